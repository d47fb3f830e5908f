"""Exercise: ZeRO-1's step and ZeRO-2's reduce-scatter in backward (the solution: zero.py).

Every rank holds the whole model, laid in flat buckets (foundations/flat.py), each cut into N
equal shards; rank r keeps the optimizer state of shard r only, as an fp32 master (for fp32 or
fp64 parameters the master is the shard itself, a view of the bucket). Given: the constructor,
reduce_gradients() (phase 1: each bucket's whole gradient reduce-scattered with op "avg", rank
r's (S,) mean in bucket.grad_shard), unscale_gradients() (phase 2: the shard / the loss scale,
as bucket.master.grad), norm_pieces(), launch_used_flags(), the inner optimizer (self.optimizer,
on the masters) and self.comm (all_reduce, all_gather, reduce_scatter; op "sum", "avg", "max").

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
        # TODO: the closure's loss (under torch.enable_grad()), if one is given; then phases
        # 1 reduce_gradients(), 2 unscale_gradients(), 3 global_norm(), 4 clip, only when
        # self.max_norm is set (clip_grad_norm_ set it); 5 one host read: the norm as a float,
        # and self._used (the used-flags, or None) as a list, read together in one transfer
        # (torch.cat, then .tolist()); 6-7 update(norm, used); then the loss scaler hears
        # whether the step was skipped (self.scaler.update). Return the loss.
        raise NotImplementedError

    @torch.no_grad()
    def update(self, norm: float, used: list | None = None):
        """Phases 6 and 7, given the host read (step()'s, or a mesh's): the norm as a float, the
        used-flags as a list (None: every parameter was used). Not finite: skip the step."""
        # TODO: keep the norm (self.last_grad_norm) and whether the step is skipped
        # (self.last_step_skipped: the norm is inf or NaN). If not: the inner optimizer steps
        # the masters, inside self.shard_step.unused_unchanged(used) (a parameter no rank used
        # must not move), then every rank's updated shard goes to every rank. Either way the
        # step's gradients are released (self._release()).
        raise NotImplementedError

    def global_norm(self) -> torch.Tensor:
        """Phase 3, once a step: the squares of this rank's shards, summed over the ranks in one
        all-reduce (the shards are disjoint), then the root: a device scalar, the same on every
        rank. The used-flags' all-reduce runs beside it."""
        # TODO: once a step (cached in self._norm): launch the used-flags' all-reduce
        # (launch_used_flags() gives the flags and a function that waits); this rank's squares
        # of norm_pieces() (self.shard_step.squares gives a (1,) tensor); sum them over the
        # ranks when there are several; wait for the flags; keep the root as a scalar in
        # self._norm and the flags in self._used.
        raise NotImplementedError

    def clip(self, max_norm: float, norm: torch.Tensor):
        """Phase 4: the masters' .grad times min(1, max_norm / norm) (torch's, given the norm)."""
        # TODO: the gradients the optimizer will step are the masters' (unscale_gradients()
        # returns them, None where a bucket has none): scale those, by the global norm.
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
        # TODO: bucket b's whole buffer, (N*S,) zeros in self.reduce_dtype, made when its first
        # gradient comes; copy parameter i's .grad into its slice (bucket.view), then drop the
        # .grad; mark it used; one gradient fewer pending: when none is left, hand the bucket to
        # self._order.ready (it launches the reduce-scatters in the same order on every rank).
        raise NotImplementedError

    def _finish_reduction(self, bucket, started):
        """Wait for a bucket's reduce-scatter, add its shard to the step's, free the gradient."""
        # TODO: started is (handle, output) from _launch_reduction: wait, divide by self.divide
        # if it is not 1, add the (S,) output to bucket.grad_shard (or keep it, if this is the
        # step's first); free the whole buffer; the next backward waits for all its gradients.
        raise NotImplementedError
