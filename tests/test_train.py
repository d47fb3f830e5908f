"""train.py end to end: the loss falls, runs at any world size agree, bad input stops early."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--steps", "25", "--log-every", "4", "--eval-every", "0", "--seq-len", "32",
         "--batch-size", "8", "--warmup", "5"]


def run(*args, ranks=1, check=True):
    """python train.py ARGS, or torchrun with `ranks` CPU processes (torchrun picks the port)."""
    launcher = [sys.executable, "train.py"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "train.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(launcher + list(args), cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def losses(output):
    return [float(v) for v in re.findall(r"^step +\d+ \| loss ([\d.]+)", output, re.M)]


@pytest.fixture(scope="module")
def single_run():
    return run(*QUICK).stdout


def test_single_process_loss_falls(single_run):
    curve = losses(single_run)
    assert len(curve) == 7                                      # steps 0, 4, ..., 24
    assert curve[-1] < curve[0] - 1.0, curve                    # from ~5.5 (ln 256) down
    assert "eval loss" in single_run


def test_ddp_on_two_ranks_matches_single_process_line_by_line(single_run):
    output = run(*QUICK, "--strategy", "ddp", ranks=2).stdout
    # Same global batch at every step, gradients averaged over 2 ranks instead of summed in one
    # pass: only the order of additions differs, so fp32 losses agree to ~1e-5 after 25 steps.
    for step_single, step_ddp in zip(losses(single_run), losses(output), strict=True):
        assert abs(step_single - step_ddp) < 1e-3 * step_single, (losses(single_run), losses(output))
    sent = re.findall(r"sent ([\d.]+) MiB/step \(ring formula ([\d.]+)\)", output)
    assert sent and all(measured == predicted for measured, predicted in sent), sent


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_matches_ddp_step_by_step(single_run, strategy):
    output = run(*QUICK, "--strategy", strategy, ranks=2).stdout
    # Same global batch, gradients averaged by a reduce-scatter instead of an all-reduce, Adam
    # applied to each half by its owner: fp32 losses agree with one process to ~1e-5.
    for step_single, step_zero in zip(losses(single_run), losses(output), strict=True):
        assert abs(step_single - step_zero) < 1e-3 * step_single, (losses(single_run), losses(output))
    # ZeRO-1 and ZeRO-2 send what DDP sends: a reduce-scatter plus an all-gather.
    sent = re.findall(r"sent ([\d.]+) MiB/step \(ring formula ([\d.]+)\)", output)
    assert sent and all(measured == predicted for measured, predicted in sent), sent


def test_ring_collectives_grad_accum_and_bf16_run():
    output = run(*QUICK, "--strategy", "ddp", "--collectives", "ring", "--grad-accum", "2",
                 "--precision", "bf16", ranks=2).stdout
    curve = losses(output)
    assert curve[-1] < curve[0] - 1.0, curve


def test_unknown_strategy_stops_every_rank_with_the_list():
    result = run("--strategy", "zero9", ranks=2, check=False)
    assert result.returncode != 0
    # argparse's message, once per rank, names every valid choice.
    errors = [line for line in result.stderr.splitlines() if "invalid choice: 'zero9'" in line]
    assert len(errors) == 2, result.stderr
    assert all("single" in line and "ddp" in line for line in errors), errors


def test_batch_that_does_not_divide_names_the_fix():
    result = run("--strategy", "ddp", "--batch-size", "10", "--grad-accum", "2", ranks=2, check=False)
    assert result.returncode != 0
    assert result.stderr.count("use a multiple of 4, e.g. --batch-size 12") == 2, result.stderr


def test_single_strategy_under_torchrun_names_the_fix():
    result = run("--strategy", "single", ranks=2, check=False)
    assert result.returncode != 0 and "use --strategy ddp" in result.stderr


# ---- --offload optimizer: the same run, the optimizer in CPU memory -------------------------------

def _offload_runs(root):
    import shutil
    import torch.distributed as dist
    import train
    from test_snapshot import RUN
    out = {}
    for strategy in ("zero2", "fsdp"):
        argv = [*RUN, "--strategy", strategy]
        saved, resumed = os.path.join(root, strategy), os.path.join(root, strategy + "-resumed")
        out[strategy] = {
            "device": train.main(argv),
            "offload": train.main([*argv, "--offload", "optimizer", "--out", saved, "--save-every", "3"])}
        if dist.get_rank() == 0:                      # as if the run stopped after step 3
            shutil.copytree(saved, resumed, ignore=shutil.ignore_patterns("ckpt-0000006"))
        dist.barrier()
        out[strategy]["resumed"] = train.main([*argv, "--offload", "optimizer", "--out", resumed, "--resume"])
    return out


def test_offload_trains_and_resumes_exactly_as_on_the_device(tmp_path):
    """The same AdamW on the same fp32 shards, run on the CPU's copy: the same curve bit for bit,
    and its checkpoint (masters and moments read from host memory) resumes it bit for bit."""
    from multiprocess import run_ranks
    runs = run_ranks(_offload_runs, 2, str(tmp_path))[0]
    for strategy, run in runs.items():
        assert run["offload"]["losses"] == run["device"]["losses"], strategy
        assert run["resumed"]["losses"] == {s: run["offload"]["losses"][s] for s in (3, 4, 5)}, strategy


def test_offload_needs_a_sharded_optimizer():
    result = run("--strategy", "ddp", "--offload", "optimizer", ranks=2, check=False)
    assert result.returncode != 0
    assert result.stderr.count("use --strategy zero1, zero2 or fsdp") == 2, result.stderr
