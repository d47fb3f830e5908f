"""train.py: the concept files composed into one training run (its command line: cli.py).

A step: every rank takes its slice of the global batch (data.py), runs forward and backward
over --grad-accum micro-batches, the strategy averages the gradients (ddp.py, zero.py, fsdp.py,
over collectives.py), and the mixed-precision optimizer updates fp32 master weights
(mixed_precision.py). The log shows loss, tokens/s, per-rank memory and bytes sent per step.
With --out the run is a directory: log, config and checkpoints (snapshot.py) that --resume
continues bit for bit, on the same or another world size and strategy. One mesh
(process_groups.make_device_mesh) splits each layer's matrices over --tp ranks
(tensor_parallel.py), each sequence over --cp ranks (context_parallel.py) and the blocks into
--pp stages fed --microbatches at a time (pipeline.py), and a mixture's experts over --ep ranks
(moe.py), in any combination (parallelize.py), and data-parallelizes the rest; --strategy tp, cp
and pipeline are ddp with their split.
Run: python train.py   or   torchrun --nproc_per_node 2 train.py --strategy zero2
     torchrun --nproc_per_node 8 train.py --tp 2 --pp 2   (tp 2 x pp 2 x dp 2)
Test: python -m pytest tests/test_train.py tests/test_snapshot.py
"""
import contextlib
import math
import os
import sys
import time
import warnings

# torch warns at import when numpy is absent (its numpy bridge); nothing here uses numpy, and
# requirements.txt does not install it.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

import lora
import snapshot
import step_time
from bench_measure import start_profiling
from cli import describe_run, parse_args
from data import TextData
from memory import held_bytes, live_numel, live_tensor_bytes
from mesh_checks import mesh_splits
from parallelize import build, dimension_report, lora_config
from process_groups import exit_distributed, global_mean, init_distributed
from snapshot import Divergence, RunError, load_weights, own_outputs


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


def train_step(model, optimizer, sync, x, y, args, measure=False):
    """One optimizer step on this rank's rows x, y (B/N, T), in --grad-accum micro-batches.

    sync: the run's gradient syncs (flat.GradientSyncs). Returns this rank's mean loss (a
    tensor) and whether the update was applied (a step whose gradients hold inf or NaN is
    skipped on every rank). measure: time a pipeline's compute exactly (on CUDA, synchronizing).
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
            _, loss = model(mx, my)                                  # mean over (B/N/k, T)
            optimizer.scale_loss(loss / args.grad_accum).backward()
        step_loss += loss.detach() / args.grad_accum
    sync.finish_gradient_sync()
    return step_loss, update(optimizer, args)


def to_device(batch: torch.Tensor, device) -> torch.Tensor:
    """The batch (built in host memory) onto the device without the host waiting for the copy.
    From pageable memory a host-to-device copy blocks the host; from pinned memory it is queued
    on the stream behind the step's kernels (the caching host allocator keeps the pinned block
    until it is done). Pinned memory exists only beside a GPU: on the CPU this is the batch."""
    if device.type == "cuda":
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)


def update(optimizer, args) -> bool:
    """Clip to --clip-grad (the global norm over every rank's share), step; False if skipped."""
    if args.clip_grad:
        optimizer.clip_grad_norm_(args.clip_grad)
    optimizer.step()
    return not optimizer.last_step_skipped


def sample(args):
    """Text from a trained model, on one process: no torch.distributed."""
    gpt = load_weights(args.init_from).eval()
    torch.manual_seed(args.seed)
    prompt = torch.tensor([list(args.prompt.encode())], dtype=torch.long)        # (1, T) bytes
    tokens = gpt.generate(prompt, args.sample_tokens, temperature=args.temperature)
    print(bytes(tokens[0].tolist()).decode("utf-8", errors="replace"))


# ---- the run ---------------------------------------------------------------------------------

def clock(seconds: float) -> str:
    """12.3 -> '0:12', 3725 -> '1:02:05'."""
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def main(argv=None, live_bytes: bool = False) -> dict:
    """Train as the command line says (argv: its words; None: sys.argv) and return the history:
    {"losses": {step: global mean loss} at logged steps, "live_bytes": {step: bytes} (only with
    live_bytes), "eval_loss"; "eval_loss_before" with --init-from, "bubble" under --strategy
    pipeline}. --sample prints text instead and returns None.

    live_bytes (CPU): also count every live tensor's bytes at each logged step, for leak tests;
    each count is a full garbage-collector pass, so it is off unless asked for."""
    args = parse_args(argv)
    if args.sample:
        return sample(args)
    args.timeout = args.timeout or (600 if torch.cuda.is_available() else 120)    # seconds
    device = init_distributed(timeout=args.timeout)
    with own_outputs(args, dist.get_rank(), device) as took_over:
        return run(args, device, took_over, live_bytes)


def run(args, device, took_over: str, live_bytes: bool) -> dict:
    """main's run, once this process owns its outputs (own_outputs)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.offload and device.type == "cuda":
        # The offloaded Adam step runs on the host, where torchrun leaves each rank one thread
        # (OMP_NUM_THREADS=1): share the cores among this node's ranks instead.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    log_file = snapshot.open_run(args, world_size) if args.out and rank == 0 else None

    def say(line):
        if rank == 0:
            print(line, flush=True)
            if log_file:
                print(line, file=log_file, flush=True)

    if took_over:
        say(took_over)

    gpt, model, optimizer, sync, predicted, napkin, context, comm, mesh, my_tokens = build(args, device)
    data_rank, data_size = mesh.dp.rank, mesh.dp.world_size
    # The ranks holding copies of the same parameters (dp x cp: a cp group's ranks hold whole
    # copies too) write them once, the first of them; a tensor group gathers its slices whole.
    splits = mesh_splits(args)
    split = mesh.tp if "tp" in splits else mesh.pp if "pp" in splits else None
    layout = snapshot.layout_of(gpt, mesh.dp_cp, split)
    start = snapshot.resume(args, gpt, optimizer, layout, world_size, rank, say) if args.resume else 0
    data = TextData.from_file(args.data)
    n_params, quantized = live_numel(gpt)                 # tp: this rank's slices; QLoRA's 4-bit
    for line in describe_run(args, world_size, data_size, f"{device.type} ({dist.get_backend()})", n_params):
        say(line)
    trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad)
    if args.lora:
        say(f"LoRA rank {args.lora_rank} on {args.lora_targets}: {trainable:,} trainable parameters "
            f"({trainable / n_params:.2%} of the model); the adapter is "
            f"{lora.adapter_bytes(gpt) / 2**10:.1f} KiB, the model {n_params * 4 / 2**20:.1f} MiB in fp32"
            + (f"; {quantized:,} frozen weights in 4-bit {args.quantize_base}" if quantized else ""))
    # The strategy's napkin math (memory.py), to read beside the measured bytes in the log.
    say(f"napkin math per rank (memory.py): params {napkin['params'] / 2**20:.1f} MiB, grads "
        f"{napkin['grads'] / 2**20:.1f}, optim {napkin['optimizer'] / 2**20:.1f}, total "
        f"{napkin['total'] / 2**20:.1f}" + (f" on the device, {napkin['host'] / 2**20:.1f} in CPU "
                                            f"memory (--offload)" if args.offload else ""))

    history = {"losses": {}, "live_bytes": {}, "napkin": napkin, "held": {}}     # this rank's
    if device.type == "cuda":
        # Set-up held more than training does (the whole fp32 model before ZeRO or FSDP
        # sharded it): the logged peak starts here, and again after each logged step.
        torch.cuda.reset_peak_memory_stats(device)
    step_done = start_profiling(args, rank, world_size)
    if args.init_from and start == 0:          # fine-tuning: where the new text starts from
        history["eval_loss_before"] = eval_loss(model, data, args, data_rank, data_size, device, my_tokens)
        say(f"step     0 | eval loss {history['eval_loss_before']:.4f} (before training)")
    tokens_per_step = args.batch_size * args.seq_len
    napkin_seconds = step_time.for_run(args, gpt, world_size, device)     # this machine, measured
    timer, last_timed, skipped = time.perf_counter(), start - 1, 0
    began = timer
    schedule = lr_scheduler(optimizer, args, start)
    divergence = Divergence(args, gpt.cfg.vocab_size)
    for step in range(start, args.steps):
        comm.bytes_sent.clear()
        mesh.clear()
        x, y = data.batch(step, args.batch_size, args.seq_len, args.seed,
                          rank=data_rank, world_size=data_size)      # (B/D, T)
        x, y = my_tokens(x, y)                                       # cp pipeline: (B/D, T/cp)
        logged = step % args.log_every == 0 or step == args.steps - 1
        loss, applied = train_step(model, optimizer, sync, to_device(x, device), to_device(y, device), args,
                                   measure=logged)
        divergence.after_step(step, applied, loss, optimizer.scaler.scale)
        skipped += not applied
        schedule.step()                                              # the next step's lr

        if logged:
            loss = global_mean(loss)                                 # the global batch's mean
            divergence.check_loss(step, loss)
            if device.type == "cuda":
                torch.cuda.synchronize()
            tokens_per_s = tokens_per_step * (step - last_timed) / (time.perf_counter() - timer)
            held = held_bytes(model, optimizer)
            host = held.pop("host", None)                           # --offload: CPU memory
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else sum(held.values())
            history["losses"][step] = loss
            history["held"][step] = {**held, **({"host": host} if host else {})}
            if live_bytes and device.type == "cpu":
                history["live_bytes"][step] = live_tensor_bytes()
            sent = {**mesh.sent(), "world": sum(comm.bytes_sent.values())}
            if splits:                                    # each dimension beside its formula
                history.setdefault("sent", {})[step] = {d: (sent[d], predicted[d]) for d in predicted}
                say(f"step {step:5d} | sent by dimension, MiB/step (formula): " + " | ".join(
                    f"{d} {sent[d] / 2**20:.3f} ({predicted[d] / 2**20:.3f})" for d in predicted))
            elapsed = time.perf_counter() - began         # this run's steps, evals and saves
            left = elapsed / (step + 1 - start) * (args.steps - step - 1)
            say(f"step {step:5d} | loss {loss:.4f} | lr {learning_rate(step, args):.2e} | "
                f"{tokens_per_s / 1e3:7.1f}k tok/s{step_time.beside(tokens_per_step / tokens_per_s, napkin_seconds)} | mem {peak / 2**20:.1f} MiB (params "
                f"{held['params'] / 2**20:.1f}, grads {held['grads'] / 2**20:.1f}, optim "
                f"{held['optimizer'] / 2**20:.1f}" + (f", host {host / 2**20:.1f}" if host else "") + ")"
                + (f" | sent {sum(sent.values()) / 2**20:.2f} MiB/step (ring formula "
                   f"{sum(predicted.values()) / 2**20:.2f})" if world_size > 1 else "")
                + (f" | skipped {skipped}" if skipped else "")
                + f" | {step + 1}/{args.steps} in {clock(elapsed)}, about {clock(left)} left")
            for line in dimension_report(args, gpt, model, mesh, context, step, history):
                say(f"step {step:5d} | {line}")
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)         # the next line's peak: its steps'
            timer, last_timed = time.perf_counter(), step
        if args.eval_every and step and step % args.eval_every == 0:
            say(f"step {step:5d} | eval loss {eval_loss(model, data, args, data_rank, data_size, device, my_tokens):.4f}")
            timer, last_timed = time.perf_counter(), step            # time training steps only
        done = step + 1
        step_done(last=done == args.steps)
        if args.out and (done == args.steps or args.save_every and done % args.save_every == 0):
            step_loss = loss if isinstance(loss, float) else global_mean(loss)
            divergence.check_loss(step, step_loss)                   # never save a diverged run
            saved = snapshot.save_checkpoint(args, done, gpt, optimizer, layout, step_loss,
                                             lora_config(args))
            say(f"step {step:5d} | saved {saved}: named by the steps done ({done}), so --resume "
                f"continues at step {done} | loss {step_loss:.4f}")
            timer, last_timed = time.perf_counter(), step
    history["eval_loss"] = eval_loss(model, data, args, data_rank, data_size, device, my_tokens)
    say(f"done | eval loss {history['eval_loss']:.4f}")
    if args.export:
        snapshot.export(args.export, gpt, optimizer, layout, rank, lora_config(args))
        say(f"exported {args.export}: fp32 weights; train.load_weights({args.export!r}) loads them")
    if log_file:
        log_file.close()
    return history


if __name__ == "__main__":
    try:
        main()
    except (RunError, snapshot.CheckpointError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        exit_distributed(2)               # destroys the process group: NCCL's are not left behind
    except (dist.DistError, RuntimeError) as e:
        if not isinstance(e, dist.DistError) and "gloo" not in str(e):
            raise                              # a bug, not a lost peer: keep the traceback
        # A peer died (its connection closed) or stalled past --timeout: stop, never hang.
        # NCCL raises DistBackendError; gloo a RuntimeError that names its own source file.
        where = f"rank {dist.get_rank()}" if dist.is_initialized() else "this rank"
        print(f"train.py: error: {where} lost contact with the other ranks ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:200]}); one of them died or stalled past --timeout. Its own "
              f"log says why; rerun the same command with --resume to continue from the last "
              f"checkpoint", file=sys.stderr)
        exit_distributed(1, peer_lost=True)
    exit_distributed()
