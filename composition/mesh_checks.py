"""composition/mesh_checks.py: the command line's checks of where strategies meet, beside composition/parallelize.py.

running/cli.py checks each option on its own; these check the combinations composition/parallelize.py composes: a
mesh whose sizes divide the world (tensor x context x pipeline x data), heads and vocabulary that
split over --tp, layers that split into --pp stages, a sequence that splits over --cp (and its
zigzag halves, and sequence parallelism's parts), experts that split over --ep, HSDP's shard
groups, zero bubble's W with something to compute on every stage. Each stops every rank with one
line naming the flag and the fix, before any work (cli.check_args calls them).
Test: python -m pytest tests/test_train.py -k bad
"""
import dataclasses
import math

import context_parallel
from extensions import schedules
import tensor_parallel
from composition.tensor_parallel_gpt import check_llama_divisible
from model import PRESETS
from pretrained.llama import LlamaConfig
from mechanics.pipeline_mechanics import split_layers

# --strategy tp, pipeline and cp: ddp over the data dimension, with that dimension split even at
# size 1.
SPLIT_BY = {"tp": "tp", "pipeline": "pp", "cp": "cp"}


def mesh_splits(args) -> dict:
    """{dimension: size} of the dimensions this run splits the model or its sequences over: tp
    (matrices), cp (sequences), pp (stages); a --strategy tp, pipeline or cp splits its own."""
    return {d: getattr(args, d) for d in ("tp", "cp", "pp")
            if getattr(args, d) > 1 or SPLIT_BY.get(args.strategy) == d}


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """The run's parallel layout, computed once from the command line (torchtitan's ParallelDims):
    how many ranks each dimension spans, and which dimensions split the model or its sequences.
    dp x tp x cp x pp is the world; ep runs inside dp x cp."""
    world: int
    dp: int
    tp: int
    cp: int
    pp: int
    ep: int
    splits: dict             # {dimension: size}: mesh_splits, the ones this run splits over

    @classmethod
    def from_args(cls, args, world: int) -> "ParallelDims":
        """The layout of args over a world of `world` ranks (running/cli.py has checked that it divides)."""
        splits = mesh_splits(args)
        tp, cp, pp = (splits.get(d, 1) for d in ("tp", "cp", "pp"))
        return cls(world, world // (tp * cp * pp), tp, cp, pp, args.ep, splits)

    @property
    def tp_enabled(self) -> bool:
        return "tp" in self.splits

    @property
    def cp_enabled(self) -> bool:
        return "cp" in self.splits

    @property
    def pp_enabled(self) -> bool:
        return "pp" in self.splits


def check_split_given(parser, args, world_size, dim: str, does: str):
    """--strategy tp, pipeline or cp over several ranks names its split's size: at --tp (--pp,
    --cp) 1 it would run, without a word, as plain data parallelism (ddp)."""
    if SPLIT_BY.get(args.strategy) == dim and getattr(args, dim) == 1 < world_size:
        n = min(d for d in range(2, world_size + 1) if world_size % d == 0)
        parser.error(f"--strategy {args.strategy} {does} --{dim} N ranks: add --{dim} N, N "
                     f"dividing the world size {world_size} (e.g. --{dim} {n}); at --{dim} 1 it is "
                     f"--strategy ddp")


def model_shape(args):
    """The config of the model the run trains: a Hugging Face directory's (args.hf_config, read
    by running/cli.py), else --model's preset with the MoE flags' overrides."""
    return (getattr(args, "hf_config", None)
            or dataclasses.replace(PRESETS[args.model], **moe_config(args)))


def model_name(args) -> str:
    """The flag that gave the model, for a refusal's line."""
    return f"hf:{args.hf}" if getattr(args, "hf_config", None) else f"--model {args.model}"


def moe_config(args) -> dict:
    """The model config fields the MoE flags override (build_model's keyword arguments)."""
    given = {"experts": args.experts, "top_k": args.top_k, "aux_loss_weight": args.aux_loss_weight,
             "z_loss_weight": args.z_loss_weight, "routing_group": args.routing_group}
    config = {name: value for name, value in given.items() if value is not None}
    if args.capacity_factor is not None:
        config["capacity_factor"] = args.capacity_factor or None      # 0: dropless, None
    return config


def check_experts(parser, args, world_size):
    """--experts, --top-k, --capacity-factor, --aux-loss-weight, --z-loss-weight, --routing-group,
    --ep: a router the model can have, and experts the world can split."""
    cfg = model_shape(args)
    if cfg.experts < 0:
        parser.error(f"--experts must be 0 (a dense model) or more, got {cfg.experts}")
    if not cfg.experts:
        if any(v is not None for v in (args.top_k, args.capacity_factor, args.aux_loss_weight,
                                       args.z_loss_weight, args.routing_group)) or args.ep != 1:
            parser.error(f"--top-k, --capacity-factor, --aux-loss-weight, --z-loss-weight, "
                         f"--routing-group and --ep "
                         f"configure experts, and model {args.model} has none: add --experts E or "
                         f"use --model tiny-moe")
        return
    # Beside --tp and --pp, the experts split over the data x context ranks holding the same
    # slice of the same stage (process_groups.make_device_mesh).
    ranks = max(1, world_size // (args.tp * args.pp))
    where = (f"the {world_size} ranks" if ranks == world_size else
             f"the {ranks} data x context ranks (world {world_size} / --tp {args.tp} / --pp {args.pp})")
    if args.ep < 1 or ranks % args.ep or cfg.experts % args.ep:
        parser.error(f"--ep {args.ep} splits the {cfg.experts} experts over groups of {args.ep} of "
                     f"{where}: use an --ep (1 or more) dividing both")
    if args.ep > 1 and (args.strategy not in ("ddp", "zero1", "zero2", "fsdp", "zero3") or args.lora):
        parser.error(f"--ep {args.ep}: expert parallelism runs under --strategy ddp, zero1, zero2 "
                     f"or fsdp, without --lora (the experts stay whole, frozen or not)")
    # A micro-batch's tokens: its rows (a data rank's share, per --grad-accum or pipeline
    # micro-batch) x --seq-len; context parallelism checks its chunks of a sequence itself.
    rows = args.batch_size // max(1, world_size // (args.tp * args.pp * args.cp))
    micro, flag = ((args.microbatches or 2 * args.pp, "--microbatches") if "pp" in mesh_splits(args)
                   else (args.grad_accum, "--grad-accum"))
    tokens = rows // micro * args.seq_len
    if args.routing_group is not None and not (1 <= args.routing_group and tokens % args.routing_group == 0):
        parser.error(f"--routing-group {args.routing_group} must divide the {tokens} tokens of a "
                     f"rank's micro-batch (--batch-size / data-parallel ranks / {flag} x --seq-len)")
    if not 1 <= cfg.top_k <= cfg.experts:
        parser.error(f"--top-k {cfg.top_k} must be between 1 and the {cfg.experts} experts")
    if args.capacity_factor is not None and not 0 <= args.capacity_factor < math.inf:
        parser.error(f"--capacity-factor must be positive, or 0 for dropless routing; got "
                     f"{args.capacity_factor}: give a finite factor such as 1.25 (the default), or 0")
    if args.aux_loss_weight is not None and not 0 <= args.aux_loss_weight < math.inf:
        parser.error(f"--aux-loss-weight must be 0 (off) or positive, got {args.aux_loss_weight}")
    if args.z_loss_weight is not None and not 0 <= args.z_loss_weight < math.inf:
        parser.error(f"--z-loss-weight must be 0 (off) or positive, got {args.z_loss_weight}")
    # Sequence parallelism: each tensor rank routes its own --seq-len / cp / tp tokens of each
    # sequence (tensor_parallel.py), in groups inside them, the groups one process routes.
    part = args.seq_len // args.cp // args.tp
    if args.sequence_parallel and (cfg.routing_group is None or part % cfg.routing_group):
        parser.error(f"--sequence-parallel with experts: each tensor rank routes its own {part} tokens "
                     f"of a sequence, so route them in groups inside those: give a --routing-group "
                     f"dividing {part}, e.g. --routing-group {part}")


def check_mesh(parser, args, world_size):
    """--tp, --cp and --pp together: one mesh (process_groups.make_device_mesh), the world their
    product x the data-parallel ranks, each combination one this project builds."""
    splits = mesh_splits(args)
    if not splits:
        return
    if args.sequence_parallel and "cp" in splits and args.seq_len // args.cp % args.tp:
        parser.error(f"--sequence-parallel with --cp {args.cp}: each rank's {args.seq_len // args.cp} "
                     f"tokens of a sequence split further into --tp {args.tp} equal parts: use a "
                     f"--seq-len divisible by {args.cp * args.tp}")
    product = math.prod(max(1, getattr(args, d)) for d in ("tp", "cp", "pp"))
    if len(splits) > 1 and world_size % product:
        parser.error(f"world size {world_size} is not {' x '.join(f'--{d} {n}' for d, n in splits.items())}"
                     f" x a data-parallel size: launch a multiple of {product} processes")


def check_tensor_parallel(parser, args, world_size):
    """--tp and --sequence-parallel: splitting the world and the model."""
    if "tp" not in mesh_splits(args):
        if args.sequence_parallel:
            parser.error("--sequence-parallel splits the tokens of a tensor-parallel group: add --tp N")
        return
    check_split_given(parser, args, world_size, "tp", "splits every matrix over")
    if world_size % args.tp:
        parser.error(f"world size {world_size} is not --tp {args.tp} x a data-parallel size: launch "
                     f"a multiple of {args.tp} processes (--nproc_per_node), or use a --tp dividing "
                     f"{world_size}")
    cfg = model_shape(args)
    try:
        tensor_parallel.check_divisible(cfg, args.tp)
        if isinstance(cfg, LlamaConfig):
            check_llama_divisible(cfg, args.tp)
    except ValueError as e:
        parser.error(f"{model_name(args)}: {e}")
    if args.sequence_parallel and args.seq_len % args.tp:
        parser.error(f"--sequence-parallel splits each sequence into --tp {args.tp} equal parts: "
                     f"use a --seq-len divisible by {args.tp}, e.g. {args.seq_len // args.tp * args.tp or args.tp}")


def check_shard_group(parser, args, world_size):
    """--shard-group S: fsdp only, S dividing the data x context ranks (experts beside it are
    sharded over the ranks holding each, not copied)."""
    if args.shard_group is None:
        return
    if args.strategy not in ("fsdp", "zero3"):
        parser.error(f"--shard-group {args.shard_group} is hybrid sharding, a layout of FSDP's shards: "
                     f"use --strategy fsdp (--strategy {args.strategy} has none)")
    # Beside --tp and --pp, FSDP shards over the dp x cp ranks holding the same slice of a stage.
    ranks = world_size // (args.tp * args.pp)
    if args.shard_group < 1 or ranks % args.shard_group:
        where = (f"the world size {world_size}" if ranks == world_size else
                 f"the {ranks} data x context ranks (world {world_size} / --tp {args.tp} / --pp {args.pp})")
        parser.error(f"--shard-group {args.shard_group} must divide {where} into equal groups: use a "
                     f"divisor of {ranks} (the ranks of one node, e.g.)")


def check_pipeline(parser, args, world_size):
    """--pp, --microbatches, --schedule, --stage-layers: a split the world and the model allow."""
    if "pp" not in mesh_splits(args):
        if (args.microbatches is not None or args.stage_layers is not None
                or args.schedule is not None or args.virtual_stages is not None):
            parser.error(f"--microbatches, --schedule, --virtual-stages and --stage-layers cut the "
                         f"model into stages: add --pp N (--strategy {args.strategy} without it runs "
                         f"the whole model on every rank)")
        return
    check_split_given(parser, args, world_size, "pp", "cuts the blocks into stages over")
    args.schedule = args.schedule or "1f1b"
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule == "interleaved" else 1
    if args.pp < 1 or world_size % args.pp:
        parser.error(f"world size {world_size} is not --pp {args.pp} x a data-parallel size: launch "
                     f"a multiple of {args.pp} processes (--nproc_per_node), or use a --pp dividing "
                     f"{world_size}")
    if args.microbatches is None:
        args.microbatches = 2 * args.pp
    if args.microbatches < 1:
        parser.error(f"--microbatches must be at least 1, got {args.microbatches}")
    if args.grad_accum != 1:
        parser.error("--grad-accum: a pipeline accumulates its gradients over its micro-batches "
                     "already; use --microbatches instead")
    cfg = model_shape(args)
    check_zero_bubble(parser, args)
    try:
        schedules.make_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
        stage_layers(args.stage_layers, cfg.n_layer, args.pp, args.virtual_stages)
    except ValueError as e:
        parser.error(f"{model_name(args)}: {e}" if "blocks" in str(e) else str(e))


def stage_layers(option: str | None, n_layer: int, P: int, v: int = 1) -> list[list[range]]:
    """Each stage's chunks of blocks (one chunk unless interleaved: stage s holds chunks s, s + P,
    ...) from --stage-layers "N,N,..." (blocks per chunk; None: balanced, pipeline_mechanics.split_layers)."""
    try:
        sizes = [int(n) for n in option.split(",")] if option else None
    except ValueError:
        raise ValueError(f"--stage-layers {option}: give whole numbers separated by commas, one "
                         f"per {'chunk' if v > 1 else 'stage'}") from None
    chunks = split_layers(n_layer, P, sizes, v)
    return [chunks[s::P] for s in range(P)]


def check_zero_bubble(parser, args):
    """--schedule zb splits each backward: B now, W (the trained weights' gradients) later, on
    every stage. Every stage holds blocks, whose linears train, unless --lora freezes them: then
    some adapter must sit in every block (experts are never adapted, so up and down adapt none
    in a mixture's blocks)."""
    if args.schedule != "zb" or not args.lora:
        return
    experts = model_shape(args).experts
    in_every_block = {"query", "key", "value", "output"} | (set() if experts else {"up", "down"})
    if not in_every_block & set(args.lora_targets.split(",")):
        parser.error(f"--schedule zb with --lora: W computes the adapters' gradients, and --lora-targets "
                     f"{args.lora_targets} leaves some stage without one; add a linear of every block "
                     f"to --lora-targets ({', '.join(sorted(in_every_block))}), or use --schedule 1f1b")


def check_context_parallel(parser, args, world_size):
    """--cp, --cp-attention, --cp-balance: a split the world and the sequence allow."""
    if "cp" not in mesh_splits(args):
        if args.cp_attention is not None or args.cp_balance is not None:
            parser.error(f"--cp-attention and --cp-balance split sequences over ranks: add --cp N "
                         f"(--strategy {args.strategy} without it gives every rank whole sequences)")
        return
    check_split_given(parser, args, world_size, "cp", "splits each sequence over")
    args.cp_attention = args.cp_attention or "ring"
    args.cp_balance = args.cp_balance or "zigzag"
    if args.cp < 1 or world_size % args.cp:
        parser.error(f"world size {world_size} is not --cp {args.cp} x a data-parallel size: launch "
                     f"a multiple of {args.cp} processes (--nproc_per_node), or use a --cp dividing "
                     f"{world_size}")
    chunks = context_parallel.SequenceSplit(args.cp, args.cp_balance == "zigzag").n_chunks
    if args.seq_len % chunks:
        per_rank = "two chunks per rank" if args.cp_balance == "zigzag" else "one chunk per rank"
        parser.error(f"--cp {args.cp} with --cp-balance {args.cp_balance} cuts each sequence into "
                     f"{chunks} equal chunks ({per_rank}): use a --seq-len divisible by {chunks}, "
                     f"e.g. {args.seq_len // chunks * chunks or chunks}")
    if args.dropout:
        parser.error("--dropout: context-parallel attention has no dropout (its masks would have to "
                     "be drawn again block by block in backward): use --dropout 0 with --cp")
    # A router sees this rank's tokens only: groups inside one chunk of a sequence are the same
    # tokens one process routes together, so the routing (capacity, balance loss) is its own.
    cfg, chunk = model_shape(args), args.seq_len // chunks
    if cfg.experts and (cfg.routing_group is None or chunk % cfg.routing_group):
        parser.error(f"--cp {args.cp} with experts: each rank routes its own tokens, so route them in "
                     f"groups inside one chunk of a sequence: give a --routing-group dividing the "
                     f"{chunk} tokens of a chunk (--seq-len / {chunks}), e.g. --routing-group {chunk}")
