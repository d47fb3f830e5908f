"""napkin/step_time.py: napkin math, time: how long one training step takes, by strategy, on a machine.

napkin/memory.py prices a step's bytes; this file its seconds, in closed form. compute = FLOPs / the
FLOP/s the machine reaches (6 per parameter per token, 8 with activation checkpointing, 4 for a
frozen weight, plus attention's; Kaplan et al. 2020 section 2.1, PaLM appendix B); a collective =
messages x latency + bytes sent / bandwidth (the ring volumes napkin/memory.py counts); and only what
compute cannot hide counts (on a GPU; a CPU hides nothing): DDP and ZeRO-2 the last bucket, ZeRO-1
all of it (it reduces after backward), FSDP its first gather and last reduce-scatter (prefetch
hides the rest), tensor parallelism all of it (on the critical path), a pipeline its bubble by
schedule (extensions/schedules.py), offload its PCIe transfers, the optimizer step its memory traffic.
Left out: launch gaps, the data loader, stragglers, a GPU's non-matmul kernels (CPU `this`
measures them in: machines.block_flops_per_second). FLOPs: napkin/flops.py; machines, and a collective's
seconds on a link: napkin/machines.py; expert and context parallelism (all-to-alls, K/V exchange):
napkin/step_time_parallel.py.
Run: python -m napkin.step_time --model medium --world 2 --batch 16 --seq-len 64 --machine a100
     python -m napkin.step_time --llama-8b (torchtitan's Llama-3.1-8B FSDP run on 8 H100s)
Test: python -m pytest tests/test_step_time.py

Shapes: L layers, C width, F the MLP's hidden width, T sequence, V vocabulary, N ranks,
P pipeline stages, M micro-batches, v chunks per stage.
"""
import math
from dataclasses import dataclass, replace

from napkin.flops import LLAMA_3_1_8B, Shape, block_flops, model_flops_per_token, step_flops
from napkin.machines import (ADAMW_BYTES, PRESETS as MACHINES, Link, Machine, collective_seconds,
                             overlapped)
from napkin.memory_math import _element_size, nf4_bytes
from model import PRESETS as MODELS
from mechanics.pipeline_mechanics import bubble_formula, split_layers
from extensions.schedules import SCHEDULES, make_schedule
from napkin.step_time_parallel import inside_blocks
from tensor_parallel import check_divisible
from foundations.values import Parser, whole

# Bytes per parameter the optimizer step reads and writes beside AdamW's (machines.ADAMW_BYTES):
# the clip's, the norm reading the gradient and the scale reading and writing it, 12; a 16-bit
# model's fp32 master's, the gradient cast up (r 2 w 4) and the weight rounded down (r 4 w 2), 12.
CLIP_BYTES, MASTER_BYTES = 12, 12
DATA_PARALLEL = ("single", "ddp", "zero1", "zero2", "fsdp")


# ---- communication: what compute cannot hide of each collective (machines.collective_seconds) -

def data_parallel_seconds(strategy: str, shape: Shape, world: int, size: int, wire: int, link: Link,
                          bucket: int, forward: float, backward: float, trainable: int,
                          quantized: int = 0) -> tuple:
    """(seconds, exposed) of the gradient sync of DDP, ZeRO-1/2 and FSDP, per step.

    ddp: one bucketed all-reduce in backward. zero1: reduce-scatter of every bucket after
    backward, all-gather of the updated shards after the step, all exposed. zero2: the
    reduce-scatter in backward (as ddp), the all-gather exposed. fsdp: a unit per block plus the
    root (embeddings, head): gathered in forward (the root before block 0, with nothing to hide
    under), gathered again in backward (blocks; the root stays), reduce-scattered in backward
    (the root's last): prefetch hides each behind the previous unit's compute. quantized: the
    blocks' matrix elements QLoRA stores in NF4, gathered as they are stored (4 bits and scales)."""
    P = shape.params()
    if strategy == "single" or world == 1:
        return 0.0, 0.0
    if strategy == "ddp":
        return overlapped("all_reduce", trainable, wire, world, link, bucket, backward)
    gather = collective_seconds("all_gather", P, size, world, link, math.ceil(P / bucket))
    if strategy == "zero1":
        scatter = collective_seconds("reduce_scatter", trainable, wire, world, link,
                                     math.ceil(trainable / bucket))
        return scatter + gather, scatter + gather
    if strategy == "zero2":
        scatter, exposed = overlapped("reduce_scatter", trainable, wire, world, link, bucket,
                                      backward)
        return scatter + gather, exposed + gather
    block = shape.block_params(active=False)
    root = P - shape.layers * block                       # embeddings, head, and the small rest
    four_bit = quantized // shape.layers                  # a block's NF4 share
    block_bytes = nf4_bytes(four_bit) + (block - four_bit) * size

    def gather(nbytes, units=1):
        return collective_seconds("all_gather", nbytes, 1, world, link, units)

    def scatter(numel, units=1):           # gradients: only the trainable share (LoRA's adapters)
        return collective_seconds("reduce_scatter", numel * trainable // P, wire, world, link,
                                  units)
    first = gather(root * size) + gather(block_bytes)
    rest_forward = gather((shape.layers - 1) * block_bytes, shape.layers - 1)
    last = scatter(root) + scatter(block)
    rest_backward = (gather(shape.layers * block_bytes, shape.layers)
                     + scatter((shape.layers - 1) * block, shape.layers - 1))
    total = first + rest_forward + last + rest_backward
    hidden = max(0.0, rest_forward - forward) + max(0.0, rest_backward - backward)
    return total, first + last + hidden


def tensor_parallel_seconds(shape: Shape, tokens: int, micro_batches: int, world: int, size: int,
                            link: Link) -> float:
    """Megatron's f and g: per micro-batch two all-reduces of the (m, C) activations per block
    forward and two backward, one each for the embedding and the head, three of m fp32 for the
    vocabulary-parallel loss, and the gradient norm's one number (napkin/sent.py's tp_bytes_per_step).
    Every one of them sits between two matmuls that need it: all exposed."""
    m = tokens // micro_batches
    activations = collective_seconds("all_reduce", m * shape.width, size, world, link, 1)
    loss = collective_seconds("all_reduce", m, 4, world, link, 1)
    per_micro_batch = (4 * shape.layers + 2) * activations + 3 * loss
    return micro_batches * per_micro_batch + collective_seconds("all_reduce", 1, 4, world, link)


def pipeline_seconds(shape: Shape, schedule: str, P: int, M: int, v: int, tokens: int, size: int,
                     link: Link, stage_compute: float) -> dict:
    """The busiest stage's p2p sends (one (m, C) activation or gradient each, exposed: the next
    stage waits for it) and the bubble: the schedule's idle share of the step (schedules.
    bubble_formula: (P-1)/(M+P-1) for GPipe and 1F1B, (P-1)/(vM+P-1) interleaved, (P-1)/(3M+P-1)
    zero bubble), so the step is the stage's compute / (1 - bubble)."""
    stages = make_schedule(schedule, P, M, v)
    sends = max(sum(a.kind.startswith("send") for a in actions) for actions in stages)
    message = tokens // M * shape.width * size
    p2p = link.seconds(sends * message, sends) + collective_seconds("all_reduce", 1, 4, P, link)
    bubble = bubble_formula(schedule, P, M, v)
    return {"p2p": p2p, "bubble": stage_compute * bubble / (1 - bubble), "bubble_share": bubble}


# ---- one step ------------------------------------------------------------------------------------

@dataclass
class Step:
    """One training step: the model's shape, the strategy over `world` ranks, the global batch
    (sequences of seq_len tokens). strategy: single, ddp, zero1, zero2, fsdp, tp or a pipeline
    ("pipeline-1f1b", ...: every rank a stage, micro_batches M, v chunks if interleaved).
    lora: (trainable adapter elements, frozen matrix elements); quantized: of those, the ones
    QLoRA stores in NF4 (FSDP gathers them so); offload: ZeRO-Offload's step.
    Under ddp, the splits inside a block (napkin/step_time_parallel.py): ep, each MoE layer's experts
    over groups of ep ranks; cp, every sequence over groups of cp ranks (zigzag), `attention`
    ring or allgather; world = the data-parallel ranks x cp."""
    shape: Shape
    strategy: str
    world: int
    batch: int
    seq_len: int
    precision: str = "fp32"
    micro_batches: int = 1
    virtual_stages: int = 1
    checkpointing: float = 0.0
    lora: tuple | None = None
    offload: bool = False
    bucket_mb: float = 25
    adamw: str = "unfused"
    quantized: int = 0
    ep: int = 1
    cp: int = 1
    attention: str = "ring"


def _compute(step: Step, machine: Machine) -> tuple[dict, int, int]:
    """(forward and backward seconds of this rank, its tokens, the parameters it updates)."""
    s, N = step.shape, step.world
    adapters, frozen = step.lora or (0, 0)
    flops = step_flops(s, step.seq_len, step.checkpointing, frozen, adapters)
    whole = step.strategy == "tp" or step.strategy.startswith("pipeline")   # every rank all rows
    tokens = step.batch * step.seq_len // (1 if whole else N)
    share = 1.0
    if step.strategy == "tp":
        share = 1 / N                                   # every matrix split over the ranks
    elif step.strategy.startswith("pipeline"):         # the busiest stage: the most blocks, +head
        chunks = split_layers(s.layers, N, v=step.virtual_stages)
        blocks = max(sum(len(c) for c in chunks[stage::N]) for stage in range(N))
        forward = blocks * block_flops(s, step.seq_len) + 2 * s.vocab * s.width
        share = forward / flops["forward"]
    rate = machine.flops[step.precision]
    seconds = {phase: tokens * f * share / rate for phase, f in flops.items()}
    trained = adapters or s.held_params(step.ep)
    updated = trained if step.strategy in ("single", "ddp") else math.ceil(trained / N)
    return seconds, tokens, updated


def predict(step: Step, machine: Machine) -> dict:
    """Seconds of one step on `machine`, by part, their total, tokens/s and MFU (model FLOPs /
    the datasheet peak of all ranks; on `this` CPU, of the measured block rate)."""
    s, N = step.shape, step.world
    size = _element_size(step.precision)
    link = machine.link(N)
    compute, tokens, updated = _compute(step, machine)
    parts = {**compute, "communication": 0.0, "exposed": 0.0}
    trainable = step.lora[0] if step.lora else s.params()
    if step.ep > 1 or step.cp > 1:
        parts.update(inside_blocks(step, machine, compute, tokens))
    elif step.strategy in DATA_PARALLEL:
        bucket = int(step.bucket_mb * 2**20) // size
        parts["communication"], parts["exposed"] = data_parallel_seconds(
            step.strategy, s, N, size, size, link, bucket, compute["forward"], compute["backward"],
            trainable, step.quantized)
    elif step.strategy == "tp":
        parts["communication"] = parts["exposed"] = tensor_parallel_seconds(s, tokens, 1, N, size,
                                                                            link)
    elif step.strategy.startswith("pipeline"):
        pipe = pipeline_seconds(s, step.strategy.split("-", 1)[1], N, step.micro_batches,
                                step.virtual_stages, tokens, size, link,
                                compute["forward"] + compute["backward"])
        parts["communication"] = parts["exposed"] = pipe["p2p"]
        parts["bubble"] = pipe["bubble"]
    else:
        raise ValueError(f"unknown strategy {step.strategy!r}: choose one of "
                         f"{', '.join(DATA_PARALLEL)}, tp, pipeline-<schedule>")
    if not machine.overlaps:           # a CPU: the collectives' work takes the compute's cores
        parts["exposed"] = parts["communication"]
    per_param = ADAMW_BYTES[step.adamw] + CLIP_BYTES + (MASTER_BYTES if size < 4 else 0)
    if step.offload:        # the gradient shard down, the parameter shard up, then the host's Adam
        parts["offload"] = machine.host_link.seconds(updated * (size + size), 2)
    memory = machine.host_memory_bandwidth if step.offload else machine.memory_bandwidth
    parts["optimizer"] = updated * per_param / memory
    total = sum(v for k, v in parts.items() if k != "communication")
    global_tokens = step.batch * step.seq_len
    peak = machine.peak_flops[step.precision] * N
    mfu = model_flops_per_token(s, step.seq_len) * global_tokens / total / peak
    return {"parts": parts, "seconds": total, "tokens_per_s": global_tokens / total, "mfu": mfu}


def beside(measured: float, predicted: float | str) -> str:
    """A log's measured seconds per step beside the napkin's, or beside why there is none."""
    if isinstance(predicted, str):
        return f" ({measured * 1e3:.0f} ms/step; no napkin: {predicted})"
    return f" ({measured * 1e3:.0f} ms/step, napkin {predicted * 1e3:.0f})"


def describe(step: Step, machine: Machine, result: dict) -> list:
    """The napkin's lines: each part in ms, the total, tokens/s per rank and MFU."""
    parts = "  ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in result["parts"].items())
    splits = ((f" + cp {step.cp} ({step.attention})" if step.cp > 1 else "")
              + (f" + ep {step.ep}" if step.ep > 1 else ""))
    return [f"{step.strategy}{splits} on {step.world} x {machine.name}, {step.precision}, batch "
            f"{step.batch} x {step.seq_len}: {parts} ms (communication: all of it; exposed: what "
            f"compute does not hide)",
            f"step {result['seconds'] * 1e3:.1f} ms, {result['tokens_per_s'] / step.world:,.0f} "
            f"tokens/s per rank, MFU {100 * result['mfu']:.1f}%"]


# --strategy: train.py's names. zero3 is fsdp (train.py's alias); cp is ddp with every sequence
# split over the whole world, ring attention (napkin/step_time_parallel.py), as train.py --strategy cp.
STRATEGIES = (*DATA_PARALLEL, "zero3", "tp", "cp", *(f"pipeline-{name}" for name in SCHEDULES))
# The run's options and their defaults: none of them may be given with --llama-8b, a fixed run.
# seq_len None: the model's block size.
RUN_DEFAULTS = dict(model="medium", strategy="ddp", world=2, batch=16, seq_len=None,
                    precision="fp32", machine="h100-sxm", microbatches=4)


def parse_args(argv=None):
    p = Parser(prog="python -m napkin.step_time", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(MODELS), help="default medium")
    p.add_argument("--llama-8b", action="store_true",
                   help="torchtitan's published Llama-3.1-8B run (docs/performance.md, table 1): "
                   "FSDP on 8 H100s, bf16, local batch 2 x 8192, selective activation "
                   "checkpointing")
    p.add_argument("--strategy", choices=STRATEGIES,
                   help="default ddp; zero3 is fsdp; cp: ddp with every sequence split over the "
                   "--world ranks (ring attention)")
    p.add_argument("--world", type=whole, help="ranks; default 2 (single: 1)")
    p.add_argument("--batch", type=whole, help="global, in sequences; default 16")
    p.add_argument("--seq-len", type=whole, help="default: the model's block size (medium: 256)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default fp32")
    p.add_argument("--machine", choices=list(MACHINES), help="default h100-sxm")
    p.add_argument("--microbatches", type=whole,
                   help="with --strategy pipeline-*: per step; default 4")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--tflops", type=float, help="the matmuls' TFLOP/s instead of the preset's "
                   "(one measured: a block's forward + backward on the card)")
    args = p.parse_args(argv)
    if args.tflops is not None and not (math.isfinite(args.tflops) and args.tflops > 0):
        p.error(f"--tflops {args.tflops:g}: give the TFLOP/s the matmuls reach, a positive number "
                f"(e.g. 700), or leave it out for the --machine preset's")
    given = [name for name in RUN_DEFAULTS if getattr(args, name) is not None] + (
        ["checkpointing"] if args.checkpointing else [])
    if args.llama_8b and given:
        p.error(f"--llama-8b prices torchtitan's published run as it ran (FSDP on 8 H100s, bf16, "
                f"16 x 8192): drop {', '.join('--' + name.replace('_', '-') for name in given)}, "
                f"or "
                f"price a run of your own without --llama-8b")
    if not args.llama_8b:
        _check_run(p, args)
    return args


def _check_run(p, args):
    """The run's options, defaults filled in: a world, batch and sequence the strategy splits."""
    if args.strategy == "single" and args.world not in (None, 1):
        p.error(f"--strategy single runs on one rank, but --world is {args.world}: use "
                f"--strategy ddp, or drop --world")
    if args.microbatches is not None and not (args.strategy or "").startswith("pipeline-"):
        p.error("--microbatches splits a pipeline's batch: give --strategy pipeline-1f1b (or "
                "another schedule), or drop --microbatches")
    for name, default in RUN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, 1 if name == "world" and args.strategy == "single" else default)
    cfg, N = MODELS[args.model], args.world
    args.seq_len = cfg.block_size if args.seq_len is None else args.seq_len
    for flag, value in (("--world", N), ("--batch", args.batch),
                        ("--microbatches", args.microbatches)):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    if not 1 <= args.seq_len <= cfg.block_size:
        p.error(f"--seq-len must be between 1 and model {args.model}'s block size "
                f"{cfg.block_size}, got {args.seq_len}")
    if args.strategy in (*DATA_PARALLEL, "zero3") and args.batch % N:
        p.error(f"--batch {args.batch} does not split over --world {N} ranks: use a multiple "
                f"of {N}")
    if args.strategy.startswith("pipeline-"):
        _check_pipeline(p, args)
    if args.strategy == "tp":
        try:
            check_divisible(cfg, N)
        except ValueError as e:
            p.error(f"--strategy tp over --world {N}: {e}")
    if args.strategy == "cp" and (N < 2 or args.seq_len % (2 * N)):
        p.error(f"--strategy cp splits each sequence into 2 x --world {N} chunks (zigzag): give "
                f"--world 2 or more and a --seq-len divisible by {2 * N}")


def _check_pipeline(p, args):
    """A pipeline of --world stages, each with a block per chunk, and whole micro-batches."""
    cfg, N, M, v = MODELS[args.model], args.world, args.microbatches, _virtual_stages(args.strategy)
    if N < 2 or cfg.n_layer < N * v:
        chunks = f" x {v} chunks" if v > 1 else ""
        p.error(f"--strategy {args.strategy} cuts model {args.model}'s {cfg.n_layer} blocks into "
                f"--world {N} stages{chunks}: give --world 2 to {cfg.n_layer // v} (a block per "
                f"chunk), or a deeper --model")
    if args.batch % M:
        p.error(f"--batch {args.batch} does not split into --microbatches {M}: use a multiple "
                f"of {M}")
    try:
        make_schedule(args.strategy.removeprefix("pipeline-"), N, M, v)
    except ValueError as e:                     # interleaved: M a multiple of P
        p.error(f"--strategy {args.strategy}: {e}")


def _virtual_stages(strategy: str) -> int:
    """Chunks per stage: interleaved runs two (train.py's default), the other schedules one."""
    return 2 if strategy == "pipeline-interleaved" else 1


def command_line_step(args) -> Step:
    """The Step the command line describes (zero3: fsdp; cp: ddp, the world one cp group)."""
    strategy = {"zero3": "fsdp", "cp": "ddp"}.get(args.strategy, args.strategy)
    return Step(Shape.of(MODELS[args.model]), strategy, args.world, args.batch, args.seq_len,
                args.precision, micro_batches=args.microbatches,
                virtual_stages=_virtual_stages(args.strategy),
                checkpointing=args.checkpointing, cp=args.world if args.strategy == "cp" else 1)


def main(argv=None):
    args = parse_args(argv)
    if args.llama_8b:
        # Selective (op) checkpointing recomputes every other matmul of a block: about half its
        # forward. torchtitan's AdamW is fused. 5,762 tokens/s per GPU is 33% MFU on this count.
        step = Step(LLAMA_3_1_8B, "fsdp", 8, 16, 8192, "bf16", checkpointing=0.5, adamw="fused")
        machine = MACHINES["h100-sxm"]
    else:
        step, machine = command_line_step(args), MACHINES[args.machine]
    if args.tflops:
        machine = replace(machine, flops={**machine.flops, step.precision: args.tflops * 1e12})
    print("\n".join(describe(step, machine, predict(step, machine))))


if __name__ == "__main__":
    main()
