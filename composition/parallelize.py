"""Where the strategies meet: one model laid out over the mesh, one apply step per concept file.

Each concept file teaches one idea on its own (ddp.py, zero.py, fsdp.py, tensor_parallel.py,
context_parallel.py, moe.py, pipeline.py, lora.py); this file composes them into one run, in
torchtitan's order (parallelize_llama, without its indirection): split the matrices, split the
sequences, route the experts, cut the stages, then wrap what is left for data parallelism. The
splits write each parameter's placement (foundations/placements.py), from which the optimizer's
one global norm and the data dimension's reductions follow; the wrappers' gradient syncs are
chained in the one protocol (flat.GradientSyncs) that the loop and the pipeline drive. Beside
each step, the bytes it predicts it sends, each its own file's formula.
Used by: train.py (build; device_mesh, prepare and observed around the rungs it builds itself).
Test: python -m pytest tests/test_train.py -k mesh
"""
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

import lora
from checkpointing import checkpoint_blocks
from foundations.comm import RING_COLLECTIVES, Comm, ring_bytes
from composition.context_parallel_gpt import ContextParallelGPT
from ddp import DDP
from foundations.flat import GradientSyncs
from fsdp import FSDP, MixedPrecisionPolicy
from extensions.fsdp_frozen import FrozenBaseFSDP
from extensions.fsdp_hybrid import HSDP
from extensions.fsdp_offload import OffloadedFSDP
from napkin.memory_math import mesh_params, run_state_bytes
from napkin.sent import (cp_kv_bytes_per_step, ddp_bytes_per_step, fsdp_bytes_per_step,
                         pipeline_bytes_per_step, tp_bytes_per_step, zero_bytes_per_step)
from composition.mesh_checks import ParallelDims, moe_config, stage_layers
from composition.mesh_optimizer import on_mesh, partition
from foundations.dtypes import master_dtype
from mixed_precision import DTYPES, MixedPrecisionOptimizer
from model import GPT, build_model
from moe import MoE, feed_forward, layer_exchange_bytes, routing_summary
from pipeline import GPTStage, Pipeline
from pretrained.streamed import StreamedFSDP, StreamedLoad, is_hollow
from foundations.placements import by_reduction, place
from mechanics.fsdp_optimizer import FSDPOptimizer
from mechanics.fsdp_state import gpt_blocks
from mechanics.pipeline_mechanics import BUBBLE_FORMULAS, bubble_formula
from foundations.process_groups import make_device_mesh, make_mesh
from extensions.schedules import COMPUTE, make_pipeline, message
from tensor_parallel import g
from composition.tensor_parallel_gpt import TensorParallelGPT
from extensions.zero_offload import Zero2OffloadOptimizer, ZeroOffloadOptimizer
from zero import Zero2Optimizer, ZeroOptimizer


# --strategy -> the data-parallel rung that wraps the data dimension: ddp.py's replicas, zero.py's
# sharded optimizer or fsdp.py's units. tp, pipeline and cp are ddp over the data dimension, beside
# their split. running/cli.py names these as --strategy's choices.
STRATEGIES = {"single": "ddp", "ddp": "ddp", "zero1": "zero", "zero2": "zero", "fsdp": "fsdp",
              "zero3": "fsdp", "tp": "ddp", "pipeline": "ddp", "cp": "ddp"}

# --collectives auto: each backend runs what was measured faster on it (bench/ring.py and
# docs/measured.md, 2 gloo ranks, the medium model's 44 MB): gloo's reduce_scatter_tensor took
# 83-87 ms against our ring's 25, its all_gather_into_tensor 90-95 against 34-42 (both copy
# through flat buffers), while its all-reduce took 32 against the ring's 44. NCCL's own, always.
FASTEST_RING = {"gloo": ("reduce_scatter", "all_gather")}


def ring_choice(collectives: str, backend: str) -> frozenset:
    """The collectives a Comm runs as our ring for --collectives native, ring or auto."""
    chosen = {"native": (), "ring": RING_COLLECTIVES}.get(collectives)
    return frozenset(FASTEST_RING.get(backend, ()) if chosen is None else chosen)



class Run(NamedTuple):
    gpt: nn.Module               # the model, this rank's part of it, with its whole-model names
    model: object                # what the loop calls: the wrapper, or the pipeline's executor
    optimizer: object
    sync: GradientSyncs          # the gradient syncs the loop drives
    predicted: dict              # {dimension: bytes sent per step, its formula}
    napkin: dict                 # napkin/memory.py's bytes held per rank
    context: object              # context parallelism's wrapper (its attention reports), or None
    comm: Comm                   # the world
    mesh: object                 # this rank's groups (process_groups.make_device_mesh)
    dims: ParallelDims           # the run's layout, the mesh's sizes
    my_tokens: Callable          # (x, y) of whole sequences -> the tokens this rank computes


def new_gpt(args) -> GPT:
    """The fp32 model --model and the MoE flags describe, its weights drawn from --seed: the
    same on every rank."""
    torch.manual_seed(args.seed)
    return build_gpt(args.model, dropout=args.dropout, **moe_config(args))


def build(args, device, dims: ParallelDims, gpt: GPT) -> Run:
    """The run the command line describes, on this rank: the mesh (device_mesh), then gpt
    (new_gpt's, its weights loaded where --init-from says) laid out on it. A strategy refuses
    its input with a ValueError. Without a tensor, context or pipeline split, whole_model wraps
    the whole model over the data dimension (train.py builds the plain rungs itself); with one,
    parallelize applies them in turn."""
    comm, mesh = device_mesh(args, dims)
    # hf:DIR's model built hollow (snapshot.pretrained_model): each unit read as the strategy
    # comes to it, its tensors checked against the files first (pretrained/streamed.py)
    fsdp = STRATEGIES[args.strategy] == "fsdp"           # FSDP moves each shard to the device
    load = (StreamedLoad(gpt, args.hf, lora_config(args, dims.tp_enabled),
                         device=None if fsdp else device) if is_hollow(gpt) else None)
    prepare(gpt, args, device, dims.tp_enabled)
    adamw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if not dims.splits:
        model, optimizer = whole_model(gpt, args, mesh.dp, device, adamw, load)
        return observed(args, dims, gpt, model, optimizer, comm, mesh)
    model, optimizer, sync, predicted, napkin, context = parallelize(gpt, args, mesh, dims,
                                                                     device, adamw, load)
    # A pipeline is fed this rank's tokens of each sequence under context parallelism, (B, T) ->
    # (B, T/cp); without one, ContextParallelGPT's forward cuts its own.
    pipelined = context is not None and hasattr(model, "train_step")
    return Run(gpt, model, optimizer, sync, predicted, napkin, context, comm, mesh, dims,
               context.local_tokens if pipelined else lambda x, y: (x, y))


def device_mesh(args, dims: ParallelDims) -> tuple[Comm, object]:
    """The world's Comm, which carries the run's timeout to every group the mesh and the
    strategies cut, and this rank's groups: one mesh, tensor x context x data x pipeline
    (running/cli.py made sure the sizes divide the world). With a split, the experts' groups and
    HSDP's are the mesh's too (--ep, --shard-group: runs inside dp x cp); without one,
    whole_model cuts them from the data group."""
    comm = Comm(ring=ring_choice(args.collectives, dist.get_backend()), timeout=args.timeout)
    split = bool(dims.splits)
    return comm, make_device_mesh(comm, tp=dims.tp, cp=dims.cp, pp=dims.pp,
                                  ep=dims.ep if split else 1,
                                  shard=args.shard_group if split else None)


def weights_dtype(args) -> torch.dtype:
    """The dtype the run stores its weights in: FSDP keeps fp32 master shards (fp64: fp64) and
    computes in --precision itself; the other strategies hold the model in --precision."""
    precision = DTYPES[args.precision]
    return master_dtype(precision) if STRATEGIES[args.strategy] == "fsdp" else precision


def prepare(gpt, args, device, split: bool = False):
    """gpt made ready for its strategy, in place: cast, --lora's adapters, activation
    checkpointing. A hollow model (pretrained/streamed.py) is in its dtype already, and each of
    its units goes to the device (and to 4 bits) as it is read. split: tensor parallelism splits
    gpt next (build), and each rank quantizes its own slices then (lora_config)."""
    hollow = is_hollow(gpt)
    # FSDP's model stays on the CPU until FSDP moves each rank's shards (a model that fits only
    # sharded must never be whole on the GPU).
    if STRATEGIES[args.strategy] == "fsdp" and not hollow:
        gpt.to(dtype=weights_dtype(args))
    elif not hollow:
        gpt.to(device=device, dtype=weights_dtype(args))
    if args.lora:         # after the cast: a 4-bit base keeps its scales in fp32
        adapted = lora_config(args, split)
        lora.apply_lora(gpt, **{**adapted, **({"quantize": None} if hollow else {})})
    if args.checkpoint_activations:
        checkpoint_blocks(gpt, every=args.checkpoint_activations)


def observed(args, dims: ParallelDims, gpt, model, optimizer, comm: Comm, mesh) -> Run:
    """The Run of a data-parallel rung already built over the whole model (train.py's
    data_parallel, or whole_model): its gradient sync and the bytes it predicts, from outside."""
    sent, held = priced(gpt, model, optimizer, args, mesh.dp)
    # The strategy's gradient sync: DDP's or FSDP's (the model), or ZeRO's (the optimizer).
    sync = GradientSyncs(*(o for o in (model, optimizer) if hasattr(o, "finish_gradient_sync")))
    return Run(gpt, model, optimizer, sync, {"dp": sent}, held, None, comm, mesh, dims,
               lambda x, y: (x, y))


def data_parallel(gpt, args, data, device, adamw: dict):
    """whole_model's (model, optimizer), and its bytes sent per step (the ring formulas) and
    held (the napkin math): priced."""
    model, optimizer = whole_model(gpt, args, data, device, adamw)
    return model, optimizer, *priced(gpt, model, optimizer, args, data)


def whole_model(gpt, args, data, device, adamw: dict, load: StreamedLoad | None = None):
    """--strategy over the whole model, the data group its only dimension: (model, optimizer).
    single and ddp: DDP's replicas (single: none) under MixedPrecisionOptimizer, which needs no
    comm for its overflow decision (after the all-reduce every rank holds the same gradients);
    zero1, zero2: the model unwrapped, ZeroOptimizer does the communication; fsdp (zero3): FSDP's
    units (gpt fp32 on the CPU: see FSDP's device), with --shard-group S HSDP's copies.
    --ep (moe.py): E/ep experts per rank; FSDP makes each a unit over the ranks holding it.
    load: a hollow gpt's reader (build), which wrap calls."""
    experts = expert_parallel(gpt, data, args.ep) if args.ep > 1 else None
    rung = STRATEGIES[args.strategy]
    # FSDP shards over S neighbouring ranks (one node), a copy per group of them
    S = (args.shard_group or data.world_size) if rung == "fsdp" else data.world_size
    shard, copies = make_mesh(data, S) if S < data.world_size else (data, None)
    model, parts = wrap(gpt, gpt, args, (data, shard, copies), device, adamw,
                        replicate=args.strategy != "single", load=load)
    # A replicated optimizer's experts differ over ep: their squares add up over it.
    return model, on_mesh(parts, {"ep": experts if rung == "ddp" else None})


def priced(gpt, model, optimizer, args, data) -> tuple[int, int]:
    """(bytes this rank sends per step, the ring formulas; bytes it holds, the napkin math) of
    --strategy's rung over the whole model, built (model, optimizer) over the data group."""
    rung = STRATEGIES[args.strategy]
    if rung == "ddp":
        sent = 0 if model is gpt else ddp_bytes_per_step(model)
        held = run_state_bytes(gpt, "ddp", args, data.world_size)
    elif rung == "fsdp":
        sent = fsdp_bytes_per_step(model, micro_batches=args.grad_accum)
        held = run_state_bytes(gpt, "zero3", args, data.world_size,
                               shard_group=args.shard_group or data.world_size)
    else:
        sent = zero_bytes_per_step(optimizer, micro_batches=args.grad_accum)
        held = run_state_bytes(gpt, args.strategy, args, data.world_size)
    return sent + exchange_bytes(gpt, args, data.world_size), held


def wrap(gpt, module, args, groups: tuple, device, adamw: dict, replicate: bool,
         load: StreamedLoad | None = None):
    """module wrapped over the data dimension as --strategy says, and gpt's optimizers: (wrapped,
    [concept optimizer per part], mesh_optimizer.on_mesh composes them). groups: (the data group, FSDP's shard group, HSDP's copies or None).
    ddp: DDP's replicas if replicate (else module itself) under MixedPrecisionOptimizer, made
    after DDP's broadcast so that fp16/bf16 masters copy rank 0's weights; fsdp: FSDP's units
    (each expert a unit of its own, sharded over its holders) under FSDPOptimizer; zero1, zero2:
    module unwrapped, ZeRO's optimizer reduces the gradients (with --offload, ZeRO-Offload), one
    per group that reduces them (mesh_optimizer.partition: the experts' over their holders).
    load: where module is still hollow, its reader: FSDP reads each unit as it makes it; the
    others read what is left now, before any replica or optimizer copies it."""
    data, shard, copies = groups
    rung, reduce_dtype = STRATEGIES[args.strategy], reduce_dtype_of(args)
    offload = bool(args.offload)                  # ZeRO-Offload: the shards' optimizer on the host
    if rung == "fsdp":
        units = held_experts(gpt)
        streamed = {"load": load} if load else {}         # each unit read as FSDP makes it
        replicas = fsdp_with(module, copies, args.offload == "params", **streamed,
                             wrap=lambda m: gpt_blocks(m) or m in units, group=shard,
                             mp_policy=MixedPrecisionPolicy(DTYPES[args.precision], reduce_dtype),
                             prefetch=args.prefetch, device=device)
        return replicas, [FSDPOptimizer(replicas, torch.optim.AdamW, offload=offload, **adamw)]
    if load:
        load.fill_rest(module)
    if rung == "ddp":
        # An expert's gradient is summed over the ranks holding it, the rest averaged over data.
        replicas = (DDP(module, data, bucket_mb=args.bucket_mb, reduce_dtype=reduce_dtype,
                        reductions=by_reduction(list(module.parameters()), data))
                    if replicate else module)
        return replicas, [MixedPrecisionOptimizer(gpt.parameters(), torch.optim.AdamW,
                                                  precision=args.precision, **adamw)]
    # zero.py's optimizer of the stage --strategy names; --offload: ZeRO-Offload's subclass of it.
    if offload:
        sharded = Zero2OffloadOptimizer if args.strategy == "zero2" else ZeroOffloadOptimizer
    else:
        sharded = Zero2Optimizer if args.strategy == "zero2" else ZeroOptimizer
    return module, [sharded(part, torch.optim.AdamW, group=comm, bucket_mb=args.bucket_mb,
                            reduce_dtype=reduce_dtype, mean_over=mean_over, **adamw)
                    for comm, mean_over, part in partition(gpt.parameters(), data)]


def fsdp_with(module, replicate_group=None, offload_params: bool = False, **options) -> FSDP:
    """fsdp.FSDP(module, **options) with the talk's extensions a run asks for, each a subclass of
    FSDP that calls super(), stacked into one class: HSDP's copies across replicate_group
    (extensions/fsdp_hybrid.py), the parameter shards in host memory (extensions/fsdp_offload.py), and, when the module
    has frozen parameters (LoRA's base), those sharded too (extensions/fsdp_frozen.py); with
    options' load, each unit read from a Hugging Face directory as it is made
    (pretrained/streamed.py)."""
    frozen = not all(p.requires_grad for p in module.parameters())
    chosen = [kind for kind, wanted in ((StreamedFSDP, "load" in options),
                                        (HSDP, replicate_group is not None),
                                        (OffloadedFSDP, offload_params), (FrozenBaseFSDP, frozen))
              if wanted]
    if chosen == [StreamedFSDP]:                  # a mixin alone (full fine-tuning): over FSDP
        chosen.append(FSDP)
    kind = chosen[0] if len(chosen) == 1 else type("FSDP", tuple(chosen), {}) if chosen else FSDP
    if replicate_group is not None:
        options["replicate_group"] = replicate_group
    return kind(module, **options)


def reduce_dtype_of(args) -> torch.dtype | None:
    """The dtype --reduce-dtype averages gradients in across ranks; None (an options object
    without it): the gradients' own dtype."""
    name = getattr(args, "reduce_dtype", None)
    return DTYPES[name] if name else None


def parallelize(gpt, args, mesh, dims: ParallelDims, device, adamw: dict,
                load: StreamedLoad | None = None):
    """--tp, --cp, --pp and --ep over the mesh, then data parallelism over what is left, each
    step its own file's (in torchtitan's order: split the matrices, split the sequences, route
    the experts, cut the stages, wrap for data parallelism): (model, optimizer, gradient syncs,
    {dimension: bytes sent per step predicted}, bytes held predicted, the context-parallel
    wrapper or None). gpt keeps its whole-model parameter names throughout (this rank's slices
    of its stage's), so checkpoints read the same on any mesh.
    load: a hollow gpt's reader (build): tp reads each block just before splitting it, a stage
    never reads what it will drop, wrap_data reads what is left.
    """
    stage = mesh.pp.rank if dims.pp_enabled else None
    layers = (stage_layers(args.stage_layers, gpt.cfg.n_layer, args.pp, args.virtual_stages)[stage]
              if dims.pp_enabled else None)
    if load and dims.pp_enabled:
        load.skip(dropped_by_stage(gpt, layers, stage == 0, stage == args.pp - 1))
    # 1. Split the matrices (tensor_parallel.py): each block's heads and MLP columns over tp
    # (a mixture of experts stays whole on every tensor rank: group_balance_losses).
    # QLoRA: each rank quantizes its slices, a block at a time (lora.quantize_split).
    quantize = (partial(lora.quantize_split, double_quant=args.double_quant)
                if args.quantize_base else None)
    tp = (TensorParallelGPT(gpt, mesh.tp, args.sequence_parallel, load and load.fill, quantize)
          if dims.tp_enabled else None)
    if tp and args.sequence_parallel:
        group_balance_losses(gpt, tp.comm)
    # 2. Split the sequences (context_parallel.py): this rank's chunks of each; attention over cp.
    cp = (ContextParallelGPT(gpt, mesh.cp, args.cp_attention, args.cp_balance == "zigzag")
          if dims.cp_enabled else None)
    if cp and tp and hasattr(tp, "group_positions"):   # sequence parallel: 1/tp of its chunks
        tp.group_positions, gpt.positions_of = gpt.positions_of, tp._my_positions
    # 3. Route the experts (moe.py): E/ep of each MoE layer's experts on this rank, the tokens
    # sent to them over the mesh's ep group (a run of ep dp x cp ranks), their gradients
    # reduced over the ranks holding the same ones (expert_dp).
    experts = (expert_parallel(gpt, mesh.dp_cp, args.ep, (mesh.ep, mesh.expert_dp))
               if mesh.ep is not None else None)
    # 4. Cut the stages (pipeline.py): this rank keeps its stage's blocks, the rest are dropped.
    module = cp or tp or gpt
    if dims.pp_enabled:
        module = GPTStage(gpt, layers, first=stage == 0, last=stage == args.pp - 1)
    # 5. Data parallelism over what is left; the pipeline's executor runs a stage's micro-batches.
    replicas, optimizer, sync, held_all = wrap_data(gpt, module, tp, experts, args, mesh, dims,
                                                    device, adamw, load)
    model = replicas
    if dims.pp_enabled:
        sp = args.tp if args.sequence_parallel else 1      # a rank sends its 1/tp of the tokens
        model = make_pipeline(replicas, mesh.pp, args.schedule, args.microbatches,
                              lambda b, t: (b, t // sp, gpt.cfg.n_embd), DTYPES[args.precision])
        model.sync = sync
    sent, held = predicted_bytes(gpt, args, mesh, dims, tp, cp, experts, model, replicas, optimizer,
                                 held_all)
    return model, optimizer, sync, sent, held, cp


def dropped_by_stage(gpt, layers, first: bool, last: bool) -> list:
    """What GPTStage(gpt, layers, first, last) will drop, which tp would split before (the
    stage's rule): the other stages' blocks; the token embedding unless the stage is the first
    or the last holding a tied copy; the head unless the stage is the last or its weight is
    the kept embedding's."""
    chunks = [layers] if isinstance(layers, range) else layers
    tied = gpt.cfg.tie_embeddings
    drop_embedding = not first and not (last and tied)
    drop_head = not last and not (tied and not drop_embedding)
    return ([b for i, b in enumerate(gpt.blocks) if not any(i in chunk for chunk in chunks)]
            + [gpt.token_emb] * drop_embedding + [gpt.head] * drop_head)


def wrap_data(gpt, module, tp, experts, args, mesh, dims: ParallelDims, device, adamw: dict,
              load: StreamedLoad | None = None):
    """Step 5: data parallelism over the ranks holding the same slice of the same stage, dp x cp
    (a cp group's ranks hold whole copies too; their gradients, from other tokens, are summed):
    ddp's replicas, ZeRO's optimizer shards or FSDP's units (with --shard-group, HSDP: sharded
    over a run of dp x cp ranks, copied across the runs), as --strategy says. Returns (the
    wrapped module, the optimizer, the gradient syncs, whether a pipeline holds every backward)."""
    data, rung = mesh.dp_cp, STRATEGIES[args.strategy]
    # Partial gradients over the tensor group (tensor_parallel.py) are summed at the sync's
    # finish, before the data dimension's; where the data dimension reduces during backward
    # (DDP's last backward, ZeRO-2's and FSDP's hooks) they are summed in backward, before it
    # reads them. A pipeline with a tied head or zero bubble's W holds every backward instead.
    held_all = dims.pp_enabled and (args.schedule == "zb" or module.tied is not None)
    in_backward = (rung == "ddp" and data.world_size > 1 or args.strategy == "zero2"
                   or rung == "fsdp" and not dims.pp_enabled)
    if tp and tp.partial and in_backward and not held_all:
        tp.sum_partial_in_backward()
    replicas, parts = wrap(gpt, module, args, (data, mesh.shard or data, mesh.replicate), device,
                           adamw, replicate=data.world_size > 1, load=load)
    # The global norm sums each value once over the dimensions that split the model beside the
    # optimizer's own ranks (foundations/placements.py): a replicated optimizer's experts differ over ep.
    optimizer = on_mesh(parts, {"ep": experts if rung == "ddp" else None,
                                "tp": mesh.tp if tp else None,
                                "pp": mesh.pp if dims.pp_enabled else None})
    # The gradient syncs in order: the tensor group's partial sums, then the data dimension's
    # reduction (DDP's, FSDP's, or ZeRO's optimizer's).
    sync = GradientSyncs(tp, replicas if replicas is not module else
                         optimizer if args.strategy in ("zero1", "zero2") else None)
    return replicas, optimizer, sync, held_all


def predicted_bytes(gpt, args, mesh, dims, tp, cp, experts, model, replicas, optimizer, held_all):
    """({dimension: bytes this rank sends per step}, each its own file's formula, and the bytes
    it holds, napkin/memory.py's napkin math), for this rank's rows (B/D) and tokens of each (T/cp; its
    MoE layers see T/cp/tp of them under sequence parallelism)."""
    data, rung, pipelined = mesh.dp_cp, STRATEGIES[args.strategy], dims.pp_enabled
    held_blocks = [i for i, block in enumerate(gpt.blocks) if not isinstance(block, nn.Identity)]
    rows, tokens = args.batch_size // mesh.dp.world_size, args.seq_len // mesh.cp.world_size
    tokens_split = mesh.cp.world_size * (args.tp if args.sequence_parallel else 1)
    micro = args.microbatches if pipelined else args.grad_accum
    backwards = micro * (args.virtual_stages if pipelined else 1)     # interleaved: one a chunk
    every = args.checkpoint_activations               # checkpoint_blocks: blocks 0, K, 2K, ...
    recomputed = sum(i % every == 0 for i in held_blocks) if every else 0
    sent = {}
    if tp:
        sent["tp"] = tp_bytes_per_step(tp, rows, tokens, micro)
        if args.sequence_parallel:         # each mixture's balance loss made the group's mean (g)
            mixtures = sum(isinstance(gpt.blocks[i].mlp, MoE) for i in held_blocks)
            wide = max(DTYPES[args.precision].itemsize, 4)         # fp32, or fp64's own
            sent["tp"] += micro * mixtures * ring_bytes("all_reduce", 1, wide, args.tp)
    if cp:
        cp.count_activations = not pipelined      # the first step's, for the log (a stage's
                                                      # forwards run in the pipeline's schedule)
        sent["cp"] = cp_kv_bytes_per_step(cp, rows, args.seq_len, micro, recomputed)
        cp.kv_formula = sent["cp"]
    if pipelined:
        sent["pp"] = pipeline_bytes_per_step(model, rows, tokens)
    if experts is not None and gpt.cfg.capacity_factor:     # dropless: as routed, no formula
        sent["ep"] = exchange_bytes(gpt, args, mesh.dp.world_size, tokens_split, micro)
    if data.world_size > 1:
        sent["dp"] = (ddp_bytes_per_step(replicas) if rung == "ddp" else
                      fsdp_bytes_per_step(replicas, micro, gathered_for_step=pipelined)
                      if rung == "fsdp" else
                      zero_bytes_per_step(optimizer, 1 if held_all else backwards))
    # napkin/memory.py: this rank's share of its stage (all of it without pp), held over dp x cp as
    # the strategy holds it (with LoRA: the frozen slices, plus the adapters, which alone train;
    # with experts, whose layers mesh_params does not price: what this rank holds, its experts).
    n_params = mesh_params(gpt.cfg, args.tp if tp else 1, len(held_blocks),
                           getattr(model, "first", True), gpt.head is not None)
    trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad) if args.lora else 0
    held = run_state_bytes(gpt, {"fsdp": "zero3", "ddp": "ddp"}.get(rung, args.strategy), args,
                           data.world_size, n_params=None if gpt.cfg.experts else n_params + trainable,
                           shard_group=mesh.shard.world_size if mesh.shard else None)
    return sent, held


def group_balance_losses(gpt, tensor: Comm):
    """Under sequence parallelism, each mixture of experts' balance loss made the tensor group's
    mean. A mixture (moe.py) stays whole on every rank of the tensor group (tensor_parallel.py
    splits model.py's MLP only; Megatron's expert tensor-parallel size 1): its input, the residual
    after attention's all-reduce, is the same on all N, so each routes the same tokens to the
    same experts and gets the same gradients, no collective needed; expert parallelism splits the
    experts over the data ranks instead. The price: N copies compute them. With sequence
    parallelism each rank computes its own T/N tokens and routes them (in groups inside them:
    running/cli.py), so a layer's balance loss is this rank's part: g makes the loss the group's mean on
    every rank, and backward hands each rank 1/N of its own part, summed over the group with the
    experts' partial gradients."""
    def group_mean(moe, args, output):
        moe.aux_loss = g(moe.aux_loss / tensor.world_size, tensor)    # Megatron's g
    for block in gpt.blocks:
        if isinstance(block.mlp, MoE):
            block.mlp.register_forward_hook(group_mean)


def lora_config(args, split: bool = False) -> dict | None:
    """--lora's settings for lora.apply_lora (and a checkpoint's export), or None. split: for
    the whole model tensor parallelism splits next: without quantize, for a 4-bit weight cannot
    be cut (each rank quantizes its own slices after the split: lora.quantize_split)."""
    quantize = None if split else args.quantize_base
    return dict(targets=args.lora_targets.split(","), rank=args.lora_rank, alpha=args.lora_alpha,
                dropout=args.lora_dropout, quantize=quantize,
                double_quant=args.double_quant) if args.lora else None


def dimension_report(args, job, step: int, history: dict) -> list[str]:
    """The log's lines, at a logged step, for each dimension that measures itself beside its
    formula: the experts' routing and all-to-alls (moe.py), the pipeline's bubble (pipeline.py)
    and context parallelism's K/V and idle attention (context_parallel.py). Each also goes into
    history. Collective where a measurement is (the pipeline's bubbles): every rank calls it.
    job: build's Run."""
    gpt, model, mesh, context, lines = job.gpt, job.model, job.mesh, job.context, []
    if gpt.cfg.experts:                  # moe.py's routing, rank 0's last micro-batch
        routing = routing_summary(gpt)
        low, mean, high = routing["tokens_per_expert"]
        exchanged = ""
        if args.ep > 1:                  # the all-to-alls alone, beside their formula
            formula = exchange_bytes(gpt, args, mesh.dp.world_size,
                                     mesh.cp.world_size * (args.tp if args.sequence_parallel else 1),
                                     args.microbatches if job.dims.pp_enabled else None)
            a2a = (mesh.ep or mesh.dp_cp).bytes_sent["all_to_all"]    # the mesh's ep, or dp's
            exchanged = (f" | all-to-all {a2a / 2**20:.2f} MiB/step "
                         + (f"(formula {formula / 2**20:.2f})" if formula
                            else "(dropless: as routed, no formula)"))
        lines.append(f"experts: tokens per expert min/mean/max {low:.0f}/{mean:.1f}/{high:.0f} | "
                     f"dropped {routing['dropped']:.1%} | balance loss {routing['balance_loss']:.3f} "
                     f"(1: balanced)" + exchanged)
    if hasattr(model, "measured_bubbles"):
        bubbles = history.setdefault("bubble", {})[step] = model.measured_bubbles()
        formula = BUBBLE_FORMULAS[args.schedule]
        predicted_bubble = bubble_formula(args.schedule, model.P, model.M, model.v)
        # zb: the weights whose gradients W computed here (its share of the bubble's fill)
        deferred = history.setdefault("deferred", {})[step] = (model.deferred_weights()
                                                                if args.schedule == "zb" else 0)
        stages = model.stages
        why = bubble_why(bubbles, stages, stage_seconds(model))        # "" within a compute slot
        lines.append(f"bubble per stage (the share of its step it sat idle) "
                     f"{' '.join(f'{b:.2f}' for b in bubbles)} | the lecture's {formula} = "
                     f"{predicted_bubble:.2f}{why} | activations held at most "
                     f"{model.observer.peak_activations} micro-batch{' chunks' if model.v > 1 else 'es'} on "
                     f"stage {model.stage}"
                     + (f" | W computed {deferred} weights' gradients" if args.schedule == "zb" else ""))
    if context is not None:
        idle, predicted_idle = context.idle_shares()
        history.setdefault("cp", {})[step] = cp = {
            "activation_bytes": context.activation_bytes, "kv_sent": context.kv_bytes_sent(),
            "kv_formula": context.kv_formula, "idle": idle, "predicted_idle": predicted_idle}
        kept = (f"activations kept {cp['activation_bytes'] / 2**20:.2f} MiB per rank | "
                if cp["activation_bytes"] is not None else "")
        lines.append(f"context parallel: {kept}K/V sent {cp['kv_sent'] / 2**20:.2f} MiB/step (formula "
                     f"{cp['kv_formula'] / 2**20:.2f}) | idle share of attention per rank "
                     f"{' '.join(f'{x:.2f}' for x in idle)} (causal mask's blocks: "
                     f"{' '.join(f'{x:.2f}' for x in predicted_idle)})")
    return lines


# ---- the experts (moe.py) on the mesh ------------------------------------------------------------

def build_gpt(name: str, **overrides) -> GPT:
    """model.build_model with moe.py's feed-forward: any preset, mixtures of experts included."""
    return build_model(name, feed_forward=feed_forward, **overrides)


def expert_parallel(gpt: nn.Module, comm: Comm, ep: int, groups: tuple | None = None) -> Comm:
    """Split every MoE layer of gpt over groups of ep consecutive ranks of comm (E/ep experts
    each); returns the ep group, over which the experts' squares add up in the norm. Each held
    expert is reduced over the ranks holding the same experts: its placement's holders, which
    the data-parallel wrappers read. Collective: every rank of comm. groups: (ep group, the
    ranks holding the same experts), made already (a device mesh's)."""
    ep_group, replicas = groups or make_mesh(comm, ep)
    for module in gpt.modules():
        if isinstance(module, MoE):
            module.shard_experts(ep_group)
    for expert in held_experts(gpt):
        for p in expert.parameters():
            place(p, holders=replicas)
    return ep_group


def held_experts(gpt: nn.Module) -> list[nn.Module]:
    """The expert modules this rank holds under expert parallelism (FSDP makes each a unit)."""
    return [module.experts[e] for module in gpt.modules()
            if isinstance(module, MoE) and module.ep is not None for e in module.local]


def exchange_bytes(gpt: nn.Module, options, data_size: int, context_size: int = 1,
                   micro_batches: int | None = None) -> int:
    """What every MoE layer of gpt (a pipeline stage: its own) sends per training step under
    train.py's options (each of data_size ranks a micro-batch of --batch-size / data_size /
    micro_batches rows at a time, of --seq-len / context_size tokens each: context
    parallelism's cp, times tp under sequence parallelism; micro_batches: --grad-accum's, or a
    pipeline's --microbatches). Dropless, the sizes follow the routing: not predicted (0), the
    counter measures them."""
    micro = micro_batches or options.grad_accum
    tokens = options.batch_size // data_size // micro * (options.seq_len // context_size)
    size = next(gpt.parameters()).element_size()
    return micro * sum(layer_exchange_bytes(tokens, m.router.in_features, len(m.experts), m.top_k,
                                            m.capacity_factor, m.group_size, m.ep.world_size, size)
                       for m in gpt.modules() if isinstance(m, MoE) and m.ep is not None
                       and m.capacity_factor is not None)


# ---- the pipeline's bubble: why the measured one is not the formula's -------------------------

def stage_seconds(pipeline: Pipeline) -> list[list[float]]:
    """Every stage's compute actions' seconds in its last step, in its list's order (collective
    over the pipeline: every stage runs as many, M v F's and B's, and zb's M W's)."""
    mine = torch.tensor([end - began for _, began, end in pipeline.observer.timeline], dtype=torch.float64,
                        device=pipeline.device)
    every = [torch.empty_like(mine) for _ in range(pipeline.P)]
    dist.all_gather(every, mine, group=pipeline.comm.group)          # a metric: not counted
    return [t.tolist() for t in every]


def replayed_idle(stages: list[list], seconds: list[list[float]]) -> list[float]:
    """Each stage's idle share when its compute actions take the measured `seconds` and the
    messages arrive at once: schedules.simulate's clock with the step's own times, so what the
    schedule's waits alone leave idle (lists already checked: no deadlock)."""
    P, arrived = len(stages), {}
    position, clock, done = [0] * P, [0.0] * P, [0] * P        # next action, time, actions computed
    while any(position[s] < len(stages[s]) for s in range(P)):
        for s in range(P):
            for a in stages[s][position[s]:]:
                if a.kind.startswith("recv"):
                    if message(s, a, P) not in arrived:
                        break                                        # the neighbour's turn
                    clock[s] = max(clock[s], arrived.pop(message(s, a, P)))
                elif a.kind.startswith("send"):
                    arrived[message(s, a, P)] = clock[s]
                else:
                    clock[s] += seconds[s][done[s]]
                    done[s] += 1
                position[s] += 1
    return [1 - sum(seconds[s]) / clock[s] for s in range(P)]


def bubble_why(measured: list[float], stages: list[list], seconds: list[list[float]]) -> str:
    """'' where every stage's measured idle share is within one compute slot of the schedule's
    clock (F, B, W one slot each, messages free: the formula's, per stage over its own step, as
    measured: a later stage of 1F1B finishes sooner); else why, from the step's own times. One
    slot, a mean action's share of the stage's step, is the clock's resolution: one action
    running long moves a share that much. The schedule replayed with the measured compute times
    and free messages (replayed_idle) keeps the first assumption's part, unequal compute; the
    rest, measured - replayed, is the messages' (send/recv, and the time between computations):
    the larger of the two is the reason."""
    clock = replayed_idle(stages, [[1.0] * len(s) for s in seconds])
    slot = [(1 - m) / len(s) for m, s in zip(measured, seconds)]      # one mean action's share
    if all(abs(m - c) <= one for m, c, one in zip(measured, clock, slot)):
        return ""
    replayed = replayed_idle(stages, seconds)
    messages = [m - r for m, r in zip(measured, replayed)]
    shares = lambda xs: " ".join(f"{x:.2f}" for x in xs)
    head = (f"; each stage as the schedule runs it (F, B, W a slot each, messages free: a later "
            f"stage ends sooner) idles {shares(clock)} | measured is off that by more than one slot "
            f"({shares(slot)} of the step), why: ")
    if sum(map(abs, messages)) >= sum(abs(r - c) for r, c in zip(replayed, clock)):
        return (f"{head}messages: send/recv and the time between computations take {shares(messages)} "
                f"of the step beyond the schedule's own waits (replayed with the measured compute times "
                f"and free messages it idles {shares(replayed)})")
    by_kind = {}                                     # F, B (and W): the same work on every stage
    for actions, times in zip(stages, seconds):
        for a, t in zip([a for a in actions if a.kind in COMPUTE], times):
            by_kind.setdefault(a.kind, []).append(t)
    means = ", ".join(f"{kind} {1e3 * sum(ts) / len(ts):.1f}" for kind, ts in by_kind.items())
    return (f"{head}unequal compute: with the measured compute times ({means} ms on average; the stages "
            f"computed {' and '.join(f'{1e3 * sum(s):.0f}' for s in seconds)} ms) and free messages the "
            f"schedule idles {shares(replayed)}; send/recv and the time between computations add "
            f"{shares(messages)}")
