"""running/cli.py: train.py's command line: its options, and every check that stops a wrong one.

Every rank parses the same command line with the same world size, so a wrong value stops
every rank with the same one-line message naming the flag and its fix, before any work: no
rank is left waiting in a collective, nothing on disk is touched. The checks of combinations
(a mesh, experts, stages, sequence splits) sit beside the composition, in composition/mesh_checks.py.
--strategy names a row of the composition's STRATEGIES (composition/parallelize.py); auto picks one with
napkin/memory.py's advice.
Test: python -m pytest tests/test_train.py
"""
import dataclasses
import math
import os
import sys
import time  # noqa: F401 (say_error's clock, as cli.time: tests stop its wait)

import torch
import torch.distributed as dist

import context_parallel
from extensions import schedules
from running import snapshot
from napkin.advisor import auto_strategy
from napkin.machines import memory_per_rank
from napkin.memory_math import activation_bytes, human_bytes, logits_bytes, model_params
from foundations.comm import RING_COLLECTIVES
from composition.parallelize import STRATEGIES, ring_choice
from foundations.dtypes import DTYPES, REDUCE_DTYPE
from model import PRESETS
from foundations.world import launched_world_size
# The one parser of every entry point (a refusal in one line); QUIET_WAIT, read by tests as cli.*
from foundations.values import QUIET_WAIT, HelpFormatter, Parser, whole  # noqa: F401
# The combinations' checks live beside the composition (composition/mesh_checks.py); moe_config is the MoE
# flags' model config, read here as cli.moe_config too.
from composition.mesh_checks import (check_context_parallel, check_experts, check_mesh, check_pipeline,  # noqa: F401
                         check_shard_group, check_tensor_parallel, mesh_splits, moe_config)

EVAL_FRACTION = 0.05                      # running/data.py's held-out tail
# AdamW (betas 0.9, 0.95: composition/parallelize.py) moves a weight by lr / (1 - 0.9) = 10 lr in its first
# step, a number torch converts to fp32 (largest 3.4e38): past that the step itself fails. Below,
# a rate too large to train diverges, and divergence.Divergence stops the run in one line.
MAX_LR = 1e37
# Seconds: --timeout also bounds the start-up (every rank importing torch and joining) and any
# wait on another rank's compute (a step, an eval, a save); shorter stops healthy runs.
MIN_TIMEOUT = 5
# ... and at most a day: the backends hold it in milliseconds in a C int (24.8 days), and a longer
# wait is a hang, never a healthy rank.
MAX_TIMEOUT = 24 * 3600
# Sampling divides the logits by --temperature: above a few, every byte is about as likely as
# any other (noise); at inf, NaN.
MAX_TEMPERATURE = 10
PRESETS_DEFAULT = "tiny"                  # --model's
# The flags that name a file or directory: "" names none (and would leave the flag silently off).
PATH_FLAGS = ("data", "out", "resume", "init_from", "export", "export_hf", "profile",
              "memory_snapshot")



def parse_args(argv=None):
    p = Parser(prog="train.py", description="train.py: the command line that composes the concept "
               "files into one training run.", formatter_class=HelpFormatter)
    p.add_argument("--strategy", choices=[*STRATEGIES, "auto"], default=None,
                   help="how ranks share the work (default: single for one process, ddp under "
                        "torchrun); fsdp and zero3 are one engine (fsdp.py): ZeRO stage 3 is FSDP; "
                        "auto walks memory.py's flow chart for this machine's memory")
    p.add_argument("--mem-budget", default=None, metavar="BYTES",
                   help="--strategy auto: memory per rank, e.g. 2GB (default: the GPU's free memory)")
    p.add_argument("--model", choices=list(PRESETS), default=PRESETS_DEFAULT,
                   help="model size (model.py's presets)")
    p.add_argument("--data", default=None, help="a text file to train on (default: the embedded "
                                                "Python standard library source)")
    p.add_argument("--steps", type=whole, default=300, help="optimizer steps in all (a resumed run "
                                                          "continues up to this many)")
    p.add_argument("--batch-size", type=whole, default=16, help="global batch, in sequences")
    p.add_argument("--seq-len", type=whole, default=64, help="tokens per sequence (bytes; an hf:DIR "
                   "model's own tokens)")
    p.add_argument("--tp", type=whole, default=1, help="ranks per tensor-parallel group, splitting "
                   "every matrix (the world is tp x cp x pp x data-parallel; --strategy tp: ddp with it)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: norms and dropout on 1/tp of the tokens each")
    p.add_argument("--pp", type=whole, default=1, help="pipeline stages the blocks are cut into, "
                   "one rank each (--strategy pipeline: ddp with them)")
    p.add_argument("--microbatches", type=whole, default=None,
                   help="with --pp: micro-batches per step in each pipeline (default: 2 x pp)")
    p.add_argument("--schedule", choices=sorted(schedules.SCHEDULES), default=None,
                   help="with --pp: all forwards then all backwards (gpipe), alternating "
                        "(1f1b, the default), over several chunks per stage (interleaved), or with "
                        "each backward split, its weight half filling the idle slots (zb)")
    p.add_argument("--virtual-stages", type=whole, default=None,
                   help="--schedule interleaved: chunks of blocks per stage (default 2)")
    p.add_argument("--stage-layers", default=None, metavar="N,N,...",
                   help="with --pp: blocks per stage (default: balanced by count)")
    p.add_argument("--cp", type=whole, default=1, help="ranks each sequence is split over (context "
                   "parallelism; --strategy cp: ddp with it)")
    p.add_argument("--cp-attention", choices=sorted(context_parallel.ATTENTIONS), default=None,
                   help="with --cp: K/V blocks passed round a ring while attention computes (ring, "
                        "the default), or the whole sequence's K/V all-gathered (allgather, Llama 3's)")
    p.add_argument("--cp-balance", choices=("zigzag", "none"), default=None,
                   help="with --cp: rank r holds chunks r and 2cp-1-r of 2cp, the same causal work "
                        "on every rank (zigzag, the default), or chunk r of cp (none)")
    p.add_argument("--grad-accum", type=whole, default=1,
                   help="micro-batches per step on each rank")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=None, help="end of the cosine decay (default: lr/10)")
    p.add_argument("--warmup", type=whole, default=30, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    p.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability in the model")
    p.add_argument("--precision", choices=list(DTYPES), default="fp32",
                   help="dtype of the model; bf16 and fp16 keep fp32 master weights, fp16 scales "
                        "the loss; fp64 (slow: for checking a strategy against one process exactly) "
                        "reduces in fp64 too")
    p.add_argument("--reduce-dtype", choices=list(DTYPES), default=REDUCE_DTYPE,
                   help="dtype the gradients are averaged in across ranks: fp32 (the default: a "
                        "bf16/fp16 gradient is upcast before the collective, FSDP2's reduce_dtype), "
                        "or the --precision's own (half the bytes, but rounded at every step of the "
                        "ring, an error that grows with the ranks)")
    p.add_argument("--collectives", choices=("auto", "native", "ring"), default="auto",
                   help="native: torch.distributed's collectives (the log's bytes sent are then the ring "
                        "volume of the calls made); ring: ours from send/recv (bytes measured as they are "
                        "sent); auto: whichever was measured faster on the backend (gloo: our ring's "
                        "reduce-scatter and all-gather, gloo's all-reduce; NCCL: its own)")
    p.add_argument("--bucket-mb", type=float, default=25, help="DDP gradient bucket size")
    p.add_argument("--offload", choices=("optimizer", "params"), default=None,
                   help="optimizer (zero1/zero2/fsdp): keep the fp32 master shards and Adam's moments "
                        "in CPU memory and step there (ZeRO-Offload): less device memory, a copy each "
                        "way per step; params (fsdp): the parameter shards too, each copied to the "
                        "device just before its all-gather")
    p.add_argument("--shard-group", type=whole, default=None, metavar="S",
                   help="fsdp: hybrid sharding (HSDP): shard within groups of S ranks (one node), "
                        "replicate across the world / S groups")
    p.add_argument("--prefetch", type=whole, default=1,
                   help="fsdp/zero3: units all-gathered ahead of the one computing (0: none)")
    p.add_argument("--seed", type=int, default=0, help="initial weights, batches and dropout masks")
    p.add_argument("--threads", type=whole, default=None,
                   help="CPU threads each rank computes with (default: OMP_NUM_THREADS if you set "
                        "it, else this node's cores / its ranks)")
    p.add_argument("--log-every", type=whole, default=10,
                   help="log a line every N steps (and the last)")
    p.add_argument("--eval-every", type=whole, default=100,
                   help="eval loss every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=whole, default=4, help="held-out batches per eval loss")
    p.add_argument("--checkpoint-activations", type=whole,
                   nargs="?", const=1, default=0, metavar="K",
                   help="recompute every K-th block's activations in backward instead of keeping "
                        "them (K=1, the default when given: every block)")
    moe = p.add_argument_group("mixture of experts (moe.py; --model tiny-moe has them)")
    moe.add_argument("--experts", type=whole, default=None,
                     help="E: every block's MLP becomes E experts behind a router (default: the "
                          "model's; 0: dense)")
    moe.add_argument("--top-k", type=whole, default=None,
                     help="experts per token (1: Switch, 2: GShard)")
    moe.add_argument("--capacity-factor", type=float, default=None,
                     help="each expert takes at most ceil(F x k x tokens / E) of a micro-batch's "
                          "tokens, the rest dropped; 0: dropless (default: the model's, 1.25)")
    moe.add_argument("--aux-loss-weight", type=float, default=None,
                     help="weight of Switch's load-balancing loss (default: the model's, 0.01)")
    moe.add_argument("--z-loss-weight", type=float, default=None,
                     help="weight of ST-MoE's router z-loss, mean (logsumexp of the router's "
                          "logits)^2, which keeps them small (default: the model's, 0: off)")
    moe.add_argument("--routing-group", type=whole, default=None, metavar="TOKENS",
                     help="tokens routed together, each group with its own capacity and balancing "
                          "loss (default: each rank's micro-batch)")
    moe.add_argument("--ep", type=whole, default=1,
                     help="expert parallelism: split the experts over groups of N ranks, each "
                          "rank's tokens sent to their experts' ranks (ddp, zero1, zero2, fsdp)")
    tune = p.add_argument_group("LoRA fine-tuning (train.py --init-from RUN_DIR --lora --data OTHER.txt)")
    tune.add_argument("--lora", action="store_true",
                      help="freeze the model, train low-rank adapters; checkpoints hold only the adapter")
    # None where not given: with --lora, LORA_DEFAULTS; without, a --lora-* flag is refused.
    tune.add_argument("--lora-rank", type=whole, default=None,
                      help="r, the adapters' inner dimension (default: 8)")
    tune.add_argument("--lora-alpha", type=float, default=None,
                      help="the update is scaled by alpha / rank (default: 16)")
    tune.add_argument("--lora-targets", default=None, help="comma-separated linear layers to adapt "
                      "(query, key, value, output, up, down, head; default: query,value)")
    tune.add_argument("--lora-dropout", type=float, default=None,
                      help="dropout on the adapters' input (default: 0.0)")
    tune.add_argument("--quantize-base", choices=("nf4",), default=None,
                      help="QLoRA: store the frozen base's linear layers (every block's, adapted "
                           "or not) in 4-bit NormalFloat")
    tune.add_argument("--double-quant", action="store_true",
                      help="with --quantize-base: quantize the 4-bit weights' scales to 8 bits too")
    run = p.add_argument_group("run directory, checkpoints and faults")
    run.add_argument("--out", default=None, help="run directory: log.txt, config.json, checkpoints; "
                                                 "OUT/lock keeps a second run out while one runs")
    run.add_argument("--save-every", type=whole, default=0,
                     help="checkpoint every K steps into --out (0: only at the end)")
    run.add_argument("--keep", type=whole, default=3,
                     help="checkpoints kept in --out, newest first")
    run.add_argument("--overwrite", action="store_true",
                     help="start a new run in an --out that holds checkpoints, deleting them")
    run.add_argument("--resume", nargs="?", const="must", default=None, metavar="auto|CHECKPOINT",
                     help="continue from the newest complete checkpoint in --out; 'auto' starts "
                          "fresh when there is none (for torchrun --max-restarts); a checkpoint "
                          "directory (OUT/ckpt-NNNNNNN) continues from that one, e.g. one saved "
                          "before a run diverged: a new branch, so --out's checkpoints off its line "
                          "(saved after it; all, for one from elsewhere) are moved to OUT/abandoned-TIME/")
    run.add_argument("--init-from", default=None,
                     help="weights only (fine-tuning): a run directory, a checkpoint, an --export "
                          "file, or hf:DIR, a local Hugging Face model directory (config.json, "
                          "model.safetensors, tokenizer.json), whose config.json gives the model "
                          "(no --model) and whose tokenizer reads --data")
    run.add_argument("--export", default=None,
                     help="at the end, write one fp32 model file that loads without torch.distributed")
    run.add_argument("--export-hf", default=None, metavar="DIR",
                     help="with --init-from hf:DIR: at the end, write the trained model as a "
                          "Hugging Face directory (config.json, model.safetensors in fp32 with "
                          "LoRA merged, tokenizer.json)")
    run.add_argument("--timeout", type=float, default=None,
                     help="seconds a collective waits for a dead or stuck rank before the run stops "
                          "(default: 120 on CPU, 600 on GPU)")
    # A diverged run stops with one line (train.Divergence): inf/NaN in any precision, and these.
    run.add_argument("--max-skipped", type=whole, default=20, metavar="N",
                     help="stop, diverged, when the fp16 loss scaler skips N steps in a row (0: never)")
    run.add_argument("--max-loss-growth", type=float, default=4.0, metavar="K",
                     help="stop, diverged, when a logged or saved loss exceeds K x the larger of the "
                          "run's first one and ln(vocab), a uniform guess's loss (0: never; an inf or "
                          "NaN loss always stops)")
    prof = p.add_argument_group("profiling")
    prof.add_argument("--profile", metavar="DIR", default=None,
                      help="write a torch.profiler trace of steps 2-4 per rank into DIR, for "
                           "https://ui.perfetto.dev: communication beside the compute it overlaps")
    prof.add_argument("--memory-snapshot", metavar="FILE", default=None,
                      help="CUDA: record every allocation of the first 5 steps into FILE (a pickle) "
                           "for https://pytorch.org/memory_viz")
    gen = p.add_argument_group("sampling (python train.py --sample --init-from RUN_DIR)")
    gen.add_argument("--sample", action="store_true", help="generate text from --init-from and stop")
    gen.add_argument("--prompt", default="def ", help="text the sample continues (default: 'def ')")
    gen.add_argument("--sample-tokens", type=whole, default=300,
                     help="bytes to generate (an hf:DIR model's own tokens)")
    gen.add_argument("--temperature", type=float, default=0.8, help="softmax temperature of sampling")
    args = p.parse_args(argv)
    check_lora_flags(p, args)
    check_pretrained_run(p, args)
    if args.mem_budget is not None and args.strategy != "auto":
        p.error("--mem-budget is the memory per rank that --strategy auto plans for: add --strategy "
                "auto, or leave --mem-budget out")
    # torchrun sets WORLD_SIZE; a caller that joined a process group itself has it there.
    try:
        world_size = dist.get_world_size() if dist.is_initialized() else launched_world_size()
    except ValueError as e:
        p.error(str(e))
    if args.strategy == "auto":              # the advice's flags, after the user's, win
        advice = auto_strategy(p, args, world_size)
        args = p.parse_args([*(sys.argv[1:] if argv is None else argv), *advice])
        check_lora_flags(p, args)
        check_pretrained_run(p, args)     # a new Namespace: its args.hf (None: auto refuses hf)
        args.advice = " ".join(advice)
    check_args(p, args, world_size=world_size)
    vars(args).pop("hf_config", None)     # read by the checks only: a run records its args
    return args


# The --lora-* flags' values where --lora is given without them.
LORA_DEFAULTS = {"lora_rank": 8, "lora_alpha": 16, "lora_targets": "query,value",
                 "lora_dropout": 0.0}


def check_pretrained_run(parser, args):
    """args.hf: the Hugging Face directory the run's model comes from (--init-from hf:DIR, or the
    one the run it resumes or starts from recorded), or None; args.hf_config: its model's config
    (the mesh checks read its shape, parse_args drops it after them), or None; and what such a
    run cannot do, refused before any work: experts (--experts, --ep), --strategy auto,
    --export's file of model.py's GPT. --export-hf needs such a model."""
    if args.init_from and args.init_from.startswith(snapshot.HF):
        try:
            snapshot.check_pretrained(args.init_from)
        except snapshot.CheckpointError as e:
            parser.error(f"--init-from {e}")
    chosen = args.resume not in (None, "must", "auto")
    resumed = args.resume if chosen else args.out if args.resume else None
    args.hf = (snapshot.pretrained_directory(args.init_from)
               or snapshot.pretrained_directory(resumed))
    if args.hf and not (args.init_from or "").startswith(snapshot.HF):   # a run's record
        flag = f"--init-from {args.init_from}" if args.init_from else f"--resume {resumed}"
        try:
            snapshot.check_pretrained(snapshot.HF + args.hf)
        except snapshot.CheckpointError as e:
            parser.error(f"{flag}: the run started from hf:{args.hf}, which no longer loads "
                         f"({e}): put that directory back")
    args.hf_config = None
    if not args.hf:
        if args.export_hf:
            parser.error("--export-hf writes a Hugging Face directory of a model loaded from one: "
                         "add --init-from hf:DIR, or use --export FILE for this project's GPT")
        return
    config = args.hf_config = snapshot.model_config_of(snapshot.read_config(args.hf), args.hf)
    if args.dropout:
        parser.error(f"--dropout {args.dropout}: a model from hf:{args.hf} is loaded without "
                     f"dropout: leave --dropout out")
    if args.strategy == "auto":
        parser.error(f"--strategy auto plans for --model's presets, not yet for hf:{args.hf}'s "
                     f"model: name a --strategy (single, ddp, zero1, zero2, fsdp, tp, ...)")
    if args.experts or args.ep != 1:
        flag = f"--experts {args.experts}" if args.experts else f"--ep {args.ep}"
        parser.error(f"{flag}: hf:{args.hf}'s config.json gives the model, dense (no experts to "
                     f"split): leave {flag.split()[0]} out")
    if args.export:
        parser.error(f"--export {args.export} writes model.py's GPT: for the model of "
                     f"hf:{args.hf} use --export-hf DIR")
    if args.export_hf:
        check_writable_directory(parser, "--export-hf", args.export_hf, "config.json, "
                                 "model.safetensors and tokenizer.json are written into it")
    if args.seq_len > config.block_size and not args.sample:
        parser.error(f"--seq-len {args.seq_len} is longer than the {config.block_size} positions "
                     f"of hf:{args.hf} (its config.json): use --seq-len {config.block_size} or "
                     f"less")


def check_lora_flags(parser, args):
    """The --lora-* flags shape the adapters --lora trains: given without --lora they would be
    ignored, so they are refused (as --double-quant without --quantize-base); else each not
    given takes its default (LORA_DEFAULTS)."""
    given = [f"--{name.replace('_', '-')}" for name in LORA_DEFAULTS
             if getattr(args, name) is not None]
    if given and not args.lora:
        one = len(given) == 1
        parser.error(f"{', '.join(given)} shape{'s' if one else ''} the adapters --lora trains, "
                     f"and this run trains none: add --lora (with --init-from RUN_DIR, the model "
                     f"to fine-tune), or drop {'it' if one else 'them'}")
    for name, default in LORA_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def run_shape(args, data_size: int) -> tuple[str, str]:
    """How the log names the run's mesh (" = tp 2 x pp 2 x dp 2, ..."; " = dp 2, experts over ep
    2" under --ep; "" without either) and its micro-batches."""
    splits = mesh_splits(args)
    experts = f", experts over ep {args.ep}" if args.ep > 1 else ""
    if not splits:
        mesh = f" = dp {data_size}{experts}" if experts else ""
        return mesh, f"{args.grad_accum} micro-batch(es) per rank"
    mesh = (" = " + " x ".join(f"{d} {n}" for d, n in splits.items()) + f" x dp {data_size}"
            + experts)
    if "cp" in splits:
        mesh += f", {args.cp_attention} attention, {args.cp_balance} balance"
    if "pp" not in splits:
        return mesh, f"{args.grad_accum} micro-batch(es) per rank"
    chunks = f" ({args.virtual_stages} chunks per stage)" if args.virtual_stages > 1 else ""
    return (mesh + f", {args.schedule}{chunks} over {args.microbatches} micro-batches",
            f"{args.microbatches} micro-batch(es) per pipeline")


def collectives_used(collectives: str, backend: str, world_size: int) -> str:
    """The log's words for the collectives that run (--collectives auto: the backend's faster
    ones), and how the bytes sent are counted (nothing is sent in a world of one)."""
    ring = ring_choice(collectives, backend)
    if not ring:
        used, counted = f"{backend}'s collectives", "the ring volume of the calls made"
    elif ring == set(RING_COLLECTIVES):
        used, counted = "our ring collectives", "measured"
    else:
        used = (f"our ring's {' and '.join(sorted(ring, reverse=True)).replace('_', '-')}, {backend}'s "
                f"others (--collectives {collectives}: the faster on {backend})")
        counted = "measured"
    return used + (f" (bytes sent: {counted})" if world_size > 1 else "")


def describe_run(args, world_size: int, data_size: int, device: str, n_params: int,
                 n_model: int) -> list[str]:
    """The log's first lines: the run as the command line chose it (and the advisor, with
    --strategy auto), and a note where an option does less than a newcomer may expect.
    n_params: this rank's parameters; n_model: the whole model's, said beside them where a rank
    holds a part (its slices, its stage, its experts)."""
    shape, micro_batches = run_shape(args, data_size)
    lines = []
    if getattr(args, "advice", None):
        lines.append(f"--strategy auto (advisor.py's flow chart, --mem-budget "
                     f"{args.mem_budget or 'free GPU memory'}): {args.advice}")
    model = f"hf:{args.hf}" if args.hf else args.model
    lines.append(f"{args.strategy} on {world_size}{shape} x {device} | model {model} "
                 f"{n_model / 1e6:.2f}M params"
                 f"{f', {n_params / 1e6:.2f}M on this rank' if shape else ''} | "
                 f"{args.precision} | "
                 f"global batch {args.batch_size} x {args.seq_len} tokens, {micro_batches} | "
                 f"{collectives_used(args.collectives, dist.get_backend(), world_size)} | {args.steps} steps")
    if args.hf and args.model != PRESETS_DEFAULT:
        lines.append(f"note: --model {args.model} is not the model: hf:{args.hf}'s config.json "
                     f"gives its shape")
    if world_size == 1 and args.strategy != "single":
        lines.append(f"note: --strategy {args.strategy} on one process is a world of 1 rank: nothing "
                     f"to average or shard, the same training as --strategy single; launch more "
                     f"ranks with torchrun --nproc_per_node N")
    if args.lora and not args.init_from:
        lines.append("note: --lora without --init-from trains the adapters on a randomly initialised "
                     "frozen model, which cannot learn much; fine-tune a trained one with "
                     "--init-from RUN_DIR")
    return lines


def check_args(parser, args, world_size):
    """Stop a wrong configuration with one message naming the fix, before any work.

    Every rank parses the same command line with the same world size, so every rank
    stops with the same message: no rank is left waiting in a collective.
    """
    check_limits(parser, args)
    if args.sample:
        check_sample(parser, args)
        return
    if args.strategy is None:
        args.strategy = "single" if world_size == 1 else "ddp"
    if args.strategy == "single" and world_size > 1:
        parser.error(f"--strategy single runs one process, but {world_size} were launched: "
                     f"use --strategy ddp (or zero1, zero2, fsdp, tp), or run with plain `python train.py`")
    for name in ("steps", "grad_accum", "seq_len", "log_every", "batch_size", "keep", "tp", "cp", "pp",
                 "eval_batches", "lora_rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("warmup", "save_every", "eval_every"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be 0 (none) or more steps, got "
                         f"{getattr(args, name)}")
    # "not x > 0" rather than "x <= 0": a NaN fails every comparison, and is refused too.
    if not 0 < args.lr <= MAX_LR:
        parser.error(f"--lr must be a positive number (the peak of the schedule; runs train at about "
                     f"1e-4 to 1e-2) up to {MAX_LR:g} (AdamW's first step, 10 x lr, must fit in "
                     f"fp32), got {args.lr}")
    if args.min_lr is not None and not 0 <= args.min_lr <= args.lr:
        parser.error(f"--min-lr (the end of the cosine decay) must be between 0 and --lr {args.lr}, "
                     f"got {args.min_lr}")
    if not 0 <= args.clip_grad < math.inf:
        parser.error(f"--clip-grad must be 0 (off) or a positive norm, got {args.clip_grad}")
    if not 0 <= args.weight_decay < math.inf:
        parser.error(f"--weight-decay must be 0 (off) or positive, got {args.weight_decay}")
    # AdamW takes lr x decay x p off every weight p each step: from lr x decay = 1 on, that zeroes
    # or flips them. Under a decay of 1, only an --lr over 1 gets there, which diverges on its
    # own (and the divergence names --lr); from 1 on, the decay is the cause.
    if args.weight_decay >= max(1, 1 / args.lr):
        kept = 1 - args.lr * args.weight_decay
        parser.error(f"--weight-decay {args.weight_decay:g} at --lr {args.lr:g}: AdamW multiplies "
                     f"every weight by 1 - lr x decay = {kept:.3g} each step, which zeroes the "
                     f"weights or flips their sign; give --weight-decay below 1/lr = "
                     f"{1 / args.lr:.3g} (runs use about 0.01 to 0.1)")
    for name in ("dropout", "lora_dropout"):
        if not 0 <= getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} is the probability of zeroing an activation: "
                         f"give a number from 0 (off) up to, not including, 1; got {getattr(args, name)}")
    # running/data.py seeds each batch's generator with (2 seed + 1) x 1_000_000_007 + step, a 64-bit
    # integer: a 32-bit seed keeps it in range for any number of steps.
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed must be from 0 to {2**32 - 1}, got {args.seed}")
    if not 0 < args.bucket_mb < math.inf:
        parser.error(f"--bucket-mb is the size of each gradient message in MiB: give a positive "
                     f"number (e.g. 25, the default), got {args.bucket_mb}")
    if not 0 < args.lora_alpha < math.inf:
        parser.error(f"--lora-alpha must be positive (the update is scaled by alpha / rank: at 0 "
                     f"the adapter never changes the model), got {args.lora_alpha}")
    check_mesh(parser, args, world_size)
    check_experts(parser, args, world_size)
    check_tensor_parallel(parser, args, world_size)
    check_pipeline(parser, args, world_size)
    check_context_parallel(parser, args, world_size)
    data_parallel = world_size // args.tp // args.pp // args.cp   # ranks reading different rows
    micro, flag = ((args.microbatches, "--microbatches") if args.strategy == "pipeline"
                   else (args.grad_accum, "--grad-accum"))
    per_step = data_parallel * micro
    if args.batch_size % per_step:
        fixed = (args.batch_size // per_step + 1) * per_step
        parser.error(f"--batch-size {args.batch_size} does not divide into {data_parallel} "
                     f"data-parallel ranks x "
                     f"{flag} {micro} = {per_step} equal micro-batches: "
                     f"use a multiple of {per_step}, e.g. --batch-size {fixed}")
    block_size = PRESETS[args.model].block_size
    if args.seq_len > block_size and not args.hf:        # hf: check_pretrained_run's
        parser.error(f"--seq-len {args.seq_len} is longer than model {args.model}'s block size "
                     f"{block_size}: use --seq-len {block_size} or less, or a larger --model")
    check_fits(parser, args, data_parallel * micro)
    if args.data is not None:
        if not os.path.isfile(args.data):
            what = ("a directory, not a text file" if os.path.isdir(args.data) else
                    "a device or a pipe, not a text file" if os.path.exists(args.data) else "no such file")
            parser.error(f"--data {args.data}: {what}; give a text file's path, or leave --data out "
                         f"to train on the embedded standard-library text")
        # Both the training part and the held-out tail must fit one window of seq_len + 1 bytes.
        need = math.ceil((args.seq_len + 1) / EVAL_FRACTION)
        size = os.path.getsize(args.data)
        have = memory_per_rank()
        if DATA_COPIES * size > have:
            parser.error(f"--data {args.data} has {human_bytes(size)}, and loading it takes "
                         f"{DATA_COPIES} copies of it, more than the {human_bytes(have)} of memory "
                         f"each of this machine's ranks can hold: train on a part of it (head -c), "
                         f"or on a machine with more memory")
        if size < need:
            parser.error(f"--data {args.data} has {size} bytes, but --seq-len {args.seq_len} needs "
                         f"at least {need} (windows of {args.seq_len + 1} bytes in the training text "
                         f"and in its last {EVAL_FRACTION:.0%}, held out): use a longer file or a "
                         f"smaller --seq-len")
    if args.precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        parser.error("--precision bf16: this GPU has no bf16 arithmetic (it needs compute "
                     "capability 8.0 or newer): use --precision fp16 (with loss scaling)")
    if args.precision == "fp64" and args.reduce_dtype == REDUCE_DTYPE:
        args.reduce_dtype = "fp64"         # every sum in fp64: fp32's default would round the mean
    if args.reduce_dtype not in (REDUCE_DTYPE, args.precision):
        parser.error(f"--reduce-dtype {args.reduce_dtype} with --precision {args.precision}: reduce in "
                     f"{REDUCE_DTYPE} (the default) or in the gradients' own dtype, {args.precision}")
    if args.offload == "params" and args.strategy not in ("fsdp", "zero3"):
        parser.error(f"--offload params keeps the parameter shards in CPU memory between uses: use "
                     f"--strategy fsdp (--strategy {args.strategy} keeps whole parameters on the device)")
    if args.offload == "optimizer" and args.strategy not in ("zero1", "zero2", "fsdp", "zero3"):
        parser.error(f"--offload optimizer moves a sharded optimizer to the CPU: use --strategy zero1, "
                     f"zero2 or fsdp (--strategy {args.strategy} keeps no optimizer shard to move)")
    check_shard_group(parser, args, world_size)
    if (args.resume or args.save_every) and not args.out:
        parser.error("--resume and --save-every need a run directory: add --out DIR")
    if args.resume and args.init_from and not args.lora:
        parser.error("--resume continues a run, --init-from starts one from other weights: use one "
                     "(with --lora, --init-from names the frozen base and --resume the adapter)")
    if args.quantize_base and not (args.lora and args.init_from):
        parser.error("--quantize-base stores a trained base in 4 bits under LoRA adapters: add "
                     "--lora and --init-from RUN_DIR (the model to fine-tune)")
    if args.double_quant and not args.quantize_base:
        parser.error("--double-quant quantizes the scales of a 4-bit base: add --quantize-base nf4")
    if args.checkpoint_activations < 0:
        parser.error(f"--checkpoint-activations K must be 1 or more, got {args.checkpoint_activations}")
    if args.memory_snapshot and not torch.cuda.is_available():
        parser.error("--memory-snapshot records CUDA's allocator and there is no GPU here: on the "
                     "CPU use --profile DIR (its trace has the memory events too)")
    if args.prefetch < 0:
        parser.error(f"--prefetch must be 0 (no prefetch) or more units, got {args.prefetch}")
    if args.max_skipped < 0:
        parser.error(f"--max-skipped must be 0 (never stop) or more steps, got {args.max_skipped}")
    if not (args.max_loss_growth == 0 or 1 < args.max_loss_growth < math.inf):
        parser.error(f"--max-loss-growth must be 0 (never stop) or a factor over 1, got "
                     f"{args.max_loss_growth}")
    if args.profile:
        check_writable_directory(parser, "--profile", args.profile, "each rank's trace goes in it")
    check_paths(parser, args)


# --data's bytes are read whole (data.TextData), then copied into the tensor the batches come from.
DATA_COPIES = 2


def check_fits(parser, args, micro_batches: int):
    """A model, or a micro-batch, that this machine's memory cannot hold is refused before it is
    built: the fp32 weights (memory_math.model_params, before any gradient or optimizer state;
    every rank builds the whole model in host memory first), and on CPU ranks one micro-batch's
    activations and log-probabilities beside them (activation_bytes, logits_bytes; a mesh's
    ranks each hold 1/(tp x cp x pp) of them), against a rank's share of the host's memory
    (memory_per_rank). A lower bound: a run refused here could never start. A model from
    hf:DIR is its config.json's (args.hf_config: every rank loads it whole in fp32), a Llama's
    activations counted by the same formula at its width, heads and layers."""
    cfg = args.hf_config or dataclasses.replace(PRESETS[args.model], **moe_config(args))
    weights, rows = 4 * model_params(cfg), args.batch_size // micro_batches
    activations = (activation_bytes(args.seq_len, rows, cfg.n_embd, cfg.n_head, cfg.n_layer,
                                    checkpointing=bool(args.checkpoint_activations),
                                    bytes_per_value=DTYPES[args.precision].itemsize,
                                    moe=cfg if cfg.experts else None, ep=args.ep)
                   + logits_bytes(args.seq_len, rows, cfg.vocab_size))
    activations //= args.tp * args.cp * args.pp
    if torch.cuda.is_available():
        activations = 0                       # on the GPU, whose out-of-memory error names itself
    have, where = memory_per_rank(), "rank's share of this machine"
    if weights > have:
        flag = (f"--init-from {args.init_from}" if args.hf else f"--experts {args.experts}"
                if args.experts else f"--model {args.model}")
        parser.error(f"{flag}: the model has {model_params(cfg):,} parameters, "
                     f"{human_bytes(weights)} in fp32 alone, more than the {human_bytes(have)} a "
                     f"{where} holds: a smaller "
                     + ("model, or a machine with more memory" if args.hf else "--model")
                     + (" or fewer --experts" if args.experts else ""))
    if weights + activations > have:
        parser.error(f"--batch-size {args.batch_size}: a micro-batch of {rows} x {args.seq_len} "
                     f"tokens keeps about {human_bytes(activations)} of activations per rank "
                     f"(memory.py's formula) beside the weights' {human_bytes(weights)}, more than "
                     f"the {human_bytes(have)} a {where} holds: a smaller --batch-size or "
                     f"--seq-len, more --grad-accum, or --checkpoint-activations")


def check_limits(parser, args):
    """Values of the right type that no run can use: an empty path (which names nothing), more
    threads than this machine has cores, a timeout that is not a number of seconds or too short
    to outlast a start-up."""
    for name in PATH_FLAGS:
        if getattr(args, name) == "":
            parser.error(f"--{name.replace('_', '-')} is empty: give a path, or leave the flag out")
    cores = os.cpu_count() or 1
    if args.threads is not None and not 1 <= args.threads <= cores:
        parser.error(f"--threads must be from 1 to this machine's {cores} CPU cores (more threads "
                     f"than cores only take turns), got {args.threads}")
    if args.timeout is not None and not 0 < args.timeout < math.inf:       # NaN fails too
        parser.error(f"--timeout must be a positive, finite number of seconds, got {args.timeout}")
    if args.timeout is not None and args.timeout < MIN_TIMEOUT:
        parser.error(f"--timeout {args.timeout:g} is shorter than the {MIN_TIMEOUT} s minimum: it also "
                     f"bounds the start-up and every wait on another rank's step, eval or save, so "
                     f"healthy ranks would be taken for dead; give {MIN_TIMEOUT} or more seconds")
    if args.timeout is not None and args.timeout > MAX_TIMEOUT:
        parser.error(f"--timeout {args.timeout:g} is longer than a day ({MAX_TIMEOUT} s): a rank "
                     f"silent that long is stuck; give {MAX_TIMEOUT} seconds or fewer")


def check_sample(parser, args):
    """--sample's flags: a model to sample, then what to sample (its values before its files)."""
    if not args.init_from:
        parser.error("--sample needs a trained model: add --init-from RUN_DIR (or a checkpoint)")
    if not 0 <= args.temperature <= MAX_TEMPERATURE:                   # NaN fails too
        parser.error(f"--temperature must be 0 (greedy: the likeliest byte each time) or "
                     f"positive, up to {MAX_TEMPERATURE} (above a few, bytes come out as noise), "
                     f"got {args.temperature}")
    if not args.prompt:
        parser.error("--prompt is empty: the model continues a text, so give it at least one "
                     "byte, e.g. --prompt 'def ' (the default)")
    if args.sample_tokens < 1:
        parser.error(f"--sample-tokens is how many bytes to generate: give 1 or more, got "
                     f"{args.sample_tokens}")
    check_paths(parser, args)


def check_paths(parser, args):
    """--init-from must be weights load_weights reads; --out must be a directory this rank can
    write, and one that holds no other run's checkpoints unless --resume continues it or
    --overwrite starts over; --resume's checkpoint must be one this run can continue. Every
    rank checks (each writes its part of every checkpoint), before any work."""
    hf = args.init_from and args.init_from.startswith(snapshot.HF)   # check_pretrained_run's
    if args.init_from and not hf and not os.path.exists(args.init_from):
        parser.error(f"--init-from {args.init_from}: no such file or directory; give a run "
                     f"directory, a checkpoint directory or an --export file")
    check_outputs_apart(parser, args)          # paths first: check_source reads every tensor
    if args.init_from:
        try:
            snapshot.check_source(args.init_from)
        except snapshot.CheckpointError as e:
            parser.error(f"--init-from: {e}")
    if not args.out:
        if args.overwrite:
            parser.error("--overwrite starts a run directory over: add --out DIR")
        return
    check_writable_directory(parser, "--out", args.out, "the run's log, configuration and "
                                                        "checkpoints go in it")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out, --overwrite deletes it: use one")
    chosen = args.resume not in (None, "must", "auto")              # --resume CHECKPOINT
    if chosen and not os.path.isfile(os.path.join(args.resume, "meta.json")):
        parser.error(f"--resume {args.resume}: not a complete checkpoint; give no value (the newest "
                     f"in --out), 'auto', or a checkpoint directory such as {args.out}/ckpt-0000100")
    saved = snapshot.checkpoints(args.out)
    if saved and not args.resume and not args.overwrite:
        parser.error(f"--out {args.out} holds another run's checkpoints (newest "
                     f"{os.path.basename(saved[-1])}): continue it with --resume, or start over with "
                     f"--overwrite (which deletes them), or give a new --out")
    if args.resume and (chosen or saved):        # none to continue: snapshot.resume says so
        check_resume(parser, args, args.resume if chosen else saved[-1])


def check_outputs_apart(parser, args):
    """What the run writes stays apart from what it reads (paths resolved, symlinks followed):
    --out neither is, holds nor lies inside --init-from's weights, which a run's checkpoints
    would mix with, --keep prune and --overwrite delete before they are read; nor is or lies
    inside the checkpoint --resume names (holding it is a resume's usual case, OUT/ckpt-NNNNNNN).
    The files it writes (--export, --memory-snapshot) replace no input, --data's included.
    Every rank, before any work."""
    inputs = []                 # (flag, its value, the file or checkpoint directory it reads)
    if args.init_from:
        newest = snapshot.latest(args.init_from) if os.path.isdir(args.init_from) else None
        hf = snapshot.pretrained_directory(args.init_from) if not newest else None
        inputs.append(("--init-from", args.init_from, newest or hf or args.init_from))
    if args.resume not in (None, "must", "auto"):
        inputs.append(("--resume", args.resume, args.resume))
    if args.data:
        inputs.append(("--data", args.data, args.data))
    for flag, given, read in inputs:
        for path in dict.fromkeys((given, read)):        # a run directory, and its newest checkpoint
            relation = _relation(args.out, path) if args.out else None
            if flag == "--init-from" and relation:
                parser.error(f"--out {args.out} {relation} --init-from {given}"
                             f"{_resolved(args.out, path)}, the weights this run starts from: its "
                             f"checkpoints would mix with them, --keep and --overwrite delete them; "
                             f"give an --out apart from them")
            if flag == "--resume" and relation in ("is", "lies inside"):
                parser.error(f"--out {args.out} {relation} --resume {given}{_resolved(args.out, path)}: "
                             f"the run would write into the checkpoint it continues; give the run "
                             f"directory holding it (--out {os.path.dirname(os.path.normpath(given))}) "
                             f"or another")
        for output, file in (("--export", args.export), ("--export-hf", args.export_hf),
                             ("--memory-snapshot", args.memory_snapshot)):
            relation = _relation(file, read) if file else None
            if relation in ("is", "lies inside"):
                parser.error(f"{output} {file} {relation} {flag} {given}{_resolved(file, read)}, "
                             f"which this run reads: the file {output} writes would replace it; "
                             f"give another path")


def _relation(path: str, other: str) -> str | None:
    """How path stands to other, both resolved: "is", "holds", "lies inside", or None (apart)."""
    path, other = os.path.realpath(path), os.path.realpath(other)
    if path == other:
        return "is"
    common = os.path.commonpath([path, other])
    return "holds" if common == path else "lies inside" if common == other else None


def _resolved(path: str, other: str) -> str:
    """The words " (resolved: A and B)" where a symlink made the two paths meet, else none."""
    real = [os.path.realpath(p) for p in (path, other)]
    if real == [os.path.abspath(p) for p in (path, other)]:
        return ""
    return f" (resolved: {real[0]} and {real[1]})"


def check_writable_directory(parser, flag: str, path: str, holds: str):
    """flag's path is a directory this rank can write (made if missing); holds: what goes in it."""
    if os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"{flag} {path} is a file: give a directory ({holds})")
    link = _dangling_link(path)
    if link:                                  # makedirs would say only "File exists"
        parser.error(f"{flag} {path}: {link} is a symbolic link to {os.readlink(link)}, which does "
                     f"not exist: create that directory, remove the link, or give another {flag}")
    try:                 # by writing, not by os.access: root passes that even on a read-only mount
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".writable-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        parser.error(f"{flag} {path}: this rank cannot write there ({e.strerror}): choose a "
                     f"directory every rank can write to")


def _dangling_link(path: str) -> str | None:
    """path, or the directory above it, that is a symbolic link to nothing; None if none is."""
    path = os.path.abspath(path)
    while not (os.path.islink(path) and not os.path.exists(path)):
        if os.path.dirname(path) == path:
            return None
        path = os.path.dirname(path)
    return path


def check_resume(parser, args, path: str):
    """--resume against the checkpoint it continues (path): its meta.json whole, a --steps that
    leaves something to train, and the run's LoRA flags, which the checkpoint's pieces need."""
    try:
        meta = snapshot.read_meta(path)
    except snapshot.CheckpointError as e:
        parser.error(f"--resume: {e}")
    step = meta["step"]
    if args.steps < step:
        parser.error(f"--steps {args.steps} is below step {step} of {path}, where --resume continues: "
                     f"nothing would train; give --steps above {step} (a resumed run trains up to "
                     f"--steps in all), or --resume a checkpoint of step {args.steps} or before")
    lora_run, base = meta.get("lora"), meta.get("base")
    if lora_run and not args.lora:
        parser.error(f"--resume {path}: the run trains LoRA adapters (its checkpoints hold them): "
                     f"add --lora, with the run's --lora-* flags" + (f" and --init-from {base}" if base else ""))
    if args.lora and not lora_run:
        parser.error(f"--lora: {path} is a run trained without LoRA (whole weights): resume it without "
                     f"--lora, or fine-tune it with --lora --init-from {path} and a new --out")
    if base and not args.init_from:
        parser.error(f"--resume {path}: the run's adapters fine-tune the frozen base {base}: "
                     + _base_fix(meta, "add"))
    if lora_run and args.lora:
        check_same_adapter(parser, args, path, meta)


# A LoRA checkpoint's settings that its pieces or its base depend on: (flag, its apply_lora
# argument as meta.json's "lora" holds it, this run's value, the flag's words for a value).
ADAPTER_FLAGS = (
    ("--lora-rank", "rank", lambda a: a.lora_rank, lambda v: f"--lora-rank {v}"),
    ("--lora-targets", "targets", lambda a: sorted(a.lora_targets.split(",")),
     lambda v: f"--lora-targets {','.join(v)}"),
    ("--quantize-base", "quantize", lambda a: a.quantize_base,
     lambda v: f"--quantize-base {v}" if v else "no --quantize-base"),
    ("--double-quant", "double_quant", lambda a: a.double_quant,
     lambda v: "--double-quant" if v else "no --double-quant"))


def check_same_adapter(parser, args, path: str, meta: dict):
    """A LoRA resume continues the adapter it saved, over the weights it was trained on: the
    same rank and targets (A and B's shapes, their names), the same 4-bit rounding of the base,
    and an --init-from holding the same weights (snapshot.base_identity), wherever they are now."""
    for flag, key, value_of, words in ADAPTER_FLAGS:
        saved, now = meta["lora"].get(key), value_of(args)   # (checkpoints before QLoRA: none)
        saved = sorted(saved) if key == "targets" else bool(saved) if key == "double_quant" else saved
        if now != saved:
            parser.error(f"{flag}: {path}'s adapter was trained with {words(saved)}, this run asks "
                         f"for {words(now)}: resume with {words(saved)}, or train a new adapter "
                         f"with another --out")
    base = meta.get("base")
    if not base and args.init_from:
        parser.error(f"--init-from {args.init_from}: {path}'s run was started without --init-from, "
                     f"so its checkpoints hold the frozen weights too: resume without --init-from")
    if not (base and meta.get("base_sha256")):          # older checkpoints record only a path
        return
    given = snapshot.base_identity(args.init_from)
    if given["sha256"] != meta["base_sha256"]:
        parser.error(f"--init-from {args.init_from} holds other weights ({given['path']}) than the "
                     f"base {path}'s adapter was trained over, {base}: " + _base_fix(meta, "resume with"))


def _base_fix(meta: dict, verb: str) -> str:
    """How to give a LoRA checkpoint's base back: "{verb} --init-from BASE" while it is there as
    recorded, else what happened to it and the fix."""
    base = meta["base"]
    try:
        snapshot.check_adapter_base(meta, base)
    except snapshot.CheckpointError:
        what = "is missing (moved or deleted)" if not os.path.exists(base) else "has changed since"
        return (f"that base {what}: put those weights back at {base}, or pass --init-from a copy "
                f"of them")
    return f"{verb} --init-from {base}"
