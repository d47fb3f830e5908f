"""FSDPOptimizer: any element-wise torch optimizer stepping on FSDP's shards (read fsdp.py first).

FSDP's reduce-scatter already did ZeRO-2's work: each rank holds its shards' fp32 gradients. So
the step is ZeRO's (zero.py's ZeroOptimizer.step; both compose mechanics/sharded_step.py's
ShardedStep) with no all-gather after it: the next forward gathers. A plain torch.optim
optimizer over FSDP.parameters() works too (with FSDP.clip_grad_norm_); this one adds fp16's
loss scale, leaves parameters no rank used unchanged, and offloads (ZeRO-Offload, Ren et al.
2021: mechanics/offload.py).
Test: python -m pytest tests/test_fsdp.py
"""
import torch

from foundations.launch import flags_to_device
from mechanics.sharded_step import ShardedStep
from mixed_precision import DynamicLossScaler
from foundations.inner_optimizer import run_closure
from mechanics.offload import OffloadedStep


class FSDPStep(ShardedStep.Owner, torch.optim.Optimizer):
    """Any element-wise torch optimizer on the shards of fsdp (an fsdp.FSDP), with ZeRO's
    sharded step (ShardedStep): unscale (fp16 loss scale), one global norm across ranks for
    clipping and for the inf/NaN skip that every rank agrees on, the inner step on this rank's
    shards.
    Loop: zero_grad(); scale_loss(loss).backward() per micro-batch; clip_grad_norm_(max_norm) if
    clipping; step(). A torch.optim.Optimizer: schedulers drive it.
    offload: ZeRO-Offload, as ZeroOptimizer's: the fp32 master shards (FSDP's parameters) and
    the optimizer state move to the host and the step runs there; the device keeps each shard
    in the compute dtype for the all-gathers, and the gradient shards.
    """

    def __init__(self, fsdp, optimizer_cls=torch.optim.AdamW,
                 scaler: DynamicLossScaler | None = None, offload: bool = False, **optimizer_kwargs):
        if offload not in (True, False):
            raise ValueError(f"FSDPOptimizer offload must be True (the optimizer on the CPU) or "
                             f"False, got {offload!r}")
        self.fsdp, self.offload, self.comm = fsdp, offload, fsdp.comm
        # HSDP's copies hold the same shards: the first copy's ranks write checkpoints.
        self.replica_rank = next((u.replicas.rank for u in fsdp.units if u.replicas is not None), 0)
        if offload:
            fsdp.offload_masters()
        self.shard_step = ShardedStep(self, fsdp.units, fsdp.comm, optimizer_cls, optimizer_kwargs,
                                      scaler or DynamicLossScaler(enabled=fsdp.compute_dtype == torch.float16))
        self.flats, self.masters, self.optimizer = fsdp.units, self.shard_step.masters, self.shard_step.optimizer
        self.last_grad_norm, self.last_step_skipped = None, False
        self._norm = self._used = None       # the global norm and used-flags, from clipping to step()

    # ---- the step: ZeRO's, with no all-gather (the next forward gathers) ----------------------

    def step(self, closure=None):
        """FSDP's backward reduce-scattered the gradients -> their global norm (one collective,
        then the step's one host read: the inf/NaN check) -> [clipped by it, clip_grad_norm_] ->
        the inner optimizer on this rank's fp32 master shards."""
        loss = run_closure(closure)
        self.reduce_gradients()
        norm, used = self.shard_step.read_decision(self.global_norm(), self._used)
        self.update(norm, used)
        self.scaler.update(self.last_step_skipped)
        return loss

    def global_norm(self) -> torch.Tensor:
        """The norm over every unit's shards (and HSDP's copies where some unit is not copied)."""
        if self._norm is None:
            self._used, agree = self.launch_used_flags()
            squares = self.shard_step.squares(self.norm_pieces())
            for group in self.norm_groups():
                if group.world_size > 1:
                    group.all_reduce(squares, op="sum")
            agree()
            self._norm = squares.sqrt()[0]
        return self._norm

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        self.shard_step.check_max_norm(max_norm)
        self.clip(max_norm, self.global_norm())
        return self._norm

    @torch.no_grad()
    def update(self, norm: float, used: list | None = None):
        """Skip on inf/NaN, else the inner step (parameters no rank used kept as they were)."""
        self.last_grad_norm = norm
        self.last_step_skipped = not self.shard_step.step(norm, used)
        if not self.last_step_skipped and self.offload:
            self.refresh_params()        # the updated host shards back to the device
        self._norm = self._used = None
        self.shard_step.new_step()

    @property
    def device(self):                     # where the gradient shards are
        return self.shard_step.device

    # ---- the phases, public: a composition (composition/mesh_optimizer.py) runs them with its own norm ---

    def reduce_gradients(self):
        self.fsdp.finish_gradient_sync()

    def gradient_shards(self) -> list:
        return [u.grad for u in self.fsdp.units]

    def unscale_gradients(self) -> list:
        self.reduce_gradients()
        return self.shard_step.unscale(self.gradient_shards())

    def _copies_summed(self) -> bool:
        # HSDP's copies hold the same shards: one copy's squares are the whole, unless some unit
        # (an expert's) is not copied; then each copied one counts 1/copies, summed over them.
        copied = [u.replicas is not None for u in self.fsdp.units]
        return any(copied) and not all(copied)

    def norm_pieces(self, weight_of=None) -> list:
        """[(a run of a gradient shard, weight)]: what the norm sums (flat.shard_pieces)."""
        summed = self._copies_summed()
        return self.shard_step.pieces(self.unscale_gradients(), weight_of or (lambda p, n: 1.0 / n),
                                      lambda u: u.replicas.world_size if summed and u.replicas else 1)

    def norm_groups(self) -> list:
        """The groups the squares are summed over: the shards' ranks, HSDP's copies if summed."""
        return [self.comm, *([next(u.replicas for u in self.fsdp.units if u.replicas)]
                             if self._copies_summed() else [])]

    def launch_used_flags(self) -> tuple:
        # FSDP.finish_gradient_sync OR'ed the flags over the ranks already: no collective.
        local = [u for unit in self.fsdp.units for u in unit.used]
        used = flags_to_device(local, self.device)
        return (None if all(local) else used), lambda: None

    def clip(self, max_norm: float, norm: torch.Tensor):
        self.shard_step.clip(max_norm, norm, self.unscale_gradients())

    # ---- bookkeeping ------------------------------------------------------------------------

    def frozen_gathered(self):
        """FSDP.frozen_gathered: the frozen weights whole, for a checkpoint (collective)."""
        return self.fsdp.frozen_gathered()

    def zero_grad(self, set_to_none: bool = True):
        for unit in self.fsdp.units:
            unit.used = [False] * len(unit.params)
            if set_to_none:
                unit.grad = unit.master.grad = None
            elif unit.grad is not None:
                unit.grad.zero_()
        self._norm = self._used = None
        self.shard_step.new_step()

    def refresh_params(self):
        """After the masters were written: drop any gathered copy; the next forward gathers."""
        for unit in self.fsdp.units:
            unit.refresh()


class FSDPOptimizer(OffloadedStep, FSDPStep):
    """FSDPStep, with ZeRO-Offload's step on the host when built with offload=True (mechanics/offload.py)."""

    def host_tensors(self) -> list[torch.Tensor]:
        return super().host_tensors() + self.fsdp.host_shards()

    def host_grads(self) -> list[torch.Tensor]:
        return [unit.offloaded.host_grad for unit in self.flats]    # MasterOnHost's
