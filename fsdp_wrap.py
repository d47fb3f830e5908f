"""How FSDP wraps a module: its two policies, the checks on what it is given, the units made.

FSDP's arguments, as PyTorch names them: the wrap policy picks the submodules that become
units (FSDP1's auto_wrap_policy; FSDP2 calls fully_shard on each), and the mixed-precision
policy the dtypes a unit computes and reduces in (FSDP2's MixedPrecisionPolicy). Wrapping, a
base class of fsdp.FSDP, walks the module: each parameter goes to the nearest wrapped module
above it, one Unit (fsdp.py) per wrapped module, the rest in the root unit. A part of FSDP a
reader can skip: fsdp.py reads without it. HSDP and the frozen base override its hooks.
Test: python -m pytest tests/test_fsdp.py
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

from model import Block
from placements import data_reduction, placement


def gpt_blocks(module: nn.Module) -> bool:
    """The default wrap policy: one unit per transformer block; the rest is the root unit.
    (Under expert parallelism parallelize.py wraps each expert a rank holds as a unit of its own.)"""
    return isinstance(module, Block)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mp_policy, its two dtypes: param_dtype, what forward and backward compute in and
    the all-gathers send (None: fp32); reduce_dtype, what the gradients are reduce-scattered in
    (None: param_dtype; torch.float32 under bf16/fp16 upcasts before the collective, fewer
    roundings for twice the bytes). The shards stay fp32 either way."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def check_input(module, compute_dtype, prefetch) -> list:
    """FSDP's arguments, checked before any work: its trainable parameters."""
    if compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"FSDP compute_dtype (mp_policy's param_dtype) must be torch.float32, "
                         f"bfloat16 or float16, got {compute_dtype}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"FSDP prefetch must be a whole number of units >= 0, got {prefetch!r}")
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("FSDP: the module has no trainable parameters (requires_grad=True)")
    if any(p.dtype != torch.float32 for p in trainable):
        raise ValueError("FSDP keeps fp32 master shards: pass the fp32 model and pick the "
                         "compute_dtype with mp_policy=MixedPrecisionPolicy(param_dtype="
                         "torch.bfloat16), do not cast the model first")
    return trainable


class Wrapping:
    """fsdp.FSDP's units, made from its module (reading its comm, data_world and unit_type)."""

    def _model_groups(self) -> list:
        """The groups whose ranks start from the same model (HSDP adds its copies')."""
        return [self.comm]

    def _same_start(self, comm, flat: torch.Tensor):
        """Ranks may have been seeded differently: every rank's flat starts as comm's rank 0's."""
        comm.broadcast(flat, src=0)

    def _tensors_of(self, m: nn.Module) -> list[torch.Tensor]:
        """The tensors of m (not its children's) that its unit shards: its parameters."""
        return list(m.parameters(recurse=False))

    def _make_units(self, module, wrap):
        """self.roots (the root unit, gathered from forward's start to backward's end), self.order
        (every other unit, in forward order, each gathered around each use), self.units (those
        with something to train) and self.root (the trained root, or None)."""
        owner = {}          # each tensor's unit: the nearest wrapped module above it, None: root

        def visit(m, unit):
            unit = m if m is not module and wrap(m) else unit
            for t in self._tensors_of(m):
                if owner.setdefault(t, unit) is not unit:
                    owner[t] = None                          # shared by two units: the root's
            for child in m.children():
                visit(child, unit)
        visit(module, None)
        self.roots, self.order = [], []
        for m in [None] + [m for m in module.modules() if m is not module and wrap(m)]:
            tensors = [t for t, o in owner.items() if o is m]
            unit = self._make_unit(len(self.roots) + len(self.order), module if m is None else m,
                                   tensors) if tensors else None
            if unit is not None:
                (self.roots if m is None else self.order).append(unit)
        self.units = [u for u in self.roots + self.order if u.params]
        self.root = next((u for u in self.roots if u.params), None)

    def _make_unit(self, index, module, params):
        """The unit of params, module's (a tensor list in module order), or None."""
        if not all(p.requires_grad for p in params):
            raise ValueError("FSDP shards trained parameters only: for a frozen base (LoRA's, "
                             "requires_grad=False) use fsdp_frozen.FrozenBaseFSDP, which shards it too")
        # With experts: an expert's unit is sharded over the ranks holding that expert.
        if len({placement(p).holders for p in params}) > 1:
            raise ValueError("FSDP: a unit mixes parameters held by different ranks (an "
                             "expert beside shared weights): wrap each expert as a unit")
        comm, op, divide = data_reduction(params[0], self.comm, self.data_world)
        unit = self.unit_type(index, module, params, comm, self)
        unit.op, unit.divide = op, divide
        return unit
