"""Exercise: a unit's life in FSDP, and prefetch (the solution: fsdp.py).

FSDP keeps 1/N of each unit (a block; the rest is the root unit) on each rank: its flat
parameter, sharded. Write the steps that make a unit whole only while it computes:
- Unit.all_gather: the flat buffer gets its memory back, and every rank's shard is gathered
  into it (asynchronously: a handle to wait on), the unit marked gathered.
- Unit.free: the memory goes again (the parameters stay views of the empty buffer).
- forward: before a unit runs, gather it (unless a prefetch already has), wait, and start
  gathering the next unit in forward order; after it runs, free it, and hook its outputs so
  that their gradient, in backward, calls _before_backward.
- backward: the weights are needed again, so gather the unit again, wait, and start gathering
  the one backward reaches next (the previous one in forward order).
- the gradient: once the unit's gradients are all in, every rank holds a whole gradient of
  it; a reduce-scatter leaves rank r the mean of shard r, and the whole gradients go.
- prefetch: gather up to `prefetch` units ahead, never holding more than 1 + prefetch.
Everything else (the wrap, the hooks, the order of the reduce-scatters, wait, free, the
step) comes from fsdp.py. Check: python -m exercises check fsdp (on 2 ranks).

Shapes: N ranks, r this rank, P elements in a unit, S = ceil(P / N) per shard: the master
(S,), the flat (N*S,).
"""
import torch
from torch.utils._pytree import tree_leaves

import fsdp


class Unit(fsdp.Unit):

    def all_gather(self):
        """Launch (async) the all-gathers that fill each flat from every rank's shard."""
        # TODO: for each (shard, flat) of self.sends(): the shard on the flat's device; the
        # flat's storage back to its full size (free() left it at 0 bytes); an async
        # all-gather over self.comm, its handle kept with the shard in self.gathering (wait()
        # reads it). Then mark the unit gathered, so that FSDP does not gather it twice.
        raise NotImplementedError

    def free(self):
        # TODO: wait for the gathers still on their way (their bytes land in this memory), then
        # every flat's storage back to 0 bytes (the parameters stay views of it, shapes kept),
        # and mark the unit no longer gathered.
        raise NotImplementedError


class FSDP(fsdp.FSDP):

    unit_type = Unit                    # the wrap builds your Unit

    def _before_forward(self, unit):
        """All-gather the unit (unless prefetched), wait for it; start the next one's gather."""
        # TODO: gather (self._gather skips a unit already on its way), wait, tell the
        # observers ("forward"), then prefetch from this unit's place in forward_order, forward.
        raise NotImplementedError

    def _after_forward(self, unit, output):
        """Free it; its backward starts when the gradient of its output arrives: a hook on each
        output tensor (the first to fire gathers the unit; _gather skips it for the others)."""
        # TODO: free the unit (self._free). When a backward will come, hook every output tensor
        # that requires grad (tree_leaves walks a tuple or dict), its hook calling
        # _before_backward(unit). Return the output.
        raise NotImplementedError

    def _before_backward(self, unit):
        """All-gather it again (its backward needs the weights); start the previous one's."""
        # TODO: as before forward (after self._hook_end_of_backward(), which has the end of
        # backward launch what is left), but tell "backward", and prefetch the other way.
        raise NotImplementedError

    def _reduce_scatter(self, unit):
        """Launch the reduce-scatter of unit's gradient, unless no_sync: each rank receives its
        shard of the sum (the mean: op avg). Returns (handle, output, used), or None."""
        # TODO: remember whether gradients wait (self._grads_to_reduce: not self._sync). When
        # syncing: a zeroed (N*S,) buffer in self.reduce_dtype, each parameter's .grad copied
        # into its view (used: which had one) and then dropped; an (S,) output; an async
        # reduce-scatter over unit.comm by unit.op; tell "reduce-scatter". In any case free the
        # unit (self._free_after_backward). Return (handle, output, used) or None.
        raise NotImplementedError

    def _prefetch(self, position: int, step: int):
        """Gather up to `prefetch` units after forward_order[position] (step +1: forward's way,
        -1: backward's), while fewer than limit = 1 + prefetch units are gathered: the one
        computing and those ahead of it (the root does not count)."""
        # TODO: walk forward_order from position + step, `step` at a time, at most prefetch
        # units; stop at either end, or once limit units of forward_order are gathered.
        raise NotImplementedError
