"""The lecture's "what to do when it does not fit" flow chart, walked with napkin/memory.py's napkin math.

The rungs, each a train.py command: ddp (then zero2, the micro-batch grown), fsdp, + activation
checkpointing, + the optimizer offloaded to the CPU, LoRA, QLoRA (FSDP sharding the 4-bit base),
QLoRA with the parameters offloaded too (the talk's 70B on two 24 GB GPUs: python -m napkin.memory
--advise --model 70b --gpu-mem 24GB --world 2 --seq-len 2048). Each is priced per rank (training
state plus one micro-batch's activations and logits); the first that fits is the advice, and
train.py --strategy auto takes it. For a model with experts, the advice is also priced under each
--ep: bytes held against all-to-all bytes sent. It chooses by bytes; --gpu NAME also ranks every
rung that fits by its step time on that machine (napkin/advisor_speed.py), and --measure runs them here
(napkin/experiment.py). Left out: pipeline and tensor parallelism, and what napkin/memory.py leaves out
(transient buffers, the CUDA context).
Run: python -m napkin.memory --advise --model gpt2-small --gpu-mem 24GB --world 4 --target-batch 64
     python -m napkin.memory --advise --params 7B --gpu-mem 24GB   (a shape of about 7B: params_shape)
     python -m napkin.memory --advise --model 7b --world 8 --seq-len 2048 --target-batch 64 --gpu rtx3090 --link pcie
     python -m napkin.memory --advise --model tiny --world 2 --seq-len 64 --measure
Test: python -m pytest tests/test_advisor.py
"""
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from napkin.machines import LINKS, PRESETS as MACHINES, joined_by
from napkin.memory_math import (GB, activation_bytes, bytes_per_param, ep_comm_bytes, ep_params, ep_state_bytes,
                         human_bytes, logits_bytes, model_params, moe_exchange_bytes, nf4_bytes,
                         quantized_params, root_params)
from model import PRESETS, GPTConfig
from foundations.world import init_distributed
# parse_bytes: the bytes --gpu-mem and train.py's --mem-budget take (the one place parsing them)
from foundations.values import count, size as parse_bytes

# ---- the flow chart, rung by rung ------------------------------------------------------------
#
#   mixed precision always (bf16, or fp16 where the GPU has no bf16)
#   -> micro-batch 1 fits with ddp, or else with zero2?  then zero2, the largest micro-batch
#   -> else zero3/fsdp  -> + activation checkpointing  -> + optimizer offloaded to the CPU
#   -> else LoRA (train adapters only)  -> QLoRA (the frozen base in 4 bits, sharded by FSDP)
#   -> + the parameters offloaded to the CPU (the device holds only the units being gathered)
# Gradient accumulation fills the rest of the target batch at every rung.

LORA_RANK, LORA_TARGETS = 8, ("query", "value")
# QLoRA adapts every linear of a block, as the paper does, and stores the whole frozen base's
# linears in 4 bits whichever it adapts (memory_math.quantized_params).
QLORA_TARGETS = ("query", "key", "value", "output", "up", "down")
HEADROOM = 0.1                  # of the memory left free: a rung fits under 90% of it


@dataclass
class Advice:
    """One rung: what train.py runs, and the napkin bytes per rank it needs."""
    rung: str
    strategy: str
    micro_batch: int              # sequences per rank per forward
    grad_accum: int
    flags: list                   # train.py flags beyond strategy, batch and accumulation
    held: dict                    # params, grads, optimizer, activations, total (device bytes)
    fits: bool

    def argv(self, model: str, precision: str, seq_len: int, target_batch: int) -> list:
        return ["--strategy", self.strategy, "--model", model, "--precision", precision,
                "--batch-size", str(target_batch), "--seq-len", str(seq_len),
                "--grad-accum", str(self.grad_accum), *self.flags]


def rung_bytes(cfg: GPTConfig, strategy: str, precision: str, world: int, seq_len: int, b: int,
               checkpointing: bool = False, offload: bool | str = False, trainable: int | None = None,
               quantized: int = 0, ep: int = 1) -> dict:
    """Per-rank device bytes of one rung: the training state (under --ep, a rank's E/ep experts
    of each MoE layer kept over the world/ep ranks that hold them) and one micro-batch of b
    sequences' activations and logits. trainable None: every parameter trains.
    offload="params" (fsdp): the shards wait on the host; the device holds, as "params", the
    units gathered: the root (root_params, gathered from forward to the end of backward) and
    FSDP's 1 + prefetch = 2 blocks, whole, as stored (4-bit where quantized)."""
    n, experts = ep_params(cfg, ep)
    states = ep_state_bytes(n, experts, strategy, precision, world, ep, trainable=trainable,
                            quantized=quantized, offload=offload)
    act = activation_bytes(seq_len, b, cfg.n_embd, cfg.n_head, cfg.n_layer, checkpointing,
                           bytes_per_param(precision)["params"], moe=cfg, ep=ep)
    act += logits_bytes(seq_len, b, cfg.vocab_size)
    params = states["params"]
    if offload == "params":
        size = bytes_per_param(precision)["params"]
        root = root_params(cfg) * size                 # in the compute dtype: QLoRA quantizes blocks
        blocks = nf4_bytes(quantized) + (n - quantized) * size - root
        params = root + 2 * blocks // cfg.n_layer
    return {"params": params, "grads": states["grads"], "optimizer": states["optimizer"],
            "activations": act, "total": states["total"] - states["params"] + params + act,
            **({"host": states["host"]} if offload else {})}


def _linear_sides(cfg: GPTConfig) -> dict:
    """in + out features of each linear layer a block has, by name; an MoE block's up and down
    are its experts', E of each. A Llama's (pretrained/llama.py): H and G heads of D, SwiGLU's
    gate, up and down F wide."""
    if hasattr(cfg, "n_kv_head"):
        C, F, q, kv = cfg.n_embd, cfg.hidden, cfg.n_head * cfg.D, cfg.n_kv_head * cfg.D
        return {"query": C + q, "key": C + kv, "value": C + kv, "output": q + C,
                "gate": C + F, "up": C + F, "down": F + C}
    C, copies = cfg.n_embd, max(1, cfg.experts)
    return {"query": 2 * C, "key": 2 * C, "value": 2 * C, "output": 2 * C,
            "up": 5 * C * copies, "down": 5 * C * copies}


def lora_params(cfg: GPTConfig, rank: int = LORA_RANK, targets=LORA_TARGETS) -> int:
    """Trainable parameters of LoRA on the named linears of each block: A (r x in), B (out x r)."""
    return cfg.n_layer * rank * sum(_linear_sides(cfg)[t] for t in targets)


def advise(model: str | GPTConfig, gpu_mem: int, world: int, seq_len: int, target_batch: int,
           precision: str = "bf16", headroom: float = HEADROOM) -> list[Advice]:
    """Walk the flow chart; every rung tried, the last one the first that fits (if any does).

    model: a preset's name, or a shape (params_shape, or a Hugging Face directory's config:
    GPTConfig or pretrained/llama.py's LlamaConfig). A rung fits when its per-rank bytes
    (states + one micro-batch's activations and logits) stay under (1 - headroom) x gpu_mem.
    target_batch: the global batch in sequences. Activations are per micro-batch: gradient
    accumulation reaches the target batch without holding more of them, so it costs steps, not
    memory.
    """
    if isinstance(model, str) and model not in PRESETS:
        raise ValueError(f"unknown model {model!r}: choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[model] if isinstance(model, str) else model
    if world < 1:
        raise ValueError(f"the world must be at least 1 GPU, got {world}")
    if not 1 <= seq_len <= cfg.block_size:
        name = f"model {model}" if isinstance(model, str) else "the assumed shape"
        raise ValueError(f"--seq-len must be between 1 and {name}'s block size "
                         f"{cfg.block_size}, got {seq_len}")
    if target_batch < 1 or target_batch % world:
        raise ValueError(f"--target-batch {target_batch} does not split over {world} ranks: "
                         f"use a multiple of {world}")
    per_rank, budget = target_batch // world, (1 - headroom) * gpu_mem
    tried = []
    for name, strategy, checkpointing, offload, trainable, quantized, flags in rungs(cfg, world):
        def need(b, strategy=strategy):
            return rung_bytes(cfg, strategy, precision, world, seq_len, b, checkpointing, offload,
                              trainable, quantized)
        held = need(1)
        if held["total"] > budget:
            tried.append(Advice(name, strategy, 1, per_rank, flags, held, False))
            continue
        if strategy in ("ddp", "zero2"):       # it fits: shard gradients and optimizer, grow b
            name, strategy = "zero2, the largest micro-batch that fits", "zero2"
        elif strategy == "single":             # one GPU: nothing to shard, grow b
            name = "one GPU, the largest micro-batch that fits"
        b = largest_micro_batch(per_rank, budget, lambda d: need(d, strategy))
        tried.append(Advice(name, strategy, b, per_rank // b, flags, need(b, strategy), True))
        break
    return tried


def rungs(cfg: GPTConfig, world: int) -> list[tuple]:
    """The flow chart's rungs: (name, strategy, checkpointing, offload, trainable (None: all),
    quantized parameters, train.py flags)."""
    lora = ["--lora", "--lora-rank", str(LORA_RANK), "--lora-targets", ",".join(LORA_TARGETS)]
    qlora = ["--lora", "--lora-rank", str(LORA_RANK), "--lora-targets", ",".join(QLORA_TARGETS),
             "--quantize-base", "nf4"]
    trained, quantized = lora_params(cfg, targets=QLORA_TARGETS), quantized_params(cfg)
    # zero2 is a rung of its own: it can fit where ddp's replicated Adam state does not.
    sharded = [("zero2, micro-batch 1", "zero2", False, False, None, 0, [])] if world > 1 else []
    return [
        ("ddp, micro-batch 1", "ddp" if world > 1 else "single", False, False, None, 0, []),
        *sharded,
        ("zero3 (fsdp)", "fsdp", False, False, None, 0, []),
        ("fsdp + activation checkpointing", "fsdp", True, False, None, 0, ["--checkpoint-activations"]),
        ("fsdp + checkpointing + optimizer offloaded to the CPU", "fsdp", True, True, None, 0,
         ["--checkpoint-activations", "--offload", "optimizer"]),
        ("LoRA (fsdp + checkpointing)", "fsdp", True, False, lora_params(cfg), 0,
         ["--checkpoint-activations", *lora]),
        ("QLoRA: the frozen base in 4-bit NF4, sharded", "fsdp", True, False, trained, quantized,
         ["--checkpoint-activations", *qlora]),
        ("QLoRA + the parameters offloaded to the CPU", "fsdp", True, "params", trained, quantized,
         ["--checkpoint-activations", *qlora, "--offload", "params"]),
    ]


def largest_micro_batch(per_rank: int, budget: float, need) -> int:
    """The largest micro-batch dividing a rank's share of the batch whose bytes (need(b)["total"])
    fit the budget; 1 if none does."""
    return max([d for d in range(1, per_rank + 1) if per_rank % d == 0 and need(d)["total"] <= budget],
               default=1)


# ---- napkin/memory.py --advise ----------------------------------------------------------------------
#
# --params N names no shape, and the flow chart needs one (activations, the blocks FSDP gathers):
# it takes one of the 7b preset's family (Llama 2 7B's proportions): heads of 128 dimensions, as
# many layers as heads, 7b's vocabulary and positions; the width is the one nearest N parameters.

HEAD_DIM = 128


def params_shape(n: float) -> GPTConfig:
    """The shape of the 7b preset's family whose parameter count is nearest n: k layers of k heads
    of 128, d_model 128 k, about 12 L d^2 = 12 128^2 k^3 parameters in the blocks."""
    def shape(k):
        return dataclasses.replace(PRESETS["7b"], n_layer=k, n_head=k, n_embd=HEAD_DIM * k)
    k = 1
    while model_params(shape(k + 1)) <= n:                    # a few hundred steps up to 10^13
        k += 1
    return min(shape(k), shape(k + 1), key=lambda cfg: abs(model_params(cfg) - n))


def describe_shape(cfg: GPTConfig) -> str:
    return (f"{cfg.n_layer} layers, d_model {cfg.n_embd}, {cfg.n_head} heads, vocabulary "
            f"{cfg.vocab_size}, {cfg.block_size} positions, {model_params(cfg):,} parameters")


def add_arguments(p):
    """The flow chart's options, a group of napkin/memory.py's command line."""
    advice = p.add_argument_group("the flow chart (memory.py --advise --model M or --params N "
                                  "--gpu-mem 24GB --world N)")
    advice.add_argument("--advise", action="store_true",
                        help="walk the lecture's flow chart and print the first train.py command that fits")
    advice.add_argument("--gpu-mem", type=parse_bytes, default=None,
                        help="memory per GPU, e.g. 24GB, 80GB, 512MiB; default "
                        "--gpu's, else 24GB")
    advice.add_argument("--gpu", choices=list(MACHINES), default=None,
                        help="a machine (machines.py): also rank every rung that fits by its speed")
    advice.add_argument("--link", choices=LINKS, default=None, help="with --gpu: the link between "
                        "its ranks (default: the preset's)")
    advice.add_argument("--measure", action="store_true", help="run each rung that fits for a few steps "
                        "on this machine (experiment.py) and print predicted beside measured")
    advice.add_argument("--target-batch", type=count(1), default=None,
                        help="global batch in sequences to reach (gradient accumulation fills it); "
                             "default 8 per GPU")
    advice.add_argument("--no-bf16", dest="bf16", action="store_false",
                        help="the GPU has no bf16 (before Ampere): fp16 with loss scaling")


# What --advise reads of napkin/memory.py's options; any other given is ignored (napkin/memory.py warns).
ADVISE_READS = {"advise", "model", "params", "world", "seq_len", "gpu_mem", "target_batch", "bf16", "gpu",
                "link", "measure"}


def check_args(p, args):
    """The shape (a preset's, or params_shape's for --params), the default target batch, then
    advise's own checks as one usage message."""
    if (args.model is None) == (args.params is None):
        p.error("--advise needs a shape: give --model (a preset, e.g. 7b) or --params N (e.g. 7B: "
                "a shape of about N parameters)")
    if args.params is not None and args.params < 1:
        p.error(f"--params must be at least 1 parameter, got {args.params:g}")
    args.shape = args.cfg if args.model else params_shape(args.params)  # cfg: memory.py's
    if args.target_batch is None:
        args.target_batch = 8 * args.world
    if args.gpu_mem is None:
        args.gpu_mem = int(MACHINES[args.gpu].memory) if args.gpu else parse_bytes("24GB")
    if args.link and not args.gpu:
        p.error("--link names the link between the ranks of a --gpu: add --gpu (e.g. --gpu h100-sxm)")
    try:
        args.machine = MACHINES.get(args.gpu)
        if args.link:
            args.machine = joined_by(args.machine, args.link)
        advise(args.model if args.model in PRESETS else args.shape, args.gpu_mem, args.world,
               args.seq_len or args.shape.block_size, args.target_batch)
    except ValueError as e:
        p.error(str(e))


def expert_parallel_options(cfg: GPTConfig, chosen: Advice, world: int, seq_len: int,
                            precision: str) -> list[tuple[int, dict, dict]]:
    """The chosen rung under each --ep dividing the experts and the world: (ep, bytes per rank
    (rung_bytes), bytes sent per step by collective: the gradients' and parameters' over their
    groups (memory_math.ep_comm_bytes) and the all-to-alls (memory_math.moe_exchange_bytes))."""
    options = []
    for ep in (ep for ep in range(1, world + 1) if world % ep == 0 and cfg.experts % ep == 0):
        n, experts = ep_params(cfg, ep)
        sent = ep_comm_bytes(n, experts, chosen.strategy, precision, world, ep)
        sent["all_to_all"] = moe_exchange_bytes(cfg, chosen.micro_batch * seq_len, ep, precision,
                                                chosen.grad_accum)
        held = rung_bytes(cfg, chosen.strategy, precision, world, seq_len, chosen.micro_batch,
                          "--checkpoint-activations" in chosen.flags, "--offload" in chosen.flags, ep=ep)
        options.append((ep, held, sent))
    return options


def print_expert_parallel(cfg: GPTConfig, chosen: Advice, world: int, seq_len: int, precision: str,
                          gpu_mem: int, unit: float = GB):
    """The advice under each --ep: fewer experts held per rank, against the all-to-all bytes."""
    if not chosen.fits or "--lora" in chosen.flags or world == 1:
        why = ("one GPU holds every expert" if world == 1 else "nothing fits" if not chosen.fits
               else "LoRA keeps the experts whole on every rank")
        print(f"expert parallelism (--ep): not priced, {why}")
        return
    print(f"\nexpert parallelism, {chosen.strategy} with micro-batch {chosen.micro_batch} x "
          f"{chosen.grad_accum}: --ep N holds {cfg.experts}/N experts per block on each rank, and each "
          f"block sends a micro-batch's tokens to them and back (4 all-to-alls, capacity buffer)")
    print(f"{'--ep':>5}{'experts':>9}{'params':>9}{'grads':>9}{'optim':>9}{'activ.':>9}"
          f"{'total ' + ('GB' if unit == GB else 'MiB'):>10}{'all-to-all MB':>15}{'sent MB/step':>14}")
    for ep, h, sent in expert_parallel_options(cfg, chosen, world, seq_len, precision):
        print(f"{ep:>5}{cfg.experts // ep:>9}{h['params'] / unit:9.2f}{h['grads'] / unit:9.2f}"
              f"{h['optimizer'] / unit:9.2f}{h['activations'] / unit:9.2f}{h['total'] / unit:10.2f}"
              f"{sent['all_to_all'] / 1e6:15.1f}{sum(sent.values()) / 1e6:14.1f}  "
              + ("fits" if h["total"] <= (1 - HEADROOM) * gpu_mem else "too big"))


# ---- train.py --strategy auto ------------------------------------------------------------------

def auto_strategy(parser, args, world_size) -> list[str]:
    """--strategy auto: advise's first rung that fits this machine; its train.py flags."""
    if args.mem_budget:
        try:
            budget = parse_bytes(args.mem_budget)
        except ValueError as e:
            parser.error(f"--mem-budget: {e}")
    elif torch.cuda.is_available():
        # The free bytes of this rank's own GPU (joining the job sets its device first: asked
        # before that, every rank would query, and make a context on, GPU 0), and the least over
        # the ranks, so that every rank picks the same rung.
        device = init_distributed(timeout=args.timeout or 600)
        free = torch.tensor([torch.cuda.mem_get_info(device)[0]], dtype=torch.float64, device=device)
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
        budget = int(free.item())
    else:
        parser.error("--strategy auto on CPU ranks needs --mem-budget (e.g. --mem-budget 2GB): "
                     "the bytes each rank may use")
    try:
        rungs = advise(args.model, budget, world_size, args.seq_len, args.batch_size, args.precision)
    except ValueError as e:
        parser.error(f"--strategy auto: {e}")
    chosen = rungs[-1]
    if not chosen.fits:
        parser.error(f"--strategy auto: model {args.model} does not fit in {human_bytes(budget)} per "
                     f"rank on any rung (QLoRA needs {human_bytes(chosen.held['total'])}): more ranks, "
                     f"a smaller --seq-len or --model")
    if "--lora" in chosen.flags and not args.init_from:
        parser.error(f"--strategy auto: model {args.model} fits in {human_bytes(budget)} per rank "
                     f"only as {chosen.rung}, which fine-tunes a trained model: add --init-from RUN_DIR")
    return ["--strategy", chosen.strategy, "--grad-accum", str(chosen.grad_accum), *chosen.flags]
