"""ZeRO stages 1 and 2: shard the optimizer state, then the gradients, over the data-parallel ranks.

Under DDP every rank holds the whole Adam state: 12 of the 16 bytes per parameter in mixed
precision. ZeRO (Rajbhandari et al. 2020, sections 5.1 and 5.2) lays the parameters in a flat
buffer split into N equal shards (flat.py's FlatParams, DDP's buckets too); rank r keeps the
optimizer state (stage 1) and the reduced gradient (stage 2) of shard r only, updates that
shard, and all-gathers the parameters. A reduce-scatter plus an all-gather move what DDP's
all-reduce moves: the memory is free (with gradient accumulation stage 2 reduce-scatters every
micro-batch, DDP all-reduces once a step). Stage 1, then stage 2 as its delta, then
ZeRO-Offload (Ren et al. 2021, section 4) as a delta on either: the shard's fp32 master and Adam
moments in host memory, the step on the CPU (offload.py); parameters and gradients stay put.
Left out: stage 3 (fsdp.py: the same FlatParams), ZeRO++'s quantised messages.
Run: torchrun --nproc_per_node 2 train.py --strategy zero2; test: python -m pytest tests/test_zero.py

Shapes: N ranks, r this rank, P elements in a bucket, S = ceil(P / N) elements per shard.
"""

import contextlib

import torch

from collectives import as_comm, ring_bytes
from flat import (MAX_REDUCTIONS_IN_FLIGHT, FlatParams, InOrder, ShardedOptimizer,
                  flags_and_norm_bytes, hook_gradient, split_into_buckets)
from mixed_precision import DynamicLossScaler, on_the_wire, parameters_only
from offload import OffloadedOptimizer, host_to_device
from placements import by_reduction
from process_groups import check_same_parameters


class Bucket(FlatParams):
    """One flat buffer's worth of parameters, sharded over comm, plus this rank's optimizer-side
    state for it."""

    def __init__(self, params, comm):
        super().__init__(params, comm.world_size)
        self.comm = comm
        self.master = None        # (S,) fp32: the shard the inner optimizer updates
        self.grad_shard = None    # (S,) this rank's reduced gradient, in the reduce dtype
        # grad_flat (FlatParams): stage 1 keeps it always, stage 2 only while in flight
        self.host_grad = None     # ZeRO-Offload (below): (S,) fp32, the gradient copied to the host
        self.replicas = None      # ranks holding copies of this shard (FSDP's HSDP; ZeRO: none)
        self.used = [False] * len(self.params)   # which got a gradient here since zero_grad()


class ZeroOptimizer(ShardedOptimizer):
    """ZeRO-1: any element-wise torch optimizer (SGD, Adam, AdamW...) on this rank's shards only.

    params: the model's parameters; frozen ones (requires_grad=False) are left alone. Their
    dtype picks the precision: fp32 updates the parameters' own shard in place (it is its own
    master), bf16 and fp16 keep an fp32 master shard, fp16 also scales the loss (.scaler, a
    DynamicLossScaler: replace it before the first step for other settings).
    group: a collectives.Comm, a process group or None (the world). bucket_mb: the size of
    each flat buffer; stage 2 reduces one bucket while backward computes the next.
    reduce_dtype: the dtype the gradients are reduce-scattered in, and the shard kept (None:
    the parameters'; torch.float32 for bf16/fp16 parameters: upcast before the collective, as
    FSDP2's reduce_dtype). optimizer_cls(masters, **optimizer_kwargs): the inner optimizer.
    Training loop: zero_grad(); scale_loss(loss).backward() per micro-batch;
    clip_grad_norm_(max_norm) if clipping (the global norm: torch.nn.utils' would see stage 2's
    freed .grad as nothing to clip); step(). A torch.optim.Optimizer: schedulers drive it.
    zero_optimizer(params, stage, offload) below picks the class of a stage, offloaded or not.

    Stage 1 keeps every full gradient in the buckets' flat buffers (param.grad is a view, as
    DDP's) and reduce-scatters them once, at step(): the gradients stay whole until then.
    """

    stage = 1
    keeps_whole_gradients = True        # flat.GradientSyncs: full buffers until the finish
    _synced = False                     # finish_gradient_sync() ran since the last gradient

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, group=None, bucket_mb: float = 25,
                 reduce_dtype: torch.dtype | None = None, **optimizer_kwargs):
        trainable = [p for p in parameters_only(params, "ZeroOptimizer") if p.requires_grad]
        if not trainable:
            raise ValueError("ZeroOptimizer: no trainable parameters (requires_grad=True) to shard")
        dtypes = {p.dtype for p in trainable}
        if len(dtypes) > 1 or not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
            raise ValueError(f"ZeroOptimizer needs all trainable parameters in one of fp32, bf16, "
                             f"fp16, got {sorted(map(str, dtypes))}: cast the model first, e.g. "
                             f"model.to(torch.bfloat16)")
        self.comm, self.reduce_dtype = as_comm(group), reduce_dtype
        check_same_parameters(trainable, self.comm)
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
            bucket.master = self._new_master(bucket, shard)
        self.flats, self.masters = self.buckets, [b.master for b in self.buckets]
        super().__init__(self.masters, optimizer_cls, optimizer_kwargs,
                         DynamicLossScaler(enabled=trainable[0].dtype == torch.float16))
        self._hook_gradients()

    def _new_master(self, bucket: Bucket, shard: torch.Tensor) -> torch.Tensor:
        """The (S,) fp32 tensor the inner optimizer updates: in fp32 the parameters' own shard."""
        return shard if shard.dtype == torch.float32 else shard.float()

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
                self._master_into_model(shard, bucket.master)          # (S,) rounded
            # The input is a copy: it must not alias the buffer being gathered into.
            gathers.append(bucket.comm.all_gather(bucket.flat, shard.clone(), async_op=True))
        for handle in gathers:
            handle.wait()

    def _master_into_model(self, shard: torch.Tensor, master: torch.Tensor):
        """Round the fp32 master into the model's (16-bit) shard, before its all-gather."""
        shard.copy_(master)

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


# ---- ZeRO-Offload: a delta on either stage ------------------------------------------------------

class ZeroOffload(OffloadedOptimizer):
    """ZeRO-Offload (Ren et al. 2021, section 4) on a ZeRO stage: each bucket's master shard and
    its Adam moments in host memory, the step on the CPU (offload.py's); the device keeps the
    parameters and the gradients (stage 1's full buffers, stage 2's shards), as without it."""

    def _new_master(self, bucket: Bucket, shard: torch.Tensor) -> torch.Tensor:
        return self._host_master(bucket, shard)                          # (S,) fp32, on the host

    # The step: OffloadedOptimizer._unscale copies the gradient shards out, Adam steps on the
    # CPU, and the parameters go back in. It could overlap more: copy each shard out as its
    # reduce-scatter retires in backward, step bucket i on the CPU while bucket i+1 is still
    # on its way, or (the paper's delayed update) run the whole CPU step beside the next
    # forward, the weights one step stale.

    def _master_into_model(self, shard: torch.Tensor, master: torch.Tensor):
        # The host -> device copy: from pinned memory it is asynchronous, and the stream runs it
        # before the all-gather's clone, so bucket i's all-gather overlaps bucket i+1's copy.
        host_to_device(shard, master)


class ZeroOffloadOptimizer(ZeroOffload, ZeroOptimizer):
    """ZeRO-1 with ZeRO-Offload: the full gradients on the device, the step on the host."""


class Zero2OffloadOptimizer(ZeroOffload, Zero2Optimizer):
    """ZeRO-2 with ZeRO-Offload: the gradient shards on the device, the step on the host."""


ZERO = {(1, False): ZeroOptimizer, (2, False): Zero2Optimizer,
        (1, True): ZeroOffloadOptimizer, (2, True): Zero2OffloadOptimizer}


def zero_optimizer(params, stage: int = 1, offload: bool = False, **kwargs) -> ZeroOptimizer:
    """ZeRO as the command line names it: the optimizer of `stage` (1 or 2), with ZeRO-Offload
    when `offload`; kwargs go to its constructor (ZeroOptimizer's)."""
    if stage not in (1, 2):
        raise ValueError(f"ZeRO stage must be 1 or 2, got {stage!r}; stage 3 shards the "
                         f"parameters too: that is FSDP (fsdp.py)")
    if offload not in (True, False):
        raise ValueError(f"ZeroOptimizer offload must be True (the optimizer on the CPU) or "
                         f"False, got {offload!r}")
    return ZERO[stage, offload](params, **kwargs)
