"""Process groups (foundations/process_groups.py): picklable objects gathered over the ranks arrive whole;
the N-D mesh cuts the world once per dimension, its groups crossing at one rank, created by
every rank in one order.

A rank that stalls stops the others within the run's --timeout, on every group. Joining the job
(foundations/world.py) runs in every spawned test; its GPU launch checks are at the end. The
groups every rank creates and the 2-D meshes are checked in tests/test_pipeline.py and
tests/test_tensor_parallel.py, and the same-model check at start-up in tests/test_snapshot.py.
"""
import itertools
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from foundations.comm import Comm
from multiprocess import run_ranks
from foundations.process_groups import DIMENSIONS, gather_objects, make_device_mesh, mesh_rank_lists, mesh_shape


def _gathered_objects():
    comm = Comm()
    r = comm.rank
    mine = {"rank": r, "text": "x" * (1000 * r + 1), "tensor": torch.arange(3 * r + 1.0)}  # sizes differ
    return gather_objects(mine, comm, torch.device("cpu")), gather_objects(mine, comm, torch.device("cpu"), dst=1)


@pytest.mark.parametrize("world_size", [3])
def test_gather_objects_without_numpy(world_size):
    """Python objects of different sizes (tensors inside) arrive whole and in rank order, on
    every rank or on one; pickled into a uint8 tensor, so no numpy is needed (CI has none)."""
    for rank, (everywhere, at_one) in enumerate(run_ranks(_gathered_objects, world_size)):
        for objects in [everywhere] + ([at_one] if rank == 1 else []):
            assert [o["rank"] for o in objects] == list(range(world_size))
            assert [len(o["text"]) for o in objects] == [1000 * i + 1 for i in range(world_size)]
            for i, o in enumerate(objects):
                assert torch.equal(o["tensor"], torch.arange(3 * i + 1.0))
        if rank != 1:
            assert at_one is None


# ---- the N-D mesh: its groups (train.py composes them: tests/test_train.py) ----

MESHES = [dict(world=8, tp=2, pp=2), dict(world=8, tp=2, cp=2), dict(world=8, pp=2, cp=2),
          dict(world=16, tp=2, cp=2, pp=2, ep=2), dict(world=8, ep=4), dict(world=4),
          dict(world=16, tp=2, cp=2, shard=2)]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_every_dimension_cuts_the_world_once_and_the_dimensions_cross_at_one_rank(mesh):
    world = mesh["world"]
    sizes = {k: v for k, v in mesh.items() if k != "world"}
    shape, lists = mesh_shape(world, **sizes), mesh_rank_lists(world, **sizes)
    assert shape["pp"] * shape["dp"] * shape["cp"] * shape["tp"] == world
    for name, groups in lists.items():
        assert sorted(r for g in groups for r in g) == list(range(world)), name     # a partition
        data = shape["dp"] * shape["cp"]
        size = {"dp_cp": data, "ep": shape["ep"], "expert_dp": data // shape["ep"],
                "shard": sizes.get("shard"), "replicate": data // sizes.get("shard", 1)
                }.get(name, shape.get(name))
        assert all(len(g) == size for g in groups), name
    # tp innermost: a tensor group is consecutive ranks (one node's links); pp outermost.
    assert all(g == list(range(g[0], g[0] + shape["tp"])) for g in lists["tp"])
    assert all(b - a == world // shape["pp"] for g in lists["pp"] for a, b in zip(g, g[1:]))
    # The groups of two dimensions through a rank share that rank only: coordinates, not overlaps.
    for r in range(world):
        through = {d: next(set(g) for g in lists[d] if r in g) for d in DIMENSIONS}
        for a, b in itertools.combinations(DIMENSIONS, 2):
            assert through[a] & through[b] == {r}, (r, a, b)
    if shape["ep"] > 1:        # experts: ep splits a data x context group, expert_dp spans its runs
        for g in lists["dp_cp"]:
            runs = [e for e in lists["ep"] if set(e) <= set(g)]
            assert len(runs) == len(g) // shape["ep"]
            assert [e for e in lists["expert_dp"] if set(e) <= set(g)] == [list(x) for x in zip(*runs)]
    if "shard" in sizes:       # HSDP: runs of S neighbours of each data x context group shard,
        for g in lists["dp_cp"]:                  # the ranks at one place in each run hold copies
            runs = [s for s in lists["shard"] if set(s) <= set(g)]
            assert runs == [g[i: i + sizes["shard"]] for i in range(0, len(g), sizes["shard"])]
            assert [c for c in lists["replicate"] if set(c) <= set(g)] == [list(x) for x in zip(*runs)]


@pytest.mark.parametrize("sizes, message", [
    (dict(world=8, tp=3), "world size 8 is not --tp 3 x --cp 1 x --pp 1 x a data-parallel size"),
    (dict(world=8, tp=2, pp=2, ep=3), "--ep 3 must divide the data x context ranks"),
    (dict(world=8, cp=0), "mesh sizes must be at least 1"),
    (dict(world=8, tp=2, shard=3), "--shard-group 3 must divide the data x context ranks")])
def test_a_mesh_that_does_not_fit_names_the_flags(sizes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        mesh_shape(**sizes)


def _mesh_sums(sizes):
    """Each group's sum of its ranks (an all-reduce in it), and the new_group calls made."""
    import torch.distributed as dist
    calls, new_group = [], dist.new_group

    def record(ranks=None, **kwargs):
        calls.append(list(ranks))
        return new_group(ranks, **kwargs)
    dist.new_group = record
    mesh = make_device_mesh(Comm(), **sizes)
    sums = {}
    for name, comm in mesh._asdict().items():
        if comm is not None:
            t = torch.tensor([float(dist.get_rank())])
            comm.all_reduce(t)
            sums[name] = t.item()
    return sums, calls


def test_the_mesh_groups_are_created_everywhere_and_reduce_over_their_ranks():
    sizes = dict(tp=2, pp=2)
    ranks = run_ranks(_mesh_sums, 4, sizes)
    lists = mesh_rank_lists(4, **sizes)
    for r, (sums, calls) in enumerate(ranks):
        assert calls == ranks[0][1]                          # every rank, every group, one order
        for name, total in sums.items():
            assert total == sum(next(g for g in lists[name] if r in g)), (r, name)


# ---- a stalled rank: every group honours --timeout -------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 6              # seconds: spare for a loaded CPU's start-up, whose collectives wait too


def _stall_last_rank(world: int, flags: list) -> list:
    """train.py on `world` plain processes (the environment torchrun gives its workers); once
    rank 0 logged step 0, the last rank is SIGSTOPped (alive, silent: no connection closes).
    Logged again only at the end, so every later collective is on the mesh's subgroups. Returns
    each other rank's (exit code, seconds from the stop to its exit, stderr)."""
    from test_snapshot import _free_port
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    argv = [sys.executable, "train.py", *flags, "--steps", "100000", "--log-every", "100000",
            "--eval-every", "0", "--seq-len", "32", "--batch-size", "8", "--timeout", str(TIMEOUT)]
    ranks = [subprocess.Popen(argv, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    try:
        for line in ranks[0].stdout:                        # training is under way ...
            if line.startswith("step     0 |"):
                break
        ranks[-1].send_signal(signal.SIGSTOP)               # ... when the last rank stalls
        stopped, exited = time.monotonic(), {}
        while len(exited) < world - 1 and time.monotonic() < stopped + 4 * TIMEOUT:   # not minutes
            for r, p in enumerate(ranks[:-1]):
                if r not in exited and p.poll() is not None:
                    exited[r] = time.monotonic() - stopped
            time.sleep(0.1)
        return [(p.returncode, exited.get(r), p.stderr.read() if r in exited else "")
                for r, p in enumerate(ranks[:-1])]
    finally:
        for p in ranks:
            p.kill()                                        # SIGKILL ends a stopped process too
            p.wait()


@pytest.mark.parametrize("world, flags", [(2, ["--strategy", "ddp"]), (4, ["--tp", "2", "--pp", "2"])])
def test_a_stalled_rank_stops_the_others_within_the_timeout(world, flags):
    for r, (code, waited, stderr) in enumerate(_stall_last_rank(world, flags)):
        # A rank waiting on the stalled one raises at --timeout; one waiting on a rank that then
        # exited raises at once (its connection closed): 2 x the timeout bounds both.
        assert waited is not None and waited < 2 * TIMEOUT and code == 1, (r, code, waited, stderr)
        lines = [line for line in stderr.splitlines() if "error:" in line]
        assert len(lines) == 1 and "Traceback" not in stderr, (r, stderr)
        assert f"rank {r} lost contact with the other ranks" in lines[0] and "--timeout" in lines[0], stderr


def _ring_message_after_a_timeout(done: str):
    """Rank 0's two ring all-reduces while rank 1 stalls, the second waited for first: once the
    first timed out, gloo fails every other message of the group with "Application timeout
    caused pair closure", naming no gloo file. What run_log.stopped, train.py's end, makes of
    it: (the error, exit code, stderr). Rank 1 stays alive (no connection closes) until done."""
    import contextlib
    import io
    import types
    import torch.distributed as dist
    from running.run_log import stopped
    dist.barrier()                              # both here: the ring's group joins within its timeout
    comm = Comm(ring=True, timeout=2)
    if dist.get_rank() == 1:
        while not os.path.exists(done):
            time.sleep(0.1)
        return None
    first = comm.all_reduce(torch.ones(8), async_op=True)
    second = comm.all_reduce(torch.ones(8), async_op=True)
    try:
        second.wait()
    except RuntimeError as e:
        error = e
    finally:
        open(done, "w").close()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = stopped(error, types.SimpleNamespace(received=False), None)
        except RuntimeError:                    # a bug's way out: its traceback kept
            code = "raised"
    with contextlib.suppress(RuntimeError):
        first.wait()
    return str(error), code, stderr.getvalue()


def test_a_ring_message_failed_by_another_ones_timeout_is_a_lost_peer(tmp_path):
    error, code, stderr = run_ranks(_ring_message_after_a_timeout, 2, str(tmp_path / "done"))[0]
    assert "Application timeout caused pair closure" in error, error      # the case, met
    assert code == 1 and stderr.count("\n") == 1, (code, stderr)
    assert "rank 0 lost contact with the other ranks" in stderr and "--timeout" in stderr, stderr


def test_a_native_collectives_pair_closure_is_a_lost_peer_too(capsys):
    """The same gloo message, met by a native collective's wait (a plain RuntimeError, not the
    ring's DistNetworkError): one line, exit 1, no traceback (CI met it once in the stalled-rank
    test under ddp)."""
    import types
    from running.run_log import stopped
    code = stopped(RuntimeError("Application timeout caused pair closure"),
                   types.SimpleNamespace(received=False), None)
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, (code, err)
    assert "this rank lost contact with the other ranks" in err and "--timeout" in err, err
    with pytest.raises(RuntimeError, match="shape mismatch"):      # a bug keeps its traceback
        stopped(RuntimeError("shape mismatch"), types.SimpleNamespace(received=False), None)


# ---- the GPU launch: NCCL's error handling under torchrun, the device each process takes --------

def test_nccl_error_handling_is_clean_up_only_under_torchrun_unless_the_user_chose():
    """torchrun's agent sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down: SIGABRT, no line said) in
    every worker unless the user set it: init_distributed, under a real torchrun, leaves it at 2
    (clean up only: the waiting call raises and train.py says its line) before the group is made;
    a value the user exported reaches the worker unchanged."""
    probe = ("import os; from foundations import world; world.init_distributed(); "
             "print('value', os.environ['TORCH_NCCL_ASYNC_ERROR_HANDLING'])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for exported, expected in ((None, "2"), ("3", "3"), ("0", "0")):
        env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
        env.update({"PYTHONPATH": root, **({"TORCH_NCCL_ASYNC_ERROR_HANDLING": exported} if exported else {})})
        out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "1",
                              "--standalone", "--no-python", sys.executable, "-c", probe],
                             env=env, capture_output=True, text=True, timeout=120, cwd=root)
        assert out.returncode == 0, out.stderr
        assert f"value {expected}" in out.stdout, (exported, out.stdout, out.stderr)


def test_nccl_error_handling_keeps_a_value_set_without_torchrun():
    from foundations.world import choose_nccl_error_handling
    for environ, expected in (({}, "2"), ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "1"),
                              ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCHELASTIC_RUN_ID": "x"}, "2"),
                              ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCHELASTIC_RUN_ID": "x"}, "3")):
        assert choose_nccl_error_handling(environ) == expected == environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]


@pytest.mark.parametrize("local_rank, local_world, visible, expected", [
    (0, 1, 1, 0), (3, 8, 8, 3), (7, 8, 8, 7),      # torchrun, a GPU per process
    (3, 4, 1, 0), (0, 4, 1, 0),                     # a launcher showing each process one GPU
    (1, 2, 4, 1),                                   # fewer processes than GPUs
    (0, 8, 4, None), (5, 8, 4, None), (2, 1, 2, None)])   # more processes than GPUs: every rank refuses
def test_each_process_takes_a_gpu_it_can_see_or_every_rank_says_why(local_rank, local_world, visible, expected):
    from foundations.world import LaunchError, cuda_index
    if expected is not None:
        assert cuda_index(local_rank, local_world, visible) == expected
        return
    with pytest.raises(LaunchError, match=rf"but {visible} GPUs: start one process per GPU \(torchrun "
                                          rf"--nproc_per_node {visible}\)"):
        cuda_index(local_rank, local_world, visible)


def test_two_processes_shown_the_same_single_gpu_are_refused():
    from foundations.world import shared_gpu
    assert shared_gpu(["GPU-a", "GPU-b", "GPU-c"]) is None
    line = shared_gpu(["GPU-a", "GPU-b", "GPU-a"])
    assert "local ranks 0 and 2 both see one GPU (GPU-a)" in line and "--nproc_per_node 2" in line
