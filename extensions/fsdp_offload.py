"""Parameter offload: FSDP's shards wait in host memory, and visit the device for their all-gathers.

ZeRO-Offload (FSDPOptimizer(offload=True), mechanics/offload.py) moves the fp32 masters and the
optimizer state to the host; the device still keeps each trained shard in the compute dtype,
and the frozen shards (extensions/fsdp_frozen.py). Parameter offload (ZeRO-Infinity's,
Rajbhandari et al. 2021; FSDP's CPUOffload(offload_params=True)) moves those too: between its
uses every shard sits in pinned host memory, and is copied to the device just before its
all-gather (which keeps the copy alive until sent), then dropped. The device holds only the
gathered units in flight, the gradient shards and the activations. This file is a delta on
fsdp.py: read that first.
Left out: NVMe (ZeRO-Infinity's other tier), prefetching the host copies ahead of the gathers.
Run: torchrun --nproc_per_node 2 train.py --strategy fsdp --offload params;
test: python -m pytest tests/test_fsdp_qlora.py -k offload
"""
import torch

from fsdp import FSDP
from mechanics.offload import host_copy


class OffloadedFSDP(FSDP):
    """FSDP(module, **options) whose shards live in host memory between uses. Step it with
    FSDPOptimizer(offload=True): the fp32 masters are on the host too, so the step runs there,
    and its write-back refreshes each shard's host copy (Unit.refresh, host -> host). A unit's
    all-gather copies a host shard to the device first (Unit.all_gather), and keeps the copy
    until it is sent; from pinned memory the copy runs beside compute on a GPU."""

    def __init__(self, module, **options):
        super().__init__(module, **options)
        for shard in self.kept_shards():      # the frozen ones, if any: to (pinned) host memory
            shard.data = host_copy(shard, dtype=shard.dtype)

    def offload_masters(self):
        super().offload_masters()
        for unit in self.units:                    # the compute-dtype copies follow the masters
            shard = unit.offloaded.compute_shard
            shard.data = host_copy(shard, dtype=self.compute_dtype)

    def forward(self, *args, **kwargs):
        if any(unit.offloaded is None for unit in self.units):
            raise ValueError("FSDP offload_params keeps the parameter shards on the host, where "
                             "the optimizer must step: use FSDPOptimizer(fsdp, offload=True)")
        return super().forward(*args, **kwargs)

    def device_shards(self) -> list[torch.Tensor]:
        return []

    def host_shards(self) -> list[torch.Tensor]:
        return self.kept_shards()
