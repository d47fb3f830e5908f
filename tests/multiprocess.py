"""Run a test function on N CPU processes joined in one gloo group, as torchrun would.

run_ranks(fn, N, *args) starts N fresh processes (forked from a server that has already
imported torch and the repository, so a launch costs a tenth of a second, not five), joins
them with a FileStore (no ports to pick, so parallel tests never collide), runs fn(*args) on
each with one thread (two cores), and returns every rank's result; run_ranks(train_logged, N,
argv) runs train.py in them; with nccl=True each rank keeps NCCL's rules that gloo lets pass
(nccl_rules, below). A rank that raises fails the test with that rank's traceback; a rank
that does not finish in `timeout` seconds (a hang) fails it too, and every process is killed:
a broken collective never hangs the suite.
"""
import contextlib
import io
import multiprocessing
import os
import pickle
import queue
import sys
import tempfile
import traceback
import weakref

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_context = multiprocessing.get_context("forkserver")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What every rank imports, imported once by the server: torch._dynamo is what the first
# torch.optim optimizer imports (with sympy), nearly 2 s a process; pytest every test file.
TORCH_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pytest"]


def _preload() -> list:
    """torch, and the repository's modules the tests imported (all of them once pytest has
    collected): a rank unpickles fn by importing its test file, which then finds train, bench,
    fsdp and the torch parts they pull in (pipelining, FSDP2, the profiler) already imported,
    not 0.2-1 s of imports per rank. The server imports them by name from its working directory
    (Python 3.11's forkserver keeps no sys.path of ours): run from the repository root, as the
    README's test command is; from elsewhere, each rank imports them itself, as before."""
    folders = {ROOT} | {os.path.join(ROOT, package) for package in os.listdir(ROOT)
                        if os.path.isfile(os.path.join(ROOT, package, "__init__.py"))}   # foundations/ ...
    ours = [name for name, module in list(sys.modules.items())
            if not name.startswith("__") and os.path.dirname(getattr(module, "__file__", None) or "") in folders]
    return TORCH_PRELOAD + sorted(ours)


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0, nccl: bool = False) -> list:
    """fn(*args) on world_size ranks; returns [result of rank 0, ..., rank N-1].
    nccl: each rank runs fn under nccl_rules(), NCCL's rules that gloo lets pass."""
    _context.set_forkserver_preload(_preload())      # read once, when the server starts
    with tempfile.TemporaryDirectory() as tmp:
        results = _context.Queue()
        # fn and args as bytes, unpickled by the rank (_rank_main)
        work = pickle.dumps((fn, args))
        procs = [_context.Process(target=_rank_main, args=(work, rank, world_size, os.path.join(
                     tmp, "store"), results, nccl))
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


def _rank_main(work, rank, world_size, store_path, results, nccl):
    # (No gc.freeze() here: a tensor made later but caught in a cycle with a frozen object
    # lingers past gc.collect(), and memory_math.live_tensor_bytes's counts then differ by its bytes
    # from step to step: measured +4 bytes at random logged steps.)
    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(work)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size),
                                rank=rank, world_size=world_size)
        buffer = io.BytesIO()                 # tensors travel as bytes: no shared-memory handles
        with nccl_rules() if nccl else contextlib.nullcontext():
            result = fn(*args)
        torch.save(result, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def torchrun_worker(monkeypatch, world_size: int, rank: int = 0):
    """This process's environment as torchrun gives its worker `rank` of world_size, for a test
    of what train.py's command line refuses before joining the job (cli.parse_args reads it)."""
    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size,
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(name, str(value))


def train_logged(argv):
    """train.main(argv) on this rank: its history (full-precision losses) and what it printed."""
    import train
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())       # what torchrun would set
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        history = train.main(argv)
    return history, printed.getvalue()


def bench_logged(argv):
    """bench.main(argv) on this rank, in the environment torchrun gives its workers: what it
    printed (rank 0 writes the JSON)."""
    from bench.compare import main
    world = str(dist.get_world_size())
    os.environ.update(WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)        # what torchrun would set
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(argv)
    return printed.getvalue()


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


# ---- NCCL's rules, kept on gloo: a bug of the GPU path fails on the CPU ---------------------------
#
# Two rules gloo lets pass: a coalesced batch_isend_irecv returns ONE work for the whole batch
# (gloo: one per message), and every tensor a collective or p2p message is given lives on the
# compute device (gloo takes host memory too). On a CPU rank host and device are both "cpu", so
# host memory is tracked: what offload.host_buffer allocates (the one helper offload allocates its
# host buffers through), and what is made from it. Such a tensor answers .device with HOST, so
# a tensor made on a device read from a host tensor (`device=master.device`) is host memory too.

HOST = torch.device("cpu", 0)       # a "cpu" that is not the compute device's "cpu"
_DEVICE_OF = torch.Tensor.device.__get__                     # what `tensor.device` calls
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "broadcast",
               "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv")


class _HostMemory(TorchFunctionMode):
    """Which storages are host memory: those recorded by add(); the fresh result of a call that
    names HOST as its device; the fresh result of a call on host memory that names no device
    (as on a GPU, where it would run on the host). Results that reuse an input's storage (an
    in-place op, .to() a device they are on) stay what they were."""

    def __init__(self):
        super().__init__()
        self.storages = set()                       # data_ptr of each live host storage

    def add(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in self.storages:
            self.storages.add(storage.data_ptr())
            # Forgotten when the memory is freed: a device tensor may get the address next.
            weakref.finalize(storage, self.storages.discard, storage.data_ptr())
        return t

    def holds(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.storages

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func == _DEVICE_OF:
            return HOST if self.holds(args[0]) else result
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        devices = [d for d in (*args, *kwargs.values()) if isinstance(d, torch.device)]
        if HOST in devices or (not devices and any(self.holds(t) for t in inputs)):
            used = {t.untyped_storage().data_ptr() for t in inputs}
            for out in (result if isinstance(result, (tuple, list)) else (result,)):
                if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in used:
                    self.add(out)
        return result


class _OneWork:
    """What NCCL's coalesced batch_isend_irecv returns for a whole batch: one work."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()
        return True


@contextlib.contextmanager
def nccl_rules(device=torch.device("cpu")):
    """Inside, this rank keeps NCCL's rules on gloo: batch_isend_irecv returns one work per batch,
    and a collective or a p2p message given a tensor that is not on `device`, or is host memory,
    raises. For CPU tests; the ring's launcher thread is outside the mode (it is per thread), so
    its messages are checked against the recorded host storages alone."""
    from mechanics import offload
    host = _HostMemory()
    original_host_buffer = offload.host_buffer

    def host_buffer(*args, **kwargs):
        return host.add(original_host_buffer(*args, **kwargs))

    def check(name, tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor) and (t.device != device or host.holds(t)):
                raise AssertionError(f"{name} was given a {tuple(t.shape)} tensor in "
                                     f"{'host memory' if host.holds(t) else t.device}: NCCL moves "
                                     f"only the compute device's ({device}) memory")

    def checked(name, collective):
        def call(*args, **kwargs):
            check(name, [t for a in (*args, *kwargs.values())
                         for t in (a if isinstance(a, (list, tuple)) else [a])])
            return collective(*args, **kwargs)
        return call

    def batch_isend_irecv(ops):
        check("batch_isend_irecv", [op.tensor for op in ops])
        return [_OneWork(original["batch_isend_irecv"](ops))]

    # Every module that imported host_buffer by name (mechanics/fsdp_state.py does) gets the recording one too.
    holders = [m for m in list(sys.modules.values())
               if m is not None and vars(m).get("host_buffer") is original_host_buffer]
    original = {name: getattr(dist, name) for name in (*COLLECTIVES, "batch_isend_irecv")}
    for name in COLLECTIVES:
        setattr(dist, name, checked(name, original[name]))
    dist.batch_isend_irecv = batch_isend_irecv
    for module in holders:
        module.host_buffer = host_buffer
    try:
        with host:
            yield
    finally:
        for name, fn in original.items():
            setattr(dist, name, fn)
        for module in holders:
            module.host_buffer = original_host_buffer
