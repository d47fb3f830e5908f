"""What a built strategy sends per step, by the ring formula.

These are the numbers the run's log prints beside the bytes its Comm counted:
"sent 3.34 MiB/step (ring formula 3.34)".

The concept files run the algorithm and their Comm counts what goes on the wire; the formula for
what should go is napkin math, kept here so that no step computes its own bookkeeping. Each
function reads a built wrapper's buckets, shards or stages (never runs it) and applies the
lecture's rule: a ring all-reduce sends 2(N-1)/N of a buffer, a reduce-scatter or an all-gather
(N-1)/N (foundations/comm.py: ring_bytes).
Test: python -m pytest tests/test_ddp.py tests/test_zero.py tests/test_pipeline.py
"""
import itertools
import math

import torch
import torch.nn as nn

from context_parallel import cp_kv_bytes
from foundations.comm import ring_bytes
from foundations.dtypes import master_dtype
from foundations.flat import flags_and_norm_bytes
from tensor_parallel import RowParallelLinear


# ---- data parallelism: ddp.py -------------------------------------------------------------------

def ddp_bytes_per_step(ddp) -> int:
    """Bytes a ddp.DDP rank sends per synchronised step, as the ring schedule sends them.

    Each bucket's all-reduce sends 2(N-1)/N of it (padded to N equal chunks) in the reduce dtype.
    The used-flags add one byte a parameter, one all-reduce per run of buckets on one group.
    In all, about twice the gradients' bytes, nearly independent of N."""
    grads = sum(ring_bytes("all_reduce", b.grad_flat.numel(),
                           (ddp.reduce_dtype or b.grad_flat.dtype).itemsize, b.comm.world_size)
                for b in ddp.buckets)
    flags = sum(ring_bytes("all_reduce", sum(len(b.params) for b in run), 1, group.world_size)
                for group, run in itertools.groupby(ddp.buckets, key=lambda b: b.comm))
    return grads + flags


# ---- ZeRO stages 1 and 2: zero.py ---------------------------------------------------------------

def zero_bytes_per_step(optimizer, micro_batches: int = 1) -> int:
    """Bytes a ZeRO optimizer (zero.py's, either stage) sends per step, by the ring formula.

    Each bucket's reduce-scatter and all-gather send (N-1)/N of it each: DDP's 2(N-1)/N, when
    the gradients and the parameters share one dtype. Stage 1 reduce-scatters once a step,
    stage 2 once per micro-batch. Beside them go the used-flags and the norm's one number.
    A mesh's optimizer over ZeRO parts (composition/mesh_optimizer.py, its .parts) sends the
    parts' sum, the norm counted once: it is all-reduced over the first part's group only.
    """
    parts = getattr(optimizer, "parts", [optimizer])
    norm = parts[0].masters[0].element_size()
    return sum(_zero_part_bytes(part, micro_batches) for part in parts) - sum(
        ring_bytes("all_reduce", 1, norm, part.comm.world_size) for part in parts[1:])


def _zero_part_bytes(optimizer, micro_batches: int) -> int:
    reductions, n = micro_batches if optimizer.stage == 2 else 1, optimizer.comm.world_size
    sent = optimizer.buckets.flags_and_norm_bytes()
    for bucket in optimizer.buckets:
        wire = (optimizer.reduce_dtype or bucket.flat.dtype).itemsize     # the gradients' bytes
        sent += reductions * ring_bytes("reduce_scatter", bucket.flat.numel(), wire, n)
        sent += ring_bytes("all_gather", bucket.flat.numel(), bucket.flat.element_size(), n)
    return sent



# ---- FSDP: fsdp.py, extensions/fsdp_hybrid.py, extensions/fsdp_frozen.py ----------------------

def fsdp_bytes_per_step(fsdp, micro_batches: int = 1, gathered_for_step: bool = False) -> int:
    """Bytes this rank of a built fsdp.FSDP sends per step (ring): each unit's all-gathers, and
    per micro-batch one reduce-scatter per unit; plus the used-flags and FSDPOptimizer's norm
    (foundations/flat.py's flags_and_norm_bytes). 3 (N-1)/N of the model: 1.5x DDP.
    gathered_for_step (a pipeline's step): one all-gather and one reduce-scatter per unit for
    all the micro-batches, 2 (N-1)/N of the stage, DDP's volume. HSDP adds its copies'
    all-reduces, a frozen base its own all-gathers."""
    size, wire = fsdp.compute_dtype.itemsize, fsdp.reduce_dtype.itemsize    # gathered, reduced
    reductions = 1 if gathered_for_step else micro_batches

    def gathers(unit) -> int:     # forward and backward each gather a unit; the root stays
        return 1 if gathered_for_step else micro_batches * (1 if unit in fsdp.root_units else 2)
    sent = sum(gathers(u) * ring_bytes("all_gather", u.flat.numel(), size, u.comm.world_size)
               + reductions * ring_bytes("reduce_scatter", u.flat.numel(), wire, u.comm.world_size)
               for u in fsdp.units) + flags_and_norm_bytes(fsdp.units, fsdp.comm)
    return sent + _hsdp_copies_bytes(fsdp, reductions) + sum(
        gathers(u) * ring_bytes("all_gather", u.frozen.flat.numel(), 1, u.comm.world_size)
        for u in fsdp.root_units + fsdp.forward_order if getattr(u, "frozen", None) is not None)


def _hsdp_copies_bytes(fsdp, reductions: int) -> int:
    """HSDP's (extensions/fsdp_hybrid.py) copies' all-reduce of each reduced shard, of the
    used-flags, and, where some units are not copied (experts), of the norm's squares."""
    replicas = getattr(fsdp, "replicas", None)            # HSDP's copies of each shard
    if replicas is None:
        return 0
    copies, wire = replicas.world_size, fsdp.reduce_dtype.itemsize
    copied = [u for u in fsdp.units if u.replicas is not None]
    shards = reductions * sum(ring_bytes("all_reduce", u.shard_numel, wire, copies)
                              for u in copied)
    flags = ring_bytes("all_reduce", sum(len(u.params) for u in copied), 1, copies)
    size = master_dtype(fsdp.compute_dtype).itemsize             # the norm's: fp32 or fp64
    norm = ring_bytes("all_reduce", 1, size, copies) if len(copied) < len(fsdp.units) else 0
    return shards + flags + norm


# ---- pipeline parallelism: pipeline.py ----------------------------------------------------------

def pipeline_bytes_per_step(pipeline, batch: int, seq_len: int) -> int:
    """Bytes one stage of a built pipeline.Pipeline sends per step, for batch rows of seq_len
    tokens.

    Each send in the stage's list carries one activation or gradient, of the shape `activation`
    gives. Under 1F1B a stage sends M forward unless it is the last, M back unless it is the
    first; interleaved sends v times as many. The gradient norm's all-reduce sends one number.
    The two ends of a tied weight all-reduce its gradient (a frozen one has none)."""
    shape = pipeline.activation(batch // pipeline.M, seq_len)                   # (b, T, C)
    message = math.prod(shape) * torch.finfo(pipeline.dtype).bits // 8
    sends = sum(a.kind.startswith("send") for a in pipeline.actions)
    wide = master_dtype(pipeline.dtype).itemsize                                # fp32 or fp64
    norm = ring_bytes("all_reduce", 1, wide, pipeline.P)
    tied = pipeline.tied
    trained = tied is not None and tied.requires_grad
    ends = ring_bytes("all_reduce", tied.numel(), tied.element_size(), 2) if trained else 0
    return message * sends + norm + ends



# ---- tensor and context parallelism -------------------------------------------------------------


def tp_bytes_per_step(tp, batch: int, seq_len: int, micro_batches: int = 1) -> int:
    """Bytes a rank of a TensorParallelGPT sends per step for the activations (ring formula).

    batch is the rows per rank; seq_len their tokens (its own, under context parallelism).
    Each split sublayer (attention, and model.py's MLP) sends 1 all-reduce forward and 1 backward
    of (B, T, C). The embedding and the head send one each.
    With sequence parallelism each all-reduce is a reduce-scatter + all-gather of the same volume.
    The loss adds 3 x M fp32 numbers, and the gradient norm one.
    The partial gradients add one all-reduce a step, or, summed in backward, one per weight and
    micro-batch. A pipeline stage (pipeline.GPTStage) counts its own blocks, and the embedding
    or head if it has them.
    """
    gpt, n = tp.gpt, tp.comm.world_size
    # Each split sublayer ends in one row layer: its g (attention's output, the MLP's down).
    sublayers = sum(isinstance(m, RowParallelLinear) for m in gpt.modules())
    # A Llama (pretrained/llama.py) embeds no positions: its first stage holds the token
    # embedding alone (on a later stage, pos_emb is the None pipeline.GPTStage sets).
    embeddings = (gpt.token_emb, getattr(gpt, "pos_emb", gpt.token_emb))
    first, last = embeddings[1] is not None, gpt.head is not None
    # With the embeddings frozen (LoRA) nothing before the first block needs its input's
    # gradient: autograd never computes it, nor the first sublayer's backward all-reduce.
    skipped = first and not any(e.weight.requires_grad for e in embeddings)
    size = next(gpt.parameters()).element_size()
    m = batch // micro_batches * seq_len
    activations = ring_bytes("all_reduce", m * gpt.cfg.n_embd, size, n)
    per_micro = (2 * sublayers + first + last - skipped) * activations
    wide = max(size, 4)          # the loss's and the norm's values: fp32, or an fp64 model's
    per_micro += 3 * ring_bytes("all_reduce", m, wide, n) if last else 0
    held = {id(p) for p in gpt.parameters()}        # a pipeline stage's: its own parts only
    partial = [p.numel() for p in tp.partial if id(p) in held]
    sync = (micro_batches * sum(ring_bytes("all_reduce", numel, size, n) for numel in partial)
            if tp.summed_in_backward else ring_bytes("all_reduce", sum(partial), size, n))
    return micro_batches * per_micro + sync + ring_bytes("all_reduce", 1, wide, n)


def cp_kv_bytes_per_step(cp, batch: int, seq_len: int, micro_batches: int = 1,
                         recomputed: int = 0) -> int:
    """K/V bytes a rank of a ContextParallelGPT sends per step: cp_kv_bytes, every layer's.

    batch is the rows per rank, split into micro_batches.
    recomputed is the checkpointed blocks, whose forward runs again in backward.
    A pipeline stage counts its own blocks; a tensor-parallel rank its own heads' K/V (a
    Llama's: its grouped key/value heads, G x D wide, not H x D).
    """
    cfg = cp.gpt.cfg
    blocks = [block for block in cp.gpt.blocks if not isinstance(block, nn.Identity)]
    attn = blocks[0].attn
    if hasattr(cfg, "n_kv_head"):      # a Llama's G key/value heads, G/tp on a tensor rank
        tp = getattr(getattr(attn.key, "comm", None), "world_size", 1)
        hidden = cfg.n_kv_head * cfg.D // tp                            # G x D, or G x D/tp
    else:
        hidden = cfg.n_embd * attn.n_head // cfg.n_head                 # C, or C/tp
    layer = cp_kv_bytes(seq_len, batch // micro_batches, hidden, cp.comm.world_size,
                        cp.attention, blocks[0].norm1.weight.element_size())
    return micro_batches * (len(blocks) * (layer["forward"] + layer["backward"])
                            + recomputed * layer["forward"])
