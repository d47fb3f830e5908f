"""bench.py: our strategies and collectives against PyTorch's own, timed in one job.

Each strategy and its PyTorch counterpart train the same model on the same data, precision and
world size, alternating run by run (fresh model, warm-up, timed steps), beside memory and bytes
sent; our ring all-reduce is timed against the native one from 1 KB up (nccl-tests' busbw).
Activation checkpointing is timed the same way: ours against torch.utils.checkpoint, both on
our DDP. fsdp runs against fully_shard (FSDP2), tp against parallelize_module over a DeviceMesh,
our pipeline executor (GPipe, 1F1B) against torch.distributed.pipelining's schedules on the same
stages, with each stage's measured bubble. Left out: gradient accumulation, data loading.
Run: torchrun --nproc_per_node 2 bench.py --quick (CPU); torchrun --nproc_per_node 8 bench.py (GPUs)
Test: python -m pytest tests/test_bench.py
"""
import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

# torch warns at import when numpy is absent (its numpy bridge); nothing here uses numpy, and
# requirements.txt does not install it.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               loss_parallel, parallelize_module)
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import pipeline
import tensor_parallel
from checkpointing import checkpoint_blocks
from collectives import Comm, split_norm
from data import TextData
from ddp import DDP
from fsdp import FSDP, FSDPOptimizer
from memory import comm_bytes, held_bytes
from mixed_precision import DTYPES, MixedPrecisionOptimizer
from model import PRESETS, build_model
from process_groups import exit_distributed, init_distributed
from zero import ZeroOptimizer

MiB = 2**20
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


# ---- the contenders: model, args -> Run, ours and PyTorch's -------------------------------------

@dataclass
class Run:
    """A model wrapped by one strategy, and what the report reads from it."""
    model: torch.nn.Module
    optimizer: object           # zero_grad(), scale_loss(loss), clip_grad_norm_(max), step()
    comm: Comm | None = None    # ours: the byte counter; PyTorch's collectives count nothing
    label: str = "ours"         # what ran, for the report
    napkin_sent: int | None = None       # bytes per step predicted, where memory.comm_bytes has no row
    loss_context: object = contextlib.nullcontext   # entered around forward and backward
    forward_backward: object = None      # (x, y) -> loss: a pipeline schedule runs both itself
    bubbles: object = None               # () -> each stage's idle share of the last step (ours)


class TorchOptimizer:
    """A torch optimizer behind our optimizers' interface: scale_loss and clip_grad_norm_.

    held_bytes reads the moments from `.optimizer.state`: ZeroRedundancyOptimizer keeps them in
    its local optimizer (state_owner), the one that updates this rank's shard.
    """

    def __init__(self, optimizer, params, state_owner=None, clip=clip_grad_norm_):
        self.torch_optimizer, self.params, self.clip = optimizer, list(params), clip
        self.optimizer = state_owner or optimizer
        self.param_groups = optimizer.param_groups

    def zero_grad(self):
        self.torch_optimizer.zero_grad(set_to_none=True)

    def scale_loss(self, loss):
        return loss

    def clip_grad_norm_(self, max_norm):
        self.clip(self.params, max_norm)

    def step(self):
        self.torch_optimizer.step()


def ours_ddp(model, args):
    comm = Comm()
    ddp = DDP(model, comm, bucket_mb=args.bucket_mb)
    return Run(ddp, MixedPrecisionOptimizer(ddp.parameters(), torch.optim.AdamW,
                                            precision=args.precision, **ADAMW), comm)


def ours_zero(stage, model, args):
    comm = Comm()
    return Run(model, ZeroOptimizer(model.parameters(), stage=stage, optimizer_cls=torch.optim.AdamW,
                                    group=comm, bucket_mb=args.bucket_mb, **ADAMW), comm)


def torch_ddp_model(model, args):
    # gradient_as_bucket_view: .grad is a view of the bucket, as in ddp.py (no second copy of the
    # gradients; held_bytes sees the buckets through .grad). Neither side re-syncs buffers per step.
    return DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, forward_sync_buffers=False,
                                   gradient_as_bucket_view=True)


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


def ours_fsdp(model, args):
    # FSDP keeps fp32 master shards and computes in --precision: the model arrives cast to
    # --precision (as every row's does, so every row starts from the same rounded weights).
    comm = Comm()
    fsdp = FSDP(model.float(), compute_dtype=DTYPES[args.precision], group=comm)
    return Run(fsdp, FSDPOptimizer(fsdp, torch.optim.AdamW, **ADAMW), comm,
               label="our FSDP(prefetch=1) + FSDPOptimizer(AdamW)")


def torch_fsdp(model, args):
    # The same units as ours: one per block, the rest the root. fully_shard's default policy is
    # ours: blocks free their gathered weights after forward, the root keeps them until the end
    # of backward. The policy computes and reduce-scatters in --precision, fp32 shards beside.
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    dtype = DTYPES[args.precision]
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    model.float()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    adamw = torch.optim.AdamW(model.parameters(), **ADAMW)
    return Run(model, TorchOptimizer(adamw, model.parameters()),
               label=f"fully_shard per block + root (FSDP2), MixedPrecisionPolicy({args.precision}) + AdamW")


def ours_tp(model, args):
    # The whole world is one tensor group: every rank computes the same rows (WHOLE_BATCH).
    comm = Comm()
    tp = tensor_parallel.TensorParallelGPT(model, comm)
    return Run(tp, MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, precision=args.precision,
                                           grad_norm=tp.grad_norm, **ADAMW), comm,
               napkin_sent=tp.bytes_per_step(args.batch_size, args.seq_len))


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


def _stage(model):
    """This rank's pipeline.GPTStage: the whole world is one pipeline, a stage per rank."""
    s, P = dist.get_rank(), dist.get_world_size()
    return pipeline.GPTStage(model, pipeline.split_layers(model.cfg.n_layer, P)[s], s == 0, s == P - 1)


def ours_pipeline(schedule, model, args):
    stage, comm = _stage(model), Comm()
    runner = pipeline.Pipeline(stage, comm, schedule, args.microbatches, model.cfg.n_embd,
                               DTYPES[args.precision])
    optimizer = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, precision=args.precision,
                                        grad_norm=runner.grad_norm, **ADAMW)
    return Run(stage, optimizer, comm, label=f"pipeline.Pipeline({schedule})",
               napkin_sent=runner.bytes_per_step(args.batch_size, args.seq_len),
               forward_backward=partial(runner.train_step, scale_loss=optimizer.scale_loss),
               bubbles=runner.measured_bubbles)


def torch_pipeline_stage(stage, s: int, P: int, micro_batch: int, seq_len: int, dtype) -> PipelineStage:
    """torch's PipelineStage around our GPTStage, told the shapes one micro-batch has going in
    and out: token ids (b, T) or activations (b, T, C) in; activations or logits (b, T, V) out.
    Given both, torch skips its shape-inference handshake, which sends Python objects
    (recv_object_list) that only decode with numpy, a package this project does not install."""
    cfg, device = stage.gpt.cfg, next(stage.parameters()).device
    # requires_grad marks what has a gradient in backward: activations do, token ids do not.
    inputs = (torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device) if s == 0 else
              torch.zeros(micro_batch, seq_len, cfg.n_embd, dtype=dtype, device=device,
                          requires_grad=True))
    outputs = torch.zeros(micro_batch, seq_len, cfg.vocab_size if s == P - 1 else cfg.n_embd,
                          dtype=dtype, device=device, requires_grad=True)
    return PipelineStage(stage, s, P, device, input_args=inputs, output_args=outputs)


def torch_pipelining(schedule, model, args):
    # The same stages; torch's last stage returns logits and applies loss_fn itself, then
    # divides the gradients by M (ours divides each micro-batch's loss by M: the same mean).
    s, P = dist.get_rank(), dist.get_world_size()
    stage = _stage(model)
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = schedule_class(torch_pipeline_stage(stage, s, P, args.batch_size // args.microbatches,
                                                 args.seq_len, DTYPES[args.precision]),
                            n_microbatches=args.microbatches,
                            loss_fn=lambda logits, t: F.cross_entropy(logits.float().flatten(0, 1), t.flatten()))

    def forward_backward(x, y):
        losses = []
        runner.step(*([x] if s == 0 else []), **({"target": y, "losses": losses} if s == P - 1 else {}))
        loss = torch.stack(losses).mean().float() if losses else torch.zeros((), device=x.device)
        dist.broadcast(loss, src=P - 1)                       # reported by every rank, as ours
        return loss
    # torch clips nothing across stages: the same MixedPrecisionOptimizer and norm as ours.
    stages = Comm()                                           # the world is the pipeline
    optimizer = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, precision=args.precision,
                                        grad_norm=lambda params, grads: split_norm(
                                            grads, stages, grads[0].device), **ADAMW)
    return Run(stage, optimizer, label=f"torch.distributed.pipelining.{schedule_class.__name__}"
               f"(n_microbatches={args.microbatches}) + our MixedPrecisionOptimizer(AdamW)",
               forward_backward=forward_backward)


# name -> (build ours, build PyTorch's). A new strategy is one more line here.
STRATEGIES = {
    "ddp": (ours_ddp, torch_ddp),
    "zero1": (partial(ours_zero, 1), torch_zero),
    "zero2": (partial(ours_zero, 2), torch_zero),
    "fsdp": (ours_fsdp, torch_fsdp),
    "tp": (ours_tp, torch_tp),
    "checkpointing": (ours_checkpointed, torch_checkpointed),
    "pipeline-gpipe": (partial(ours_pipeline, "gpipe"), partial(torch_pipelining, "gpipe")),
    "pipeline-1f1b": (partial(ours_pipeline, "1f1b"), partial(torch_pipelining, "1f1b")),
}
NAPKIN_STRATEGY = {"checkpointing": "ddp"}   # what memory.comm_bytes knows a row as
# A tensor group or a pipeline computes one model: its ranks read the same rows.
WHOLE_BATCH = {"tp", "pipeline-gpipe", "pipeline-1f1b"}
BENCHMARKS = (*STRATEGIES, "collectives")


# ---- timing ------------------------------------------------------------------------------------

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
    """memory.held_bytes of a run. A DTensor (fully_shard's and parallelize_module's parameters,
    gradients, AdamW moments) has no storage of its own: held_bytes reads stand-ins holding
    the local tensors, which serve as both the model and the optimizer it reads. (A gradient's
    local tensor need not be its parameter's shape: TP's embedding gradient is whole.)"""
    if not any(isinstance(p, DTensor) for p in run.model.parameters()):
        return sum(held_bytes(run.model, run.optimizer).values())
    params = [SimpleNamespace(untyped_storage=_local(p).untyped_storage,
                              grad=None if p.grad is None else _local(p.grad))
              for p in run.model.parameters()]
    state = {i: {k: _local(v) for k, v in s.items()} for i, s in enumerate(run.optimizer.optimizer.state.values())}
    local = SimpleNamespace(parameters=lambda: params, buffers=lambda: map(_local, run.model.buffers()),
                            param_groups=[{"params": params}], optimizer=SimpleNamespace(state=state))
    return sum(held_bytes(local, local).values())


class LiveSaved:
    """Saved-tensor hooks that track the bytes autograd holds for backward at each moment, and
    their peak: what a pipeline stage's micro-batches in flight cost (GPipe M, 1F1B at most P).
    A storage counts once while any saved tensor uses it; parameters never count."""

    def __init__(self, params):
        self.weights = {_local(p).untyped_storage().data_ptr() for p in params}
        self.users, self.live, self.peak = {}, 0, 0

    def pack(self, t):
        storage = _local(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.weights:
            return t
        if self.users.get(ptr, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.users[ptr] = self.users.get(ptr, 0) + 1
        return _Saved(t, self, ptr, storage.nbytes())

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved


class _Saved:
    """A saved tensor; when autograd drops it (its backward ran), its bytes leave the count."""

    def __init__(self, tensor, counter, ptr, nbytes):
        self.tensor, self.counter, self.ptr, self.nbytes = tensor, counter, ptr, nbytes

    def __del__(self):
        self.counter.users[self.ptr] -= 1
        if self.counter.users[self.ptr] == 0:
            self.counter.live -= self.nbytes


def activation_bytes(run: Run, x, y) -> int:
    """Bytes one forward keeps for backward (saved-tensor hooks), each storage once, untimed.

    checkpointing.saved_activation_bytes fixes the parameters' storages before forward; FSDP
    gathers them during forward, and a DTensor has none: so the parameters' storages are
    read again at each save. DDP wrappers only add gradient hooks: their module is run.
    """
    if run.forward_backward is not None:      # a pipeline: the peak over a whole step's schedule
        counter = LiveSaved(run.model.parameters())
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            run.forward_backward(x, y)
        run.optimizer.zero_grad()
        return counter.peak
    model = run.model.module if isinstance(run.model, (DDP, DistributedDataParallel)) else run.model
    owner = getattr(run.model, "module", run.model)          # our FSDP: the gathered weights
    storages = {}

    def pack(t):
        weights = {_local(p).untyped_storage().data_ptr() for p in owner.parameters()}
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t
    with run.loss_context(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)                                         # the graph is dropped unused
    return sum(storages.values())


def time_training(build, args, batches, device) -> dict:
    """Build a fresh model and strategy, warm up, time args.steps steps: ms/step, memory, bytes."""
    gc.collect()                                # the previous run's model and hooks are gone
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)                # every run starts from the same weights
    run = build(build_model(args.model).to(device=device, dtype=DTYPES[args.precision]), args)
    for x, y in batches[:args.warmup]:          # first steps allocate, build buckets, tune
        train_step(run, x, y, args.clip_grad)
    if run.comm is not None:
        run.comm.bytes_sent.clear()
    sync(device)
    dist.barrier()                              # every rank starts the clock together
    start = time.perf_counter()
    for x, y in batches[args.warmup:]:
        loss = train_step(run, x, y, args.clip_grad)
    sync(device)
    seconds = across_ranks(time.perf_counter() - start, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else held(run)
    sent = None if run.comm is None else sum(run.comm.bytes_sent.values()) / args.steps
    bubbles = run.bubbles() if run.bubbles else None          # of the last timed step
    return {"ms_per_step": 1e3 * seconds / args.steps, "label": run.label, "bubbles": bubbles,
            "peak_bytes": across_ranks(peak, device), "sent_per_step": sent,
            "napkin_sent": run.napkin_sent,
            "activation_bytes": across_ranks(activation_bytes(run, x, y), device),
            # the same loss on both sides says both did the same work
            "last_loss": across_ranks(loss.item(), device, dist.ReduceOp.SUM) / dist.get_world_size()}


def bench_strategy(name, args, batches, device, n_params, peak_flops) -> dict:
    """Ours, PyTorch's, ours, PyTorch's...: args.repeats runs each, so drift hits both alike."""
    runs = {"ours": [], "torch": []}
    for _ in range(args.repeats):
        for side, build in zip(runs, STRATEGIES[name]):
            runs[side].append(time_training(build, args, batches, device))
    row = {"strategy": name, "torch_counterpart": runs["torch"][-1]["label"]}
    tokens_per_step = args.batch_size * args.seq_len                  # the global batch
    for side, results in runs.items():
        ms = summary([r["ms_per_step"] for r in results])
        row[side] = {"ms_per_step": ms, "tokens_per_s": tokens_per_step / ms["median"] * 1e3,
                     "peak_bytes": max(r["peak_bytes"] for r in results),
                     "activation_bytes": results[-1]["activation_bytes"],
                     "sent_per_step": results[-1]["sent_per_step"],
                     "last_loss": results[-1]["last_loss"], "bubbles": results[-1]["bubbles"]}
    row["ratio"] = row["ours"]["ms_per_step"]["median"] / row["torch"]["ms_per_step"]["median"]
    napkin = runs["ours"][-1]["napkin_sent"]
    row["ours"]["napkin_sent_per_step"] = napkin if napkin is not None else sum(
        comm_bytes(n_params, NAPKIN_STRATEGY.get(name, name), args.precision, dist.get_world_size()).values())
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
            "world_size": dist.get_world_size(),
            "model": args.model, "n_params": n_params, "precision": args.precision,
            "global_batch": args.batch_size, "seq_len": args.seq_len, "warmup": args.warmup,
            "steps": args.steps, "repeats": args.repeats, "bucket_mb": args.bucket_mb,
            "microbatches": args.microbatches,
            "clip_grad": args.clip_grad, "matmul_peak_tflops": peak_flops and peak_flops / 1e12,
            "datasheet_peak_tflops": (datasheet_peak_flops(device, args.precision) or 0) / 1e12
            if device.type == "cuda" else None}


def spread(s: dict) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def _bubble_note(row: dict, m: dict) -> str:
    """A pipeline row's measured idle share per stage, beside (P-1)/(M+P-1)."""
    if not row["ours"]["bubbles"]:
        return ""
    P, M = m["world_size"], m["microbatches"]
    return (f"; ours {M} micro-batches, bubble per stage (idle share of a step) "
            f"{' '.join(f'{b:.2f}' for b in row['ours']['bubbles'])}, formula (P-1)/(M+P-1) "
            f"{(P - 1) / (M + P - 1):.2f}; activations: the most a stage holds at once")


def report(m: dict, rows: list, collective_rows: list) -> str:
    lines = [f"{m['cpu']}, {m['cores']} cores ({m['threads_per_rank']} thread(s) per rank), GPU: "
             f"{m['gpu'] or 'none'}, torch {m['torch']}, {m['backend']}, world size {m['world_size']}, "
             f"model {m['model']} ({m['n_params'] / 1e6:.2f}M params), {m['precision']}, global batch "
             f"{m['global_batch']} x seq len {m['seq_len']}, {m['warmup']} warm-up + {m['steps']} "
             f"timed steps x {m['repeats']} repetitions", ""]
    if rows:
        lines += ["| strategy | ours ms/step | torch ms/step | ours/torch | ours tokens/s | "
                  "ours peak MiB | torch peak MiB | activations MiB (ours / torch) | "
                  "ours sent MiB/step (ring volume of the calls / napkin) | torch sent MiB/step | ours MFU |",
                  "|" + "---|" * 11]
        for r in rows:
            ours, theirs = r["ours"], r["torch"]
            lines.append(f"| {r['strategy']} | {spread(ours['ms_per_step'])} | "
                         f"{spread(theirs['ms_per_step'])} | {r['ratio']:.2f} | "
                         f"{ours['tokens_per_s']:,.0f} | {ours['peak_bytes'] / MiB:.1f} | "
                         f"{theirs['peak_bytes'] / MiB:.1f} | {ours['activation_bytes'] / MiB:.1f} / "
                         f"{theirs['activation_bytes'] / MiB:.1f} | {ours['sent_per_step'] / MiB:.2f} / "
                         f"{ours['napkin_sent_per_step'] / MiB:.2f} | "
                         + (f"{theirs['sent_per_step'] / MiB:.2f} | " if theirs["sent_per_step"] is not None
                            else "n/a | ")
                         + (f"{100 * r['mfu']:.1f}% ({100 * r['mfu_of_measured_peak']:.1f}% of the "
                            f"measured peak) |" if "mfu" in r else "n/a |"))
        peak = ("CUDA max_memory_allocated, activations included" if m["gpu"] else "memory.held_bytes: "
                "parameters + gradients (torch DDP's buckets, as .grad views) + optimizer state, a DTensor's "
                "local tensors")
        mfu = (f"model FLOPs / the datasheet's dense {m['precision']} peak of "
               f"{m['datasheet_peak_tflops']:.0f} TFLOP/s per GPU (in brackets: / a measured bf16 "
               f"matmul's {m['matmul_peak_tflops']:.0f} TFLOP/s)" if m["gpu"] else "GPU only")
        lines += ["", f"ms/step: median (min-max) over repetitions, slowest rank. Peak: max over ranks, "
                  f"{peak}. Sent: our Comm's counter (ring volume, native calls included) beside "
                  f"memory.comm_bytes (fsdp: our root unit is gathered once, not twice; tp: "
                  f"tensor_parallel's bytes_per_step, activation traffic memory.py does not model); "
                  f"PyTorch's collectives count nothing. Activations: bytes one forward keeps for "
                  f"backward (saved-tensor hooks), max over ranks. MFU: {mfu}. Both sides: AdamW, "
                  f"gradient-norm clip {m['clip_grad']}. PyTorch's side, and the loss after the last "
                  f"step (ours / torch: the same work gives the same loss):"]
        lines += [f"- {r['strategy']}: {r['torch_counterpart']}; loss {r['ours']['last_loss']:.5f} / "
                  f"{r['torch']['last_loss']:.5f}" + _bubble_note(r, m) for r in rows]
    lines += [f"- {name}: skipped, {why}" for name, why in m["skipped"].items()]
    if collective_rows:
        lines += ["", "| all-reduce size | ring us | native us | ring/native | ring busbw GB/s | "
                  "native busbw GB/s |", "|" + "---|" * 6]
        for r in collective_rows:
            size = f"{r['bytes'] // MiB} MB" if r["bytes"] >= MiB else f"{r['bytes'] // 2**10} KB"
            lines.append(f"| {size} | {spread(r['ring']['us'])} | {spread(r['native']['us'])} | "
                         f"{r['ratio']:.2f} | {r['ring']['busbw_GBps']:.3f} | "
                         f"{r['native']['busbw_GBps']:.3f} |")
        lines += ["", "Per call, median (min-max) over repetitions; algbw = bytes / time, "
                  "busbw = algbw x 2(N-1)/N (nccl-tests); 1 GB = 1e9 bytes."]
    elif "collectives" in m["benchmarks"]:
        lines += ["", "all-reduce: skipped, a world of one sends nothing (run with 2+ ranks)"]
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="the CPU preset, under a minute on 2 cores: the defaults in brackets")
    p.add_argument("--strategies", default=",".join(BENCHMARKS),
                   help=f"comma list, default all: {','.join(BENCHMARKS)}")
    p.add_argument("--model", choices=list(PRESETS), help="default gpt2-small (tiny)")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="default bf16 (fp32)")
    p.add_argument("--batch-size", type=int, help="global, in sequences; default 8 per rank")
    p.add_argument("--seq-len", type=int, help="default 1024 (64)")
    p.add_argument("--warmup", type=int, help="untimed steps per run; default 5 (3)")
    p.add_argument("--steps", type=int, help="timed steps per run; default 20 (10)")
    p.add_argument("--repeats", type=int, help="runs of each side; default 5 (3)")
    p.add_argument("--max-mb", type=float, help="largest all-reduce, MiB; default 64 (4)")
    p.add_argument("--bucket-mb", type=float, default=25, help="bucket MiB, ours and torch's; default 25")
    p.add_argument("--microbatches", type=int, help="pipeline rows: micro-batches per step; "
                   "default 2 x world size")
    p.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip, 0: off; default 1")
    p.add_argument("--threads", type=int, help="torch threads per rank; default cores / local ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench.json", help="the numbers as JSON; default bench.json")
    args = p.parse_args(argv)
    for name, full, quick in (("model", "gpt2-small", "tiny"), ("precision", "bf16", "fp32"),
                              ("seq_len", 1024, 64), ("warmup", 5, 3), ("steps", 20, 10),
                              ("repeats", 5, 3), ("max_mb", 64, 4)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
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
    indivisible = [f"{name}={size}" for name, size in (("n_head", cfg.n_head), ("n_embd", cfg.n_embd),
                                                        ("vocab_size", cfg.vocab_size)) if size % world_size]
    if "tp" in args.strategies and indivisible:
        why = (f"tp splits model {args.model} over all {world_size} ranks, and {world_size} does not "
               f"divide {', '.join(indivisible)}")
        if chosen:
            p.error(f"{why}: leave tp out of --strategies or launch a world size that divides them")
        args.strategies.remove("tp")
        args.skipped["tp"] = why
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
        if chosen:
            p.error(f"{', '.join(pipelines)}: {why}; leave them out of --strategies")
        for name in pipelines:
            args.strategies.remove(name)
            args.skipped[name] = why
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


def main(argv=None):
    args = parse_args(argv)
    # torchrun sets OMP_NUM_THREADS=1; on a CPU the ranks share the cores, a share each.
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_ranks))
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()

    data = TextData.from_file()

    def batches(rank, world_size):
        return [tuple(t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, args.seed,
                                                       rank=rank, world_size=world_size))
                for step in range(args.warmup + args.steps)]
    rows_of_rank, whole = batches(rank, world_size), batches(0, 1)       # (B/N, T), (B, T) each
    n_params = build_model(args.model).num_parameters()
    peak_flops = matmul_peak_flops(device) if device.type == "cuda" else None
    rows = [bench_strategy(name, args, whole if name in WHOLE_BATCH else rows_of_rank, device,
                           n_params, peak_flops)
            for name in args.strategies if name in STRATEGIES]
    collective_rows = (bench_collectives(args, device)
                       if "collectives" in args.strategies and world_size > 1 else [])

    m = {**machine(device, args, n_params, peak_flops), "benchmarks": args.strategies,
         "skipped": args.skipped}
    if rank == 0:
        print(report(m, rows, collective_rows))
        print(f"\nbench.py ran {time.perf_counter() - started:.0f} s")
        with open(args.json, "w") as f:
            json.dump({"machine": m, "strategies": rows, "collectives": collective_rows}, f, indent=1)


if __name__ == "__main__":
    main()
    exit_distributed()
