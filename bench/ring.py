"""bench/ring.py: our ring collectives (built from send/recv) against the native ones, by size.

All-reduce (every strategy's gradient sync) and all-to-all (moe.py's dispatch and combine).
Message sizes x4 from 1 KB to --max-mb, each timed per call over many calls (more for small
messages, where latency is the cost), ring and native in turn so drift hits both alike; reported
as nccl-tests do: algbw = bytes / time, busbw = what each link carries. Beside them, the bytes a
rank sends per call by our ring's counter and by the formula. Left out: reduce-scatter and
all-gather (all-reduce's two halves), uneven all-to-all splits, dtypes other than fp32.
Run: torchrun --nproc_per_node 2 -m bench --quick --strategies collectives
Test: python -m pytest tests/test_bench.py
"""
import statistics
import time

import torch
import torch.distributed as dist

from bench.measure import MiB, across_ranks, progress, spread, summary, sync
from foundations.comm import Comm, all_to_all_bytes, ring_bytes

# What each link carries per byte of the message (nccl-tests' busbw factor), for N ranks: a ring
# all-reduce sends 2(N-1)/N of it; all-to-all sends each rank's N-1 blocks out of N.
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def bench_collectives(args, device) -> dict:
    """{collective: rows}: ring (ours, from send/recv) against native, sizes x4 from 1 KB to
    --max-mb; an all-to-all's size is each rank's input, N equal blocks of it. All-reduce also
    times the ring's messages alone (transfer_only): the floor under any ring on this backend."""
    comms = {"ring": Comm(ring=True), "native": Comm()}
    p2p = dist.new_group(list(range(dist.get_world_size())),      # every rank creates it,
                         timeout=comms["native"].group_timeout())  # with the run's timeout
    rows = {}
    for name in BUS_FACTOR:
        rows[name] = _by_size(name, comms, p2p, args, device)
        progress(f"{name} timed, ring and native, up to {args.max_mb} MB")
    return rows


def transfer_only(tensor: torch.Tensor, group, segment_bytes: int):
    """A call that sends what a ring all-reduce of `tensor` sends, without its reductions:
    2(N-1) steps, each a (numel/N,) chunk to the right neighbour and one from the left, in the
    ring's segments (each send beside its receive, one batch_isend_irecv, as the ring posts
    them). No ring made of this backend's send/recv can be faster than this."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    send, recv = torch.zeros(2, -(-tensor.numel() // n), device=tensor.device)       # (2, c)
    per_segment = max(1, segment_bytes // send.element_size())

    def call():
        for _ in range(2 * (n - 1)):
            works = [dist.batch_isend_irecv([
                dist.P2POp(dist.isend, segment, group=group, group_peer=(r + 1) % n),
                dist.P2POp(dist.irecv, into, group=group, group_peer=(r - 1) % n)])
                for segment, into in zip(send.split(per_segment), recv.split(per_segment))]
            for work in (w for pair in works for w in pair):
                work.wait()
    return call


def _by_size(name, comms, p2p, args, device) -> list:
    n, rank, rows, nbytes = dist.get_world_size(), dist.get_rank(), [], 2**10
    while nbytes <= args.max_mb * MiB:
        # fp32 zeros stay finite under sum; all-to-all's input: N equal blocks of rows
        tensor = torch.zeros(nbytes // 4 // n * n, device=device)
        if name == "all_reduce":
            formula = ring_bytes("all_reduce", tensor.numel(), 4, n)
            calls = {side: (lambda comm=comm: comm.all_reduce(tensor)) for side, comm in comms.items()}
            calls["transfer_only"] = transfer_only(tensor, p2p, comms["ring"].segment_bytes)
        else:
            formula, output = all_to_all_bytes(tensor, None, rank, n), torch.empty_like(tensor)
            calls = {side: (lambda comm=comm: comm.all_to_all(output, tensor)) for side, comm in comms.items()}
        iters = max(5, min(100, 2**26 // nbytes))              # small messages: more calls
        for call in calls.values():                            # warm-up: connections, buffers
            call()
            call()
        times = {side: [] for side in calls}
        comms["ring"].bytes_sent.clear()
        for _ in range(args.repeats):
            for side, call in calls.items():
                sync(device)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    call()
                sync(device)
                times[side].append(across_ranks(time.perf_counter() - start, device) / iters)
        row = {"bytes": tensor.nbytes, "formula_bytes": formula,
               "ring_sent_bytes": comms["ring"].bytes_sent[name] / (args.repeats * iters)}
        for side, seconds in times.items():
            algbw = tensor.nbytes / statistics.median(seconds)     # nccl-tests: size / time
            row[side] = {"us": summary([1e6 * s for s in seconds]), "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * BUS_FACTOR[name](n) / 1e9}
        # each side timed back to back with native in each repetition: the median of those
        # pairs' ratios, which drift on a shared machine moves less than a ratio of two medians
        ratio = lambda side: statistics.median(t / native for t, native in zip(times[side], times["native"]))
        row["ratio"] = ratio("ring")
        if "transfer_only" in times:
            row["transfer_ratio"] = ratio("transfer_only")
        rows.append(row)
        nbytes *= 4
    return rows


def collectives_report(m: dict, tables: dict) -> list:
    """The all-reduce and all-to-all tables' lines, or why they are missing; none when not asked for."""
    lines = []
    for name, rows in tables.items():
        title = name.replace("_", "-")
        floor = all("transfer_ratio" in r for r in rows)         # (older JSON files lack it)
        lines += ["", f"| {title} size | ring us | native us | ring/native | "
                  + ("ring's messages alone / native | " if floor else "")
                  + "ring busbw GB/s | native busbw GB/s | sent per rank, B (ring counter / formula) |",
                  "|" + "---|" * (8 if floor else 7)]
        for r in rows:
            # rounded: an all-to-all of N equal blocks on N = 3 ranks is a few bytes short
            size = (f"{round(r['bytes'] / MiB)} MB" if r["bytes"] >= MiB / 2 else
                    f"{round(r['bytes'] / 2**10)} KB")
            lines.append(f"| {size} | {spread(r['ring']['us'])} | {spread(r['native']['us'])} | "
                         f"{r['ratio']:.2f} | " + (f"{r['transfer_ratio']:.2f} | " if floor else "")
                         + f"{r['ring']['busbw_GBps']:.3f} | "
                         f"{r['native']['busbw_GBps']:.3f} | {r['ring_sent_bytes']:,.0f} / "
                         f"{r['formula_bytes']:,} |")
    if tables:
        lines += ["", "Per call, median (min-max) over repetitions; ring/native: the median over repetitions of "
                  "the ratio of back-to-back timings; the ring's messages alone: the same sends and "
                  "receives in the same segments, no reduction (bench_collectives.transfer_only), the "
                  "floor under any ring built on this backend's send/recv; algbw = bytes / time, busbw = "
                  "algbw x 2(N-1)/N for all-reduce, x (N-1)/N for all-to-all (nccl-tests); 1 GB = 1e9 "
                  "bytes. An all-to-all's size is each rank's input. Formula: collectives.ring_bytes, "
                  "collectives.all_to_all_bytes."]
    elif "collectives" in m["benchmarks"]:
        lines += ["", "all-reduce, all-to-all: skipped, a world of one sends nothing (run with 2+ ranks)"]
    return lines
