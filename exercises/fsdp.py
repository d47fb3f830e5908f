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
Everything else (the wrap, the hooks, the order of the reduce-scatters, the step) comes from
fsdp.py. Check: python -m exercises check fsdp (on 2 ranks).

Given, on a Unit:
- self.comm: all_gather(output, input, async_op=False) fills output (N*S,) from every rank's
  input (S,); reduce_scatter(output, input, op="sum", async_op=False) leaves rank r
  output (S,) = op over the ranks of input's chunk r; with async_op=True each returns a handle
  with .wait().
- self.op (the gradient's op), self.params, self.flat (N*S,) (the parameters are views of it),
  self.master (S,) (this rank's shard).
- self.views(buffer): a view of buffer (N*S,) per parameter, shaped like it.
- self.sends(): [(this rank's shard (S,), the flat it fills)].
- self.gathered: True from the launch of its all-gather until it is freed.
- self.gathering: what wait() reads: a list of (handle, shard) pairs, in that order (the shard
  kept alive until sent). self.wait() waits for each handle, then gathering = ().
Given, on FSDP:
- self.forward_order: the wrapped units (the blocks) in forward order; the root is not in it.
- self.prefetch, self.reduce_dtype; self._sync: False under no_sync.
- self._grads_to_reduce: a flag your _reduce_scatter sets (True: gradients wait unreduced).
- self._gather(unit): launches unit.all_gather() unless unit.gathered.
- self._free(unit), self._free_after_backward(unit): free it, unless a pipeline's step keeps
  it (use these, not unit.free()).
- self._hook_end_of_backward(): once per backward.
- self._tell(what, unit): tells the observers; what is "forward", "backward" or
  "reduce-scatter", as the unit computes or launches.

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
        # flat's storage back to its full size (free() left it at 0 bytes); the all-gather,
        # launched, not waited for (what must wait() find?). Then mark the unit gathered, so
        # that FSDP does not gather it twice.
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
        # TODO: set self._grads_to_reduce = not self._sync (gradients wait unreduced). When
        # syncing: the unit's whole gradient as one (N*S,) buffer in self.reduce_dtype (a
        # parameter with no .grad adds zeros; used: which had one), the whole .grads dropped,
        # and the reduce-scatter launched into an (S,) output; tell "reduce-scatter". In any
        # case the unit is freed. Return (handle, output, used) or None.
        raise NotImplementedError

    def _prefetch(self, position: int, step: int):
        """Gather up to `prefetch` units after forward_order[position] (step +1: forward's way,
        -1: backward's), while fewer than limit = 1 + prefetch units are gathered: the one
        computing and those ahead of it (the root does not count)."""
        # TODO: walk forward_order from position + step, `step` at a time, at most prefetch
        # units; stop at either end, or once limit units of forward_order are gathered.
        raise NotImplementedError
