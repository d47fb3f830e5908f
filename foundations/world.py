"""The world: join the job torchrun started (or become a world of one), and leave it.

torchrun starts one process per rank and tells each its place in environment variables.
init_distributed reads them, picks this rank's device and makes the world's process group:
NCCL with CUDA, else gloo. Without torchrun the world is one process, so every code path is the
same. Before it does, the launch is checked: one GPU per process, NCCL's error handling chosen so
that a lost peer is said in one line. exit_distributed leaves at the end of a script. The groups
and meshes made inside the world: foundations/process_groups.py.
Test: python -m pytest tests/test_process_groups.py tests/test_train.py
"""
import datetime
import os
import re
import sys

import torch
import torch.distributed as dist


class LaunchError(Exception):
    """The processes were started in a way this machine cannot run (more ranks than GPUs, two
    ranks on one GPU): said in one line with the fix, without a traceback."""


# NCCL's watchdog, on a collective past the timeout or a lost peer, aborts the communicators and
# by default (3: SkipCleanUp) the process too, by SIGABRT: no Python line runs. CleanUpOnly (2)
# aborts the communicators only, so the waiting call raises and train.py says which rank lost
# contact and where --resume continues. NCCL reads the variable when the process group is made.
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def choose_nccl_error_handling(environ=os.environ) -> str:
    """Set NCCL_ERROR_HANDLING to CleanUpOnly (2) unless the user chose a value; return it.

    torchrun's agent puts the variable into every worker's environment itself, set to 1
    (TearDown: SIGABRT), whenever the user set none: under torchrun a 1 is torchrun's default,
    not a choice, and is replaced, as running/threads.py's cpu_threads replaces torchrun's
    OMP_NUM_THREADS=1. (A user who wants TearDown under torchrun sets 3, which also tears the
    process down.)"""
    value = environ.get(NCCL_ERROR_HANDLING)
    if value is None or (value == "1" and "TORCHELASTIC_RUN_ID" in environ):
        environ[NCCL_ERROR_HANDLING] = value = "2"
    return value


def cuda_index(local_rank: int, local_world: int, visible: int) -> int:
    """Which of the visible GPUs this process computes on.

    torchrun on a node with a GPU per process: GPU LOCAL_RANK. A launcher that shows each process
    one GPU of its own (SLURM's --gpus-per-task=1, some Kubernetes operators): GPU 0, the only one
    it sees (ranks sharing one GPU are caught by shared_gpu). More processes than GPUs, each seeing
    them all: refused, as NCCL cannot put two ranks of one communicator on one GPU."""
    if visible == 1:
        return 0
    if max(local_world, local_rank + 1) > visible:     # every local rank refuses alike
        processes = max(local_world, local_rank + 1)
        raise LaunchError(f"{processes} processes on this node but {visible} "
                          f"GPUs: start one process per GPU (torchrun --nproc_per_node {visible}), "
                          f"or a launcher that gives each process its own GPU")
    return local_rank


def shared_gpu(uuids: list[str]) -> str | None:
    """The refusal when two local ranks see the same GPU, else None.

    uuids: each local rank's GPU."""
    for i, uuid in enumerate(uuids):
        if uuid in uuids[:i]:
            return (f"local ranks {uuids.index(uuid)} and {i} both see one GPU ({uuid}): this node "
                    f"shows each process a single GPU, the same one; start one process per GPU "
                    f"(torchrun --nproc_per_node {len(set(uuids))})")
    return None


def _check_one_gpu_each(store, device: torch.device):
    """With one visible GPU per process and several processes on the node, every local rank
    publishes its GPU's uuid in the job's store and reads its neighbours': all refuse alike."""
    node = os.environ.get("GROUP_RANK", "0")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.device_count() > 1 or local_world == 1:
        return
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    store.set(f"gpu/{node}/{os.environ.get('LOCAL_RANK', '0')}", uuid)
    why = shared_gpu([store.get(f"gpu/{node}/{i}").decode() for i in range(local_world)])
    if why:
        raise LaunchError(why)


def init_distributed(timeout: float | None = None) -> torch.device:
    """Join the job torchrun started, or become a world of one; return this rank's device.

    torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, on one node
    or many (--nnodes, --rdzv-endpoint). Plain `python train.py` gets a process group of
    size 1 held in memory, so every code path, collectives included, is the same.
    timeout (seconds): how long a collective waits for a rank that died or hangs before it
    raises, instead of blocking forever (None: torch's default, 10 minutes).
    """
    if torch.cuda.is_available():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        device = torch.device("cuda", cuda_index(int(os.environ.get("LOCAL_RANK", 0)), local_world,
                                                 torch.cuda.device_count()))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        choose_nccl_error_handling()
        wait = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
        if "RANK" in os.environ:
            store, rank, world_size = next(dist.rendezvous("env://", **wait))
            # torchrun --max-restarts keeps one store for every attempt: a restarted worker
            # could read the address a dead worker left there and wait on it. Each attempt
            # gets its own keys.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"attempt{attempt}/", store)
            if device.type == "cuda":
                _check_one_gpu_each(store, device)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    device_id=device if device.type == "cuda" else None, **wait)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **wait)
    return device


TORCHRUN_INTEGERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


def launched_world_size() -> int:
    """The world size torchrun started this process in (1 without torchrun), read from the
    variables torchrun sets; a ValueError naming the variable and the fix where they are not
    torchrun's (set by hand, or left over in a shell): init_distributed would join a world of
    one while the checks planned for WORLD_SIZE ranks, or wait for ranks that never come."""
    env = os.environ
    for name in TORCHRUN_INTEGERS:
        if name in env and not re.fullmatch(r"[0-9]+", env[name]):
            raise ValueError(f"{name}={env[name]!r} is not a whole number: torchrun sets it "
                             f"for each process it starts; launch with torchrun, or unset {name}")
    world = int(env.get("WORLD_SIZE", 1))
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world}: a job has 1 rank or more; launch with torchrun, or "
                         f"unset WORLD_SIZE")
    if "RANK" not in env:
        if world != 1:
            raise ValueError(f"WORLD_SIZE={world} is set but RANK is not: torchrun sets both (with "
                             f"MASTER_ADDR and MASTER_PORT) for each of its processes; launch with "
                             f"torchrun --nproc_per_node {world} train.py, or unset WORLD_SIZE")
        return 1
    missing = [name for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise ValueError(f"RANK is set but not {', '.join(missing)}: torchrun sets them all for "
                         f"each of its processes; launch with torchrun, or unset RANK")
    if not 0 <= int(env["RANK"]) < world:
        raise ValueError(f"RANK={env['RANK']} is not a rank of WORLD_SIZE={world} "
                         f"(0 to {world - 1}): launch with torchrun, which numbers its processes")
    return world


def exit_distributed(code: int = 0, peer_lost: bool = False):
    """Leave the job: destroy the process group, flush, and end the process at once.

    gloo's worker threads can still be dropping the last collective's tensors, which needs
    the GIL; if the interpreter is already finalizing, that aborts the process (SIGABRT
    after a finished run, seen about once in ten 2-rank runs on a loaded CPU). A script's
    last line calls this, after every file is written and closed, so finalizing is skipped.
    The same holds after a peer died mid-collective (peer_lost), with the group then left
    as it is: its failed work is what the worker threads still hold.
    """
    if dist.is_initialized() and not peer_lost:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
