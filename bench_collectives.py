"""bench_collectives.py: our ring all-reduce (built from send/recv) against the native one, by size.

Message sizes x4 from 1 KB to --max-mb, each timed per call over many calls (more for small
messages, where latency is the cost), ring and native in turn so drift hits both alike; reported
as nccl-tests do: algbw = bytes / time, busbw = what each link carries. Left out: the other
collectives (reduce-scatter, all-gather: the two halves of this one) and dtypes other than fp32.
Run: torchrun --nproc_per_node 2 bench.py --quick --strategies collectives
Test: python -m pytest tests/test_bench.py
"""
import statistics
import time

import torch
import torch.distributed as dist

from bench_measure import MiB, across_ranks, spread, summary, sync
from collectives import Comm


def bench_collectives(args, device) -> list:
    """Ring (ours, from send/recv) against native all-reduce, sizes x4 from 1 KB to --max-mb."""
    comms = {"ring": Comm(ring=True), "native": Comm()}
    n, rows, nbytes = dist.get_world_size(), [], 2**10
    while nbytes <= args.max_mb * MiB:
        tensor = torch.zeros(nbytes // 4, device=device)      # fp32; zeros stay finite under sum
        iters = max(5, min(100, 2**26 // nbytes))              # small messages: more calls
        for comm in comms.values():                            # warm-up: connections, buffers
            comm.all_reduce(tensor)
            comm.all_reduce(tensor)
        times = {name: [] for name in comms}
        for _ in range(args.repeats):
            for name, comm in comms.items():
                sync(device)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    comm.all_reduce(tensor)
                sync(device)
                times[name].append(across_ranks(time.perf_counter() - start, device) / iters)
        row = {"bytes": nbytes}
        for name, seconds in times.items():
            algbw = nbytes / statistics.median(seconds)        # nccl-tests: size / time
            row[name] = {"us": summary([1e6 * s for s in seconds]), "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * 2 * (n - 1) / n / 1e9}   # what each link carries
        row["ratio"] = row["ring"]["us"]["median"] / row["native"]["us"]["median"]
        rows.append(row)
        nbytes *= 4
    return rows


def collectives_report(m: dict, rows: list) -> list:
    """The all-reduce table's lines, or why it is missing; none when it was not asked for."""
    lines = []
    if rows:
        lines += ["", "| all-reduce size | ring us | native us | ring/native | ring busbw GB/s | "
                  "native busbw GB/s |", "|" + "---|" * 6]
        for r in rows:
            size = f"{r['bytes'] // MiB} MB" if r["bytes"] >= MiB else f"{r['bytes'] // 2**10} KB"
            lines.append(f"| {size} | {spread(r['ring']['us'])} | {spread(r['native']['us'])} | "
                         f"{r['ratio']:.2f} | {r['ring']['busbw_GBps']:.3f} | "
                         f"{r['native']['busbw_GBps']:.3f} |")
        lines += ["", "Per call, median (min-max) over repetitions; algbw = bytes / time, "
                  "busbw = algbw x 2(N-1)/N (nccl-tests); 1 GB = 1e9 bytes."]
    elif "collectives" in m["benchmarks"]:
        lines += ["", "all-reduce: skipped, a world of one sends nothing (run with 2+ ranks)"]
    return lines
