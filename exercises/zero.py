"""Exercise: ZeRO-1's step and ZeRO-2's reduce-scatter in backward (the solution: zero.py).

Every rank holds the whole model, laid in flat buckets (foundations/flat.py), each cut into N
equal shards; rank r keeps the optimizer state of shard r only, as an fp32 master (for fp32 or
fp64 parameters the master is the shard itself, a view of the bucket).
Given (set by the constructor, or inherited from zero.py):
- self.comm: .rank, .world_size; all_reduce(t, op), all_gather(out, inp, async_op=False),
  reduce_scatter(out, inp, op, async_op=False), op "sum", "avg" or "max"; with async_op=True
  each returns a handle with .wait().
- self.buckets: a list of Bucket; each has .params (its parameters, in order), .flat (N*S,)
  the parameters' values (each parameter a view of it), .grad_flat (N*S,) or None, .master,
  .grad_shard (S,) or None, .used (a bool per parameter), .pending (gradients yet to come this
  backward; len(.params) when none came), .shard_numel (S), .shard(flat, rank) (a (S,) view of
  an (N*S,) tensor) and .view(flat, i) (parameter i's slice of it, shaped like the parameter).
- self.optimizer: the inner optimizer, on the masters; self.scaler.update(skipped: bool);
  self.max_norm: None, or the float clip_grad_norm_(max_norm) set (reset after each step, by
  _release()); self._norm, self._used: None until global_norm() sets them this step.
- reduce_gradients(): phase 1, each bucket's whole gradient reduce-scattered with op "avg",
  rank r's (S,) mean in bucket.grad_shard. unscale_gradients(): phase 2, the shard / the loss
  scale as bucket.master.grad; returns the masters' .grad, None where a bucket has none.
  Both work once a step: a second call does nothing more (unscale_gradients() returns the
  same list), so step() may call them whether or not clip_grad_norm_ ran them already.
  norm_pieces(): this rank's runs of gradient shards, for self.shard_step.squares(pieces),
  a (1,) fp32 tensor, this rank's sum of squares. launch_used_flags(): returns (the used-flags,
  a tensor, or None when this rank used every parameter; a function to call to wait for them).
- self.shard_step.read_decision(norm, used): the one host read, (norm as a float, used as a
  list or None; with flags, both go through fp32), the same read as torch.cat of the norm and
  the flags in the norm's dtype, then .tolist(). self.shard_step.unused_unchanged(used): a
  context manager, keeps the elements of parameters no rank used as they were.
  self._master_into_model(shard, master): rounds the master into the model's shard.
  self._release(): drops the step's gradients, starts a new step.
- ZeRO-2: self.reduce_dtype (None: the parameters' dtype), self.divide (1, or the count to
  divide the summed shard by), self._order.ready(bucket) (launches full buckets' reduce-scatters
  in bucket order, the same on every rank); _launch_reduction(bucket) returns (handle, output).

ZeroOptimizer, ZeRO-1's step, phase by phase:
- global_norm: the squares of this rank's gradient shards, summed over the ranks (the shards
  are disjoint, so the sum is the whole gradient's), then the square root;
- clip: the masters' gradients times min(1, max_norm / norm);
- update: the inner optimizer steps this rank's masters only, then all_gather_parameters hands
  every rank's updated shard to every rank, so each rank holds the whole model again;
- step: the phases in order, with one read of the norm on the host (inf/NaN: skip).
Zero2Optimizer, your ZeroOptimizer plus stage 2: each gradient is copied into its bucket's
buffer the moment backward makes it (a post-accumulate hook calls _take) and its .grad dropped;
a full bucket is reduce-scattered at once, while backward goes on; when its reduce-scatter is
done, the shard is kept (added to earlier micro-batches') and the whole buffer freed.
Check: python -m exercises check zero (on 3 ranks, against one process's AdamW and clipping).

Shapes: N ranks, r this rank, P elements in a bucket, S = ceil(P / N) per shard; a bucket's
flat, grad_flat (N*S,); its shard, master, grad_shard (S,); the norm a scalar tensor.
"""
import math

import torch
from torch.nn.utils import clip_grads_with_norm_

import zero


class ZeroOptimizer(zero.ZeroOptimizer):
    """ZeRO-1: the constructor, the reduce-scatter and the unscale come from zero.py."""

    @torch.no_grad()
    def step(self, closure=None):
        """One ZeRO step. The lecture's three moves are phases 1 (reduce-scatter), 6 (update this
        rank's shard) and 7 (all-gather). Phases 2-5 are what any mixed-precision step with
        clipping does (mixed_precision.py), here on the shards: unscale, the global norm (also the
        inf/NaN test, so it runs without clipping too), clip, one host read.
        Phases 1-3 run once a step: when the loop called clip_grad_norm_(max_norm) first, they
        ran there, and phase 4 clips by max_norm."""
        # TODO: the closure's loss (under torch.enable_grad()), if one is given; then the
        # phases in order (phases 1-3 are safe to call again: each does its work once a step).
        # Clip only when clip_grad_norm_ asked for it (self.max_norm). Phase 5 reads the norm
        # and the used-flags to the host in one transfer. Which of the phases runs the inner
        # optimizer, and what must the loss scaler hear afterwards? Return the loss.
        raise NotImplementedError

    @torch.no_grad()
    def update(self, norm: float, used: list | None = None):
        """Phases 6 and 7, given the host read (step()'s, or a mesh's): the norm as a float, the
        used-flags as a list (None: every parameter was used). Not finite: skip the step."""
        # TODO: keep the norm (self.last_grad_norm) and whether the step is skipped
        # (self.last_step_skipped). If not skipped: the inner optimizer steps the masters (a
        # parameter no rank used must not move), then every rank's updated shard goes to every
        # rank. Either way the step's gradients are released.
        raise NotImplementedError

    def global_norm(self) -> torch.Tensor:
        """Phase 3, once a step: the squares of this rank's shards, summed over the ranks in one
        all-reduce (the shards are disjoint), then the root: a device scalar, the same on every
        rank. The used-flags' all-reduce runs beside it."""
        # TODO: once a step (cached in self._norm): launch the used-flags' all-reduce first, so
        # it overlaps; this rank's sum of squares; what must happen to it across the ranks
        # before the root? Wait for the flags; keep the root (a scalar) in self._norm and the
        # flags in self._used.
        raise NotImplementedError

    def clip(self, max_norm: float, norm: torch.Tensor):
        """Phase 4: the masters' .grad times min(1, max_norm / norm) (torch's, given the norm)."""
        # TODO: the gradients the optimizer will step are the masters' .grad (unscale_gradients()
        # returns them, None where a bucket has none). torch's clip_grads_with_norm_(parameters,
        # max_norm, total_norm) takes the tensors that HOLD a .grad, not the gradients.
        raise NotImplementedError

    def all_gather_parameters(self):
        """Phase 7: each rank's updated shard, rounded into the model's dtype, to every rank."""
        # TODO: for each bucket, this rank's shard of bucket.flat (the model's parameters), with
        # the master copied into it where the master is a separate tensor; all-gather it into
        # the whole bucket.flat (send a copy: input and output must not overlap). Launch every
        # bucket's all-gather (async_op=True), then wait for them all.
        raise NotImplementedError


class Zero2Optimizer(ZeroOptimizer, zero.Zero2Optimizer):
    """ZeRO-2: your ZeroOptimizer, with each bucket reduce-scattered during backward."""

    def _take(self, b: int, i: int):
        """Take parameter i's .grad into bucket b's buffer: copy it (in reduce_dtype), free it.
        The bucket goes once full. The buffer lives until its reduce-scatter is waited for: the
        peak memory is the buckets in flight."""
        # TODO: the bucket's buffer is made when its first gradient comes, in self.reduce_dtype
        # (None: the parameters' dtype). When is the bucket full, and who launches it?
        raise NotImplementedError

    def _finish_reduction(self, bucket, started):
        """Wait for a bucket's reduce-scatter, add its shard to the step's, free the gradient."""
        # TODO: started is (handle, output) from _launch_reduction. What if an earlier
        # micro-batch left a shard? What must the bucket hold for the next backward?
        raise NotImplementedError
