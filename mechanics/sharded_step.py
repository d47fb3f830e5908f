"""The sharded step: the inner optimizer on this rank's fp32 master shards, ZeRO's and FSDP's.

Once every rank holds its shard of each reduced gradient, ZeRO (zero.py) and FSDP
(mechanics/fsdp_optimizer.py) end the step alike (Rajbhandari et al. 2020, section 5.1): the
gradient shards / the loss scale into the fp32 masters' .grad, the squares of the shards (the
global norm, once the caller has summed them over its ranks), the step's one host read, then the
inner optimizer on the masters, or nothing if the norm is inf/NaN. ShardedStep is that half,
which FSDP's optimizer composes; it writes its own reduce-scatter, the norm's all-reduce over its
groups, and leaves the gathers to the next forward. zero.py writes the same half out in its
step(), the lecture's, and composes ShardedStep only for the inner optimizer, the loss scale,
the used-flags' launch, a mesh's norm pieces and the checkpoints.
Test: python -m pytest tests/test_zero.py tests/test_fsdp.py

Shapes: N ranks, S elements per shard, P parameters in the flats.
"""
import contextlib
import math

import torch
from torch.nn.utils import clip_grads_with_norm_

from foundations.flat import or_used_flags, shard_pieces, squares_of
from foundations.inner_optimizer import (check_max_norm, element_state, load_masters,
                                         optimizer_state, read_decision, refuse_new_groups,
                                         wrap_inner)
from mixed_precision import DynamicLossScaler, unscale_grads


class ShardedStep:
    """The inner optimizer on this rank's fp32 master shards, and fp16's loss scale.

    owner: the torch.optim.Optimizer the loop holds (zero.py's, FSDP's): it gets the inner
    optimizer's param_groups and state (wrap_inner), so a scheduler drives the inner step.
    flats: FlatParams (ZeRO's buckets, FSDP's units), each with its (S,) fp32 `master`; comm: the
    ranks they are sharded over. The inner optimizer: optimizer_cls(masters, **optimizer_kwargs).
    scaler: default a DynamicLossScaler, enabled when the flats are fp16.
    A step calls, in order: unscale, pieces -> squares (the caller sums them over its ranks: the
    norm is their root), launch_used_flags, read_decision (the one host read), clip, step.
    """

    def __init__(self, owner: torch.optim.Optimizer, flats: list, comm, optimizer_cls,
                 optimizer_kwargs: dict, scaler: DynamicLossScaler | None = None):
        self.flats, self.comm = list(flats), comm
        self.masters = [flat.master for flat in self.flats]
        self.scaler = scaler or DynamicLossScaler(enabled=self.flats[0].flat.dtype == torch.float16)
        self.optimizer = wrap_inner(owner, optimizer_cls(self.masters, **optimizer_kwargs))
        self.unscaled = False                # the masters' .grad hold this step's gradients

    @property
    def device(self) -> torch.device:
        """Where the gradient shards are, and the norm is made: the parameters' device."""
        return self.flats[0].params[0].device

    def unscale(self, grads: list) -> list:
        """grads[k], flat k's (S,) reduced gradient shard or None, / the loss scale, in fp32, into its
        master's .grad, once a step (until new_step()); returns the masters' .grad (None where grads[k] is)."""
        if not self.unscaled:
            with_grad = [(grad, flat.master) for grad, flat in zip(grads, self.flats) if grad is not None]
            unscale_grads([grad for grad, _ in with_grad], [master for _, master in with_grad], self.scaler.scale)
            self.unscaled = True
        return [flat.master.grad if grad is not None else None for grad, flat in zip(grads, self.flats)]

    def pieces(self, grads: list, weight_of=None, copies=None) -> list:
        """[(a run of a gradient shard, its weight)]: what the global norm sums (flat.shard_pieces)."""
        return shard_pieces(self.flats, grads, weight_of, copies)

    def squares(self, pieces: list) -> torch.Tensor:
        """The pieces' weighted squares summed: (1,) fp32 on the device, this rank's share of the
        norm squared (the shards are disjoint: summed over the ranks, the whole)."""
        return squares_of(pieces, self.device, self.masters[0].dtype)

    def launch_used_flags(self) -> tuple:
        """(Did any rank compute each parameter's gradient: (P,) flags OR'ed over comm, their
        all-reduce launched, or None where this rank used every one; agree(), which waits for it)."""
        used, agree = or_used_flags(self.flats, self.device)
        return (None if all(u for flat in self.flats for u in flat.used) else used), agree

    def read_decision(self, norm: torch.Tensor, used: torch.Tensor | None) -> tuple[float, list | None]:
        """The step's one device-to-host read: (the norm, a float: not finite means skip; the
        used-flags as a list, or None)."""
        return read_decision(norm, used)

    check_max_norm = staticmethod(check_max_norm)       # clip_grad_norm_'s argument, checked first

    def clip(self, max_norm: float, norm: torch.Tensor, grads: list):
        """The masters' .grad (where grads[k] is not None) times min(1, max_norm / norm)."""
        clip_grads_with_norm_([flat.master for flat, grad in zip(self.flats, grads) if grad is not None],
                              max_norm, norm)

    @torch.no_grad()
    def step(self, norm: float, used: list | None) -> bool:
        """Given the host read: an inf/NaN norm skips the step (returns False); else the inner
        optimizer on the masters (returns True), the elements of a parameter no rank used kept as
        they were (used: the P flags; None: every parameter was used)."""
        if not math.isfinite(norm):
            return False
        with self.unused_unchanged(used):
            self.optimizer.step()
        return True

    def unused_unchanged(self, used: list | None):
        """A context: the masters' and moments' elements of each parameter no rank used come
        out of it as they went in (keep_unchanged; used: the P flags, None: all were used)."""
        return keep_unchanged(unused_ranges(self.flats, used), self.optimizer.state)

    def new_step(self):
        """This step's gradients are gone (stepped, or zero_grad): the next unscale() runs again."""
        self.unscaled = False

    # ---- bookkeeping: the checkpoints' and the meters' questions -----------------------------

    refuse_new_groups = staticmethod(refuse_new_groups)   # the owner's add_param_group, once built

    def master_ranges(self) -> list[tuple]:
        """(param, start, stop, master, offset): elements start:stop of param (flattened) have
        their fp32 master, and their optimizer state, at master[offset : offset + stop - start].
        Only this rank's shards: a checkpoint saves every rank's and joins them by name."""
        return [(flat.params[i], start, stop, flat.master, offset) for flat in self.flats
                for i, start, stop, offset in flat.shard_ranges(flat.comm.rank)]

    def state_dict(self) -> dict:
        """This rank's: inner state, fp32 master shards, loss scale, which shard."""
        return optimizer_state(self, self._shard_id())

    def load_state_dict(self, state: dict):
        """state_dict's inverse, checked (the owner then refreshes the model from the masters)."""
        load_masters(self, state, self._shard_id())

    def _shard_id(self) -> dict:
        return {"rank": self.comm.rank, "world_size": self.comm.world_size}

    def state_tensors(self) -> list[torch.Tensor]:
        """The fp32 master shards and the inner optimizer's state (memory_math.held_bytes)."""
        return [*self.masters, *element_state(self.optimizer)]

    class Owner:
        """What the loop, a mesh, the checkpoints and the meters ask an optimizer that composes a
        ShardedStep (self.shard_step; zero.py's, mechanics/fsdp_optimizer.py's), answered by asking it;
        refresh_params(), the model following the masters, is the owner's own."""

        sharded = True                                  # each rank holds only its shard of the masters
        add_param_group = refuse_new_groups             # torch's while built, then refused
        scaler = property(lambda self: self.shard_step.scaler,            # fp16's loss scale, settable:
                          lambda self, scaler: setattr(self.shard_step, "scaler", scaler))   # a mesh's parts share one

        def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
            return self.scaler.scale_loss(loss)

        def master_ranges(self) -> list[tuple]:
            return self.shard_step.master_ranges()

        def state_dict(self) -> dict:
            return self.shard_step.state_dict()

        def load_state_dict(self, state: dict):
            self.shard_step.load_state_dict(state)
            self.refresh_params()                       # the model follows the masters

        def state_tensors(self) -> list[torch.Tensor]:
            return self.shard_step.state_tensors()


def unused_ranges(flats: list, used: list | None) -> list:
    """[(master, start, stop)]: the elements of each flat's (S,) master shard that belong to a
    parameter no rank used (used: the P flags read on the host; None: every one was used)."""
    if used is None:
        return []
    flags, ranges = iter(used), []
    for flat in flats:
        unused = {i for i in range(len(flat.params)) if not next(flags)}
        ranges += [(flat.master, offset, offset + stop - start)
                   for i, start, stop, offset in flat.shard_ranges(flat.comm.rank) if i in unused]
    return ranges


@contextlib.contextmanager
def keep_unchanged(ranges: list, state: dict):
    """Elements master[start:stop] of each (master, start, stop), and the same elements of the
    optimizer's per-element state (Adam's moments), come out as they went in.

    A flat master holds parameters that got no gradient beside ones that did. torch's
    optimizers skip a parameter whose .grad is None: no update, no weight decay, no moment
    change. A shard sees a zero gradient instead, which AdamW would still decay, so the
    elements are put back. (The shard's step count still advances: a parameter unused for
    some steps and then used again gets the bias correction of the shard's count.)
    """
    saved = []
    for master, start, stop in ranges:
        moments = {k: v[start:stop].clone() for k, v in state.get(master, {}).items()
                   if isinstance(v, torch.Tensor) and v.shape == master.shape}
        saved.append((master, start, stop, master.detach()[start:stop].clone(), moments))
    yield
    with torch.no_grad():
        for master, start, stop, values, moments in saved:
            master[start:stop] = values
            for key, v in state[master].items():
                if isinstance(v, torch.Tensor) and v.shape == master.shape:
                    # State the step created (the first one) starts from zero, as it would
                    # the first time this parameter has a gradient.
                    v[start:stop] = moments[key] if key in moments else 0
