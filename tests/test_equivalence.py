"""The equivalence tests' tolerances hold on another CPU: some of them rerun under another
ATEN_CPU_CAPABILITY than this run's (PyTorch's vector width: default, avx2, avx512).

"Equal to one process" must not depend on the CPU's vector width: a laptop's kernels round sums
in another order than the CI machine's, and Adam amplifies that (tests/equivalence.py). Every
such test is marked `equivalence` (pytest.ini); `ATEN_CPU_CAPABILITY=default python -m pytest -m
equivalence` runs them all on no vector code at all. Here, within the suite, a few of them run
again in a fresh pytest under another capability: default when this run vectorises, else the
CPU's own best.
"""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A few seconds each, one per strategy whose fp32 claim rests on a tolerance Adam amplifies,
# among them the ones a 2-core AMD EPYC with AVX-512 failed when their bound was one machine's
# measure (test_tensor_parallel's tied head, test_moe's experts beside context parallelism).
RERUN = ["test_tensor_parallel.py::test_tied_head_and_16_bit_precisions_like_one_process",
         "test_tensor_parallel.py::test_tensor_parallel_in_fp64_is_one_process_up_to_rounding",
         "test_moe.py::test_experts_beside_context_parallelism_train_as_one_process[2-1.25-flags0]",
         "test_zero.py::test_both_stages_on_two_ranks_equal_one_process",
         "test_ddp.py::test_matches_single_process[N=2]",
         "test_fsdp.py::test_plain_torch_optimizer_trains_fsdp_shards[2]",
         "test_pipeline.py::test_pipeline_equals_one_process_and_holds_what_the_schedule_says[2]"]


def _capability(env: dict) -> str:
    """The capability a fresh Python under env runs PyTorch's CPU kernels with ("AVX512", ...)."""
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          env=env, capture_output=True, text=True, check=True, timeout=120).stdout.strip()


def _another_capability() -> dict:
    """The environment of the rerun: ATEN_CPU_CAPABILITY=default if this run vectorises, else
    (this run is on default) the variable unset, for the CPU's own best."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        env["ATEN_CPU_CAPABILITY"] = "default"
    return env


def test_equivalence_tests_hold_under_another_cpu_capability():
    """RERUN, each marked `equivalence`, passes in a fresh pytest under another capability."""
    env = _another_capability()
    theirs, ours = _capability(env), torch.backends.cpu.get_cpu_capability()
    if theirs == ours:
        pytest.skip(f"this CPU has no capability besides {ours} to rerun under")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "equivalence",
                             *[f"tests/{test}" for test in RERUN]],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"under {theirs} (this run: {ours}):\n{result.stdout[-6000:]}{result.stderr[-2000:]}"
    assert f"{len(RERUN)} passed" in result.stdout, result.stdout[-2000:]
