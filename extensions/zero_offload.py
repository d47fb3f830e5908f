"""ZeRO-Offload on either ZeRO stage, and ZeRO as the command line names it (zero_optimizer).

ZeRO-Offload (Ren et al. 2021, section 4) keeps each rank's shard of the fp32 master and the
Adam moments in host memory and runs the step on the CPU (mechanics/offload.py's
OffloadedStep). The device keeps the parameters and the gradients (stage 1's whole buffers,
stage 2's shards), as without it. A delta on zero.py's optimizers: it overrides the two methods
zero.py leaves for it (_new_master, _master_into_model) and OffloadedStep's phases of the step.
Test: python -m pytest tests/test_zero.py -k offload
"""
import torch

from mechanics.offload import OffloadedStep, host_to_device
from foundations.flat import Bucket
from zero import Zero2Optimizer, ZeroOptimizer


class ZeroOffload(OffloadedStep):
    """Each bucket's master shard on the host; the updated shard crosses back before its
    all-gather."""

    def _new_master(self, bucket: Bucket, shard: torch.Tensor) -> torch.Tensor:
        return self._host_master(bucket, shard)                          # (S,) fp32, on the host

    # The step: OffloadedStep.to_host copies the gradient shards out, Adam steps on the CPU, and
    # the parameters go back in. It could overlap more: copy each shard out as its
    # reduce-scatter retires in backward, step bucket i on the CPU while bucket i+1 is still
    # on its way, or (the paper's delayed update) run the whole CPU step beside the next
    # forward, the weights one step stale.

    def _master_into_model(self, shard: torch.Tensor, master: torch.Tensor):
        # The host -> device copy: from pinned memory it is asynchronous, and the stream runs it
        # before the all-gather's clone, so bucket i's all-gather overlaps bucket i+1's copy.
        host_to_device(shard, master)


class ZeroOffloadOptimizer(ZeroOffload, ZeroOptimizer):
    """ZeRO-1 with ZeRO-Offload: the full gradients on the device, the step on the host."""


class Zero2OffloadOptimizer(ZeroOffload, Zero2Optimizer):
    """ZeRO-2 with ZeRO-Offload: the gradient shards on the device, the step on the host."""


ZERO = {(1, False): ZeroOptimizer, (2, False): Zero2Optimizer,
        (1, True): ZeroOffloadOptimizer, (2, True): Zero2OffloadOptimizer}


def zero_optimizer(params, stage: int = 1, offload: bool = False, **kwargs) -> ZeroOptimizer:
    """ZeRO as the command line names it: the optimizer of `stage` (1 or 2), with ZeRO-Offload
    when `offload`; kwargs go to its constructor (ZeroOptimizer's)."""
    if stage not in (1, 2):
        raise ValueError(f"ZeRO stage must be 1 or 2, got {stage!r}; stage 3 shards the "
                         f"parameters too: that is FSDP (fsdp.py)")
    if offload not in (True, False):
        raise ValueError(f"ZeroOptimizer offload must be True (the optimizer on the CPU) or "
                         f"False, got {offload!r}")
    return ZERO[stage, offload](params, **kwargs)
