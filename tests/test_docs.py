"""What a new user reads: the README's first screen, its links, and the measured pages' tables,
which must be what the bench's JSON says (docs/generate.py writes them); and every command the
README and docs/*.md show, run in their order in a fresh copy of the repository, shortened by the
programs' own flags (marked docs_commands: a few minutes; `-m "not docs_commands"` leaves them out)."""
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import threading
import sys

import pytest

from pictures import draw as pictures
from test_pretrained import llama_files, random_tensors, small_spec, write_directory

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


# ---- every command the pages show, run as a reader would: in order, in a fresh copy ----------

PAGES = ["README.md"] + [f"docs/{page.name}" for page in sorted((ROOT / "docs").glob("*.md"))]
PROGRAM = re.compile(r"(sh install\.sh|\.venv/bin/\w+ |python |torchrun )")    # what starts a command
ACTIVATE = ". .venv/bin/activate"        # the README's line after its first screen


def shown_commands(text: str) -> list[str]:
    """Every command a page shows, in its order: the lines of its code blocks (indented or
    fenced) that start a program, `\\` continuations joined, and the code spans of its prose and
    table cells that do (a span may wrap across lines)."""
    commands, paragraph, fenced, in_block = [], [], False, False

    def spans_of_paragraph():
        for span in re.findall(r"`([^`]+)`", " ".join(paragraph)):
            if PROGRAM.match(" ".join(span.split())):
                commands.append(" ".join(span.split()))
        paragraph.clear()

    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("```"):
            spans_of_paragraph()
            fenced = not fenced
            continue
        in_block = fenced or (line.startswith("    ") and (in_block or not paragraph))
        if in_block:
            command = line.strip()
            while command.endswith("\\"):
                command = command[:-1].rstrip() + " " + next(lines).strip()
            if PROGRAM.match(command):
                commands.append(command)
        elif line.strip():
            paragraph.append(line)
        else:
            spans_of_paragraph()
    spans_of_paragraph()
    return commands


SHOWN = {page: shown_commands((ROOT / page).read_text()) for page in PAGES}
SUITE = "the test suite, which holds this test: CI runs it (.ci/run runs the first screen's line)"
GPU = "gpt2-small at 32 to 64 sequences of 1024 a step: about 20 GB a rank, minutes a step on a CPU"
NODES = "nodes joined at HOST_OF_NODE_0, a machine's address to fill in (and gpt2-small: GPUs)"
ALONE = "tests/test_alone.py runs it as written, and holds it to its check against one process"
# The reading table's last column: the command that runs each concept file alone.
ALONE_COMMANDS = re.findall(r"^\| \d+ \| `\w+\.py` \|.*\| `([^`]+)` \|$", README, re.M)
# Shown but not run here, each with why; the test below fails when a page shows a command that is
# neither run nor named here, and when one named here is no longer shown.
NOT_RUN_HERE = {
    "sh install.sh && .venv/bin/python -m pytest -q": SUITE,
    ".venv/bin/python -m pytest -m quick": SUITE,
    ".venv/bin/python -m pytest -m quick                # one test per concept file: 17 tests, 73 s": SUITE,
    ".venv/bin/python -m pytest -q -m \"not eight_ranks\" # without the 8-rank meshes": SUITE,
    ".venv/bin/python -m pytest -q -m \"not docs_commands\" # without running the pages' commands": SUITE,
    "torchrun --nnodes 2 --nproc_per_node 8 ... train.py --strategy fsdp --shard-group 8":
        "a form: ... stands for the rendezvous flags of docs/running.md's two-node commands",
    "python train.py --model gpt2-small --precision bf16 --batch-size 32 --seq-len 1024": GPU,
    "torchrun --nproc_per_node 8 train.py --strategy zero2 --model gpt2-small --precision bf16 "
    "--batch-size 64 --seq-len 1024": GPU,
    "torchrun --nproc_per_node 8 train.py --strategy tp --tp 4 --sequence-parallel --model gpt2-small "
    "--precision bf16 --batch-size 64 --seq-len 1024          # 2 data-parallel groups of 4": GPU,
    "torchrun --nproc_per_node 8 train.py --tp 2 --pp 2 --model gpt2-small --precision bf16 "
    "--batch-size 64 --seq-len 1024                  # tp 2 x pp 2 x dp 2": GPU,
    "torchrun --nnodes 4 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST_OF_NODE_0:29500 "
    "--rdzv-id my-run train.py --tp 4 --cp 2 --pp 2 --model gpt2-small --precision bf16 "
    "--batch-size 64 --seq-len 1024                  # tp 4 x cp 2 x pp 2 x dp 2": NODES,
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST_OF_NODE_0:29500 "
    "--rdzv-id my-run train.py --strategy ddp --model gpt2-small --precision bf16 --batch-size 128 "
    "--seq-len 1024": NODES,
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST_OF_NODE_0:29500 "
    "--rdzv-id my-run train.py --strategy fsdp --shard-group 8 --model gpt2-small --precision bf16 "
    "--batch-size 128 --seq-len 1024": NODES,
    "python train.py --sample --init-from DIR_OR_FILE": "a form: DIR_OR_FILE is the reader's run or file",
    "torchrun --max-restarts R ... --resume auto": "a form: R and ... are the reader's",
    "torchrun --max-restarts": "a flag's name, not a command",
    "torchrun --nproc_per_node N -m exercises check NAME": "a form: N and NAME are the reader's",
    "torchrun --nproc_per_node 2 train.py --strategy fsdp --init-from hf:Llama-3.1-70B --lora "
    "--quantize-base nf4 --precision bf16 --checkpoint-activations --batch-size 2 --seq-len 512 "
    "--data argparse_help.txt --out runs/qlora70b": "a 70B's weights on two GPUs (the napkin's "
                                                    "line before it runs, from its config)",
    "torchrun --standalone --nproc_per_node 1": "the launcher's half of the runs in the table below it",
    **{command: ALONE for command in ALONE_COMMANDS},
}


MAKES_FILES = re.compile(r" (>|-o|--out|--export|--json) ")


def uncommented(command: str) -> str:
    return re.sub(r"\s+# .*", "", command)


def to_run(page: str) -> list[str]:
    """The page's commands this test runs, in order, none of NOT_RUN_HERE: a command shown again
    (here or on an earlier page, its comment aside) runs once, unless it makes a file, which the
    page's later commands may read."""
    commands = [uncommented(c) for before in PAGES[:PAGES.index(page) + 1] for c in SHOWN[before]]
    first_of_this_page = len(commands) - len(SHOWN[page])
    return [shown for i, (shown, command) in enumerate(zip(SHOWN[page], commands[first_of_this_page:]),
                                                        first_of_this_page)
            if shown not in NOT_RUN_HERE and (MAKES_FILES.search(command) or command not in commands[:i])]


TRAIN_STEPS_RUN_AS_WRITTEN = 24      # a train.py command giving at most this many steps runs whole


def shortened(command: str) -> str:
    """The command as this test runs it: the program's own flags appended (argparse keeps the last
    of a repeated flag), before a trailing comment, so that the work takes seconds while the
    command line and the code paths stay the same:
      train.py    --steps 2, where it would run more than 24 steps (the default is 300);
      bench/compare.py    one timed step, no warm-up, one repeat of each side, on the tiny GPT at 64 tokens,
                  all-reduces up to 1 MiB; --scaling at worlds 1 and 2, ddp only (--report: as is);
      pictures/draw.py memory: one panel, zero2, of the five;
      bench/gpu.py  the tiny GPT at 64 tokens, one timed step a side, a given peak (no GPU here);
    everything else as written."""
    command, comment = re.match(r"(.*?)(\s+# .*)?$", command).groups()
    steps = re.findall(r"--steps (\d+)", command)
    if re.search(r"\btrain\.py\b", command) and not (steps and int(steps[-1]) <= TRAIN_STEPS_RUN_AS_WRITTEN):
        command += " --steps 2"
    elif re.search(r"-m bench(\s|$)", command) and "--report" not in command:
        command += " --warmup 0 --steps 1 --repeats 1 --model tiny --seq-len 64 --max-mb 1"
        command += " --scaling 1,2 --strategies ddp" if "--scaling" in command else ""
    elif "-m pictures memory" in command:
        command += " --strategies zero2"
    elif re.search(r"-m bench\.gpu\b", command):
        command += " --model tiny --seq-len 64 --warmup 0 --steps 1 --peak-tflops 1"
    return command + (comment or "")


def fresh_copy(where: pathlib.Path, cache: pathlib.Path) -> pathlib.Path:
    """The working tree's tracked files as they are now (edits included, no runs/ or outputs),
    with the README's .venv linked in, as a new clone after `sh install.sh` holds, and `cache` as
    its .cache/ (napkin/machines.py's measurements of this machine, kept as one clone keeps them)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    for name in filter(None, tracked.stdout.decode().split("\0")):
        if (ROOT / name).is_file():                  # a tracked file deleted in the tree is gone
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, where / name)
    (where / ".venv").symlink_to((ROOT / ".venv").resolve())
    (where / ".cache").symlink_to(cache, target_is_directory=True)
    stand_ins(where)
    return where


# The pretrained models docs/pretrained.md names, which a reader downloads: in the copy,
# SmolLM2-135M is SmolLM2's width and heads in 2 blocks (7M parameters, random weights under its
# tensor names, a small tokenizer of its style), and Llama-3.1-70B its published config.json
# alone, all the napkin reads.
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
             "rms_norm_eps": 1e-05, "hidden_act": "silu", "rope_theta": 500000.0,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
             "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 128000,
             "eos_token_id": 128001}


def stand_ins(where: pathlib.Path):
    spec = small_spec("gpt2")
    C, F, H, G, L, V = 576, 1536, 9, 3, 2, len(spec["model"]["vocab"]) + 1
    config, _ = llama_files(V, "smollm2")
    config |= {"hidden_size": C, "intermediate_size": F, "num_attention_heads": H,
               "num_key_value_heads": G, "num_hidden_layers": L}
    D, shapes = C // H, {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    for i in range(L):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in {
            "input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
            "self_attn.q_proj.weight": (H * D, C), "self_attn.k_proj.weight": (G * D, C),
            "self_attn.v_proj.weight": (G * D, C), "self_attn.o_proj.weight": (C, H * D),
            "mlp.gate_proj.weight": (F, C), "mlp.up_proj.weight": (F, C),
            "mlp.down_proj.weight": (C, F)}.items()}
    write_directory(where / "SmolLM2-135M", config, random_tensors(shapes, 3), spec)
    (where / "Llama-3.1-70B").mkdir()
    (where / "Llama-3.1-70B" / "config.json").write_text(json.dumps(LLAMA_70B))


def run_as_written(command: str, cwd: pathlib.Path, timeout: float = 300) -> tuple[int, str]:
    """`. .venv/bin/activate && COMMAND` in bash: exit status and output. A command still running
    after `timeout` seconds is killed with every process it started (torchrun's ranks). Its
    torchrun, if any, takes a free port (PET_MASTER_PORT: its --master-port's default), not
    29500: two pages' commands run side by side."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PET_MASTER_PORT"] = str(free_port())
    proc = subprocess.Popen(["bash", "-c", f"{ACTIVATE} && {command}"], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)          # torchrun passes it on to its ranks' sessions
        try:
            output = proc.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate()[0]
        return -1, output + f"\n... stopped after {timeout} s"
    return proc.returncode, output


def free_port() -> int:
    """A TCP port no process listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def polyline_steps(svg: str) -> list[list[str]]:
    """The x coordinates of each line a picture draws: its steps, whatever the losses."""
    return [[point.split(",")[0] for point in points.split()]
            for points in re.findall(r'<polyline points="([^"]+)"', svg)]


def loss_picture_has_the_committed_steps(copy: pathlib.Path):
    """The README's loss picture, made by its commands, logs the committed picture's steps (the
    losses themselves depend on the Python installation's text and the CPU)."""
    made = polyline_steps((copy / "loss_fsdp_vs_single.svg").read_text())
    committed = polyline_steps((ROOT / "docs" / "loss_fsdp_vs_single.svg").read_text())
    assert made == committed and len(made) == 2, f"the lines' steps (x) {made}, committed {committed}"


# After a command, what it made is checked too.
AFTER = {"python -m pictures loss runs/single runs/fsdp -o loss_fsdp_vs_single.svg   # any runs' --out":
         loss_picture_has_the_committed_steps}


def run_page(page: str, copy: pathlib.Path):
    """The page's commands (to_run), in order, in copy, each command's AFTER check as it ends;
    the first that fails stops the page (the commands after it may read what it makes)."""
    for command in to_run(page):
        status, output = run_as_written(shortened(command), copy)
        assert status == 0, f"{page}: `{shortened(command)}` exited {status}:\n{output[-6000:]}"
        if command in AFTER:
            AFTER[command](copy)


@pytest.fixture(scope="module")
def pages_run(request, tmp_path_factory) -> dict:
    """{page: None, or what run_page raised} for the pages selected (-k), two pages at a time,
    each in a fresh copy of its own: a page's commands wait on each other (a command spends
    much of its time importing torch, on one core), two pages' need not. The copies share one
    .cache/ (napkin/machines.py's measurements of this machine, kept as one clone keeps them)."""
    chosen = [item.callspec.params["page"] for item in request.session.items
              if item.module is request.module and item.originalname == PAGE_TEST]
    cache = tmp_path_factory.mktemp("cache")
    copies = {page: fresh_copy(tmp_path_factory.mktemp("copy"), cache) for page in chosen}
    failures, waiting, lock = {}, list(chosen), threading.Lock()

    def worker():
        while True:
            with lock:
                if not waiting:
                    return
                page = waiting.pop(0)
            try:
                failures[page] = run_page(page, copies[page])
            except BaseException as failed:           # raised again by the page's test
                failures[page] = failed
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(2)]   # Ctrl-C: no wait
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


PAGE_TEST = "test_every_command_a_page_shows_runs_as_written_in_a_fresh_copy"


@pytest.mark.docs_commands
@pytest.mark.parametrize("page", PAGES)
def test_every_command_a_page_shows_runs_as_written_in_a_fresh_copy(page, pages_run):
    """Each command the page shows, in the page's order, in a fresh copy of the repository with
    the README's environment activated, exactly as written but for `shortened`'s flags: a page's
    commands make the files its later commands read (base.pt, runs/...), or the copy holds them.
    The pages run side by side (pages_run); what failed in this page's run fails here."""
    if pages_run[page] is not None:
        raise pages_run[page]


def test_the_readme_commands_write_no_tracked_file():
    """Issue 55: the README's picture commands wrote over docs/'s committed pictures, and `git
    status` then showed them modified. What a command writes (-o, --out, --export, --json, >) is
    no file git tracks, nor a directory holding one."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    tracked = set(filter(None, tracked.stdout.decode().split("\0")))
    for command in SHOWN["README.md"]:
        for target in re.findall(r" (?:>|-o|--out|--export|--json) (\S+)", uncommented(command)):
            target = os.path.normpath(target)
            assert not any(t == target or t.startswith(target + "/") for t in tracked), command


def test_the_readmes_fine_tunes_learn_the_new_text_and_keep_their_adapter():
    """Issue 55: the QLoRA recipe had no --data (it fine-tuned on the base's own text) and the
    LoRA one no --out (the adapter went with the process). Each README command that fine-tunes
    a base trains on the text made for it and keeps its checkpoints in a run directory."""
    tunes = [c for c in SHOWN["README.md"] if "--init-from base.pt" in c and "--lora" in c]
    assert len(tunes) == 2, tunes
    for command in tunes:
        assert "--data argparse_help.txt" in command and re.search(r"--out runs/\w+", command), command


def test_the_readme_activates_its_environment_after_the_first_screen_and_each_page_says_so():
    lines = README.splitlines()
    activate = lines.index("    " + ACTIVATE)
    bare = [i for i, line in enumerate(lines) if re.search(r"(^|[ `])(python|torchrun) ", line)]
    assert 20 < activate < bare[0], (activate, lines[bare[0]])
    for page in PAGES[1:]:
        assert f"`{ACTIVATE}`" in " ".join((ROOT / page).read_text().splitlines()[:5]), page


def test_commands_not_run_here_are_shown_and_nothing_else_is_left_out():
    """NOT_RUN_HERE names only commands a page shows; every other one runs (to_run)."""
    shown = {command for page in PAGES for command in SHOWN[page]}
    assert set(NOT_RUN_HERE) <= shown, set(NOT_RUN_HERE) - shown
    assert set(AFTER) <= shown, set(AFTER) - shown
    ran = {uncommented(command) for page in PAGES for command in to_run(page)}
    assert {command for command in shown if uncommented(command) not in ran} == set(NOT_RUN_HERE)


# Each program's run with its defaults (its required arguments only; pictures/draw.py's schedule
# spelled out, its defaults), and each example: the commands above run them, the pages show them.
DEFAULT_RUNS = ["python train.py", "torchrun --nproc_per_node 2 -m bench --quick",
                "python -m napkin.memory --model gpt2-small --world 8", "python -m napkin.step_time",
                "python -m pictures memory -o memory_over_a_step.svg",
                "python -m pictures schedule --schedule 1f1b --stages 2 --microbatches 4 -o "
                "pipeline_executed.svg", "python -m extensions.schedules", "python -m napkin.machines",
                *[f"torchrun --nproc_per_node 2 examples/{example.name}"
                  for example in sorted((ROOT / "examples").glob("*.py"))]]


def test_each_program_with_its_defaults_and_each_example_is_a_command_run_above():
    ran = {uncommented(command) for page in PAGES for command in to_run(page)}
    assert set(DEFAULT_RUNS) <= ran, set(DEFAULT_RUNS) - ran
    shown = DEFAULT_RUNS[5].split()[3:]                # after "python -m pictures"
    assert pictures.parse_args(shown)[0] == pictures.parse_args(["schedule", "-o", shown[-1]])[0]
