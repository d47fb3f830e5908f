"""Bad input at every entry point (train.py and each `python -m` module): refused in one line on
stderr that names the flag (or file) and the real reason, exit code not 0, no traceback, nothing
written, before any work. Every case runs as a user runs it, a process of its own in an empty
directory of its own, forked from one python that has imported torch (tests/forked.py: a
process was mostly importing torch); they run side by side, then each case checks its own."""
import os

import pytest

import forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN, README = os.path.join(ROOT, "train.py"), os.path.join(ROOT, "README.md")
MEMORY, PICTURES = ["-m", "napkin.memory"], ["-m", "pictures"]
LIMIT_KB = 6_000_000                      # ulimit -v 6000000: 6 GB of address space, under
                                          # a 6 GB file's two copies

# (name, the process's arguments after python, the flag or file its line names, the words of the
# real reason in it). Files: big.txt, 1 TiB; six.txt, 6 GB, both sparse (no disk); run/log.txt,
# a log of bytes that are not UTF-8. "ulimit" cases run under LIMIT_KB.
CASES = [
    # sizes that cannot fit: refused before anything is allocated (the napkin's own measurement
    # of a block, napkin/machines.py, was what failed)
    ("batch-size 3e6", [TRAIN, "--batch-size", "3000000"], "--batch-size", "activations per rank"),
    ("batch-size 1e11", [TRAIN, "--batch-size", "99999999999"],
     "--batch-size", "up to 2,147,483,647"),
    ("experts 99999", [TRAIN, "--model", "tiny-moe", "--experts", "99999"],
     "--experts", "in fp32 alone"),
    ("data 1TiB", [TRAIN, "--data", "big.txt"], "--data big.txt", "2 copies of it"),
    ("data 6GB ulimit", [TRAIN, "--data", "six.txt"], "--data six.txt", "2 copies of it"),
    ("machines rows", ["-m", "napkin.machines", "--this", "--rows", "3000000"], "--rows 3000000",
     "give fewer --rows"),
    # numbers out of every range: the flag's name, not an OverflowError
    ("timeout 1e30", [TRAIN, "--timeout", "1e30"], "--timeout", "longer than a day"),
    ("mem-budget inf", [TRAIN, "--strategy", "auto", "--mem-budget", "infGB"], "--mem-budget",
     "not a positive size"),
    ("gpu-mem inf", [*MEMORY, "--advise", "--params", "7B", "--gpu-mem", "infGB"], "--gpu-mem",
     "not a positive size"),
    ("gpu-mem empty", [*MEMORY, "--advise", "--model", "tiny", "--gpu-mem", ""], "--gpu-mem",
     "not a positive size"),
    ("world 1e20", [*MEMORY, "--params", "7B", "--world", "99999999999999999999"], "--world",
     "up to 2,147,483,647"),
    ("tp 0", [*MEMORY, "--params", "7B", "--tp", "0"], "--tp", "from 1"),
    ("tp -2", [*MEMORY, "--params", "7B", "--tp", "-2"], "--tp", "from 1"),
    ("memory batch -4", [*MEMORY, "--model", "tiny", "--batch-size", "-4"],
     "--batch-size", "from 1"),
    ("target-batch -1", [*MEMORY, "--advise", "--model", "tiny", "--target-batch", "-1"],
     "--target-batch", "from 1"),
    ("target-batch 0", [*MEMORY, "--advise", "--model", "tiny", "--target-batch", "0"],
     "--target-batch", "from 1"),
    ("advise seq-len 0", [*MEMORY, "--advise", "--model", "tiny", "--seq-len", "0"], "--seq-len",
     "from 1"),
    ("step_time world", ["-m", "napkin.step_time", "--world", "99999999999999999999"], "--world",
     "up to 2,147,483,647"),
    ("temperature inf", [TRAIN, "--sample", "--init-from", README, "--temperature", "inf"],
     "--temperature", "up to 10"),
    ("temperature 1e30", [TRAIN, "--sample", "--init-from", README, "--temperature", "1e30"],
     "--temperature", "up to 10"),
    # values that start with a dash: parsed, then refused for what they are
    ("lr -inf", [TRAIN, "--lr", "-inf"], "--lr", "must be a positive number"),
    ("mem-budget -1GB", [TRAIN, "--strategy", "auto", "--mem-budget", "-1GB"], "--mem-budget",
     "not a positive size"),
    ("tflops -inf", ["-m", "napkin.step_time", "--tflops", "-inf"],
     "--tflops", "a positive number"),
    # stray flags, nonsense the bench and the pictures took
    ("lora-rank alone", [TRAIN, "--lora-rank", "4"], "--lora-rank", "add --lora"),
    ("bench max-mb nan", ["-m", "bench", "--quick", "--max-mb", "nan"],
     "--max-mb", "positive, finite"),
    ("bench max-mb -1", ["-m", "bench", "--quick", "--max-mb", "-1"],
     "--max-mb", "positive, finite"),
    ("bench bucket-mb 0", ["-m", "bench", "--quick", "--bucket-mb", "0"],
     "--bucket-mb", "positive"),
    ("bench threads 0", ["-m", "bench", "--quick", "--threads", "0"], "--threads", "from 1"),
    ("bench clip-grad nan", ["-m", "bench", "--quick", "--clip-grad", "nan"],
     "--clip-grad", "finite"),
    ("bench scaling empty", ["-m", "bench", "--scaling", ""], "--scaling", "not a comma list"),
    ("bench bogus", ["-m", "bench", "--bogus"], "--bogus", "unrecognized"),
    ("bench.gpu budget nan", ["-m", "bench.gpu", "--budget-s", "nan"], "--budget-s", "positive"),
    ("pictures ranks 0", [*PICTURES, "memory", "--ranks", "0", "-o", "m.svg"], "--ranks", "from 1"),
    ("pictures ranks -1", [*PICTURES, "memory", "--ranks", "-1", "-o", "m.svg"],
     "--ranks", "from 1"),
    ("pictures bucket nan", [*PICTURES, "memory", "--bucket-mb", "nan", "-o", "m.svg"],
     "--bucket-mb", "positive, finite"),
    ("pictures microbatches 0", [*PICTURES, "schedule", "--microbatches", "0", "-o", "s.svg"],
     "--microbatches", "from 1"),
    ("pictures loss not utf-8", [*PICTURES, "loss", "run", "-o", "l.svg"], "run/log.txt",
     "no 'step N | loss X' line"),
    ("schedules bogus", ["-m", "extensions.schedules", "--bogus"], "--bogus", "unrecognized"),
    ("schedules stages 1e11", ["-m", "extensions.schedules", "--stages", "99999999999"], "--stages",
     "up to 2,147,483,647"),
]


def _files(directory: str) -> dict:
    """{path: (size, mtime)} of everything under directory."""
    found = {}
    for where, _, names in os.walk(directory):
        for name in [*names, "."]:
            path = os.path.join(where, name)
            stat = os.stat(path)
            found[os.path.relpath(path, directory)] = (stat.st_size, stat.st_mtime_ns)
    return found


def _prepare(directory: str) -> dict:
    """The case's files in its directory; returns _files' picture of it, before the case runs."""
    with open(os.path.join(directory, "big.txt"), "wb") as f:
        f.truncate(2**40)
    with open(os.path.join(directory, "six.txt"), "wb") as f:
        f.truncate(6 * 10**9)
    os.makedirs(os.path.join(directory, "run"))
    with open(os.path.join(directory, "run", "log.txt"), "wb") as f:
        f.write(b"\xff\xfe step \xff | loss\n")
    return _files(directory)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict:
    """{case name: (exit code, stderr, the files before, after)} of the cases selected (-k), each
    a process of its own in a directory of its own, forked by tests/forked.py from one python
    that has imported torch (the import was most of each refusal's time)."""
    chosen = {item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    cases = [(name, argv) for name, argv, _, _ in CASES if name in chosen]
    directories = [str(tmp_path_factory.mktemp("case")) for _ in cases]
    before = [_prepare(directory) for directory in directories]
    launcher = ("TORCHELASTIC", "LOCAL_", "RANK", "WORLD_SIZE", "MASTER_")   # torchrun's, if any
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    ran = forked.run([[argv, directory, LIMIT_KB * 1024 if "ulimit" in name else 0]
                      for (name, argv), directory in zip(cases, directories)],
                     env, tmp_path_factory.mktemp("logs"))
    return {name: (code, stderr if code is not None else f"still running after {forked.TIMEOUT} s",
                   before[i], _files(directories[i]))                    # None: it went to work
            for i, ((name, _), (code, _, stderr)) in enumerate(zip(cases, ran))}


@pytest.mark.parametrize("name, argv, flag, says", CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_naming_the_flag_and_nothing_is_written(results, name, argv, flag,
                                                                       says):
    code, stderr, before, after = results[name]
    lines = stderr.splitlines()
    assert code != 0 and "Traceback" not in stderr, stderr
    assert len(lines) == 1 and flag in lines[0] and says in lines[0], stderr
    assert "expected one argument" not in stderr and "invalid <lambda>" not in stderr, stderr
    assert after == before, sorted(set(after.items()) ^ set(before.items()))


def test_a_value_with_a_dash_is_the_flags_and_a_missing_one_is_still_missing(capsys):
    """foundations.values.Parser joins "-inf" or "-1GB" to the flag before it, as --lr=-inf, and
    only those: a flag after a flag still lacks its value, and "--" still ends the options."""
    from foundations.values import Parser, real, size
    p = Parser(prog="p")
    p.add_argument("--lr", type=float)
    p.add_argument("--mem", type=size)
    p.add_argument("--steps", type=int)
    p.add_argument("rest", nargs="*")
    args = p.parse_args(["--lr", "-inf", "--steps", "-3", "--", "-x"])
    assert (args.lr, args.steps, args.rest) == (float("-inf"), -3, ["-x"])
    with pytest.raises(SystemExit) as stop:
        p.parse_args(["--mem", "-1GB"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("p: error: argument --mem: memory '-1GB' is not a positive "
                                       "size up to a petabyte: write it like 24GB, 80GB, 512MiB "
                                       "(see --help)\n")
    with pytest.raises(SystemExit):
        p.parse_args(["--lr", "--steps", "3"])
    said = capsys.readouterr().err
    assert said == "p: error: argument --lr: expected one argument (see --help)\n", said
    assert real(0, 1)("0.5") == 0.5
    for text in ("nan", "inf", "-0.1", "1.5", "x"):
        with pytest.raises(ValueError):
            real(0, 1)(text)
