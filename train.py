"""train.py: the command line that composes the concept files into one training run.

A step: every rank takes its slice of the global batch (data.py), runs forward and backward
over --grad-accum micro-batches, the strategy averages the gradients (ddp.py, over
collectives.py), and the mixed-precision optimizer updates fp32 master weights
(mixed_precision.py). The log shows loss, tokens/s, per-rank memory and bytes sent per step.
Left out (for now): the sharded strategies, checkpoints and resume, which later files add.
Run: python train.py   or   torchrun --nproc_per_node 2 train.py --strategy ddp
Test: python -m pytest tests/test_train.py
"""
import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist

from collectives import Comm, init_distributed
from data import TextData
from ddp import DDP
from memory import held_bytes, state_bytes
from mixed_precision import DTYPES, MixedPrecisionOptimizer
from model import PRESETS, build_model
from zero import ZeroOptimizer

STRATEGIES = ("single", "ddp", "zero1", "zero2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="how ranks share the work (default: single for one process, ddp under torchrun)")
    p.add_argument("--model", choices=list(PRESETS), default="tiny")
    p.add_argument("--data", default=None, help="a text file to train on (default: the embedded "
                                                "Python standard library source)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step on each rank")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=None, help="end of the cosine decay (default: lr/10)")
    p.add_argument("--warmup", type=int, default=30, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--precision", choices=list(DTYPES), default="fp32",
                   help="dtype of the model; bf16 and fp16 keep fp32 master weights, fp16 scales the loss")
    p.add_argument("--collectives", choices=("native", "ring"), default="native",
                   help="torch.distributed's collectives, or ours from send/recv")
    p.add_argument("--bucket-mb", type=float, default=25, help="DDP gradient bucket size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100, help="eval loss every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=4)
    args = p.parse_args(argv)
    check_args(p, args, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    return args


def check_args(parser, args, world_size):
    """Stop a wrong configuration with one message naming the fix, before any work.

    Every rank parses the same command line with the same world size, so every rank
    stops with the same message: no rank is left waiting in a collective.
    """
    if args.strategy is None:
        args.strategy = "single" if world_size == 1 else "ddp"
    if args.strategy == "single" and world_size > 1:
        parser.error(f"--strategy single runs one process, but {world_size} were launched: "
                     f"use --strategy ddp (or zero1, zero2), or run with plain `python train.py`")
    per_step = world_size * args.grad_accum
    if args.batch_size % per_step:
        fixed = (args.batch_size // per_step + 1) * per_step
        parser.error(f"--batch-size {args.batch_size} does not divide into {world_size} ranks x "
                     f"--grad-accum {args.grad_accum} = {per_step} equal micro-batches: "
                     f"use a multiple of {per_step}, e.g. --batch-size {fixed}")
    block_size = PRESETS[args.model].block_size
    if args.seq_len > block_size:
        parser.error(f"--seq-len {args.seq_len} is longer than model {args.model}'s block size "
                     f"{block_size}: use --seq-len {block_size} or less, or a larger --model")
    for name in ("steps", "grad_accum", "seq_len", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")


def learning_rate(step, args):
    """Linear warmup to --lr, then cosine decay to --min-lr at the last step."""
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - 1 - args.warmup)
    return min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def eval_loss(model, data, args, rank, world_size, device):
    model.eval()
    losses = []
    for i in range(args.eval_batches):
        x, y = data.batch(i, args.batch_size, args.seq_len, args.seed, "eval", rank, world_size)
        losses.append(model(x.to(device), y.to(device))[1])
    model.train()
    return global_mean(torch.stack(losses).mean())


def global_mean(value: torch.Tensor) -> float:
    """The mean over ranks of a per-rank scalar: a metric, outside the byte counter."""
    value = value.detach().float().clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value.item()


def train_step(model, optimizer, x, y, args):
    """One optimizer step on this rank's rows x, y (B/N, T), in --grad-accum micro-batches.

    Returns this rank's mean loss (a tensor) and whether the update was applied (fp16
    skips a step whose gradients overflowed).
    """
    optimizer.zero_grad()
    ddp = isinstance(model, DDP)
    step_loss = torch.zeros((), device=x.device)
    for micro, (mx, my) in enumerate(zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum))):
        last = micro == args.grad_accum - 1
        # Gradients of all but the last micro-batch accumulate locally: one sync per step.
        with model.no_sync() if ddp and not last else contextlib.nullcontext():
            _, loss = model(mx, my)                                  # mean over (B/N/k, T)
            optimizer.scale_loss(loss / args.grad_accum).backward()
        step_loss += loss.detach() / args.grad_accum
    if ddp:
        model.finish_gradient_sync()
    return step_loss, optimizer.step(clip_grad=args.clip_grad or None)


def main(argv=None):
    args = parse_args(argv)
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    comm = Comm(ring=args.collectives == "ring")
    torch.manual_seed(args.seed)
    model = build_model(args.model, dropout=args.dropout).to(device=device, dtype=DTYPES[args.precision])
    adamw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if args.strategy in ("zero1", "zero2"):
        optimizer = ZeroOptimizer(model.parameters(), stage=int(args.strategy[-1]), optimizer_cls=torch.optim.AdamW,
                                  group=comm, bucket_mb=args.bucket_mb, **adamw)
    else:
        if args.strategy == "ddp":
            model = DDP(model, comm, bucket_mb=args.bucket_mb)
        # No comm for the overflow decision: after DDP's all-reduce every rank holds the same
        # averaged gradients, so every rank already decides the same way.
        optimizer = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW,
                                            precision=args.precision, **adamw)
    data = TextData.from_file(args.data)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"{args.strategy} on {world_size} x {device.type} ({dist.get_backend()}) | model {args.model} "
        f"{n_params / 1e6:.2f}M params | {args.precision} | global batch {args.batch_size} x "
        f"{args.seq_len} tokens, {args.grad_accum} micro-batch(es) per rank | {args.collectives} collectives")
    # What the strategy's collectives should send per step (ring volume), printed beside what
    # the counter measured.
    if args.strategy == "single":
        predicted = 0
    elif args.strategy == "ddp":
        predicted = model.bytes_per_step()
    else:
        predicted = optimizer.bytes_per_step(micro_batches=args.grad_accum)
    # memory.py's napkin math for this run, to read beside the measured bytes in the log.
    napkin = state_bytes(n_params, "ddp" if args.strategy == "single" else args.strategy,
                         args.precision, world_size)
    say(f"napkin math per rank (memory.py): params {napkin['params'] / 2**20:.1f} MiB, grads "
        f"{napkin['grads'] / 2**20:.1f}, optim {napkin['optimizer'] / 2**20:.1f}, total "
        f"{napkin['total'] / 2**20:.1f}")

    tokens_per_step = args.batch_size * args.seq_len
    timer, last_timed, skipped = time.perf_counter(), -1, 0
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        comm.bytes_sent.clear()
        x, y = data.batch(step, args.batch_size, args.seq_len, args.seed,
                          rank=rank, world_size=world_size)          # (B/N, T)
        loss, applied = train_step(model, optimizer, x.to(device), y.to(device), args)
        skipped += not applied

        if step % args.log_every == 0 or step == args.steps - 1:
            loss = global_mean(loss)                                 # the global batch's mean
            if device.type == "cuda":
                torch.cuda.synchronize()
            tokens_per_s = tokens_per_step * (step - last_timed) / (time.perf_counter() - timer)
            held = held_bytes(model, optimizer)
            peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else sum(held.values())
            say(f"step {step:5d} | loss {loss:.4f} | lr {learning_rate(step, args):.2e} | "
                f"{tokens_per_s / 1e3:7.1f}k tok/s | mem {peak / 2**20:.1f} MiB (params "
                f"{held['params'] / 2**20:.1f}, grads {held['grads'] / 2**20:.1f}, optim "
                f"{held['optimizer'] / 2**20:.1f}) | sent {sum(comm.bytes_sent.values()) / 2**20:.2f} "
                f"MiB/step (ring formula {predicted / 2**20:.2f})" + (f" | skipped {skipped}" if skipped else ""))
            timer, last_timed = time.perf_counter(), step
        if args.eval_every and step and step % args.eval_every == 0:
            say(f"step {step:5d} | eval loss {eval_loss(model, data, args, rank, world_size, device):.4f}")
            timer, last_timed = time.perf_counter(), step            # time training steps only
    say(f"done | eval loss {eval_loss(model, data, args, rank, world_size, device):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
