"""Collectives: how ranks combine tensors, built from point-to-point messages.

Every strategy in this project is a choice of which rank holds which bytes and which
collective moves them. Here the collectives are built from send/recv on a ring, the
bandwidth-optimal schedule (Patarasuk & Yuan, 2009) that NCCL uses for large messages,
and all-reduce is written as the lecture's identity: reduce-scatter, then all-gather.
The same methods run on torch.distributed's native calls (the default, and the fast
path); one switch picks ring or native, and a byte counter records what each rank sends.
Left out: tree and hierarchical algorithms, latency tuning for small messages. Joining the
job, its groups and meshes: process_groups.py.
Test: python -m pytest tests/test_collectives.py

Shapes: N ranks in the group, r this rank, L elements in the tensor, c = ceil(L / N)
elements per chunk; rank r's neighbours on the ring are r - 1 (left) and r + 1 (right).
"""
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


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
    from point-to-point messages instead of calling torch.distributed's. bytes_sent: a
    Counter {collective name: bytes this rank sent}, shared with comms made by subgroups().
    Every method works in place on the given tensors and takes async_op: when True it
    returns a Handle at once, so the caller can compute while the bytes move.
    Constructing a Comm over the world with ring=True is collective: every rank does it;
    over a subgroup, process_groups.subgroups() builds it (with p2p_group, its private twin).
    """

    def __init__(self, group=None, ring: bool = False, bytes_sent: Counter | None = None,
                 p2p_group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.ring = ring
        self.bytes_sent = bytes_sent if bytes_sent is not None else Counter()
        if ring:
            # Ring messages get a private communicator, so they never interleave with native
            # collectives on the same group, and one worker thread, so every rank runs its
            # ring collectives in the order they were issued (the order the peers expect).
            # Creating a group is collective over the whole world (new_group's rule; NCCL
            # with a bound device splits it from the world's communicator, every rank
            # joining), so only the world's Comm makes its own here; subgroups() makes the rest.
            if p2p_group is None:
                if self.world_size != dist.get_world_size():
                    raise ValueError("Comm(group, ring=True) over part of the world: build it with "
                                     "process_groups.subgroups (or make_mesh), which create every "
                                     "rank's groups on every rank")
                p2p_group = dist.new_group(dist.get_process_group_ranks(self.group))
            self._p2p_group = p2p_group
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ring")
            self._ring_streams = {}               # CUDA: the worker's stream, per device

    # ---- the public collectives -------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        """Every rank ends with op(tensor of rank 0, ..., tensor of rank N-1)."""
        if self.ring:
            return self._run_ring(self._ring_all_reduce, async_op, tensor, op)
        self._count("all_reduce", tensor.numel(), tensor.element_size())
        work = dist.all_reduce(tensor, op=REDUCE_OPS[op], group=self.group, async_op=async_op)
        return Handle(work.wait) if async_op else None

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                       async_op: bool = False):
        """input (N*c,) on every rank -> output (c,) on rank r = op over ranks of input chunk r."""
        _check_shards("reduce_scatter", output, input, self.world_size)
        if self.ring:
            return self._run_ring(self._ring_reduce_scatter, async_op, output, input, op)
        self._count("reduce_scatter", input.numel(), input.element_size())
        work = dist.reduce_scatter_single(output, input, op=REDUCE_OPS[op], group=self.group,
                                          async_op=async_op)
        return Handle(work.wait) if async_op else None

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """input (c,) on rank r -> output (N*c,) on every rank, chunk r = rank r's input."""
        _check_shards("all_gather", input, output, self.world_size)
        if self.ring:
            return self._run_ring(self._ring_all_gather, async_op, output, input)
        self._count("all_gather", output.numel(), output.element_size())
        work = dist.all_gather_single(output, input, group=self.group, async_op=async_op)
        return Handle(work.wait) if async_op else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Every rank ends with rank `src`'s tensor (src is a rank within this group)."""
        if self.ring:
            return self._run_ring(self._ring_broadcast, async_op, tensor, src)
        self._count("broadcast", tensor.numel(), tensor.element_size(), root=src)
        work = dist.broadcast(tensor, group=self.group, group_src=src, async_op=async_op)
        return Handle(work.wait) if async_op else None

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", async_op: bool = False):
        """Rank `dst` ends with op over all ranks' tensors; the others' tensors are unspecified."""
        if self.ring:
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
        if self.ring:
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

        One dist.batch_isend_irecv: under NCCL one group of p2p calls, which run together.
        Separate calls would run one after another on the p2p stream (schedules.py's
        run_under_nccl says why that can deadlock). Messages between two ranks are matched in
        the order they were posted, so shape and dtype of each receive must match its send.
        """
        p2p = []
        for kind, tensor, peer in ops:
            if kind == "send":
                self.bytes_sent["send"] += tensor.nbytes
            p2p.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor,
                                  group=self.group, group_peer=peer))
        works = dist.batch_isend_irecv(p2p) if p2p else []
        return Handle(lambda: [work.wait() for work in works])

    # ---- the ring versions, from send/recv --------------------------------------------

    def _ring_reduce_scatter(self, output, input, op, name="reduce_scatter"):
        #   step 0        step 1        ...  step N-2
        #   rank r sends chunk r-1-s to r+1 and adds chunk r-2-s from r-1 into its own copy;
        #   after N-1 steps chunk r has passed every rank once: it holds the full reduction.
        n, r = self.world_size, self.rank
        chunks = input.detach().clone().view(n, -1)        # (N, c): never touch the caller's input
        incoming = torch.empty_like(chunks[0])             # (c,)
        for step in range(n - 1):
            self._ring_step(chunks[(r - step - 1) % n], incoming, name)
            _combine(chunks[(r - step - 2) % n], incoming, op)
        if op == "avg":
            chunks[r].div_(n)
        output.copy_(chunks[r])

    def _ring_all_gather(self, output, input, name="all_gather"):
        # Rank r starts with chunk r; at step s it forwards chunk r-s (its own, then what it
        # just received) to r+1 and receives chunk r-s-1 from r-1.
        n, r = self.world_size, self.rank
        chunks = output.view(n, -1)                        # (N, c)
        chunks[r].copy_(input)
        for step in range(n - 1):
            self._ring_step(chunks[(r - step) % n], chunks[(r - step - 1) % n], name)

    def _ring_all_reduce(self, tensor, op):
        # The lecture's identity: all-reduce = reduce-scatter + all-gather, 2(N-1)/N x bytes.
        n = self.world_size
        flat = _padded_copy(tensor, n)                     # (N*c,)
        shard = torch.empty_like(flat[: flat.numel() // n])  # (c,)
        self._ring_reduce_scatter(shard, flat, op, name="all_reduce")  # rank r owns reduced chunk r
        self._ring_all_gather(flat, shard, name="all_reduce")          # every rank gets every chunk
        tensor.copy_(flat[: tensor.numel()].view_as(tensor))

    def _ring_broadcast(self, tensor, src):
        # Scatter (the root sends chunk i to rank i), then ring all-gather: the root sends
        # about 2x the tensor, every other rank about 1x, instead of the root sending N-1 copies.
        n, r = self.world_size, self.rank
        flat = _padded_copy(tensor, n)                     # (N*c,)
        chunks = flat.view(n, -1)                          # (N, c)
        if r == src:
            ops = [self._p2p(dist.isend, chunks[i], i) for i in range(n) if i != src]
            self.bytes_sent["broadcast"] += chunks[0].nbytes * (n - 1)
        else:
            ops = [self._p2p(dist.irecv, chunks[r], src)]
        _send_recv(ops)
        self._ring_all_gather(flat, chunks[r].clone(), name="broadcast")
        tensor.copy_(flat[: tensor.numel()].view_as(tensor))

    def _ring_reduce(self, tensor, dst, op):
        # Mirror image of broadcast: ring reduce-scatter, then every rank sends its reduced
        # chunk to the root (a gather).
        n, r = self.world_size, self.rank
        flat = _padded_copy(tensor, n)                     # (N*c,)
        chunks = flat.view(n, -1)                          # (N, c)
        shard = torch.empty_like(chunks[0])
        self._ring_reduce_scatter(shard, flat, op, name="reduce")
        if r == dst:
            chunks[r].copy_(shard)
            ops = [self._p2p(dist.irecv, chunks[i], i) for i in range(n) if i != dst]
        else:
            ops = [self._p2p(dist.isend, shard, dst)]
            self.bytes_sent["reduce"] += shard.nbytes
        _send_recv(ops)
        if r == dst:
            tensor.copy_(flat[: tensor.numel()].view_as(tensor))

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
            _send_recv(ops)
            self.bytes_sent["all_to_all"] += sends[to].nbytes

    # ---- plumbing -----------------------------------------------------------------------

    def _ring_step(self, send: torch.Tensor, recv: torch.Tensor, name: str):
        """One ring step: send to the right neighbour while receiving from the left one."""
        n = self.world_size
        ops = [self._p2p(dist.isend, send, (self.rank + 1) % n),
               self._p2p(dist.irecv, recv, (self.rank - 1) % n)]
        _send_recv(ops)
        self.bytes_sent[name] += send.nbytes

    def _p2p(self, fn, tensor, group_peer):
        return dist.P2POp(fn, tensor, group=self._p2p_group, group_peer=group_peer)

    def _run_ring(self, fn, async_op, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or not tensors[0].is_cuda:
            future = self._worker.submit(_no_grad, fn, *args)
            wait = future.result
        else:
            # No host synchronize (it would end all overlap): the worker's stream waits for the
            # caller's with an event, and waiting on the handle makes the caller's stream wait
            # for the worker's in turn.
            ready, device = torch.cuda.Event(), tensors[0].device
            ready.record()

            def run():
                torch.cuda.set_device(device)              # a new thread starts on GPU 0
                stream = self._ring_streams.setdefault(device, torch.cuda.Stream(device))
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    for t in tensors:                      # freed by the caller: not reused early
                        t.record_stream(stream)
                    _no_grad(fn, *args)
                    done = torch.cuda.Event()
                    done.record(stream)
                return done
            future = self._worker.submit(run)

            def wait():
                torch.cuda.current_stream().wait_event(future.result())
        if async_op:
            return Handle(wait)
        wait()

    def _count(self, name, numel, element_size, root=0):
        # The native library does not report what it sent: count what the ring sends.
        self.bytes_sent[name] += ring_bytes(name, numel, element_size, self.world_size,
                                            self.rank, root)


def split_norm(grads: list, comm: Comm, device) -> torch.Tensor:
    """The 2-norm of one gradient held in disjoint pieces by comm's ranks (ZeRO's and FSDP's
    shards, a pipeline's stages): each rank's squares, summed over the ranks by one 4-byte
    all-reduce (padding is zero), then the root. Every rank gets the same norm. device: the
    group's (NCCL reduces device memory only)."""
    squares = torch.zeros(1, device=device)
    for g in grads:
        squares += g.float().pow(2).sum()
    comm.all_reduce(squares, op="sum")
    return squares.sqrt()[0]


def _no_grad(fn, *args):
    """fn(*args) with autograd off in this thread (grad mode is per thread: the ring's worker
    does not inherit a caller's no_grad, and a collective's in-place writes are no graph)."""
    with torch.no_grad():
        return fn(*args)


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


def _check_shards(name, shard, full, world_size):
    if full.numel() != shard.numel() * world_size or full.dtype != shard.dtype:
        raise ValueError(f"{name}: the full tensor must hold exactly N={world_size} shards of the "
                         f"same dtype, got {full.numel()} {full.dtype} elements for shards of "
                         f"{shard.numel()} {shard.dtype}; pad the full tensor to a multiple of N")


def _padded_copy(tensor, n):
    """Flat copy of `tensor`, zero-padded to a multiple of n: (L,) -> (N*c,)."""
    flat = tensor.detach().reshape(-1)
    padded = flat.new_zeros(-(-flat.numel() // n) * n)
    padded[: flat.numel()] = flat
    return padded


def _combine(acc, incoming, op):
    if op == "max":
        torch.maximum(acc, incoming, out=acc)
    else:                                                  # sum, and avg (divided at the end)
        acc.add_(incoming)


def _send_recv(ops):
    """Post a list of sends and receives together and wait for all of them."""
    if ops:                                                # a world of one has nothing to post
        for work in dist.batch_isend_irecv(ops):
            work.wait()
