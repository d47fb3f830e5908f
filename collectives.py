"""Collectives: how ranks combine tensors, built from point-to-point messages.

Every strategy in this project is a choice of which rank holds which bytes and which
collective moves them. Here the collectives are built from send/recv on a ring, the
bandwidth-optimal schedule (Patarasuk & Yuan, 2009) that NCCL uses for large messages,
and all-reduce is written as the lecture's identity: reduce-scatter, then all-gather.
As in NCCL, each ring step's chunk moves in segments, so reducing one overlaps sending the
next, and the scratch it reduces into is allocated once, not per call. The same methods run
on torch.distributed's native calls (the default); one switch picks ring or native, and a
byte counter records what each rank sends.
Left out: tree and hierarchical algorithms, latency tuning for small messages. Joining the
job, its groups and meshes: process_groups.py; the thread, stream, private group and scratch
the ring is launched with (one launch order on every rank, as NCCL requires): launch.py.
Test: python -m pytest tests/test_collectives.py

Shapes: N ranks in the group, r this rank, L elements in the tensor, c = ceil(L / N)
elements per chunk; rank r's neighbours on the ring are r - 1 (left) and r + 1 (right).
"""
import datetime
from collections import Counter
from typing import NamedTuple

import torch
import torch.distributed as dist

from launch import (Workspaces, all_gather_single, check_shards, copy_back, launcher, post,
                    reduce_scatter_single, ring_group, send_recv, wait_all)

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}
# A ring step's chunk travels in segments of this size, so that reducing one overlaps sending
# the next. Smaller segments overlap more and pay a message's fixed cost more often: 1 MiB
# measured best on gloo over loopback (bench_collectives.py); NCCL's own slices are smaller.
SEGMENT_BYTES = 2**20
# The collectives a Comm can build as a ring (Comm(ring=...) names some, or True for all).
RING_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")


class Handle:
    """What an asynchronous collective returns: wait() blocks until the result is in place."""

    def __init__(self, wait):
        self._wait = wait

    def wait(self):
        self._wait()


def ring_bytes(collective: str, numel: int, element_size: int, world_size: int,
               rank: int = 0, root: int = 0) -> int:
    """Bytes rank `rank` sends in the ring version of `collective` on a tensor of `numel`.

    reduce_scatter and all_gather take `numel` as the full (N x shard) tensor; the others
    pad it to N equal chunks. Each ring step sends one chunk, so a rank sends (N-1) chunks
    per reduce-scatter or all-gather, about (N-1)/N of the tensor, and twice that for an
    all-reduce: the volume that makes ring all-reduce bandwidth-optimal.
    """
    n = world_size
    chunk = -(-numel // n) * element_size
    steps = {"reduce_scatter": n - 1, "all_gather": n - 1, "all_reduce": 2 * (n - 1),
             # broadcast = scatter from the root + all-gather; reduce = reduce-scatter + gather
             "broadcast": (n - 1) * (2 if rank == root else 1),
             "reduce": (n - 1) + (0 if rank == root else 1)}[collective]
    return steps * chunk if n > 1 else 0


class Comm:
    """Collectives over one process group: ring (from send/recv) or native, bytes counted.

    group: the ranks taking part (default: the whole world). ring: build the collectives
    from point-to-point messages instead of calling torch.distributed's: True for all of them,
    or the names of those to build (RING_COLLECTIVES). bytes_sent: a
    Counter {collective name: bytes this rank sent}, shared with comms made by subgroups().
    Every method works in place on the given tensors and takes async_op: when True it
    returns a Handle at once, so the caller can compute while the bytes move.
    Constructing a Comm over the world with ring=True is collective: every rank does it;
    over a subgroup, process_groups.subgroups() builds it (with p2p_group, its private twin).
    segment_bytes: the ring's pipelining grain (SEGMENT_BYTES).
    timeout: seconds a collective on a group made from this Comm (its ring twin, its subgroups)
    waits for a stalled rank before it raises: the run's, as the world's was joined with
    (process_groups.init_distributed). None: torch's default, 30 minutes on gloo, 10 on NCCL.
    """

    def __init__(self, group=None, ring=False, bytes_sent: Counter | None = None,
                 p2p_group=None, segment_bytes: int = SEGMENT_BYTES, timeout: float | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.ring = frozenset(RING_COLLECTIVES if ring is True else ring or ())    # names, or empty
        self.timeout = timeout
        self.bytes_sent = bytes_sent if bytes_sent is not None else Counter()
        if ring:
            # Ring messages go on a private communicator, the world's made here (launch.ring_group
            # says why only the world's), and leave from the process's one launcher thread.
            self._p2p_group = p2p_group if p2p_group is not None else ring_group(
                self.group, self.group_timeout())
            self._workspaces = Workspaces()       # (dtype, device) -> the ring's scratch buffer
            self.segment_bytes = segment_bytes

    def group_timeout(self) -> "datetime.timedelta | None":
        """timeout as new_group takes it (every group creation passes it)."""
        return None if self.timeout is None else datetime.timedelta(seconds=self.timeout)

    # ---- the public collectives -------------------------------------------------------

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
        check_shards("reduce_scatter", output, input, self.world_size)
        if "reduce_scatter" in self.ring:
            return self._run_ring(self._ring_reduce_scatter, async_op, output, input, op)
        self._count("reduce_scatter", input.numel(), input.element_size())
        work = reduce_scatter_single(output, input, op=REDUCE_OPS[op], group=self.group,
                                     async_op=async_op)
        return Handle(work.wait) if async_op else None

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """input (c,) on rank r -> output (N*c,) on every rank, chunk r = rank r's input."""
        check_shards("all_gather", input, output, self.world_size)
        if "all_gather" in self.ring:
            return self._run_ring(self._ring_all_gather, async_op, output, input)
        self._count("all_gather", output.numel(), output.element_size())
        work = all_gather_single(output, input, group=self.group, async_op=async_op)
        return Handle(work.wait) if async_op else None

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
        """Rank r sends input's i-th block of rows to rank i, and receives rank i's r-th block
        into output's i-th: input (sum of input_splits, ...) -> output (sum of output_splits,
        ...); splits are row counts per rank, None for N equal blocks. MoE's dispatch and
        combine (moe.py): each rank's tokens to the ranks that hold their experts, and back."""
        if "all_to_all" in self.ring:
            return self._run_ring(self._ring_all_to_all, async_op, output, input, output_splits,
                                  input_splits)
        self.bytes_sent["all_to_all"] += all_to_all_bytes(input, input_splits, self.rank,
                                                          self.world_size)
        work = dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group,
                                      async_op=async_op)
        return Handle(work.wait) if async_op else None

    # ---- point to point: what a pipeline stage sends its neighbour ----------------------

    def exchange(self, ops: list) -> Handle:
        """Post sends and receives together: ops is a list of ("send" | "recv", tensor, peer),
        peer a rank of this group; wait() before reading a receive's tensor or reusing a send's.

        One dist.batch_isend_irecv: under NCCL one group of p2p calls, which run together
        (and one work for all of them). Separate calls would run one after another on the p2p
        stream (schedules.py's run_under_nccl says why that can deadlock). Messages between two
        ranks are matched in the order they were posted, so shape and dtype of each receive
        must match its send. With ring collectives the launcher thread posts them, after every
        ring message issued before (launch.Launcher says why).
        """
        p2p = []
        for kind, tensor, peer in ops:
            if kind == "send":
                self.bytes_sent["send"] += tensor.nbytes
            p2p.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor,
                                  group=self.group, group_peer=peer))
        if not p2p:
            return Handle(lambda: None)
        if self.ring:
            posted = launcher().submit(post, [op.tensor for op in p2p], p2p)
            return Handle(lambda: wait_all(posted()))
        works = post(p2p)
        return Handle(lambda: wait_all(works))

    # ---- the ring versions, from send/recv --------------------------------------------

    def _ring_reduce_scatter(self, output, input, op):
        #   step 0        step 1        ...  step N-2
        #   rank r sends chunk r-1-s to r+1 and reduces chunk r-2-s from r-1 with its own copy;
        #   after N-1 steps chunk r has passed every rank once: it holds the full reduction.
        # The caller's input is only read: the partial sums go to two workspace chunks in
        # turn (one on the wire while the next is written), the last step's into output.
        n, r = self.world_size, self.rank
        if n == 1:
            return output.copy_(input.view(-1))
        chunks = input.view(n, -1)                         # (N, c)
        recv, *partial = self._workspaces.take(output, *[output.numel()] * (1 + min(2, n - 2)))
        steps, send = [], chunks[(r - 1) % n]
        for step in range(n - 1):
            out = output if step == n - 2 else partial[step % 2]
            steps.append(_Step(send, recv, add=chunks[(r - step - 2) % n], out=out))
            send = out
        self._run_steps(steps, op, "reduce_scatter")

    def _ring_all_gather(self, output, input):
        chunks = output.view(self.world_size, -1)          # (N, c)
        chunks[self.rank].copy_(input)
        self._run_steps(self._all_gather_steps(chunks), None, "all_gather")

    def _ring_all_reduce(self, tensor, op):
        # The lecture's identity: all-reduce = reduce-scatter + all-gather, 2(N-1)/N x bytes,
        # in place: rank r reduces chunk r where it lies, then passes it round. One run of
        # 2(N-1) steps, so the all-gather's first segment leaves as soon as it is reduced.
        flat, recv = self._workspaces.in_place(tensor, self.world_size)   # (N*c,), (c,)
        chunks = flat.view(self.world_size, -1)            # (N, c)
        steps = self._reduce_scatter_steps(chunks, recv) + self._all_gather_steps(chunks)
        self._run_steps(steps, op, "all_reduce")
        copy_back(tensor, flat)

    def _ring_broadcast(self, tensor, src):
        # Scatter (the root sends chunk i to rank i), then ring all-gather: the root sends
        # about 2x the tensor, every other rank about 1x, instead of the root sending N-1 copies.
        n, r = self.world_size, self.rank
        flat, _ = self._workspaces.in_place(tensor, n)     # (N*c,)
        chunks = flat.view(n, -1)                          # (N, c)
        if r == src:
            ops = [self._p2p(dist.isend, chunks[i], i) for i in range(n) if i != src]
            self.bytes_sent["broadcast"] += chunks[0].nbytes * (n - 1)
        else:
            ops = [self._p2p(dist.irecv, chunks[r], src)]
        send_recv(ops)
        self._run_steps(self._all_gather_steps(chunks), None, "broadcast")
        copy_back(tensor, flat)

    def _ring_reduce(self, tensor, dst, op):
        # Mirror image of broadcast: ring reduce-scatter in place (the other ranks' tensors
        # are left unspecified), then every rank sends its reduced chunk to the root (a gather).
        n, r = self.world_size, self.rank
        flat, recv = self._workspaces.in_place(tensor, n)  # (N*c,), (c,)
        chunks = flat.view(n, -1)                          # (N, c)
        self._run_steps(self._reduce_scatter_steps(chunks, recv), op, "reduce")
        if r == dst:
            ops = [self._p2p(dist.irecv, chunks[i], i) for i in range(n) if i != dst]
        else:
            ops = [self._p2p(dist.isend, chunks[r], dst)]
            self.bytes_sent["reduce"] += chunks[r].nbytes
        send_recv(ops)
        if r == dst:
            copy_back(tensor, flat)

    def _ring_all_to_all(self, output, input, output_splits, input_splits):
        # Not a ring: every pair of ranks exchanges once. At step s rank r sends its block for
        # r+s and receives r-s's block for it, both posted together (NCCL runs two ranks'
        # p2p calls in order: posted apart, every rank's send would wait for a receive that
        # is not posted yet). N-1 steps, each rank sending what is not its own: (N-1)/N of
        # the input for equal blocks, as the native call.
        n, r = self.world_size, self.rank
        sends, receives = _row_blocks(input, input_splits, n), _row_blocks(output, output_splits, n)
        receives[r].copy_(sends[r])
        for step in range(1, n):
            to, source = (r + step) % n, (r - step) % n
            ops = [self._p2p(dist.isend, sends[to], to)] if sends[to].numel() else []
            if receives[source].numel():                 # an empty block is never sent
                ops.append(self._p2p(dist.irecv, receives[source], source))
            send_recv(ops)
            self.bytes_sent["all_to_all"] += sends[to].nbytes

    # ---- the ring's steps, run as a pipeline of segments --------------------------------

    def _reduce_scatter_steps(self, chunks, recv) -> list:
        # In place: rank r sends chunk r-1-s and adds chunk r-2-s from r-1 into its own.
        n, r = self.world_size, self.rank
        return [_Step(chunks[(r - step - 1) % n], recv, add=chunks[(r - step - 2) % n],
                      out=chunks[(r - step - 2) % n]) for step in range(n - 1)]

    def _all_gather_steps(self, chunks) -> list:
        # Rank r starts with chunk r; at step s it forwards chunk r-s (its own, then what it
        # just received) to r+1 and receives chunk r-s-1 from r-1, straight into place.
        n, r = self.world_size, self.rank
        return [_Step(chunks[(r - step) % n], chunks[(r - step - 1) % n]) for step in range(n - 1)]

    def _run_steps(self, steps: list, op, name: str):
        """Run ring steps: at each, send step.send to the right neighbour while receiving the
        left one's into step.recv, then, in a reduction, step.out = step.add (op) step.recv.

        Each chunk travels in segments of segment_bytes, and segment j of step s+1 leaves as
        soon as segment j of step s is in place: while one segment is being reduced, the next
        ones are on the wire (NCCL's pipelined ring does this with its slices). Every rank
        posts in one order, (step 0, segment 0), (0, 1), ..., (1, 0), ..., each segment's send
        and receive in one batch_isend_irecv: under NCCL two ranks' p2p calls run in the order
        posted, and a ring whose sends went out alone would wait for receives not yet posted.
        NCCL coalesces the batch and returns one work for both (gloo one each): every work
        the batch returns is waited on.
        """
        n = self.world_size
        if not steps:                                      # a world of one: nothing to send
            return
        right, left = (self.rank + 1) % n, (self.rank - 1) % n
        per_segment = max(1, self.segment_bytes // steps[0].send.element_size())
        split = [[t.split(per_segment) if t is not None else None for t in step] for step in steps]

        def post_segment(s, j):
            send, recv = split[s][0][j], split[s][1][j]
            self.bytes_sent[name] += send.nbytes
            return post([self._p2p(dist.isend, send, right), self._p2p(dist.irecv, recv, left)])
        in_flight = [post_segment(0, j) for j in range(len(split[0][0]))]
        for s, (_, recv, add, out) in enumerate(split):
            # avg: divide once, where a chunk's sum is complete (the reduce-scatter's last step)
            divide = op == "avg" and add is not None and (s + 1 == len(steps) or steps[s + 1].add is None)
            for j, works in enumerate(in_flight):
                wait_all(works)      # the segment arrived, and the one sent may be overwritten
                if add is not None:
                    _combine(out[j], add[j], recv[j], op)
                    if divide:
                        out[j].div_(n)
                if s + 1 < len(steps):
                    in_flight[j] = post_segment(s + 1, j)

    def _p2p(self, fn, tensor, group_peer):
        return dist.P2POp(fn, tensor, group=self._p2p_group, group_peer=group_peer)

    def _run_ring(self, fn, async_op, *args):
        wait = launcher().submit(fn, [a for a in args if isinstance(a, torch.Tensor)], *args)
        if async_op:
            return Handle(wait)
        wait()

    def _count(self, name, numel, element_size, root=0):
        # The native library does not report what it sent: count what the ring sends.
        self.bytes_sent[name] += ring_bytes(name, numel, element_size, self.world_size,
                                            self.rank, root)


def all_to_all_bytes(input: torch.Tensor, input_splits, rank: int, world_size: int) -> int:
    """Bytes a rank sends in an all-to-all: every block of its input but its own."""
    blocks = _row_blocks(input, input_splits, world_size)
    return sum(block.nbytes for i, block in enumerate(blocks) if i != rank)


def _row_blocks(tensor: torch.Tensor, splits, n: int) -> list[torch.Tensor]:
    """tensor cut along dim 0 into n blocks of splits[i] rows (None: n equal blocks); views."""
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"all_to_all: {tensor.shape[0]} rows do not split into {n} equal "
                             f"blocks: pass the splits")
        splits = [tensor.shape[0] // n] * n
    if len(splits) != n or sum(splits) != tensor.shape[0]:
        raise ValueError(f"all_to_all: splits {list(splits)} must be {n} row counts adding up to "
                         f"the tensor's {tensor.shape[0]} rows")
    return list(tensor.split(list(splits)))


def as_comm(group) -> Comm:
    """Strategies accept a Comm, a process group or None (the world, native collectives)."""
    return group if isinstance(group, Comm) else Comm(group)


class _Step(NamedTuple):
    """One ring step of one rank, (c,) views: send goes right, recv comes from the left;
    a reduction's step also sets out = add (op) recv."""
    send: torch.Tensor
    recv: torch.Tensor
    add: torch.Tensor | None = None
    out: torch.Tensor | None = None


def _combine(out, a, b, op):
    if op == "max":
        torch.maximum(a, b, out=out)
    else:                                                  # sum, and avg (divided at the end)
        torch.add(a, b, out=out)
