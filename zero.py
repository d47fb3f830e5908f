"""ZeRO stages 1 and 2: shard the optimizer state, then the gradients, over the data-parallel ranks.

Under DDP every rank holds the whole Adam state: 12 of the 16 bytes per parameter in mixed
precision. ZeRO (Rajbhandari et al. 2020, sections 5.1 and 5.2) lays the parameters in a flat
buffer split into N equal shards; rank r keeps the optimizer state (stage 1) and the reduced
gradient (stage 2) of shard r only, updates that shard, and all-gathers the parameters. A
reduce-scatter plus an all-gather move what DDP's all-reduce moves: the memory is free (with
gradient accumulation stage 2 reduce-scatters every micro-batch, DDP all-reduces once a step).
offload=True is ZeRO-Offload (Ren et al. 2021, section 4): the shard's fp32 master and Adam
moments live in host memory and the step runs on the CPU; parameters and gradients stay put.
Left out: stage 3 (fsdp.py: the same FlatParams, ddp.py's), ZeRO++'s quantised messages, offload's
one-step delayed update and a vectorised CPU Adam (torch's own runs on the host).
Run: torchrun --nproc_per_node 2 train.py --strategy zero2; test: python -m pytest tests/test_zero.py

Shapes: N ranks, r this rank, P elements in a bucket, S = ceil(P / N) elements per shard.
"""

import contextlib
import itertools
import weakref

import torch

from collectives import Comm, as_comm, flags_to_device, ring_bytes
from ddp import FlatParams, InOrder, hook_gradient, split_into_buckets
from mixed_precision import (DynamicLossScaler, MasterOptimizer, on_the_wire, parameters_only,
                             unscale_grads)
from placements import by_reduction, grad_norm, norm_weight
from process_groups import check_same_parameters

# Stage 2 (and FSDP) keeps at most this many full gradients in flight, buckets or units: when a
# third fills, backward waits for the oldest reduce-scatter and frees its buffer. Memory stays
# bounded whatever the network's speed; two in flight are enough to keep the link busy.
MAX_REDUCTIONS_IN_FLIGHT = 2


class Bucket(FlatParams):
    """One flat buffer's worth of parameters, sharded over comm, plus this rank's optimizer-side
    state for it."""

    def __init__(self, params, comm):
        super().__init__(params, comm.world_size)
        self.comm = comm
        self.master = None        # (S,) fp32: the shard the inner optimizer updates
        self.grad_shard = None    # (S,) this rank's reduced gradient, in the reduce dtype
        # grad_flat (FlatParams): stage 1 keeps it always, stage 2 only while in flight
        self.host_grad = None     # offload: (S,) fp32 host buffer the reduced gradient lands in
        self.replicas = None      # ranks holding copies of this shard (FSDP's HSDP; ZeRO: none)
        self.used = [False] * len(self.params)   # which got a gradient here since zero_grad()


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

    _decision_host = None   # offload: the norm and flags land here, beside the gradients

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

    def _unscale(self):
        """Offloaded, the norm is taken on the device, where the gradient shards are (and NCCL
        reduces), and copied to the host with them: one wait for all, the step's one host sync,
        then clipping and the inf/NaN check read host memory only."""
        if not self.offload or self._unscaled is not None:
            return super()._unscale()
        grads, masters = self._gradients()                               # (S,) each, on the device
        scale = self.scaler.scale
        norm = self._total_norm(grads, masters) / scale         # a power of two: exact division
        decision = norm.reshape(1).float()                               # (1,) or (1 + P,)
        if self._used_anywhere is not None:
            decision = torch.cat([decision, self._used_anywhere.float()])
        host_grad = {id(flat.master): flat.host_grad for flat in self.flats}
        buffers = [host_grad[id(m)] for m in masters]
        if self._decision_host is None:           # (1 + P,) fp32, pinned once for the run
            flags = sum(len(flat.params) for flat in self.flats)
            self._decision_host = host_buffer(decision.new_empty(1 + flags))
        *grads, decision = gradients_to_host([*grads, decision],
                                             [*buffers, self._decision_host[: decision.numel()]])
        unscale_grads(grads, masters, scale)
        self._used_anywhere = decision[1:] if self._used_anywhere is not None else None
        self._unscaled = masters, decision[0]
        return self._unscaled

    def master_ranges(self) -> list[tuple]:
        """(param, start, stop, master, offset): elements start:stop of param (flattened) have
        their fp32 master, and their optimizer state, at master[offset : offset + stop - start].
        Only this rank's shards: a checkpoint saves every rank's and joins them by name."""
        return [(flat.params[i], start, stop, flat.master, offset) for flat in self.flats
                for i, start, stop, offset in flat.shard_ranges(flat.comm.rank)]

    def host_tensors(self) -> list[torch.Tensor]:
        """What offload keeps in host memory: fp32 masters, optimizer state, gradient buffers."""
        if not self.offload:
            return []
        return [*self.state_tensors(), *(flat.host_grad for flat in self.flats)]

    def _shard_id(self) -> dict:
        return {"rank": self.comm.rank, "world_size": self.comm.world_size}


class ZeroOptimizer(ShardedOptimizer):
    """ZeRO-1: any element-wise torch optimizer (SGD, Adam, AdamW...) on this rank's shards only.

    params: the model's parameters; frozen ones (requires_grad=False) are left alone. Their
    dtype picks the precision: fp32 updates the parameters' own shard in place (it is its own
    master), bf16 and fp16 keep an fp32 master shard, fp16 also scales the loss (scaler).
    stage: 1, or 2 for ZeRO-2 (the constructor then builds a Zero2Optimizer, below).
    group: a collectives.Comm, a process group or None (the world). bucket_mb: the size of
    each flat buffer; stage 2 reduces one bucket while backward computes the next.
    offload: keep the fp32 masters and the optimizer state on the host and step there (the
    device then holds only the parameters and the gradient shards). reduce_dtype: the dtype
    the gradients are reduce-scattered in, and the shard kept (None: the parameters'; torch.float32
    for bf16/fp16 parameters: upcast before the collective, as FSDP2's reduce_dtype).
    Training loop: zero_grad(); scale_loss(loss).backward() per micro-batch;
    clip_grad_norm_(max_norm) if clipping (the global norm: torch.nn.utils' would see stage 2's
    freed .grad as nothing to clip); step(). A torch.optim.Optimizer: schedulers drive it.

    Stage 1 keeps every full gradient in the buckets' flat buffers (param.grad is a view, as
    DDP's) and reduce-scatters them once, at step(): the gradients stay whole until then.
    """

    stage = 1
    keeps_whole_gradients = True        # ddp.GradientSyncs: full buffers until the finish
    _synced = False                     # finish_gradient_sync() ran since the last gradient

    def __new__(cls, params, stage: int = 1, *args, **kwargs):
        # ZeroOptimizer(params, stage=2) is a Zero2Optimizer: one class per stage, one argument.
        return super().__new__(Zero2Optimizer if stage == 2 else cls)

    def __init__(self, params, stage: int = 1, optimizer_cls=torch.optim.AdamW, group=None,
                 bucket_mb: float = 25, scaler: DynamicLossScaler | None = None,
                 offload: bool = False, reduce_dtype: torch.dtype | None = None,
                 **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2, got {stage!r}; stage 3 shards the "
                             f"parameters too: that is FSDP (fsdp.py)")
        trainable = [p for p in parameters_only(params, "ZeroOptimizer") if p.requires_grad]
        if not trainable:
            raise ValueError("ZeroOptimizer: no trainable parameters (requires_grad=True) to shard")
        dtypes = {p.dtype for p in trainable}
        if len(dtypes) > 1 or not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
            raise ValueError(f"ZeroOptimizer needs all trainable parameters in one of fp32, bf16, "
                             f"fp16, got {sorted(map(str, dtypes))}: cast the model first, e.g. "
                             f"model.to(torch.bfloat16)")
        self.comm = as_comm(group)
        check_same_parameters(trainable, self.comm)
        if offload not in (True, False):
            raise ValueError(f"ZeroOptimizer offload must be True (the optimizer on the CPU) or "
                             f"False, got {offload!r}")
        self.offload, self.reduce_dtype = offload, reduce_dtype
        # Reverse registration order is roughly the order backward produces gradients (stage 2
        # reduces buckets as they fill); each bucket is sharded N ways, so rank r's share of
        # the optimizer state is shard r of every bucket: 1/N of the whole, plus padding.
        # A parameter only some data ranks hold (an expert: placements.py's holders) is sharded
        # over its holders, in buckets of its own: placements.data_reduction says how.
        self.buckets = []
        for (comm, op, divide), part in by_reduction(trainable, self.comm):
            for chunk in split_into_buckets(part[::-1], bucket_mb):
                bucket = Bucket(chunk, comm)
                bucket.op, bucket.divide = op, divide
                self.buckets.append(bucket)
        for bucket in self.buckets:
            bucket.comm.broadcast(bucket.flat, src=0)                # ranks start identical
            shard = bucket.shard(bucket.flat, bucket.comm.rank)      # (S,) a view of the parameters
            if offload:
                # Even in fp32 the host needs its own copy: the CPU cannot update device memory.
                bucket.master, bucket.host_grad = host_copy(shard), host_buffer(shard)
            else:
                bucket.master = shard if shard.dtype == torch.float32 else shard.float()
        self.flats, self.masters = self.buckets, [b.master for b in self.buckets]
        super().__init__(self.masters, optimizer_cls, optimizer_kwargs,
                         scaler or DynamicLossScaler(enabled=trainable[0].dtype == torch.float16))
        self._hook_gradients()

    def _hook_gradients(self):
        """Gradients accumulate straight into each bucket's flat buffer: param.grad is a view."""
        for b, bucket in enumerate(self.buckets):
            bucket.grad_flat = torch.zeros_like(bucket.flat)
            for i, (p, view) in enumerate(zip(bucket.params, bucket.views(bucket.grad_flat))):
                p.grad = view
                hook_gradient(p, self._mark_used, b, i)

    def _mark_used(self, b: int, i: int):
        self.buckets[b].used[i] = True
        self._synced = False                                   # a gradient came: reduce again

    def no_sync(self):
        """Stage 1 keeps whole gradients until its finish anyway: nothing to hold back."""
        return contextlib.nullcontext()

    def finish_gradient_sync(self):
        """Reduce-scatter every bucket's full gradient; keep this rank's shard. After the last
        backward (the loop's, a pipeline's) or at step(), whichever comes first: once a step."""
        if self._synced:
            return
        self._synced = True
        for bucket in self.buckets:
            # A parameter that the user's zero_grad(set_to_none=True) or autograd re-created is
            # copied back into the flat buffer once, and becomes a view again.
            for p, view in zip(bucket.params, bucket.views(bucket.grad_flat)):
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view
        reductions = []
        for bucket in self.buckets:
            wire = on_the_wire(bucket.grad_flat, self.reduce_dtype)                  # (N*S,)
            output = wire.new_empty(bucket.shard_numel)                              # (S,)
            # wire, an upcast copy, is kept until its reduce-scatter is waited for
            reductions.append((bucket, output, wire, bucket.comm.reduce_scatter(
                output, wire, op=bucket.op, async_op=True)))
        for bucket, output, _, handle in reductions:
            handle.wait()
            bucket.grad_shard = output.div_(bucket.divide) if bucket.divide != 1 else output

    # ---- the step ----------------------------------------------------------------------

    def _gradients(self):
        """This rank's gradient shards (reduced now, or in backward by stage 2), its masters."""
        self.finish_gradient_sync()
        buckets = [b for b in self.buckets if b.grad_shard is not None]
        # Offloaded (ZeRO-Offload), ShardedOptimizer._unscale copies them out, Adam steps on the
        # CPU, and the parameters go back in. It could overlap more: copy each shard out as its
        # reduce-scatter retires in backward, step bucket i on the CPU while bucket i+1 is still
        # on its way, or (the paper's delayed update) run the whole CPU step beside the next
        # forward, the weights one step stale.
        return [b.grad_shard for b in buckets], [b.master for b in buckets]      # (S,) each

    def _write_back(self):
        self._all_gather_parameters()

    def _release(self):
        # The shard goes too: it is recomputed from the full gradient, which stays until zero_grad().
        for bucket in self.buckets:
            bucket.grad_shard = bucket.master.grad = None
        self._synced = False

    def _all_gather_parameters(self):
        gathers = []
        for bucket in self.buckets:
            shard = bucket.shard(bucket.flat, bucket.comm.rank)
            if bucket.master is not shard:
                # Round the fp32 master into the model. Offloaded, this is the host -> device copy:
                # from pinned memory it is asynchronous, and the stream runs it before the
                # clone below, so bucket i's all-gather overlaps bucket i+1's copy.
                host_to_device(shard, bucket.master)
            # The input is a copy: it must not alias the buffer being gathered into.
            gathers.append(bucket.comm.all_gather(bucket.flat, shard.clone(), async_op=True))
        for handle in gathers:
            handle.wait()

    def refresh_params(self):
        """After the masters were written (a loaded checkpoint): the model's parameters follow."""
        self._all_gather_parameters()

    def zero_grad(self, set_to_none: bool = True):
        """Forget this step's gradients. Stage 1's .grad are views into flat buffers it keeps for
        the next backward (as DDP's gradient_as_bucket_view): they are zeroed whatever
        set_to_none says."""
        for bucket in self.buckets:
            bucket.grad_shard = bucket.master.grad = None
            bucket.used = [False] * len(bucket.params)
            if bucket.grad_flat is not None:
                bucket.grad_flat.zero_()
        self._synced = False

    # ---- bookkeeping ------------------------------------------------------------------------

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The gradient memory this rank holds: full flat buffers (stage 1) or shards (stage 2)."""
        return [t for b in self.buckets for t in (b.grad_flat, b.grad_shard) if t is not None]

    def reductions_per_step(self, micro_batches: int) -> int:
        """Stage 1 reduce-scatters once a step, whatever the gradient accumulation."""
        return 1

    def bytes_per_step(self, micro_batches: int = 1) -> int:
        """Bytes this rank sends per step (ring): reduce-scatter + all-gather of every bucket.

        Each is (N-1)/N of the bucket, together DDP's 2(N-1)/N: ZeRO-1 costs no more traffic
        than DDP (plus the gradient norm's one fp32 number and the used-flags).
        """
        reductions = self.reductions_per_step(micro_batches)
        wire = lambda b: (self.reduce_dtype or b.flat.dtype).itemsize        # the gradient's bytes
        return flags_and_norm_bytes(self.buckets, self.comm) + sum(
            reductions * ring_bytes("reduce_scatter", b.flat.numel(), wire(b), b.comm.world_size)
            + ring_bytes("all_gather", b.flat.numel(), b.flat.element_size(), b.comm.world_size)
            for b in self.buckets)


class Zero2Optimizer(ZeroOptimizer):
    """ZeRO-2: ZeRO-1 plus one difference, gradients freed as soon as they are reduced.

    Each bucket is reduce-scattered the moment backward fills it, and its full gradient freed:
    a rank holds whole gradients only for the buckets in flight, then its 1/N shards. The price:
    with gradient accumulation every micro-batch reduce-scatters (no full buffer is kept to
    add the next micro-batch into), where DDP and ZeRO-1 reduce once a step.
    """

    stage = 2
    keeps_whole_gradients = False       # each bucket reduced and freed as backward fills it

    #   backward   | grads of bucket 0 | grads of bucket 1 | grads of bucket 2 |
    #   network                        |= reduce-scatter 0 =|= reduce-scatter 1 =|= 2 =|
    #   memory       a full gradient buffer exists only for the bucket being filled and the
    #                (at most MAX_REDUCTIONS_IN_FLIGHT) buckets in flight; then only shards

    def _hook_gradients(self):
        self._order = InOrder(self.buckets, self._launch_reduction, self._retire,
                              max_in_flight=MAX_REDUCTIONS_IN_FLIGHT)
        self._backward_hooked = False             # end-of-backward callback queued?
        for b, bucket in enumerate(self.buckets):
            bucket.grad_flat = None                   # allocated while a bucket is in flight
            for i, p in enumerate(bucket.params):
                hook_gradient(p, self._gradient_ready, b, i)

    syncing, _unreduced = True, False

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside leave each gradient whole in .grad, as ZeRO-1 keeps it, and step()
        reduce-scatters them. For a pipeline whose gradients are complete only after backward:
        zero bubble's weight gradients (W), a tied head's two ends summed (pipeline.py)."""
        self.syncing, self._unreduced = False, True
        try:
            yield
        finally:
            self.syncing = True

    def _gradient_ready(self, b: int, i: int):
        if not self.syncing:
            return                                     # under no_sync: it waits in .grad
        if not self._backward_hooked:
            # Runs once backward is over: launch what never filled (unused parameters), wait.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._backward_hooked = True
        self._take(b, i)

    def _take(self, b: int, i: int):
        """Parameter i's gradient into bucket b's buffer; the bucket goes once it is full."""
        bucket = self.buckets[b]
        param = bucket.params[i]
        if bucket.grad_flat is None:                  # (N*S,) lives while in flight, in the reduce dtype
            bucket.grad_flat = torch.zeros_like(bucket.flat, dtype=self.reduce_dtype)
        bucket.view(bucket.grad_flat, i).copy_(param.grad)
        param.grad = None                                            # the full gradient is gone
        bucket.used[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._order.ready(bucket)

    def _launch_reduction(self, bucket: Bucket):
        if bucket.grad_flat is None:                                     # no gradient came
            bucket.grad_flat = torch.zeros_like(bucket.flat, dtype=self.reduce_dtype)
        output = bucket.grad_flat.new_empty(bucket.shard_numel)          # (S,)
        return bucket.comm.reduce_scatter(output, bucket.grad_flat, op=bucket.op, async_op=True), output

    def _retire(self, bucket: Bucket, started):
        """Wait for a bucket's reduce-scatter, keep the shard, free the full gradient."""
        handle, output = started
        handle.wait()
        if bucket.divide != 1:
            output.div_(bucket.divide)
        # Micro-batches of one step (gradient accumulation) add up in the shard.
        bucket.grad_shard = output if bucket.grad_shard is None else bucket.grad_shard.add_(output)
        bucket.grad_flat = None
        bucket.pending = len(bucket.params)

    def _finish_backward(self):
        self._order.launch_rest()                                        # some gradient never came
        self._order.wait_all()
        self._backward_hooked = False

    def finish_gradient_sync(self):
        """Nothing left to reduce (backward did it, bucket by bucket), unless the backwards ran
        under no_sync: then what they left in .grad goes now, in bucket order."""
        if not self._unreduced:        # a flag, the same on every rank: they all reduce, or none
            return
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                if p.grad is not None:
                    self._take(b, i)
        self._finish_backward()
        self._unreduced = False

    def _release(self):
        # The shard is all that is left of the gradient: it stays until zero_grad(), as a .grad.
        for bucket in self.buckets:
            if bucket.master.grad is not bucket.grad_shard:
                bucket.master.grad = None                # an fp32 or host copy lives only inside step()

    def reductions_per_step(self, micro_batches: int) -> int:
        """One reduce-scatter per micro-batch: ZeRO-2 sends more than DDP under accumulation."""
        return micro_batches


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


# ---- CPU offload (ZeRO-Offload), shared with fsdp.py -------------------------------------------

def host_buffer(like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """An empty (fp32) host tensor shaped like `like`, pinned when `like` is on a GPU: only from
    pinned (page-locked) memory can a copy run as a DMA transfer that does not block the CPU."""
    buffer = torch.empty(like.shape, dtype=dtype)
    if like.is_cuda:
        lock_pages(buffer)
    return buffer


def lock_pages(t: torch.Tensor):
    """Pin t's own memory where it is (cudaHostRegister), until its storage is freed: exactly its
    bytes, as memory.py counts them. torch.empty(..., pin_memory=True) would take a block of
    torch's caching host allocator, rounded up to a power of two: up to twice the bytes, for
    buffers held the whole run. (Copies from registered memory run asynchronously too.)"""
    if t.nbytes == 0:
        return
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(t.data_ptr(), t.nbytes, 0))
    # The storage outlives this tensor object (a parameter's .data, views): unpin when it goes.
    weakref.finalize(t.untyped_storage(), cudart.cudaHostUnregister, t.data_ptr())


def host_copy(t: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """An (fp32) copy of `t` in (pinned) host memory."""
    return host_buffer(t, dtype).copy_(t.detach())


def host_to_device(device_tensor: torch.Tensor, host: torch.Tensor):
    """Copy a pinned host tensor into a device tensor (of another dtype: the fp32 master into a
    16-bit shard) without the host waiting. torch converts a dtype on the source's side, and a
    converted host tensor is pageable memory, which the host copies out itself: so the bytes
    cross in the host's dtype, from pinned memory, and are rounded on the device."""
    if host.dtype != device_tensor.dtype:
        host = host.to(device_tensor.device, non_blocking=True)
    device_tensor.copy_(host, non_blocking=True)


def gradients_to_host(grads: list, buffers: list) -> list:
    """Copy each device gradient shard (S,) into its fp32 host buffer (S,); return the buffers."""
    for grad, buffer in zip(grads, buffers):
        buffer.copy_(grad, non_blocking=True)    # queued behind the reduce-scatter that made grad
    if grads and grads[0].is_cuda:
        # One wait for all of them (the copies run back to back): the CPU step must not read a
        # buffer before its bytes have landed.
        torch.cuda.current_stream(grads[0].device).synchronize()
    return buffers
