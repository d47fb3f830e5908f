"""Run a test function on N CPU processes joined in one gloo group, as torchrun would.

run_ranks(fn, N, *args) starts N fresh processes (forked from a server that has already
imported torch, so a launch costs about a second, not five), joins them with a FileStore
(no ports to pick, so parallel tests never collide), runs fn(*args) on each with one
thread (two cores), and returns every rank's result; run_ranks(train_logged, N, argv) runs
train.py in them. A rank that raises fails the test
with that rank's traceback; a rank that does not finish in `timeout` seconds (a hang)
fails it too, and every process is killed: a broken collective never hangs the suite.
"""
import contextlib
import io
import multiprocessing
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist

_context = multiprocessing.get_context("forkserver")
# What every rank imports, imported once by the server: torch._dynamo is what the first
# torch.optim optimizer imports (with sympy), nearly 2 s a process.
_context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """fn(*args) on world_size ranks; returns [result of rank 0, ..., rank N-1]."""
    with tempfile.TemporaryDirectory() as tmp:
        results = _context.Queue()
        procs = [_context.Process(target=_rank_main,
                                  args=(fn, rank, world_size, os.path.join(tmp, "store"), args, results))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        outputs = {}
        try:
            while len(outputs) < world_size:
                try:
                    rank, ok, payload = results.get(timeout=timeout)
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise AssertionError(f"ranks {missing} of {world_size} did not finish "
                                         f"{fn.__name__} within {timeout:.0f}s (a hang?)") from None
                if not ok:
                    raise AssertionError(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{payload}")
                outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
    return [outputs[rank] for rank in range(world_size)]


def _rank_main(fn, rank, world_size, store_path, args, results):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size),
                                rank=rank, world_size=world_size)
        buffer = io.BytesIO()                 # tensors travel as bytes: no shared-memory handles
        torch.save(fn(*args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train_logged(argv):
    """train.main(argv) on this rank: its history (full-precision losses) and what it printed."""
    import train
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())       # what torchrun would set
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        history = train.main(argv)
    return history, printed.getvalue()


def assert_tensors_close(actual: dict, expected: dict, rtol: float, atol: float, what: str = ""):
    """Compare two {name: tensor} dicts; a failure names the tensor, the largest difference and where."""
    assert actual.keys() == expected.keys(), f"{what}: different names {set(actual) ^ set(expected)}"
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol,
                                   msg=lambda message, name=name: f"{what} {name}: {message}")


def assert_mean_close(actual: dict, expected: dict, atol: float, what: str = ""):
    """The mean absolute difference over every element of two {name: tensor} dicts: one element
    may sit where Adam amplifies rounding noise, but a real bug moves many and shows here."""
    diffs = torch.cat([(actual[k] - expected[k]).abs().flatten() for k in expected])
    assert diffs.mean().item() <= atol, f"{what}: mean |difference| {diffs.mean().item():.3g} > {atol}"
