"""running/threads.py: the CPU threads each rank of a run computes with, a share of its node's cores.

Used by: train.py, which logs the line cpu_threads returns. Test: python -m pytest
tests/test_run_log.py -k cpu_threads
"""
import os

import torch


def cpu_threads(requested: int | None, device: torch.device, offload: bool = False) -> str:
    """Set the threads each rank computes with on the CPU; return how many and why, for the log.

    The ranks of a node share its cores: a rank gets cores / local ranks (at least 1), unless
    `requested` (--threads) or OMP_NUM_THREADS says otherwise. torchrun sets OMP_NUM_THREADS=1
    itself when it starts several workers and the user set none; that one is not a choice and
    is replaced by the share. On a GPU the host only launches kernels, unless it runs the
    offloaded Adam step (offload): then it shares the cores too. "" where nothing was set.
    """
    if device.type == "cuda" and not offload:
        return ""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    omp = os.environ.get("OMP_NUM_THREADS")
    torchrun_default = "TORCHELASTIC_RUN_ID" in os.environ and omp == "1" and local_ranks > 1
    if requested:
        threads, why = requested, "--threads"
    elif omp and not torchrun_default:            # OpenMP read it at start-up: keep it
        threads, why = torch.get_num_threads(), "OMP_NUM_THREADS"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // local_ranks)
        why = f"{cores} core{'s' * (cores > 1)} / {local_ranks} rank{'s' * (local_ranks > 1)} on this node"
    torch.set_num_threads(threads)
    return f"{threads} CPU thread{'s' * (threads > 1)} per rank: {why}"
