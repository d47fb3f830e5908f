"""ZeRO stages 1 and 2: shard the optimizer state, then the gradients, over the data-parallel ranks.

Under DDP every rank holds the whole Adam state: 12 of the 16 bytes per parameter in mixed
precision. ZeRO (Rajbhandari et al. 2020, sections 5.1 and 5.2) lays the parameters in a flat
buffer split into N equal shards (foundations/flat.py's buckets); rank r keeps the optimizer state
(stage 1) and the reduced gradient (stage 2) of shard r only, updates that shard (the inner
optimizer on its fp32 masters: foundations/sharded_step.py), and all-gathers the parameters.
A reduce-scatter plus an all-gather move what DDP's all-reduce moves, with gradients and parameters
in one dtype: the memory saved costs no extra communication (but stage 2 reduce-scatters every
micro-batch of an accumulated step). bf16 gradients reduced in fp32 (train.py's default) make the
reduce-scatter twice the all-gather: 0.75x DDP's all-reduce, which is then fp32 too.
Stage 1, then stage 2 as its delta. Left out: stage 3 (fsdp.py: the same FlatParams),
ZeRO-Offload (zero_offload.py), ZeRO++.
Run alone: torchrun --nproc_per_node 2 zero.py; test: python -m pytest tests/test_zero.py

Shapes: N ranks, r this rank, P elements in a bucket, S = ceil(P / N) elements per shard.
"""

import contextlib
import copy
import os

import torch
import torch.distributed as dist

from collectives import as_comm
from foundations.alone import start_alone
from foundations.flat import ShardedBuckets
from foundations.sharded_step import ShardedStep


class ZeroOptimizer(ShardedStep.Owner, torch.optim.Optimizer):
    """ZeRO-1: any element-wise torch optimizer (optimizer_cls) on this rank's shards only.

    params: the trainable ones, in fp32 (each its own master) or bf16/fp16 (an fp32 master
    shard; fp16 scales the loss: .scaler). group: a Comm, a process group or None (the world).
    bucket_mb: each flat buffer's size. reduce_dtype: the gradients' dtype on the wire and in
    the shard (None: the parameters'). mean_over: the gradient is the sum over group / this
    many ranks (None: the group's mean). A torch.optim.Optimizer: schedulers drive it.
    Loop: zero_grad(); scale_loss(loss).backward(); this clip_grad_norm_ (torch's sees no reduced .grad); step().
    Stage 1 accumulates full gradients in the buckets' flat buffers in the parameters' dtype
    (param.grad is a view, as DDP's), reduce-scattered once, at step(), in reduce_dtype."""

    stage = 1
    keeps_whole_gradients = True        # flat.GradientSyncs: full buffers until the finish

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, group=None, bucket_mb: float = 25,
                 reduce_dtype: torch.dtype | None = None, mean_over: int | None = None,
                 **optimizer_kwargs):
        self.comm, self.reduce_dtype = as_comm(group), reduce_dtype
        self.op, self.divide = ("avg", 1) if mean_over is None else ("sum", mean_over)
        self.buckets = ShardedBuckets(params, self.comm, bucket_mb, "ZeroOptimizer")   # the trainable ones
        # Rank r's share of the optimizer state: shard r of every bucket, 1/N of it (plus padding).
        for bucket in self.buckets:
            shard = bucket.shard(bucket.flat, self.comm.rank)        # (S,) a view of the parameters
            bucket.master = self._new_master(bucket, shard)
        # The inner optimizer on those fp32 masters, and fp16's loss scale: this rank's step.
        self.shard_step = ShardedStep(self, self.buckets, self.comm, optimizer_cls, optimizer_kwargs)
        # What a mesh (mesh_optimizer.py), offload.py and the checkpoints read (FSDP's optimizer's too):
        self.flats, self.masters, self.optimizer = self.buckets, self.shard_step.masters, self.shard_step.optimizer
        self.device = self.shard_step.device          # where the gradient shards are
        self.last_grad_norm, self.last_step_skipped = None, False
        self._release()        # how far the step got, none yet: _synced (reduced), _norm, _used (global_norm)
        self._hook_gradients()

    # ---- the step, as the lecture draws it ---------------------------------------------------

    def step(self, closure=None):
        """One call per phase, in order; each runs once a step (after clip_grad_norm_, 1-3 return at once)."""
        with torch.enable_grad():
            loss = None if closure is None else closure()
        self.reduce_gradients()          # 1 reduce-scatter: this rank's (S,) shard of each bucket
        self.unscale_gradients()         # 2 the shards / the loss scale, into the fp32 masters' .grad
        norm_on_device = self.global_norm()    # 3 the shards' squares, one all-reduce: a tensor
        # 4 clipping is clip_grad_norm_(max_norm)'s, if the loop called it: by this norm, already
        norm, used = self.shard_step.read_decision(norm_on_device, self._used)   # 5 the one host read
        self.update(norm, used)          # 6 inf/NaN: skip; else the inner step, 7 the all-gather
        self.scaler.update(self.last_step_skipped)               # 8 the loss scale follows
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Phases 1-3 of step(), then 4: the masters' .grad scaled by min(1, max_norm / norm).
        Returns the norm before clipping, a device tensor (no host read: step() makes it)."""
        self.shard_step.check_max_norm(max_norm)
        self.reduce_gradients()
        self.unscale_gradients()
        self.clip(max_norm, self.global_norm())
        return self._norm

    @torch.no_grad()
    def update(self, norm: float, used: list | None = None):
        """Phases 6 and 7, given the host read (step()'s, or a composition's, mesh_optimizer.py):
        the norm as a float, not finite -> skip the step; the used-flags as a list."""
        self.last_grad_norm = norm                       # before clipping; inf/NaN if skipped
        self.last_step_skipped = not self.shard_step.step(norm, used)     # unused parameters kept
        if not self.last_step_skipped:
            self.all_gather_parameters()
        self._release()

    # ---- the phases, public: a composition (mesh_optimizer.py) runs them with its own norm ---

    def gradient_shards(self) -> list:                      # each bucket's (S,) shard, or None
        return [b.grad_shard for b in self.buckets]

    def unscale_gradients(self) -> list:
        """Phase 2: each bucket's gradient shard / the loss scale, in fp32, as its master's .grad
        (or None); after phase 1, which it runs if not yet done (a composition calls it alone)."""
        self.reduce_gradients()
        return self.shard_step.unscale(self.gradient_shards())

    def global_norm(self) -> torch.Tensor:
        """Phase 3, once a step: sqrt(the shards' squares summed over the group), a device scalar,
        the whole norm on every rank (the shards are disjoint); the used-flags' all-reduce beside it."""
        if self._norm is None:
            self._used, agree = self.launch_used_flags()
            squares = self.shard_step.squares(self.norm_pieces())     # (1,) this rank's sum
            if self.comm.world_size > 1:
                self.comm.all_reduce(squares, op="sum")
            agree()
            self._norm = squares.sqrt()[0]
        return self._norm

    def norm_pieces(self, weight_of=None) -> list:
        """[(a run of a gradient shard, weight_of(param, 1), default 1)]: what the norm sums."""
        return self.shard_step.pieces(self.unscale_gradients(), weight_of)   # phase 2's, run already

    def launch_used_flags(self) -> tuple:      # (did any rank use each parameter: flags, or None), agree()
        return self.shard_step.launch_used_flags()

    def clip(self, max_norm: float, norm: torch.Tensor):     # phase 4: the shards times min(1, max_norm / norm)
        self.shard_step.clip(max_norm, norm, self.unscale_gradients())

    # ---- the mechanics: stage 1's buffers, the reduce-scatter, the all-gather -----------------

    def _new_master(self, bucket, shard: torch.Tensor) -> torch.Tensor:
        """The (S,) tensor the inner optimizer updates: fp32 (in fp32, fp64: the shard itself)."""
        return shard if shard.dtype in (torch.float32, torch.float64) else shard.float()

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

    no_sync = contextlib.nullcontext     # stage 1 keeps whole gradients until its finish anyway

    def finish_gradient_sync(self):          # flat.GradientSyncs' name for reduce_gradients
        self.reduce_gradients()

    def reduce_gradients(self):
        """Reduce-scatter every bucket's full gradient, keep this rank's shard: once a step, after
        the last backward (the loop's, a pipeline's) or at step(), whichever comes first."""
        if self._synced:
            return
        self._synced = True
        for bucket in self.buckets:   # a .grad re-created (zero_grad(set_to_none), autograd): a view again
            for p, view in zip(bucket.params, bucket.views(bucket.grad_flat)):
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view
        # In bucket order, a few in flight (in_order's cap): the upcast copies on the wire are
        # bounded too, not one per bucket at once (a second whole gradient in fp32).
        order = self.buckets.in_order(self._launch_reduction, self._retire)
        for bucket in self.buckets:
            order.ready(bucket)
        order.wait_all()

    def _launch_reduction(self, bucket):
        wire = bucket.grad_flat.to(self.reduce_dtype or bucket.grad_flat.dtype)   # (N*S,) itself, or cast
        output = wire.new_empty(bucket.shard_numel)                              # (S,)
        return self.comm.reduce_scatter(output, wire, op=self.op, async_op=True), output, wire  # wire kept till waited

    def _retire(self, bucket, started):
        """Wait for a bucket's reduce-scatter and keep this rank's shard (the full gradient stays)."""
        handle, output, _ = started
        handle.wait()
        bucket.grad_shard = output.div_(self.divide) if self.divide != 1 else output

    def all_gather_parameters(self):
        """Each rank's updated shard, rounded into the model's dtype, to every rank."""
        gathers = []
        for bucket in self.buckets:
            shard = bucket.shard(bucket.flat, self.comm.rank)
            if bucket.master is not shard:
                self._master_into_model(shard, bucket.master)          # (S,) rounded
            gathers.append(self.comm.all_gather(bucket.flat, shard.clone(), async_op=True))  # no aliasing
        for handle in gathers:
            handle.wait()

    def _master_into_model(self, shard: torch.Tensor, master: torch.Tensor):
        """Round the fp32 master into the model's (16-bit) shard, before its all-gather."""
        shard.copy_(master)

    def refresh_params(self):                # the masters were written (a checkpoint): the model follows
        self.all_gather_parameters()

    def _release(self):
        # Stage 1 drops the shard too: the next reduce recomputes it from the full gradient it keeps.
        for bucket in self.buckets:
            bucket.grad_shard = bucket.master.grad = None
        self._synced, self._norm, self._used = False, None, None
        self.shard_step.new_step()

    def zero_grad(self, set_to_none: bool = True):
        """Forget this step's gradients. Stage 1's .grad are views into flat buffers it keeps for
        the next backward (as DDP's gradient_as_bucket_view): zeroed whatever set_to_none says."""
        for bucket in self.buckets:
            bucket.grad_shard = bucket.master.grad = None
            bucket.used = [False] * len(bucket.params)
            if bucket.grad_flat is not None:
                bucket.grad_flat.zero_()
        self._release()

    # ---- bookkeeping: what the meters ask (the loop's, a mesh's and the checkpoints' questions:
    # ShardedStep.Owner, which asks self.shard_step) ------------------------------------------------

    def host_tensors(self) -> list[torch.Tensor]:   # none here (offload.py's step keeps the masters there)
        return []

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The gradient memory this rank holds: full flat buffers (stage 1) or shards (stage 2)."""
        return [t for b in self.buckets for t in (b.grad_flat, b.grad_shard) if t is not None]


class Zero2Optimizer(ZeroOptimizer):
    """ZeRO-2: ZeRO-1, but each bucket is reduce-scattered the moment backward fills it, and its
    full gradient freed: a rank holds whole gradients only for the buckets in flight, then its 1/N
    shards. The price: with gradient accumulation every micro-batch reduce-scatters (no full
    buffer is kept to add the next one into), where DDP and ZeRO-1 reduce once a step."""

    stage, keeps_whole_gradients = 2, False     # each bucket reduced and freed as backward fills it
    syncing, _unreduced = True, False           # False / True under no_sync(): gradients wait in .grad

    #   backward   | grads of bucket 0 | grads of bucket 1 | grads of bucket 2 |
    #   network                        |= reduce-scatter 0 =|= reduce-scatter 1 =|= 2 =|
    #   memory       full buffers only for the bucket filling, a few in flight (in_order's cap); then shards

    def _hook_gradients(self):
        self._order = self.buckets.in_order(self._launch_reduction, self._retire)
        self._backward_hooked = False             # end-of-backward callback queued?
        for bucket in self.buckets:
            bucket.grad_flat = None                   # allocated while a bucket is in flight
        self.buckets.hook_gradients(self._gradient_ready)   # _gradient_ready(b, i) after each gradient

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside leave each gradient whole in .grad, reduced at the finish (or step()):
        for gradients complete only after backward (zero bubble's W, a tied head, pipeline.py)."""
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
        """Parameter i's gradient copied into bucket b's buffer (in reduce_dtype) and freed; the bucket
        goes once full. The buffer lives until its reduce-scatter retires: peak memory is those in flight."""
        bucket = self.buckets[b]
        if bucket.grad_flat is None:                                   # (N*S,)
            bucket.grad_flat = torch.zeros_like(bucket.flat, dtype=self.reduce_dtype)
        bucket.view(bucket.grad_flat, i).copy_(bucket.params[i].grad)
        bucket.params[i].grad = None                 # before the reduction: the full gradient is gone
        bucket.used[i] = True
        bucket.pending -= 1                          # FlatParams': gradients yet to come this backward
        if bucket.pending == 0:
            self._order.ready(bucket)

    def _launch_reduction(self, bucket):
        if bucket.grad_flat is None:                                     # no gradient came
            bucket.grad_flat = torch.zeros_like(bucket.flat, dtype=self.reduce_dtype)
        output = bucket.grad_flat.new_empty(bucket.shard_numel)          # (S,)
        return self.comm.reduce_scatter(output, bucket.grad_flat, op=self.op, async_op=True), output

    def _retire(self, bucket, started):
        """Wait for a bucket's reduce-scatter, keep the shard, free the full gradient."""
        handle, output = started
        handle.wait()
        output = output.div_(self.divide) if self.divide != 1 else output
        bucket.grad_shard = output if bucket.grad_shard is None else bucket.grad_shard.add_(output)  # accumulating
        bucket.grad_flat = None
        bucket.pending = len(bucket.params)

    def _finish_backward(self):
        self._order.launch_rest()                                        # some gradient never came
        self._order.wait_all()
        self._backward_hooked = False

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

    def _release(self):
        # Unlike stage 1's, the shard stays until zero_grad() (all that is left of the gradient);
        # the master's .grad goes unless the unscale made it the shard itself (an fp32 shard).
        for bucket in self.buckets:
            if bucket.master.grad is not bucket.grad_shard:
                bucket.master.grad = None
        self._norm, self._used = None, None
        self.shard_step.new_step()


if __name__ == "__main__":
    start_alone(torchrun=True)
    # A tiny model, 5 steps on each rank's rows (fp32: no scale_loss), beside one process's AdamW.
    dist.init_process_group("gloo")
    world, failed = as_comm(None), False
    for stage, cls in ((1, ZeroOptimizer), (2, Zero2Optimizer)):
        torch.manual_seed(0)
        one = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        model, whole = copy.deepcopy(one), torch.optim.AdamW(one.parameters(), lr=1e-2)
        ours = cls(model.parameters(), group=world, bucket_mb=0.004, lr=1e-2)
        rows = slice(world.rank * 8, (world.rank + 1) * 8)               # 8 rows each: equal means
        for _ in range(5):
            x, y = torch.randn(8 * world.world_size, 8), torch.randn(8 * world.world_size, 4)   # every rank's
            for net, opt, r in ((model, ours, rows), (one, whole, slice(None))):
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(x[r]), y[r]).backward()
                opt.step()
        difference = max((a - b).abs().max().item() for a, b in zip(model.parameters(), one.parameters()))
        held = sum(t.numel() for t in ours.state_tensors())           # master shards, moments
        every = sum(3 * p.numel() for p in one.parameters())            # weights, 2 moments
        failed |= not difference <= 1e-5
        if world.rank == 0:
            print(f"ZeRO-{stage}: rank 0 holds {held} of the {every} elements of fp32 weights and Adam moments "
                  f"(1/{world.world_size}, plus padding) | max |difference| from one process: {difference:.1e} "
                  f"(bound 1e-05: fp32 sums reordered)", flush=True)
    dist.destroy_process_group()
    os._exit(int(failed))  # at once: gloo's threads may still hold tensors (exit_distributed)
