"""What a new user reads: the README's first screen, its links, and the measured pages' tables,
which must be what the bench's JSON says (docs/generate.py writes them)."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_first_screen_is_two_commands_that_set_themselves_up():
    first_screen = README.splitlines()[:20]
    commands = [line.strip() for line in first_screen if line.startswith("    ")]
    assert len(commands) == 2, commands
    train, test = commands
    for command in commands:                       # each makes its own venv and installs torch
        assert command.startswith("sh install.sh && .venv/bin/"), command
    assert "train.py" in train and "-m pytest -q" in test
    # .ci/run finds and runs exactly this line: CI is the README's command.
    ci = (ROOT / ".ci" / "run").read_text()
    pattern = re.search(r"grep -m1 -E '(.*)' README.md", ci).group(1)
    assert [line for line in README.splitlines() if re.match(pattern, line)][0].strip() == test


def test_install_pins_the_tested_torch_and_the_cpu_build_without_a_gpu():
    requirements = (ROOT / "requirements.txt").read_text()
    install = (ROOT / "install.sh").read_text()
    assert re.search(r"^torch==2\.13\.0$", requirements, re.M), requirements
    assert "torch==2.13.0 --no-deps --index-url https://download.pytorch.org/whl/cpu" in install
    assert subprocess.run(["sh", "-n", str(ROOT / "install.sh")]).returncode == 0   # it parses


def test_the_readme_stays_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 300
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_measured_tables_are_what_their_json_says():
    sys.path.insert(0, str(ROOT / "docs"))
    import generate
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        assert generate.regenerate(text) == text, \
            f"docs/{page.name} differs from its JSON: run python docs/generate.py"
    assert generate.BLOCK.search((ROOT / "docs" / "measured.md").read_text())


def test_every_python_program_the_readme_shows_is_an_example_that_a_test_runs():
    examples = "".join(p.read_text() for p in (ROOT / "examples").glob("*.py"))
    for block in re.findall(r"```python\n(.*?)```", README, re.S):
        assert block.strip() in examples, "a README program not in examples/: " + block[:80]
    assert "examples/loop.py" in README
