"""bench/scaling.py: what a rank holds and sends as the world grows, beside the napkin math.

Each strategy trains 2 steps of the same model at world 1, 2, 4 and 8 (train.py under torchrun,
one process per rank; 8 ranks on 2 CPU cores are slow, but bytes count exactly). Its log gives
the bytes a rank holds between steps (params, grads, optimizer: counted tensor storage) beside
napkin/memory.py's prediction, and the bytes it sends per step beside the strategy's ring formula.
The lecture's picture in numbers: DDP holds the same at every world and sends 2(N-1)/N of the
gradients; ZeRO-1, ZeRO-2 and FSDP shard more and more of the 16 bytes per parameter; tensor and
pipeline parallelism split the model (at most one head, one block per rank: beyond that the
rest of the world is data parallel, tp 4 x dp 2 at world 8 for the tiny GPT).
Run: python -m bench --scaling 1,2,4,8 (no torchrun: it launches one per run)
Test: python -m pytest tests/test_bench.py
"""
import os
import re
import subprocess
import sys

from bench.measure import progress
from model import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "tp", "pipeline")
# train.py's log (running/run_log.py): napkin/memory.py's prediction, the measure, and the bytes sent
NAPKIN = re.compile(r"predicted \(memory.py's napkin math\): params ([\d.]+) MiB, grads ([\d.]+), optim ([\d.]+)")
HELD = re.compile(r"measured: params ([\d.]+) MiB, grads ([\d.]+), optim ([\d.]+)")
SENT = re.compile(r"\| sent ([\d.]+) MiB/step \(ring formula ([\d.]+)\)")


def split_flags(strategy: str, world: int, model: str) -> list[str]:
    """tp and pipeline split the model over as many ranks as it allows (a head, a block each);
    the rest of the world is data parallel."""
    cfg = PRESETS[model]
    if strategy == "tp":
        return ["--tp", str(max(d for d in range(1, world + 1) if world % d == 0 and cfg.n_head % d == 0))]
    if strategy == "pipeline":
        stages = max(d for d in range(1, world + 1) if world % d == 0 and d <= cfg.n_layer)
        return ["--pp", str(stages), "--microbatches", str(2 * stages)]
    return []


def scaling_run(strategy: str, world: int, args) -> dict:
    """2 steps of train.py on `world` ranks: the measured and predicted bytes (MiB) of rank 0."""
    flags = split_flags(strategy, world, args.model)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
            "train.py", "--model", args.model, "--strategy", strategy, *flags, "--steps", "2",
            "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--batch-size",
            str(args.batch_size), "--seq-len", str(args.seq_len), "--precision", args.precision]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv[3:])} failed:\n{out.stderr[-2000:]}")
    napkin = [float(v) for v in NAPKIN.search(out.stdout).groups()]
    held = [float(v) for v in HELD.findall(out.stdout)[-1]]     # the last one (said when it changes)
    sent, formula = SENT.findall(out.stdout)[-1] if world > 1 else (0.0, 0.0)     # the last step's
    return {"strategy": strategy, "world": world, "split": " ".join(flags[:2]),
            "held": held, "napkin_held": napkin, "sent": float(sent), "formula_sent": float(formula)}


def bench_scaling(args) -> list[dict]:
    runs = []
    for strategy in args.strategies:
        for world in args.scaling:
            runs.append(scaling_run(strategy, world, args))
            progress(f"{strategy} on {world} rank(s) run")
    return runs


def scaling_report(m: dict, rows: list) -> list:
    if not rows:
        return []
    worlds = sorted({r["world"] for r in rows})
    lines = [f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['backend']}, {m['date']}",
             f"\nBytes per rank as the world grows: model {m['model']}, {m['precision']}, batch "
             f"{m['global_batch']} x {m['seq_len']}, 2 steps of train.py each; rank 0's. held: params + "
             f"grads + optimizer, measured / memory.py (MiB); sent per step, measured / ring formula "
             f"(MiB)", "",
             "| strategy | " + " | ".join(f"world {w}: held | sent" for w in worlds) + " |",
             "|---|" + "---|---|" * len(worlds)]
    for strategy in STRATEGIES:
        cells = []
        for w in worlds:
            r = next((r for r in rows if r["strategy"] == strategy and r["world"] == w), None)
            if r is None:
                cells += ["", ""]
                continue
            split = f" ({r['split']})" if r["split"] else ""
            cells += [f"{sum(r['held']):.1f} / {sum(r['napkin_held']):.1f}{split}",
                      f"{r['sent']:.2f} / {r['formula_sent']:.2f}"]
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    return lines
