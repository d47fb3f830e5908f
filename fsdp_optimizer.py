"""FSDPOptimizer: any element-wise torch optimizer stepping on FSDP's shards (read fsdp.py first).

FSDP's reduce-scatter already did ZeRO-2's work: each rank holds its shards' fp32 gradients. So
the step is ZeRO's sharded step (flat.py's ShardedOptimizer) with no all-gather after it: the
next forward gathers. A plain torch.optim optimizer over FSDP.parameters() works too (with
FSDP.clip_grad_norm_); this one adds fp16's loss scale, leaves parameters no rank used
unchanged, and offloads (ZeRO-Offload, Ren et al. 2021: offload.py).
Test: python -m pytest tests/test_fsdp.py
"""
import torch

from launch import flags_to_device
from mixed_precision import DynamicLossScaler
from offload import OffloadedOptimizer as ShardedOptimizer


class FSDPOptimizer(ShardedOptimizer):
    """Any element-wise torch optimizer on the shards of fsdp (an fsdp.FSDP), with ZeRO's
    sharded step: unscale (fp16 loss scale), one global norm across ranks for clipping and for
    the inf/NaN skip that every rank agrees on, the inner step on this rank's shards.
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
        self.flats, self.masters = fsdp.units, [u.master for u in fsdp.units]
        super().__init__(self.masters, optimizer_cls, optimizer_kwargs,
                         scaler or DynamicLossScaler(enabled=fsdp.compute_dtype == torch.float16))

    def _gradients(self):
        self.fsdp.finish_gradient_sync()
        # Offloaded, offload.OffloadedOptimizer._unscale copies them out, Adam steps on the CPU,
        # the updated shards go back in (Unit.refresh), where the next forward's all-gathers wait.
        units = [u for u in self.fsdp.units if u.grad is not None]
        return [u.grad for u in units], [u.master for u in units]        # (S,) each, on the device

    def _used_anywhere_flags(self, device) -> tuple:
        # FSDP.finish_gradient_sync (in _gradients) OR'ed the flags over the ranks already.
        used = flags_to_device([u for unit in self.fsdp.units for u in unit.used], device)
        return used, lambda: None

    def _write_back(self):
        if self.offload:
            self.refresh_params()

    def host_tensors(self) -> list[torch.Tensor]:
        return super().host_tensors() + self.fsdp.host_shards()

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

    def refresh_params(self):
        """After the masters were written: drop any gathered copy; the next forward gathers."""
        for unit in self.fsdp.units:
            unit.refresh()
