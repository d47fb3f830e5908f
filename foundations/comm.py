"""Comm: the project's collectives, the lecture's ring as it runs, bytes counted.

collectives.py shows the ring plainly: reduce-scatter and all-gather in N-1 steps of one message
per rank, all-reduce as the two (Patarasuk & Yuan, 2009). Comm runs the same steps for every
strategy, each chunk pipelined in segments, launched in one order on every rank as NCCL requires,
beside torch.distributed's native calls, and counts the bytes each rank sends (the run's log
prints them beside the ring formula, ring_bytes). Under the ring (launcher thread, scratch):
foundations/launch.py.
Test: python -m pytest tests/test_collectives.py

Shapes: N ranks in the group, r this rank, c = ceil(L / N) elements per chunk of an (L,) tensor.
"""
import datetime
from collections import Counter
from typing import NamedTuple

import torch
import torch.distributed as dist

from foundations.launch import Handle, Messages, Workspaces


def ring_bytes(collective: str, numel: int, element_size: int, world_size: int,
               rank: int = 0, root: int = 0) -> int:
    """Bytes rank `rank` sends in the ring `collective` on a tensor of `numel` (reduce_scatter,
    all_gather: the full N x shard tensor; the others pad it to N chunks): one chunk a step."""
    n = world_size
    chunk = -(-numel // n) * element_size
    steps = {"reduce_scatter": n - 1, "all_gather": n - 1, "all_reduce": 2 * (n - 1),
             # broadcast = scatter from the root + all-gather; reduce = reduce-scatter + gather
             "broadcast": (n - 1) * (2 if rank == root else 1),
             "reduce": (n - 1) + (0 if rank == root else 1)}[collective]
    return steps * chunk if n > 1 else 0


# The plain ring's steps, each chunk in segments so that reducing one overlaps sending the next
# (_run_steps), into scratch kept call after call; every rank launching on its communicators in
# one order, NCCL's rule (_run_ring). Beside it, torch.distributed's native calls (ring= picks).

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}
# Smaller segments overlap more and pay a message's fixed cost more often: 1 MiB measured best
# on gloo over loopback (bench/ring.py); NCCL's own slices are smaller.
SEGMENT_BYTES = 2**20
RING_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")


class Comm:
    """Collectives over one process group (default: the world), ring or native, bytes counted.

    ring: True builds every collective from messages, or the names of those to build
    (RING_COLLECTIVES); a world's ring Comm is made on every rank, a subgroup's by
    process_groups.subgroups() (with p2p_group, its private twin). Each method works in place;
    async_op=True returns a Handle (wait()) at once, to compute while the bytes move.
    bytes_sent: a Counter {collective: bytes this rank sent}, shared with comms made by subgroups():
    a ring collective's counted message by message, a native call's by ring_bytes (the formula).
    timeout: seconds a group made from this Comm waits for a stalled rank before it raises (None:
    torch's default, 30 minutes on gloo, 10 on NCCL)."""

    def __init__(self, group=None, ring=False, bytes_sent: Counter | None = None,
                 p2p_group=None, segment_bytes: int = SEGMENT_BYTES, timeout: float | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.ring = frozenset(RING_COLLECTIVES if ring is True else ring or ())    # names, or empty
        self.timeout = timeout
        self.bytes_sent = bytes_sent if bytes_sent is not None else Counter()
        if ring:
            # on a private communicator, the world's made here (private_twin says why only it)
            self._ring_messages = (Messages(p2p_group) if p2p_group is not None else
                                   Messages.private_twin(self.group, self.group_timeout()))
            self._workspaces = Workspaces()       # (dtype, device) -> the ring's scratch buffer
            self.segment_bytes = segment_bytes

    @classmethod
    def from_group(cls, group) -> "Comm":
        """The strategies' group argument as a Comm: a Comm as it is, a process group or None
        (the world) wrapped, with native collectives."""
        return group if isinstance(group, Comm) else cls(group)

    def group_timeout(self) -> "datetime.timedelta | None":
        """timeout as new_group takes it (every group creation passes it)."""
        return None if self.timeout is None else datetime.timedelta(seconds=self.timeout)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        """Every rank ends with op(tensor of rank 0, ..., tensor of rank N-1)."""
        if "all_reduce" in self.ring:
            return self._run_ring(self._ring_all_reduce, async_op, tensor, op)
        self._count("all_reduce", tensor.numel(), tensor.element_size())
        work = dist.all_reduce(tensor, op=REDUCE_OPS[op], group=self.group, async_op=async_op)
        return Handle(work.wait) if async_op else None

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                       async_op: bool = False):
        """input (N*c,) on every rank -> output (c,) on rank r = op over ranks of input chunk r."""
        _check_shards("reduce_scatter", output, input, self.world_size)
        if "reduce_scatter" in self.ring:
            return self._run_ring(self._ring_reduce_scatter, async_op, output, input, op)
        self._count("reduce_scatter", input.numel(), input.element_size())
        work = reduce_scatter_single(output, input, op=REDUCE_OPS[op], group=self.group,
                                     async_op=async_op)
        return Handle(work.wait) if async_op else None

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """input (c,) on rank r -> output (N*c,) on every rank, chunk r = rank r's input."""
        _check_shards("all_gather", input, output, self.world_size)
        if "all_gather" in self.ring:
            return self._run_ring(self._ring_all_gather, async_op, output, input)
        self._count("all_gather", output.numel(), output.element_size())
        work = all_gather_single(output, input, group=self.group, async_op=async_op)
        return Handle(work.wait) if async_op else None

    # ---- the pipelined ring: the plain ring's steps, each chunk in segments ------------------

    def _ring_reduce_scatter(self, output, input, op):
        # ring_reduce_scatter's steps, the input only read: step s's partial sum goes to workspace
        # chunk s % 2, sent at step s+1 while that step writes the other (one would do: _run_steps
        # waits for segment j's send before writing out[j]); the last step writes into output.
        n = self.world_size
        if n == 1:
            return output.copy_(input.view(-1))
        recv, *partial = self._workspaces.take(output, *[output.numel()] * (1 + min(2, n - 2)))
        outs = [partial[step % 2] for step in range(n - 2)] + [output]
        steps = self._reduce_scatter_steps(input.view(n, -1), recv, outs)   # input (N, c), read
        self._run_steps(steps, op, "reduce_scatter")

    def _ring_all_gather(self, output, input):
        chunks = output.view(self.world_size, -1)          # (N, c)
        chunks[self.rank].copy_(input)
        self._run_steps(self._all_gather_steps(chunks), None, "all_gather")

    def _ring_all_reduce(self, tensor, op):
        # reduce-scatter + all-gather in place, as ring_all_reduce, but as one run of 2(N-1)
        # steps, so the all-gather's first segment leaves as soon as it is reduced.
        chunks, recv = self._workspaces.in_place(tensor, self.world_size)  # (N, c), (c,)
        steps = self._reduce_scatter_steps(chunks, recv) + self._all_gather_steps(chunks)
        self._run_steps(steps, op, "all_reduce")
        Workspaces.copy_back(tensor, chunks)

    def _reduce_scatter_steps(self, chunks, recv, outs: list | None = None) -> list:
        # ring_reduce_scatter's: at step s rank r adds chunk r-2-s to what arrives, into outs[s]
        # (default: that chunk, in place), and sends chunk r-1, then the sum of the step before.
        n, r = self.world_size, self.rank
        if outs is None:
            outs = [chunks[(r - step - 2) % n] for step in range(n - 1)]
        sends = [chunks[(r - 1) % n]] + outs[:-1]
        return [_Step(sends[step], recv, add=chunks[(r - step - 2) % n], out=outs[step])
                for step in range(n - 1)]

    def _all_gather_steps(self, chunks) -> list:
        # ring_all_gather's: rank r forwards chunk r-s and receives chunk r-s-1 into place.
        n, r = self.world_size, self.rank
        return [_Step(chunks[(r - step) % n], chunks[(r - step - 1) % n]) for step in range(n - 1)]

    def _run_steps(self, steps: list, op, name: str):
        """Run ring steps: at each, send step.send right while receiving the left neighbour's
        into step.recv, then, in a reduction, step.out = step.add (op) step.recv.

        Each chunk travels in segments of segment_bytes: step 0's are all posted at once, then
        segment j of step s+1 leaves as soon as segment j of step s is in place, so a segment is
        reduced while the others are on the wire (NCCL's slices). Every rank posts in one order,
        (step 0, segment 0), (0, 1), ..., (1, 0), ..., a segment's send and receive in one batch."""
        n = self.world_size
        if not steps:                                      # a world of one: nothing to send
            return
        right, left = (self.rank + 1) % n, (self.rank - 1) % n
        per_segment = max(1, self.segment_bytes // steps[0].send.element_size())
        # Each step's tensors as segments; every step's are (c,) views, so cut alike (in_flight).
        split = [[t.split(per_segment) if t is not None else None for t in step] for step in steps]

        def post_segment(s, j):
            send, recv = split[s][0][j], split[s][1][j]
            self.bytes_sent[name] += send.nbytes
            return self._ring_messages.post([("send", send, right), ("recv", recv, left)])
        in_flight = [post_segment(0, j) for j in range(len(split[0][0]))]
        for s, (_, recvs, adds, outs) in enumerate(split):         # step s's segments
            # avg: divide once, where a chunk's sum is complete (the reduce-scatter's last step)
            divide = op == "avg" and adds is not None and (s + 1 == len(steps) or steps[s + 1].add is None)
            for j, works in enumerate(in_flight):
                Messages.wait(works)  # segment j arrived, and the one sent may be overwritten
                if adds is not None:                       # sum (avg: divided below) or max
                    (torch.maximum if op == "max" else torch.add)(adds[j], recvs[j], out=outs[j])
                    if divide:
                        outs[j].div_(n)
                if s + 1 < len(steps):
                    in_flight[j] = post_segment(s + 1, j)

    def _run_ring(self, fn, async_op, *args):
        # NCCL's launch rule, every rank launching on its communicators in one order: the ring runs
        # on the one launcher thread, after every ring call and exchange before it (launch.Launcher).
        handle = Messages.launch(fn, [a for a in args if isinstance(a, torch.Tensor)], *args)
        return handle if async_op else handle.wait()

    # ---- the other collectives, ring or native --------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Every rank ends with rank `src`'s tensor (src is a rank within this group)."""
        if "broadcast" in self.ring:
            return self._run_ring(self._ring_broadcast, async_op, tensor, src)
        self._count("broadcast", tensor.numel(), tensor.element_size(), root=src)
        work = dist.broadcast(tensor, group=self.group, group_src=src, async_op=async_op)
        return Handle(work.wait) if async_op else None

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", async_op: bool = False):
        """Rank `dst` ends with op over all ranks' tensors; the others' tensors are unspecified."""
        if "reduce" in self.ring:
            return self._run_ring(self._ring_reduce, async_op, tensor, dst, op)
        self._count("reduce", tensor.numel(), tensor.element_size(), root=dst)
        work = dist.reduce(tensor, group=self.group, group_dst=dst, op=REDUCE_OPS[op],
                           async_op=async_op)
        return Handle(work.wait) if async_op else None

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits=None,
                   input_splits=None, async_op: bool = False):
        """MoE's dispatch and combine: rank r sends input's i-th block of rows to rank i and
        receives rank i's r-th block into output's i-th; splits: rows per rank (None: N equal
        blocks). Built from messages it is not a ring (launch.Messages.all_to_all)."""
        self.bytes_sent["all_to_all"] += all_to_all_bytes(input, input_splits, self.rank, self.world_size)
        if "all_to_all" in self.ring:
            return self._run_ring(self._ring_messages.all_to_all, async_op, output, input,
                                  output_splits, input_splits)
        work = dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group,
                                      async_op=async_op)
        return Handle(work.wait) if async_op else None

    def exchange(self, ops: list) -> Handle:
        """A pipeline stage's sends and receives, posted together as a ring step's pair: ops
        ("send" | "recv", tensor, peer), peer a rank of this group; wait() before reading a
        receive or reusing a send. With ring collectives, posted after every ring message before."""
        self.bytes_sent["send"] += sum(tensor.nbytes for kind, tensor, _ in ops if kind == "send")
        return Messages(self.group).exchange(ops, after_the_ring=bool(self.ring))

    def _ring_broadcast(self, tensor, src):
        # Scatter (the root sends chunk i to rank i), then ring all-gather: the root sends
        # about 2x the tensor, every other rank about 1x, instead of the root sending N-1 copies.
        chunks, _ = self._workspaces.in_place(tensor, self.world_size)    # (N, c)
        self.bytes_sent["broadcast"] += self._ring_messages.scatter(chunks, src)
        self._run_steps(self._all_gather_steps(chunks), None, "broadcast")
        Workspaces.copy_back(tensor, chunks)

    def _ring_reduce(self, tensor, dst, op):
        # Mirror image of broadcast: ring reduce-scatter in place (the other ranks' tensors
        # are left unspecified), then every rank sends its reduced chunk to the root (a gather).
        chunks, recv = self._workspaces.in_place(tensor, self.world_size)  # (N, c), (c,)
        self._run_steps(self._reduce_scatter_steps(chunks, recv), op, "reduce")
        self.bytes_sent["reduce"] += self._ring_messages.gather(chunks, dst)
        if self.rank == dst:
            Workspaces.copy_back(tensor, chunks)

    def _count(self, name, numel, element_size, root=0):
        # The native library does not report what it sent: count what the ring sends.
        self.bytes_sent[name] += ring_bytes(name, numel, element_size, self.world_size,
                                            self.rank, root)


# mechanics/fsdp_state.py's name for Comm.from_group, until it calls the classmethod itself.


def all_to_all_bytes(input: torch.Tensor, input_splits, rank: int, world_size: int) -> int:
    """Bytes a rank sends in an all-to-all: every block of its input but its own."""
    blocks = Messages.row_blocks(input, input_splits, world_size)
    return sum(block.nbytes for i, block in enumerate(blocks) if i != rank)


# torch 2.13's one-tensor collectives, or their names before it (a GPU image's older torch),
# looked up at each call (a test that wraps torch's collective sees every call)
def all_gather_single(*args, **kwargs):
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_single(*args, **kwargs):
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(*args, **kwargs)


def _check_shards(name, shard, full, world_size):
    """A reduce-scatter's or an all-gather's tensors, checked before anything is launched: the
    (c,) shard first, then the (N*c,) full tensor, whichever of them is the output."""
    if full.numel() != shard.numel() * world_size or full.dtype != shard.dtype:
        raise ValueError(f"{name}: the full tensor must hold exactly N={world_size} shards of the "
                         f"same dtype, got {full.numel()} {full.dtype} elements for shards of "
                         f"{shard.numel()} {shard.dtype}; pad the full tensor to a multiple of N")


class _Step(NamedTuple):
    """One ring step of one rank, (c,) views: send goes right, recv comes from the left."""
    send: torch.Tensor
    recv: torch.Tensor
    add: torch.Tensor | None = None
    out: torch.Tensor | None = None
