"""The flow chart's rungs ranked by speed: each that fits, at its largest micro-batch, priced by
napkin/step_time.py on a named machine (napkin/memory.py --advise --gpu h100-sxm --link nvlink).

advisor.advise takes the first rung that fits; a later rung can be faster: sharding or
offloading frees memory for a larger micro-batch, and fewer micro-batches per step mean fewer
of the per-micro-batch costs that accumulation repeats (ZeRO-2's and FSDP's reduce-scatters
every micro-batch, FSDP's gathers, a small micro-batch's compute too short to hide them).
A rung's step: grad_accum micro-batches of world x b sequences, each its forward, backward and
what of its communication compute does not hide, then once per step DDP's all-reduce (no_sync),
ZeRO-2's all-gather, the optimizer and ZeRO-Offload's transfers (step_time.predict prices one
micro-batch and the step's once-only parts). Parameter offload adds each micro-batch's copies
of the rank's stored shards to the device, for the forward's and the backward's gathers; QLoRA
gathers its base as stored, in 4 bits. Left out: QLoRA's dequantization.
Test: python -m pytest tests/test_advisor.py -k speed
"""
import math

from napkin.advisor import (HEADROOM, LORA_TARGETS, QLORA_TARGETS, Advice, largest_micro_batch, lora_params,
                     rung_bytes, rungs)
from napkin.flops import Shape
from napkin.machines import Machine, collective_seconds
from napkin.memory_math import _element_size, model_params, nf4_bytes, quantized_params
from model import GPTConfig
from napkin.step_time import Step, predict


def every_rung(cfg: GPTConfig, gpu_mem: int, world: int, seq_len: int, target_batch: int,
               precision: str = "bf16", headroom: float = HEADROOM) -> list[Advice]:
    """Every rung at its largest micro-batch that fits, plain ddp among them (advise stops at the
    first that fits, and grows ddp into zero2; the speed ranking and --measure compare them all)."""
    per_rank, budget, tried = target_batch // world, (1 - headroom) * gpu_mem, []
    for name, strategy, checkpointing, offload, trainable, quantized, flags in rungs(cfg, world):
        def need(b, strategy=strategy):
            return rung_bytes(cfg, strategy, precision, world, seq_len, b, checkpointing, offload,
                              trainable, quantized)
        b = largest_micro_batch(per_rank, budget, need)
        name = name.replace(", micro-batch 1", "")
        tried.append(Advice(name, strategy, b, per_rank // b, flags, need(b), need(b)["total"] <= budget))
    return tried


def rung_step(cfg: GPTConfig, a: Advice, world: int, seq_len: int, precision: str) -> Step:
    """One micro-batch of the rung as step_time's Step: LoRA's frozen matrices need no weight
    gradient (the matrices and the head, as run_log.predicted_seconds counts them)."""
    shape, lora, qlora = Shape.of(cfg), None, "--quantize-base" in a.flags
    if "--lora" in a.flags:
        targets = QLORA_TARGETS if qlora else LORA_TARGETS
        lora = (lora_params(cfg, targets=targets), shape.layers * shape.block_params() + shape.vocab * shape.width)
    return Step(shape, a.strategy, world, world * a.micro_batch, seq_len, precision,
                checkpointing=1.0 if "--checkpoint-activations" in a.flags else 0.0, lora=lora,
                offload="--offload" in a.flags, quantized=quantized_params(cfg) if qlora else 0)


def rung_seconds(cfg: GPTConfig, a: Advice, world: int, seq_len: int, precision: str,
                 machine: Machine) -> dict:
    """A rung's step on `machine`, by part (compute, exposed communication, host transfers,
    optimizer; seconds per step), its total and tokens/s."""
    step = rung_step(cfg, a, world, seq_len, precision)
    parts, size = predict(step, machine)["parts"], _element_size(precision)
    exposed, once = parts["exposed"], 0.0
    if a.strategy in ("ddp", "single"):          # no_sync: the all-reduce in the last micro-batch only
        exposed, once = 0.0, exposed
    elif a.strategy == "zero2":                  # the updated shards gathered once, after the step
        P, bucket = step.shape.params(), int(step.bucket_mb * 2**20) // size
        once = collective_seconds("all_gather", P, size, world, machine.link(world), math.ceil(P / bucket))
        exposed -= once
    transfers = parts.get("offload", 0.0)
    if "params" in a.flags:       # the stored shards to the device for each forward and backward gather
        n, quantized = model_params(cfg), quantized_params(cfg) if "--quantize-base" in a.flags else 0
        stored = nf4_bytes(quantized) + (n - quantized) * size
        transfers += a.grad_accum * machine.host_link.seconds(2 * stored / world, 2 * (cfg.n_layer + 1))
    k = a.grad_accum
    split = {"compute": k * (parts["forward"] + parts["backward"]), "communication": k * exposed + once,
             "transfers": transfers, "optimizer": parts["optimizer"]}
    seconds = sum(split.values())
    return {"parts": split, "seconds": seconds, "tokens_per_s": world * a.micro_batch * k * seq_len / seconds}


def priced_rungs(cfg: GPTConfig, machine: Machine, world: int, seq_len: int, target_batch: int,
                 precision: str = "bf16", gpu_mem: float | None = None) -> list[tuple[Advice, dict]]:
    """Every rung that fits machine's memory (or gpu_mem), with its rung_seconds, in the ladder's
    order: the plainest first."""
    fitting = [a for a in every_rung(cfg, gpu_mem or machine.memory, world, seq_len, target_batch, precision)
               if a.fits]
    return [(a, rung_seconds(cfg, a, world, seq_len, precision, machine)) for a in fitting]


def fine_tunes(a: Advice) -> bool:
    """LoRA's rungs train adapters on a frozen base: a fine-tune, not the same training."""
    return "--lora" in a.flags


def _parts_said(diffs: list) -> str:
    """[(ms, part)] -> 'its compute takes 27.1 ms less, its transfers 3.0 ms less and its
    optimizer 0.2 ms less'."""
    said = [f"its {p}{' takes' if i == 0 else ''} {abs(d):.1f} ms {'less' if d < 0 else 'more'}"
            for i, (d, p) in enumerate(diffs)]
    return " and ".join([", ".join(said[:-1]), said[-1]] if len(said) > 1 else said)


def why(winner: tuple, runner_up: tuple) -> str:
    """One sentence a student can repeat: which rung is faster than which, by how much, and
    because of what, part by part: the micro-batch one fits and the other does not (fewer
    micro-batches a step, so fewer of the costs each repeats), the parts it spends less on,
    and in brackets the parts it spends more on."""
    (w, ws), (r, rs) = winner, runner_up
    diffs = [(d, p) for d, p in sorted(((ws["parts"][p] - rs["parts"][p]) * 1e3, p) for p in ws["parts"])
             if abs(d) >= 0.05]
    gains, costs = [x for x in diffs if x[0] < 0], [x for x in diffs[::-1] if x[0] > 0]  # largest first
    said = _parts_said(gains) or "the parts take the same time"
    if w.micro_batch > r.micro_batch:
        said = (f"it fits micro-batch {w.micro_batch} where '{r.rung}' fits {r.micro_batch} ({w.grad_accum} "
                f"micro-batch{'es' if w.grad_accum > 1 else ''} a step instead of {r.grad_accum}), so {said}")
    elif r.micro_batch > w.micro_batch:
        said += f", though '{r.rung}' fits micro-batch {r.micro_batch} where it fits {w.micro_batch}"
    return (f"why: '{w.rung}' is {(rs['seconds'] - ws['seconds']) * 1e3:.1f} ms a step faster than "
            f"'{r.rung}' because {said}" + (f" ({_parts_said(costs)})" if costs else ""))


def print_ranking(cfg: GPTConfig, machine: Machine, world: int, seq_len: int, target_batch: int,
                  precision: str, gpu_mem: float):
    """The ranking's table, then the fastest fine-tune and the fastest full training, and why."""
    ladder = priced_rungs(cfg, machine, world, seq_len, target_batch, precision, gpu_mem)
    ranked = sorted(ladder, key=lambda pair: pair[1]["seconds"])                 # fastest first
    print(f"\nby speed on {world} x {machine.name} ({gpu_mem / 1e9:.0f} GB each), {precision}: step_time.py's "
          f"napkin per step of {target_batch} x {seq_len} (ms; communication: what compute does not hide)")
    print(f"{'':>3} {'rung':<60}{'b x k':>8}{'compute':>9}{'comm.':>8}{'transf.':>8}{'optim':>9}"
          f"{'step ms':>9}{'tokens/s':>11}")
    for i, (a, s) in enumerate(ranked, 1):
        p = s["parts"]
        print(f"{i:>3} {a.rung + (' (fine-tune)' if fine_tunes(a) else ''):<60}"
              f"{f'{a.micro_batch} x {a.grad_accum}':>8}{p['compute'] * 1e3:9.1f}"
              f"{p['communication'] * 1e3:8.1f}{p['transfers'] * 1e3:8.1f}{p['optimizer'] * 1e3:9.1f}"
              f"{s['seconds'] * 1e3:9.1f}{s['tokens_per_s']:11,.0f}")
    # A fine-tune trains other weights than full training: each kind has its own winner, said
    # against the plainest rung of its kind that fits (the talk's experiment starts there and
    # turns one knob at a time), or against the runner-up if the winner is that rung.
    for kind, tuning in (("fine-tune", True), ("full training", False)):
        group = [pair for pair in ranked if fine_tunes(pair[0]) == tuning]
        if not group:
            print(f"no {kind} rung fits")
            continue
        print(f"fastest {kind}: {group[0][0].rung}, {group[0][1]['tokens_per_s']:,.0f} tokens/s")
        plainest = next(pair for pair in ladder if fine_tunes(pair[0]) == tuning)
        if len(group) > 1:
            print(why(group[0], plainest if plainest is not group[0] else group[1]))
