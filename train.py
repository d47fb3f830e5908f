"""train.py: the concept files composed into one training run (its command line: cli.py).

A step: every rank takes its slice of the global batch (data.py), runs forward and backward
over --grad-accum micro-batches, the strategy averages the gradients (ddp.py, zero.py, fsdp.py,
over collectives.py), and the mixed-precision optimizer updates fp32 master weights
(mixed_precision.py). The log (run_log.py) shows loss, tokens/s and bytes sent per step, and
memory per rank measured beside memory.py's prediction; Ctrl-C or a refusal ends in one line.
With --out the run is a directory: log, config and checkpoints (snapshot.py) that --resume
continues bit for bit, on the same or another world size and strategy. One mesh
(process_groups.make_device_mesh) splits each layer's matrices over --tp ranks
(tensor_parallel.py), each sequence over --cp ranks (context_parallel.py) and the blocks into
--pp stages fed --microbatches at a time (pipeline.py), and a mixture's experts over --ep ranks
(moe.py), in any combination (parallelize.py), and data-parallelizes the rest; --strategy tp, cp
and pipeline are ddp with their split.
Run: python train.py   or   torchrun --nproc_per_node 2 train.py --strategy zero2
     torchrun --nproc_per_node 8 train.py --tp 2 --pp 2   (tp 2 x pp 2 x dp 2)
Test: python -m pytest tests/test_train.py tests/test_snapshot.py tests/test_run_log.py
"""
import contextlib
import math
import os
import time

# OpenMP's threads spin between parallel regions by default: on a busy CPU (other ranks, other
# programs) a spinning thread holds a core the others wait for, and a step takes 20x longer
# (measured on 2 shared cores). Passive threads sleep instead. Read when torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import no_numpy  # noqa: F401  (first: torch warns as it is imported when numpy is absent)
import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

import lora
import snapshot
import step_time
from cli import describe_run, parse_args
from data import TextData
from launch import pinned_copy
from memory_math import held_bytes, live_numel, live_tensor_bytes
from mesh_checks import mesh_splits, moe_config
from meters import saved_activation_bytes
from parallelize import build, build_gpt, dimension_report, lora_config
from process_groups import cpu_threads, exit_distributed, global_mean, init_distributed
from run_log import (Clock, RunLog, finish, measured_memory, predicted_activations, predicted_memory,
                     predicted_seconds, start_profiling, step_line)
from snapshot import Divergence, RunError, load_weights, own_outputs  # noqa: F401 (train.RunError)


def learning_rate(step, args):
    """Linear warmup to --lr, then cosine decay to --min-lr at the last step."""
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - 1 - args.warmup)
    return min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def lr_scheduler(optimizer, args, start: int) -> LambdaLR:
    """learning_rate as torch's LambdaLR over our optimizer (a torch.optim.Optimizer), set for
    step `start`: a resumed run rebuilds the schedule from its own --steps and --lr."""
    for group in optimizer.param_groups:
        group["initial_lr"] = args.lr
    return LambdaLR(optimizer, lambda step: learning_rate(step, args) / args.lr, last_epoch=start - 1)


@torch.no_grad()
def eval_loss(model, data, args, rank, world_size, device, my_tokens):
    """The mean loss over --eval-batches held-out batches (my_tokens: build's Run.my_tokens)."""
    model.eval()
    losses = []
    for i in range(args.eval_batches):
        x, y = my_tokens(*data.batch(i, args.batch_size, args.seq_len, args.seed, "eval", rank, world_size))
        _, loss = model(x.to(device), y.to(device))      # a pipeline forwards through every stage
        losses.append(loss)
    model.train()
    return global_mean(torch.stack(losses).mean())


def train_step(model, optimizer, sync, x, y, args, measure=False, kept: dict | None = None):
    """One optimizer step on this rank's rows x, y (B/N, T), in --grad-accum micro-batches.

    sync: the run's gradient syncs (flat.GradientSyncs). Returns this rank's mean loss (a
    tensor) and whether the update was applied (a step whose gradients hold inf or NaN is
    skipped on every rank). measure: time a pipeline's compute exactly (on CUDA, synchronizing).
    kept: gets "bytes", what the first micro-batch's forward keeps for backward (the activations).
    """
    optimizer.zero_grad(set_to_none=True)
    if hasattr(model, "train_step"):
        # A pipeline runs the --microbatches by its schedule; replicas average once per step.
        loss = model.train_step(x, y, optimizer.scale_loss, measure)
        return loss, update(optimizer, args)
    # DDP reduces once per step (no_sync); ZeRO-2 and FSDP reduce-scatter every micro-batch's
    # gradient into shards, so that no rank ever holds a full gradient (no_sync would keep one).
    no_sync = sync.no_sync if sync.keeps_whole_gradients else contextlib.nullcontext
    step_loss = torch.zeros((), device=x.device)
    for micro, (mx, my) in enumerate(zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum))):
        last = micro == args.grad_accum - 1
        # Gradients of all but the last micro-batch accumulate locally: one sync per step.
        with contextlib.nullcontext() if last else no_sync():
            if kept is not None and micro == 0:     # each micro-batch's are freed by its backward
                kept["bytes"], (_, loss) = saved_activation_bytes(lambda: model(mx, my), list(model.parameters()))
            else:
                _, loss = model(mx, my)                              # mean over (B/N/k, T)
            optimizer.scale_loss(loss / args.grad_accum).backward()
        step_loss += loss.detach() / args.grad_accum
    sync.finish_gradient_sync()
    return step_loss, update(optimizer, args)


def update(optimizer, args) -> bool:
    """Clip to --clip-grad (the global norm over every rank's share), step; False if skipped."""
    if args.clip_grad:
        optimizer.clip_grad_norm_(args.clip_grad)
    optimizer.step()
    return not optimizer.last_step_skipped


def sample(args):
    """Text from a trained model, on one process: no torch.distributed. Under torchrun every
    process was given the command, and rank 0 alone samples (the same text, printed once)."""
    if int(os.environ.get("RANK", 0)):            # a whole number: cli.parse_args checked it
        return
    gpt = load_weights(args.init_from).eval()
    torch.manual_seed(args.seed)
    # The prompt's own bytes: the model reads bytes, and a command line's that are not UTF-8
    # come as surrogates (Python's surrogateescape), which fsencode turns back into those bytes.
    prompt = torch.tensor([list(os.fsencode(args.prompt))], dtype=torch.long)    # (1, T) bytes
    tokens = gpt.generate(prompt, args.sample_tokens, temperature=args.temperature)
    print(bytes(tokens[0].tolist()).decode("utf-8", errors="replace"))


# ---- the run ---------------------------------------------------------------------------------

def main(argv=None, live_bytes: bool = False, logs: list | None = None) -> dict:
    """Train as the command line says (argv: its words; None: sys.argv) and return the history:
    {"losses": {step: global mean loss} at logged steps, "live_bytes": {step: bytes} (only with
    live_bytes), "eval_loss"; "eval_loss_before" with --init-from, "bubble" under --strategy
    pipeline}. --sample prints text instead and returns None.

    live_bytes (CPU): also count every live tensor's bytes at each logged step, for leak tests;
    each count is a full garbage-collector pass, so it is off unless asked for. logs: the run's
    RunLog is appended to it (the command line reads where a Ctrl-C stopped the run)."""
    args = parse_args(argv)
    if args.sample:
        return sample(args)
    args.timeout = args.timeout or (600 if torch.cuda.is_available() else 120)    # seconds
    device = init_distributed(timeout=args.timeout)
    # The command line shares this node's cores among its ranks; a caller in Python (a test's
    # ranks, one thread each) keeps its own count unless --threads says otherwise.
    threads = cpu_threads(args.threads, device, bool(args.offload)) if argv is None or args.threads else ""
    export_size = export_bytes(args) if args.export else 0
    with own_outputs(args, dist.get_rank(), device, export_size) as (took_over, file):
        log = RunLog(args, dist.get_rank(), file)
        if logs is not None:
            logs.append(log)
        for line in [took_over] if took_over else []:
            log.say(line)
        return run(args, device, log, threads, live_bytes)


def run(args, device, log: RunLog, threads: str, live_bytes: bool) -> dict:
    """main's run, once this process owns its outputs (own_outputs), saying each step in log."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The weights a LoRA run's adapter trains over, pinned as build loads them: its checkpoints
    # record them, and a resume over other weights is refused (cli.check_resume).
    base = snapshot.base_identity(args.init_from) if args.lora and args.init_from else None
    job = build(args, device)
    gpt, model, optimizer, mesh = job.gpt, job.model, job.optimizer, job.mesh
    # The ranks holding copies of the same parameters (dp x cp: a cp group's ranks hold whole
    # copies too) write them once, the first of them; a tensor group gathers its slices whole.
    splits = mesh_splits(args)
    split = mesh.tp if "tp" in splits else mesh.pp if "pp" in splits else None
    layout = snapshot.layout_of(gpt, mesh.dp_cp, split)
    start, first_loss = (snapshot.resume(args, gpt, optimizer, layout, world_size, rank, log.say)
                         if args.resume else (0, None))
    data = TextData.from_file(args.data)
    say_header(args, gpt, job.napkin, log, mesh.dp.world_size, threads, device)
    history = {"losses": {}, "live_bytes": {}, "napkin": job.napkin, "held": {}}     # this rank's
    step_done = start_profiling(args, rank, world_size, device)
    evaluate = lambda: eval_loss(model, data, args, mesh.dp.rank, mesh.dp.world_size, device, job.my_tokens)
    if args.init_from and start == 0:          # fine-tuning: where the new text starts from
        history["eval_loss_before"] = evaluate()
        log.say(f"step     0 | eval loss {history['eval_loss_before']:.4f} (before training)")
    clock = Clock(start, device)
    napkin_seconds = predicted_seconds(args, gpt, world_size, device)     # this machine, measured
    schedule = lr_scheduler(optimizer, args, start)
    divergence = Divergence(args, gpt.cfg.vocab_size, first_loss)
    for step in range(start, args.steps):
        log.step = step
        job.comm.bytes_sent.clear()
        mesh.clear()
        x, y = data.batch(step, args.batch_size, args.seq_len, args.seed,
                          rank=mesh.dp.rank, world_size=mesh.dp.world_size)      # (B/D, T)
        x, y = job.my_tokens(x, y)                                   # cp pipeline: (B/D, T/cp)
        logged = step % args.log_every == 0 or step == args.steps - 1
        kept = {} if logged and not {"pp", "cp"} & splits.keys() else None
        loss, applied = train_step(model, optimizer, job.sync, pinned_copy(x, device), pinned_copy(y, device), args,
                                   measure=logged, kept=kept)
        divergence.after_step(step, applied, loss, optimizer.scaler.scale)
        clock.skipped += not applied
        clock.step_done(step)
        schedule.step()                                              # the next step's lr
        if logged:
            loss = global_mean(loss)                                 # the global batch's mean
            divergence.check_loss(step, loss)
            say_step(args, job, log, clock, step, loss, kept, history, live_bytes, napkin_seconds)
        if args.eval_every and step and step % args.eval_every == 0:
            log.say(f"step {step:5d} | eval loss {evaluate():.4f}")
            clock.restart(step)                                      # time training steps only
        step_done(last=step + 1 == args.steps)
        if args.out and (step + 1 == args.steps or args.save_every and (step + 1) % args.save_every == 0):
            save(args, job, layout, log, divergence, step, loss, base)
            clock.restart(step)
    history["eval_loss"] = evaluate()
    log.say(f"done | eval loss {history['eval_loss']:.4f}")
    if args.export:
        snapshot.export(args.export, gpt, optimizer, layout, rank, lora_config(args), args.out)
        log.say(f"exported {args.export}: fp32 weights; train.load_weights({args.export!r}) loads them")
    return history


def export_bytes(args) -> int:
    """About the bytes of --export's file: every parameter of the model in fp32 and its record's
    header (under 1 KiB). Counted on the meta device: no memory; a LoRA run exports its adapters
    folded into the base's shapes."""
    with torch.device("meta"):
        gpt = build_gpt(args.model, **moe_config(args))
    return sum(4 * p.numel() + 2**10 for p in gpt.parameters())


def say_header(args, gpt, napkin, log, data_size, threads, device):
    """The log's first lines: the run (cli.describe_run), LoRA's share, memory.py's prediction."""
    n_params, quantized = live_numel(gpt)                 # tp: this rank's slices; QLoRA's 4-bit
    where = f"{device.type} ({dist.get_backend()})" + (f" | {threads}" if threads else "")
    for line in describe_run(args, dist.get_world_size(), data_size, where, n_params):
        log.say(line)
    if args.lora:
        trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad)
        log.say(f"LoRA rank {args.lora_rank} on {args.lora_targets}: {trainable:,} trainable parameters "
                f"({trainable / n_params:.2%} of the model); the adapter is "
                f"{lora.adapter_bytes(gpt) / 2**10:.1f} KiB, the model {n_params * 4 / 2**20:.1f} MiB in fp32"
                + (f"; {quantized:,} frozen weights in 4-bit {args.quantize_base}" if quantized else ""))
    log.say(predicted_memory(napkin, predicted_activations(args, gpt.cfg, data_size)))


def say_step(args, job, log, clock, step, loss, kept, history, live_bytes, napkin_seconds):
    """A logged step: measure what this rank holds and sent, record it in history, say it, its time
    beside the napkin's (step_time.py, priced on this machine) where there is one."""
    device = clock.device
    if device.type == "cuda":
        torch.cuda.synchronize()
    tokens_per_s = args.batch_size * args.seq_len * (step - clock.last_timed) / (time.perf_counter() - clock.timer)
    held = held_bytes(job.model, job.optimizer)          # "host": --offload's CPU memory
    if not held.get("host"):
        held.pop("host", None)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    history["losses"][step], history["held"][step] = loss, held
    if live_bytes and device.type == "cpu":
        history["live_bytes"][step] = live_tensor_bytes()
    log.say_if_changed(step, "memory", measured_memory(held, kept.get("bytes") if kept else None, peak))
    sent, predicted = {**job.mesh.sent(), "world": sum(job.comm.bytes_sent.values())}, job.predicted
    if mesh_splits(args):                                 # each dimension beside its formula
        history.setdefault("sent", {})[step] = {d: (sent[d], predicted[d]) for d in predicted}
        log.say(f"step {step:5d} | sent by dimension, MiB/step (formula): " + " | ".join(
            f"{d} {sent[d] / 2**20:.3f} ({predicted[d] / 2**20:.3f})" for d in predicted))
    napkin = step_time.beside(args.batch_size * args.seq_len / tokens_per_s, napkin_seconds)
    log.say(step_line(step, loss, learning_rate(step, args), tokens_per_s, sum(sent.values()),
                      sum(predicted.values()), dist.get_world_size(), clock.skipped, args.steps,
                      time.perf_counter() - clock.began, clock.seconds_left(step, args.steps), napkin))
    for line in dimension_report(args, job.gpt, job.model, job.mesh, job.context, step, history):
        log.say(f"step {step:5d} | {line}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)         # the next line's peak: its steps'
    clock.restart(step)


def save(args, job, layout, log, divergence, step, loss, base):
    """Checkpoint after step: never a diverged run (its loss is checked first). base: a LoRA
    run's base (snapshot.base_identity), or None."""
    step_loss = loss if isinstance(loss, float) else global_mean(loss)
    divergence.check_loss(step, step_loss)
    saved = snapshot.save_checkpoint(args, step + 1, job.gpt, job.optimizer, layout, step_loss,
                                     lora_config(args), first_loss=divergence.first_loss, base=base)
    log.say(f"step {step:5d} | saved {saved}: named by the steps done ({step + 1}), so --resume "
            f"continues at step {step + 1} | loss {step_loss:.4f}")


if __name__ == "__main__":
    code = finish(main)
    # 1 (a peer lost) and 130 (Ctrl-C: the peers may be gone): the group is left as it is.
    exit_distributed(code, peer_lost=code not in (0, 2))
