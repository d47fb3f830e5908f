"""Hybrid sharding (HSDP): FSDP within a group of ranks, copies of its shards across the groups.

FSDP over a whole cluster all-gathers every unit over every rank, across the slow links between
nodes. HSDP (Zhao et al. 2023, 3.2.1, FSDP's HYBRID_SHARD; FSDP2's 2-D mesh) shards each unit
within a group (one node's fast links) and keeps one copy of the sharded model per group: the
all-gathers and reduce-scatters stay inside the group, and only the reduced gradient shard, 1/S
of the model, is all-reduced across the copies. Memory: 1/S of the training state, S the group's
size. This file is a delta on fsdp.py: read that first.
Left out: ZeRO++'s hierarchical partitioning (a secondary shard per node for the backward gather).
Run: torchrun --nproc_per_node 4 train.py --strategy fsdp --shard-group 2;
test: python -m pytest tests/test_fsdp_qlora.py -k hybrid
"""
from foundations.comm import Comm
from fsdp import FSDP


class HSDP(FSDP):
    """FSDP(module, group=shard group, **options), each shard copied over replicate_group.

    replicate_group: the ranks holding the same shard in the other groups (process_groups.make_mesh's
    outer group). Each reduce-scattered gradient shard is then all-reduced over them (the mean
    over both), with the used-flags, and every copy starts as the first group's. An expert's unit
    is not copied: it stays sharded over its holders (foundations/placements.py), its gradient summed there.
    """

    def __init__(self, module, replicate_group, **options):
        self.replicas = Comm.from_group(replicate_group)   # before FSDP builds its units over them
        super().__init__(module, **options)

    def _model_groups(self, comm) -> list:
        return [comm, self.replicas]

    def _make_unit(self, index, module, tensors):
        unit = super()._make_unit(index, module, tensors)
        if unit is not None and unit.comm is self.comm:       # (an expert's unit is not copied)
            # Every copy starts as the first group's: each shard as its twin's there.
            for shard in ([unit.master.detach()] if unit.params else []) + unit.kept():
                self.replicas.broadcast(shard, src=0)
            if unit.params:
                unit.replicas = self.replicas        # foundations/flat.py's norm and used-flags read them too
        return unit

    def _add_gradient(self, unit, output, used):
        if unit.replicas is not None:                # the shard's mean over the copies too
            unit.replicas.all_reduce(output, op=unit.op)
        super()._add_gradient(unit, output, used)
