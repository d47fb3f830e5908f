"""Process groups: cut the world into groups and a mesh, agree before the first step.

Every rank joins the world first (foundations/world.py). Strategies work on groups inside it:
a 2-D mesh (tensor x data, pipeline x data), and the N-D one, one group per dimension (tensor,
context, data, pipeline; experts folded into data x context). Every rank creates those groups in
the same order, as torch.distributed.new_group requires. Before the first step the ranks check
that they were started with the same model (gather_objects). What moves the bytes of every step
is foundations/comm.py's Comm. Left out: torch's DeviceMesh, elastic membership changes.
Test: python -m pytest tests/test_process_groups.py (the groups: tests/test_pipeline.py)
"""
import ctypes
import itertools
import math
import pickle
from collections import Counter
from typing import NamedTuple

import torch
import torch.distributed as dist

from foundations.comm import Comm, all_gather_single


# ---- groups inside the job: subgroups and a 2-D mesh -----------------------------------------

def subgroups(comm: Comm, rank_lists: list[list[int]], bytes_sent=None) -> "Comm | None":
    """Create a group for each list of (world) ranks, on every rank, in the given order; return
    a Comm over the one holding this rank (None if none does), sharing comm's counter (or
    counting into bytes_sent), its ring switch and its timeout (each group waits that long for a
    stalled rank, as the world does: new_group's default would be torch's, 30 minutes on gloo).

    Every rank must call it with the same lists: new_group is collective over the whole world
    (with NCCL and a bound device it splits the world's communicator, which every rank joins),
    and a group created by some ranks only, or in another order, hangs or pairs the wrong ranks.
    With ring collectives each group gets its private twin for the ring's messages, also here.
    """
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        group = dist.new_group(list(ranks), timeout=comm.group_timeout())
        p2p_group = dist.new_group(list(ranks), timeout=comm.group_timeout()) if comm.ring else None
        if me in ranks:
            mine = Comm(group, ring=comm.ring, p2p_group=p2p_group, timeout=comm.timeout,
                        bytes_sent=comm.bytes_sent if bytes_sent is None else bytes_sent)
    return mine


def make_mesh(comm: Comm, inner: int) -> tuple[Comm, Comm]:
    """(inner, outer) Comms of a 2-D grid over comm's ranks, sharing its byte counter.

    Ranks r*inner .. r*inner + inner-1 form an inner group (neighbours: on a GPU node, the
    fast links); ranks with the same position in their inner group form an outer group.
        world 4, inner 2:   inner groups {0,1} {2,3}     outer groups {0,2} {1,3}
    The caller checks that inner divides the world size, naming its own flag.
    """
    ranks = dist.get_process_group_ranks(comm.group)
    return (subgroups(comm, [ranks[start: start + inner] for start in range(0, len(ranks), inner)]),
            subgroups(comm, [ranks[offset::inner] for offset in range(inner)]))


# ---- the N-D mesh: tensor x context x data x pipeline, experts inside data x context ---------
#
# A rank's coordinates, the innermost on neighbouring ranks:  rank = ((pp D + dp) C + cp) T + tp
#   tp innermost: it all-reduces activations in every layer, forward and backward, the most
#      bytes and the most latency-bound: on one node's fastest links (NVLink), T ranks apart 1.
#   cp next: K/V blocks pass every attention layer, less than tp, more than data parallelism.
#   dp next: one gradient reduction per step (or FSDP's gathers, once per unit).
#   pp outermost: only the activations between neighbouring stages, point to point, the least
#      traffic: it can cross nodes.
# Experts (ep) fold into the D x C ranks that hold the same tensor and pipeline slice, as
# torchtitan does: consecutive runs of ep of them split the experts (an all-to-all per MoE
# layer stays on near ranks), and the ranks at the same place in each run hold the same experts
# (their expert gradients are reduced over them). Hybrid sharding (HSDP, --shard-group S) cuts
# the same D x C ranks the same way: FSDP shards over a run of S neighbours, and the ranks at
# the same place in each run hold copies of the same shards.

DIMENSIONS = ("pp", "dp", "cp", "tp")            # outermost first, as in the rank formula


class Mesh(NamedTuple):
    """This rank's group along each dimension (a Comm over 1 rank where the size is 1), plus the
    groups gradients are reduced over: dp_cp, the ranks holding the same non-expert parameters,
    and, with ep > 1, ep (the ranks splitting the experts) and expert_dp (the ranks holding the
    same experts as this one)."""
    tp: Comm
    cp: Comm
    dp: Comm
    pp: Comm
    dp_cp: Comm
    ep: Comm | None
    expert_dp: Comm | None
    shard: Comm | None = None        # HSDP: the run of dp x cp ranks FSDP shards over
    replicate: Comm | None = None    # HSDP: the ranks holding copies of this rank's shards

    def sent(self) -> dict:
        """{dimension: bytes this rank sent along it since clear()}: each dimension counts on its
        own; dp is the data-parallel reductions (over dp x cp, and expert_dp's)."""
        comms = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp_cp, "ep": self.ep}
        return {name: sum(comm.bytes_sent.values()) for name, comm in comms.items()
                if comm is not None}

    def clear(self):
        for comm in (self.tp, self.cp, self.pp, self.dp_cp, self.ep):
            if comm is not None:
                comm.bytes_sent.clear()


def mesh_shape(world: int, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
               shard: int | None = None) -> dict:
    """{dimension: size} of the mesh over `world` ranks, data parallel over what is left; a
    ValueError naming the flags when the sizes do not fit the world (or ep or the HSDP shard
    group the data x context)."""
    sizes = {"tp": tp, "cp": cp, "pp": pp, "ep": ep}
    if any(size < 1 for size in sizes.values()):
        raise ValueError(f"mesh sizes must be at least 1, got {sizes}")
    if world % (tp * cp * pp):
        raise ValueError(f"world size {world} is not --tp {tp} x --cp {cp} x --pp {pp} x a "
                         f"data-parallel size: launch a multiple of {tp * cp * pp} processes")
    dp = world // (tp * cp * pp)
    if (dp * cp) % ep:
        raise ValueError(f"--ep {ep} must divide the data x context ranks that hold the same "
                         f"tensor and pipeline slice, dp {dp} x cp {cp} = {dp * cp}")
    if shard is not None and (shard < 1 or (dp * cp) % shard):
        raise ValueError(f"--shard-group {shard} must divide the data x context ranks that hold "
                         f"the same tensor and pipeline slice, dp {dp} x cp {cp} = {dp * cp}")
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep}


def mesh_rank_lists(world: int, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
                    shard: int | None = None) -> dict:
    """{group name: [rank list, ...]}: every group of the mesh, in one order (every rank creates
    them all). A group varies along its dimensions and keeps the others fixed."""
    shape = mesh_shape(world, tp, cp, pp, ep, shard)

    def along(dims):                             # dims in DIMENSIONS' order
        fixed = [d for d in DIMENSIONS if d not in dims]
        groups = []
        for outer in itertools.product(*(range(shape[d]) for d in fixed)):
            group = []
            for inner in itertools.product(*(range(shape[d]) for d in dims)):
                where = {**dict(zip(fixed, outer)), **dict(zip(dims, inner))}
                group.append(_flatten([where[d] for d in DIMENSIONS],
                                      [shape[d] for d in DIMENSIONS]))
            groups.append(group)
        return groups
    lists = {d: along([d]) for d in DIMENSIONS}
    lists["dp_cp"] = along(["dp", "cp"])                      # ranks ordered dp-major: dp C + cp

    def runs(size):           # each dp x cp group: runs of `size` neighbours, and across the runs
        return ([g[start: start + size] for g in lists["dp_cp"]
                 for start in range(0, len(g), size)],
                [g[offset::size] for g in lists["dp_cp"] for offset in range(size)])
    if ep > 1:
        lists["ep"], lists["expert_dp"] = runs(ep)
    if shard is not None and shard < shape["dp"] * shape["cp"]:
        lists["shard"], lists["replicate"] = runs(shard)
    return lists


def _flatten(coords: list, sizes: list) -> int:
    """The rank at coords (outermost first) of a grid of the given sizes: for the mesh,
    ((pp D + dp) C + cp) T + tp."""
    r = 0
    for c, n in zip(coords, sizes):
        r = r * n + c
    return r


def make_device_mesh(comm: Comm, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
                     shard: int | None = None) -> Mesh:
    """This rank's Mesh over comm's ranks (the world), a byte counter per dimension (Mesh.sent);
    shard: HSDP's shard group size within dp x cp (None: FSDP shards over all of it).
    Collective: every rank creates every group, dimension by dimension, in mesh_rank_lists'
    order."""
    ranks = dist.get_process_group_ranks(comm.group)
    lists = mesh_rank_lists(len(ranks), tp, cp, pp, ep, shard)
    data = Counter()              # dp, dp x cp, expert_dp and HSDP's: the gradients' reductions
    counters = {"dp": data, "dp_cp": data, "expert_dp": data, "shard": data, "replicate": data}
    groups = {name: subgroups(comm, [[ranks[r] for r in group] for group in rank_lists],
                              bytes_sent=counters.get(name, Counter()))
              for name, rank_lists in lists.items()}
    return Mesh(groups["tp"], groups["cp"], groups["dp"], groups["pp"], groups["dp_cp"],
                groups.get("ep"), groups.get("expert_dp"), groups.get("shard"),
                groups.get("replicate"))


# ---- agreeing before the first step ----------------------------------------------------------

def gather_objects(obj, comm: Comm, device: torch.device, dst: int | None = None) -> list | None:
    """Every rank's picklable `obj`, in rank order, on rank `dst` of comm (None: on every rank).

    torch's all_gather_object/gather_object do the same, decoding through numpy. Here the pickled
    bytes travel as a uint8 tensor on `device`
    (NCCL moves only device tensors): first every rank's length, then the bytes padded to the
    longest. Ranks other than dst get None. For set-up and export, not for every step.
    """
    n = comm.world_size
    mine = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)            # (N,)
    lengths[comm.rank] = mine.numel()
    dist.all_reduce(lengths, group=comm.group)
    lengths = lengths.tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)  # (longest,)
    padded[: mine.numel()] = mine
    receives = dst is None or comm.rank == dst
    every = torch.empty(n * max(lengths), dtype=torch.uint8, device=device) if receives else None
    if dst is None:                                                       # (N * longest,)
        all_gather_single(every, padded, group=comm.group)
    else:
        dist.gather(padded, list(every.view(n, -1)) if receives else None, group=comm.group,
                    group_dst=dst)
    if not receives:
        return None
    every = every.view(n, -1).cpu()                                       # (N, longest)
    # The bytes of each row, read straight from memory (one memcpy): torch itself goes through
    # numpy here, and iterating a storage reads one byte per Python call.
    return [pickle.loads(ctypes.string_at(row.data_ptr(), length))
            for row, length in zip(every, lengths)]


def check_same_parameters(params: list[torch.Tensor], comm: Comm, device=None):
    """Raise the same clear error on every rank if the ranks' parameter shapes differ.

    Called by the strategies at construction, before their first broadcast: ranks started
    with different model configurations would otherwise exchange mismatched buffers and
    fail deep inside torch, or silently train rank 0's model everywhere.
    """
    shapes = [tuple(p.shape) for p in params]
    # device: the group's (NCCL gathers device memory only); default: the parameters'.
    device = device or (params[0].device if params else torch.device("cpu"))
    every = gather_objects(shapes, comm, device)
    for rank, other in enumerate(every):
        if other != every[0]:
            def count(s):
                return sum(math.prod(shape) for shape in s)
            i = next((i for i, (a, b) in enumerate(zip(every[0], other)) if a != b),
                     min(len(other), len(every[0])))
            first = [s[i] if i < len(s) else "none" for s in (every[0], other)]
            raise ValueError(f"ranks were started with different models: rank 0 has "
                             f"{count(every[0]):,} parameters in {len(every[0])} tensors, rank "
                             f"{rank} has {count(other):,} in {len(other)} (tensor {i}: {first[0]} "
                             f"vs {first[1]}); start every rank with the same model configuration")


def global_mean(value: torch.Tensor) -> float:
    """The mean over ranks of a per-rank scalar: a metric, outside the byte counter."""
    value = value.detach().float().clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value.item()
