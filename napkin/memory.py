"""Napkin math: the bytes each rank holds and sends, by strategy and precision.

napkin/memory.py is the command line: napkin/memory_math.py's formulas printed as tables, the ZeRO stages
side by side or one strategy in detail, each pipeline schedule, each context-parallel split, a
mesh's stages; and with --advise the lecture's flow chart (napkin/advisor.py), ranked by speed on a
--gpu (napkin/advisor_speed.py) and run here with --measure (napkin/experiment.py).
Run: python -m napkin.memory --params 7.5e9 --world 64 (--advise: the lecture's flow chart, napkin/advisor.py;
     --model gpt2-small --pp 4 --microbatches 8: activations and bubble per pipeline schedule;
     --model gpt2-small --cp 8: activations and K/V traffic per context-parallel rank;
     --model DIR: a Hugging Face model's directory, as train.py --init-from hf:DIR loads it)
Test: python -m pytest tests/test_memory.py (context parallelism's: tests/test_context_parallel.py)
"""
import os
import sys

from napkin import advisor
from napkin.advisor_speed import print_ranking
# the one parser (a refusal in one line), train.py's help (each default shown once, or none), the
# values its flags take; parse_count is the count --params takes
from foundations.values import HelpFormatter, Parser, count, number, whole
from foundations.values import quantity as parse_count
from context_parallel import cp_kv_bytes
from napkin.experiment import measure
from napkin.memory_math import (ALIASES, COLLECTIVES, GB, OPTIMIZERS, PRECISIONS, SHARDED, STRATEGIES, MiB,
                         _element_size, _strategy, active_params, activation_bytes, bytes_per_param,
                         cp_activation_bytes, ep_comm_bytes, ep_params, ep_state_bytes, expert_params,
                         human_bytes, logits_bytes, mesh_bytes, mesh_params, model_params, moe_exchange_bytes,
                         pipeline_activation_bytes, quantized_params, stage_blocks, state_bytes,
                         why_sent_departs)
from foundations.dtypes import REDUCE_DTYPE
from model import PRESETS
from pretrained import PretrainedError
from pretrained.load import model_config, read_config
from mechanics.pipeline_mechanics import BUBBLE_FORMULAS, bubble_formula
from extensions.schedules import SCHEDULES
from tensor_parallel import check_divisible
from composition.tensor_parallel_gpt import check_llama_divisible


def _parse_args(argv=None):
    p = Parser(prog="python -m napkin.memory", description=__doc__.split("\n")[0],
               formatter_class=HelpFormatter)
    p.add_argument("--params", type=parse_count, default=None, help="parameter count, e.g. 7.5e9 or 7B")
    p.add_argument("--model", default=None, metavar="PRESET or DIR",
                   help=f"a model preset ({', '.join(PRESETS)}), or a Hugging Face model's "
                        "directory (its config.json: GPT-2, Llama, Qwen2), as train.py "
                        "--init-from hf:DIR reads it: gives the parameter count and the "
                        "activation shapes")
    p.add_argument("--strategy", choices=STRATEGIES + tuple(ALIASES) + ("single",), default=None,
                   help="one strategy in detail (default: a table of ddp and the zero stages)")
    p.add_argument("--world", type=whole, default=1, help="N, the number of ranks")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="parameter and gradient dtype (bf16 and fp16 cost the same bytes)")
    p.add_argument("--reduce-dtype", choices=PRECISIONS, default=REDUCE_DTYPE,
                   help="dtype the gradients travel and their shards stay in, as train.py's flag "
                        "(the ZeRO paper's table: --reduce-dtype bf16 with --precision bf16)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="whose state counts: AdamW's two fp32 moments, or plain SGD's none")
    p.add_argument("--batch-size", type=count(1), default=None,
                   help="global batch in sequences, as train.py takes it (default: one per rank)")
    p.add_argument("--grad-accum", type=whole, default=1,
                   help="micro-batches per step on each rank")
    p.add_argument("--seq-len", type=count(1), default=None, help="default: the model's block size")
    p.add_argument("--trainable", type=number, default=None,
                   help="parameters that train, e.g. 4.2e6 for LoRA adapters (default: all); the "
                        "rest is frozen: no gradient, no optimizer state")
    p.add_argument("--quantize-base", choices=("nf4",), default=None,
                   help="QLoRA: the frozen base in 4-bit NormalFloat (with --trainable): a --model's "
                        "blocks' linear layers, or with --params every frozen parameter")
    p.add_argument("--double-quant", action="store_true", help="with --quantize-base: 8-bit scales")
    p.add_argument("--offload", choices=("optimizer", "params"), default=None,
                   help="ZeRO-Offload: the sharded optimizer (fp32 master, moments) in host memory; "
                        "params (zero3/fsdp): the parameter shards too (other strategies: optimizer)")
    p.add_argument("--tp", type=count(1), default=1,
                   help="tensor parallelism: with --model and --world, "
                   "beside --cp and --pp, what each rank of the mesh holds and sends by dimension")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp in a mesh: norms and "
                   "dropout on 1/tp of the tokens, a pipeline stage sending 1/tp of each activation")
    p.add_argument("--pp", type=whole, default=1,
                   help="pipeline stages: with --model, each schedule's "
                   "bubble and activations per stage")
    p.add_argument("--microbatches", type=whole, default=None,
                   help="with --pp: per step (default 2 x pp)")
    p.add_argument("--ep", type=count(1), default=1,
                   help="expert parallelism (--model with experts): each rank holds E/ep of every "
                        "MoE layer's experts, its tokens sent to them and back by all-to-all")
    p.add_argument("--cp", type=whole, default=1,
                   help="context parallelism: with --model, a rank's "
                   "activations and K/V bytes sent as each sequence splits over 1, 2, 4 ... cp ranks")
    p.add_argument("--shard-group", type=count(1), default=None, metavar="S",
                   help="with --strategy fsdp: hybrid sharding (HSDP), sharded within groups of S "
                        "ranks (one node), a copy per group; the shards' gradients all-reduced "
                        "across the copies")
    advisor.add_arguments(p)
    args = p.parse_args(argv)
    given = {dest for dest, value in vars(args).items() if value != p.get_default(dest)}
    args.cfg = _model_config(p, args.model)
    _check_ep(p, args)
    _check_shard_group(p, args)
    if args.advise:
        if args.cfg and args.seq_len is not None and not 1 <= args.seq_len <= args.cfg.block_size:
            p.error(f"--seq-len must be between 1 and model {args.model}'s block size "
                    f"{args.cfg.block_size}, got {args.seq_len}")
        if args.measure and args.model not in (None, *PRESETS):
            p.error(f"--measure runs train.py on --model's presets, not yet on --model "
                    f"{args.model}: drop --measure")
        advisor.check_args(p, args)
        _warn_ignored(given - advisor.ADVISE_READS, "--advise walks every rung itself and reads only "
                      "--model or --params, --world, --seq-len, --gpu-mem, --target-batch, --no-bf16, "
                      "--gpu, --link, --measure")
        return args

    if args.quantize_base and args.trainable is None:
        p.error("--quantize-base stores the frozen parameters in 4 bits: give --trainable, the "
                "parameters that train (the LoRA adapters)")
    if (args.params is None) == (args.model is None):
        p.error("give exactly one of --params (e.g. --params 7.5e9) or --model "
                f"({', '.join(PRESETS)})")
    if args.params is not None and (args.params < 1 or args.params != int(args.params)):
        p.error(f"--params must be a whole number of parameters, at least 1, got {args.params:g}")
    most = args.params or model_params(args.cfg)
    if args.trainable is not None and not 0 <= args.trainable <= most:
        p.error(f"--trainable {args.trainable:g} must be between 0 and the model's parameter count")
    if args.world < 1:
        p.error(f"--world must be at least 1 (the number of ranks), got {args.world}")
    if args.strategy == "single" and args.world != 1:
        p.error(f"--strategy single runs on one rank, but --world is {args.world}: "
                f"use --strategy ddp, or drop --world")
    if args.grad_accum < 1:
        p.error("--grad-accum must be at least 1")
    args.mesh = args.tp != 1 or (args.cp > 1) + (args.pp > 1) > 1     # two or more splits, or tp
    if args.pp != 1 or args.microbatches is not None:
        if args.model is None or args.pp < 1:
            p.error("--pp needs --model (the layers and activation shapes) and a count of at least 1")
        if args.microbatches is not None and args.microbatches < 1:
            p.error(f"--microbatches must be at least 1, got {args.microbatches} (default: 2 x --pp)")
        args.microbatches = args.microbatches or 2 * args.pp
        data_parallel = args.world // (args.tp * args.cp * args.pp) if args.mesh else 1
        args.batch_size = args.batch_size or args.microbatches * max(1, data_parallel)
        if args.microbatches < 1 or args.batch_size % args.microbatches:
            p.error(f"--batch-size {args.batch_size} does not split into --microbatches "
                    f"{args.microbatches} equal micro-batches: use a multiple of it")
        if args.cfg.n_layer < args.pp:
            p.error(f"--model {args.model} has {args.cfg.n_layer} blocks, fewer than --pp "
                    f"{args.pp} stages")
    if args.cp != 1 and (args.model is None or args.cp < 1):
        p.error("--cp needs --model (the layers and activation shapes) and a count of at least 1")
    if args.mesh:
        split = args.tp * args.cp * args.pp
        if args.model is None or args.tp < 1 or args.world % split:
            p.error(f"--tp {args.tp} x --cp {args.cp} x --pp {args.pp} is a mesh: give --model and a "
                    f"--world that is a multiple of {split}")
        try:                                          # as train.py refuses it (composition/mesh_checks.py)
            check_divisible(args.cfg, args.tp)
            if hasattr(args.cfg, "n_kv_head"):            # a Llama's G heads and MLP width too
                check_llama_divisible(args.cfg, args.tp)
        except ValueError as e:
            p.error(f"--model {args.model}: {e}")
    if args.sequence_parallel and not (args.mesh and args.tp > 1):
        p.error("--sequence-parallel splits a tensor group's tokens in a mesh: give --tp N, --model "
                "and --world")
    if args.offload and args.strategy in ("ddp", "single"):
        p.error(f"--offload optimizer moves a sharded optimizer to the host, and --strategy "
                f"{args.strategy} keeps it whole: use --strategy zero1, zero2 or fsdp")
    if args.offload == "params" and args.strategy in ("zero1", "zero2"):
        p.error(f"--offload params keeps FSDP's parameter shards on the host, and --strategy "
                f"{args.strategy} keeps whole parameters on the device: use --strategy fsdp")
    if args.model is not None:
        cfg = args.cfg
        args.seq_len = cfg.block_size if args.seq_len is None else args.seq_len
        if not 1 <= args.seq_len <= cfg.block_size:
            p.error(f"--seq-len must be between 1 and model {args.model}'s block size "
                    f"{cfg.block_size}, got {args.seq_len}")
        # micro-batches per step: each rank's, or in a mesh each data-parallel rank's (its --pp
        # pipeline's --microbatches)
        per_step = (args.world // (args.tp * args.cp * args.pp) * (args.microbatches or args.grad_accum)
                    if args.mesh else args.world * args.grad_accum)
        args.batch_size = per_step if args.batch_size is None else args.batch_size
        if args.batch_size < 1 or args.batch_size % per_step:
            p.error(f"--batch-size {args.batch_size} does not divide into the data-parallel ranks x "
                    f"micro-batches = {per_step} equal micro-batches: use a multiple of {per_step}")
    _warn_ignored(given & ADVISE_OPTIONS, "only --advise reads them: add --advise, or drop them")
    if args.model is None:
        _warn_ignored(given & SHAPE_OPTIONS, "activations need a shape: give --model (e.g. --model 7b) "
                      "instead of --params")
    elif args.strategy is None and not args.mesh and args.pp == args.cp == args.ep == 1:
        _warn_ignored(given & SHAPE_OPTIONS, "the table of strategies shows no activations: add "
                      "--strategy S for them")
    return args


def _model_config(p, model: str | None):
    """--model's config: a preset's, or the one a Hugging Face directory's config.json gives
    (pretrained/load.py: model.py's GPTConfig for GPT-2, a LlamaConfig for Llama and Qwen2)."""
    if model is None or model in PRESETS:
        return PRESETS.get(model)
    if not os.path.isdir(model):
        p.error(f"--model {model}: neither a preset ({', '.join(PRESETS)}) nor a directory: give "
                f"one, or a Hugging Face model's directory holding its config.json")
    try:
        return model_config(read_config(model), os.path.join(model, "config.json"))
    except PretrainedError as e:
        p.error(f"--model {e}")


# Options only some modes read: given where they are not, napkin/memory.py says so (_warn_ignored).
ADVISE_OPTIONS = {"gpu_mem", "target_batch", "bf16", "gpu", "link", "measure"}
SHAPE_OPTIONS = {"batch_size", "seq_len", "grad_accum"}        # a micro-batch's activations


def _warn_ignored(dests: set, why: str):
    """One line on stderr naming the options given (dests) that this run does not read."""
    if dests:
        flags = sorted("--no-bf16" if d == "bf16" else "--" + d.replace("_", "-") for d in dests)
        print(f"memory.py: warning: {', '.join(flags)} ignored: {why}", file=sys.stderr)


def _check_ep(p, args):
    """--ep: a model with experts, split evenly over a world it divides, every parameter trained."""
    if args.ep == 1:
        return
    with_experts = [name for name, cfg in PRESETS.items() if cfg.experts]
    cfg = args.cfg
    if args.advise:
        p.error("--advise prints the first rung that fits under every --ep that splits the "
                "experts: drop --ep")
    if cfg is None or not cfg.experts:
        p.error(f"--ep splits a model's experts: give --model {' or '.join(with_experts)}")
    if args.ep < 1 or args.world % args.ep or cfg.experts % args.ep:
        p.error(f"--ep {args.ep} splits the {cfg.experts} experts over groups of {args.ep} of the "
                f"--world {args.world} ranks: use an --ep dividing both")
    if args.trainable is not None:
        p.error("--ep with --trainable: LoRA keeps the experts whole on every rank (train.py "
                "refuses --ep with --lora)")


def _check_shard_group(p, args):
    """--shard-group S: one fsdp breakdown, S dividing the ranks that shard (beside --ep, the
    experts are sharded over the ranks holding each, not copied)."""
    if args.shard_group is None:
        return
    if args.strategy not in ("fsdp", "zero3"):
        p.error(f"--shard-group {args.shard_group} is hybrid sharding, a layout of FSDP's shards: "
                f"give --strategy fsdp")
    ranks = args.world // (args.tp * args.pp)    # FSDP shards over dp x cp: one slice of a stage
    if args.shard_group < 1 or ranks % args.shard_group:
        p.error(f"--shard-group {args.shard_group} must divide the {ranks} ranks that shard (--world "
                f"{args.world} / --tp {args.tp} / --pp {args.pp}) into equal groups: use a divisor "
                f"of {ranks} (the ranks of one node, e.g.)")


def _predict(n_params, strategy, args):
    """state_bytes and comm_bytes for the command line's choices, and why the bytes sent depart
    from the lecture's rule ("" where they do not; not priced under --ep). --offload applies to the
    sharded strategies. --shard-group S (zero3): held as zero3 over S ranks, sent as HSDP.
    Under --ep a rank holds E/ep of each MoE layer's experts (ep_state_bytes, ep_comm_bytes)
    and sends its micro-batches' tokens to them and back (moe_exchange_bytes)."""
    trainable = None if args.trainable is None else int(args.trainable)
    # A preset's frozen base in 4 bits is its blocks' matrices (quantized_params); --params has no
    # shape: every frozen parameter counted as 4-bit, an upper bound on the saving.
    untrained = n_params - (trainable or 0)
    quantized = (0 if not args.quantize_base else untrained if args.model is None
                 else min(untrained, quantized_params(args.cfg)))
    canonical = _strategy(strategy, args.world)
    experts = 0
    if args.ep > 1:
        n_params, experts = ep_params(args.cfg, args.ep)
    frozen = dict(trainable=trainable, quantized=quantized, double_quant=args.double_quant)
    held = ep_state_bytes(n_params, experts, strategy, args.precision, args.world, args.ep,
                          args.optimizer, shard_group=args.shard_group, **frozen,
                          reduce_precision=args.reduce_dtype, offload=(False if canonical == "ddp" else args.offload if canonical == "zero3"
                                   else bool(args.offload)))
    sent = ep_comm_bytes(n_params, experts, strategy, args.precision, args.world, args.ep, **frozen,
                         shard_group=args.shard_group, reduce_precision=args.reduce_dtype)
    why = ""
    if args.ep > 1:
        sent["all_to_all"] = moe_exchange_bytes(args.cfg, _micro_batch_tokens(args),
                                                args.ep, args.precision, args.grad_accum)
    elif strategy != "single":
        why = why_sent_departs(n_params, strategy, args.precision, args.world, **frozen,
                               shard_group=args.shard_group, reduce_precision=args.reduce_dtype)
    return held, sent, why


def _micro_batch_tokens(args) -> int:
    return args.batch_size // (args.world * args.grad_accum) * args.seq_len


def _moe_lines(args) -> list:
    """A model with experts: its parameters in all and per token, and what --ep splits and sends."""
    cfg = args.cfg
    if cfg is None or not cfg.experts:
        return []
    total, active = model_params(cfg), active_params(cfg)
    lines = [f"{args.model}: {cfg.experts} experts per block, top-{cfg.top_k}: a token computes with "
             f"{active:,} of the {total:,} parameters ({active / total:.0%}); the experts hold "
             f"{expert_params(cfg):,}"]
    if args.ep > 1:
        held, experts = ep_params(cfg, args.ep)
        capacity = ("dropless: the all-to-all sizes follow the routing, estimated balanced"
                    if cfg.capacity_factor is None else
                    f"capacity factor {cfg.capacity_factor:g}: a fixed buffer of E x K slots")
        lines.append(f"--ep {args.ep}: a rank holds {cfg.experts // args.ep} of each block's "
                     f"{cfg.experts} experts, {held:,} parameters in all ({experts:,} in experts); per "
                     f"block and micro-batch of {_micro_batch_tokens(args)} tokens it sends 4 "
                     f"all-to-alls ({capacity})")
    return lines


def _reduced_in(args) -> str:
    """The headers' note of --reduce-dtype where it is not the --precision (train.py's default)."""
    return "" if args.reduce_dtype == args.precision else f" (gradients averaged in {args.reduce_dtype})"


def _table(n_params, args):
    """One row per strategy: the ZeRO paper's figure 1, plus bytes sent per step."""
    per_param = bytes_per_param(args.precision, args.optimizer)
    # GB for models the paper talks about; a laptop-sized model reads better in MiB.
    big = n_params * sum(per_param.values()) >= GB
    unit, name = (GB, "GB (1 GB = 1e9 bytes, the ZeRO paper's unit)") if big else (
        MiB, "MiB (1 MiB = 2**20 bytes, as train.py logs)")
    print(f"{n_params:,} parameters on {args.world} ranks, {args.precision}{_reduced_in(args)} with "
          f"{args.optimizer}: "
          f"{per_param['params']} + {per_param['grads']} + {per_param['optimizer']} = "
          f"{sum(per_param.values())} bytes per parameter before sharding")
    for line in _moe_lines(args):
        print(line)
    print(f"per rank, in {name}; sent: ring algorithm, per step"
          + ("; --offload: the zero stages' optimizer in host memory (ddp cannot)" if args.offload else "")
          + ("; params: zero3's parameter shards too" if args.offload == "params" else ""))
    host = f"{'host':>9}" if args.offload else ""
    print(f"{'strategy':<9}{'params':>9}{'grads':>9}{'optimizer':>11}{'total':>9}{host} |{'sent':>8}  collectives")
    for strategy in STRATEGIES:
        held, sent, why = _predict(n_params, strategy, args)
        host = f"{held['host'] / unit:9.2f}" if "host" in held else f"{'-':>9}" if args.offload else ""
        print(f"{strategy:<9}{held['params'] / unit:9.2f}{held['grads'] / unit:9.2f}"
              f"{held['optimizer'] / unit:11.2f}{held['total'] / unit:9.2f}{host} |"
              f"{sum(sent.values()) / unit:8.2f}  {COLLECTIVES[strategy]}"
              + (" + all-to-all" if "all_to_all" in sent else "") + why)


def _breakdown(n_params, args):
    """One strategy in detail: what a rank holds, activations included, and what it sends."""
    strategy, n = args.strategy, args.world
    held, sent, why = _predict(n_params, strategy, args)
    canonical = _strategy(strategy, n)
    experts = f", its experts 1/{n // args.ep}" if args.ep > 1 else ""    # over the ranks holding them
    S = args.shard_group or n
    how = [f"1/{S} shard{experts}" if s else "full" for s in SHARDED[canonical]]
    hybrid = f", sharded over groups of {S} (HSDP), {n // S} copies" if S < n else ""
    row = lambda label, value: print(f"  {label:<44}{value:>16,}{value / MiB:12.2f}{value / GB:10.3f}")
    print(f"{args.model or 'model'}: {n_params:,} parameters | {strategy} on {n} rank(s){hybrid} | "
          f"{args.precision} parameters and gradients{_reduced_in(args)}, {args.optimizer}")
    for line in _moe_lines(args):
        print(line)
    print(f"per rank{'bytes':>54}{'MiB':>12}{'GB':>10}   (MiB = 2**20 bytes, as train.py logs; GB = 1e9)")
    row(f"parameters ({how[0]})", held["params"])
    row(f"gradients ({how[1]})", held["grads"])
    row(f"optimizer state ({how[2]}{', offloaded' if 'host' in held else ''})", held["optimizer"])
    totals = {"": held["total"]}
    if args.model is not None:
        cfg = args.cfg
        b, s = args.batch_size // (n * args.grad_accum), args.seq_len
        value = _element_size(args.precision)
        shape = dict(seq_len=s, batch=b, hidden=cfg.n_embd, heads=cfg.n_head, layers=cfg.n_layer,
                     bytes_per_value=value, moe=cfg, ep=args.ep)
        full, ckpt = activation_bytes(**shape), activation_bytes(**shape, checkpointing=True)
        logits = logits_bytes(s, b, cfg.vocab_size)
        print(f"  activations: micro-batch b={b} per rank, s={s}, {cfg.n_layer} layers, "
              f"{value}-byte values" + ("; a Llama's blocks by GPT's formula at its C and heads "
                                        "(SwiGLU and rotary keep other tensors)"
                                        if hasattr(cfg, "n_kv_head") else ""))
        row("activations, L x (sbh(15 + 5as/h) + MoE MLP)" if cfg.experts else
            "activations, L x sbh(34 + 5as/h)", full)
        row("activations checkpointed, L x 2sbh + 1 layer", ckpt)
        row("logits kept by the loss (4 sbV, fp32)", logits)
        totals = {"": held["total"] + full + logits,
                  " with checkpointing": held["total"] + ckpt + logits}
    for suffix, value in totals.items():
        row(f"total{suffix}", value)
    if "host" in held:
        row("host: fp32 master, moments, gradient copy", held["host"])
    print(f"sent per rank per step (ring algorithm): "
          f"{'nothing, one rank' if strategy == 'single' else COLLECTIVES[canonical]}"
          + (f" within a group of {S}, + all-reduce of the gradient shard over the {n // S} copies"
             if S < n else "")
          + (" + all-to-all (the tokens to their experts and back)" if "all_to_all" in sent else "")
          + why)
    for name, value in sent.items():
        row(name, value)
    row("total sent", sum(sent.values()))


def _pipeline_table(args):
    """--pp P: each schedule's bubble and the activations its stages hold at their peak."""
    cfg, P, M = args.cfg, args.pp, args.microbatches
    b = args.batch_size // M
    print(f"{args.model} cut into {P} pipeline stages, {M} micro-batches of {b} x {args.seq_len} "
          f"tokens, {_element_size(args.precision)}-byte activations; bubble on schedules.py's "
          f"clock (F, B, W one slot each), activations per stage at its peak (MiB)")
    print(f"{'schedule':<16}{'bubble':>8}  {'formula':<16}" + "".join(f"{f'stage {s}':>11}" for s in range(P)))
    for name in SCHEDULES:
        for v in ((2, 4) if name == "interleaved" else (1,)):
            try:
                peaks = pipeline_activation_bytes(cfg, name, P, M, b, args.seq_len, v,
                                                  _element_size(args.precision))
            except ValueError as e:                       # interleaved: M or P it cannot run
                print(f"{name + (f' v={v}' if v > 1 else ''):<16}  {e}")
                continue
            print(f"{name + (f' v={v}' if v > 1 else ''):<16}{bubble_formula(name, P, M, v):8.3f}  "
                  f"{BUBBLE_FORMULAS[name]:<16}" + "".join(f"{p / MiB:11.1f}" for p in peaks))


def _cp_table(args):
    """--cp N: what one rank keeps and sends as every sequence splits over 1, 2, 4 ... N ranks
    (context_parallel.py), ring attention beside all-gather K/V."""
    cfg, s, value = args.cfg, args.seq_len, _element_size(args.precision)
    kv = cfg.n_kv_head * cfg.D if hasattr(cfg, "n_kv_head") else cfg.n_embd   # a Llama's G x D
    b = args.batch_size // args.grad_accum                 # a cp group's ranks read the same rows
    print(f"{args.model}: {cfg.n_layer} layers, micro-batch {b} x {s} tokens split over cp ranks, "
          f"{value}-byte activations; per rank, MiB: activations kept (sbh(34 + 5as/h) at s/cp "
          f"tokens, memory_math.cp_activation_bytes) and K/V sent per layer and micro-batch, forward + "
          f"backward (context_parallel.cp_kv_bytes)")
    print(f"{'cp':>4}{'activations ring':>18}{'all-gather':>12}{'K/V sent ring':>15}{'all-gather':>12}")
    for cp in sorted({2 ** i for i in range(args.cp.bit_length()) if 2 ** i <= args.cp} | {args.cp}):
        shape = dict(seq_len=s, batch=b, hidden=cfg.n_embd, heads=cfg.n_head, layers=cfg.n_layer, cp=cp,
                     bytes_per_value=value)
        kept = [cp_activation_bytes(**shape, attention=a) for a in ("ring", "allgather")]
        sent = [sum(cp_kv_bytes(s, b, kv, cp, a, value).values()) for a in ("ring", "allgather")]
        print(f"{cp:>4}{kept[0] / MiB:18.1f}{kept[1] / MiB:12.1f}{sent[0] / MiB:15.2f}{sent[1] / MiB:12.2f}")


def _mesh_table(args):
    """--tp, --cp, --pp over --world: each pipeline stage's rank 0, what it holds and what it sends
    per step by dimension (mesh_params, state_bytes over dp x cp, mesh_bytes)."""
    cfg, tp, cp, pp = args.cfg, args.tp, args.cp, args.pp
    dp = args.world // (tp * cp * pp)
    strategy = {"fsdp": "zero3"}.get(args.strategy or "ddp", args.strategy or "ddp")
    micro = args.microbatches if pp > 1 else args.grad_accum
    over = (f"groups of {args.shard_group} of dp x cp = {dp * cp} (HSDP)" if args.shard_group
            else f"dp x cp = {dp * cp}")
    trainable = None if args.trainable is None else int(args.trainable)
    frozen = ("" if trainable is None else
              f"; --trainable {trainable:,} counted whole on every rank (an upper bound: tp "
              f"splits one factor of each adapter, a stage holds its own)"
              + (", the stage's frozen matrices in 4 bits, split over tp" if args.quantize_base
                 else ""))
    print(f"{args.model} on {args.world} ranks = tp {tp} x cp {cp} x pp {pp} x dp {dp}, {strategy} over "
          f"{over}, global batch {args.batch_size} x {args.seq_len}, {micro} micro-batches, "
          f"{args.precision}; per rank, MiB: held (parameters + gradients + optimizer) and sent "
          f"per step{frozen}")
    print(f"{'stage':>5}{'params':>12}{'held':>10}" + "".join(f"{d + ' sent':>11}" for d in ("tp", "cp", "pp", "dp")))
    for stage in range(pp):
        blocks = stage_blocks(cfg.n_layer, pp, stage)
        n_params = mesh_params(cfg, tp, blocks, first=stage == 0, last=stage == pp - 1)
        # QLoRA: this stage's blocks' 4-bit matrices, each split over tp (lora.quantize_split)
        quantized = (quantized_params(cfg) // cfg.n_layer * blocks // tp if args.quantize_base
                     else 0)
        held = state_bytes(n_params + (trainable or 0), strategy, args.precision,
                           args.shard_group or dp * cp, trainable=trainable, quantized=quantized,
                           double_quant=args.double_quant)["total"]
        sent = mesh_bytes(cfg, args.batch_size // dp, args.seq_len, tp, cp, pp, dp, micro,
                          args.precision, stage, strategy=strategy, shard_group=args.shard_group,
                          sequence_parallel=args.sequence_parallel)
        print(f"{stage:>5}{n_params:>12,}{held / MiB:10.1f}"
              + "".join(f"{sent.get(d, 0) / MiB:11.2f}" for d in ("tp", "cp", "pp", "dp")))


def print_advice(args):
    """Every rung tried, bytes per rank, and the train.py command of the first that fits."""
    gpu_mem, cfg = args.gpu_mem, args.shape
    seq_len = args.seq_len or cfg.block_size
    precision = "bf16" if args.bf16 else "fp16"
    preset = args.model in PRESETS
    rungs = advisor.advise(args.model if preset else cfg, gpu_mem, args.world, seq_len,
                           args.target_batch, precision)
    name = args.model or next((n for n, preset in PRESETS.items() if preset == cfg), None)
    if args.params is not None:
        print(f"--params {int(args.params):,} names no shape: assuming the 7b preset's proportions "
              f"(heads of {advisor.HEAD_DIM}, as many layers as heads) at the nearest count: "
              f"{advisor.describe_shape(cfg)}" + (f" (preset {name})" if name else ""))
    active = (f", {active_params(cfg):,} of them active per token: top-{cfg.top_k} of "
              f"{cfg.experts} experts" if cfg.experts else "")
    print(f"{name or 'the assumed shape'} ({model_params(cfg):,} parameters{active}) on {args.world} GPU(s) "
          f"of {human_bytes(gpu_mem)}, seq len {seq_len}, target batch {args.target_batch}, "
          f"{precision} (mixed precision, fp32 masters); fits = under 90% of the memory")
    print("activations are one micro-batch's (b sequences per rank): --grad-accum adds none")
    # GB for what the lecture's GPUs hold; a laptop-sized model reads better in MiB.
    unit, label = (GB, "GB") if rungs[0].held["total"] >= GB else (MiB, "MiB")
    print(f"{'rung':<55}{'b':>4}{'params':>9}{'grads':>9}{'optim':>9}{'activ.':>9}{'total ' + label:>10}")
    for a in rungs:
        h = a.held
        print(f"{a.rung:<55}{a.micro_batch:>4}{h['params'] / unit:9.2f}{h['grads'] / unit:9.2f}"
              f"{h['optimizer'] / unit:9.2f}{h['activations'] / unit:9.2f}{h['total'] / unit:10.2f}  "
              + ("fits" + (f" (+{human_bytes(h['host'])} in CPU memory)" if "host" in h else "")
                 if a.fits else "too big"))
    chosen = rungs[-1]
    if not chosen.fits:
        print("nothing fits: more GPUs, a smaller --seq-len, or a smaller model")
        return
    launch = "python" if args.world == 1 else f"torchrun --nproc_per_node {args.world}"
    argv = chosen.argv(name or "SHAPE", precision, seq_len, args.target_batch)
    if args.model and not preset:                # a Hugging Face directory: train.py loads it
        at = argv.index("--model")
        argv[at:at + 2] = ["--init-from", f"hf:{args.model}"]
    print(f"\n{launch} train.py {' '.join(argv)}"
          + ("" if name else "   # train.py builds presets only: add this shape to model.PRESETS")
          + ("   # LoRA fine-tunes a trained model: add --init-from RUN_DIR"
             if "--lora" in argv and preset else ""))
    if cfg.experts:
        advisor.print_expert_parallel(cfg, chosen, args.world, seq_len, precision, gpu_mem, unit)
    if args.machine:
        print_ranking(cfg, args.machine, args.world, seq_len, args.target_batch, precision, gpu_mem)
    if args.measure:
        return measure(args)


def main(argv=None):
    args = _parse_args(argv)
    if args.advise:
        return print_advice(args)
    if args.mesh:
        return _mesh_table(args)
    if args.pp > 1:
        return _pipeline_table(args)
    if args.cp > 1:
        return _cp_table(args)
    n_params = model_params(args.cfg) if args.model is not None else int(args.params)
    if args.strategy is None:
        _table(n_params, args)
    else:
        _breakdown(n_params, args)


if __name__ == "__main__":
    main()
