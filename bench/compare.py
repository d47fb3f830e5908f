"""bench/compare.py (python -m bench): our strategies and collectives against PyTorch's own,
timed in one job.

The contenders: each strategy and its PyTorch counterpart (DistributedDataParallel, ZeRO-1's
ZeroRedundancyOptimizer, fully_shard, parallelize_module, torch.distributed.pipelining's
schedules on the same stages, torch.utils.checkpoint on our DDP) train the same model on the
same data, precision and world size (fully_shard also on a 2-D mesh, HSDP, against our FSDP's
shard and replicate groups, and on a LoRA model whose frozen base both sides shard); a mixture
of experts trains with its experts split over --ep ranks against the same model replicated
(PyTorch has no expert parallelism of its own); context parallelism's ring attention runs
beside its all-gather (PyTorch's context_parallel does not run on CPU ranks). bench/measure.py
times them and prints the tables, bench/ring.py all-reduce and all-to-all by size.
Left out: gradient accumulation, data loading.
Run: torchrun --nproc_per_node 2 -m bench --quick (CPU); torchrun --nproc_per_node 8 -m bench (GPUs);
python -m bench --scaling 1,2,4,8 (no torchrun) the bytes per rank as the world grows
(bench/scaling.py);
python -m bench --report bench.json prints a finished run's tables again (the README's come so)
Test: python -m pytest tests/test_bench.py
"""
import argparse
import gc
import inspect
import json
import os
import time
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               loss_parallel, parallelize_module)
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import context_parallel
from composition import context_parallel_gpt
import pipeline
from composition import tensor_parallel_gpt
from bench.ring import bench_collectives, collectives_report
from bench.scaling import STRATEGIES as SCALED, bench_scaling, scaling_report
from bench.measure import (MiB, Run, bench_moe, bench_strategy, machine, matmul_peak_flops,
                           moe_report, progress, predicted_cell, report, size_report, spread,
                           summary, time_training)
from checkpointing import checkpoint_blocks
from foundations.comm import Comm
from running.data import TextData
from ddp import DDP
from fsdp import MixedPrecisionPolicy as FSDPPrecision
from mechanics.fsdp_optimizer import FSDPOptimizer
from lora import apply_lora
from napkin.machines import this
from napkin.memory_math import run_state_bytes
from napkin.sent import (cp_kv_bytes_per_step, ddp_bytes_per_step, fsdp_bytes_per_step,
                         pipeline_bytes_per_step, tp_bytes_per_step)
from composition.mesh_optimizer import on_mesh
from mixed_precision import DTYPES, MixedPrecisionOptimizer
from foundations.inner_optimizer import element_state
from model import PRESETS
from composition.parallelize import build_gpt, data_parallel, fsdp_with, ring_choice
from mechanics.pipeline_mechanics import BUBBLE_FORMULAS, bubble_formula, split_layers
from foundations.process_groups import make_mesh
from foundations.world import init_distributed
from foundations.values import Parser, count, counts, real, whole
from extensions.schedules import make_pipeline
from running.snapshot import unwritable_file
from napkin.step_time import Shape, Step, predict
from extensions.zero_offload import zero_optimizer

ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


# ---- the contenders: model, args -> Run, ours and PyTorch's -------------------------------------

class TorchOptimizer:
    """A torch optimizer behind our optimizers' interface: scale_loss and clip_grad_norm_.

    held_bytes asks for masters (a torch optimizer updates the parameters themselves) and
    state_tensors(): ZeroRedundancyOptimizer keeps the moments in its local optimizer
    (state_owner), the one that updates this rank's shard.
    """

    def __init__(self, optimizer, params, state_owner=None, clip=clip_grad_norm_):
        self.torch_optimizer, self.params, self.clip = optimizer, list(params), clip
        self.optimizer = state_owner or optimizer
        self.param_groups = optimizer.param_groups
        self.masters = [p for group in self.param_groups for p in group["params"]]

    def state_tensors(self):
        return [*self.masters, *element_state(self.optimizer)]

    def zero_grad(self):
        self.torch_optimizer.zero_grad(set_to_none=True)

    def scale_loss(self, loss):
        return loss

    def clip_grad_norm_(self, max_norm):
        self.clip(self.params, max_norm)

    def step(self):
        self.torch_optimizer.step()


def our_comm() -> Comm:
    """Ours as train.py runs by default (--collectives auto): on each backend the collectives
    measured faster there (gloo: our ring's reduce-scatter and all-gather; NCCL: its own)."""
    return Comm(ring=ring_choice("auto", dist.get_backend()))


def ours_ddp(model, args):
    comm = our_comm()
    ddp = DDP(model, comm, bucket_mb=args.bucket_mb)
    return Run(ddp, MixedPrecisionOptimizer(ddp.parameters(), torch.optim.AdamW,
                                            precision=args.precision, **ADAMW), comm)


def ours_zero(stage, model, args):
    comm = our_comm()
    return Run(model, zero_optimizer(model.parameters(), stage=stage, optimizer_cls=torch.optim.AdamW,
                                     group=comm, bucket_mb=args.bucket_mb, **ADAMW), comm)


def torch_ddp_model(model, args):
    # gradient_as_bucket_view: .grad is a view of the bucket, as in ddp.py (no second copy of the
    # gradients; held_bytes sees the buckets through .grad). Neither side re-syncs buffers per step.
    # (torch 2.13 renamed broadcast_buffers forward_sync_buffers: a GPU image may hold an older torch)
    sync = ("forward_sync_buffers" if "forward_sync_buffers" in
            inspect.signature(DistributedDataParallel).parameters else "broadcast_buffers")
    return DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True,
                                   **{sync: False})


def torch_ddp(model, args):
    ddp = torch_ddp_model(model, args)
    label = f"DistributedDataParallel(bucket_cap_mb={args.bucket_mb:g}, gradient_as_bucket_view=True)"
    if args.precision == "fp32":
        adamw = torch.optim.AdamW(ddp.parameters(), **ADAMW)
        return Run(ddp, TorchOptimizer(adamw, ddp.parameters()), label=label + " + AdamW")
    # torch has no fp32-master wrapper for a bf16 model: the same MixedPrecisionOptimizer as ours.
    return Run(ddp, MixedPrecisionOptimizer(ddp.parameters(), torch.optim.AdamW,
                                            precision=args.precision, **ADAMW),
               label=label + " + our MixedPrecisionOptimizer(AdamW), fp32 masters")


def torch_zero(model, args):
    # ZeroRedundancyOptimizer is ZeRO stage 1 only; it is zero2's counterpart too (the nearest
    # other one, FSDP's SHARD_GRAD_OP, also changes how parameters are held). In bf16 it runs
    # AdamW on the bf16 weights themselves: no fp32 master, less work and memory than ours.
    ddp = torch_ddp_model(model, args)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                   parameters_as_bucket_view=True, **ADAMW)
    label = ("DistributedDataParallel + ZeroRedundancyOptimizer(AdamW, parameters_as_bucket_view="
             "True), stage 1" + ("" if args.precision == "fp32" else ", AdamW on the bf16 weights"))
    return Run(ddp, TorchOptimizer(zero, ddp.parameters(), state_owner=zero.optim), label=label)


def ours_checkpointed(model, args):
    checkpoint_blocks(model)
    run = ours_ddp(model, args)
    return Run(run.model, run.optimizer, run.comm, label="our DDP + checkpointing.checkpoint_blocks")


def torch_checkpointed(model, args):
    for block in model.blocks:               # non-reentrant: PyTorch's recommended variant
        block.forward = partial(torch_checkpoint, block.forward, use_reentrant=False)
    run = ours_ddp(model, args)
    return Run(run.model, run.optimizer, run.comm,
               label="our DDP + torch.utils.checkpoint.checkpoint(use_reentrant=False) per block")


# hsdp: FSDP shards within groups of this many neighbouring ranks (one node's fast links) and
# keeps a copy of the model per group (train.py --shard-group 2): a world of 2 groups or more.
SHARD_GROUP = 2
# fsdp-lora: train.py's --lora defaults, adapters on attention's query and value.
LORA = dict(targets=("query", "value"), rank=8, alpha=16)


def ours_fsdp(model, args, shard_group=None):
    # FSDP keeps fp32 master shards and computes in --precision: the model arrives cast to
    # --precision (as every row's does, so every row starts from the same rounded weights).
    # shard_group: hybrid sharding, as train.py --shard-group builds it (make_mesh's inner groups
    # shard, its outer groups hold the copies; both count into the one Comm).
    comm = our_comm()
    shard, copies = make_mesh(comm, shard_group) if shard_group else (comm, None)
    frozen = any(not p.requires_grad for p in model.parameters())
    # What a rank holds, predicted (napkin/memory.py); with a frozen base, also what it would hold whole.
    options = SimpleNamespace(precision=args.precision, ep=1, double_quant=False, offload=None)
    napkin_held = {f"zero3 over {shard.world_size}": run_state_bytes(model, "zero3", options,
                                                                     shard.world_size)["total"]}
    if frozen:
        napkin_held["ddp (the base whole)"] = run_state_bytes(model, "ddp", options, comm.world_size)["total"]
    fsdp = fsdp_with(model.float(), copies, group=shard, mp_policy=FSDPPrecision(DTYPES[args.precision]))
    hybrid = f", shard group {shard.world_size} x {copies.world_size} copies" if copies else ""
    return Run(fsdp, FSDPOptimizer(fsdp, torch.optim.AdamW, **ADAMW), comm,
               label=f"our FSDP(prefetch=1{hybrid}) + FSDPOptimizer(AdamW)",
               # memory_math.comm_bytes prices the copies' all-reduce and a frozen base's gathers too,
               # but as one flat buffer with the root gathered twice (test_fsdp_qlora compares
               # them): these rows print FSDP's own formula, unit by unit, exact to the byte.
               napkin_sent=fsdp_bytes_per_step(fsdp) if copies or frozen else None, napkin_held=napkin_held)


def torch_fsdp(model, args, shard_group=None, offload=False):
    # The same units as ours: one per block, the rest the root. fully_shard's default policy is
    # ours: blocks free their gathered weights after forward, the root keeps them until the end
    # of backward. The policy computes and reduce-scatters in --precision, fp32 shards beside.
    # shard_group: FSDP2's HSDP, a 2-D mesh whose ranks [[0, 1], [2, 3]] shard along a row and
    # hold copies down a column, the groups make_mesh gives ours.
    device_type, n = next(model.parameters()).device.type, dist.get_world_size()
    mesh = (init_device_mesh(device_type, (n // shard_group, shard_group),
                             mesh_dim_names=("replicate", "shard")) if shard_group
            else init_device_mesh(device_type, (n,)))
    dtype = DTYPES[args.precision]
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    model.float()
    for p in model.parameters():       # a frozen base is kept in --precision, as ours keeps it
        if not p.requires_grad:
            p.data = p.data.to(dtype)
    # offload: FSDP2's CPUOffloadPolicy, the shards, their gradients and AdamW's step in host memory.
    options = dict(mesh=mesh, mp_policy=policy, **({"offload_policy": CPUOffloadPolicy()} if offload else {}))
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    # After fully_shard: it replaced each parameter with a sharded one (a DTensor).
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    hybrid = f" on a {n // shard_group} x {shard_group} (replicate, shard) mesh: HSDP" if shard_group else ""
    return Run(model, TorchOptimizer(adamw, model.parameters()),
               label=f"fully_shard per block + root (FSDP2){hybrid}, MixedPrecisionPolicy({args.precision})"
                     + (", CPUOffloadPolicy" if offload else "") + " + AdamW")


def with_lora(build, model, args):
    """build (ours_fsdp or torch_fsdp) on the model with LoRA adapters: its base frozen."""
    apply_lora(model, **LORA)
    run = build(model, args)
    run.label += f" on apply_lora(rank {LORA['rank']}, {','.join(LORA['targets'])})"
    return run


def ours_tp(model, args):
    # The whole world is one tensor group: every rank computes the same rows (WHOLE_BATCH).
    comm = our_comm()
    tp = tensor_parallel_gpt.TensorParallelGPT(model, comm)
    optimizer = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, precision=args.precision, **ADAMW)
    optimizer = on_mesh([optimizer], {"tp": comm})   # the norm sums the slices over the group
    return Run(tp, optimizer, comm, napkin_sent=tp_bytes_per_step(tp, args.batch_size, args.seq_len))


def clip_mixed(params, max_norm):
    """clip_grad_norm_ for a model of DTensor and plain parameters, which it refuses to mix.

    A split weight's DTensor norm is over the whole matrix (.full_tensor() sums the ranks'
    squares); a plain parameter is replicated, the same on every rank, so its norm is local.
    """
    kinds = [p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]
    split, replicated = (get_total_norm([p.grad for p in kind]) for kind in kinds)
    norm = (split.full_tensor() ** 2 + replicated ** 2).sqrt()
    for kind in kinds:
        clip_grads_with_norm_(kind, max_norm, norm)


def torch_tp(model, args):
    # Our split, layer by layer: query/key/value/up by columns, output/down by rows (Megatron),
    # the embedding by vocabulary rows (RowwiseParallel on an nn.Embedding: out-of-range ids
    # give zeros, an all-reduce sums), the head by vocabulary columns, its logits never gathered.
    # What differs: the vocab-parallel loss is loss_parallel's (DTensor reductions of per-token
    # numbers), ours is three all-reduces (max, target logit, sum of exponentials). Norms and
    # the position embedding stay plain tensors (ours: replicated parameters), hence clip_mixed.
    n = dist.get_world_size()
    mesh = init_device_mesh(next(model.parameters()).device.type, (n,))
    plan = {"token_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, block in enumerate(model.blocks):
        block.attn.n_head //= n                  # H/N heads per rank, as ours
        plan.update({
            # One DTensor input for query, key and value: their input gradients are summed
            # first and all-reduced once, as ours does (f entered once per sublayer).
            f"blocks.{i}.attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                                   desired_input_layouts=(Replicate(),),
                                                   use_local_output=False),
            **{f"blocks.{i}.attn.{name}": ColwiseParallel() for name in ("query", "key", "value")},
            f"blocks.{i}.attn.output": RowwiseParallel(),
            f"blocks.{i}.mlp.up": ColwiseParallel(), f"blocks.{i}.mlp.down": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    if model.cfg.tie_embeddings:                 # each layer got its own DTensor: tie them again
        model.head.weight = model.token_emb.weight
    # torch has no fp32-master wrapper for TP: in bf16 AdamW runs on the bf16 weights.
    adamw = torch.optim.AdamW(model.parameters(), **ADAMW)
    return Run(model, TorchOptimizer(adamw, model.parameters(), clip=clip_mixed), loss_context=loss_parallel,
               label="parallelize_module(Colwise: query/key/value/up/head, Rowwise: output/down/"
                     "token_emb) + loss_parallel + AdamW" + ("" if args.precision == "fp32" else
                                                             " on the bf16 weights"))


# The pipeline rows' chunks per stage: interleaved runs two (Megatron's and torch's usual).
VIRTUAL_STAGES = {"interleaved": 2}


def _stage(model, v: int = 1):
    """This rank's pipeline.GPTStage (v chunks of blocks): the whole world is one pipeline, a
    stage per rank."""
    s, P = dist.get_rank(), dist.get_world_size()
    return pipeline.GPTStage(model, split_layers(model.cfg.n_layer, P, v=v)[s::P], s == 0, s == P - 1)


def ours_pipeline(schedule, model, args):
    v = VIRTUAL_STAGES.get(schedule, 1)
    stage, comm = _stage(model, v), our_comm()
    runner = make_pipeline(stage, comm, schedule, args.microbatches, model.cfg.n_embd, DTYPES[args.precision])
    optimizer = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, precision=args.precision, **ADAMW)
    optimizer = on_mesh([optimizer], {"pp": comm})   # the norm sums the stages
    return Run(stage, optimizer, comm, label=f"pipeline.Pipeline({schedule}" + (f", v={v})" if v > 1 else ")"),
               napkin_sent=pipeline_bytes_per_step(runner, args.batch_size, args.seq_len),
               forward_backward=partial(runner.train_step, scale_loss=optimizer.scale_loss),
               bubbles=runner.measured_bubbles,
               predicted_bubble=(BUBBLE_FORMULAS[schedule], bubble_formula(schedule, comm.world_size, args.microbatches, v)))


class TorchChunk(torch.nn.Module):
    """Chunk `chunk` of an interleaved GPTStage as a module of its own, for torch's PipelineStage:
    its parameters() are this chunk's alone (torch's zero-bubble W differentiates by them)."""

    def __init__(self, stage, chunk: int):
        super().__init__()
        gpt, last = stage.gpt, chunk == len(stage.chunks) - 1 and stage.last
        ends = ([gpt.token_emb, gpt.pos_emb] if chunk == 0 and stage.first else []) + (
            [gpt.norm, gpt.head] if last else [])
        self.parts = torch.nn.ModuleList([gpt.blocks[i] for i in stage.chunks[chunk]] + ends)
        self.run = partial(stage, chunk=chunk)            # a function: the stage is not registered

    def forward(self, x):
        return self.run(x)


def torch_pipeline_stage(stage, s: int, P: int, micro_batch: int, seq_len: int, dtype,
                         chunk: int = 0) -> PipelineStage:
    """torch's PipelineStage around our GPTStage (or its chunk `chunk`, virtual stage chunk P + s),
    told the shapes one micro-batch has going in and out: token ids (b, T) or activations (b, T, C)
    in; activations or logits (b, T, V) out. Given both, torch skips its shape-inference
    handshake, which sends Python objects (recv_object_list) before the first step."""
    cfg, device = stage.gpt.cfg, next(stage.parameters()).device
    index, n = chunk * P + s, len(stage.chunks) * P                   # virtual stage, of n
    # requires_grad marks what has a gradient in backward: activations do, token ids do not.
    inputs = (torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device) if index == 0 else
              torch.zeros(micro_batch, seq_len, cfg.n_embd, dtype=dtype, device=device,
                          requires_grad=True))
    outputs = torch.zeros(micro_batch, seq_len, cfg.vocab_size if index == n - 1 else cfg.n_embd,
                          dtype=dtype, device=device, requires_grad=True)
    module = stage if len(stage.chunks) == 1 else TorchChunk(stage, chunk)
    return PipelineStage(module, index, n, device, input_args=inputs, output_args=outputs)


def torch_pipelining(schedule, model, args):
    # The same stages; torch's last stage returns logits and applies loss_fn itself, then
    # divides the gradients by M (ours divides each micro-batch's loss by M: the same mean).
    # Interleaved: the same chunks; zero bubble: torch's interleaved ZB with one chunk per stage.
    s, P, v = dist.get_rank(), dist.get_world_size(), VIRTUAL_STAGES.get(schedule, 1)
    stage = _stage(model, v)
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                      "zb": ScheduleInterleavedZeroBubble}[schedule]
    stages = [torch_pipeline_stage(stage, s, P, args.batch_size // args.microbatches, args.seq_len,
                                   DTYPES[args.precision], chunk) for chunk in range(v)]
    runner = schedule_class(stages if schedule in ("interleaved", "zb") else stages[0],   # several: a list
                            n_microbatches=args.microbatches,
                            loss_fn=lambda logits, t: F.cross_entropy(logits.float().flatten(0, 1), t.flatten()))

    def forward_backward(x, y):
        losses = []
        runner.step(*([x] if s == 0 else []), **({"target": y, "losses": losses} if s == P - 1 else {}))
        loss = torch.stack(losses).mean().float() if losses else torch.zeros((), device=x.device)
        dist.broadcast(loss, src=P - 1)                       # reported by every rank, as ours
        return loss
    # torch clips nothing across stages: the same MixedPrecisionOptimizer and norm as ours.
    optimizer = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, precision=args.precision, **ADAMW)
    optimizer = on_mesh([optimizer], {"pp": Comm()})         # the world is the pipeline
    return Run(stage, optimizer, label=f"torch.distributed.pipelining.{schedule_class.__name__}"
               f"(n_microbatches={args.microbatches}) + our MixedPrecisionOptimizer(AdamW)",
               forward_backward=forward_backward)


def ours_moe(ep, model, args):
    """Our DDP on a mixture of experts, as train.py --strategy ddp --ep builds it
    (parallelize.data_parallel):
    each rank holds E/ep of every MoE layer's experts and sends its tokens to them by all-to-all;
    ep 1 keeps every expert on every rank, plain data parallelism."""
    comm = our_comm()
    options = SimpleNamespace(strategy="ddp", ep=ep, bucket_mb=args.bucket_mb, precision=args.precision,
                              batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=1,
                              double_quant=False, offload=None)
    wrapped, optimizer, sent, _ = data_parallel(model, options, comm, None, ADAMW)
    return Run(wrapped, optimizer, comm, label=f"our DDP --ep {ep}", napkin_sent=sent)


# name -> (build ours, build PyTorch's). A new strategy is one more line here.
STRATEGIES = {
    "ddp": (ours_ddp, torch_ddp),
    "zero1": (partial(ours_zero, 1), torch_zero),
    "zero2": (partial(ours_zero, 2), torch_zero),
    "fsdp": (ours_fsdp, torch_fsdp),
    "hsdp": (partial(ours_fsdp, shard_group=SHARD_GROUP), partial(torch_fsdp, shard_group=SHARD_GROUP)),
    "fsdp-lora": (partial(with_lora, ours_fsdp), partial(with_lora, torch_fsdp)),
    "tp": (ours_tp, torch_tp),
    "checkpointing": (ours_checkpointed, torch_checkpointed),
    "pipeline-gpipe": (partial(ours_pipeline, "gpipe"), partial(torch_pipelining, "gpipe")),
    "pipeline-1f1b": (partial(ours_pipeline, "1f1b"), partial(torch_pipelining, "1f1b")),
    "pipeline-interleaved": (partial(ours_pipeline, "interleaved"), partial(torch_pipelining, "interleaved")),
    "pipeline-zb": (partial(ours_pipeline, "zb"), partial(torch_pipelining, "zb")),
}


# Seconds machines.this times a row's block for: once per shape and run, so longer than the 1 s a
# train.py run spends at its start (a shared machine's drift averages out more).
THIS_WINDOW = 3.0


def strategy_priced(name: str, args, N: int) -> tuple[Step, dict]:
    """What napkin/step_time.py prices strategy row `name` as over N ranks: its Step, and the block
    machines.this measures for it (this()'s shape arguments), at the rows a rank's blocks
    compute at a time: its share of the batch, the whole batch under tp (a tp rank's 1/N of
    each block), a micro-batch in a pipeline. hsdp is priced as fsdp over the whole world (the
    napkin has no copies' all-reduce)."""
    cfg = PRESETS[args.model]
    pipelined = name.startswith("pipeline-")
    rows = args.batch_size // (args.microbatches if pipelined else 1 if name == "tp" else N)
    shape, lora = Shape.of(cfg), None
    if name == "fsdp-lora":        # A (r x C) and B (C x r) on each target of every block; all else frozen
        adapters = cfg.n_layer * len(LORA["targets"]) * 2 * LORA["rank"] * cfg.n_embd
        lora = (adapters, cfg.n_layer * shape.block_params() + cfg.vocab_size * cfg.n_embd)
    step = Step(shape, {"checkpointing": "ddp", "hsdp": "fsdp", "fsdp-lora": "fsdp"}.get(name, name), N,
                args.batch_size, args.seq_len, args.precision, args.microbatches,
                VIRTUAL_STAGES.get(name.removeprefix("pipeline-"), 1), float(name == "checkpointing"), lora,
                bucket_mb=args.bucket_mb)
    return step, dict(cfg=cfg, rows=rows, seq_len=args.seq_len, precision=args.precision,
                      split=N if name == "tp" else 1)


def inside_priced(model: str, args, N: int, ep: int = 1, cp: int = 1,
                  attention: str = "ring") -> tuple[Step, dict]:
    """strategy_priced for a moe row (ep) or a cp row (cp: the whole world one cp group), both
    our DDP (napkin/step_time_parallel.py): the block machines.this measures is `model`'s as a rank
    computes it, at its B/N rows of T tokens, or a cp rank's B cp/N rows of T/cp tokens with
    context_parallel.py's `attention` (machines.rank_block)."""
    cfg = PRESETS[model]
    step = Step(Shape.of(cfg), "ddp", N, args.batch_size, args.seq_len, args.precision,
                bucket_mb=args.bucket_mb, ep=ep, cp=cp, attention=attention)
    return step, dict(cfg=cfg, rows=args.batch_size * cp // N, seq_len=args.seq_len,
                      precision=args.precision, cp=cp, attention=attention)


def predicted(priced: tuple[Step, dict], device, cache: str) -> dict:
    """napkin/step_time.py's napkin for a row (strategy_priced, inside_priced), on this machine as
    machines.this measures it (every rank at once; read from `cache` once measured for the run).
    Never fitted to the row's runs. Returns {part: ms} (step_time.predict's parts) and "step",
    their sum."""
    step, block = priced
    result = predict(step, this(**block, device=device, cache=cache, window=THIS_WINDOW))
    return {**{part: 1e3 * seconds for part, seconds in result["parts"].items()},
            "step": 1e3 * result["seconds"]}


def with_predicted(rows: list, napkin: list) -> list:
    """Each row with its napkin beside it: "predicted" ({part: ms}, "step") and "predicted_ms"."""
    return [{**row, "predicted_ms": p["step"], "predicted": p} for row, p in zip(rows, napkin)]


# A tensor group or a pipeline computes one model: its ranks read the same rows.
WHOLE_BATCH = {"tp", *(name for name in STRATEGIES if name.startswith("pipeline-"))}
BENCHMARKS = (*STRATEGIES, "moe", "cp", "collectives")


# ---- context parallelism: ring attention beside all-gather K/V ----------------------------------

# PyTorch's own, torch.distributed.tensor.experimental.context_parallel, is no contender on CPU
# ranks (checked with torch 2.13.0): its ring takes over only CUDA's attention kernels (flash,
# memory-efficient, cuDNN), while the CPU runs _scaled_dot_product_flash_attention_for_cpu.
TORCH_CONTEXT_PARALLEL = ("PyTorch's context_parallel not run: its ring handles only CUDA's SDPA "
                          "kernels (flash, efficient, cuDNN), not the CPU's "
                          "_scaled_dot_product_flash_attention_for_cpu")


def ours_context_parallel(attention, model, args):
    """The whole world as one cp group (every rank reads the whole batch, keeps its zigzag chunks),
    gradients summed by our DDP over it."""
    comm = our_comm()
    cp = context_parallel_gpt.ContextParallelGPT(model, comm, attention)
    ddp = DDP(cp, comm, bucket_mb=args.bucket_mb)
    return Run(ddp, MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, precision=args.precision,
                                            **ADAMW), comm,
               label=f"context_parallel_gpt.ContextParallelGPT({attention}, zigzag) + our DDP",
               napkin_sent=ddp_bytes_per_step(ddp)
               + cp_kv_bytes_per_step(cp, args.batch_size, args.seq_len),
               bubbles=lambda: cp.idle_shares()[0])


def bench_context_parallel(args, batches, device) -> list:
    """Ring and all-gather, alternating, args.repeats runs each: one row per attention."""
    runs = {attention: [] for attention in context_parallel.ATTENTIONS}
    for _ in range(args.repeats):
        for attention in runs:
            runs[attention].append(time_training(partial(ours_context_parallel, attention), args,
                                                 batches, device))
    tokens_per_step = args.batch_size * args.seq_len
    rows = []
    for attention, results in runs.items():
        ms, last = summary([r["ms_per_step"] for r in results]), results[-1]
        rows.append({"attention": attention, "label": last["label"], "ms_per_step": ms,
                     "tokens_per_s": tokens_per_step / ms["median"] * 1e3,
                     **{key: last[key] for key in ("activation_bytes", "sent_per_step", "napkin_sent",
                                                   "last_loss")},
                     "idle": last["bubbles"]})
    return rows


def context_parallel_report(m: dict, rows: list) -> list:
    """The ring-vs-all-gather table's lines; none when cp was not asked for."""
    if not rows:
        return []
    lines = ["", f"| cp attention (cp {m['world_size']}, zigzag) | ms/step | predicted ms | tokens/s | "
             f"activations MiB per rank | sent MiB/step (measured / formula) | idle share of attention "
             f"per rank |", "|" + "---|" * 7]
    lines += [f"| {r['attention']} | {spread(r['ms_per_step'])} | {predicted_cell(r, r['ms_per_step'])} | "
              f"{r['tokens_per_s']:,.0f} | "
              f"{r['activation_bytes'] / MiB:.2f} | {r['sent_per_step'] / MiB:.2f} / "
              f"{r['napkin_sent'] / MiB:.2f} | {' '.join(f'{x:.2f}' for x in r['idle'])} |" for r in rows]
    return lines + ["", "Context parallelism: the whole world is one cp group; sent = K/V "
                    "(context_parallel.cp_kv_bytes) + DDP's gradient all-reduce; idle: 1 - a rank's "
                    "busy seconds in attention's forward / the busiest rank's, over every step of "
                    "the last run; predicted: step_time.py's napkin (step_time_parallel: 1/cp of "
                    "the sequence's compute, the K/V exchange, DDP's all-reduce, the optimizer) on "
                    "machines.this measured at a cp rank's block with this attention (its B x T/cp "
                    "tokens, machines.rank_block), in brackets predicted / measured, leaving out "
                    "each rank's wait for the other at a K/V pass beyond the link's latency; loss "
                    + " / ".join(f"{r['last_loss']:.5f}" for r in rows) + f". {TORCH_CONTEXT_PARALLEL}."]


# ---- command line ------------------------------------------------------------------------------

def parse_args(argv=None):
    p = Parser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="the CPU preset, under a minute on 2 cores: the defaults in brackets")
    p.add_argument("--strategies", default=",".join(BENCHMARKS),
                   help=f"comma list, default all: {','.join(BENCHMARKS)}")
    p.add_argument("--model", choices=list(PRESETS), help="default gpt2-small (tiny)")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="default bf16 (fp32)")
    p.add_argument("--batch-size", type=whole, help="global, in sequences; default 8 per rank")
    p.add_argument("--seq-len", type=whole, help="default 1024 (64)")
    p.add_argument("--warmup", type=whole, help="untimed steps per run; default 5 (3)")
    p.add_argument("--steps", type=whole, help="timed steps per run; default 20 (10)")
    p.add_argument("--repeats", type=whole, help="runs of each side; default 5 (3)")
    p.add_argument("--max-mb", type=real(0, above=True),
                   help="largest all-reduce, MiB; default 64 (4)")
    p.add_argument("--bucket-mb", type=real(0, above=True), default=25,
                   help="bucket MiB, ours and torch's; default 25")
    p.add_argument("--microbatches", type=count(1), help="pipeline rows: micro-batches per step; "
                   "default 2 x world size")
    p.add_argument("--moe-model", choices=[name for name, cfg in PRESETS.items() if cfg.experts],
                   help="the moe rows' model; default gpt2-small-moe (tiny-moe)")
    p.add_argument("--ep", type=count(1), default=2, 
                   help="the moe rows: experts split over groups of "
                   "--ep ranks, against ep 1; default 2")
    p.add_argument("--clip-grad", type=real(0), default=1.0,
                   help="gradient-norm clip, 0: off; default 1")
    p.add_argument("--threads", type=count(1, os.cpu_count() or 1),
                   help="torch threads per rank; default cores / local ranks")
    p.add_argument("--seed", type=count(0, 2**32 - 1), default=0)
    p.add_argument("--profile", action="store_true",
                   help="one more untimed run of each side under torch.profiler: a table of the "
                        "operators' time per step, ours beside PyTorch's, under each row")
    p.add_argument("--json", default="bench.json", help="the numbers as JSON; default bench.json")
    p.add_argument("--report", metavar="FILE", nargs="+",
                   help="print the tables of finished runs from the JSON they wrote (runs nothing; the "
                        "README's tables are made so); with several, also ddp's step time by model size")
    p.add_argument("--scaling", metavar="WORLDS", type=counts(1),
                   help="instead of the contenders: ddp, zero1, zero2, fsdp, tp and pipeline 2 steps "
                        "at each world size (e.g. 1,2,4,8), bytes held and sent per rank beside "
                        "memory.py (run with python, not torchrun: it launches a torchrun per run)")
    args = p.parse_args(argv)
    if args.report:
        args.runs = [read_run(p, name) for name in args.report]
        return args
    why = unwritable_file("--json", args.json, "bench.json")   # written at the end, this machine's beside it
    if why:
        p.error(why)
    for name, full, quick in (("model", "gpt2-small", "tiny"), ("moe_model", "gpt2-small-moe", "tiny-moe"),
                              ("precision", "bf16", "fp32"),
                              ("seq_len", 1024, 64), ("warmup", 5, 3), ("steps", 20, 10),
                              ("repeats", 5, 3), ("max_mb", 64, 4)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.scaling:
        if world_size > 1:
            p.error("--scaling launches a torchrun for each world size itself: run python -m bench "
                    "--scaling ..., not under torchrun")
        if any(w < 1 for w in args.scaling) or args.seq_len > PRESETS[args.model].block_size:
            p.error(f"--scaling takes world sizes of 1 or more, and --seq-len at most model "
                    f"{args.model}'s block size")
        args.batch_size = args.batch_size or 16
        chosen = args.strategies != p.get_default("strategies")
        args.strategies = [s.strip() for s in args.strategies.split(",")] if chosen else list(SCALED)
        if not set(args.strategies) <= set(SCALED):
            p.error(f"--scaling runs --strategies among {', '.join(SCALED)}")
        if any(args.batch_size % w for w in args.scaling):
            p.error(f"--batch-size {args.batch_size} must split over every --scaling world size")
        return args
    args.batch_size = 8 * world_size if args.batch_size is None else args.batch_size
    # Every rank parses the same line, so a mistake stops every rank here, before any work.
    chosen = args.strategies != p.get_default("strategies")
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in args.strategies if s not in BENCHMARKS] or ([] if args.strategies else ["''"])
    if unknown:
        p.error(f"unknown --strategies {', '.join(unknown)}: choose from {', '.join(BENCHMARKS)}")
    # tp splits heads, width and vocabulary over every rank. A world that does not divide them
    # refuses tp when asked for, and leaves it out of the default list, saying so in the report.
    cfg, args.skipped = PRESETS[args.model], {}

    def refuse(names: list, why: str, fix: str):
        """Rows this run cannot hold: an error if the user chose them, else skipped and said so."""
        if chosen:
            p.error(f"{', '.join(names)}: {why}; {fix}")
        for name in names:
            args.strategies.remove(name)
            args.skipped[name] = why
    indivisible = [f"{name}={size}" for name, size in (("n_head", cfg.n_head), ("n_embd", cfg.n_embd),
                                                        ("vocab_size", cfg.vocab_size)) if size % world_size]
    if "tp" in args.strategies and indivisible:
        refuse(["tp"], f"tp splits model {args.model} over all {world_size} ranks, and {world_size} "
               f"does not divide {', '.join(indivisible)}",
               "leave tp out of --strategies or launch a world size that divides them")
    # The pipeline rows cut the model into one stage per rank: they need a block per rank, a
    # batch of whole micro-batches, and an untied head (torch's schedules do not tie stages).
    args.microbatches = args.microbatches or 2 * world_size
    pipelines = [s for s in args.strategies if s.startswith("pipeline")]
    why = ("a pipeline needs 2 or more ranks" if world_size < 2 else
           f"model {args.model} has {cfg.n_layer} blocks, fewer than {world_size} stages"
           if cfg.n_layer < world_size else
           f"model {args.model} ties its head to its token embedding, which "
           f"torch.distributed.pipelining does not share between stages" if cfg.tie_embeddings else
           f"--batch-size {args.batch_size} does not split into --microbatches {args.microbatches}"
           if args.batch_size % args.microbatches else None)
    if pipelines and why:
        refuse(pipelines, why, "leave them out of --strategies")
    v = VIRTUAL_STAGES["interleaved"]
    why = (f"model {args.model} has {cfg.n_layer} blocks, fewer than {world_size} stages x {v} chunks"
           if cfg.n_layer < world_size * v else
           f"--microbatches {args.microbatches} is not a multiple of the {world_size} stages"
           if args.microbatches % world_size else None)
    if "pipeline-interleaved" in args.strategies and why:
        refuse(["pipeline-interleaved"], why, "leave it out of --strategies")
    # hsdp shards over groups of SHARD_GROUP ranks and keeps a copy per group: 2 groups at least.
    if "hsdp" in args.strategies and (world_size < 2 * SHARD_GROUP or world_size % SHARD_GROUP):
        refuse(["hsdp"], f"hsdp shards over groups of {SHARD_GROUP} ranks and keeps a copy per group: "
               f"it needs a world of {2 * SHARD_GROUP} or more ranks, a multiple of {SHARD_GROUP}, "
               f"not {world_size}", f"leave hsdp out of --strategies or launch {2 * SHARD_GROUP}, "
               f"{3 * SHARD_GROUP}... ranks")
    # The moe rows split the experts of --moe-model over groups of --ep ranks.
    moe = PRESETS[args.moe_model]
    why = ("expert parallelism needs 2 or more ranks" if world_size < 2 else
           f"--ep {args.ep} must be 2 or more and divide the world size {world_size} and model "
           f"{args.moe_model}'s {moe.experts} experts" if args.ep < 2 or world_size % args.ep
           or moe.experts % args.ep else
           f"--seq-len {args.seq_len} exceeds model {args.moe_model}'s block size {moe.block_size}"
           if args.seq_len > moe.block_size else None)
    if "moe" in args.strategies and why:
        refuse(["moe"], why, "leave it out of --strategies")
    chunks = 2 * world_size                              # cp: the zigzag split, 2 chunks per rank
    why = ("context parallelism needs 2 or more ranks" if world_size < 2 else
           f"--seq-len {args.seq_len} does not split into {chunks} equal chunks (zigzag over "
           f"{world_size} ranks)" if args.seq_len % chunks else None)
    if "cp" in args.strategies and why:
        refuse(["cp"], why, "leave cp out of --strategies")
    if args.batch_size < 1 or args.batch_size % world_size:
        p.error(f"--batch-size {args.batch_size} does not split over {world_size} ranks: "
                f"use a positive multiple of {world_size}")
    if not 1 <= args.seq_len <= PRESETS[args.model].block_size:
        p.error(f"--seq-len must be 1 to {PRESETS[args.model].block_size}, model {args.model}'s "
                f"block size")
    if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--steps and --repeats must be at least 1, --warmup at least 0")
    args.clip_grad = args.clip_grad or None
    return args


RUN_KEYS = ("machine", "strategies", "moe", "context_parallel", "collectives")     # what main writes


def read_run(p, name: str) -> dict:
    """--report FILE: the JSON a bench/compare.py run wrote, read whole before any table is printed."""
    try:
        with open(name) as f:
            data = json.load(f)
    except OSError as e:
        p.error(f"--report {name}: {e.strerror}: give the JSON file a bench.py run wrote (its --json)")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        p.error(f"--report {name} is not JSON ({e}): give the file a bench.py run wrote (its --json)")
    missing = sorted(set(RUN_KEYS) - set(data)) if isinstance(data, dict) else list(RUN_KEYS)
    if missing:
        p.error(f"--report {name} is not a bench.py run's JSON (no {', '.join(missing)}): give the file "
                f"a bench.py run wrote (its --json; NAME-this.json beside it holds machines.this's figures)")
    return data


def print_report(data: dict):
    """Every table of one run, from its JSON (what main prints as it ends): the README's tables
    are made this way, from the file a run wrote, with its machine, torch version and date."""
    m = data["machine"]
    # A --scaling run has a header of its own, and no contenders.
    contenders = report(m, data["strategies"]) if not data.get("scaling") else []
    print("\n".join(contenders + moe_report(data["moe"])
                    + context_parallel_report(m, data["context_parallel"])
                    + collectives_report(m, data["collectives"])
                    + scaling_report(m, data.get("scaling", []))))


def this_file(args) -> str:
    """Where this run keeps machines.this's measurements: beside its JSON."""
    return os.path.splitext(args.json)[0] + "-this.json"


def strategy_rows(args, rows_of_rank, whole, device, n_params, peak_flops) -> list:
    """bench_strategy's row for each strategy asked for, and napkin/step_time.py's prediction beside it:
    this machine measured afresh for this run (machines.this, every rank at once, into a file
    beside the JSON), once per shape a row computes: rows of one shape read one measurement, so
    their predictions differ only by their formulas."""
    machine_file, rows = this_file(args), []
    if dist.get_rank() == 0 and os.path.exists(machine_file):
        os.remove(machine_file)
    dist.barrier()
    for name in (name for name in args.strategies if name in STRATEGIES):
        napkin = predicted(strategy_priced(name, args, dist.get_world_size()), device, machine_file)
        rows.append({**bench_strategy(name, STRATEGIES[name], args, whole if name in WHOLE_BATCH else rows_of_rank,
                                      device, n_params, peak_flops),
                     "predicted_ms": napkin["step"], "predicted": napkin})
        progress(f"{name} timed, ours and PyTorch's")
    return rows


def moe_and_cp_rows(args, rows_of_rank, whole, device) -> tuple:
    """bench_moe's row and bench_context_parallel's rows (None and [] when not asked for), each
    run with napkin/step_time.py's napkin beside it, priced first (machines.this measures between runs,
    never inside one; strategy_rows has emptied the run's file of measurements)."""
    moe_row, cp_rows, N = None, [], dist.get_world_size()
    if "moe" in args.strategies:
        napkin = [predicted(inside_priced(args.moe_model, args, N, ep=ep), device, this_file(args))
                  for ep in (1, args.ep)]
        moe_args = argparse.Namespace(**{**vars(args), "model": args.moe_model})   # time_training builds it
        moe_row = bench_moe({ep: partial(ours_moe, ep) for ep in (1, args.ep)}, moe_args, rows_of_rank, device)
        moe_row["runs"] = with_predicted(moe_row["runs"], napkin)
        progress(f"moe timed at ep 1 and ep {args.ep}")
    if "cp" in args.strategies:
        napkin = [predicted(inside_priced(args.model, args, N, cp=N, attention=attention), device,
                            this_file(args)) for attention in context_parallel.ATTENTIONS]
        cp_rows = with_predicted(bench_context_parallel(args, whole, device), napkin)
        progress(f"cp timed, {' and '.join(context_parallel.ATTENTIONS)} attention")
    return moe_row, cp_rows


def main(argv=None):
    args = parse_args(argv)
    # What is imported lives as long as the process: frozen, the garbage collector's full passes
    # (time_training's gc.collect between runs, the automatic ones during them) skip torch's
    # objects (the tests' quick run: about 10% less CPU).
    gc.freeze()
    if args.report:                             # finished runs' tables: no ranks, no run
        for data in args.runs:
            print_report(data)
        if len(args.runs) > 1:
            print("\n".join(size_report(args.runs)))
        return
    # torchrun sets OMP_NUM_THREADS=1; on a CPU the ranks share the cores, a share each.
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_ranks))
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    progress(f"{', '.join(args.strategies)} on {world_size} rank(s)"
             + (f", at worlds {', '.join(map(str, args.scaling))}" if args.scaling else "")
             + ": a line as each is done, the tables at the end")

    if args.scaling:                             # train.py runs of their own, from this process
        m = {**machine(device, args, build_gpt(args.model).num_parameters(), None), "skipped": {}, "benchmarks": ["scaling"]}
        data = {"machine": m, "strategies": [], "moe": None, "context_parallel": [], "collectives": {},
                "scaling": bench_scaling(args)}
        print_report(data)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        return
    data = TextData.from_file()

    def batches(rank, world_size):
        return [tuple(t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, args.seed,
                                                       rank=rank, world_size=world_size))
                for step in range(args.warmup + args.steps)]
    rows_of_rank, whole = batches(rank, world_size), batches(0, 1)       # (B/N, T), (B, T) each
    n_params = build_gpt(args.model).num_parameters()
    peak_flops = matmul_peak_flops(device) if device.type == "cuda" else None
    rows = strategy_rows(args, rows_of_rank, whole, device, n_params, peak_flops)
    moe_row, cp_rows = moe_and_cp_rows(args, rows_of_rank, whole, device)
    collective_rows = (bench_collectives(args, device)
                       if "collectives" in args.strategies and world_size > 1 else {})

    m = {**machine(device, args, n_params, peak_flops), "benchmarks": args.strategies,
         "skipped": args.skipped}
    if rank == 0:
        data = {"machine": m, "strategies": rows, "moe": moe_row, "context_parallel": cp_rows,
                "collectives": collective_rows}
        print_report(data)
        print(f"\nbench.py ran {time.perf_counter() - started:.0f} s")
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
