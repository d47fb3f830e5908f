"""Exercise: DDP's gradient sync, overlapped with backward (the solution: ddp.py's DDP).

Every rank holds the whole model and runs backward on its own rows; the gradients must end up
averaged over the ranks before the optimizer steps. Write the four methods below:
- mark_param_as_ready: the gradient goes into its slot and is counted; once a bucket has all of
  its gradients it is full, and full buckets start their all-reduce, while backward carries on
  with the earlier layers (under no_sync, the gradient just stays in .grad).
- _all_reduce: start one bucket's all-reduce without waiting, and remember it.
- finish_gradient_sync: after the last backward, wait for every bucket, and leave the mean in
  each .grad, ready for the optimizer; then start over for the next step.
- no_sync: a context in which backwards only accumulate, so that k micro-batches cost one sync.
Check: python -m exercises check ddp (on 3 ranks, fp64, against one process on the whole batch).

Given by __init__ (i: a parameter, b: a bucket; N ranks, P trainable parameter tensors):
- self.buckets: the buckets, in the order backward fills them; bucket b's flat gradient
  buffer bucket.grad_flat (L_b,) holds its parameters' .grad end to end (the slots); its
  bucket.comm (all_reduce(tensor, op="sum"|"avg"|"max", async_op=False): with async_op=True
  it returns at once a work whose .wait() blocks until the tensor holds the result),
  bucket.op (the op to reduce with) and bucket.divide (divide the result by it afterwards).
  bucket.view(bucket.grad_flat, j): parameter j's slot, a view of the buffer shaped like it:
  where its gradient sits in the bucket (a .grad that is this view adds into the bucket).
- self.params (P,): the parameters in bucket order; self.bucket_indices[b]: the range of i
  in bucket b, so bucket b's parameter j is params[bucket_indices[b][j]].
- A hook calls mark_param_as_ready(b, j) when backward has added into bucket b's param j's .grad.
The state the four methods share (_reset() renews all but the first two):
- self.require_backward_grad_sync: False inside no_sync (True otherwise).
- self._hooked[i]: i's hook has fired once.     self._used[i]: i got a gradient since the sync.
- self._ready[i]: i's gradient is counted into its bucket, this sync.
- self.pending[b]: gradients bucket b still waits for (0: full).
- self.launched: how many buckets have launched, this sync.
- self._in_flight: [(bucket, wire, work)]: each launched bucket, the tensor it sends (wire) and
  its work, for the finish to wait for.
Given helpers (the corner cases):
- _check_first_gradient(i): raises if i's gradient was already counted this sync.
- _upcast(grad_flat): what to send: a copy in reduce_dtype, or grad_flat itself if none.
- _launch_unused(): fills the slots no gradient came to (zeros, or no_sync's .grad), then
  launches the buckets that are now full.
- _launch_used_flags(): launches an all-reduce of the "used" flags; returns wait_used_flags(),
  which waits and returns them (P,): True where some rank used i.
- _reset(): the per-sync state starts over.
"""
from contextlib import contextmanager

import ddp
from foundations.flat import FlatParams


class DDP(ddp.DDP):
    """ddp.py's DDP with its gradient sync written by you (everything else is inherited)."""

    # ---- during backward: a gradient is ready; a full bucket's all-reduce starts -------------

    def mark_param_as_ready(self, b: int, j: int):
        """Backward has accumulated bucket b's parameter j into its .grad (the gradient hook)."""
        # TODO: record what the state says of parameter i. Under no_sync, the gradient stays in
        # .grad. Otherwise (a second gradient this sync is an error) it must sit in its slot:
        # autograd's first .grad is a tensor of its own, not the bucket's view. Count it off its
        # bucket. Once the bucket is full, which buckets may start now, if the ranks pair
        # all-reduces by call order? (self.launched says how far the launches have come.)
        raise NotImplementedError

    def _all_reduce(self, bucket: FlatParams):
        """Start the bucket's all-reduce and return without waiting for it."""
        # TODO: the wire (see _upcast) all-reduced over the bucket's comm with its op, without
        # waiting; the finish will need the bucket, the wire and the work.
        raise NotImplementedError

    # ---- after backward: wait for every bucket ----------------------------------------------

    def finish_gradient_sync(self):
        """Wait for every bucket's all-reduce and leave the averaged gradients in .grad.

        Call it after the step's last backward, before optimizer.step()."""
        # TODO: every rank must launch every bucket, also those backward never filled (an
        # unused parameter's), and the used flags after them. Then wait for each bucket: what
        # must happen before grad_flat holds the mean (bucket.divide; a wire may be a copy)?
        # Each .grad: where some rank used the parameter, its slot; else None. Then start over.
        raise NotImplementedError

    # ---- gradient accumulation --------------------------------------------------------------

    @contextmanager
    def no_sync(self):
        """Backwards inside accumulate into .grad locally; the next one outside syncs the sum."""
        # TODO: require_backward_grad_sync False for the body of the with; afterwards, the
        # value it had before, nested or not, also when the body raises.
        raise NotImplementedError
