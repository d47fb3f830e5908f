"""Exercise: DDP's gradient sync, overlapped with backward (the solution: ddp.py's DDP).

Every rank holds the whole model and runs backward on its own rows; the gradients must end up
averaged over the ranks before the optimizer steps. DDP's __init__ (given) lays the trainable
parameters, in the order backward produces their gradients, into buckets: each a flat gradient
buffer (bucket.grad_flat) whose slots are the parameters' .grad. It also registers a hook that
calls mark_param_as_ready(b, j) when backward has added bucket b's parameter j into its .grad.
Write the four methods below:
- mark_param_as_ready: the gradient goes into its slot and is counted; once a bucket has all of
  its gradients it is full, and full buckets start their all-reduce in bucket order, while
  backward carries on with the earlier layers (under no_sync, the gradient just stays in .grad).
- _all_reduce: start one bucket's all-reduce without waiting, and remember it.
- finish_gradient_sync: after the last backward, wait for every bucket, and leave the mean in
  each .grad, ready for the optimizer; then start over for the next step.
- no_sync: a context in which backwards only accumulate, so that k micro-batches cost one sync.
The state they share is listed in DDP.__init__ (ddp.py): pending, launched, _ready, _used,
_hooked, _in_flight, require_backward_grad_sync. The corner cases are given: _grad_into_slot,
_check_first_gradient, _launch_full_buckets, _upcast, _launch_unused, _launch_used_flags, _reset.
Check: python -m exercises check ddp (on 3 ranks, fp64, against one process on the whole batch).

Shapes: N ranks in the group, P trainable parameter tensors, bucket b holds params[i] for i in
bucket_indices[b], L_b elements in its flat buffer grad_flat (L_b,).
"""
from contextlib import contextmanager

import ddp
from foundations.flat import FlatParams


class DDP(ddp.DDP):
    """ddp.py's DDP with its gradient sync written by you (everything else is inherited)."""

    # ---- during backward: a gradient is ready; a full bucket's all-reduce starts -------------

    def mark_param_as_ready(self, b: int, j: int):
        """Backward has accumulated bucket b's parameter j into its .grad (the gradient hook)."""
        # TODO: i, the parameter's index in self.params (bucket_indices); it was used and its
        # hook has fired. Under no_sync (require_backward_grad_sync False) that is all: the
        # gradient stays in .grad. Otherwise: refuse a second gradient (_check_first_gradient),
        # move .grad into its bucket slot (_grad_into_slot), mark it ready, count it off the
        # bucket's pending; when the bucket is full, launch it and the full ones after it, never
        # before an earlier bucket (_launch_full_buckets: ranks pair collectives by call order).
        raise NotImplementedError

    def _all_reduce(self, bucket: FlatParams):
        """Start the bucket's all-reduce and return without waiting for it."""
        # TODO: what goes on the wire is self._upcast(bucket.grad_flat) (a copy in reduce_dtype,
        # or the buffer itself); all-reduce it over bucket.comm with op=bucket.op (the default
        # "avg" is the mean over the ranks), async_op=True, and append (bucket, wire, work) to
        # self._in_flight for the finish.
        raise NotImplementedError

    # ---- after backward: wait for every bucket ----------------------------------------------

    def finish_gradient_sync(self):
        """Wait for every bucket's all-reduce and leave the averaged gradients in .grad.

        Call it after the step's last backward, before optimizer.step()."""
        # TODO: first the buckets backward never filled (_launch_unused: every rank must launch
        # every bucket), then the used flags (_launch_used_flags returns the function that
        # waits for them). Wait for each bucket in flight; divide its wire by bucket.divide
        # where that is not 1; copy the wire into grad_flat if it is a copy. Then each
        # parameter's .grad is its slot if some rank used it, else None; then _reset().
        raise NotImplementedError

    # ---- gradient accumulation --------------------------------------------------------------

    @contextmanager
    def no_sync(self):
        """Backwards inside accumulate into .grad locally; the next one outside syncs the sum."""
        # TODO: set require_backward_grad_sync to False for the body of the with, and give it
        # back its value afterwards (a try/finally around the yield), nested or not.
        raise NotImplementedError
