"""train.py: build, loop, log. The concept files composed into one training run.

A step: each rank takes its slice of the global batch, runs forward and backward over
--grad-accum micro-batches, the strategy averages the gradients and the mixed-precision optimizer
updates the fp32 master weights (mixed_precision.py). data_parallel below builds the strategy:
ddp.py's replicas, zero.py's sharded optimizer or fsdp.py's units. A mesh splits the matrices
over --tp ranks, the sequences over --cp, the blocks into --pp stages and the experts over --ep,
in any combination (composition/parallelize.py). The log says loss, speed, bytes and memory
beside their formulas (running/report.py). With --out the run is a directory whose checkpoints
--resume continues bit for bit (running/snapshot.py).
Run: python train.py   or   torchrun --nproc_per_node 2 train.py --strategy zero2
Test: python -m pytest tests/test_train.py tests/test_snapshot.py tests/test_run_log.py
"""
import contextlib
import math
import os

# OpenMP's threads spin between parallel regions by default, holding a core the other ranks wait
# for (a step 20x longer on 2 shared cores); passive ones sleep. Read when torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if __name__ == "__main__":
    # Before torch's import (seconds on a loaded machine): a Ctrl-C or SIGTERM is said then too.
    from running.stopping import StopSignals
    signals = StopSignals()

import torch
import torch.distributed as dist
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR

from running import report, snapshot
from running.cli import parse_args
from running.data import TextData, pinned_copy
from composition.mesh_checks import ParallelDims
from running.divergence import Divergence
from running.errors import RunError, refused
from foundations.meters import peak_saved_bytes, saved_activation_bytes
from composition import parallelize
from ddp import DDP
from fsdp import FSDP, MixedPrecisionPolicy
from mechanics.fsdp_optimizer import FSDPOptimizer
from mixed_precision import DTYPES, MixedPrecisionOptimizer
from zero import Zero2Optimizer, ZeroOptimizer
from foundations.process_groups import global_mean
from foundations.world import exit_distributed, init_distributed
from running.threads import cpu_threads
from running.run_log import Clock, RunLog, finish, predicted_seconds, start_profiling
from running.snapshot import load_weights, own_outputs


def learning_rate(step, args):
    """Linear warmup to --lr, then cosine decay to --min-lr at the last step."""
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - 1 - args.warmup)
    return min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def eval_loss(model, data, args, rank, world_size, device, my_tokens):
    """The mean loss over --eval-batches held-out batches (my_tokens: build's Run.my_tokens)."""
    model.eval()
    losses = []
    for i in range(args.eval_batches):
        batch = data.batch(i, args.batch_size, args.seq_len, args.seed, "eval", rank, world_size)
        x, y = my_tokens(*batch)
        _, loss = model(x.to(device), y.to(device))      # a pipeline forwards through every stage
        losses.append(loss)
    model.train()
    return global_mean(torch.stack(losses).mean())


def train_step(model, optimizer, sync, x, y, args, measure=False, kept: dict | None = None):
    """One optimizer step on this rank's rows x, y (B/N, T) in --grad-accum micro-batches: (this
    rank's mean loss, False if the update was skipped: gradients with inf or NaN, on every rank).
    sync: the run's flat.GradientSyncs. measure: time a pipeline's compute exactly. kept: gets
    "bytes", the activations kept for backward (a pipeline's: the most its stage held at once)."""
    optimizer.zero_grad(set_to_none=True)
    if hasattr(model, "train_step"):
        # A pipeline runs the --microbatches by its schedule; replicas average once per step.
        step = lambda: model.train_step(x, y, optimizer.scale_loss, measure)
        if kept is None:
            return step(), update(optimizer, args)
        inner = getattr(model.module, "module", model.module)
        weights = [*model.module.parameters(), *inner.parameters()]
        kept["bytes"], loss = peak_saved_bytes(step, weights)       # the micro-batches in flight
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
                # The weights the module computes with: FSDP's own parameters are its shards
                weights = [*model.parameters(), *getattr(model, "module", model).parameters()]
                kept["bytes"], (_, loss) = saved_activation_bytes(lambda: model(mx, my), weights)
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


# ---- the strategy: the data-parallel rungs, built here over the whole model --------------------

def data_parallel(gpt, args, group, device):
    """--strategy over the data group: (the model the loop calls, the optimizer that steps)."""
    adamw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    reduce_dtype = DTYPES[args.reduce_dtype]               # the gradients' dtype on the wire
    if args.strategy in ("single", "ddp"):          # replicas: all-reduce the gradients (ddp.py)
        model = DDP(gpt, group, args.bucket_mb, reduce_dtype) if args.strategy == "ddp" else gpt
        return model, MixedPrecisionOptimizer(gpt.parameters(), AdamW, args.precision, **adamw)
    if args.strategy in ("zero1", "zero2"):    # the model whole, the optimizer sharded (zero.py)
        sharded = Zero2Optimizer if args.strategy == "zero2" else ZeroOptimizer
        return gpt, sharded(gpt.parameters(), AdamW, group, args.bucket_mb, reduce_dtype, **adamw)
    # fsdp (zero3): each block a unit, its shards gathered to compute and freed after (fsdp.py)
    model = FSDP(gpt, group=group, prefetch=args.prefetch, device=device,
                 mp_policy=MixedPrecisionPolicy(DTYPES[args.precision], reduce_dtype))
    return model, FSDPOptimizer(model, AdamW, **adamw)


def build(args, device, dims: ParallelDims, gpt) -> parallelize.Run:
    """The run on this rank: gpt under data_parallel's rung; a mesh (--tp, --cp, --pp, --ep), the
    talk's extensions (--shard-group, --offload, --lora) or hf:DIR by composition/parallelize."""
    if dims.splits or dims.ep > 1 or args.shard_group or args.offload or args.lora or args.hf:
        return parallelize.build(args, device, dims, gpt)
    comm, mesh = parallelize.device_mesh(args, dims)
    parallelize.prepare(gpt, args, device)          # the cast the strategy needs, checkpointing
    model, optimizer = data_parallel(gpt, args, mesh.dp, device)
    return parallelize.observed(args, dims, gpt, model, optimizer, comm, mesh)


# ---- the run ---------------------------------------------------------------------------------

def main(argv=None, live_bytes: bool = False, logs: list | None = None) -> dict:
    """Train as the command line says (argv: its words; None: sys.argv); return the history
    (losses at logged steps, eval_loss, ...). live_bytes (CPU): every live tensor's bytes at each
    logged step (leak tests). logs gets the run's RunLog (where a Ctrl-C stopped it)."""
    args = parse_args(argv)
    if args.sample:
        return report.sample(args)
    log = RunLog(args)                 # from here a stop signal's line names --out's checkpoints
    if logs is not None:
        logs.append(log)
    args.timeout = args.timeout or (600 if torch.cuda.is_available() else 120)    # seconds
    device = init_distributed(timeout=args.timeout)
    log.rank = dist.get_rank()
    # The command line shares this node's cores among its ranks; a caller in Python (a test's
    # ranks, one thread each) keeps its own count unless --threads says otherwise.
    threads = (cpu_threads(args.threads, device, bool(args.offload))
               if argv is None or args.threads else "")
    export_size = report.export_bytes(args) if args.export else 0
    with own_outputs(args, dist.get_rank(), device, export_size) as (took_over, log.file):
        for line in [took_over] if took_over else []:
            log.say(line)
        return run(args, device, log, threads, live_bytes)


def run(args, device, log: RunLog, threads: str, live_bytes: bool) -> dict:
    """main's run, once this process owns its outputs (own_outputs), saying each step in log."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # A LoRA run's base weights, recorded in its checkpoints: --resume over others is refused.
    base = snapshot.base_identity(args.init_from) if args.lora and args.init_from else None
    dims = ParallelDims.from_args(args, world_size)       # the layout, computed once
    try:
        # fp32, the same on every rank; hf:DIR's built hollow, each unit read as build lays it out
        gpt = snapshot.pretrained_model(args) or parallelize.new_gpt(args)
        if args.init_from and not args.init_from.startswith(snapshot.HF):
            load_weights(args.init_from, gpt)
        job = build(args, device, dims, gpt)
        data = TextData.from_file(args.data, snapshot.pretrained_tokenizer(args.hf))
        data.check_length(args.seq_len)       # a model's tokens: fewer than --data's bytes
    except ValueError as e:
        if not refused(e):
            raise                              # a bug on the way: its traceback says where
        raise RunError(str(e)) from None       # a strategy refused its input: same on every rank
    gpt, model, optimizer, mesh = job.gpt, job.model, job.optimizer, job.mesh
    # Copies (dp x cp) are written once, by the first holder; a tensor group gathers its slices.
    split = mesh.tp if dims.tp_enabled else mesh.pp if dims.pp_enabled else None
    layout = snapshot.layout_of(gpt, mesh.dp_cp, split)
    start, first_loss = (snapshot.resume(args, gpt, optimizer, layout, world_size, rank, log.say)
                         if args.resume else (0, None))
    activations = report.say_header(args, gpt, job.napkin, log, dims, threads, device)
    history = {"losses": {}, "live_bytes": {}, "napkin": job.napkin, "held": {},     # this rank's
               "napkin_activations": activations and activations[0]}
    step_done = start_profiling(args, rank, world_size, device)
    evaluate = lambda: eval_loss(model, data, args, mesh.dp.rank, mesh.dp.world_size, device,
                                 job.my_tokens)
    if args.init_from and start == 0:          # fine-tuning: where the new text starts from
        history["eval_loss_before"] = evaluate()
        log.say(f"step     0 | eval loss {history['eval_loss_before']:.4f} (before training)")
    clock = Clock(start, device)
    napkin_seconds = predicted_seconds(args, gpt, dims, device)     # this machine, measured
    for group in optimizer.param_groups:      # LambdaLR's base: it may start at a resumed step
        group["initial_lr"] = args.lr
    lr_at = lambda s: learning_rate(s, args) / args.lr              # learning_rate as a factor
    schedule = LambdaLR(optimizer, lr_at, last_epoch=start - 1)
    divergence = Divergence(args, gpt.cfg.vocab_size, first_loss)
    for step in range(start, args.steps):
        log.step = step
        job.comm.bytes_sent.clear()
        mesh.clear()
        x, y = data.batch(step, args.batch_size, args.seq_len, args.seed,
                          rank=mesh.dp.rank, world_size=mesh.dp.world_size)      # (B/D, T)
        x, y = job.my_tokens(x, y)                                   # cp pipeline: (B/D, T/cp)
        logged = step % args.log_every == 0 or step == args.steps - 1
        kept = {} if logged and not dims.cp_enabled else None
        x, y = pinned_copy(x, device), pinned_copy(y, device)
        loss, applied = train_step(model, optimizer, job.sync, x, y, args, logged, kept)
        divergence.after_step(step, applied, loss, optimizer.scaler.scale)
        clock.skipped += not applied
        clock.step_done(step)
        schedule.step()                                              # the next step's lr
        if logged:
            loss = global_mean(loss)                                 # the global batch's mean
            divergence.check_loss(step, loss)
            report.say_step(args, job, log, clock, step, loss, learning_rate(step, args), kept,
                            history, live_bytes, napkin_seconds)
        if args.eval_every and step and step % args.eval_every == 0:
            log.say(f"step {step:5d} | eval loss {evaluate():.4f}")
            clock.restart(step)                                      # time training steps only
        step_done(last=step + 1 == args.steps)
        saving = args.save_every and (step + 1) % args.save_every == 0
        if args.out and (step + 1 == args.steps or saving):
            report.save(args, job, layout, log, divergence, step, loss, base)
            clock.restart(step)
    history["eval_loss"] = evaluate()
    log.say(f"done | eval loss {history['eval_loss']:.4f}")
    if args.export or args.export_hf:           # one fp32 file, or a Hugging Face directory
        report.export(args, job, layout, log)
    return history


if __name__ == "__main__":
    code = finish(main, signals)
    # 1 (a peer lost), 130 and 143 (Ctrl-C, SIGTERM: the peers may be gone): the group is kept.
    exit_distributed(code, peer_lost=code not in (0, 2))
