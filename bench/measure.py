"""bench/measure.py: how bench/compare.py measures one training run, and the table it prints of them.

A run is a fresh model under one strategy: warm-up steps, then timed steps (the slowest rank's
time), beside the bytes held between steps (memory_math.held_bytes, a DTensor by its local tensors),
the bytes one forward keeps for backward (saved-tensor hooks) and, on a GPU, MFU against the
card's datasheet peak. Ours and PyTorch's runs alternate; so do a mixture of experts' runs at
ep 1 and ep P, with the expert weights a rank holds and the all-to-all bytes beside napkin/memory.py's.
With --profile, one more untimed run of each side under torch.profiler says where a step's time
goes, operator by operator, side by side (run_log.start_profiling: train.py's --profile and
--memory-snapshot, the same tools on a training run). Left out: a CPU allocator's peak (none is kept: bytes
held between steps instead).
Run: torchrun --nproc_per_node 2 -m bench --quick (bench/compare.py imports this file)
Test: python -m pytest tests/test_bench.py
"""
import contextlib
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from foundations.comm import Comm
from ddp import DDP
from napkin.memory_math import comm_bytes, ep_params, ep_state_bytes, expert_params, held_bytes, moe_exchange_bytes
from mixed_precision import DTYPES
from foundations.inner_optimizer import element_state
from model import PRESETS
from moe import MoE
from composition.parallelize import build_gpt
from foundations.meters import peak_saved_bytes

MiB = 2**20


# ---- what a contender hands over: bench/compare.py's builds return a Run -------------------------------

@dataclass
class Run:
    """A model wrapped by one strategy, and what the report reads from it."""
    model: torch.nn.Module
    optimizer: object           # zero_grad(), scale_loss(loss), clip_grad_norm_(max), step()
    comm: Comm | None = None    # ours: the byte counter; PyTorch's collectives count nothing
    label: str = "ours"         # what ran, for the report
    napkin_sent: int | None = None       # bytes per step predicted, where memory_math.comm_bytes has no row
    napkin_held: dict | None = None      # {what napkin/memory.py assumes: bytes held per rank it predicts}
    loss_context: object = contextlib.nullcontext   # entered around forward and backward
    forward_backward: object = None      # (x, y) -> loss: a pipeline schedule runs both itself
    bubbles: object = None               # () -> each stage's idle share of the last step (ours)
    predicted_bubble: tuple | None = None      # (formula, value): the schedule's, on its clock


# ---- timing ------------------------------------------------------------------------------------

STARTED = time.perf_counter()


def progress(line: str):
    """Rank 0 says on stderr what the bench has done so far (its tables come at the end)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        seconds = time.perf_counter() - STARTED
        print(f"bench: {line} ({seconds:.0f} s in)", file=sys.stderr, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def across_ranks(value: float, device, op=dist.ReduceOp.MAX) -> float:
    """A per-rank number combined over ranks (the slowest rank's time is the step's time)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.item()


def summary(samples: list) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "samples": samples}


def train_step(run: Run, x, y, clip_grad) -> torch.Tensor:
    run.optimizer.zero_grad()
    if run.forward_backward is not None:                # a pipeline: the schedule does both
        loss = run.forward_backward(x, y)
        update(run.optimizer, clip_grad)
        return loss.detach()
    with run.loss_context():
        _, loss = run.model(x, y)
        run.optimizer.scale_loss(loss).backward()
    if hasattr(run.model, "finish_gradient_sync"):     # ours: DDP's, FSDP's, tp's collectives
        run.model.finish_gradient_sync()
    update(run.optimizer, clip_grad)
    return loss.detach()


def update(optimizer, clip_grad):
    if clip_grad:
        optimizer.clip_grad_norm_(clip_grad)
    optimizer.step()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's part on this rank (its storage is the DTensor's bytes here), else t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def held(run: Run) -> int:
    """memory_math.held_bytes of a run. A DTensor (fully_shard's and parallelize_module's parameters,
    gradients, AdamW moments) has no storage of its own: held_bytes reads stand-ins holding
    the local tensors, which serve as both the model and the optimizer it reads. (A gradient's
    local tensor need not be its parameter's shape: TP's embedding gradient is whole.)"""
    if not any(isinstance(p, DTensor) for p in run.model.parameters()):
        return sum(held_bytes(run.model, run.optimizer).values())
    params = [SimpleNamespace(untyped_storage=_local(p).untyped_storage,
                              grad=None if p.grad is None else _local(p.grad))
              for p in run.model.parameters()]
    state = [_local(v) for v in element_state(run.optimizer.optimizer)]
    local = SimpleNamespace(parameters=lambda: params, buffers=lambda: map(_local, run.model.buffers()),
                            masters=params, state_tensors=lambda: [*params, *state])
    return sum(held_bytes(local, local).values())


def frozen_bytes(model) -> tuple[int, int]:
    """The frozen parameters (LoRA's base): (bytes this rank holds between steps, bytes of the
    whole base, what every rank holds when it is not sharded). Our FSDP holds its frozen shards
    (the parameters are views of a gathered buffer, empty between uses); a DTensor its local
    tensor; a plain parameter itself. 0 and 0 for a model with nothing frozen."""
    frozen = [p for p in getattr(model, "module", model).parameters() if not p.requires_grad]
    here = model.frozen_shards() if hasattr(model, "frozen_shards") else [_local(p) for p in frozen]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in here}
    return sum(storages.values()), sum(p.numel() * p.element_size() for p in frozen)


def expert_bytes(model) -> int:
    """Bytes of the expert weights this rank holds (moe.py: every MoE layer's E experts, or its
    E/ep under expert parallelism); 0 for a dense model."""
    return sum(p.nbytes for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters())


def activation_bytes(run: Run, x, y) -> int:
    """Bytes one forward keeps for backward (saved-tensor hooks), each storage once, untimed.

    meters.saved_activation_bytes fixes the parameters' storages before forward; FSDP
    gathers them during forward, and a DTensor has none: so the parameters' storages are
    read again at each save. DDP wrappers only add gradient hooks: their module is run.
    """
    if run.forward_backward is not None:      # a pipeline: the peak over a whole step's schedule
        peak, _ = peak_saved_bytes(lambda: run.forward_backward(x, y), run.model.parameters())
        run.optimizer.zero_grad()
        return peak
    model = run.model.module if isinstance(run.model, (DDP, DistributedDataParallel)) else run.model
    owner = getattr(run.model, "module", run.model)          # our FSDP: the gathered weights
    storages = {}

    def pack(t):
        weights = {_local(p).untyped_storage().data_ptr() for p in owner.parameters()}
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        # Not t itself: an op's saved output would point back at the op through t.grad_fn, a
        # cycle through autograd's C++ graph that Python's gc never frees (a forward's every
        # activation, each run). The graph is never run backward: a detached alias will do.
        return t.detach()
    with run.loss_context(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)                                         # the graph is dropped unused
    return sum(storages.values())


def time_training(build, args, batches, device, profile: bool = False) -> dict:
    """Build a fresh model and strategy, warm up, time args.steps steps: ms/step, memory, bytes.
    profile: run the timed steps under torch.profiler (which slows them), and add "profile"."""
    gc.collect()                                # the previous run's model and hooks are gone
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)                # every run starts from the same weights
    run = build(build_gpt(args.model).to(device=device, dtype=DTYPES[args.precision]), args)
    for x, y in batches[:args.warmup]:          # first steps allocate, build buckets, tune
        train_step(run, x, y, args.clip_grad)
    if run.comm is not None:
        run.comm.bytes_sent.clear()
    sync(device)
    dist.barrier()                              # every rank starts the clock together
    start = time.perf_counter()
    profiler = (torch.profiler.profile(activities=profiled_activities(device)) if profile
                else contextlib.nullcontext())
    with profiler:
        for x, y in batches[args.warmup:]:
            loss = train_step(run, x, y, args.clip_grad)
        sync(device)
    seconds = across_ranks(time.perf_counter() - start, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else held(run)
    sent = None if run.comm is None else {name: b / args.steps for name, b in run.comm.bytes_sent.items()}
    bubbles = run.bubbles() if run.bubbles else None          # of the last timed step
    frozen_here, frozen_whole = frozen_bytes(run.model)
    return {"ms_per_step": 1e3 * seconds / args.steps, "label": run.label, "bubbles": bubbles,
            "predicted_bubble": run.predicted_bubble,
            "peak_bytes": across_ranks(peak, device), "sent_by_collective": sent,
            "sent_per_step": None if sent is None else sum(sent.values()),
            "napkin_sent": run.napkin_sent, "napkin_held": run.napkin_held,
            "frozen_bytes": across_ranks(frozen_here, device), "frozen_whole": frozen_whole,
            "expert_bytes": across_ranks(expert_bytes(run.model), device),
            "activation_bytes": across_ranks(activation_bytes(run, x, y), device),
            # the same loss on both sides says both did the same work
            "last_loss": across_ranks(loss.item(), device, dist.ReduceOp.SUM) / dist.get_world_size(),
            **({"profile": ops_per_step(profiler, args.steps, device)} if profile else {})}


def profiled_activities(device) -> list:
    cpu = [torch.profiler.ProfilerActivity.CPU]
    return cpu + [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else cpu


def ops_per_step(profiler, steps: int, device) -> dict:
    """{operator: this rank's self time per step, ms}: CPU time on a CPU, kernel time on a GPU
    (where the host only launches). Self time: an operator's own, without the operators it calls,
    so the figures add up to the step."""
    cuda = device.type == "cuda"
    return {e.key: (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3 / steps
            for e in profiler.key_averages()}


NAPKIN_STRATEGY = {"checkpointing": "ddp"}   # what memory_math.comm_bytes knows a row as


def alternate(builds, args, batches, device) -> list[list[dict]]:
    """args.repeats runs of each build, taking turns (a, b, a, b...), so drift hits all alike."""
    runs = [[] for _ in builds]
    for _ in range(args.repeats):
        for results, build in zip(runs, builds):
            results.append(time_training(build, args, batches, device))
    return runs


def side(results: list, args) -> dict:
    """One contender's runs: ms/step over the repetitions, tokens/s of the global batch, the most
    bytes held, and the last run's activations, bytes sent, frozen bytes and loss."""
    ms = summary([r["ms_per_step"] for r in results])
    return {"ms_per_step": ms, "tokens_per_s": args.batch_size * args.seq_len / ms["median"] * 1e3,
            "peak_bytes": max(r["peak_bytes"] for r in results),
            **{key: results[-1][key] for key in ("activation_bytes", "sent_per_step", "napkin_held",
                                                  "frozen_bytes", "frozen_whole")},
            "last_loss": results[-1]["last_loss"], "bubbles": results[-1]["bubbles"],
            "predicted_bubble": results[-1]["predicted_bubble"]}


def bench_strategy(name, builds, args, batches, device, n_params, peak_flops) -> dict:
    """Ours, PyTorch's, ours, PyTorch's...: args.repeats runs each, so drift hits both alike.
    builds: (build ours, build PyTorch's), the strategy's row of bench.STRATEGIES."""
    runs = dict(zip(("ours", "torch"), alternate(builds, args, batches, device)))
    row = {"strategy": name, "torch_counterpart": runs["torch"][-1]["label"],
           **{who: side(results, args) for who, results in runs.items()}}
    row["ratio"] = row["ours"]["ms_per_step"]["median"] / row["torch"]["ms_per_step"]["median"]
    napkin = runs["ours"][-1]["napkin_sent"]
    row["ours"]["napkin_sent_per_step"] = napkin if napkin is not None else sum(
        comm_bytes(n_params, NAPKIN_STRATEGY.get(name, name), args.precision, dist.get_world_size()).values())
    if args.profile:       # one untimed run more of each side: where the time goes, side by side
        row["profile"] = {who: time_training(build, args, batches, device, profile=True)["profile"]
                          for who, build in zip(("ours", "torch"), builds)}
    if peak_flops:
        # Model FLOPs per token (Kaplan et al. 2020; PaLM appendix B): 6 per parameter for forward
        # and backward, plus attention's scores and weighted sum, 12 * layers * width * sequence.
        # Against the datasheet's peak (MFU), and against the measured bf16 matmul's beside it.
        cfg = PRESETS[args.model]
        flops = (6 * n_params + 12 * cfg.n_layer * cfg.n_embd * args.seq_len) * row["ours"]["tokens_per_s"]
        sheet = datasheet_peak_flops(device, args.precision)
        if sheet:
            row["mfu"] = flops / (sheet * dist.get_world_size())
        row["mfu_of_measured_peak"] = flops / (peak_flops * dist.get_world_size())
    return row


def bench_moe(builds: dict, args, batches, device) -> dict:
    """Expert parallelism against the same MoE replicated: builds {ep: build} (ep 1 first), run
    in turn as bench_strategy's sides. Beside each ep's time: the expert weights a rank holds,
    the bytes it holds and sends and its all-to-all bytes, each with napkin/memory.py's napkin (sent:
    the build's prediction, ddp's bucket formula plus moe.exchange_bytes)."""
    cfg, world = PRESETS[args.model], dist.get_world_size()
    tokens = args.batch_size // world * args.seq_len                 # a rank's micro-batch
    size = DTYPES[args.precision].itemsize
    runs = []
    for ep, results in zip(builds, alternate(list(builds.values()), args, batches, device)):
        last = results[-1]
        runs.append({"ep": ep, "label": last["label"], **side(results, args),
                     "expert_bytes": last["expert_bytes"],
                     "napkin_expert_bytes": expert_params(cfg, cfg.experts // ep) * size,
                     "napkin_held_bytes": ep_state_bytes(*ep_params(cfg, ep), "ddp", args.precision,
                                                         world, ep)["total"],
                     "all_to_all_per_step": last["sent_by_collective"].get("all_to_all", 0),
                     "napkin_all_to_all_per_step": moe_exchange_bytes(cfg, tokens, ep, args.precision),
                     "napkin_sent_per_step": last["napkin_sent"]})
    return {"model": args.model, "tokens_per_rank": tokens, "runs": runs,
            "ratio": runs[-1]["ms_per_step"]["median"] / runs[0]["ms_per_step"]["median"]}


# Dense peak TFLOP/s from the vendors' datasheets (no 2:4 sparsity), by the name torch reports:
# MFU's denominator (PaLM, appendix B). "tf32" is an fp32 run whose matmuls use TF32 tensor cores
# (torch.backends.cuda.matmul.allow_tf32), "fp32" one that does not (torch's default).
DATASHEET_TFLOPS = [              # (all these words in the name, {precision: TFLOP/s})
    (("H100", "PCIe"), {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    (("H100",), {"bf16": 989, "fp16": 989, "tf32": 495, "fp32": 67}),            # SXM
    (("H200",), {"bf16": 989, "fp16": 989, "tf32": 495, "fp32": 67}),
    (("A100",), {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    (("L4",), {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}),
]


def datasheet_peak_flops(device, precision: str) -> float | None:
    """The card's datasheet peak for this run's precision, or None for a card not in the table."""
    name = torch.cuda.get_device_name(device)
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        precision = "tf32"
    for words, peaks in DATASHEET_TFLOPS:
        if all(w in name for w in words):
            return peaks[precision] * 1e12
    return None


def matmul_peak_flops(device, n=8192, iters=20) -> float:
    """What this card really does in bf16 (a large matmul): printed beside the datasheet's."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return across_ranks(2 * n**3 * iters / (time.perf_counter() - start), device, dist.ReduceOp.MIN)


# ---- the report --------------------------------------------------------------------------------

def machine(device, args, n_params, peak_flops) -> dict:
    cpu = platform.processor() or "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return {"cpu": cpu, "cores": os.cpu_count(), "threads_per_rank": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "backend": dist.get_backend(),
            "date": datetime.date.today().isoformat(),
            "world_size": dist.get_world_size(),
            "model": args.model, "n_params": n_params, "precision": args.precision,
            "global_batch": args.batch_size, "seq_len": args.seq_len, "warmup": args.warmup,
            "steps": args.steps, "repeats": args.repeats, "bucket_mb": args.bucket_mb,
            "microbatches": args.microbatches, "moe_model": args.moe_model, "ep": args.ep,
            "clip_grad": args.clip_grad, "matmul_peak_tflops": peak_flops and peak_flops / 1e12,
            "datasheet_peak_tflops": (datasheet_peak_flops(device, args.precision) or 0) / 1e12
            if device.type == "cuda" else None}


def spread(s: dict) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def _bubble_note(row: dict, m: dict) -> str:
    """A pipeline row's measured idle share per stage, beside its schedule's formula."""
    if not row["ours"]["bubbles"]:
        return ""
    formula, value = row["ours"]["predicted_bubble"]
    return (f"; ours {m['microbatches']} micro-batches, bubble per stage (idle share of a step) "
            f"{' '.join(f'{b:.2f}' for b in row['ours']['bubbles'])}, formula {formula} "
            f"{value:.2f}; activations: the most a stage holds at once"
            + (" (ours: what autograd saves; the inputs and output gradients kept for a deferred W "
               "live outside autograd after its B, uncounted; torch keeps the graph until W)"
               if "zb" in row["strategy"] else ""))


def _held_note(row: dict) -> str:
    """Beside the peak column: a frozen base's bytes per rank on both sides and whole (what every
    rank holds unsharded), and napkin/memory.py's prediction of our bytes held, where the build gave one."""
    ours, theirs = row["ours"], row["torch"]
    note = ""
    if ours["frozen_whole"]:
        note += (f"; frozen base per rank {ours['frozen_bytes'] / MiB:.2f} / "
                 f"{theirs['frozen_bytes'] / MiB:.2f} MiB (ours / torch), whole "
                 f"{ours['frozen_whole'] / MiB:.2f} MiB (every rank's under DDP)")
    if ours["napkin_held"]:
        note += "; ours held per rank predicted (memory_math.run_state_bytes): " + ", ".join(
            f"{what} {nbytes / MiB:.2f} MiB" for what, nbytes in ours["napkin_held"].items())
    return note


def predicted_cell(row: dict, ms_per_step: dict) -> str:
    """napkin/step_time.py's napkin for the row, and its ratio to the measured median (ours)."""
    if row.get("predicted_ms") is None:                      # a run from before the column
        return "n/a"
    return f"{row['predicted_ms']:.1f} ({row['predicted_ms'] / ms_per_step['median']:.2f})"


def report(m: dict, rows: list) -> list:
    """The report's lines: the machine and the run, the strategy table, its notes, what was skipped."""
    lines = [f"{m['cpu']}, {m['cores']} cores ({m['threads_per_rank']} thread(s) per rank), GPU: "
             f"{m['gpu'] or 'none'}, torch {m['torch']}, {m['backend']}, {m.get('date', 'undated')}, "
             f"world size {m['world_size']}, "
             f"model {m['model']} ({m['n_params'] / 1e6:.2f}M params), {m['precision']}, global batch "
             f"{m['global_batch']} x seq len {m['seq_len']}, {m['warmup']} warm-up + {m['steps']} "
             f"timed steps x {m['repeats']} repetitions", ""]
    if rows:
        lines += ["| strategy | ours ms/step | torch ms/step | predicted ms | ours/torch | ours tokens/s | "
                  "ours peak MiB | torch peak MiB | activations MiB (ours / torch) | "
                  "ours sent MiB/step (ring volume of the calls / napkin) | torch sent MiB/step | ours MFU |",
                  "|" + "---|" * 12]
        for r in rows:
            ours, theirs = r["ours"], r["torch"]
            lines.append(f"| {r['strategy']} | {spread(ours['ms_per_step'])} | "
                         f"{spread(theirs['ms_per_step'])} | {predicted_cell(r, ours['ms_per_step'])} | "
                         f"{r['ratio']:.2f} | "
                         f"{ours['tokens_per_s']:,.0f} | {ours['peak_bytes'] / MiB:.1f} | "
                         f"{theirs['peak_bytes'] / MiB:.1f} | {ours['activation_bytes'] / MiB:.1f} / "
                         f"{theirs['activation_bytes'] / MiB:.1f} | {ours['sent_per_step'] / MiB:.2f} / "
                         f"{ours['napkin_sent_per_step'] / MiB:.2f} | "
                         + (f"{theirs['sent_per_step'] / MiB:.2f} | " if theirs["sent_per_step"] is not None
                            else "n/a | ")
                         + (f"{100 * r['mfu']:.1f}% ({100 * r['mfu_of_measured_peak']:.1f}% of the "
                            f"measured peak) |" if "mfu" in r else "n/a |"))
        peak = ("CUDA max_memory_allocated, activations included" if m["gpu"] else "memory_math.held_bytes: "
                "parameters + gradients (torch DDP's buckets, as .grad views) + optimizer state, a DTensor's "
                "local tensors")
        mfu = (f"model FLOPs / the datasheet's dense {m['precision']} peak of "
               f"{m['datasheet_peak_tflops']:.0f} TFLOP/s per GPU (in brackets: / a measured bf16 "
               f"matmul's {m['matmul_peak_tflops']:.0f} TFLOP/s)" if m["gpu"] else "GPU only")
        lines += ["", f"ms/step: median (min-max) over repetitions, slowest rank. Peak: max over ranks, "
                  f"{peak}. Sent: our Comm's counter (ring volume, native calls included) beside "
                  f"memory_math.comm_bytes (fsdp: our root unit is gathered once, not twice; tp: "
                  f"napkin/sent.py's tp_bytes_per_step, activation traffic memory.py does not model; "
                  f"hsdp, "
                  f"fsdp-lora: napkin/sent.py's fsdp_bytes_per_step, with the copies' all-reduce and the frozen base's "
                  f"gathers memory_math.comm_bytes has no row for); "
                  f"PyTorch's collectives count nothing. Predicted: step_time.py's napkin on this "
                  f"machine as machines.this measured it (a block's forward + backward at the row's "
                  f"shape, AdamW's memory traffic, an all-reduce's latency and bandwidth), in brackets "
                  f"predicted / ours. Activations: bytes one forward keeps for "
                  f"backward (saved-tensor hooks), max over ranks. MFU: {mfu}. Both sides: AdamW, "
                  f"gradient-norm clip {m['clip_grad']}. PyTorch's side, and the loss after the last "
                  f"step (ours / torch: the same work gives the same loss):"]
        lines += [f"- {r['strategy']}: {r['torch_counterpart']}; loss {r['ours']['last_loss']:.5f} / "
                  f"{r['torch']['last_loss']:.5f}" + _bubble_note(r, m) + _held_note(r) for r in rows]
    lines += [f"- {name}: skipped, {why}" for name, why in m["skipped"].items()]
    return lines + [line for r in rows if "profile" in r for line in profile_report(r)]


def profile_report(row: dict, top: int = 12) -> list:
    """A profiled row's operators, ours beside PyTorch's: self ms per step on rank 0 in one more
    run under torch.profiler, the `top` largest on either side, then the sum over every operator."""
    ours, theirs = row["profile"]["ours"], row["profile"]["torch"]
    ops = sorted(set(ours) | set(theirs), key=lambda op: -max(ours.get(op, 0), theirs.get(op, 0)))
    lines = ["", f"{row['strategy']}: where a step's time goes (bench.py --profile: self ms per step, "
                 f"rank 0, one more run under torch.profiler, slowed by it)", "",
             "| operator | ours ms/step | torch ms/step | ours - torch |", "|---|---|---|---|"]
    for op in ops[:top]:
        a, b = ours.get(op, 0.0), theirs.get(op, 0.0)
        lines.append(f"| {op} | {a:.1f} | {b:.1f} | {a - b:+.1f} |")
    total_ours, total_torch = sum(ours.values()), sum(theirs.values())
    lines.append(f"| every operator | {total_ours:.1f} | {total_torch:.1f} | {total_ours - total_torch:+.1f} |")
    return lines


def size_report(runs: list) -> list:
    """ddp against DistributedDataParallel in each run (one per model size), smallest model first:
    whether the ratio holds as the matmuls grow and the per-call overheads stop dominating."""
    lines = ["", "ddp by model size (bench.py --report on each size's JSON):", "",
             "| model | params | global batch x seq len | ours ms/step | torch ms/step | ours/torch | "
             "ours tokens/s | torch tokens/s | run |", "|---|---|---|---|---|---|---|---|---|"]
    for data in sorted(runs, key=lambda d: d["machine"]["n_params"]):
        m = data["machine"]
        for r in (r for r in data["strategies"] if r["strategy"] == "ddp"):
            lines.append(f"| {m['model']} | {m['n_params'] / 1e6:.2f}M | {m['global_batch']} x "
                         f"{m['seq_len']} | {spread(r['ours']['ms_per_step'])} | "
                         f"{spread(r['torch']['ms_per_step'])} | {r['ratio']:.2f} | "
                         f"{r['ours']['tokens_per_s']:,.0f} | {r['torch']['tokens_per_s']:,.0f} | "
                         f"{m['world_size']} ranks, {m['repeats']} x {m['steps']} steps, {m['date']} |")
    return lines


def moe_report(row: dict | None) -> list:
    """The expert-parallelism table's lines (bench_moe's row), or none when it was not run."""
    if row is None:
        return []
    cfg = PRESETS[row["model"]]
    both = lambda r, key: f"{r[key] / MiB:.2f} / {r['napkin_' + key] / MiB:.2f}"
    lines = ["", "| expert parallelism | ms/step | predicted ms | tokens/s | expert weights MiB per rank "
             "(measured / napkin) | peak MiB per rank (measured / napkin) | all-to-all MiB/step (counter / "
             "napkin) | sent MiB/step (counter / napkin) | loss |", "|" + "---|" * 9]
    for r in row["runs"]:
        lines.append(f"| ep {r['ep']}: {cfg.experts // r['ep']} of {cfg.experts} experts per rank | "
                     f"{spread(r['ms_per_step'])} | {predicted_cell(r, r['ms_per_step'])} | "
                     f"{r['tokens_per_s']:,.0f} | {both(r, 'expert_bytes')} | "
                     f"{r['peak_bytes'] / MiB:.2f} / {r['napkin_held_bytes'] / MiB:.2f} | "
                     f"{both(r, 'all_to_all_per_step')} | {both(r, 'sent_per_step')} | "
                     f"{r['last_loss']:.5f} |")
    P = row["runs"][-1]["ep"]
    capacity = "dropless" if cfg.capacity_factor is None else f"capacity factor {cfg.capacity_factor:g}"
    lines += ["", f"ep {P} / ep 1: {row['ratio']:.2f}x the time per step. Model {row['model']} "
              f"({cfg.experts} experts per block, top-{cfg.top_k}, {capacity}), each rank routing its "
              f"own {row['tokens_per_rank']} tokens; both sides our DDP as train.py --strategy ddp "
              f"--ep N builds it (parallelize.data_parallel), AdamW. ep 1 keeps every expert on every rank and "
              f"all-reduces their gradients over the world; ep {P} holds {cfg.experts // P} per rank "
              f"and sends each block's tokens to their experts and back (4 all-to-alls per block). "
              f"Napkin: memory.py's expert_params, ep_state_bytes (ddp), moe_exchange_bytes; sent: "
              f"ddp's bucket formula plus moe.exchange_bytes (at ep > 1 the clip adds a 4-byte "
              f"norm all-reduce). Peak as in the strategy table. Predicted: step_time.py's napkin "
              f"(step_time_parallel: the active experts' compute, the all-to-alls, DDP's all-reduce, "
              f"the optimizer) on machines.this measured at model {row['model']}'s block, in brackets "
              f"predicted / measured."]
    return lines
