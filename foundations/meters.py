"""Meters: what a run measures of itself, without making a step wait for the device.

Three instruments the strategies carry for train.py's log and the tests:
- the bytes autograd keeps for backward while a forward runs (saved-tensor hooks, each storage
  once): what checkpointing and context parallelism cut, against napkin/memory.py's formulas;
  over a pipeline's schedule, their peak;
- the seconds spent inside a block of code (the CPU's clock, or CUDA events on the compute
  stream, read with one synchronize when asked);
- a Comm whose blocking calls such a clock times. Context parallelism's idle share per rank is
  its attention's seconds less those.
Left out: the allocator's peak, profiling (bench/compare.py).
Test: python -m pytest tests/test_checkpointing.py tests/test_context_parallel.py
tests/test_activations.py
"""
import contextlib
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from foundations.launch import Handle


def _storage(t: torch.Tensor):
    """The bytes t lives in on this rank.

    A DTensor's (fully_shard's parameters) are its local part's."""
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def saved_activation_bytes(run, exclude=()):
    """Bytes autograd keeps for backward while run() executes, each storage counted once.

    Counted with saved-tensor hooks (every tensor an op or a Function saves passes through
    pack); `exclude` (the parameters) are not activations. Their storages are read at each save,
    not once before: FSDP gathers a unit's weights into fresh memory as its forward begins (and
    frees it after), so a weight a matmul saves is in storage that did not exist when run began.
    """
    exclude = list(exclude)
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in {p.untyped_storage().data_ptr() for p in exclude}:
            storages[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return sum(storages.values()), result


def peak_saved_bytes(run, exclude=()):
    """The most bytes autograd held for backward at once while run() executes its forwards and
    backwards (a pipeline stage's schedule: the micro-batches in flight), each storage counted
    once while any saved tensor uses it; `exclude` (the parameters) read at each save, as
    saved_activation_bytes does. Returns (peak, run's result)."""
    exclude = list(exclude)
    users, count = {}, {"live": 0, "peak": 0}

    class Saved:            # autograd drops it when its backward has run: its bytes leave the count
        def __init__(self, t, ptr, nbytes):
            self.tensor, self.ptr, self.nbytes = t, ptr, nbytes

        def __del__(self):
            users[self.ptr] -= 1
            if not users[self.ptr]:
                count["live"] -= self.nbytes

    def pack(t):
        storage = _storage(t)
        ptr = storage.data_ptr()
        if ptr in {_storage(p).data_ptr() for p in exclude}:
            return t
        if not users.get(ptr):
            count["live"] += storage.nbytes()
            count["peak"] = max(count["peak"], count["live"])
        users[ptr] = users.get(ptr, 0) + 1
        return Saved(t, ptr, storage.nbytes())

    def unpack(saved):
        return saved.tensor if isinstance(saved, Saved) else saved
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        result = run()
    return count["peak"], result


class BusyClock:
    """Seconds this rank spent inside timing(), summed until read(): the CPU's clock, or CUDA events
    on the compute stream, read (one synchronize) only when asked, on a logged step, so no step
    waits for the device."""

    def __init__(self):
        self.seconds, self.events = 0.0, []

    @contextlib.contextmanager
    def timing(self, cuda: bool):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - began

    def read(self) -> float:
        """The seconds since the last read; the count starts again."""
        if self.events:
            self.events[-1][1].synchronize()
        seconds = self.seconds + sum(start.elapsed_time(end) for start, end in self.events) / 1e3
        self.seconds, self.events = 0.0, []
        return seconds


class WaitTimedComm:
    """A Comm whose calls are timed into `waited` until stop().

    A collective counts for as long as it blocks; an exchange while it posts and while its
    handle's wait() blocks. On CUDA, the clock reads how long the compute stream waited for them.
    Its other attributes (rank, world_size, bytes_sent) are the Comm's."""

    def __init__(self, comm, waited: BusyClock, cuda: bool):
        self.comm, self.waited, self.cuda = comm, waited, cuda

    def stop(self):
        """Count no more calls (context parallelism: backward's, after forward's were counted)."""
        self.waited = None

    def __getattr__(self, name):
        attribute = getattr(self.comm, name)
        return partial(self._blocking, attribute) if callable(attribute) else attribute

    def _blocking(self, call, *args, **kwargs):
        timed = self.waited is not None
        with self.waited.timing(self.cuda) if timed else contextlib.nullcontext():
            result = call(*args, **kwargs)
        if isinstance(result, Handle):                  # an exchange's: its wait() blocks too
            return Handle(partial(self._blocking, result.wait))
        return result


def idle_shares(busy: float, group, device) -> list[float]:
    """Each rank of the group's idle share: 1 - its `busy` seconds / the busiest rank's.

    Collective over the group; device: where its collective's tensor lives."""
    busy = torch.tensor([busy], dtype=torch.float64, device=device)
    every = [torch.zeros_like(busy) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, busy, group=group)                   # a metric: not counted
    busiest = max(b.item() for b in every)
    return [1 - b.item() / busiest if busiest else 0.0 for b in every]
