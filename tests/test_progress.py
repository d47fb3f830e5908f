"""A long command shows what it is doing as it goes (issue 55: `python -m bench --quick --model
medium` printed nothing for 8 minutes, then everything; `python -m pictures memory` nothing for 72
s): its first line arrives while the work goes on, not with the result at the end."""
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lines_as_they_arrive(argv: list[str], timeout: float = 600) -> tuple[list, float]:
    """argv run from the repository's root, stdout and stderr together: [(seconds since the
    start, line)] as each line arrived, and the seconds until it exited (status 0)."""
    began = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    arrived = [(time.perf_counter() - began, line) for line in proc.stdout]
    assert proc.wait(timeout=timeout) == 0, "".join(line for _, line in arrived)[-4000:]
    return arrived, time.perf_counter() - began


def assert_said_before_the_end(arrived: list, ended: float, prefix: str, lines: int):
    """`lines` progress lines or more, starting with `prefix`, the first one said at least a second
    before the last one (the work between them), and the last before the process ends."""
    said = [(t, line) for t, line in arrived if line.startswith(prefix)]
    assert len(said) >= lines, "".join(line for _, line in arrived)[-4000:]
    first, last = said[0][0], said[-1][0]
    assert first + 1.0 < last <= ended, [(round(t, 1), line.strip()) for t, line in said]


def test_the_bench_says_each_row_as_it_is_timed():
    """The bench, shortened as tests/test_docs.py runs it, on two strategies: a line when it
    starts and one as each row is timed, on stderr from rank 0, before its tables."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
            "bench", "--quick", "--strategies", "ddp,zero2", "--warmup", "0", "--steps", "1",
            "--repeats", "1", "--model", "tiny", "--seq-len", "64", "--json", os.devnull]
    arrived, ended = lines_as_they_arrive(argv)
    assert_said_before_the_end(arrived, ended, "bench: ", 3)
    said = [line for _, line in arrived if line.startswith("bench: ")]
    assert said[1].startswith("bench: ddp timed") and said[2].startswith("bench: zero2 timed"), said


def test_the_memory_picture_says_each_strategy_as_it_starts(tmp_path):
    """pictures memory on two of its strategies: a line as each starts, before it writes."""
    out = str(tmp_path / "memory.svg")
    argv = [sys.executable, "-m", "pictures", "memory", "--strategies", "single,zero2", "-o", out]
    arrived, ended = lines_as_they_arrive(argv)
    assert_said_before_the_end(arrived, ended, "tracing ", 2)
    assert arrived[-1][1].strip() == f"wrote {out}"
