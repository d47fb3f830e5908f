"""Launch: what runs under foundations/comm.py's ring, so that every rank launches in one order.

NCCL requires every rank to launch on its communicators in one order. The ring's messages get a
private communicator and leave from one thread per process, in the order they were submitted; on
CUDA that thread has its own stream, ordered against the caller's by events, never by a host
synchronize. Also here, the ring's low-level helpers: its scratch, kept call after call, and
padded copies; its messages (each send posted together with its receive) and the patterns Comm
builds from messages besides the ring (scatter, gather, all-to-all, a pipeline's exchange); the
Handle an asynchronous collective returns; and booleans copied to the device without a host
sync. Left out: CUDA graphs, more than one launching thread.
Test: python -m pytest tests/test_collectives.py

Shapes: N ranks in the group, L elements in the tensor, c = ceil(L / N) elements per chunk.
"""
import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist


class Handle:
    """What an asynchronous collective returns: wait() blocks until the result is in place."""

    def __init__(self, wait):
        self._wait = wait

    def wait(self):
        self._wait()


class Launcher:
    """The one thread of this process that launches ring messages: every ring Comm's collectives
    (each run to its end before the next starts) and, with ring collectives, every exchange().

    NCCL requires every rank to launch on its communicators in one order: two ranks that launch
    on communicators A and B in opposite orders can each wait in one for the other. One thread
    per Comm would race its messages against other Comms' threads and the caller's own launches
    differently on each rank. Here they leave in the order they were submitted, and they are
    submitted by the main thread, or by autograd's while the main thread waits in backward()
    (the hooks of DDP, ZeRO-2, FSDP, context parallelism's backward): one sequence, the same
    program order on every rank. A native call made apart (a set-up's, a metric's) comes when
    nothing submitted here is still unfinished: after a blocking collective or a step's waits.
    """

    def __init__(self):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ring")
        self._streams = {}                         # CUDA: the thread's own stream, per device

    def submit(self, fn, tensors: list, *args):
        """Run fn(*args) on the thread, after everything submitted before, autograd off; return
        wait(), which blocks until it is done and returns fn's result. tensors: those fn reads
        and writes (CUDA: the thread's stream starts after the caller's work on them, and
        wait() makes the caller's stream wait for the thread's, with no host synchronize, and
        only then lets them go).

        CUDA: the tensors are held here until wait(), not marked with record_stream on the
        thread's stream: a block so marked returns to the caching allocator only once everything
        queued on that stream by then has run, so a freed bucket or FSDP unit would stay
        reserved behind later messages (the GPU reserving more than napkin/memory.py predicts). Held
        until the caller's stream waits for the thread's, a freed block is reused on the caller's
        stream, after that wait."""
        if not tensors or not tensors[0].is_cuda:
            return self._thread.submit(_no_grad, fn, *args).result
        ready, device = torch.cuda.Event(), tensors[0].device
        ready.record()

        def run():
            torch.cuda.set_device(device)                  # a new thread starts on GPU 0
            if device not in self._streams:                # one stream, made once
                self._streams[device] = torch.cuda.Stream(device)
            stream = self._streams[device]
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                result = _no_grad(fn, *args)
                done = torch.cuda.Event()
                done.record(stream)
            return result, done
        future, held = self._thread.submit(run), list(tensors)

        def wait():
            result, done = future.result()
            torch.cuda.current_stream().wait_event(done)
            held.clear()                                   # reusable now, after the wait
            return result
        return wait


@functools.cache
def launcher() -> Launcher:
    """This process's launcher, made at its first use (a thread does not survive a fork)."""
    return Launcher()


def _no_grad(fn, *args):
    """fn(*args) with autograd off in this thread (grad mode is per thread: the ring's worker
    does not inherit a caller's no_grad, and a collective's in-place writes are no graph)."""
    with torch.no_grad():
        return fn(*args)


class Workspaces(dict):
    """The ring's scratch, {(dtype, device): one buffer}, kept and reused call after call, grown
    when a call needs more: no allocation per call or step. Sharing it is safe because one
    thread (on CUDA, its one stream), the launcher's, runs the ring collectives one after another."""

    def take(self, like: torch.Tensor, *sizes: int) -> list:
        """Buffers of these sizes (like's dtype and device), carved from the one buffer."""
        key = (like.dtype, like.device)
        if key not in self or self[key].numel() < sum(sizes):
            self[key] = torch.empty(sum(sizes), dtype=like.dtype, device=like.device)
        return list(self[key][: sum(sizes)].split(sizes))

    def in_place(self, tensor: torch.Tensor, n: int):
        """(the tensor as N chunks (N, c); a (c,) receive buffer). The tensor itself when it is
        contiguous and splits into N equal chunks, else a zero-padded copy of it (copy_back)."""
        c = -(-tensor.numel() // n)
        if tensor.is_contiguous() and tensor.numel() == n * c:
            return tensor.view(n, c), self.take(tensor, c)[0]
        flat, recv = self.take(tensor, n * c, c)
        flat[tensor.numel():].zero_()
        flat[: tensor.numel()].copy_(tensor.reshape(-1))
        return flat.view(n, c), recv

    @staticmethod
    def copy_back(tensor: torch.Tensor, chunks: torch.Tensor):
        """The result into the caller's tensor, when in_place gave a padded copy of it."""
        if chunks.data_ptr() != tensor.data_ptr():
            tensor.copy_(chunks.view(-1)[: tensor.numel()].view_as(tensor))


class Messages:
    """Point-to-point messages on one process group, posted in batches: what the ring's steps
    and Comm.exchange send. A failure of the transport (a peer that died, or stalled past the
    group's timeout) is raised as torch's DistNetworkError (transport_errors)."""

    def __init__(self, group):
        self.group = group

    @classmethod
    def private_twin(cls, group, timeout) -> "Messages":
        """Messages on a private twin of the world's `group`: what a ring Comm sends on.

        Ring messages get a private communicator, so they never interleave with native
        collectives on the same group; they are launched by the process's one launcher
        thread (launcher), in the order they were issued (the order the peers expect).
        Creating a group is collective over the whole world (new_group's rule; NCCL
        with a bound device splits it from the world's communicator, every rank
        joining), so only the world's Comm makes its own here; subgroups() makes the rest.
        timeout: a datetime.timedelta, or None for torch's default.
        """
        if dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("Comm(group, ring=True) over part of the world: build it with "
                             "process_groups.subgroups (or make_mesh), which create every "
                             "rank's groups on every rank")
        return cls(dist.new_group(dist.get_process_group_ranks(group), timeout=timeout))

    def post(self, ops: list) -> list:
        """ops: ("send" | "recv", tensor, peer), peer a rank of the group, posted together in
        one dist.batch_isend_irecv; returns its works (NCCL: one for the batch; gloo: one each)."""
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, group=self.group,
                          group_peer=peer) for kind, tensor, peer in ops]
        with transport_errors():
            return dist.batch_isend_irecv(p2p)

    @staticmethod
    def wait(works: list):
        """Wait for every work post returned."""
        with transport_errors():
            for work in works:
                work.wait()

    def send_recv(self, ops: list):
        """Post ops together and wait for all of them."""
        if ops:                                            # a world of one has nothing to post
            self.wait(self.post(ops))

    # The patterns besides the ring that Comm builds from messages; each returns the bytes sent.

    def scatter(self, chunks: torch.Tensor, src: int) -> int:
        """chunks (N, c): rank src sends chunk i to rank i, which receives it into its chunks[i]."""
        n, r = len(chunks), dist.get_rank(self.group)
        if r == src:
            self.send_recv([("send", chunks[i], i) for i in range(n) if i != src])
            return chunks[0].nbytes * (n - 1)
        self.send_recv([("recv", chunks[r], src)])
        return 0

    def gather(self, chunks: torch.Tensor, dst: int) -> int:
        """chunks (N, c): rank i sends its chunks[i] to rank dst, which receives it in place."""
        n, r = len(chunks), dist.get_rank(self.group)
        if r == dst:
            self.send_recv([("recv", chunks[i], i) for i in range(n) if i != dst])
            return 0
        self.send_recv([("send", chunks[r], dst)])
        return chunks[r].nbytes

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits, input_splits):
        """Comm.all_to_all from messages: input's i-th block of rows to rank i, rank i's block for
        this rank into output's i-th (splits: rows per rank, None for N equal blocks).

        Not a ring: every pair of ranks exchanges once. At step s rank r sends its block for r+s
        and receives r-s's block for it, posted together as a ring step's pair. N-1 steps, each
        rank sending what is not its own: (N-1)/N of the input for equal blocks, as the native
        call."""
        n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        sends = self.row_blocks(input, input_splits, n)
        receives = self.row_blocks(output, output_splits, n)
        receives[r].copy_(sends[r])
        for step in range(1, n):
            to, source = (r + step) % n, (r - step) % n
            ops = [("send", sends[to], to)] if sends[to].numel() else []
            if receives[source].numel():                 # an empty block is never sent
                ops.append(("recv", receives[source], source))
            self.send_recv(ops)

    @staticmethod
    def row_blocks(tensor: torch.Tensor, splits, n: int) -> list[torch.Tensor]:
        """An all-to-all's tensor cut along dim 0 into n blocks of splits[i] rows (None: n equal
        blocks); views. Bad splits are one clear error, raised before anything is sent."""
        if splits is None:
            if tensor.shape[0] % n:
                raise ValueError(f"all_to_all: {tensor.shape[0]} rows do not split into {n} equal "
                                 f"blocks: pass the splits")
            splits = [tensor.shape[0] // n] * n
        if len(splits) != n or sum(splits) != tensor.shape[0]:
            raise ValueError(f"all_to_all: splits {list(splits)} must be {n} row counts adding up "
                             f"to the tensor's {tensor.shape[0]} rows")
        return list(tensor.split(list(splits)))

    def exchange(self, ops: list, after_the_ring: bool) -> Handle:
        """Comm.exchange's messages, posted together. after_the_ring: post them from the
        launcher thread, after every ring message submitted before (Launcher says why)."""
        ops = list(ops)
        if not ops:
            return Handle(lambda: None)
        if after_the_ring:
            posted = launcher().submit(self.post, [tensor for _, tensor, _ in ops], ops)
            return Handle(lambda: self.wait(posted()))
        works = self.post(ops)
        return Handle(lambda: self.wait(works))

    @staticmethod
    def launch(fn, tensors: list, *args) -> Handle:
        """fn(*args), which posts messages, run on the process's one launcher thread after
        everything submitted before; tensors: those it reads and writes (Launcher.submit)."""
        return Handle(launcher().submit(fn, tensors, *args))


@contextlib.contextmanager
def transport_errors():
    """A failure of the messages' transport (a peer that died, or stalled past the group's
    timeout) raised as torch's DistNetworkError, which train.py says as a lost peer in one line
    (run_log.stopped), as it says a native collective's. gloo names its own source file in most
    of its errors, not in the one every other message of a group gets once one timed out:
    "Application timeout caused pair closure", which a wait on a later message can meet first."""
    try:
        yield
    except dist.DistError:
        raise
    except RuntimeError as e:
        raise dist.DistNetworkError(str(e)) from e


def flags_to_device(flags: list[bool], device) -> torch.Tensor:
    """Python booleans as a (len,) uint8 tensor on `device`, for a collective to OR them.

    torch.tensor(flags, device=cuda) would copy from pageable memory, a host sync: the flags go
    through pinned (page-locked) memory instead, queued on the stream while the host runs on."""
    flags = torch.tensor(flags, dtype=torch.uint8)                       # (len,)
    if torch.device(device).type == "cuda":
        flags = flags.pin_memory()
    return flags.to(device, non_blocking=True)
