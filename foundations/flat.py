"""The flat buffer: parameters laid end to end, cut into N equal shards; the ladder's one buffer.

DDP's buckets, ZeRO's buckets and FSDP's units are the same FlatParams. DDP's rank owns all of
it (one shard). ZeRO's rank r owns shard r of the optimizer state and the gradient. FSDP's rank r
owns shard r of the parameters too. "Who owns which shard" is the whole difference (ZeRO,
Rajbhandari et al. 2020, section 5; FSDP's FlatParameter, Zhao et al. 2023, section 3).
Here beside the buffer: buckets of a few MiB, the gradient hook, and ZeRO's buckets
(ShardedBuckets). ZeRO-2's and FSDP's reductions go in an order every rank agrees on (InOrder).
The sharded step's pieces are here too: the shards' squares and the used-flags (the step itself,
ZeRO's and FSDP's, is mechanics/sharded_step.py). Last, the gradient-sync protocol every
reducer speaks (GradientSyncs).
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

from foundations.comm import Comm, ring_bytes
from foundations.dtypes import DTYPES, master_dtype
from foundations.launch import flags_to_device
from foundations.placements import add_squares, norm_weight
from foundations.process_groups import check_same_parameters


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

    The gradient side, read and written by the strategies, is declared here:
        comm        the ranks that reduce its gradient (and hold its shards, when sharded)
        op, divide  the gradient is reduced by `op` over comm, then divided by `divide`
        replicas    the ranks holding copies of its shard (HSDP's), or None
        grad_flat   (N*S,) the whole gradient in the same layout, or None while none is held
        pending     how many of its gradients this backward has still to produce
        used        which parameters got a gradient since it was last cleared
    with_grad=True allocates grad_flat at once, zeroed (DDP's buckets hold it always).
    """

    def __init__(self, params: list[nn.Parameter], world_size: int, comm: Comm | None = None,
                 op: str = "avg", divide: float = 1, with_grad: bool = False):
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
        self.comm, self.op, self.divide, self.replicas = comm, op, divide, None
        self.grad_flat = torch.zeros_like(self.flat) if with_grad else None           # (N*S,)
        self.pending = len(self.params)
        self.used = [False] * len(self.params)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The slice of `flat` that belongs to params[i], shaped like it."""
        return flat[self.offsets[i]: self.offsets[i + 1]].view_as(self.params[i])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self.view(flat, i) for i in range(len(self.params))]

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard of `flat`: (N*S,) -> (S,)."""
        return flat[rank * self.shard_numel: (rank + 1) * self.shard_numel]

    def hook_gradients(self, method, *indices: int):
        """Call method(*indices, i), a bound method of a wrapper (DDP, ZeRO-2, FSDP), each time
        backward has accumulated params[i]'s gradient into its .grad.

        The hook holds the wrapper weakly and gets plain indices, never this buffer: torch keeps
        post-accumulate hooks where Python's gc does not look (torch 2.13), so a hook reaching the
        wrapper, which holds the parameter, would be a cycle never freed, every model wrapped kept.
        Once the wrapper is gone, the hook does nothing.
        """
        wrapper, function = weakref.ref(method.__self__), method.__func__
        for i, param in enumerate(self.params):
            def hook(_, i=i):
                if (alive := wrapper()) is not None:
                    function(alive, *indices, i)
            param.register_post_accumulate_grad_hook(hook)

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
    """Consecutive tensors grouped into messages of at most bucket_mb MiB, one dtype and device
    each.

    One message per tensor pays the network's latency hundreds of times; one message for
    everything can only start when the last gradient exists. Buckets of a few MiB reach the
    link's bandwidth and can still start early. A tensor larger than the cap gets its own.
    ZeRO's cut (ShardedBuckets); ddp.py writes the same cut out beside DDP's buckets.
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


class InOrder:
    """The backward side of ZeRO-2 and FSDP: one reduction per bucket (or unit), in one order.

    The order is fixed and every rank agrees on it, whatever order the gradients arrive in.
    At most max_in_flight reductions are unfinished at a time. ddp.py writes the same rule in its
    own few lines, where the lecture reads it (DDP._launch_full_buckets).

    Collectives are matched by call order, not by name. A rank whose backward fills bucket 2
    before bucket 1 (data-dependent control flow, a unit only some ranks use) must still launch
    1 first, or it pairs its buffers with another rank's wrong ones. So a full bucket waits for
    every earlier one, then all consecutive full ones go.
    launch(bucket) starts its reduction and returns what retire(bucket, started) needs to finish
    it (wait, keep the result, free the buffer). It returns None when nothing was started (FSDP
    under no_sync). The strategy calls ready() from its gradient hooks. At the end of backward it
    calls launch_rest(), then wait_all(). Buckets whose gradients never came still reduce, since
    every rank must launch every bucket.
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


# Stage 2 (and FSDP) keeps at most this many full gradients in flight, buckets or units: when a
# third fills, backward waits for the oldest reduce-scatter and frees its buffer. Memory stays
# bounded whatever the network's speed; two in flight are enough to keep the link busy.
MAX_REDUCTIONS_IN_FLIGHT = 2


class Bucket(FlatParams):
    """One flat buffer's worth of parameters, sharded over comm, plus this rank's optimizer-side
    state for it (zero.py's optimizer)."""

    def __init__(self, params, comm):
        super().__init__(params, comm.world_size, comm)
        self.master = None        # (S,) fp32: the shard the inner optimizer updates
        self.grad_shard = None    # (S,) this rank's reduced gradient, in the reduce dtype
        # grad_flat (FlatParams): stage 1 keeps it always, stage 2 only while in flight
        self.host_grad = None     # (S,) fp32, on the host: ZeRO-Offload copies grad_shard here


def parameters_only(params, who: str) -> list:
    """params as a list of tensors; our optimizers lay out their masters themselves, so they
    take one group of parameters (settings are keyword arguments), not group dicts."""
    params = list(params)
    if any(isinstance(p, dict) for p in params):
        raise ValueError(f"{who} takes the model's parameters (e.g. model.parameters()), not "
                         f"parameter-group dicts: its options apply to all of them")
    return params


def trainable_in_one_dtype(params, who: str) -> list:
    """The parameters that train (requires_grad), checked: some, all in one of fp32/bf16/fp16
    (or fp64, where a strategy is checked against one process exactly)."""
    trainable = [p for p in parameters_only(params, who) if p.requires_grad]
    if not trainable:
        raise ValueError(f"{who}: no trainable parameters (requires_grad=True) to shard")
    dtypes = {p.dtype for p in trainable}
    if len(dtypes) > 1 or not dtypes <= set(DTYPES.values()):
        raise ValueError(f"{who} needs all trainable parameters in one of {', '.join(DTYPES)}, "
                         f"got {sorted(map(str, dtypes))}: cast the model first, e.g. "
                         f"model.to(torch.bfloat16)")
    return trainable


class ShardedBuckets(list):
    """ZeRO's buckets (zero.py): the trainable parameters of `params`, checked (all in one of
    fp32/bf16/fp16; `who` names the caller in the error), in Buckets of about bucket_mb MiB
    sharded over comm, in reverse registration order (roughly the order backward produces
    gradients), the same on every rank: the shapes checked, the values broadcast from rank 0."""

    def __init__(self, params, comm: Comm, bucket_mb: float, who: str):
        trainable = trainable_in_one_dtype(params, who)
        check_same_parameters(trainable, comm)
        chunks = split_into_buckets(trainable[::-1], bucket_mb)
        super().__init__(Bucket(chunk, comm) for chunk in chunks)
        self.comm = comm
        for bucket in self:
            comm.broadcast(bucket.flat, src=0)

    def hook_gradients(self, method):
        """method(b, i) each time backward has accumulated parameter i of bucket b's gradient."""
        for b, bucket in enumerate(self):
            bucket.hook_gradients(method, b)

    def in_order(self, launch, retire) -> InOrder:
        """The buckets reduced in one order on every rank (InOrder).

        At most MAX_REDUCTIONS_IN_FLIGHT are unfinished at a time."""
        return InOrder(self, launch, retire, max_in_flight=MAX_REDUCTIONS_IN_FLIGHT)

    def flags_and_norm_bytes(self) -> int:
        """What a sharded step sends besides the shards: the used-flags and the norm (ring)."""
        return step_message_bytes(sum(len(bucket.params) for bucket in self), self.comm.world_size,
                                  _norm_size(self))


# ---- the sharded step's pieces: the norm's and the used-flags' (mechanics/sharded_step.py, FSDP's state) ---

def shard_pieces(flats: list, grads: list, weight_of=None, copies=None) -> list:
    """What the global norm sums of this rank's shards, [(a run of a gradient shard, weight)]:
    grads[k] is flats[k]'s (S,) gradient shard, or None. Each parameter's run counts
    weight_of(param, n) (default 1), n = copies(flat) ranks holding the same shard (default 1);
    neighbours of one weight merged (one kernel), the padding left out."""
    runs = []                   # (grad, first, last, weight): equal neighbours merged, one kernel
    for flat, grad in zip(flats, grads):
        if grad is None:
            continue
        n = copies(flat) if copies else 1
        for i, start, stop, offset in flat.shard_ranges(flat.comm.rank):
            weight = weight_of(flat.params[i], n) if weight_of else 1.0
            last = offset + stop - start
            if runs and runs[-1][0] is grad and runs[-1][2:] == (offset, weight):
                runs[-1] = (grad, runs[-1][1], last, weight)
            else:
                runs.append((grad, offset, last, weight))
    return [(grad[first:last], weight) for grad, first, last, weight in runs]


def squares_of(pieces: list, device, dtype=torch.float32) -> torch.Tensor:
    """The pieces' weighted squares summed ((1,) in dtype, the masters', on device),
    placements.add_squares's way."""
    return add_squares(pieces, torch.zeros(1, dtype=dtype, device=device))


def shards_norm(flats: list, grads: list, comm: Comm, split: dict) -> torch.Tensor:
    """The global gradient norm from this rank's shards of flats (grads: each flat's (S,)
    gradient shard, or None), summed over comm, the groups the model is split over beside it
    (split, {mesh dim: group}), and HSDP's copies where some shard is not copied (an expert's
    unit spans them; with every shard copied, one copy's squares are the whole). Each run of a
    shard counts as placements.norm_weight says: every value once. Collective."""
    copied = [flat.replicas is not None for flat in flats]
    copies_summed = any(copied) and not all(copied)

    def copies(flat):
        return flat.replicas.world_size if copies_summed and flat.replicas else 1
    squares = squares_of(shard_pieces(flats, grads, lambda p, n: norm_weight(p, split, n), copies),
                         flats[0].params[0].device, flats[0].master.dtype)
    replicas = [flats[copied.index(True)].replicas] if copies_summed else []
    for group in [comm, *split.values(), *replicas]:
        if group.world_size > 1:
            group.all_reduce(squares, op="sum")
    return squares.sqrt()[0]


def or_used_flags(flats: list, device, local: list | None = None) -> tuple:
    """Did any rank compute a gradient for each parameter of the flats?

    The (P,) "used" flags (local, or else each flat's `used`) are OR'ed over the ranks holding
    each flat (its comm), then over HSDP's copies of the shard (its `replicas`). Returns the
    flags on device, their all-reduces launched, and agree(), which waits for them. The message
    is P bytes, one all-reduce per run of flats on one comm."""
    if local is None:
        local = [u for flat in flats for u in flat.used]
    used = flags_to_device(local, device)                                              # (P,)
    launched, first = [], 0
    for comm, run in itertools.groupby(flats, key=lambda flat: flat.comm):
        run = list(run)
        stop = first + sum(len(flat.params) for flat in run)
        handle = comm.all_reduce(used[first: stop], op="max", async_op=True)
        launched.append((handle, run[0].replicas, first, stop))
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
    gradient: the sharded step keeps it unchanged (keep_unchanged), a plain
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
               ) + ring_bytes("all_reduce", 1, _norm_size(flats), comm.world_size)


def _norm_size(flats) -> int:
    """Bytes of the global norm's one number: the masters' dtype (squares_of's), fp32 or fp64."""
    return master_dtype(next(iter(flats)).params[0].dtype).itemsize


def step_message_bytes(n_params: int, world_size: int, norm_size: int = 4) -> int:
    """What a sharded step sends besides the shards (ring): the P used-flags, one byte each,
    as DDP sends them, and the global norm's one fp32 number (norm_size bytes: fp64's 8)."""
    return (ring_bytes("all_reduce", n_params, 1, world_size)
            + ring_bytes("all_reduce", 1, norm_size, world_size))


# ---- the gradient-sync protocol every reducer speaks --------------------------------------

class GradientSyncs:
    """The one gradient-sync protocol, and several reducers driven as one.

    Every reducer in the project speaks it (DDP, ZeRO's optimizers, FSDP, a tensor-parallel
    model's partial sums):
        with sync.no_sync(): backward     gradients wait where they are, nothing reduced
        sync.finish_gradient_sync()       after the step's last backward: every reduction done
    keeps_whole_gradients is True when every member holds whole gradients until the step anyway
    (DDP, ZeRO-1). Running all micro-batches but the last under no_sync() then saves their
    reductions at no memory cost. ZeRO-2 and FSDP reduce each one, so no rank holds a whole
    gradient. The loop and the pipeline drive the members in order: a tensor group's partial sums
    come before the data dimension's reduction, which shards or frees what they read."""

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
