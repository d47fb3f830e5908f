"""What a training run says and keeps at its steps: the log's first lines (the run, LoRA's share,
the napkin's memory), each logged step (loss, speed, memory and bytes beside their formulas),
each checkpoint; and, for --sample and --export, the text a trained model writes and the size
of the export. train.py calls these; they read the run's objects, never change its training.
Test: python -m pytest tests/test_train.py tests/test_run_log.py
"""
import os
import time

import torch
import torch.distributed as dist

import lora
from running import snapshot
from napkin import step_time
from running.cli import describe_run, run_shape
from napkin.memory_math import (held_bytes, live_numel, live_tensor_bytes, load_peak_bytes,
                               model_params, why_sent_departs)
from composition.mesh_checks import moe_config
from composition.parallelize import build_gpt, dimension_report, lora_config
from foundations.process_groups import global_mean
from running.run_log import measured_memory, predicted_activations, predicted_memory, step_line
from running.snapshot import load_weights


def say_header(args, gpt, napkin, log, dims, threads, device):
    """The log's first lines: the run (cli.describe_run), LoRA's share, napkin/memory.py's prediction;
    returns its activations' (run_log.predicted_activations). dims: the run's ParallelDims."""
    n_params, quantized = live_numel(gpt)                 # tp: this rank's slices; QLoRA's 4-bit
    where = f"{device.type} ({dist.get_backend()})" + (f" | {threads}" if threads else "")
    n_model = n_params if not run_shape(args, dims.dp)[0] else model_params(gpt.cfg)
    for line in describe_run(args, dims.world, dims.dp, where, n_params, n_model):
        log.say(line)
    if args.lora:
        trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad)
        log.say(f"LoRA rank {args.lora_rank} on {args.lora_targets}: {trainable:,} trainable parameters "
                f"({trainable / n_params:.2%} of the model); the adapter is "
                f"{lora.adapter_bytes(gpt) / 2**10:.1f} KiB, the model {n_params * 4 / 2**20:.1f} MiB in fp32"
                + (f"; {quantized:,} frozen weights in 4-bit {args.quantize_base}" if quantized else ""))
    activations = predicted_activations(args, gpt.cfg, dims)
    log.say(predicted_memory(napkin, activations))
    if snapshot.streamed(args):                # hf:DIR read unit by unit: the load's own peak
        loading = load_peak_bytes(gpt, args, args.shard_group or dims.dp * dims.cp)  # FSDP's N
        step = napkin["params"] + napkin["grads"] + napkin["optimizer"]
        log.say(f"memory per rank while loading hf:DIR unit by unit, predicted: at most "
                f"{loading / 2**20:.2f} MiB (memory_math.load_peak_bytes), beside the step's "
                f"{step / 2**20:.2f} MiB on the device")
    return activations


def say_step(args, job, log, clock, step, loss, lr, kept, history, live_bytes, napkin_seconds):
    """A logged step (lr: its learning rate): measure what this rank holds and sent, record it in
    history, say it, its time beside the napkin's (napkin/step_time.py, priced on this machine) if any."""
    device = clock.device
    if device.type == "cuda":
        torch.cuda.synchronize()
    tokens_per_s = args.batch_size * args.seq_len * (step - clock.last_timed) / (time.perf_counter() - clock.timer)
    held = held_bytes(job.model, job.optimizer)          # "host": --offload's CPU memory
    if not held.get("host"):
        held.pop("host", None)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    history["losses"][step], history["held"][step] = loss, held
    if kept:
        history.setdefault("activations", {})[step] = kept["bytes"]
    if live_bytes and device.type == "cpu":
        history["live_bytes"][step] = live_tensor_bytes()
    log.say_if_changed(step, "memory", measured_memory(held, kept.get("bytes") if kept else None, peak))
    sent, predicted = {**job.mesh.sent(), "world": sum(job.comm.bytes_sent.values())}, job.predicted
    if job.dims.splits:                                   # each dimension beside its formula
        history.setdefault("sent", {})[step] = {d: (sent[d], predicted[d]) for d in predicted}
        log.say(f"step {step:5d} | sent by dimension, MiB/step (formula): " + " | ".join(
            f"{d} {sent[d] / 2**20:.3f} ({predicted[d] / 2**20:.3f})" for d in predicted))
    napkin = step_time.beside(args.batch_size * args.seq_len / tokens_per_s, napkin_seconds)
    log.say(step_line(step, loss, lr, tokens_per_s, sum(sent.values()),
                      sum(predicted.values()), dist.get_world_size(), clock.skipped, args.steps,
                      time.perf_counter() - clock.began, clock.seconds_left(step, args.steps), napkin,
                      why=sent_departs(args, job, sum(predicted.values()))))
    for line in dimension_report(args, job, step, history):
        log.say(f"step {step:5d} | {line}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)         # the next line's peak: its steps'
    clock.restart(step)


def sent_departs(args, job, formula: int) -> str:
    """Why the data-parallel rungs' bytes sent depart from the lecture's rule, in one clause
    (memory_math.why_sent_departs; "" for a mesh or experts, whose bytes it does not price)."""
    gpt, world = job.gpt, job.dims.world
    if job.dims.splits or gpt.cfg.experts or world == 1 or args.strategy == "single":
        return ""
    n_params, quantized = live_numel(gpt)
    trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad) if args.lora else None
    return why_sent_departs(n_params, args.strategy, args.precision, world, trainable=trainable,
                            quantized=quantized, double_quant=args.double_quant,
                            shard_group=args.shard_group, reduce_precision=args.reduce_dtype,
                            sent=formula, micro_batches=args.grad_accum)


def save(args, job, layout, log, divergence, step, loss, base):
    """Checkpoint after step: never a diverged run (its loss is checked first). base: a LoRA
    run's base (snapshot.base_identity), or None."""
    step_loss = loss if isinstance(loss, float) else global_mean(loss)
    divergence.check_loss(step, step_loss)
    saved = snapshot.save_checkpoint(args, step + 1, job.gpt, job.optimizer, layout, step_loss,
                                     lora_config(args), first_loss=divergence.first_loss, base=base)
    log.say(f"step {step:5d} | saved {saved}: named by the steps done ({step + 1}), so --resume "
            f"continues at step {step + 1} | loss {step_loss:.4f}")


def export(args, job, layout, log):
    """At the run's end, --export's file (the fp32 weights, LoRA's adapters folded in) and
    --export-hf's directory (export_hf)."""
    if args.export:
        snapshot.export(args.export, job.gpt, job.optimizer, layout, dist.get_rank(),
                        lora_config(args), args.out)
        log.say(f"exported {args.export}: fp32 weights; "
                f"train.load_weights({args.export!r}) loads them")
    if args.export_hf:
        export_hf(args, job, layout, log)


def export_hf(args, job, layout, log):
    """--export-hf's directory at the run's end: config.json, model.safetensors (fp32, LoRA
    merged, a 4-bit base dequantized) and the tokenizer of the model it started from."""
    snapshot.export_pretrained(args.export_hf, job.gpt, job.optimizer, layout, dist.get_rank(),
                               lora_config(args), args.hf, args.out)
    log.say(f"exported {args.export_hf}: config.json, model.safetensors (fp32), tokenizer.json; "
            f"pretrained.load.load_pretrained({args.export_hf!r}) loads them")


def export_bytes(args) -> int:
    """About the bytes of --export's file: every parameter of the model in fp32 and its record's
    header (under 1 KiB). Counted on the meta device: no memory; a LoRA run exports its adapters
    folded into the base's shapes."""
    with torch.device("meta"):
        gpt = build_gpt(args.model, **moe_config(args))
    return sum(4 * p.numel() + 2**10 for p in gpt.parameters())


def sample(args):
    """Text from a trained model, on one process: no torch.distributed. Under torchrun every
    process was given the command, and rank 0 alone samples (the same text, printed once)."""
    if int(os.environ.get("RANK", 0)):            # a whole number: cli.parse_args checked it
        return
    gpt = load_weights(args.init_from).eval()
    tokenizer = snapshot.pretrained_tokenizer(snapshot.pretrained_directory(args.init_from))
    torch.manual_seed(args.seed)
    # The prompt's own bytes: the model reads bytes, and a command line's that are not UTF-8
    # come as surrogates (Python's surrogateescape), which fsencode turns back into those bytes.
    prompt = os.fsencode(args.prompt)
    ids = tokenizer.encode(prompt.decode("utf-8", errors="replace")) if tokenizer else list(prompt)
    tokens = gpt.generate(torch.tensor([ids], dtype=torch.long), args.sample_tokens,   # (1, T)
                          temperature=args.temperature)[0].tolist()
    print(tokenizer.decode(tokens) if tokenizer else
          bytes(tokens).decode("utf-8", errors="replace"))
