"""napkin/memory_math.py: napkin math, the bytes each rank holds and sends, by strategy and precision.

Per parameter a rank may hold three things (the parameter, its gradient, the optimizer's
state); each strategy keeps each of them whole or as a 1/N shard, and the collectives that
keep the shards in step move a predictable volume (Rajbhandari et al. 2020, "ZeRO", section 3,
figure 1; activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4). A mixture of experts (moe.py) computes with top_k of its E
MLPs per token; under expert parallelism a rank holds E/ep of them and adds the all-to-alls.
Hybrid sharding (--shard-group S) holds zero3 over S ranks and all-reduces each shard across copies.
held_bytes() measures the same three on a live rank. Left out: transient buffers (FSDP's
gathered unit, the fp32 gradient inside a mixed-precision step), fragmentation, the CUDA context.
The command line that prints these formulas as tables: napkin/memory.py.
Test: python -m pytest tests/test_memory.py (context parallelism's: tests/test_context_parallel.py)

Shapes: P parameters, N world size, c = ceil(P / N) elements per shard; activations: s sequence,
b micro-batch per rank, h hidden (n_embd), a heads, L layers, V vocabulary; experts: t = sb
tokens on a rank, E experts per layer, k of them per token, split over ep ranks.
"""
import gc

import torch

from foundations.comm import ring_bytes
from context_parallel import cp_kv_bytes
from mixed_precision import DTYPES
from model import PRESETS, Block, GPTConfig
from moe import expert_capacity, layer_exchange_bytes
from mechanics.pipeline_mechanics import split_layers
from foundations.placements import placement
from pretrained.streamed import own_modules
from quantization import BLOCK, LEVELS, NF4Weight
from extensions.schedules import make_schedule

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ALIASES = {"fsdp": "zero3"}            # FSDP is ZeRO stage 3, sharded unit by unit
PRECISIONS = tuple(DTYPES)             # fp32, bf16, fp16, fp64
OPTIMIZERS = ("adamw", "sgd")

# Which of the three a rank holds as a 1/N shard (True) or whole (False): docs/design.md's table,
# and the four bars of the ZeRO paper's figure 1 (baseline, P_os, P_os+g, P_os+g+p).
#                 params  grads  optimizer
SHARDED = {"ddp": (False, False, False),
           "zero1": (False, False, True),
           "zero2": (False, True, True),
           "zero3": (True, True, True)}
# ... and the collectives that keep them in step (comm_bytes counts their bytes).
COLLECTIVES = {"ddp": "all-reduce grads",
               "zero1": "reduce-scatter grads + all-gather params",
               "zero2": "reduce-scatter grads + all-gather params",
               "zero3": "all-gather fwd + all-gather bwd + reduce-scatter grads"}


def _strategy(strategy: str, world_size: int) -> str:
    """The canonical name: fsdp -> zero3, single -> ddp on one rank (and checked to be one)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if strategy == "single":
        if world_size != 1:
            raise ValueError(f"strategy 'single' runs on one rank, got world_size={world_size}: "
                             f"use 'ddp' (or a zero stage) for {world_size} ranks")
        return "ddp"
    strategy = ALIASES.get(strategy, strategy)
    if strategy not in SHARDED:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of "
                         f"{', '.join(STRATEGIES + tuple(ALIASES) + ('single',))}")
    return strategy


def _element_size(precision: str) -> int:
    if precision not in DTYPES:
        raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    return torch.finfo(DTYPES[precision]).bits // 8


# ---- training state: parameters, gradients, optimizer ----------------------------------------

def bytes_per_param(precision: str, optimizer: str = "adamw") -> dict:
    """Bytes per parameter of each of the three, before any sharding.

    The gradient has the parameter's dtype (backward produces it there). The optimizer works
    in fp32: in fp32 training the parameter is its own master copy, so Adam adds only its two
    moments (8 bytes); in 16-bit training it also needs an fp32 master copy, because a 16-bit
    weight cannot absorb an update smaller than its rounding step (4 + 4 + 4 = 12, the ZeRO
    paper's K). Plain SGD without momentum keeps no state: only the 16-bit case's master.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    size = _element_size(precision)
    master = 0 if size >= 4 else 4                     # fp32 (and fp64): its own master
    moments = 2 * max(size, 4) if optimizer == "adamw" else 0
    return {"params": size, "grads": size, "optimizer": master + moments}


def nf4_bytes(numel: int, double_quant: bool = False) -> int:
    """A 4-bit NormalFloat weight (quantization.py): half a byte per value, plus one fp32 scale
    per 64 values, or with double quantization one int8 scale per 64 and an fp32 per 256 of those."""
    blocks = -(-numel // 64)
    scales = blocks + 4 * -(-blocks // 256) if double_quant else 4 * blocks
    return -(-numel // 2) + scales


def state_bytes(n_params: int, strategy: str, precision: str, world_size: int,
                optimizer: str = "adamw", trainable: int | None = None, quantized: int = 0,
                double_quant: bool = False, offload: bool | str = False,
                reduce_precision: str | None = None) -> dict:
    """Bytes one rank holds in parameters, gradients and optimizer state, and their total.

    A sharded quantity is one padded shard, c = ceil(P / N) elements: the implementation pads
    the flat buffer to N equal shards so that every collective moves equal chunks. Under
    zero1 and zero2 the full parameters (and zero1's full gradients) are that padded flat
    buffer, N * c elements; ddp keeps unpadded per-parameter tensors, P elements.
    trainable: how many of the P parameters train (LoRA: the adapters). The frozen rest has no
    gradient and no optimizer state, and is held in the parameters' dtype, whole, or under
    zero3 one 1/N shard: the talk's "the model plus about 4x the trainable parameters".
    quantized: how many of the frozen ones are stored in NF4 (QLoRA), counted as one weight
    (each real matrix pads to 64 values), whole or (zero3) a 1/N shard of them.
    offload (ZeRO-Offload, zero1/zero2/zero3 only): the optimizer shard moves to host memory,
    and "host" counts it: fp32 master (fp32 training too: the CPU updates its own copy, the
    device keeps the parameters), moments, and an fp32 buffer the gradient shard lands in.
    offload="params" (zero3 only): the parameter shards (trained and frozen) move to the host
    too, visiting the device only for their all-gathers. "total" stays the device's bytes.
    reduce_precision (train.py's --reduce-dtype): the gradient shard as the strategies keep it
    after the reduce-scatter, zero2's in that dtype, zero3's in fp32 (fsdp.py upcasts after the
    wire), and zero3's 16-bit shards as fsdp.py keeps them (fp32, the masters); None: in the
    parameters' dtype, the table's simplification.
    """
    strategy = _strategy(strategy, world_size)
    if offload and strategy == "ddp":
        raise ValueError("offload moves a sharded optimizer to the host: use zero1, zero2 or "
                         "zero3/fsdp (ddp keeps a whole optimizer on every rank)")
    if offload == "params" and strategy != "zero3":
        raise ValueError("offload='params' moves parameter shards to the host: zero3/fsdp only")
    per_param = bytes_per_param(precision, optimizer)
    trainable = n_params if trainable is None else trainable
    shard = -(-trainable // world_size)                             # c = ceil(P / N)
    whole = trainable if strategy == "ddp" else shard * world_size  # P, or N * c (padded)
    frozen_size = per_param["params"]
    master = max(frozen_size, 4)                       # fp32 masters (fp64's own: 8 bytes)
    if reduce_precision is not None and strategy in ("zero2", "zero3"):
        per_param["grads"] = _element_size(reduce_precision) if strategy == "zero2" else master
    if reduce_precision is not None and strategy == "zero3" and frozen_size == 2 and not offload:
        # fsdp.py, as FSDP2: a trained shard stays fp32 and is itself the master (cast to the
        # compute dtype as it is gathered), so the optimizer holds only its moments. Offloaded,
        # the master moves to the host and the device keeps a 16-bit shard: the table's layout.
        per_param["optimizer"] -= 4
        per_param["params"] = 4
    held = {name: per_param[name] * (shard if sharded else whole)
            for name, sharded in zip(("params", "grads", "optimizer"), SHARDED[strategy])}
    frozen = n_params - trainable - quantized
    held["params"] += frozen_size * (-(-frozen // world_size) if SHARDED[strategy][0] else frozen)
    held["params"] += nf4_bytes(-(-quantized // world_size) if SHARDED[strategy][0] else quantized,
                                double_quant)
    held["total"] = sum(held.values())
    if offload:
        own = master * shard if per_param["params"] >= 4 else 0   # 16-bit: already in "optimizer"
        held["host"] = held["optimizer"] + own + master * shard
        held["total"] -= held["optimizer"]
        held["optimizer"] = 0
    if offload == "params":
        held["host"] += held["params"]
        held["total"] -= held["params"]
        held["params"] = 0
    if quantized:    # NF4's 16 levels: one fp32 table on the device, read by every 4-bit weight
        held["params"] += LEVELS.numel() * LEVELS.element_size()
        held["total"] += LEVELS.numel() * LEVELS.element_size()
    return held


# ---- communication --------------------------------------------------------------------------

def comm_bytes(n_params: int, strategy: str, precision: str, world_size: int,
               trainable: int | None = None, quantized: int = 0, double_quant: bool = False,
               shard_group: int | None = None, reduce_precision: str | None = None) -> dict:
    """Bytes one rank sends per optimizer step, by collective, with the ring algorithm.

    Keys are foundations/comm.py Comm's counter names, so a measured comm.bytes_sent compares
    directly. Gradients and gathered parameters travel in the parameters' dtype; the whole
    model is counted as one flat buffer padded to N equal chunks (real buckets and FSDP units
    pad each message separately, a few elements more; FSDP gathers its root unit once, not
    twice). single sends nothing. trainable, quantized, double_quant: as state_bytes. Only
    trainable parameters have gradients to reduce (and, under zero1/2, updates to gather);
    zero3 all-gathers the frozen ones too, a quantized weight as its packed NF4 bytes (4.5
    bits, fsdp_frozen.FrozenBytes). shard_group S (zero3, HSDP): all-gathers and reduce-scatter among
    S ranks, then each 1/S gradient shard all-reduced over the world / S copies. reduce_precision
    (train.py's --reduce-dtype, default: the parameters'): the dtype the gradients travel in.
    """
    if strategy == "single":
        _strategy(strategy, world_size)
        return {}
    strategy = _strategy(strategy, world_size)
    size, wire = _element_size(precision), _element_size(reduce_precision or precision)
    trainable = n_params if trainable is None else trainable
    S = shard_group or world_size
    if S != world_size and (strategy != "zero3" or S < 1 or world_size % S):
        raise ValueError(f"shard_group {S} is hybrid sharding: zero3/fsdp only, with a group size "
                         f"dividing world_size {world_size}")
    padded = -(-trainable // S) * S                                  # S * c (S = N unless HSDP)
    if strategy == "ddp":
        # Every rank needs the whole averaged gradient: one all-reduce, 2 (N-1)/N x its size.
        return {"all_reduce": ring_bytes("all_reduce", trainable, wire, world_size)}
    reduce_scatter = ring_bytes("reduce_scatter", padded, wire, S)
    if strategy in ("zero1", "zero2"):
        # Rank r needs only the averaged gradient of the shard it updates (reduce-scatter),
        # then everyone needs everyone's updated shard (all-gather). All-reduce is exactly
        # reduce-scatter + all-gather, so the optimizer-state savings cost no extra bytes.
        return {"reduce_scatter": reduce_scatter,
                "all_gather": ring_bytes("all_gather", padded, size, world_size)}
    # zero3 keeps no full parameters between uses: gather them for forward, gather them again
    # for backward, reduce-scatter the gradients. The update needs no gather (each rank owns
    # its shard), so the total is 3 (N-1)/N: 1.5 x an all-reduce. A 4-bit base goes as bytes.
    all_gather = (ring_bytes("all_gather", n_params - quantized, size, S)
                  + ring_bytes("all_gather", nf4_bytes(quantized, double_quant), 1, S))
    sent = {"all_gather": 2 * all_gather, "reduce_scatter": reduce_scatter}
    if S < world_size:               # HSDP: the shard's mean over the copies, 2 (G-1)/G of it
        sent["all_reduce"] = ring_bytes("all_reduce", padded // S, wire, world_size // S)
    return sent


# The lecture's bytes sent, as a multiple of DDP's all-reduce, with gradients and parameters in
# one dtype: ZeRO-1/2's reduce-scatter + all-gather move what the all-reduce moves; ZeRO-3 gathers
# the parameters twice (forward, backward) and reduce-scatters the gradients: 1.5x.
LECTURE_RATIO = {"zero1": 1.0, "zero2": 1.0, "zero3": 1.5}


def why_sent_departs(n_params: int, strategy: str, precision: str, world_size: int,
                     trainable: int | None = None, quantized: int = 0, double_quant: bool = False,
                     shard_group: int | None = None, reduce_precision: str | None = None,
                     sent: int | None = None, micro_batches: int = 1) -> str:
    """One clause saying why the bytes sent depart from the lecture's rule ("" where they do
    not). sent: the run's own formula for strategy (FSDP's gathers its root unit once; ZeRO-2
    and FSDP send for each of micro_batches), else comm_bytes'. DDP departs in bytes per
    parameter, the others in their multiple of DDP's."""
    canonical = _strategy(strategy, world_size)
    if world_size == 1:
        return ""
    size, wire = _element_size(precision), _element_size(reduce_precision or precision)
    kind = dict(trainable=trainable, quantized=quantized, double_quant=double_quant)
    upcast = (f"grads reduced in {reduce_precision}, params gathered in {precision} "
              f"(--reduce-dtype {precision}: one dtype, as the lecture)")
    if canonical == "ddp":
        return (f"; grads reduced in {reduce_precision}, {wire} bytes each (--reduce-dtype "
                f"{precision}: the lecture's {size})" if wire != size else "")
    ddp = sum(comm_bytes(n_params, "ddp", precision, world_size, **kind,
                         reduce_precision=reduce_precision).values())
    ours = sum(comm_bytes(n_params, canonical, precision, world_size, **kind,
                          shard_group=shard_group, reduce_precision=reduce_precision).values())
    ratio = (ours if sent is None else sent) / ddp
    if abs(ratio - LECTURE_RATIO[canonical]) < 0.005:
        return ""
    why = [upcast] if wire != size else []
    if micro_batches > 1 and canonical in ("zero2", "zero3"):
        why.append(f"{'ZeRO-2' if canonical == 'zero2' else 'FSDP'} reduce-scatters each of the "
                   f"{micro_batches} micro-batches' gradients (it keeps no whole one to add to)")
    if canonical == "zero3":
        if (trainable or n_params) < n_params:
            why.append("the frozen base is gathered but sends no gradient")
        if quantized:
            why.append("its 4-bit weights are gathered as packed bytes")
        if shard_group and shard_group < world_size:
            why.append(f"HSDP gathers within groups of {shard_group}")
        if sent is not None and sent < ours:
            why.append("the root unit (embeddings, head) is gathered once, not twice")
    why = why or ["the shards padded to equal sizes"]
    return (f"; {ratio:.2f}x ddp's, not the lecture's {LECTURE_RATIO[canonical]:g}x: "
            + "; ".join(why))


# ---- expert parallelism: experts over ep ranks, the rest over all -----------------------------

def ep_state_bytes(n_params: int, experts: int, strategy: str, precision: str, world_size: int,
                   ep: int, optimizer: str = "adamw", offload: bool | str = False,
                   shard_group: int | None = None, reduce_precision: str | None = None, **rest) -> dict:
    """state_bytes under expert parallelism (moe.py): `experts` of the n_params a rank holds are
    its E/ep experts of each MoE layer, kept (whole or sharded, as the strategy says) over the
    world_size / ep ranks holding the same ones; the others over all world_size ranks (HSDP:
    over its shard_group). rest: state_bytes' trainable, quantized and double_quant, which
    concern the others (LoRA never runs with split experts)."""
    held = state_bytes(n_params - experts, strategy, precision, shard_group or world_size, optimizer,
                       offload=offload, reduce_precision=reduce_precision, **rest)
    if experts:
        split = state_bytes(experts, strategy, precision, world_size // ep, optimizer, offload=offload,
                            reduce_precision=reduce_precision)
        held = {key: held[key] + split[key] for key in held}
    return held


def ep_comm_bytes(n_params: int, experts: int, strategy: str, precision: str, world_size: int,
                  ep: int, reduce_precision: str | None = None, **rest) -> dict:
    """comm_bytes under expert parallelism: the gradients (and under ZeRO and FSDP the parameters)
    of a rank's `experts` travel among the world_size / ep ranks holding the same ones (nowhere
    when ep is the world), the others' among all. The all-to-alls: moe_exchange_bytes. rest:
    comm_bytes' trainable, quantized, double_quant and shard_group, which concern the others."""
    sent = comm_bytes(n_params - experts, strategy, precision, world_size,
                      reduce_precision=reduce_precision, **rest)
    if experts:
        for name, value in comm_bytes(experts, strategy, precision, world_size // ep,
                                      reduce_precision=reduce_precision).items():
            sent[name] = sent.get(name, 0) + value
    return sent


def moe_exchange_bytes(cfg: GPTConfig, tokens: int, ep: int, precision: str,
                       micro_batches: int = 1) -> int:
    """All-to-all bytes a rank sends per step with the experts split over ep ranks: each MoE
    layer's four exchanges (moe.layer_exchange_bytes: the capacity buffer, or dropless an
    estimate for balanced routing) per micro-batch of `tokens` tokens. 0 for a dense model."""
    if not cfg.experts:
        return 0
    return micro_batches * cfg.n_layer * layer_exchange_bytes(
        tokens, cfg.n_embd, cfg.experts, cfg.top_k, cfg.capacity_factor, cfg.routing_group, ep,
        _element_size(precision))


# ---- activations ----------------------------------------------------------------------------

def activation_bytes(seq_len: int, batch: int, hidden: int, heads: int, layers: int = 1,
                     checkpointing: bool = False, bytes_per_value: int = 2,
                     moe: GPTConfig | None = None, ep: int = 1, tp: int = 1,
                     sequence_parallel: bool = False) -> int:
    """Bytes of activations kept for backward by `layers` transformer layers on one rank.

    Korthikanti et al., section 4.1, per layer, counting 16-bit values and 1-byte dropout masks:
        attention   11 sbh + 5 a s^2 b   (Q, K, V, the s x s scores, softmax, its dropout mask)
        MLP         19 sbh               (the 4h-wide GeLU input and output dominate)
        2 norms      4 sbh
        total       sbh (34 + 5 a s / h)
    Other activation dtypes scale everything by bytes_per_value / 2: napkin-accurate, since
    the masks (2 sbh + a s^2 b of it) stay 1 byte in reality. For this project's model it is
    an upper bound: dropout defaults to 0 (no masks) and a fused attention kernel recomputes
    the s x s scores in backward instead of keeping them (kept_activation_bytes counts what it
    does keep, train.py's prediction: 16 sbh values a block and a few fp32 ones a token).

    With activation checkpointing each layer keeps only its input, 2 sbh, and backward
    recomputes one layer's full activations at a time, so that one layer's worth is added
    once (the paper's "full activation recomputation").

    moe: the config of a model whose MLPs are mixtures of experts: each layer's MLP term is
    moe_mlp_bytes (its experts split over ep ranks) instead of 19 sbh.
    tp (dense only, section 4.2): sbh (10 + 24/tp + 5as/(h tp)), the norms' and the linear
    layers' whole inputs and two dropout masks (10 sbh) not split; with sequence parallelism
    those too: sbh (34 + 5as/h) / tp.
    """
    s, b, h, a = seq_len, batch, hidden, heads
    rest = 15 * s * b * h + 5 * a * s * s * b              # attention and the norms, 16-bit
    if tp > 1 and not (moe is not None and moe.experts):
        whole = 0 if sequence_parallel else 10 * s * b * h
        split = (34 * s * b * h - whole + 5 * a * s * s * b) // tp
        per_layer = (whole + split) * bytes_per_value // 2
        if checkpointing:
            kept_input = 2 * s * b * h // (tp if sequence_parallel else 1) * bytes_per_value // 2
            return layers * kept_input + per_layer
        return layers * per_layer
    if moe is not None and moe.experts:
        per_layer = rest * bytes_per_value // 2 + moe_mlp_bytes(s * b, moe, ep, bytes_per_value)
    else:
        per_layer = (rest + 19 * s * b * h) * bytes_per_value // 2    # sbh (34 + 5as/h)
    if checkpointing:
        return layers * 2 * s * b * h * bytes_per_value // 2 + per_layer
    return layers * per_layer


QKV = ("query", "key", "value")


def kept_activation_bytes(cfg: GPTConfig, seq_len: int, batch: int, bytes_per_value: int = 4,
                          checkpoint_every: int = 0, adapted=None, lora_rank: int = 8,
                          tp: int = 1, sequence_parallel: bool = False, ep: int = 1, cp: int = 1,
                          cp_attention: str = "ring", blocks: range | None = None,
                          head: bool = True) -> int:
    """Bytes model.py's GPT keeps for backward on one rank for a micro-batch of `batch` rows of
    seq_len tokens (t = sb): what autograd saves, op by op, each tensor once (what
    meters.saved_activation_bytes measures). activation_bytes is the lecture's rule; this is
    where our model departs from it. A block that trains everything keeps, in values of the
    compute dtype,
        norm1's input, its output (query, key and value's input)          2 th
        q, k, v and attention's output (the output projection's input)   4 th
        norm2's input, its output (the MLP's input)                        2 th
        the GeLU's input and output (4h wide each)                         8 th
    16 th, and in fp32 two norms' mean and 1/std (2t each) and the fused attention's log-sum-exp
    per head (a t): the lecture's 34 sbh at 2 bytes less its dropout masks (dropout 0 here), and
    none of its 5 a s^2 b (the fused kernel recomputes the scores in backward).
    checkpoint_every K: blocks 0, K, 2K ... (checkpointing.checkpoint_blocks) keep only their
    input, th. The block recomputed in backward holds its own full share meanwhile: a transient
    of backward's, not kept from forward (the lecture's "+ one layer" is that peak).
    adapted (LoRA, QLoRA: the --lora-targets' names; None: every weight trains): a frozen
    linear keeps no input (its weight needs no gradient, and the input's gradient needs only
    the weight), an adapted one keeps its input for A's gradient and tr for B's; a norm and the
    attention keep theirs only once a gradient flows through them (after the first adapter).
    tp (tensor_parallel.py): q, k, v, attention's output and the MLP's 4h halves on h/tp
    columns each; the norms' inputs and outputs whole, or under sequence parallelism their
    inputs on t/tp tokens (the column layers keep the all-gathered output, th). The loss over
    the split vocabulary keeps the softmax, 4 t V/tp bytes, instead of the log-probabilities.
    cp (context_parallel.py): every term at the rank's s/cp tokens; its attention returns heads
    first, so the output projection keeps a copy (th), and all-gather attention keeps the whole
    sequence's K and V where the ring keeps its own: 2 (cp - 1) th more.
    A mixture of experts' layer keeps moe_mlp_bytes in place of the MLP's (ep: its experts split).
    Around the blocks: the final norm's input (and output, if the head trains) and the loss's
    fp32 log-probabilities (logits_bytes). Left out: the int64 token ids and targets the
    embedding and loss keep (16 bytes a token) and dropout's masks (--dropout, --lora-dropout).
    A pipeline stage's chunk (pipeline_activation_bytes): `blocks`, the numbers of its blocks
    (None: all), whose input carries a gradient unless block 0's (a received activation does),
    and head: whether the final norm and the loss are its.
    A Llama-family config (pretrained/llama.py): kept_llama_bytes.
    """
    if _is_llama(cfg):
        return kept_llama_bytes(cfg, seq_len, batch, bytes_per_value, checkpoint_every, adapted,
                                lora_rank, tp, sequence_parallel, cp, blocks, head)
    e, C, a, V = bytes_per_value, cfg.n_embd, cfg.n_head, cfg.vocab_size
    seq_len //= cp
    t = seq_len * batch
    norm_t = t // tp if sequence_parallel else t              # tokens a norm sees on this rank
    trains = (lambda name: True) if adapted is None else (lambda name: name in adapted)
    adapter = lambda *names: sum(t * lora_rank * e for n in names if adapted and n in adapted)
    norm = norm_t * C * e + 2 * norm_t * 4                    # its input, fp32 mean and 1/std
    blocks = range(cfg.n_layer) if blocks is None else blocks
    # does a gradient flow into the residual stream yet? (a received activation's does)
    grad = adapted is None or blocks.start > 0
    kept = 0
    for i in blocks:
        block = 0
        block += norm if grad else 0
        block += t * C * e if any(map(trains, QKV)) else 0                        # norm1's output
        attention = grad or any(map(trains, QKV))
        block += 4 * t * C // tp * e + 4 * a // tp * t if attention else 0        # q k v out, lse
        block += t * C // tp * e if trains("output") and not attention else 0
        block += adapter(*QKV, "output")
        if cp > 1:
            block += t * C // tp * e if trains("output") else 0    # the heads-first output's copy
            gathered = attention and cp_attention == "allgather"
            block += 2 * (cp - 1) * t * C // tp * e if gathered else 0
        grad = attention or trains("output")
        block += norm if grad else 0
        if cfg.experts:
            block += moe_mlp_bytes(norm_t, cfg, ep, e)
        else:
            block += t * C * e if trains("up") else 0                              # norm2's output
            block += 4 * t * C // tp * e if grad or trains("up") else 0            # GeLU's input
            block += 4 * t * C // tp * e if trains("down") else 0                  # its output
            block += adapter("up", "down")
        grad = grad or cfg.experts or trains("up") or trains("down")
        kept += norm_t * C * e if checkpoint_every and i % checkpoint_every == 0 else block
    if not head:
        return kept
    kept += norm if grad else 0
    kept += t * C * e + adapter("head") if trains("head") else 0              # the head's input
    return kept + logits_bytes(seq_len, batch, V // tp)


def kept_llama_bytes(cfg, seq_len: int, batch: int, bytes_per_value: int = 4,
                     checkpoint_every: int = 0, adapted=None, lora_rank: int = 8, tp: int = 1,
                     sequence_parallel: bool = False, cp: int = 1, blocks: range | None = None,
                     head: bool = True) -> int:
    """kept_activation_bytes of a Llama-family model (pretrained/llama.py's LlamaBlock), op by op
    as autograd saves them on a CPU (t = sb tokens, e bytes a value, w = max(e, 4), H query and
    G key/value heads of D, F the MLP's width). A block that trains everything keeps
        RMSNorm, twice  its input in fp32 (or wider), tCw; 1/rms, tw; x/rms (the scale's
                        input), tCe; its output (the next linears' input), tCe
        rotary          cos and sin, T D/2 each, at the sequence's T positions: once in fp32,
                        where the rotation's cast returns the same tensor, in lower precision a
                        cast copy for q and another for k
        attention       rotated q and k (new tensors), v (the value linear's own output), the
                        fused attention's output and its fp32 log-sum-exp, t (2H + 2G) D e + 4 H t
        output's input  a copy of the attention's output in (B, T, H D), t H D e (the CPU's
                        fused attention returns (B, H, T, D) contiguous, as rotated q is)
        SwiGLU          gate's output g (silu's input), silu(g) and up's output (the product's
                        two inputs), the product (down's input): 4 t F e
    LoRA, QLoRA (adapted): frozen norms keep no x / rms; a frozen linear keeps no input (QLoRA's
    4-bit Function saves none either); an adapted one its input and t r e for B; an op keeps
    what the gradients flowing through it need (g and up's output once g carries one, silu(g)
    once up's output does), nothing before the first adapter. A checkpointed block
    (checkpoint_every) keeps its input, tCe. Around the blocks: the final norm, the head's
    input if it trains (tied or not), the loss's fp32 log-probabilities, its int64 targets (8t)
    and fp32 total weight (4 bytes), and the embedding's int64 token ids (8t) if it trains (tp:
    each with a bool mask, t, and no total weight).
    tp, sequence_parallel, cp: the heads, F and the vocabulary split over tp, the tokens over cp
    and the norms' over tp under sequence parallelism, as kept_activation_bytes splits a GPT's
    (ring attention's saves are the fused kernel's); all-gather attention's are not counted.
    """
    e, wide = bytes_per_value, max(bytes_per_value, 4)
    C, D, V = cfg.n_embd, cfg.D, cfg.vocab_size
    H, G, F = cfg.n_head // tp, cfg.n_kv_head // tp, cfg.hidden // tp
    seq_len //= cp
    t = seq_len * batch
    norm_t = t // tp if sequence_parallel else t              # tokens a norm sees on this rank
    full = adapted is None
    trains = (lambda name: True) if full else (lambda name: name in adapted)
    adapter = lambda *names: sum(t * lora_rank * e for n in names if not full and n in adapted)
    # its input in fp32 (or wider), 1 / rms, and x / rms once the scale trains
    norm = norm_t * C * wide + norm_t * wide + (norm_t * C * e if full else 0)
    # cos and sin for the rotations that carry a gradient: shared in fp32, one cast each else
    rotary = lambda n: (min(n, 1) if e == 4 else n) * seq_len * D * e
    blocks = range(cfg.n_layer) if blocks is None else blocks
    grad = full or blocks.start > 0
    # the token ids (tp: the rank's masked ids and the bool mask of those outside its rows)
    kept = (8 + (tp > 1)) * t if full and blocks.start == 0 else 0
    for i in blocks:
        block = norm if grad else 0
        block += t * C * e if any(map(trains, QKV)) else 0                        # norm1's output
        q, k, v = (grad or trains(name) for name in QKV)
        block += rotary(q + k)
        attention = q or k or v
        block += t * (2 * H + 2 * G) * D * e + 4 * H * t if attention else 0     # q k v out, lse
        block += t * H * D * e if trains("output") else 0           # the output's (B, T, H D)
        block += adapter(*QKV, "output")
        grad = attention or trains("output")
        block += norm if grad else 0
        block += t * C * e if trains("gate") or trains("up") else 0               # norm2's output
        gate, up = grad or trains("gate"), grad or trains("up")
        block += (2 * gate + up) * t * F * e                       # g and up's output, silu(g)
        block += t * F * e if trains("down") else 0                          # the product
        block += adapter("gate", "up", "down")
        grad = grad or gate or up or trains("down")
        kept += norm_t * C * e if checkpoint_every and i % checkpoint_every == 0 else block
    if not head:
        return kept
    kept += norm if grad else 0
    kept += t * C * e + adapter("head") if trains("head") else 0              # the head's input
    # the targets and cross_entropy's total weight (tp: the rank's targets and a bool mask)
    loss = 8 * t + (t if tp > 1 else 4)
    return kept + logits_bytes(seq_len, batch, V // tp) + loss


def moe_mlp_bytes(tokens: int, cfg: GPTConfig, ep: int = 1, bytes_per_value: int = 2) -> int:
    """Bytes one MoE layer (moe.py) keeps for backward on a rank's t = `tokens` tokens, in place
    of the dense MLP's 19 sbh; the same 16-bit accounting, with h = n_embd:
        input        2 th    the router's and the dispatch's input (the dense MLP's 2 sbh)
        router       8 tE    fp32 logits and softmax probabilities, whatever the dtype
        expert rows 19 Rh    each row an expert runs: its gathered input, the 4h-wide GeLU
                             input and output, the dropout mask (the dense MLP's 19 per token)
        assigned     4 Ah    each assignment's token gathered for dispatch and its expert's
                             output gathered back (for its gate's product)
    A: the k t assignments. R: the rows the experts run. Dropless, R = A on one rank (under
    expert parallelism what the routing sends a rank's experts, A when balanced). In capacity
    mode every expert runs on its whole static buffer of K slots in each of G routing groups,
    empty ones too (fixed shapes: the host never reads the routing), so R = E K G, about
    capacity_factor x k t, with or without expert parallelism; a dropped assignment is still
    gathered (its gate zeroed). Left out: a few int64 indices and fp32 gates per assignment
    (about 1% of the total at h = 128 in fp32).
    """
    E, k, h = cfg.experts, cfg.top_k, cfg.n_embd
    assigned = rows = k * tokens                            # A, R
    if cfg.capacity_factor is not None:
        group = cfg.routing_group or tokens
        rows = tokens // group * E * expert_capacity(group, E, k, cfg.capacity_factor)   # E K G
    return (2 * tokens + 19 * rows + 4 * assigned) * h * bytes_per_value // 2 + 8 * tokens * E


def pipeline_activation_bytes(cfg: GPTConfig, schedule: str, P: int, M: int, micro_batch: int,
                              seq_len: int, v: int = 1, bytes_per_value: int = 2,
                              kept: dict | None = None) -> list[int]:
    """Each pipeline stage's peak activation bytes under `schedule` (extensions/schedules.py's lists): walk
    the stage's list, each F adding its chunk's layers' activation_bytes for one micro-batch
    (and the logits, on the last chunk), each B freeing them (W, when the backward is split: an
    upper bound, since B frees all but the linear layers' inputs and output gradients).
    Blocks split as pipeline_mechanics.split_layers does: balanced over the P v chunks.
    kept (kept_activation_bytes' options, {} for none): each chunk's bytes as this project's
    model keeps them (train.py's prediction), instead of the lecture's rule; with checkpointing,
    each B's peak includes the largest block it recomputes, beside what the stage holds."""
    V = P * v
    if cfg.n_layer < V:
        raise ValueError(f"{cfg.n_layer} blocks, fewer than {V} chunks: every chunk needs a block")
    chunks = split_layers(cfg.n_layer, P, v=v)                                 # ranges of blocks
    layers = [len(chunk) for chunk in chunks]
    peaks = []
    for s, actions in enumerate(make_schedule(schedule, P, M, v)):
        release = "W" if any(a.kind == "W" for a in actions) else "B"
        held = peak = 0
        for a in actions:
            if a.kind in ("F", release):
                vs = a.chunk * P + s
                if kept is not None:
                    size = kept_activation_bytes(cfg, seq_len, micro_batch, bytes_per_value, **kept,
                                                 blocks=chunks[vs], head=vs == V - 1)
                else:
                    size = activation_bytes(seq_len, micro_batch, cfg.n_embd, cfg.n_head,
                                            layers[vs], bytes_per_value=bytes_per_value) + (
                        logits_bytes(seq_len, micro_batch, cfg.vocab_size) if vs == V - 1 else 0)
                if kept and kept.get("checkpoint_every") and a.kind == release:
                    # backward recomputes each checkpointed block: its share beside its input
                    recomputed = (_recomputed(cfg, seq_len, micro_batch, bytes_per_value, kept, i)
                                  for i in chunks[vs])
                    peak = max(peak, held + max(recomputed))
                held += size if a.kind == "F" else -size
                peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _recomputed(cfg, seq_len, micro_batch, bytes_per_value, kept: dict, block: int) -> int:
    """What recomputing `block` in backward adds to its checkpointed input (0: not checkpointed)."""
    if block % kept["checkpoint_every"]:
        return 0
    one = dict(kept, blocks=range(block, block + 1), head=False)
    full = kept_activation_bytes(cfg, seq_len, micro_batch, bytes_per_value,
                                 **dict(one, checkpoint_every=0))
    return full - kept_activation_bytes(cfg, seq_len, micro_batch, bytes_per_value, **one)


def cp_activation_bytes(seq_len: int, batch: int, hidden: int, heads: int, layers: int, cp: int,
                        attention: str = "ring", checkpointing: bool = False,
                        bytes_per_value: int = 2) -> int:
    """activation_bytes on one of cp context-parallel ranks (context_parallel.py): every term at
    its s/cp tokens, except two. Its queries' scores span every key, 5 a (s/cp) s b (an upper
    bound, as in activation_bytes: the ring keeps none). And all-gather attention keeps the whole
    sequence's K and V, 4 s b h, where the ring keeps its own 4 (s/cp) b h. So the sbh terms fall
    as 1/cp, the scores' as 1/cp too (s/cp rows of s), the all-gather's K/V not at all."""
    s, b, h, a = seq_len, batch, hidden, heads
    local = s // cp
    extra = 5 * a * local * (s - local) * b                 # scores: s keys per query, not s/cp
    if attention == "allgather":
        extra += 4 * (s - local) * b * h                    # the gathered K and V
    full_layers = 1 if checkpointing else layers            # checkpointed: one layer's, recomputed
    return (activation_bytes(local, b, h, a, layers, checkpointing, bytes_per_value)
            + full_layers * extra * bytes_per_value // 2)


def logits_bytes(seq_len: int, batch: int, vocab: int) -> int:
    """The loss keeps b x s x V fp32 log-probabilities for backward: 4 sbV bytes (section 4).

    Outside the per-layer formula, and at GPT-2's vocabulary as large as a couple of layers.
    """
    return 4 * seq_len * batch * vocab


# ---- parameter count ------------------------------------------------------------------------

def model_params(name_or_config) -> int:
    """Parameters of a preset name or a GPTConfig, in closed form (no model is built); of a
    Llama-family config (pretrained/llama.py), llama_params'.

    Per block (C = n_embd): query, value and output projections C*C + C each, key C*C (no
    bias: see model.py), MLP up C*4C + 4C and down 4C*C + C, two layer norms 2C each:
    12 C^2 + 12 C. With E experts (moe.py) the MLP's 8 C^2 + 5 C is there E times, plus the
    router's E C. Around the blocks: token and position embeddings, the final norm, and the
    head, which is the token embedding itself when tied (counted once, as .parameters() does).
    """
    if _is_llama(name_or_config):
        return llama_params(name_or_config)
    cfg = _config(name_or_config)
    return _shared_params(cfg) + expert_params(cfg)


def llama_params(cfg, tp: int = 1, blocks: int | None = None, first: bool = True,
                 last: bool = True) -> int:
    """Parameters of a Llama-family config (pretrained/llama.py) one rank of a tensor x pipeline
    mesh holds, as mesh_params. Per block: query and output H D C each, key and value G D C each
    (G grouped key/value heads), SwiGLU's gate, up and down 3 C F, two RMSNorms C each; the
    column layers (query, key, value, gate, up) and their biases split over tp, the row layers'
    biases (output, down) and the norms whole. No position embedding; the token embedding and
    an untied head split over the vocabulary; the final norm C."""
    C, V, D, H, G, F = (cfg.n_embd, cfg.vocab_size, cfg.D, cfg.n_head, cfg.n_kv_head,
                        cfg.hidden)
    qkv_bias = cfg.qkv_bias or cfg.output_bias
    split = ((2 * H + 2 * G) * D * C + 3 * C * F + qkv_bias * (H + 2 * G) * D
             + cfg.mlp_bias * 2 * F)
    block = split // tp + 2 * C + cfg.output_bias * C + cfg.mlp_bias * C
    embeddings = V * C // tp if first else 0
    head = 0 if cfg.tie_embeddings and first else V * C // tp
    return embeddings + (cfg.n_layer if blocks is None else blocks) * block + (
        C + head if last else 0)


def active_params(name_or_config) -> int:
    """Parameters one token computes with: a mixture of experts runs only top_k of its E MLPs
    (the rest of the model, router included, as model_params). A dense model: all of them."""
    cfg = _config(name_or_config)
    if not cfg.experts:
        return model_params(cfg)
    return _shared_params(cfg) + expert_params(cfg, cfg.top_k)


def expert_params(name_or_config, experts: int | None = None) -> int:
    """Parameters of the experts' MLPs over all blocks: every one of each MoE layer's E, or
    `experts` of them (a token's top_k; a rank's E/ep under expert parallelism). 0 if dense."""
    cfg = _config(name_or_config)
    if not cfg.experts:
        return 0
    C = cfg.n_embd
    return cfg.n_layer * (cfg.experts if experts is None else experts) * (8 * C * C + 5 * C)


def ep_params(name_or_config, ep: int = 1) -> tuple[int, int]:
    """(parameters one rank holds, of which its experts) with each MoE layer's E experts split
    over ep ranks, E/ep on each; ep 1 splits nothing: (model_params, 0)."""
    cfg = _config(name_or_config)
    if ep == 1:
        return model_params(cfg), 0
    experts = expert_params(cfg, cfg.experts // ep)
    return _shared_params(cfg) + experts, experts


def root_params(name_or_config) -> int:
    """Parameters around the blocks (FSDP's root unit): token and position embeddings, the
    final norm, and the head unless it is the token embedding (tied). A Llama's: no position
    embedding, an RMSNorm of C (no bias)."""
    cfg = _config(name_or_config)
    C, V = cfg.n_embd, cfg.vocab_size
    if _is_llama(cfg):
        return V * C + C + (0 if cfg.tie_embeddings else V * C)
    return V * C + cfg.block_size * C + 2 * C + (0 if cfg.tie_embeddings else V * C)


def quantized_params(name_or_config) -> int:
    """Weights QLoRA stores in 4 bits (lora.QUANTIZED): every block's attention and MLP matrices,
    each expert's, 4 C^2 + 8 C^2 E (E = 1 dense). The embeddings, norms, biases, routers and the
    head stay in the compute dtype (the head unless LoRA adapts it). A Llama's block: query and
    output H D C each, key and value G D C each, SwiGLU's three C F."""
    cfg = _config(name_or_config)
    C = cfg.n_embd
    if _is_llama(cfg):
        return cfg.n_layer * ((2 * cfg.n_head + 2 * cfg.n_kv_head) * cfg.D * C + 3 * C * cfg.hidden)
    return cfg.n_layer * (4 * C * C + 8 * C * C * max(1, cfg.experts))


def _shared_params(cfg: GPTConfig) -> int:
    """Every parameter but the experts': an MoE block keeps its router (E C) instead of the MLP."""
    C = cfg.n_embd
    block = 4 * C * C + 7 * C + (cfg.experts * C if cfg.experts else 8 * C * C + 5 * C)
    return root_params(cfg) + cfg.n_layer * block


def _is_llama(cfg) -> bool:
    """A Llama-family config (pretrained/llama.py's LlamaConfig): grouped key/value heads."""
    return hasattr(cfg, "n_kv_head")


def _config(name_or_config) -> GPTConfig:
    """A preset's GPTConfig by name, or the config given: a GPTConfig or a Llama's."""
    cfg = name_or_config
    if isinstance(cfg, str):
        if cfg not in PRESETS:
            raise ValueError(f"unknown model {cfg!r}: choose one of {', '.join(PRESETS)}")
        cfg = PRESETS[cfg]
    if not isinstance(cfg, GPTConfig) and not _is_llama(cfg):
        raise TypeError(f"model_params takes a preset name, a GPTConfig or a LlamaConfig, got "
                        f"{type(cfg).__name__}")
    return cfg


def live_numel(gpt) -> tuple[int, int]:
    """(parameters, of which 4-bit) of a built model as this rank holds it: its slices or its
    stage. QLoRA's 4-bit weights are buffers, not parameters: counted by their shape."""
    quantized = sum(torch.Size(m.shape).numel() for m in gpt.modules() if isinstance(m, NF4Weight))
    return sum(p.numel() for p in gpt.parameters()) + quantized, quantized


def is_expert(p) -> bool:
    """Is parameter p one of the experts this rank holds under expert parallelism (moe.py)?"""
    return "ep" in placement(p).shard


def run_state_bytes(gpt, strategy: str, options, world_size: int, n_params: int | None = None,
                    shard_group: int | None = None) -> dict:
    """state_bytes of a built model under train.py's options (--precision, --double-quant,
    --offload): the parameters this rank holds, of which those that train, over world_size
    data-parallel ranks (HSDP: over its shard_group). n_params: count that many instead (tp:
    whole-matrix slices in closed form). Each strategy's build() calls it: the prediction
    train.py logs beside the measure. Under expert parallelism (--ep) this rank's experts are
    held over the world / ep ranks that hold the same ones, the rest as said: two predictions,
    added."""
    numel, quantized = live_numel(gpt)
    experts = sum(p.numel() for p in gpt.parameters() if is_expert(p))
    trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad) - experts
    return ep_state_bytes(numel if n_params is None else n_params, experts, strategy,
                          options.precision, world_size, options.ep, shard_group=shard_group,
                          trainable=trainable,
                          quantized=quantized, double_quant=options.double_quant,
                          offload=options.offload or False,
                          reduce_precision=getattr(options, "reduce_dtype", None))


def mesh_params(name_or_config, tp: int = 1, blocks: int | None = None, first: bool = True,
                last: bool = True) -> int:
    """Parameters one rank of a tensor x pipeline mesh holds (tensor_parallel.py, pipeline.py),
    in closed form: its stage's blocks (None: all of them), each split over the tp ranks, and
    the first stage's embeddings, the last stage's final norm and head.

    Every matrix of a block is split over the tp ranks, and so are the column layers' biases
    (query, value, MLP up: 6C); the row layers' biases (2C) and the norms (4C) stay whole:
    12 C^2 / tp + 6C / tp + 6C per block. Token embedding and head are split over the
    vocabulary; positions and the final norm are whole. A head tied to the token embedding
    is a copy of it on a last stage that is not also the first. tp=1, all blocks: model_params.
    """
    cfg = PRESETS[name_or_config] if isinstance(name_or_config, str) else name_or_config
    if _is_llama(cfg):                                     # a Llama's (pretrained/llama.py)
        return llama_params(cfg, tp, blocks, first, last)
    C, V = cfg.n_embd, cfg.vocab_size
    block = (12 * C * C + 6 * C) // tp + 6 * C
    embeddings = V * C // tp + cfg.block_size * C if first else 0
    head = 0 if cfg.tie_embeddings and first else V * C // tp
    return embeddings + (cfg.n_layer if blocks is None else blocks) * block + (2 * C + head if last else 0)


def stage_blocks(n_layer: int, pp: int, stage: int, virtual_stages: int = 1) -> int:
    """Blocks pipeline stage `stage` holds under the balanced split (pipeline_mechanics.split_layers)."""
    return sum(len(chunk) for chunk in split_layers(n_layer, pp, v=virtual_stages)[stage::pp])


def mesh_bytes(name_or_config, batch: int, seq_len: int, tp: int = 1, cp: int = 1, pp: int = 1,
               dp: int = 1, micro_batches: int = 1, precision: str = "fp32", stage: int = 0,
               schedule: str = "1f1b", virtual_stages: int = 1, attention: str = "ring",
               strategy: str = "ddp", shard_group: int | None = None,
               sequence_parallel: bool = False, reduce_precision: str | None = None) -> dict:
    """Bytes one rank of a tp x cp x pp x dp mesh (composition/parallelize.py) sends per step, by
    dimension, in closed form, for pipeline stage `stage` (the balanced split of the blocks):
    batch rows per data-parallel rank (B/D), seq_len tokens per whole sequence, micro_batches
    per step (--grad-accum, or a pipeline's --microbatches). A dimension of size 1 sends nothing.

    tp: per micro-batch, two all-reduces of the (m, C) activations per block forward and two
    backward, one for the embedding (first stage) and one for the head (last), 3 of m fp32 for
    the vocabulary-parallel loss (last stage), m = its tokens; one fp32 for the norm (these
    fp32 values an fp64 model's own: 8 bytes). With
    sequence_parallel each all-reduce is a reduce-scatter and an all-gather of the same volume,
    and the weights that stay whole (norms, row biases, positions: their gradients partial sums)
    are all-reduced once a step (zero2, zero3 or beside cp: every micro-batch).
    cp: cp_kv_bytes per block and micro-batch, K and V C/tp wide (a Llama's G D/tp).
    pp: one (b, T/cp, C) activation or gradient per send in the stage's schedule (sequence
    parallel: T/cp/tp), a norm fp32 (fp64's own); at the two ends of a tied head, the tied
    weight's gradient (V C / tp) summed between them, one all-reduce of 2 ranks.
    dp: comm_bytes of this rank's parameters (mesh_params) over dp x cp ranks, in the padding-free
    napkin form (real buckets pad each message to dp x cp chunks: a few elements more); ZeRO-2
    reduce-scatters every micro-batch; zero3 in a pipeline gathers once a step (2 (N-1)/N);
    shard_group (zero3): HSDP's groups inside dp x cp; reduce_precision: the gradients' dtype
    on the wire (comm_bytes').
    """
    cfg = _config(name_or_config)
    size, C = _element_size(precision), cfg.n_embd
    wide = max(size, 4)                  # the loss's and the norm's values: fp32, or fp64's own
    chunks = make_schedule(schedule, pp, micro_batches, virtual_stages)[stage] if pp > 1 else []
    blocks = stage_blocks(cfg.n_layer, pp, stage, virtual_stages)
    first, last = stage == 0, stage == pp - 1
    m = batch // micro_batches * seq_len // cp                     # a micro-batch's tokens here
    sent = {}
    if tp > 1:
        activations = (4 * blocks + first + last) * ring_bytes("all_reduce", m * C, size, tp)
        loss = 3 * ring_bytes("all_reduce", m, wide, tp) if last else 0
        sent["tp"] = micro_batches * (activations + loss) + ring_bytes("all_reduce", 1, wide, tp)
        if sequence_parallel:               # 6C a block (mesh_params), positions, final norm
            whole = 6 * C * blocks + (cfg.block_size * C if first else 0) + (2 * C if last else 0)
            if _is_llama(cfg):              # two RMSNorms (and row biases) a block, final norm
                row_biases = (cfg.output_bias + cfg.mlp_bias) * C
                whole = (2 * C + row_biases) * blocks + (C if last else 0)
            # ZeRO-2 and FSDP read gradients during backward, and context parallelism wraps the
            # tensor-parallel model: summed in backward there, every micro-batch
            # (TensorParallelGPT.sum_partial_in_backward; C divides by tp, so no padding), unless
            # a zero-bubble pipeline holds the backwards' reductions: once, at its finish
            zb = pp > 1 and schedule == "zb"
            times = micro_batches if (strategy in ("zero2", "zero3") or cp > 1) and not zb else 1
            sent["tp"] += times * ring_bytes("all_reduce", whole, size, tp)
    if cp > 1:
        kv = cfg.n_kv_head * cfg.D if _is_llama(cfg) else C    # a Llama's G heads, G x D
        layer = cp_kv_bytes(seq_len, batch // micro_batches, kv // tp, cp, attention, size)
        sent["cp"] = micro_batches * blocks * (layer["forward"] + layer["backward"])
    if pp > 1:
        sends = sum(action.kind.startswith("send") for action in chunks)
        sent["pp"] = (sends * (m // tp if sequence_parallel else m) * C * size
                      + ring_bytes("all_reduce", 1, wide, pp))
        if cfg.tie_embeddings and (first or last):          # pipeline.Pipeline's ends group
            sent["pp"] += ring_bytes("all_reduce", cfg.vocab_size * C // tp, size, 2)
    if dp * cp > 1:
        n_params = mesh_params(cfg, tp, blocks, first, last)
        sent["dp"] = sum(comm_bytes(n_params, strategy, precision, dp * cp, shard_group=shard_group,
                                    reduce_precision=reduce_precision).values())
        # ZeRO-2 reduce-scatters every backward (a micro-batch's, or a chunk's of one), unless it
        # waits for a tied head's sum (the ends) or zb's W: once a step then
        waits = pp > 1 and (schedule == "zb" or cfg.tie_embeddings and (first or last))
        if strategy == "zero2" and not waits:           # one per backward: per chunk interleaved
            sent["dp"] += (micro_batches * virtual_stages - 1) * ring_bytes(
                "reduce_scatter", n_params, _element_size(reduce_precision or precision), dp * cp)
        if strategy == "zero3" and pp > 1:    # gathered once for the step's micro-batches, not
            # once for forward and again for backward (fsdp.FSDP.gathered_for_step)
            sent["dp"] -= ring_bytes("all_gather", n_params, size, shard_group or dp * cp)
    return sent


# ---- measured on a live rank -----------------------------------------------------------------


def held_bytes(model, optimizer) -> dict:
    """Measured: bytes this rank holds in parameters, gradients and optimizer state.

    Each storage counts once, whole: ZeRO's parameters are views of padded flat buffers and
    its fp32 master shards (fp32 training) views of those. The optimizer side counts fp32
    master copies and Adam's moments; DDP's and ZeRO's gradient buffers count as gradients.
    An offloading optimizer's host tensors count under "host" (a key only it adds), first.
    """
    seen = set()

    def total(tensors):
        count = 0
        for t in tensors:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                count += t.untyped_storage().nbytes()
        return count

    host = getattr(optimizer, "host_tensors", list)()
    host = {"host": total(host)} if host else {}
    # The wrappers, outermost first: a pipeline's DDP, DDP's tensor-parallel GPT, FSDP's module
    # (its frozen weights empty between uses: FSDP's device_shards hold their bytes), each with
    # what it holds itself.
    wrappers = [model]
    while hasattr(wrappers[-1], "module"):
        wrappers.append(wrappers[-1].module)
    modules = [w for w in wrappers if hasattr(w, "parameters")]        # a pipeline has none
    params = [*(p for m in modules for p in m.parameters()),
              *(t for w in wrappers for t in getattr(w, "device_shards", list)())]
    buffers = [*(t for w in (*wrappers, optimizer) for t in getattr(w, "gradient_buffers", list)())]
    return {"params": total(params + [b for m in modules for b in m.buffers()]),   # QLoRA's 4-bit
            "grads": total([p.grad for p in params + optimizer.masters] + buffers),
            "optimizer": total(optimizer.state_tensors()), **host}        # fp32 masters, moments


def live_tensor_bytes() -> int:
    """Measured: bytes of every CPU tensor storage alive in this process, each counted once.

    The CPU's stand-in for torch.cuda.memory_allocated(): whatever a strategy forgot to free
    (a gradient buffer, a handle holding its output, a graph kept by a logged loss) shows here.
    """
    gc.collect()      # garbage in reference cycles is not alive, only not yet collected
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which some module proxies warn on
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# ---- units -----------------------------------------------------------------------------------

GB, MiB = 1e9, 2**20    # GB as in the ZeRO paper; MiB as train.py logs what it measures


def human_bytes(n: float) -> str:
    """n bytes in a unit that shows them: GB (1e9, the ZeRO paper's) from 1 GB up, below that MiB
    or KiB (2**20, 2**10, as train.py logs), under 1 KiB bytes."""
    for unit, size in (("GB", GB), ("MiB", MiB), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} bytes"


def load_peak_bytes(gpt, options, world_size: int) -> int:
    """At most the bytes a rank holds while pretrained/streamed.py reads a Hugging Face model
    into its share unit by unit, from the built model gpt (options: --strategy, --precision,
    --tp; world_size: FSDP's shard group). LoRA's adapters are drawn whole before any unit is
    read. The units come in the layout's order: FSDP makes the root (all but the blocks) first,
    then each block; the others read each block, then the root (tensor parallelism: the
    embedding, then the head, then the rest). A unit is read in the dtype the run stores weights
    in (fp32 under FSDP, --precision otherwise), whole (W; a tensor split over tp counts tp
    times its slice). Beside the shares of the units before it, a unit holds
      - under FSDP: W, then the larger of its largest 4-bit matrix being quantized (Q) or its
        stored bytes S laid out whole and this rank's 1/N cut from them: W + max(Q, S (1 + 1/N));
      - under tensor parallelism: W and the slices of one layer being cut from it (each layer's
        whole weights let go as it is replaced; twice the slices for a row layer, whose columns
        are copied twice, and for a tied embedding, the head's rows cut from the table too);
        then, QLoRA, its slices in full precision and Q of the largest (lora.quantize_split);
      - otherwise, module by module: the modules read before (4-bit ones as their codes), one
        module as read and, if it is 4-bit, Q.
    Q: the temporaries of quantizing the matrix (_quantizing, 17.5 bytes a value at most, its
    fp32 copy first where it is held in 16 bits), and an adapted layer's adapters drawn again
    aside (lora.as_4_bit). Under tp x fsdp the slices are all made before FSDP makes its units:
    then each unit's S (1 + 1/N) beside them all."""
    fsdp = options.strategy in ("fsdp", "zero3")
    compute = _element_size(options.precision)
    stored = max(compute, 4) if fsdp else compute               # the hollow model's dtype
    tp = getattr(options, "tp", 1)
    blocks = [b for b in gpt.blocks if isinstance(b, Block)]
    if tp > 1:                        # a stage's dropped embedding or head: None, never read
        order = [*blocks, gpt.token_emb, gpt.head, gpt]
    else:
        order = [gpt, *blocks] if fsdp else [*blocks, gpt]
    # under tp the embedding and the head are units of their own (the head's 4-bit slice too)
    split_units = {m for u in (gpt.token_emb, gpt.head) if tp > 1 and u is not None
                   for m in u.modules()}
    seen, adapters, held, peak = set(), 0, 0, 0
    fsdp_units = {}          # tp x fsdp: FSDP's units (each block; the root, all the rest)
    for unit in (u for u in order if u is not None):
        modules = [m for m in own_modules(unit) if unit is not gpt or m not in split_units]
        weights, matrices, drawn = [], [], 0     # its tensors (a tied one once), 4-bit modules
        for m in modules:
            for name, p in m.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if name.startswith("lora_"):
                    drawn += stored * _whole(p, tp)
                else:
                    weights.append(p)
            matrices += [m] if isinstance(m, NF4Weight) else []
        adapters += drawn
        numels = [torch.Size(m.shape).numel() for m in matrices]
        # a 4-bit slice of a tensor-parallel layer (lora.quantize_split) was read whole
        cut = {id(m.base) for m in modules if hasattr(m, "local_product") and m.base is not None}
        nf4 = sum(nf4_bytes(n, m.double_quant) for n, m in zip(numels, matrices))
        read = stored * (sum(_whole(p, tp) for p in weights)                          # W
                         + sum(n * (tp if id(m) in cut else 1) for n, m in zip(numels, matrices)))
        # an adapted layer made 4-bit as read draws its adapters again aside (lora.as_4_bit)
        aside = {id(m.base): sum(a.numel() * a.element_size() for a in (m.lora_A, m.lora_B))
                 for m in modules if isinstance(getattr(m, "base", None), NF4Weight)
                 and hasattr(m, "lora_A") and not hasattr(m, "local_product")}
        quantizing = max((_quantizing(n, stored) + aside.get(id(m), 0)                # Q
                          for n, m in zip(numels, matrices)), default=0)
        own = nf4 + sum(p.numel() * p.element_size() for p in weights)      # as kept by it
        if fsdp and tp == 1:     # S: 4-bit, frozen in --precision, trained (adapters) in fp32
            S = own + drawn - sum(p.numel() * (p.element_size() - compute)
                                  for p in weights if not p.requires_grad)
            share = _ceil_div(S, world_size)
            peak = max(peak, held + read + max(quantizing, S + share))
        elif cut or any(_whole(p, tp) != p.numel() for p in weights):   # read whole, then split
            share = own
            slices = own - nf4 + stored * sum(numels)        # the 4-bit ones before quantizing
            if unit is gpt.head and gpt.cfg.tie_embeddings:  # the embedding's slice, read and held
                read = slices = 0
            # each layer's slices cut in turn, its whole weights let go as it is replaced: one
            # layer's slices beside the read, twice for a row layer (its columns made contiguous,
            # then copied) and a tied embedding (the head's rows cut from the whole table too)
            tied_table = gpt.cfg.tie_embeddings and unit is gpt.token_emb
            cutting = max((2 if getattr(m, "dim", 0) == 1 or tied_table else 1)
                          * (sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                             + (stored * torch.Size(m.base.shape).numel()
                                if id(getattr(m, "base", None)) in cut else 0))
                          for m in modules if hasattr(m, "local_product") or m is gpt.token_emb)
            peak = max(peak, held + read + cutting * bool(read),
                       held + slices + quantizing)           # each slice quantized in turn
        else:            # each module read, and quantized, in turn: its 4-bit codes kept
            share, kept, unread = own, 0, {id(p): p for p in weights}
            for m in modules:
                mine = [unread.pop(id(p)) for p in m.parameters(recurse=False) if id(p) in unread]
                got = sum(p.numel() * p.element_size() for p in mine)
                numel = torch.Size(m.shape).numel() if isinstance(m, NF4Weight) else 0
                peak = max(peak, held + kept + got + stored * numel + _quantizing(numel, stored)
                           + aside.get(id(m), 0))
                kept += got + (nf4_bytes(numel, m.double_quant) if numel else 0)
        key = unit if isinstance(unit, Block) else gpt
        fsdp_units[key] = fsdp_units.get(key, 0) + own + drawn
        held += share
    if fsdp and tp > 1:               # FSDP's units made after the split, each laid out whole
        peak = max(peak, held + max(S + _ceil_div(S, world_size) for S in fsdp_units.values()))
    return adapters + peak


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _quantizing(numel: int, element_size: int) -> int:
    """The temporaries of quantizing a numel-value matrix to NF4 (quantization.NF4Weight), P its
    values padded to blocks of 64: the padded and normalized copies (8 bytes a value of P); a
    16th of the blocks (rounded up) at a time, their distances to the 16 levels and those
    distances' magnitudes (2 x 64 bytes a value) and the nearest level's index (int64: 8); the
    codes (1); and the fp32 copy first where the matrix is held in 16 bits. 17.5 P at most."""
    if not numel:
        return 0
    blocks = _ceil_div(numel, BLOCK)
    padded, chunk = BLOCK * blocks, BLOCK * _ceil_div(blocks, 16)
    return 8 * padded + 136 * chunk + padded + (4 * numel if element_size != 4 else 0)


def _whole(p, tp: int) -> int:
    """p's elements whole: tp times its slice where tensor parallelism split it."""
    return p.numel() * (tp if placement(p).shard.get("tp") is not None else 1)
