"""bench/gpu.py: one GPU's short window spent measuring, every strategy at world 1 against PyTorch's.

GPU time comes in windows of about 15 minutes on one card. This is the one command to run first:
ddp, zero1, zero2, fsdp, QLoRA under fsdp, zero2 with its optimizer offloaded, tp and a 1F1B
pipeline, each ours and PyTorch's own (bench/compare.py's contenders; for QLoRA PyTorch has no 4-bit
type, so its side is fully_shard over the bf16 base; for the offload, fully_shard's
CPUOffloadPolicy) on gpt2-small in bf16, at world 1 (collectives over a group of one, so the
time is the strategy's own compute, copies and bookkeeping). Each row: ms/step, tokens/s, MFU
against the datasheet peak of the card found (or --peak-tflops), peak memory and loss; then the
memory held over one step, drawn. One Markdown table, one JSON, one SVG. A side that fails (an
older torch's renamed argument, a card without bf16) is written down with its error and the
next goes on; rows stop starting once --budget-s is spent, so the whole fits the window.
Run: python -m bench.gpu (one GPU, under 8 minutes on an H100); tests/test_bench.py runs it on
the CPU with the tiny model and a given peak.
"""
import json
import platform
import sys
import time
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pictures import draw as pictures
from pictures import traces
from bench.compare import ADAMW, LORA, STRATEGIES, our_comm, ours_fsdp, torch_fsdp, with_lora
from bench.measure import Run, datasheet_peak_flops, side, time_training
from running.data import TextData
from lora import apply_lora
from model import PRESETS
from composition.parallelize import build_gpt, data_parallel
from foundations.world import exit_distributed, init_distributed
from foundations.values import Parser, count, number, real, whole
from running.snapshot import unwritable_file

MiB = 2**20


def ours_qlora(model, args):
    """QLoRA as train.py --strategy fsdp --lora --quantize-base nf4 runs it: the base in 4 bits."""
    apply_lora(model, **LORA, quantize="nf4")
    run = ours_fsdp(model, args)
    run.label += f" on apply_lora(rank {LORA['rank']}, {','.join(LORA['targets'])}, quantize nf4)"
    return run


def ours_zero2_offload(model, args):
    """ZeRO-2 with ZeRO-Offload, as train.py --strategy zero2 --offload optimizer builds it."""
    comm = our_comm()
    options = SimpleNamespace(strategy="zero2", ep=1, bucket_mb=args.bucket_mb, precision=args.precision,
                              batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=1,
                              double_quant=False, offload="optimizer", reduce_dtype="fp32")
    wrapped, optimizer, sent, _ = data_parallel(model, options, comm, None, ADAMW)
    return Run(wrapped, optimizer, comm, label="our ZeRO-2 + ZeRO-Offload (AdamW on the host)", napkin_sent=sent)


# row -> (build ours, build PyTorch's), bench/compare.py's contenders where it has them.
ROWS = {
    **{name: STRATEGIES[name] for name in ("ddp", "zero1", "zero2", "fsdp")},
    "qlora-fsdp": (ours_qlora, partial(with_lora, torch_fsdp)),
    "zero2-offload": (ours_zero2_offload, partial(torch_fsdp, offload=True)),
    "tp": STRATEGIES["tp"],
    "pipeline-1f1b": STRATEGIES["pipeline-1f1b"],
}


def parse_args(argv=None):
    p = Parser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(PRESETS), default="gpt2-small")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--batch-size", type=whole, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=whole, default=1024)
    p.add_argument("--microbatches", type=count(1), default=4,
                   help="the pipeline row's (default 4)")
    p.add_argument("--warmup", type=whole, default=3, help="untimed steps per side (default 3)")
    p.add_argument("--steps", type=whole, default=10, help="timed steps per side (default 10)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list, default all: {','.join(ROWS)}")
    p.add_argument("--peak-tflops", type=number, default=None,
                   help="MFU's denominator; default: the datasheet's for the card found (bench_measure)")
    p.add_argument("--budget-s", type=real(0), default=420,
                   help="start no row after this many seconds (default 420: the run ends inside 8 minutes)")
    p.add_argument("--out", default="bench-gpu", help="writes OUT.md, OUT.json and OUT-memory.svg")
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not args.rows or set(args.rows) - set(ROWS):
        p.error(f"--rows {','.join(args.rows) or repr('')}: choose among {','.join(ROWS)}")
    if args.batch_size < 1 or args.batch_size % args.microbatches:
        p.error(f"--batch-size {args.batch_size} must split into --microbatches {args.microbatches}")
    if not 1 <= args.seq_len <= PRESETS[args.model].block_size:
        p.error(f"--seq-len must be 1 to {PRESETS[args.model].block_size}, model {args.model}'s block size")
    if args.steps < 1 or args.warmup < 0 or (args.peak_tflops is not None and not args.peak_tflops > 0):
        p.error("--steps must be 1 or more, --warmup 0 or more, --peak-tflops above 0")
    why = unwritable_file("--out", args.out, "bench-gpu")          # a prefix: OUT.md, OUT.json, OUT-memory.svg
    if why:
        p.error(why)
    # bench_measure reads these of every run (one repetition each side: the window is short)
    args.repeats, args.bucket_mb, args.clip_grad, args.seed, args.profile = 1, 25, 1.0, 0, False
    return args


def measure_side(build, args, batches, device) -> dict:
    """One side of a row timed (bench_measure.time_training), or the error that stopped it."""
    try:
        return side([time_training(build, args, batches, device)], args)
    except Exception as error:                    # noted, and the window goes on to the next side
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def model_flops_per_token(cfg, n_params: int, seq_len: int) -> float:
    """Forward and backward: 6 per parameter, plus attention's scores and weighted sum,
    12 x layers x width x sequence (PaLM, appendix B), as bench/compare.py counts them."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * seq_len


def row_of(name, args, batches, device, peak_flops, flops_per_token) -> dict:
    row = {"row": name}
    for who, build in zip(("ours", "torch"), ROWS[name]):
        result = measure_side(build, args, batches, device)
        if "tokens_per_s" in result and peak_flops:
            result["mfu"] = flops_per_token * result["tokens_per_s"] / peak_flops
        row[who] = result
    if "ms_per_step" in row["ours"] and "ms_per_step" in row["torch"]:
        row["ratio"] = row["ours"]["ms_per_step"]["median"] / row["torch"]["ms_per_step"]["median"]
    print(" | ".join(table_cells(row)), file=sys.stderr, flush=True)       # progress, row by row
    return row


def table_cells(row: dict) -> list[str]:
    """A row's Markdown cells: each side's ms/step, tokens/s, MFU, peak MiB and loss, or its error."""
    def cells(s):
        if "error" in s:
            return [f"failed: {s['error']}"] + [""] * 4
        mfu = f"{100 * s['mfu']:.1f}%" if "mfu" in s else "-"
        return [f"{s['ms_per_step']['median']:.1f}", f"{s['tokens_per_s']:,.0f}", mfu,
                f"{s['peak_bytes'] / MiB:,.0f}", f"{s['last_loss']:.4f}"]
    if "ours" not in row:
        return [row["row"], f"not run: {row['skipped']}"] + [""] * 10
    ratio = f"{row['ratio']:.2f}" if "ratio" in row else "-"
    return [row["row"], *cells(row["ours"]), *cells(row["torch"]), ratio]


def report(machine: dict, rows: list) -> str:
    peak = machine["peak_tflops"]
    head = (f"{machine['gpu'] or machine['cpu']}, torch {machine['torch']}, {machine['backend']}, world 1 | "
            f"model {machine['model']} {machine['precision']}, batch {machine['batch_size']} x "
            f"{machine['seq_len']}, {machine['warmup']} + {machine['steps']} steps a side | MFU against "
            + (f"{peak:g} TFLOP/s ({machine['peak_from']})" if peak else "no known peak (--peak-tflops)"))
    columns = ["row"] + [f"{who} {what}" for who in ("ours", "PyTorch's") for what in
                         ("ms/step", "tokens/s", "MFU", "peak MiB", "loss")] + ["ours / PyTorch's"]
    lines = [head, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(table_cells(row)) + " |" for row in rows]
    return "\n".join(lines + ["", f"bench_gpu.py ran {machine['seconds']:.0f} s"]) + "\n"


def memory_picture(args, strategies=("zero2", "fsdp")) -> str:
    """The bytes held over one step of this model (traces.memory_over_a_step at world 1), drawn by
    pictures.draw_memory with napkin/memory.py's napkin dashed over it (and, on a GPU, the allocator)."""
    flags = ["--model", args.model, "--precision", args.precision, "--batch-size", str(args.batch_size),
             "--seq-len", str(args.seq_len)]
    return pictures.draw_memory([traces.memory_over_a_step(s, flags) for s in strategies])


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    device = init_distributed()
    if dist.get_world_size() != 1:
        raise SystemExit("bench_gpu.py: error: it measures one GPU at world 1: run it with python, "
                         "or torchrun --nproc_per_node 1")
    data = TextData.from_file()
    batches = [tuple(t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, 0, rank=0, world_size=1))
               for step in range(args.warmup + args.steps)]                      # (B, T) each
    cfg, n_params = PRESETS[args.model], build_gpt(args.model).num_parameters()
    sheet = datasheet_peak_flops(device, args.precision) if device.type == "cuda" else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else sheet
    rows = []
    for name in args.rows:
        if time.perf_counter() - started > args.budget_s:
            rows.append({"row": name, "skipped": f"the --budget-s {args.budget_s:g} s was spent"})
            continue
        rows.append(row_of(name, args, batches, device, peak, model_flops_per_token(cfg, n_params, args.seq_len)))
    try:
        svg, picture_error = memory_picture(args), None
    except Exception as error:                                          # the table still gets written
        svg, picture_error = None, f"{type(error).__name__}: {error}"
    machine = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               "cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "backend": dist.get_backend(),
               "cuda": torch.version.cuda, "model": args.model, "n_params": n_params,
               "precision": args.precision, "batch_size": args.batch_size, "seq_len": args.seq_len,
               "warmup": args.warmup, "steps": args.steps, "peak_tflops": peak and peak / 1e12,
               "peak_from": "--peak-tflops" if args.peak_tflops else "datasheet",
               "memory_picture_error": picture_error, "seconds": time.perf_counter() - started}
    table = report(machine, rows)
    for path, text in ((f"{args.out}.md", table), (f"{args.out}.json", json.dumps({"machine": machine, "rows": rows},
                                                                                  indent=1)),
                       *(((f"{args.out}-memory.svg", svg),) if svg else ())):
        with open(path, "w") as f:
            f.write(text)
    print(table)


if __name__ == "__main__":
    main()
    exit_distributed()
