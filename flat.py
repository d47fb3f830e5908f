"""The flat buffer: parameters laid end to end, cut into N equal shards; the ladder's one buffer.

DDP's buckets (one shard: the rank owns all of it), ZeRO's buckets (rank r owns shard r of the
optimizer state and the gradient) and FSDP's units (shard r of the parameters too) are the same
FlatParams: "who owns which shard" is the whole difference (ZeRO, Rajbhandari et al. 2020,
section 5; FSDP's FlatParameter, Zhao et al. 2023, section 3). Written here once, the
foundation of ddp.py, zero.py and fsdp.py: the buffer, buckets of a few MiB, the gradient hook,
one reduction per bucket in an order every rank agrees on, and the sharded optimizer's step
(ShardedOptimizer, the base of ZeRO's and FSDP's: one global norm, the used-flags; offload.py
moves it to the host), and the gradient-sync protocol they all speak (GradientSyncs).
Left out: FSDP2's per-parameter sharding (each tensor cut along its first dim, not laid in one
flat buffer).
Test: python -m pytest tests/test_ddp.py tests/test_zero.py

Shapes: N ranks, r this rank, P elements in a flat buffer, S = ceil(P / N) elements per shard.
"""
import itertools
import weakref
from collections import deque
from contextlib import ExitStack, contextmanager

import torch
import torch.nn as nn

from collectives import Comm, ring_bytes
from launch import flags_to_device
from mixed_precision import MasterOptimizer
from placements import grad_norm, norm_weight


# ---- the buffer ---------------------------------------------------------------------------------

class FlatParams:
    """Parameters laid end to end in one flat buffer, zero-padded to N equal shards: the one
    buffer of the whole ladder. DDP's rank owns every shard (N = 1, no padding); ZeRO's rank r
    owns shard r of the optimizer state and the gradient (zero.py); FSDP's of the parameters too.

        params   [ w0: 6 elements | w1: 3 | b1: 2 ]              P = 11, N = 3, S = 4
        flat     [ w0 w0 w0 w0 | w0 w0 w1 w1 | w1 b1 b1 pad ]
                      shard 0       shard 1       shard 2        rank r owns shard r

    After construction every parameter is a view into `flat`: the model runs unchanged, and
    whatever is written into `flat` (an all-gather) is written into the parameters. Any other
    flat tensor of the same layout (a gradient buffer) is cut the same way by views() and shard().
    """

    def __init__(self, params: list[nn.Parameter], world_size: int):
        self.params = list(params)
        first = self.params[0]
        self.numel = sum(p.numel() for p in self.params)                 # P
        self.shard_numel = -(-self.numel // world_size)                  # S = ceil(P / N)
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.flat = torch.zeros(world_size * self.shard_numel, dtype=first.dtype,
                                device=first.device)                     # (N*S,)
        with torch.no_grad():
            for p, view in zip(self.params, self.views(self.flat)):
                view.copy_(p)
                p.data = view
        # The gradient side, filled by the strategies as backward runs:
        self.grad_flat = None     # (N*S,) the full gradient in the same layout (DDP: always)
        self.pending = len(self.params)   # gradients not yet in, this backward

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The slice of `flat` that belongs to params[i], shaped like it."""
        return flat[self.offsets[i]: self.offsets[i + 1]].view_as(self.params[i])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self.view(flat, i) for i in range(len(self.params))]

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard of `flat`: (N*S,) -> (S,)."""
        return flat[rank * self.shard_numel: (rank + 1) * self.shard_numel]

    def shard_ranges(self, rank: int) -> list[tuple[int, int, int, int]]:
        """What shard `rank` holds, parameter by parameter: (i, start, stop, offset) says that
        elements start:stop of params[i] (flattened) sit at shard[offset : offset + stop - start].
        In the picture above, shard 1 is (0, 4, 6, 0), (1, 0, 2, 2). Checkpoints save this map
        beside each shard, so another world size can cut the same values differently."""
        low, high = rank * self.shard_numel, (rank + 1) * self.shard_numel
        ranges = []
        for i in range(len(self.params)):
            first, last = max(self.offsets[i], low), min(self.offsets[i + 1], high)
            if first < last:
                ranges.append((i, first - self.offsets[i], last - self.offsets[i], first - low))
        return ranges


# ---- the backward side: buckets, hooks, one reduction per bucket in an agreed order ------------

def split_into_buckets(tensors: list, bucket_mb: float) -> list[list]:
    """Consecutive tensors grouped into messages of at most bucket_mb MiB, one dtype and device each.

    One message per tensor pays the network's latency hundreds of times; one message for
    everything can only start when the last gradient exists. Buckets of a few MiB reach the
    link's bandwidth and can still start early. A tensor larger than the cap gets its own.
    """
    cap = bucket_mb * 2**20
    buckets, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > cap or (t.dtype, t.device) != (buckets[-1][-1].dtype,
                                                                        buckets[-1][-1].device):
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


def hook_gradient(param: nn.Parameter, method, *indices: int):
    """Call method(*indices), a bound method of a wrapper (DDP, ZeRO-2, FSDP), each time backward
    has accumulated param's gradient into param.grad.

    The hook holds the wrapper weakly and gets plain indices, never a bucket or unit: torch keeps
    post-accumulate hooks where Python's gc does not look (torch 2.13), so a hook reaching the
    wrapper, which holds the parameter, would be a cycle never freed, every model wrapped kept.
    Once the wrapper is gone, the hook does nothing.
    """
    wrapper, function = weakref.ref(method.__self__), method.__func__

    def hook(_):
        if (alive := wrapper()) is not None:
            function(alive, *indices)
    param.register_post_accumulate_grad_hook(hook)


class InOrder:
    """The backward side of DDP, ZeRO-2 and FSDP, written once: launch one reduction per bucket
    (or unit) in a fixed order that every rank agrees on, whatever order the gradients arrive in,
    with at most max_in_flight unfinished.

    Collectives are matched by call order, not by name: a rank whose backward fills bucket 2
    before bucket 1 (data-dependent control flow, a unit only some ranks use) must still launch
    1 first, or it pairs its buffers with another rank's wrong ones. So a full bucket waits for
    every earlier one, then all consecutive full ones go. launch(bucket) starts its reduction
    and returns what retire(bucket, started) needs to finish it (wait, keep the result, free the
    buffer); None when nothing was started (FSDP under no_sync). The strategy calls ready() from
    its gradient hooks and, at the end of backward, launch_rest() (buckets whose gradients never
    came still reduce: every rank must launch every bucket) and wait_all().
    """

    def __init__(self, buckets: list, launch, retire, max_in_flight: int | None = None):
        self.buckets, self.launch, self.retire = list(buckets), launch, retire
        self.max_in_flight = max_in_flight
        self._ready = set()                    # indices of full buckets not yet launched
        self._next = 0                         # the first bucket not launched in this backward
        self._in_flight = deque()              # (bucket, what launch returned), oldest first
        self._index = {id(b): i for i, b in enumerate(self.buckets)}

    @property
    def launched(self) -> int:
        """Buckets launched so far in this backward."""
        return self._next

    def ready(self, bucket):
        """All of bucket's gradients are in: launch it, and every full one after it, in order."""
        self._ready.add(self._index[id(bucket)])
        while self._next in self._ready:
            self._ready.discard(self._next)
            self._start(self.buckets[self._next])
            self._next += 1

    def launch_rest(self):
        """End of backward: launch every bucket not launched yet, full or not, in order."""
        for bucket in self.buckets[self._next:]:
            self._start(bucket)
        self._next, self._ready = 0, set()

    def wait_all(self):
        while self._in_flight:
            self.retire(*self._in_flight.popleft())

    def _start(self, bucket):
        started = self.launch(bucket)
        if started is not None:
            self._in_flight.append((bucket, started))
        # Memory stays bounded whatever the network's speed: wait for the oldest.
        while self.max_in_flight is not None and len(self._in_flight) > self.max_in_flight:
            self.retire(*self._in_flight.popleft())


# ---- the sharded step: what ZeRO's optimizer and FSDP's share ------------------------------------

# Stage 2 (and FSDP) keeps at most this many full gradients in flight, buckets or units: when a
# third fills, backward waits for the oldest reduce-scatter and frees its buffer. Memory stays
# bounded whatever the network's speed; two in flight are enough to keep the link busy.
MAX_REDUCTIONS_IN_FLIGHT = 2


class ShardedOptimizer(MasterOptimizer):
    """What ZeRO's optimizer and FSDP's share once the gradients are shards (the base of both).

    self.flats: the flat buffers (zero.py's buckets, fsdp.py's units), each with `master`, this
    rank's (S,) fp32 shard, `comm`, the ranks it is sharded over (self.comm, or with expert
    parallelism the ranks holding the same experts), and `used`, one flag per parameter: did
    this rank compute a gradient for it since zero_grad()? The step is stage 2's whatever the
    stage: each rank updates its shards only, with one global norm for clipping and the
    inf/NaN skip.
    Inside a mesh (parallelize.py), split_model() names the groups whose ranks hold the other
    parts of the model beside these shards (tensor slices, pipeline stages): the norm adds the
    squares over them too (shards_norm).
    """

    def _total_norm(self, grads, masters):
        device = self.flats[0].params[0].device
        local = [u for flat in self.flats for u in flat.used]
        used, agree = self._used_anywhere_flags(device)                          # (P,), launched
        # The shards are disjoint slices of the one gradient (an expert's shards, over the world,
        # cover every expert once): every rank gets the same global norm, so every rank takes
        # the same skip decision.
        grad_of = {id(master): grad for grad, master in zip(grads, masters)}
        norm = shards_norm(self.flats, [grad_of.get(id(f.master)) for f in self.flats], self.comm,
                           self.split)
        agree()
        # Read only where this rank missed a gradient: if it computed every one, every parameter
        # was used somewhere. Read or not, it rides in the step's one host read, the norm's.
        self._used_anywhere = used if not all(local) else None
        return norm

    def _used_anywhere_flags(self, device) -> tuple:
        # A parameter no rank used keeps its values and moments (keep_unchanged), as torch's
        # optimizers skip a .grad of None: the flags OR'ed over the ranks, sent beside the norm.
        return or_used_flags(self.flats, device)

    def _flags_to_read(self):
        return self._used_anywhere

    def _unused(self):
        if self._flags_read is None:
            return []
        used, ranges = iter(self._flags_read), []
        for flat in self.flats:
            unused = {i for i in range(len(flat.params)) if not next(used)}
            ranges += [(flat.master, offset, offset + stop - start)
                       for i, start, stop, offset in flat.shard_ranges(flat.comm.rank) if i in unused]
        return ranges

    def master_ranges(self) -> list[tuple]:
        """(param, start, stop, master, offset): elements start:stop of param (flattened) have
        their fp32 master, and their optimizer state, at master[offset : offset + stop - start].
        Only this rank's shards: a checkpoint saves every rank's and joins them by name."""
        return [(flat.params[i], start, stop, flat.master, offset) for flat in self.flats
                for i, start, stop, offset in flat.shard_ranges(flat.comm.rank)]

    def host_tensors(self) -> list[torch.Tensor]:
        """What this rank keeps in host memory: nothing (offload.py's step keeps the masters there)."""
        return []

    def _shard_id(self) -> dict:
        return {"rank": self.comm.rank, "world_size": self.comm.world_size}


def shards_norm(flats: list, grads: list, comm: Comm, split: dict) -> torch.Tensor:
    """The global gradient norm from this rank's shards of flats (grads: each flat's (S,)
    gradient shard, or None), summed over comm, the groups the model is split over beside it
    (split, {mesh dim: group}), and HSDP's copies where some shard is not copied (an expert's
    unit spans them; with every shard copied, one copy's squares are the whole). Each run of a
    shard counts as placements.norm_weight says: every value once. Collective."""
    copied = [flat.replicas is not None for flat in flats]
    copies_summed = any(copied) and not all(copied)
    runs = []                   # (grad, first, last, weight): equal neighbours merged, one kernel
    for flat, grad in zip(flats, grads):
        if grad is None:
            continue
        copies = flat.replicas.world_size if copies_summed and flat.replicas else 1
        for i, start, stop, offset in flat.shard_ranges(flat.comm.rank):
            weight, last = norm_weight(flat.params[i], split, copies), offset + stop - start
            if runs and runs[-1][0] is grad and runs[-1][2:] == (offset, weight):
                runs[-1] = (grad, runs[-1][1], last, weight)
            else:
                runs.append((grad, offset, last, weight))
    pieces = [(grad[first:last], weight) for grad, first, last, weight in runs]
    groups = [comm, *split.values(), *([flats[copied.index(True)].replicas] if copies_summed else [])]
    return grad_norm(pieces, groups, flats[0].params[0].device)


def or_used_flags(flats: list, device) -> tuple:
    """The flats' "used" flags OR'ed over the ranks holding each (its comm), then over HSDP's
    copies of the shard (a flat's `replicas`): did any rank compute a gradient for each
    parameter? Returns the (P,) uint8 flags on device, their all-reduces launched (a P-byte
    message, as DDP's; one per run of flats on one comm), and agree(), which waits for them."""
    used = flags_to_device([u for flat in flats for u in flat.used], device)         # (P,)
    launched, first = [], 0
    for comm, run in itertools.groupby(flats, key=lambda flat: flat.comm):
        run = list(run)
        stop = first + sum(len(flat.params) for flat in run)
        handle = comm.all_reduce(used[first: stop], op="max", async_op=True)
        launched.append((handle, getattr(run[0], "replicas", None), first, stop))
        first = stop

    def agree():
        for handle, copies, start, stop in launched:
            handle.wait()           # (before the copies' all-reduce: NCCL orders no two groups)
            if copies is not None:
                copies.all_reduce(used[start: stop], op="max")
    return used, agree


def agree_used(flats: list, device):
    """or_used_flags, waited for and read, for flats whose gradient the reducer owns (FSDP's
    units): a flat no rank used then has no gradient, .grad None, as in one process, so a plain
    torch optimizer skips it where a zero gradient would still be decayed by AdamW (and moved by
    its moments). A parameter unused inside a used flat keeps a zero slice of the shard's
    gradient: ShardedOptimizer keeps it unchanged (mixed_precision.keep_unchanged), a plain
    optimizer does not. Collective: call it at the same place on every rank."""
    local = [u for flat in flats for u in flat.used]
    used, agree = or_used_flags(flats, device)                                  # (P,) uint8
    agree()
    if all(local):
        return               # every parameter was used here: no read (a host sync on a GPU)
    flags = iter(used.bool().tolist())
    for flat in flats:
        flat.used = [next(flags) for _ in flat.params]
        if not any(flat.used):
            flat.grad = None


def flags_and_norm_bytes(flats: list, comm) -> int:
    """step_message_bytes when the flats are sharded over groups of their own (expert
    parallelism's): each run of flats sends its flags to its ranks; the norm goes to comm's."""
    return sum(ring_bytes("all_reduce", sum(len(flat.params) for flat in run), 1, group.world_size)
               for group, run in itertools.groupby(flats, key=lambda flat: flat.comm)
               ) + ring_bytes("all_reduce", 1, 4, comm.world_size)


def step_message_bytes(n_params: int, world_size: int) -> int:
    """What a sharded step sends besides the shards (ring): the P used-flags, one byte each,
    as DDP sends them, and the global norm's one fp32 number."""
    return (ring_bytes("all_reduce", n_params, 1, world_size)
            + ring_bytes("all_reduce", 1, 4, world_size))


# ---- the gradient-sync protocol every reducer speaks --------------------------------------

class GradientSyncs:
    """The one gradient-sync protocol, spoken by every reducer in the project (DDP, ZeRO's
    optimizers, FSDP, a tensor-parallel model's partial sums), and several of them driven as one:
        with sync.no_sync(): backward     gradients wait where they are, nothing reduced
        sync.finish_gradient_sync()       after the step's last backward: every reduction done
    keeps_whole_gradients: True when every member holds whole gradients until the step anyway
    (DDP, ZeRO-1): running all micro-batches but the last under no_sync() then saves their
    reductions at no memory cost (ZeRO-2 and FSDP reduce each one, so no rank holds a whole
    gradient). The loop and the pipeline drive this, in this order: a tensor group's partial
    sums before the data dimension's reduction, which shards or frees what they read."""

    def __init__(self, *syncs):
        self.syncs = [s for s in syncs if s is not None]
        self.keeps_whole_gradients = all(s.keeps_whole_gradients for s in self.syncs)

    @contextmanager
    def no_sync(self):
        with ExitStack() as stack:
            for sync in self.syncs:
                stack.enter_context(sync.no_sync())
            yield

    def finish_gradient_sync(self):
        for sync in self.syncs:
            sync.finish_gradient_sync()
