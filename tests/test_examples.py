"""Every program the README shows lives in examples/ and runs as the README says, with torchrun on
2 CPU processes, from a clean environment: the library found by the example itself."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(example: str, ranks: int = 2) -> str:
    """`torchrun --nproc_per_node RANKS examples/EXAMPLE` from the repository's root, as the README
    runs it (--standalone: torchrun picks a free port); what rank 0 printed."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={ranks}", os.path.join("examples", example)],
                            cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_loop_trains_one_model_the_same_under_ddp_zero2_and_fsdp():
    """The README's own training loop: DDP with torch's AdamW, ZeRO-2, FSDP with torch's AdamW and
    FSDPOptimizer in bf16 train the same model on the same batches to about the same loss."""
    output = torchrun("loop.py")
    found = dict((name, (float(first), float(last))) for name, first, last in re.findall(
        r"^(ddp|zero2|fsdp|fsdp bf16) +loss ([\d.]+) -> ([\d.]+)$", output, re.M))
    assert found.keys() == {"ddp", "zero2", "fsdp", "fsdp bf16"}, output
    (first, ddp), zero2, fsdp, bf16 = found["ddp"], found["zero2"][1], found["fsdp"][1], found["fsdp bf16"][1]
    # fp32: the same averaged gradients, clipped by the same global norm: the sums' order only,
    # below the 4 printed decimals (measured: all three equal). bf16 rounds (measured 2.4e-3 apart).
    assert abs(zero2 - ddp) <= 1.5e-4 and abs(fsdp - ddp) <= 1.5e-4, output
    assert abs(bf16 - ddp) <= 0.01, output
    assert ddp < first - 2.0, output                 # from ln 256 = 5.5 to about 2.5 in 20 steps


def test_loop_without_torchrun_says_how_to_run_it():
    """`python examples/loop.py` has no ranks to join: one line naming torchrun, before torch is
    imported (no traceback from init_process_group's missing RANK)."""
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "PYTHONPATH")}
    result = subprocess.run([sys.executable, os.path.join("examples", "loop.py")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr == ("examples/loop.py trains on several processes: run it with torchrun "
                             "--nproc_per_node 2 examples/loop.py\n"), result.stderr


def test_every_example_is_run_by_a_test_here():
    """examples/ holds what the README's own-loop section shows; a file added there is run here."""
    run_here = set(re.findall(r'torchrun\("(\w+\.py)"', open(__file__).read()))
    assert run_here == {name for name in os.listdir(os.path.join(ROOT, "examples")) if name.endswith(".py")}
