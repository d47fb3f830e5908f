"""ZeRO stages 1 and 2: shard the optimizer state, then the gradients, over the data-parallel ranks.

Under DDP every rank holds the whole Adam state: 12 of the 16 bytes per parameter in mixed
precision. ZeRO (Rajbhandari et al. 2020, sections 5.1 and 5.2) lays the parameters in flat
buffers, the buckets of foundations/flat.py, each split into N equal shards. The model's
parameters are views into those buffers: an all-gather into a buffer updates the model.
Rank r keeps the optimizer state (stage 1) and the reduced gradient (stage 2) of shard r only.
It updates that shard with the inner optimizer on an fp32 master, then all-gathers the
parameters. Every rank still holds all the parameters, as under DDP.
The lecture counts DDP's all-reduce at 2 bytes per parameter, the 16-bit gradient. A ring
all-reduce is a reduce-scatter then an all-gather: in one dtype ZeRO moves the same bytes (plus
one scalar all-reduce for the gradient norm, which DDP's ranks compute without talking).
Comm (foundations/comm.py) runs torch.distributed's collectives on its group, bytes counted:
comm.reduce_scatter(out, inp, op), all_gather(out, inp) and all_reduce(t, op) are
dist.reduce_scatter_tensor, all_gather_into_tensor and all_reduce; op "avg", "sum" or "max".
Stage 1, then stage 2 as its delta. Left out: stage 3 (fsdp.py, on the same flat buffers),
ZeRO-Offload (extensions/zero_offload.py), ZeRO++.
Run alone: torchrun --nproc_per_node 2 zero.py; test: python -m pytest tests/test_zero.py

Shapes: N ranks, r this rank, P elements in a bucket, S = ceil(P / N) elements per shard.
(A bucket's used-flags are one per parameter tensor, not per element.)
"""

import contextlib
import copy
import math
import os

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grads_with_norm_

from foundations.comm import Comm
from foundations.alone import start_alone
from foundations.flat import ShardedBuckets
from mechanics.sharded_step import ShardedStep


class ZeroOptimizer(ShardedStep.Owner, torch.optim.Optimizer):
    """ZeRO-1: any element-wise torch optimizer (optimizer_cls) on this rank's shards only.

    Loop: zero_grad(); scale_loss(loss).backward(); clip_grad_norm_(max_norm) to clip; step().
    Use this clip_grad_norm_: torch's sees no reduced gradient, only this rank's own.
    Stage 1 accumulates whole gradients in the buckets' flat buffers, in the parameters' dtype
    (param.grad is a view, as in DDP). It reduce-scatters them once, at step(), in reduce_dtype.
    params: fp32 (each its own master) or bf16/fp16 (an fp32 master shard). group: a Comm, a
    process group or None (the world). reduce_dtype: the gradients' dtype on the wire.
    From ShardedStep.Owner (mechanics/sharded_step.py): .scaler, mixed_precision.py's loss
    scale (fp16: .scale multiplies the loss; .update(skipped) halves it after inf/NaN, grows it
    after a clean run), scale_loss, state_dict and state_tensors (the checkpoints' tensors).
    A torch.optim.Optimizer (foundations/inner_optimizer.py shares the inner one's param_groups):
    lr schedulers drive it."""

    stage = 1
    keeps_whole_gradients = True     # foundations/flat.py's GradientSyncs: whole until the step

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, group=None,
                 bucket_mb: float = 25, reduce_dtype: torch.dtype | None = None,
                 mean_over: int | None = None, **optimizer_kwargs):
        self.comm, self.reduce_dtype = Comm.from_group(group), reduce_dtype   # None: the world
        # The group's mean; or, with mean_over, the sum / mean_over: an expert's ranks, fewer than
        # the data ranks whose tokens they saw, divide by the data ranks.
        self.op, self.divide = ("avg", 1) if mean_over is None else ("sum", mean_over)
        # The parameters, in backward's (reverse) order, cut into buckets of about bucket_mb, each
        # padded to N*S, rank 0's values broadcast (the ranks' shapes checked to be the same).
        self.buckets = ShardedBuckets(params, self.comm, bucket_mb, "ZeroOptimizer")
        # Rank r's share of the optimizer state: shard r of every bucket, 1/N of it (+ padding).
        for bucket in self.buckets:
            shard = bucket.shard(bucket.flat, self.comm.rank)     # (S,) a view of the parameters
            bucket.master = self._new_master(bucket, shard)
        # The inner optimizer on those fp32 masters, fp16's loss scale, the checkpoints' side.
        self.shard_step = ShardedStep(self, self.buckets, self.comm, optimizer_cls,
                                      optimizer_kwargs)
        self.masters = self.shard_step.masters
        self.optimizer = self.shard_step.optimizer    # the inner one: its state is ours too
        self.device = self.shard_step.device               # where the gradient shards are
        self.last_grad_norm, self.last_step_skipped = None, False
        self._synced = False      # reduce-scattered since the last gradient came
        self._start_step()
        self._hook_gradients()

    # ---- the step, as the lecture draws it -------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One ZeRO step. The lecture's three moves are phases 1 (reduce-scatter), 6 (update this
        rank's shard) and 7 (all-gather). Phases 2-5 are what any mixed-precision step with
        clipping does (mixed_precision.py), here on the shards: unscale, the global norm (also the
        inf/NaN test, so it runs without clipping too), clip, one host read.
        Phases 1-3 run once a step: when the loop called clip_grad_norm_(max_norm) first, they
        ran there, and phase 4 clips by max_norm."""
        with torch.enable_grad():
            loss = None if closure is None else closure()
        self.reduce_gradients()        # 1 reduce-scatter: this rank's (S,) shard of each bucket
        self.unscale_gradients()       # 2 each shard / the loss scale, as its fp32 master's .grad
        norm = self.global_norm()      # 3 the shards' squares, one all-reduce: the whole norm
        if self.max_norm is not None:
            self.clip(self.max_norm, norm)    # 4 the masters' .grad times min(1, max_norm / norm)
        # 5 The one host read: the norm (inf/NaN: skip), the used-flags beside it as 0.0/1.0
        if self._used is None:
            norm, used = norm.item(), None
        else:
            norm, *used = torch.cat([norm.reshape(1), self._used.to(norm.dtype)]).tolist()
        self.update(norm, used)          # 6 optimizer.step() on the masters, 7 the all-gather
        self.scaler.update(self.last_step_skipped)   # fp16: a skip shrinks the scale, runs grow it
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Phases 1-3 of step() now; step() then clips by min(1, max_norm / norm) (phase 4).
        Returns the norm before clipping, a device tensor (no host read: step() makes it)."""
        self.shard_step.check_max_norm(max_norm)          # a float > 0, else ValueError
        self.max_norm = max_norm
        self.reduce_gradients()
        self.unscale_gradients()
        return self.global_norm()

    @torch.no_grad()
    def update(self, norm: float, used: list | None = None):
        """Phases 6 and 7, given the host read (step()'s, or a mesh's): the norm as a float, the
        used-flags as a list (None: every parameter was used). Not finite: skip the step."""
        self.last_grad_norm = norm                       # before clipping; inf/NaN if skipped
        self.last_step_skipped = not math.isfinite(norm)
        if not self.last_step_skipped:
            # Unused parameters: their slice of a shard holds zeros, which AdamW would still
            # decay; torch's optimizers skip a .grad None. So those elements are put back.
            with self.shard_step.unused_unchanged(used):
                self.optimizer.step()          # 6 the inner optimizer on the (S,) fp32 masters
            self.all_gather_parameters()       # 7 every rank's updated shard to every rank
        self._release()

    def zero_grad(self, set_to_none: bool = True):
        """Forget this step's gradients. Stage 1's .grad are views into flat buffers it keeps for
        the next backward (as DDP's gradient_as_bucket_view): zeroed whatever set_to_none says."""
        for bucket in self.buckets:
            bucket.grad_shard = bucket.master.grad = None
            bucket.used = [False] * len(bucket.params)
            if bucket.grad_flat is not None:
                bucket.grad_flat.zero_()
        self._release()

    # ---- the phases, public: a mesh (composition/mesh_optimizer.py) runs them with its norm -

    def reduce_gradients(self):
        """Phase 1: reduce-scatter every bucket's whole gradient and keep this rank's shard.
        Once a step: after the last backward (the loop's, a pipeline's), or at step()."""
        if self._synced:
            return
        self._synced = True
        self._gradients_into_buckets()
        # In bucket order on every rank (collectives pair up by the order they are called), a
        # few in flight at most (foundations/flat.py's InOrder): launch, then finish each. The
        # copies cast for the wire are bounded too, never a second whole gradient in fp32.
        order = self.buckets.in_order(self._launch_reduction, self._finish_reduction)
        for bucket in self.buckets:
            order.ready(bucket)
        order.wait_all()

    def _launch_reduction(self, bucket):
        wire = bucket.grad_flat.to(self.reduce_dtype or bucket.grad_flat.dtype)   # (N*S,)
        output = wire.new_empty(bucket.shard_numel)                              # (S,)
        handle = self.comm.reduce_scatter(output, wire, op=self.op, async_op=True)
        return handle, output, wire                     # the wire is kept until the wait

    def _finish_reduction(self, bucket, started):
        """Wait for a bucket's reduce-scatter and keep this rank's shard (the whole gradient
        stays, for the next micro-batch's backward to add into)."""
        handle, output, _ = started
        handle.wait()
        bucket.grad_shard = output.div_(self.divide) if self.divide != 1 else output

    def gradient_shards(self) -> list:                 # each bucket's (S,) shard, or None
        return [bucket.grad_shard for bucket in self.buckets]

    def unscale_gradients(self) -> list:
        """Phase 2, once a step (after phase 1, run here if need be): each gradient shard / the
        loss scale, in fp32, as its master's .grad. The upcast comes first: divided in fp16,
        the small gradients the scale rescued would underflow again.
        Returns the masters' .grad (None where a bucket has no shard)."""
        self.reduce_gradients()
        if not self._unscaled:
            self._unscaled, scale = True, self.scaler.scale
            for bucket in self.buckets:
                grad, master = bucket.grad_shard, bucket.master
                if grad is None:
                    continue
                # .to() returns grad itself when it is fp32 already: the shard is then the grad
                master.grad = grad.to(master.dtype)                    # (S,) fp32
                if scale != 1.0:
                    master.grad.div_(scale)
        return [b.master.grad if b.grad_shard is not None else None for b in self.buckets]

    def global_norm(self) -> torch.Tensor:
        """Phase 3, once a step: the squares of this rank's shards, summed over the ranks in one
        all-reduce (the shards are disjoint), then the root: a device scalar, the same on every
        rank. The used-flags' all-reduce runs beside it."""
        if self._norm is None:
            used, wait_for_flags = self.launch_used_flags()
            # (1,) fp32: sum of weight * piece**2 over norm_pieces(), this rank's share
            squares = self.shard_step.squares(self.norm_pieces())
            if self.comm.world_size > 1:
                self.comm.all_reduce(squares, op="sum")
            wait_for_flags()
            self._norm, self._used = squares.sqrt()[0], used
        return self._norm

    def norm_pieces(self, weight_of=None) -> list:
        """[(a run of a gradient shard, its weight)]: each parameter's elements of each shard,
        the padding left out. A weight is weight_of(param, 1), default 1 (a mesh's own)."""
        return self.shard_step.pieces(self.unscale_gradients(), weight_of)

    def clip(self, max_norm: float, norm: torch.Tensor):
        """Phase 4: the masters' .grad times min(1, max_norm / norm) (torch's, given the norm)."""
        grads = self.unscale_gradients()
        clip_grads_with_norm_([b.master for b, g in zip(self.buckets, grads) if g is not None],
                              max_norm, norm)

    def all_gather_parameters(self):
        """Phase 7: each rank's updated shard, rounded into the model's dtype, to every rank."""
        gathers = []
        for bucket in self.buckets:
            shard = bucket.shard(bucket.flat, self.comm.rank)          # (S,) a view
            if bucket.master.data_ptr() != shard.data_ptr():   # else the master is the shard
                self._master_into_model(shard, bucket.master)
            # Sent from a copy: the output buffer holds the shard, and the two must not alias.
            gathers.append(self.comm.all_gather(bucket.flat, shard.clone(), async_op=True))
        for handle in gathers:
            handle.wait()

    # ---- stage 1's gradients: whole, in the buckets' flat buffers ---------------------------

    def _hook_gradients(self):
        """Gradients accumulate straight into each bucket's flat buffer: param.grad is a view."""
        for bucket in self.buckets:
            bucket.grad_flat = torch.zeros_like(bucket.flat)
            for p, view in zip(bucket.params, bucket.views(bucket.grad_flat)):
                p.grad = view
        self.buckets.hook_gradients(self._mark_used)      # _mark_used(b, i) after each gradient

    def _mark_used(self, b: int, i: int):
        self.buckets[b].used[i] = True
        self._synced = False                                   # a gradient came: reduce again

    no_sync = contextlib.nullcontext     # stage 1 keeps whole gradients until the step anyway

    def finish_gradient_sync(self):  # foundations/flat.py's GradientSyncs: every reducer's
        self.reduce_gradients()

    # ---- corner cases, after the core -------------------------------------------------------

    def launch_used_flags(self) -> tuple:
        """Unused parameters: one that no rank used must not move, so the ranks OR their "used"
        flags: an async comm.all_reduce(op="max") of 0/1 flags, one per parameter tensor, beside
        the norm's. Returns (the flags, or None where this rank used every parameter; a function
        that waits)."""
        return self.shard_step.launch_used_flags()

    def _new_master(self, bucket, shard: torch.Tensor) -> torch.Tensor:
        """The (S,) tensor the inner optimizer updates: for fp32 or fp64 parameters the shard
        itself, for 16-bit ones an fp32 copy (extensions/zero_offload.py's: in host memory)."""
        return shard if shard.dtype in (torch.float32, torch.float64) else shard.float()

    def _master_into_model(self, shard: torch.Tensor, master: torch.Tensor):
        """Round the fp32 master into the model's (16-bit) shard, before its all-gather
        (extensions/zero_offload.py overrides it: a copy from the host)."""
        shard.copy_(master)

    def _gradients_into_buckets(self):
        """A .grad made anew (zero_grad(set_to_none) in a caller, autograd after .grad = None)
        is no view of the bucket: copy it in, and make .grad a view again."""
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views(bucket.grad_flat)):
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view

    def _release(self):
        """After a step or zero_grad(): stage 1 drops the shards and the masters' .grad (the next
        reduce recomputes them from the whole gradients it keeps). The next step starts over."""
        for bucket in self.buckets:
            bucket.grad_shard = bucket.master.grad = None
        self._synced = False
        self._start_step()

    def _start_step(self):
        self._unscaled, self._norm, self._used, self.max_norm = False, None, None, None

    def refresh_params(self):           # the masters were written (a checkpoint): the model follows
        self.all_gather_parameters()

    # ---- bookkeeping: what the meters ask (the checkpoints' questions: ShardedStep.Owner) ---

    flats = property(lambda self: self.buckets)     # the name mechanics/offload.py reads

    def host_tensors(self) -> list[torch.Tensor]:     # none (ZeRO-Offload keeps the masters there)
        return []

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The gradient memory this rank holds: whole flat buffers (stage 1) or shards (stage 2)."""
        return [t for b in self.buckets for t in (b.grad_flat, b.grad_shard) if t is not None]


class Zero2Optimizer(ZeroOptimizer):
    """ZeRO-2: ZeRO-1, but each bucket is reduce-scattered the moment backward fills it, and its
    whole gradient freed: a rank holds whole gradients only for the buckets in flight, then its
    1/N shards. The price: with gradient accumulation every micro-batch reduce-scatters (no whole
    buffer is kept to add the next one into), where ZeRO-1 (and DDP under no_sync) reduce once.
    The lecture reduces layer J's gradient to the one worker that owns J. Here each rank owns 1/N
    of every bucket, so each bucket is reduce-scattered over all: the same idea, another layout."""

    stage, keeps_whole_gradients = 2, False     # each bucket reduced and freed in backward
    # syncing: False inside no_sync(), where the hooks leave each .grad alone.
    # _unreduced: True once a backward under no_sync() left gradients in .grad to reduce.
    syncing, _unreduced = True, False

    #   backward   | grads of bucket 0 | grads of bucket 1 | grads of bucket 2 |
    #   network                        |= reduce-scatter 0 =|= reduce-scatter 1 =|= 2 =|
    #   memory     whole buffers only for the buckets filling or in flight (InOrder's cap); shards

    def _hook_gradients(self):
        self._order = self.buckets.in_order(self._launch_reduction, self._finish_reduction)
        self._backward_hooked = False             # end-of-backward callback queued?
        for bucket in self.buckets:
            bucket.grad_flat = None                   # allocated while a bucket is in flight
        self.buckets.hook_gradients(self._gradient_ready)   # _gradient_ready(b, i) each gradient

    def _gradient_ready(self, b: int, i: int):
        if not self.syncing:
            return                                     # under no_sync: it waits in .grad
        if not self._backward_hooked:
            # Runs once backward is over: launch what never filled (unused parameters), wait.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._backward_hooked = True
        self._take(b, i)

    def _take(self, b: int, i: int):
        """Take parameter i's .grad into bucket b's buffer: copy it (in reduce_dtype), free it.
        The bucket goes once full. The buffer lives until its reduce-scatter is waited for: the
        peak memory is the buckets in flight."""
        bucket = self.buckets[b]
        if bucket.grad_flat is None:                                   # (N*S,)
            bucket.grad_flat = torch.zeros_like(bucket.flat, dtype=self.reduce_dtype)
        bucket.view(bucket.grad_flat, i).copy_(bucket.params[i].grad)
        bucket.params[i].grad = None           # before the reduction: the whole gradient is gone
        bucket.used[i] = True
        bucket.pending -= 1          # gradients yet to come (foundations/flat.py's FlatParams)
        if bucket.pending == 0:
            self._order.ready(bucket)

    def _launch_reduction(self, bucket):
        if bucket.grad_flat is None:                                     # no gradient came
            bucket.grad_flat = torch.zeros_like(bucket.flat, dtype=self.reduce_dtype)
        output = bucket.grad_flat.new_empty(bucket.shard_numel)          # (S,)
        return self.comm.reduce_scatter(output, bucket.grad_flat, op=self.op, async_op=True), output

    def _finish_reduction(self, bucket, started):
        """Wait for a bucket's reduce-scatter, add its shard to the step's, free the gradient."""
        handle, output = started
        handle.wait()
        output = output.div_(self.divide) if self.divide != 1 else output
        # Accumulating: each micro-batch's shard adds to the earlier ones'.
        bucket.grad_shard = output if bucket.grad_shard is None else bucket.grad_shard.add_(output)
        bucket.grad_flat = None
        bucket.pending = len(bucket.params)

    def _finish_backward(self):
        self._order.launch_rest()                                        # some gradient never came
        self._order.wait_all()
        self._backward_hooked = False

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside leave each gradient whole in .grad, reduced at the finish (or step()):
        for gradients complete only after backward (zero bubble's W, a tied head, pipeline.py)."""
        self.syncing, self._unreduced = False, True
        try:
            yield
        finally:
            self.syncing = True

    def reduce_gradients(self):
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

    def zero_grad(self, set_to_none: bool = True):
        """Stage 1's, and the gradients backwards under no_sync() left whole in .grad: stage 2
        holds no buffer for them, so they go whatever set_to_none says."""
        super().zero_grad(set_to_none)
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None
        self._unreduced = False

    def _release(self):
        # Unlike stage 1's, the shard stays until zero_grad(): all that is left of the gradient.
        # The master's .grad goes, unless the unscale made it the shard itself (an fp32 shard).
        for bucket in self.buckets:
            if bucket.master.grad is not bucket.grad_shard:
                bucket.master.grad = None
        self._start_step()


if __name__ == "__main__":
    start_alone(torchrun=True)
    # A tiny model, 5 steps on each rank's rows (fp32: no scale_loss), beside one process's AdamW.
    dist.init_process_group("gloo")
    world, failed = Comm(), False
    for stage, cls in ((1, ZeroOptimizer), (2, Zero2Optimizer)):
        torch.manual_seed(0)
        one = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        model, reference = copy.deepcopy(one), torch.optim.AdamW(one.parameters(), lr=1e-2)
        ours = cls(model.parameters(), group=world, bucket_mb=0.001, lr=1e-2)   # 3 buckets
        rows = slice(world.rank * 8, (world.rank + 1) * 8)   # equal counts: mean of means = mean
        for _ in range(5):
            n = 8 * world.world_size
            x, y = torch.randn(n, 8), torch.randn(n, 4)                 # every rank's rows
            for net, opt, r in ((model, ours, rows), (one, reference, slice(None))):
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(x[r]), y[r]).backward()
                if opt is ours:        # the gradient elements held between backward and step
                    held = sum(t.numel() for t in ours.gradient_buffers())
                opt.step()
        difference = max((a - b).abs().max().item()
                          for a, b in zip(model.parameters(), one.parameters()))
        # What is sharded: AdamW's 2 moments, ceil(P / N) of each bucket's P elements per rank.
        # The weights stay whole on every rank (fp32: the master is this rank's shard of them).
        # Gradients held: stage 1 each bucket whole (N*S, padded), stage 2 its (S,) shard only.
        moments = sum(t.numel() for t in ours.state_tensors()) - sum(map(len, ours.masters))
        shard = sum(math.ceil(sum(p.numel() for p in b.params) / world.world_size)
                    for b in ours.buckets)
        whole = sum(p.numel() for p in one.parameters())
        grads = world.world_size * shard if stage == 1 else shard
        failed |= not difference <= 1e-5 or moments != 2 * shard or held != grads
        if world.rank == 0:
            print(f"ZeRO-{stage}, {len(ours.buckets)} buckets: rank 0 keeps AdamW's 2 moments for "
                  f"{shard} of the {whole} weights (1/{world.world_size} of each bucket) and "
                  f"{held} gradient elements ({'whole' if stage == 1 else 'its shards'}); all "
                  f"{whole} weights on every rank | max |difference| from one process: "
                  f"{difference:.1e} (bound 1e-05: fp32 sums reordered)", flush=True)
    dist.destroy_process_group()
    os._exit(int(failed))  # at once: gloo's threads may still hold tensors (exit_distributed)
