"""running/run_log.py: what train.py prints, each number saying what it is, and how a run ends.

The log: the run's header (cli.describe_run, the CPU threads), memory per rank as napkin/memory.py
predicts it (the lecture's four terms: parameters, gradients, optimizer state, activations)
and as the run measures it, in the same words (printed again only when it changes), and each
logged step's loss, speed (beside napkin/step_time.py's: predicted_seconds), bytes sent beside their
formula and time left; --profile's traces and --memory-snapshot (start_profiling). The end, on the
command line: a refused command line, a refusal or divergence found while running, a lost
peer, Ctrl-C and SIGTERM (running/stopping.py) each print one line (under torchrun once: values.say_error;
SIGTERM's, every rank that got it) and exit with a code.
Test: python -m pytest tests/test_train.py -k "log or interrupt or usage"
"""
import contextlib
import json
import os
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist

from running import snapshot
from running.errors import RunError
from foundations.values import record_for_torchrun, say_error
from running.stopping import StopSignals
from foundations.comm import Comm
from foundations.dtypes import DTYPES
from napkin.flops import Shape
from napkin.machines import this
from napkin.memory_math import (activation_bytes, cp_activation_bytes, kept_activation_bytes,
                                logits_bytes, pipeline_activation_bytes, quantized_params)
from composition.mesh_checks import ParallelDims
from foundations.process_groups import gather_objects
from foundations.world import LaunchError
from napkin.step_time import DATA_PARALLEL, Step, predict

MiB = 2**20


def clock(seconds: float) -> str:
    """12.3 -> '0:12', 3725 -> '1:02:05'."""
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def state_text(held: dict) -> str:
    """Parameters, gradients and optimizer state in MiB, as predicted and as measured alike:
    'params 3.3 MiB, grads 3.3, optim 6.7 = 13.3 on the device' (and the host's with --offload)."""
    device = held["params"] + held["grads"] + held["optimizer"]
    return (f"params {held['params'] / MiB:.1f} MiB, grads {held['grads'] / MiB:.1f}, optim "
            f"{held['optimizer'] / MiB:.1f} = {device / MiB:.1f} on the device"
            + (f", host {held['host'] / MiB:.1f} in CPU memory (--offload)" if held.get("host") else ""))


def predicted_memory(napkin: dict, activations: tuple | None) -> str:
    """The header's line: napkin/memory.py's bytes per rank, the state held between steps and the
    activations (predicted_activations: counted as autograd keeps them, what the count leaves
    out, and the lecture's rule beside)."""
    if activations is None:
        kept = ""
    else:
        counted, left_out, lecture = activations
        kept = (f" | + activations {counted / MiB:.1f} MiB kept for backward (counted op by op as "
                f"autograd keeps them: memory_math.kept_activation_bytes{left_out}) | the lecture's "
                f"rule: activations {lecture / MiB:.1f} MiB kept for backward (Korthikanti et al.'s "
                f"formula and the loss's log-probabilities; it counts dropout masks and the s x s "
                f"attention scores, which the fused attention recomputes instead)")
    return f"memory per rank, predicted (memory.py's napkin math): {state_text(napkin)}{kept}"


def measured_memory(held: dict, activations: int | None, peak: int | None) -> str:
    """A logged step's line, in predicted_memory's words: the state counted tensor by tensor,
    the bytes the step's first micro-batch kept for backward, CUDA's peak allocation."""
    return ("memory per rank, measured: " + state_text(held)
            + ("" if activations is None else f" | + activations {activations / MiB:.1f} MiB kept "
               f"for backward (autograd's saved tensors)")
            + ("" if peak is None else f" | peak {peak / MiB:.1f} MiB allocated since the last logged step "
               f"(all four, and temporaries)"))


def step_line(step: int, loss: float, lr: float, tokens_per_s: float, sent: int, formula: int,
              world_size: int, skipped: int, steps: int, elapsed: float, left: float | None,
              napkin: str = "", why: str = "") -> str:
    """A logged step: its global loss, lr, speed (napkin: its time beside napkin/step_time.py's), rank 0's
    bytes sent in the step beside their ring formula (on more than one rank; why: the clause saying
    why the formula departs from the lecture's rule, report.sent_departs), skipped fp16 steps,
    progress and the seconds left (Clock.seconds_left; None: not known yet)."""
    remaining = (f"about {clock(left)} left" if left is not None
                 else "time left from the next logged step (the first warms up)")
    return (f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s / 1e3:7.1f}k tok/s{napkin}"
            + (f" | sent {sent / MiB:.2f} MiB/step (ring formula {formula / MiB:.2f}){why}"
               if world_size > 1 else "")
            + (f" | skipped {skipped}" if skipped else "")
            + f" | {step + 1}/{steps} in {clock(elapsed)}, {remaining}")


class Clock:
    """The log's time: since the run (re)started, and since the last timed step (tokens/s count
    training steps only: the clock restarts after an eval or a save); skipped fp16 steps."""

    def __init__(self, start: int, device):
        self.start, self.device, self.skipped = start, device, 0
        self.began, self.first_done = time.perf_counter(), None
        self.restart(start - 1)
        if device.type == "cuda":
            # Set-up held more than training does (the whole fp32 model before ZeRO or FSDP
            # sharded it): the logged peak starts here, and again after each logged step.
            torch.cuda.reset_peak_memory_stats(device)

    def restart(self, step: int):
        self.timer, self.last_timed = time.perf_counter(), step

    def step_done(self, step: int):
        """Note when the first step since the (re)start ended: its warm-up (the allocator's first
        blocks, the collectives' first connections, lazy initialisation) took many times a
        later step's time, and says nothing about them."""
        if step == self.start:
            self.first_done = time.perf_counter()

    def seconds_left(self, step: int, steps: int) -> float | None:
        """The steps after `step` at the pace of those since the first (evals and saves
        included: they recur); None right after the first, whose pace is its warm-up's."""
        if step + 1 >= steps:
            return 0.0
        if step == self.start:
            return None
        return (time.perf_counter() - self.first_done) / (step - self.start) * (steps - step - 1)


class RunLog:
    """Rank 0's lines, on stdout and (with --out) in OUT/log.txt (file: opened by
    snapshot.own_outputs); and the step under way, for the line a stop signal prints. Made before
    the process group (rank: set once it exists; None says nothing)."""

    def __init__(self, args, rank: int | None = None, file=None):
        self.rank, self.out, self.file = rank, args.out, file
        self.step, self.last = None, {}

    def say(self, line: str):
        if self.rank == 0:
            print(line, flush=True)
            if self.file:
                self._write(line)

    def _write(self, line: str):
        """line into log.txt. One the disk has no room for ends the file at its last whole line,
        and the run goes on, logging on stdout only: said once (rank 0's log is no reason to stop
        the other ranks; a checkpoint that does not fit stops them all, saying what it needs)."""
        whole = os.fstat(self.file.fileno()).st_size          # every earlier line was flushed
        try:
            print(line, file=self.file, flush=True)
        except OSError as e:
            file, self.file = self.file, None
            with contextlib.suppress(OSError):    # closed all the same, its unwritten rest dropped
                file.close()
            with contextlib.suppress(OSError):
                os.truncate(file.name, whole)     # shorter: needs no room
            print(f"train.py: {file.name} cannot take more lines ({e.strerror}): from here the "
                  f"log is on stdout only", flush=True)

    def say_if_changed(self, step: int, what: str, text: str):
        """'step N | text', unless the last line about `what` said the same."""
        if self.last.get(what) != text:
            self.last[what] = text
            self.say(f"step {step:5d} | {text}")


def last_checkpoint(log: RunLog | None) -> str | None:
    """The newest complete checkpoint in --out (this run's or the one it resumed from), read
    from the disk now: where --resume would continue from."""
    return snapshot.latest(log.out) if log is not None and log.out else None


def resume_hint(log: RunLog | None) -> str:
    """The end of a stopped run's line: the checkpoint to continue from, or that there is none."""
    saved = last_checkpoint(log)
    if saved:
        return f"the last checkpoint is {saved}: rerun the same command with --resume to continue from it"
    if log is not None and log.out:
        return f"no checkpoint in {log.out} yet (--save-every K writes one every K steps)"
    return "nothing was saved (--out DIR --save-every K keeps a checkpoint every K steps)"


def interrupted_line(log: RunLog | None, signum: int = signal.SIGINT) -> str:
    """Where a stop signal (Ctrl-C's SIGINT, or SIGTERM) stopped the run, and resume_hint.
    SIGTERM's names the rank: every rank that gets it says so, since the rank torchrun found
    dead (killed outright, silent) may be local rank 0, which says Ctrl-C's line for the job."""
    step = "before the first step" if log is None or log.step is None else f"at step {log.step}"
    if signum != signal.SIGTERM:
        return f"train.py: interrupted {step}; {resume_hint(log)}"
    who = f"rank {dist.get_rank()} " if dist.is_initialized() and dist.get_world_size() > 1 else ""
    why = (" (torchrun sends it to every rank when one fails, its summary names the first, or when "
           "the job is stopped)" if "TORCHELASTIC_RUN_ID" in os.environ else "")
    return f"train.py: {who}stopped by SIGTERM {step}{why}; {resume_hint(log)}"


def finish(main, signals: StopSignals) -> int:
    """Run main(logs=[]) as the command line does, stopped by signals (installed before train.py's
    imports): its exit code, any way it stops said in one line: 0 done, 2 refused (the command
    line, a check while running, a divergence), 1 a peer lost, 130 Ctrl-C, 143 SIGTERM. A bug
    keeps its traceback."""
    logs = []
    signals.stuck = lambda: stopped(KeyboardInterrupt(), signals, logs[-1] if logs else None)
    try:
        signals.run()
        main(logs=logs)
        signals.stopping = signals.taken = True     # done: a signal from here on is only noted
        return 0
    except BaseException as e:           # Ctrl-C, SIGTERM, and SystemExit: argparse's exit 2
        # First, before any call (where Python runs a pending signal's handler): a signal
        # arriving from here on, or caught inside a collective until now, is only noted.
        signals.stopping = signals.taken = True
        return stopped(e, signals, logs[-1] if logs else None)


PAIR_CLOSED = "Application timeout caused pair closure"        # gloo's, naming no gloo file


def stopped(error: BaseException, signals: StopSignals, log: RunLog | None) -> int:
    """finish's line and exit code for the error that stopped the run."""
    if signals.received == signal.SIGTERM:     # this rank's line: a peer may be gone, rank 0 too
        line = interrupted_line(log, signal.SIGTERM)
        print(line, file=sys.stderr, flush=True)
        record_for_torchrun(line)
        return 128 + signal.SIGTERM
    if signals.received:            # every rank got it; a peer that stopped first is no news
        say_error(interrupted_line(log), refusal=False)
        return 128 + signal.SIGINT
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) else 1
    if isinstance(error, (RunError, snapshot.CheckpointError, LaunchError)):
        say_error(f"train.py: error: {error}")
        return 2
    if not isinstance(error, dist.DistError) and not (isinstance(error, RuntimeError) and (
            "gloo" in str(error) or PAIR_CLOSED in str(error))):
        raise error                                    # a bug, not a lost peer: keep the traceback
    # A peer died (its connection closed) or stalled past --timeout: stop, never hang. NCCL
    # raises DistBackendError; gloo a RuntimeError that names its own source file, but for the
    # one every other message of a group meets once one timed out (PAIR_CLOSED), which a native
    # collective's wait can meet first.
    where = f"rank {dist.get_rank()}" if dist.is_initialized() else "this rank"
    saved = last_checkpoint(log)
    print(f"train.py: error: {where} lost contact with the other ranks ({type(error).__name__}: "
          f"{str(error).splitlines()[0][:200]}); one of them died or stalled past --timeout. Its own "
          f"log says why; rerun the same command with --resume to continue from the last "
          f"checkpoint" + (f", {saved}" if saved else ""), file=sys.stderr, flush=True)
    return 1


def predicted_activations(args, cfg, dims: ParallelDims) -> tuple[int, str, int] | None:
    """(memory_math.kept_activation_bytes for one micro-batch of this rank's rows (B/D/k, T),
    what it leaves out ("" or "; ..." for the log), the lecture's rule for them: activation_bytes
    and the loss's fp32 log-probabilities); a pipeline's: stage 0's peak over its schedule
    (pipeline_activation_bytes); None for a pipeline of uneven stages (--stage-layers) or beside
    cp. Under cp the context line measures them."""
    splits = dims.splits
    if "pp" in splits and ("cp" in splits or args.stage_layers):
        return None
    rows, value = args.batch_size // dims.dp // args.grad_accum, DTYPES[args.precision].itemsize
    options = dict(checkpoint_every=args.checkpoint_activations or 0,
                   adapted=args.lora_targets.split(",") if args.lora else None,
                   lora_rank=args.lora_rank, tp=splits.get("tp", 1),
                   sequence_parallel=args.sequence_parallel, ep=args.ep)
    masked = args.dropout or args.lora and args.lora_dropout
    uncounted = "; dropout's masks not counted" if masked else ""
    if hasattr(cfg, "n_kv_head"):     # a Llama's count (kept_llama_bytes) holds its int64 ids too
        if args.grad_accum > 1 or "pp" in splits and not args.lora:
            uncounted += ("; the token ids and targets counted for one micro-batch, measured "
                          "as the whole batch they are views of")
        if splits.get("cp", 1) > 1 and args.cp_attention == "allgather":
            uncounted += "; all-gather attention's gathered K/V and masks not counted"
    if "pp" in splits:             # stage 0's (rank 0 logs): its peak over the step's schedule
        pipeline = (cfg, args.schedule, args.pp, args.microbatches, rows // args.microbatches,
                    args.seq_len, args.virtual_stages or 1, value)
        return (pipeline_activation_bytes(*pipeline, kept=options)[0],
                "; the most stage 0 holds at once" + uncounted,
                pipeline_activation_bytes(*pipeline)[0])
    counted = kept_activation_bytes(cfg, args.seq_len, rows, value, **options, cp=splits.get("cp", 1),
                                    cp_attention=args.cp_attention or "ring")
    left_out = ("; a block's share recomputed in backward, held meanwhile, not counted"
                if args.checkpoint_activations else "") + uncounted
    cp, every = splits.get("cp", 1), args.checkpoint_activations
    checkpointed = -(-cfg.n_layer // every) if every else 0         # blocks 0, K, 2K, ...
    shape = (rows, cfg.n_embd, cfg.n_head)
    moe = dict(moe=cfg if cfg.experts else None, ep=args.ep, tp=options["tp"],
               sequence_parallel=args.sequence_parallel)
    lecture = logits_bytes(args.seq_len // cp, rows, cfg.vocab_size // options["tp"]) + (
        cp_activation_bytes(args.seq_len, *shape, cfg.n_layer, cp, args.cp_attention or "ring",
                            bool(every), value) if cp > 1 else
        activation_bytes(args.seq_len, *shape, cfg.n_layer - checkpointed, False, value, **moe)
        + (activation_bytes(args.seq_len, *shape, checkpointed, True, value, **moe) if every else 0))
    return counted, left_out, lecture


def predicted_seconds(args, gpt, dims: ParallelDims, device) -> float | str:
    """train.py's run priced by napkin/step_time.py on this machine (machines.this, measured by every
    rank at its first call: call it on every rank): seconds per step, or, for what the napkin
    does not compose, why not, which the log says in its place. The model: model.py's GPT, or
    hf:DIR's (a Llama's shape and block: flops.Shape.of, machines.rank_block)."""
    splits, cfg, world_size = dims.splits, gpt.cfg, dims.world
    pipelined = splits.get("pp") == world_size and len(splits) == 1
    cp = world_size if splits == {"cp": world_size} and args.strategy in ("cp", "ddp") else 1
    strategy = ("tp" if splits.get("tp") == world_size and len(splits) == 1 else
                f"pipeline-{args.schedule or '1f1b'}" if pipelined else "ddp" if cp > 1 else
                {"zero3": "fsdp"}.get(args.strategy, args.strategy) if not splits else None)
    known = strategy in (*DATA_PARALLEL, "tp") or str(strategy).startswith("pipeline-")
    mesh = " x ".join(f"{d} {n}" for d, n in splits.items())
    unpriced = [                  # (what the napkin leaves out, what the log says in its place)
        (not known, f"step_time.py prices one split over the whole world, not {mesh} of "
                    f"{world_size} ranks"),
        (args.grad_accum > 1, f"step_time.py prices one micro-batch a step, not --grad-accum "
                              f"{args.grad_accum}"),
        (args.shard_group, "step_time.py has no hybrid sharding (--shard-group)"),
        (args.ep > 1 and (strategy != "ddp" or cp > 1), "step_time.py prices --ep under ddp alone, "
                                                        "without --cp"),
        (cp > 1 and (args.cp_balance != "zigzag" or args.checkpoint_activations),
         "step_time.py prices --cp with zigzag balance, without checkpointing")]
    why = next((why for left_out, why in unpriced if left_out), None)
    if why:
        return why
    M = args.microbatches or 1 if pipelined else 1
    rows = args.batch_size // (M if pipelined else 1 if strategy == "tp" else world_size)
    if cp > 1:       # a cp rank's B cp/N rows of T/cp tokens, at its own attention's rate
        rows = args.batch_size * cp // world_size
    machine = this(cfg, rows, args.seq_len, args.precision, device=device,
                   split=world_size if strategy == "tp" else 1, cp=cp,
                   attention=args.cp_attention or "ring")
    trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad)
    shape = Shape.of(cfg)
    lora = (trainable, shape.layers * shape.block_params() + shape.vocab * shape.width) if args.lora else None
    step = Step(shape, strategy, world_size, args.batch_size, args.seq_len, args.precision, M,
                args.virtual_stages or 1, 1 / args.checkpoint_activations if args.checkpoint_activations else 0.0,
                lora, bool(args.offload), args.bucket_mb, ep=args.ep, cp=cp, attention=args.cp_attention or "ring",
                quantized=quantized_params(cfg) if args.quantize_base and strategy == "fsdp" else 0)
    return predict(step, machine)["seconds"]


# ---- --profile and --memory-snapshot ----------------------------------------------------------

def start_profiling(args, rank, world_size, device):
    """torch.profiler over steps 2-4 (after two warm-up steps), and CUDA's allocation history.

    Returns a function to call after every step: it advances the profiler's schedule and
    writes the memory snapshot once its steps are done. A trace that could not be written
    whole (check_trace) stops every rank, at the step that wrote it, with one RunError.
    """
    profiler, traces = None, []
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        trace = os.path.join(args.profile, f"trace-rank{rank}.json")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities, profile_memory=True,
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
            on_trace_ready=lambda p: traces.append(check_trace(p, trace)))
        profiler.start()
    snapshot_file, snapshot_steps = args.memory_snapshot, [0]
    if snapshot_file:
        if world_size > 1:                        # one file per rank: model.pickle -> model-rank1.pickle
            root, ext = os.path.splitext(snapshot_file)
            snapshot_file = f"{root}-rank{rank}{ext}"
        torch.cuda.memory._record_memory_history(max_entries=100_000)

    def step_done(last: bool):
        if profiler:
            profiler.step()
            if last:
                profiler.stop()
        if traces:                                # every rank's was written at this step
            problems = [p for p in gather_objects(traces.pop(), Comm(), device) if p]
            if problems:
                raise RunError(problems[0])
        if snapshot_file and snapshot_steps[0] >= 0:
            snapshot_steps[0] += 1
            if snapshot_steps[0] == 5 or last:
                torch.cuda.memory._dump_snapshot(snapshot_file)
                torch.cuda.memory._record_memory_history(enabled=None)
                snapshot_steps[0] = -1
    return step_done


def check_trace(profiler, trace: str) -> str | None:
    """Write profiler's chrome trace to `trace` and read it back: torch's C++ writer only logs a
    write that fails (a full disk leaves trace.tmp cut short, its first file, and no trace).
    None if it reads back whole; else the line that says so, what was cut short removed."""
    profiler.export_chrome_trace(trace)
    try:
        with open(trace) as f:
            json.load(f)
        return None
    except (OSError, ValueError):
        directory = os.path.dirname(trace)
        free = shutil.disk_usage(directory).free          # what the writer found
        for cut in (trace, trace + ".tmp"):
            with contextlib.suppress(OSError):
                os.remove(cut)
    return (f"--profile {directory}: {trace} was cut short as it was written ({free:,} bytes free "
            f"there: a full disk?) and is removed: free space there, or give another --profile "
            f"directory, and rerun")
