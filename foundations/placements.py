"""Placements: one small record per parameter saying how it lies on the mesh, and what follows.

A rank holds each parameter whole or as a piece. Along each mesh dimension a parameter is
  sharded     the dimension's ranks hold different pieces: slices along a tensor dim (tensor
              parallelism's columns and rows) or different tensors (the experts, a pipeline's
              stages), or
  replicated  they hold the same values (the default: data parallelism's copies),
and its gradient may be a partial sum over a group until that group sums it (sequence
parallelism's replicated weights, the whole factor of a split LoRA layer). This is DTensor's
idea (PyTorch 2.x, Shard / Replicate / Partial), written small: the split that creates a layout
writes the record, and three things read it, each written once:
  - the global gradient norm: every piece's squares, weighted so that a value held by k ranks
    of the groups summed over counts 1/k on each (grad_norm, norm_weight);
  - the group that averages a gradient over the data dimension (data_reduction);
  - the pieces a checkpoint gathers (running/snapshot.py, running/pieces.py: tensor_dim).
Left out: DTensor's tensor subclass and its operator dispatch; a record is read, never run.
Test: python -m pytest tests/test_placements.py
"""

from dataclasses import dataclass, field, replace

import torch

from foundations.comm import Comm


@dataclass(frozen=True)
class Placement:
    shard: dict = field(default_factory=dict)  # {mesh dim: tensor dim cut, or None: different tensors}
    partial: str | None = None      # the mesh dim its gradient is a partial sum over, until summed
    holders: Comm | None = None     # inside the data dimension, the ranks holding these values
                                    # (an expert's replicas); None: every data rank
    counted: bool = True            # False: a second copy whose gradient the norm counts elsewhere


_REPLICATED = Placement()


def placement(p) -> Placement:
    """p's record; a parameter no split has touched is replicated everywhere."""
    return getattr(p, "placement", _REPLICATED)


def place(p, shard: dict | None = None, **fields):
    """Write (add to) p's record: shard={"tp": 0} merges with the dims it is sharded along
    already; partial=, holders=, counted= replace theirs. Returns p."""
    old = placement(p)
    p.placement = replace(old, shard={**old.shard, **(shard or {})}, **fields)
    return p


def tensor_dim(p, dim: str = "tp") -> int | None:
    """The tensor dim p is cut along over mesh dimension `dim`; None when p is whole there."""
    return placement(p).shard.get(dim)


# ---- the data dimension: which group averages a gradient ------------------------------------

def data_reduction(p, data: Comm, world: int | None = None) -> tuple[Comm, str, int]:
    """(group, op, divisor) that make p's gradient the mean over the data dimension's `world`
    ranks (default: data's): data's average for a replicated p. A p held by only some of them
    (an expert: `holders`) has a gradient that already sums the tokens of the ranks it is
    sharded over (the all-to-all brought them), so it is summed over its holders and divided by
    the whole world: the same mean. ddp.py, zero.py and fsdp.py reduce by it."""
    holders = placement(p).holders
    if holders is None:
        return data, "avg", 1
    return holders, "sum", world or data.world_size


def by_reduction(tensors: list, data: Comm, world: int | None = None) -> list:
    """[(data_reduction(), tensors)], replicated ones first, then each holders group's; order
    kept within each, the same on every rank (every rank holds the same kinds of parameter)."""
    groups = {}                                       # {id(holders): tensors}, None's first
    for t in sorted(tensors, key=lambda t: placement(t).holders is not None):    # stable
        groups.setdefault(id(placement(t).holders), []).append(t)
    return [(data_reduction(part[0], data, world), part) for part in groups.values()]


# ---- the global gradient norm -----------------------------------------------------------------

def norm_weight(p, split: dict, copies: int = 1) -> float:
    """What p's squares count on this rank, so that their sum over the ranks of `split` (and of
    the data group, for a sharded optimizer) counts every value once: 1/k for a value that k of
    those ranks hold, 0 for a copy counted elsewhere.
    split: {mesh dim: group} the norm sums over beside the optimizer's own data group; p, sharded
    along a dim, holds its own piece there (1), else the same values as the dim's other ranks.
    copies: ranks of the data group holding this same piece (HSDP's copies of a shard)."""
    where = placement(p)
    if not where.counted:
        return 0.0
    weight = 1.0 / copies
    for dim, group in split.items():
        if dim not in where.shard:
            weight /= group.world_size
    return weight


def add_squares(pieces: list, squares: torch.Tensor) -> torch.Tensor:
    """Add each piece's weighted squares, [(gradient tensor, weight)] in order, into squares
    ((1,) fp32, or fp64 for fp64 weights: dtypes.master_dtype): the one place the project sums a
    gradient's squares. Returns squares."""
    for grad, weight in pieces:
        if weight:
            squares += grad.to(squares.dtype).pow(2).sum() * weight
    return squares


def grad_norm(pieces: list, groups: list, device) -> torch.Tensor:
    """The global gradient 2-norm from this rank's pieces [(gradient tensor, norm_weight)]:
    weighted squares summed here, then over each group (one 4-byte all-reduce each; the groups
    are orthogonal dimensions of the mesh, so together they span every rank holding a piece),
    then the root. Every rank gets the same norm. device: the groups' (NCCL reduces device
    memory only)."""
    squares = add_squares(pieces, torch.zeros(1, device=device))
    for group in groups:
        if group.world_size > 1:
            group.all_reduce(squares, op="sum")
    return squares.sqrt()[0]
