"""Ring collectives equal the native ones, and send the bytes the ring formula says."""
import math

import pytest
import torch

from foundations.comm import Comm, ring_bytes
from multiprocess import run_ranks

DTYPES = [torch.float32, torch.bfloat16]
LENGTHS = [1, 7, 12, 1001]           # odd, smaller than N, divisible by 2, 3 and 4, large and odd
# The ring's pipelining grain, tiny here: chunks of 1 to 501 elements travel as one segment,
# several, and several with a short last one (3 fp32 or 6 bf16 elements a segment).
SEGMENT = 12


def _inputs(rank, length, dtype, integers):
    """Each rank's own data: small integers sum exactly in any order (an exact test of the
    algorithm); random floats check rounding stays at the dtype's noise level."""
    g = torch.Generator().manual_seed(1000 + rank)
    if integers:
        return torch.randint(-8, 9, (length,), generator=g).to(dtype)
    return torch.randn(length, generator=g).to(dtype)


def _all_collectives(dtype_name, integers):
    import torch.distributed as dist
    dtype = getattr(torch, dtype_name)
    native, ring = Comm(), Comm(ring=True, segment_bytes=SEGMENT)
    n, r = native.world_size, native.rank
    out = {}
    for length in LENGTHS:
        x = _inputs(r, length, dtype, integers)
        for op in ("sum", "avg", "max"):
            a, b = x.clone(), x.clone()
            native.all_reduce(a, op)
            ring.all_reduce(b, op)
            out[f"all_reduce {op} L={length}"] = (b, a)
        full = _inputs(r, length * n, dtype, integers)          # (N*L,) -> shard (L,)
        a, b = torch.empty(length, dtype=dtype), torch.empty(length, dtype=dtype)
        native.reduce_scatter(a, full)
        ring.reduce_scatter(b, full)
        out[f"reduce_scatter L={length}"] = (b, a)
        a, b = torch.empty(length * n, dtype=dtype), torch.empty(length * n, dtype=dtype)
        native.all_gather(a, x)
        ring.all_gather(b, x)
        out[f"all_gather L={length}"] = (b, a)
        for root in {0, n - 1}:
            a, b = x.clone(), x.clone()
            native.broadcast(a, src=root)
            ring.broadcast(b, src=root)
            out[f"broadcast root={root} L={length}"] = (b, a)
            a, b = x.clone(), x.clone()
            native.reduce(a, dst=root)
            ring.reduce(b, dst=root)
            if r == root:
                out[f"reduce root={root} L={length}"] = (b, a)
    # async: issue several, compute meanwhile, then wait; results equal the blocking ones
    xs = [_inputs(r, 1001, dtype, integers) for _ in range(3)]
    handles = [ring.all_reduce(x, async_op=True) for x in xs]
    busy = torch.randn(64, 64) @ torch.randn(64, 64)          # work overlapping the messages
    for h in handles:
        h.wait()
    ref = _inputs(r, 1001, dtype, integers)
    native.all_reduce(ref)
    out["async all_reduce"] = (xs[0], ref)
    dist.barrier()
    return out


def _every_dtype():
    """_all_collectives in each dtype, on integers and on random floats, in one launch:
    {(dtype's name, integers): its results}."""
    names = [str(dtype).split(".")[1] for dtype in DTYPES]
    return {(name, integers): _all_collectives(name, integers)
            for name in names for integers in (True, False)}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_equals_native(world_size):
    ranks = run_ranks(_every_dtype, world_size)
    for dtype in DTYPES:
        name = str(dtype).split(".")[1]
        for integers in (True, False):
            for rank, results in enumerate(each[name, integers] for each in ranks):
                for what, (ring, native) in results.items():
                    # integers: exact (no rounding anywhere); random fp32: a sum over N <= 4 terms
                    # reordered, a few ulps; bf16: the ring rounds each partial sum to bf16.
                    tol = 0 if integers else (1e-6 if dtype == torch.float32 else 2e-2)
                    torch.testing.assert_close(
                        ring, native, rtol=tol, atol=tol,
                        msg=lambda m: f"N={world_size} rank {rank} {dtype} {what}: {m}")


def _shard_collectives(integers):
    """Every op of reduce-scatter, and all-gather (async), native and ring: this rank's results,
    which the test checks against a reference built from every rank's inputs."""
    native, ring = Comm(), Comm(ring=True, segment_bytes=SEGMENT)
    n, r = native.world_size, native.rank
    out = {}
    for length in LENGTHS:
        full = _inputs(r, length * n, torch.float32, integers)          # (N*L,) -> shard (L,)
        for name, comm in (("native", native), ("ring", ring)):
            for op in ("sum", "avg", "max"):
                shard = torch.empty(length)
                comm.reduce_scatter(shard, full, op=op)
                out[f"{name} reduce_scatter {op} L={length}"] = shard
            gathered = torch.empty(length * n)
            comm.all_gather(gathered, full[:length], async_op=True).wait()
            out[f"{name} all_gather L={length}"] = gathered
    return out


def test_reduce_scatter_every_op_and_all_gather_equal_the_reference():
    """N = 3 (an odd ring: an index off by one that 2 ranks hide shows): rank r's shard of a
    reduce-scatter is op over the ranks' r-th chunks, computed here from every rank's input,
    for sum, avg and max; all-gather is the ranks' inputs end to end; ring and native."""
    n = 3
    for integers in (True, False):
        for rank, out in enumerate(run_ranks(_shard_collectives, n, integers)):
            for length in LENGTHS:
                chunks = torch.stack([_inputs(i, length * n, torch.float32, integers).view(n, length)[rank]
                                      for i in range(n)])                 # (N, L): chunk r of each rank
                total = chunks.sum(0)
                expected = {"sum": total, "avg": total / n, "max": chunks.max(0).values}
                whole = torch.cat([_inputs(i, length * n, torch.float32, integers)[:length]
                                   for i in range(n)])                    # (N*L,)
                for name in ("native", "ring"):
                    # integers: exact in any order; random fp32: three terms summed in another order
                    tol = 0 if integers else 1e-6
                    for op, value in expected.items():
                        torch.testing.assert_close(out[f"{name} reduce_scatter {op} L={length}"], value,
                                                   rtol=tol, atol=tol,
                                                   msg=lambda m: f"rank {rank} {name} {op} L={length}: {m}")
                    assert torch.equal(out[f"{name} all_gather L={length}"], whole), (rank, name, length)


def _bytes_per_collective(length):
    ring = Comm(ring=True, segment_bytes=1000)               # 4 KiB chunks in 5 segments
    n = ring.world_size
    x = torch.ones(length)
    sent = {}
    for name, call in [("all_reduce", lambda: ring.all_reduce(x)),
                       ("reduce_scatter", lambda: ring.reduce_scatter(torch.empty(length // n), x)),
                       ("all_gather", lambda: ring.all_gather(torch.empty(length * n), x[: length])),
                       ("broadcast", lambda: ring.broadcast(x, src=0)),
                       ("reduce", lambda: ring.reduce(x, dst=0))]:
        ring.bytes_sent.clear()
        call()
        sent[name] = ring.bytes_sent[name]
    return sent


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_bytes_match_formula(world_size):
    length = 12 * 1024                                      # divides by 2, 3 and 4: no padding
    nbytes = length * 4
    for rank, sent in enumerate(run_ranks(_bytes_per_collective, world_size, length)):
        n = world_size
        # The lecture's claim, exactly: ring all-reduce sends 2(N-1)/N of the tensor per rank,
        # which is what a reduce-scatter plus an all-gather send together.
        assert sent["all_reduce"] == 2 * (n - 1) * nbytes // n
        assert sent["reduce_scatter"] == (n - 1) * nbytes // n
        assert sent["all_gather"] == (n - 1) * nbytes          # output is N x the input
        assert sent["all_reduce"] == sent["reduce_scatter"] + sent["all_gather"] // n
        assert sent["broadcast"] == (n - 1) * nbytes // n * (2 if rank == 0 else 1)
        assert sent["reduce"] == (n - 1) * nbytes // n + (0 if rank == 0 else nbytes // n)
        for name, measured in sent.items():
            numel = length * n if name == "all_gather" else length
            assert measured == ring_bytes(name, numel, 4, n, rank, root=0), name


def _batches_posted(segment_bytes, chunk):
    """batch_isend_irecv calls per ring collective and dtype, on chunks of `chunk` elements."""
    import torch.distributed as dist
    ring, posted, original = Comm(ring=True, segment_bytes=segment_bytes), [0], dist.batch_isend_irecv

    def counting(ops):
        posted[0] += 1
        return original(ops)
    n, counts = ring.world_size, {}
    dist.batch_isend_irecv = counting
    try:
        for dtype in (torch.float32, torch.bfloat16):
            full = torch.ones(n * chunk, dtype=dtype)
            for name, call in [("all_reduce", lambda: ring.all_reduce(full)),
                               ("reduce_scatter", lambda: ring.reduce_scatter(torch.empty_like(full[:chunk]), full)),
                               ("all_gather", lambda: ring.all_gather(full, full[:chunk].clone()))]:
                posted[0] = 0
                call()
                counts[name, dtype] = posted[0]
    finally:
        dist.batch_isend_irecv = original
    return counts


def test_ring_sends_each_chunk_in_segments_of_segment_bytes():
    """Each ring step's chunk of 1001 elements goes in ceil(chunk bytes / segment_bytes) messages,
    one batch_isend_irecv each (a send and a receive): fp32 4004 bytes in 5 segments of 1000 bytes,
    bf16 2002 bytes in 3; N = 3: reduce-scatter and all-gather N-1 = 2 steps, all-reduce 4."""
    for rank, counts in enumerate(run_ranks(_batches_posted, 3, 1000, 1001)):
        for dtype, segments in ((torch.float32, math.ceil(4004 / 1000)), (torch.bfloat16, math.ceil(2002 / 1000))):
            assert counts["reduce_scatter", dtype] == counts["all_gather", dtype] == 2 * segments, (rank, counts)
            assert counts["all_reduce", dtype] == 4 * segments, (rank, counts)


def _workspace_after_calls():
    """The ring's scratch buffers after a first and after further calls of every collective:
    reused, never allocated per call (a fresh large buffer page-faults on every call)."""
    ring, n = Comm(ring=True, segment_bytes=SEGMENT), dist_world_size()
    x, shard, full = torch.randn(1200), torch.empty(1200 // n), torch.randn(1200)
    calls = [lambda: ring.all_reduce(x), lambda: ring.reduce_scatter(shard, full),
             lambda: ring.all_gather(full, shard), lambda: ring.broadcast(x), lambda: ring.reduce(x),
             lambda: ring.all_reduce(x[:1001])]                  # padded: the copy is scratch too
    for call in calls:
        call()
    first = {key: (t.data_ptr(), t.numel()) for key, t in ring._workspaces.items()}
    for _ in range(3):
        for call in calls:
            call()
    return first, {key: (t.data_ptr(), t.numel()) for key, t in ring._workspaces.items()}


def dist_world_size():
    import torch.distributed as dist
    return dist.get_world_size()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_reuses_one_workspace(world_size):
    for first, later in run_ranks(_workspace_after_calls, world_size):
        assert list(first) == [(torch.float32, torch.device("cpu"))] and later == first
        # the largest need: all-reduce of 1001 padded to N x c plus a (c,) receive buffer, or
        # reduce-scatter's receive buffer and (N >= 4) two partial sums of 1200 / N each
        c = -(-1001 // world_size)
        assert first[(torch.float32, torch.device("cpu"))][1] == max(
            world_size * c + c, (1 + min(2, world_size - 2)) * 1200 // world_size)


def _mismatched_shards():
    comm = Comm()
    try:
        comm.reduce_scatter(torch.empty(3), torch.empty(7))
    except ValueError as error:
        return str(error)


def test_wrong_shard_size_is_a_clear_error():
    for message in run_ranks(_mismatched_shards, 2):
        assert "pad the full tensor to a multiple of N" in message


def _plain_ring_of_odd_length():
    from collectives import ring_all_reduce
    try:
        ring_all_reduce(torch.ones(7))
    except ValueError as error:
        return str(error)


def test_plain_ring_of_a_length_n_does_not_divide_is_a_clear_error():
    """7 elements on 2 ranks: one line naming the fix on every rank, before any message."""
    for message in run_ranks(_plain_ring_of_odd_length, 2):
        assert message and "pad the tensor to a multiple of N" in message, message



# ---- all-to-all (moe.py's dispatch and combine) ------------------------------------------------

def _rows_for(source, dest):
    """Rows rank `source` sends rank `dest`: uneven, and zero for some pairs."""
    return (source + 2 * dest) % 3


def _a2a_input(rank, n, features=3):
    """Rank's input (sum of its row counts, features), small integers: every value says where
    it came from, and the test is exact."""
    rows = sum(_rows_for(rank, dest) for dest in range(n))
    return (rank * 1000 + torch.arange(rows * features, dtype=torch.float32)).view(rows, features)


def _all_to_alls():
    from foundations.comm import all_to_all_bytes
    native, ring = Comm(), Comm(ring=True)
    n, r = native.world_size, native.rank
    x = _a2a_input(r, n)
    input_splits = [_rows_for(r, dest) for dest in range(n)]
    output_splits = [_rows_for(source, r) for source in range(n)]
    expected = torch.cat([_a2a_input(source, n).split([_rows_for(source, d) for d in range(n)])[r]
                          for source in range(n)])
    out = {"expected": expected, "formula": all_to_all_bytes(x, input_splits, r, n)}
    for name, comm in (("native", native), ("ring", ring)):
        result = torch.full((sum(output_splits), 3), -1.0)
        comm.bytes_sent.clear()
        comm.all_to_all(result, x, output_splits, input_splits)
        out[name], out[f"{name} bytes"] = result, comm.bytes_sent["all_to_all"]
    equal = torch.arange(4.0 * n).view(2 * n, 2) + 100 * r     # equal blocks, no splits given
    out["equal native"], out["equal ring"] = torch.empty_like(equal), torch.empty_like(equal)
    native.all_to_all(out["equal native"], equal)
    ring.all_to_all(out["equal ring"], equal, async_op=True).wait()
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_to_all_ring_equals_native_and_bytes_equal_formula(world_size):
    """Our all-to-all from send/recv equals torch's all_to_all_single (exactly: nothing is added)
    with uneven and empty blocks, and every rank sends what is not its own block."""
    for rank, out in enumerate(run_ranks(_all_to_alls, world_size)):
        what = f"N={world_size} rank {rank}"
        assert torch.equal(out["native"], out["expected"]), what
        assert torch.equal(out["ring"], out["expected"]), what
        assert torch.equal(out["equal ring"], out["equal native"]), what
        sent_rows = sum(_rows_for(rank, dest) for dest in range(world_size) if dest != rank)
        assert out["formula"] == sent_rows * 3 * 4, what
        assert out["ring bytes"] == out["native bytes"] == out["formula"], what


# ---- NCCL's rules on the CPU (multiprocess.nccl_rules) -----------------------------------------

@pytest.mark.parametrize("world_size", [3])
def test_ring_runs_under_nccl_rules(world_size):
    """Under NCCL a batch of p2p messages is coalesced into one work: the ring waits on whatever
    works a batch returns (it unpacked two, a send's and a receive's, and died at its first
    collective). Every collective, async included, equals the native one exactly (integers)."""
    for rank, results in enumerate(run_ranks(_all_collectives, world_size, "float32", True, nccl=True)):
        for what, (ring, native) in results.items():
            assert torch.equal(ring, native), f"N={world_size} rank {rank} {what}"
    for rank, out in enumerate(run_ranks(_all_to_alls, world_size, nccl=True)):
        assert torch.equal(out["ring"], out["expected"]) and torch.equal(out["equal ring"], out["equal native"])


# ---- the lecture's ring, plainly (collectives.ring_*) -------------------------------------------

def _plain_ring():
    """This rank's results of the plain ring's reduce-scatter, all-gather and all-reduce on small
    integers (exact in any order), and the steps it logged."""
    from collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
    import torch.distributed as dist
    n, r, steps = dist.get_world_size(), dist.get_rank(), []
    reduced = _inputs(r, 4 * n, torch.float64, True).view(n, 4)               # (N, c)
    ring_reduce_scatter(reduced, log=steps.append)
    gathered = torch.zeros(n, 4, dtype=torch.float64)                         # (N, c)
    gathered[r] = _inputs(r, 4, torch.float64, True)
    ring_all_gather(gathered, log=steps.append)
    summed = _inputs(r, 4 * n, torch.float64, True)
    ring_all_reduce(summed)
    return reduced[r], gathered, summed, steps


def test_plain_ring_equals_the_sums_computed_here():
    """The lecture's ring as written plainly, N = 3 (odd: an index off by one shows), against
    every rank's input summed here: rank r's chunk r after reduce-scatter is the sum of the ranks'
    chunks r, all-gather leaves rank i's chunk in row i on every rank, all-reduce is the sum on
    every rank; exact (small integers). N-1 logged steps each; also under NCCL's rules."""
    n = 3
    total = sum(_inputs(i, 4 * n, torch.float64, True) for i in range(n))          # (N*c,)
    rows = torch.stack([_inputs(i, 4, torch.float64, True) for i in range(n)])     # (N, c)
    for nccl in (False, True):
        for rank, (shard, gathered, summed, steps) in enumerate(run_ranks(_plain_ring, n, nccl=nccl)):
            assert torch.equal(shard, total.view(n, 4)[rank]), (nccl, rank, shard)
            assert torch.equal(gathered, rows), (nccl, rank, gathered)
            assert torch.equal(summed, total), (nccl, rank, summed)
            assert len(steps) == 2 * (n - 1) and f"rank {rank} sends chunk" in steps[0], steps
