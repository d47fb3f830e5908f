"""The optimizer of a run on a mesh: one concept optimizer per part of the parameters, one norm.

A concept optimizer (mixed_precision.py's MixedPrecisionOptimizer, zero.py's ZeroOptimizer,
mechanics/fsdp_optimizer.py's FSDPOptimizer) steps its own parameters over the group it is given. On a
mesh the parameters lie differently (foundations/placements.py): an expert's gradient is reduced over the
ranks holding it, not the whole data group; a tensor-parallel rank holds a slice of one matrix
and a copy of the replicated weights; a pipeline stage holds its blocks only. Here they meet:
the parameters are partitioned by the group that reduces them (placements.by_reduction), one
concept optimizer is built per part, and the step sums the parts' squares over the mesh once,
each parameter's weighted by placements.norm_weight (every value counted once: a weight handed
to the parts rather than a part per weight, so that the buckets, and the sums' order, stay
those of the concept alone), makes the step's one host read (the norm, the inf/NaN check; the
sharded parts' used-flags in the same copy), and hands every part the norm and the decision.
Used by: composition/parallelize.py. Test: tests/test_placements.py, tests/test_train.py -k mesh
"""
import contextlib
import math
from collections.abc import Mapping

import torch

from foundations.flat import GradientSyncs
from foundations.inner_optimizer import (check_max_norm, read_decision, refuse_new_groups,
                                         run_closure)
from foundations.placements import add_squares, by_reduction, norm_weight


def partition(params, data) -> list:
    """[(group, mean_over, parameters)]: the trainable parameters by the group that reduces them
    (placements.by_reduction): the data group's mean (mean_over None), then each holders
    group's sum divided by the data group's size (an expert's gradient sums others' tokens)."""
    trainable = [p for p in params if p.requires_grad]
    return [(comm, None if op == "avg" else divide, part)
            for (comm, op, divide), part in by_reduction(trainable, data)]


def on_mesh(parts: list, split: dict | None = None):
    """The run's optimizer: the one part itself where nothing else meets it (one part, the model
    not split beside its group), else a MeshOptimizer over the parts."""
    split = {dim: g for dim, g in (split or {}).items() if g is not None and g.world_size > 1}
    return parts[0] if len(parts) == 1 and not split else MeshOptimizer(parts, split)


class PartStates(Mapping):
    """The parts' inner optimizers' state as one mapping, master -> its part's state."""

    def __init__(self, parts: list):
        self.parts = parts

    def _owner(self, master):
        for part in self.parts:
            if any(m is master for m in part.masters):
                return part.optimizer.state
        raise KeyError("not a master of any part")

    def __getitem__(self, master):
        return self._owner(master)[master]

    def __iter__(self):
        return (m for p in self.parts for m in p.optimizer.state)

    def __len__(self):
        return sum(len(p.optimizer.state) for p in self.parts)


class MeshOptimizer(torch.optim.Optimizer):
    """Concept optimizers over the parts of one model's parameters, stepped with one global norm.

    parts: the concept optimizers, the first over the data group (the parts' squares are summed
    over it when they are shards), each over its own parameters; they share the first's loss
    scale. split: {mesh dimension: group} where the model is split beside the parts' own ranks
    ("tp" tensor, "pp" pipeline, "ep" a replicated optimizer's experts): the squares are summed
    over them too, each value counted once (placements.norm_weight). A torch.optim.Optimizer
    with the parts' param groups, so a scheduler drives every part.
    """

    def __init__(self, parts: list, split: dict):
        self.parts, self.split = parts, split
        self.scaler = parts[0].scaler
        for part in parts[1:]:
            part.scaler = self.scaler
        torch.optim.Optimizer.__init__(self, [g for p in parts for g in p.param_groups], parts[0].defaults)
        self.state, self.optimizer = PartStates(parts), self        # running/pieces.py reads .optimizer.state
        self.masters = [m for p in parts for m in p.masters]
        self.syncs = GradientSyncs(*(p for p in parts if hasattr(p, "finish_gradient_sync")))
        self.last_grad_norm, self.last_step_skipped = None, False
        self._norm = self._used = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(loss)

    def step(self, closure=None):
        """Every part's gradients reduced and unscaled -> the one global norm -> one host read
        (the inf/NaN check) -> each part skips, or steps (and gathers) with it."""
        loss = run_closure(closure)
        norm, used = read_decision(self.global_norm(), self._used)
        for part, flags in zip(self.parts, self._per_part(used)):
            part.update(norm, flags)
        self.last_grad_norm, self.last_step_skipped = norm, not math.isfinite(norm)
        self.scaler.update(self.last_step_skipped)
        return loss

    def global_norm(self) -> torch.Tensor:
        """sqrt(the parts' weighted squares, summed over the data group (sharded parts) and the
        mesh's splits), the same on every rank; the sharded parts' used-flags beside it."""
        if self._norm is None:
            for part in self.parts:
                part.unscale_gradients()                # ZeRO-1 reduce-scatters here
            launched = [part.launch_used_flags() if hasattr(part, "launch_used_flags") else (None, None)
                        for part in self.parts]
            weight_of = lambda p, copies=1: norm_weight(p, self.split, copies)
            pieces = [piece for part in self.parts for piece in part.norm_pieces(weight_of)]
            squares = add_squares(pieces, torch.zeros(1, dtype=self.masters[0].dtype,
                                                      device=self.parts[0].device))
            own = self._own_groups()
            for group in [*own[:1], *self.split.values(), *own[1:]]:
                if group.world_size > 1:
                    group.all_reduce(squares, op="sum")
            for _, agree in launched:
                if agree is not None:
                    agree()
            self._norm, self._used = squares.sqrt()[0], self._flags(launched, squares.device)
            self._to_host()
        return self._norm

    def _own_groups(self) -> list:
        # The first part's: its shards' group (and FSDP's HSDP copies); none for whole copies.
        first = self.parts[0]
        if hasattr(first, "norm_groups"):
            return first.norm_groups()
        return [first.comm] if first.sharded else []

    def _flags(self, launched: list, device):
        """The parts' used-flags in one tensor, or None where every part used every parameter."""
        if all(used is None for used, _ in launched):
            return None
        return torch.cat([used if used is not None else
                          torch.ones(self._count(part), dtype=torch.uint8, device=device)
                          for part, (used, _) in zip(self.parts, launched)])

    @staticmethod
    def _count(part) -> int:
        return sum(len(flat.params) for flat in getattr(part, "flats", []))

    def _per_part(self, used: list | None) -> list:
        if used is None:
            return [None] * len(self.parts)
        cuts, first = [], 0
        for part in self.parts:
            cuts.append(used[first: first + self._count(part)])
            first += self._count(part)
        return cuts

    def _to_host(self):
        # ZeRO-Offload's parts take the decision to the host with their gradients (one wait).
        offloaded = [p for p in self.parts if getattr(p, "offload", False)]
        if not offloaded:
            return
        decision = self._norm.reshape(1)                    # fp32 (fp64 for fp64 weights)
        if self._used is not None:
            decision = torch.cat([decision, self._used.to(decision.dtype)])
        for part in offloaded:
            decision = part.to_host(decision)
        self._norm, self._used = decision[0], (decision[1:] if self._used is not None else None)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Every part's gradients scaled by min(1, max_norm / the global norm); returns it."""
        check_max_norm(max_norm)
        norm = self.global_norm()
        for part in self.parts:
            part.clip(max_norm, norm)
        return norm

    def zero_grad(self, set_to_none: bool = True):
        for part in self.parts:
            part.zero_grad(set_to_none)
        self._norm = self._used = None

    # ---- what the loop, the pipeline and the checkpoints ask of the run's optimizer ---------

    @property
    def keeps_whole_gradients(self) -> bool:
        return self.syncs.keeps_whole_gradients

    def no_sync(self):
        return self.syncs.no_sync()

    def finish_gradient_sync(self):
        self.syncs.finish_gradient_sync()

    @property
    def sharded(self) -> bool:
        return self.parts[0].sharded

    @property
    def replica_rank(self) -> int:
        return getattr(self.parts[0], "replica_rank", 0)

    def frozen_gathered(self):
        """FSDP's frozen weights whole, for a checkpoint (snapshot.frozen_whole); else nothing."""
        return getattr(self.parts[0], "frozen_gathered", contextlib.nullcontext)()

    def add_param_group(self, param_group: dict):
        refuse_new_groups(self, param_group)

    def master_ranges(self) -> list[tuple]:
        return [r for p in self.parts for r in p.master_ranges()]

    def refresh_params(self):
        for part in self.parts:
            part.refresh_params()

    def state_dict(self) -> dict:
        return {"parts": [p.state_dict() for p in self.parts]}

    def load_state_dict(self, state: dict):
        for part, saved in zip(self.parts, state["parts"]):
            part.load_state_dict(saved)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.state_tensors()]

    def host_tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in getattr(p, "host_tensors", list)()]

    def gradient_buffers(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in getattr(p, "gradient_buffers", list)()]
