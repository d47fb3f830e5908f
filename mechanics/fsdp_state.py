"""What fsdp.py leaves out: how FSDP wraps a module, and what the rest of the program reads of it.

fsdp.py is the lecture: units gathered, freed, their gradients reduce-scattered, the step on the
shards. FSDPState, a base of fsdp.FSDP, holds the rest. The wrap: the arguments checked, each
parameter given to the nearest wrapped module above it, one unit per wrapped module (FSDP1's
auto_wrap_policy; FSDP2 calls fully_shard on each), the rest in the root unit. The readings:
napkin/memory.py counts the bytes each rank holds, a plain torch optimizer clips the global norm, a
checkpoint reads the whole model, the napkin math checks the bytes a step sends; and ZeRO-Offload
(FSDPOptimizer(offload=True)) moves the masters to the host (mechanics/offload.py's
MasterOnHost). HSDP, parameter offload and the frozen base override some of these. FSDPTrace
watches a unit's life from outside: the order of its gathers, computes and reduce-scatters, and
the most bytes gathered at once. Test: python -m pytest tests/test_fsdp.py
"""
import contextlib
import math

import torch
import torch.nn as nn

from foundations.comm import Comm
from foundations.flat import MAX_REDUCTIONS_IN_FLIGHT, agree_used, shards_norm
from model import Block
from mechanics.offload import MasterOnHost
from foundations.placements import data_reduction, placement
from foundations.process_groups import check_same_parameters


def gpt_blocks(module: nn.Module) -> bool:
    """The default wrap policy: one unit per transformer block; the rest is the root unit.
    (Under expert parallelism composition/parallelize.py wraps each expert a rank holds as a
    unit of its own.)"""
    return isinstance(module, Block)


class FSDPState:
    """fsdp.FSDP's wrap and its readings, on its module, comm, dtypes and units."""

    reductions_in_flight = MAX_REDUCTIONS_IN_FLIGHT     # ZeRO-2's bound, whole unit gradients here

    def train(self, mode: bool = True):
        self.module.train(mode)     # .module is not a submodule (parameters() are the shards)
        return super().train(mode)

    # ---- the wrap: the arguments checked, the units made ----------------------------------

    def _checked(self, module: nn.Module, group, device) -> tuple:
        """FSDP's arguments, checked before any work, the same model on every rank: (the
        foundations/comm.py's Comm of group (None: the world), the device the shards live on)."""
        comm = Comm.from_group(group)
        if self.compute_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"FSDP compute_dtype (mp_policy's param_dtype) must be torch.float32, "
                             f"bfloat16 or float16, got {self.compute_dtype}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"FSDP prefetch must be a whole number of units >= 0, "
                             f"got {self.prefetch!r}")
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("FSDP: the module has no trainable parameters (requires_grad=True)")
        # fp32 masters; an fp64 model (checked against one process exactly) keeps fp64 ones
        dtypes = {p.dtype for p in trainable}
        if dtypes not in ({torch.float32}, {torch.float64}) or \
                dtypes == {torch.float64} != {self.compute_dtype}:
            raise ValueError("FSDP keeps fp32 master shards: pass the fp32 model and pick the "
                             "compute_dtype with mp_policy=MixedPrecisionPolicy(param_dtype="
                             "torch.bfloat16), do not cast the model first")
        device = torch.device(device) if device is not None else trainable[0].device
        for ranks in self._model_groups(comm):
            check_same_parameters(list(module.parameters()), ranks, device)
        return comm, device

    def _model_groups(self, comm) -> list:
        """The groups whose ranks start from the same model: comm (HSDP adds its copies')."""
        return [comm]

    def _tensors_of(self, m: nn.Module) -> list[torch.Tensor]:
        """The tensors of m (not its children's) that its unit shards: its parameters."""
        return list(m.parameters(recurse=False))

    def _wrap(self, module, wrap) -> tuple[list, list]:
        """(root_units, forward_order): root_units, [] or [the root unit], what no wrapped module
        holds and any tensor two units share (tied weights); forward_order, one unit per module
        wrap(m) picks (None: gpt_blocks), in registration order (the forward's, in a GPT)."""
        wrap = wrap or gpt_blocks
        # The data dimension's ranks (an expert's gradient is divided by all of them).
        self.data_world = math.prod(comm.world_size for comm in self._model_groups(self.comm))
        owner = {}          # each tensor's unit: the nearest wrapped module above it, None: root

        def visit(m, unit):
            unit = m if m is not module and wrap(m) else unit
            for t in self._tensors_of(m):
                if owner.setdefault(t, unit) is not unit:
                    owner[t] = None                          # shared by two units: the root's
            for child in m.children():
                visit(child, unit)
        visit(module, None)
        roots, order = [], []
        for m in [None] + [m for m in module.modules() if m is not module and wrap(m)]:
            tensors = [t for t, o in owner.items() if o is m]
            unit = self._make_unit(len(roots) + len(order), module if m is None else m,
                                   tensors) if tensors else None
            if unit is not None:
                (roots if m is None else order).append(unit)
        return roots, order

    def _make_unit(self, index, module, params):
        """The unit of params, module's (a tensor list in module order), or None."""
        if not all(p.requires_grad for p in params):
            raise ValueError("FSDP shards trained parameters only: for a frozen base (LoRA's, "
                             "requires_grad=False) use fsdp_frozen.FrozenBaseFSDP, which shards "
                             "it too")
        # With experts: an expert's unit is sharded over the ranks holding that expert.
        if len({placement(p).holders for p in params}) > 1:
            raise ValueError("FSDP: a unit mixes parameters held by different ranks (an "
                             "expert beside shared weights): wrap each expert as a unit")
        comm, op, divide = data_reduction(params[0], self.comm, self.data_world)
        unit = self.unit_type(index, module, params, comm, self.compute_dtype, self.device)
        unit.op, unit.divide = op, divide
        unit.replicas = None     # ranks holding copies of its shard (extensions/fsdp_hybrid.py's)
        return unit

    def _agree_used(self):
        """After every reduce-scatter is launched: the used-flags OR'ed over the ranks, and a
        unit no rank used gets .grad None (flat.agree_used). Collective."""
        agree_used(self.units, self.device)

    def _tell(self, what: str, unit):
        """Tell each of FSDP's observers (FSDPTrace) what just happened to unit."""
        for observe in self.observers:
            observe(what, unit)

    # ---- reduce-scatter less often: a pipeline's step (FSDP.no_sync: accumulation) -------------

    @contextlib.contextmanager
    def gathered_for_step(self):
        """Inside, a unit stays gathered from its first use to the end of the block, and every
        backward runs as under no_sync: one all-gather per unit for all the micro-batches, one
        reduce-scatter at finish_gradient_sync() after the block (FSDP2's reshard_after_forward
        off), for the whole unit's parameters and gradients during the step. pipeline.Pipeline
        enters it around each step, as torchtitan does: its schedule runs several micro-batches'
        forwards before their backwards, so a unit freed after one would be gathered again."""
        self._gathered_for_step, outer, self._sync = True, self._sync, False
        try:
            yield
        finally:
            self._gathered_for_step, self._sync = False, outer
            for unit in self.root_units + self.forward_order:
                unit.free()

    # ---- the shards and their gradients (napkin/memory.py, the optimizer) ---------------------

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The gradient shards this rank holds (fp32, on the device)."""
        return [u.grad for u in self.units if u.grad is not None]

    def kept_shards(self) -> list[torch.Tensor]:
        """The shards every unit keeps besides FSDP.parameters() (the compute-dtype copies when
        the masters are offloaded, a frozen base's bytes)."""
        return [shard for unit in self.root_units + self.forward_order for shard in unit.kept()]

    def device_shards(self) -> list[torch.Tensor]:
        """The kept shards that live on the device (napkin/memory.py counts them): all here."""
        return self.kept_shards()

    def host_shards(self) -> list[torch.Tensor]:
        """The kept shards that wait in host memory: none here (extensions/fsdp_offload.py's)."""
        return []

    def offload_masters(self):
        """ZeRO-Offload (FSDPOptimizer(offload=True)): each fp32 master shard moves to the host,
        where the optimizer steps; the device keeps it rounded, for the all-gathers."""
        for unit in self.units:
            unit.offloaded = MasterOnHost(unit.master, self.compute_dtype)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """For a plain torch optimizer over FSDP.parameters(): scale the shards' gradients so the
        whole model's gradient has 2-norm at most max_norm; returns the norm before clipping.
        Collective (an all-reduce of the squares): call on every rank, after
        finish_gradient_sync(). torch.nn.utils.clip_grad_norm_ would see this rank's shards only.
        FSDPOptimizer has its own, which also unscales fp16's loss scale first."""
        if max_norm <= 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
        norm = shards_norm(self.units, [u.grad for u in self.units], self.comm, {})
        # torch's rule (clip_grad_norm_): scale by max_norm / norm when that is below 1.
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in self.gradient_buffers():                                   # (S,) each, fp32
            g.mul_(scale)
        return norm

    # ---- the whole model (checkpoints) ----------------------------------------------------------

    def frozen_gathered(self):
        """A checkpoint reads and writes the frozen weights inside this (collective): whole here,
        as there are none (extensions/fsdp_frozen.py gathers its sharded base)."""
        return contextlib.nullcontext()

    def names(self) -> dict:
        """{original parameter: its name in .module}."""
        return {p: name for name, p in self.module.named_parameters()}

    @torch.no_grad()
    def full_state_dict(self, all_ranks: bool = False) -> dict:
        """{name: fp32 tensor of its original shape (an fp64 model's: fp64)}, on rank 0 (empty
        elsewhere) or all_ranks.
        Collective: every rank calls it. Under expert parallelism, only this rank's experts."""
        names, out = self.names(), {}
        for unit in self.units:
            flat = torch.empty(unit.flat.numel(), dtype=unit.master.dtype,
                               device=unit.flat.device)                                     # (N*S,)
            unit.comm.all_gather(flat, unit.master.detach().to(flat.device, copy=True))
            out.update({names[p]: view.clone() for p, view in zip(unit.params, unit.views(flat))})
        return out if all_ranks or self.comm.rank == 0 else {}


class FSDPTrace:
    """The life of an FSDP's units, watched from outside. `events`: the last forward's and
    backward's [(what, unit index)] in order ("all-gather", "forward", "forward done", "backward",
    "reduce-scatter"), and `peak_gathered_bytes`, the most bytes of gathered units (the root too)
    held at once since the trace began. FSDP tells it of each gather, compute and reduce-scatter
    (its observers); module hooks tell it the rest."""

    def __init__(self, fsdp):
        self.fsdp, self.events, self.peak_gathered_bytes = fsdp, [], 0
        fsdp.observers.append(self.saw)
        fsdp.register_forward_pre_hook(self._new_step)
        for unit in fsdp.forward_order:      # after FSDP's own hook has freed the unit
            unit.module.register_forward_hook(
                lambda m, args, out, u=unit: self.saw("forward done", u))

    def _new_step(self, fsdp, args):
        self.events = []

    def saw(self, what: str, unit):
        self.events.append((what, unit.index))
        if what == "all-gather":
            units = self.fsdp.root_units + self.fsdp.forward_order
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, sum(
                flat.untyped_storage().nbytes() for u in units for flat in u.flats()))
