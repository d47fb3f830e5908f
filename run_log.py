"""run_log.py: what train.py prints, each number saying what it is, and how a run ends.

The log: the run's header (cli.describe_run, the CPU threads), memory per rank as memory.py
predicts it (the lecture's four terms: parameters, gradients, optimizer state, activations)
and as the run measures it, in the same words (printed again only when it changes), and each
logged step's loss, speed, bytes sent beside their formula and time left. The end, on the
command line: a refused command line, a refusal or divergence found while running, a lost
peer, and Ctrl-C each print one line (under torchrun once: cli.say_error) and exit with a code.
Test: python -m pytest tests/test_train.py -k "log or interrupt or usage"
"""
import contextlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import snapshot
from cli import say_error
from dtypes import DTYPES
from memory import activation_bytes, logits_bytes
from mesh_checks import mesh_splits
from process_groups import LaunchError

MiB = 2**20
INTERRUPTED = 130            # a shell's exit status for a process stopped by Ctrl-C (128 + SIGINT)


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


def predicted_memory(napkin: dict, activations: int | None) -> str:
    """The header's line: memory.py's bytes per rank, the state held between steps and, where
    the run has no tp, pp or cp split (their own lines say theirs), the activations."""
    kept = ("" if activations is None else f" | + activations {activations / MiB:.1f} MiB kept for "
            f"backward (Korthikanti et al.'s formula and the loss's log-probabilities)")
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
              napkin: str = "") -> str:
    """A logged step: its global loss, lr, speed (napkin: its time beside step_time.py's), rank 0's
    bytes sent in the step beside their ring formula (on more than one rank), skipped fp16 steps,
    progress and the seconds left (Clock.seconds_left; None: not known yet)."""
    remaining = (f"about {clock(left)} left" if left is not None
                 else "time left from the next logged step (the first warms up)")
    return (f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s / 1e3:7.1f}k tok/s{napkin}"
            + (f" | sent {sent / MiB:.2f} MiB/step (ring formula {formula / MiB:.2f})" if world_size > 1 else "")
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
    snapshot.own_outputs); and the step under way, for the line Ctrl-C prints."""

    def __init__(self, args, rank: int, file=None):
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


class CtrlC:
    """SIGINT, as the command line handles it: the first raises KeyboardInterrupt (where the run
    is), unless the run is already stopping (then it is only noted); a second while stopping
    ends the process at once. torchrun forwards a Ctrl-C to every worker as SIGINT."""

    def __init__(self):
        self.received = self.stopping = False
        # A job started in the background (`cmd &` in a script, nohup) ignores SIGINT: it stays so.
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, self)

    def __call__(self, signum, frame):
        if self.received and self.stopping:
            os._exit(INTERRUPTED)
        self.received = True
        if not self.stopping:
            raise KeyboardInterrupt


def interrupted_line(log: RunLog | None) -> str:
    """Where Ctrl-C stopped the run, and where --resume would continue from (the newest complete
    checkpoint in --out, this run's or the one it resumed from)."""
    step = "before the first step" if log is None or log.step is None else f"at step {log.step}"
    saved = snapshot.latest(log.out) if log is not None and log.out else None
    if saved:
        then = f"the last checkpoint is {saved}: rerun the same command with --resume to continue from it"
    elif log is not None and log.out:
        then = f"no checkpoint in {log.out} yet (--save-every K writes one every K steps)"
    else:
        then = "nothing was saved (--out DIR --save-every K keeps a checkpoint every K steps)"
    return f"train.py: interrupted {step}; {then}"


def finish(main) -> int:
    """Run main(logs=[]) as the command line does: its exit code, any way it stops said in one
    line: 0 done, 2 refused (the command line, a check while running, a divergence), 1 a peer
    lost, 130 Ctrl-C. A bug keeps its traceback."""
    ctrl_c, logs = CtrlC(), []
    try:
        main(logs=logs)
        return 0
    except BaseException as e:           # Ctrl-C, and SystemExit: argparse's exit 2
        # First, before any call (where Python runs a pending signal's handler): a Ctrl-C
        # arriving from here on, or caught inside a collective until now, is only noted.
        ctrl_c.stopping = True
        return stopped(e, ctrl_c, logs[-1] if logs else None)


def stopped(error: BaseException, ctrl_c: CtrlC, log: RunLog | None) -> int:
    """finish's line and exit code for the error that stopped the run."""
    if ctrl_c.received:             # every rank got it; a peer that stopped first is no news
        say_error(interrupted_line(log), refusal=False)
        return INTERRUPTED
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) else 1
    if isinstance(error, (snapshot.RunError, snapshot.CheckpointError, LaunchError)):
        say_error(f"train.py: error: {error}")
        return 2
    if not isinstance(error, dist.DistError) and not (isinstance(error, RuntimeError) and "gloo" in str(error)):
        raise error                                    # a bug, not a lost peer: keep the traceback
    # A peer died (its connection closed) or stalled past --timeout: stop, never hang. NCCL
    # raises DistBackendError; gloo a RuntimeError that names its own source file.
    where = f"rank {dist.get_rank()}" if dist.is_initialized() else "this rank"
    print(f"train.py: error: {where} lost contact with the other ranks ({type(error).__name__}: "
          f"{str(error).splitlines()[0][:200]}); one of them died or stalled past --timeout. Its own "
          f"log says why; rerun the same command with --resume to continue from the last "
          f"checkpoint", file=sys.stderr, flush=True)
    return 1


def predicted_activations(args, cfg, data_size: int) -> int | None:
    """memory.activation_bytes for one micro-batch of this rank's rows (B/D/k, T) through every
    block, and the loss's fp32 log-probabilities (logits_bytes); None where the run splits the
    model or its sequences (tp, pp, cp: their lines say theirs) or checkpoints every K-th block
    for K > 1 (the formula knows all or none)."""
    if mesh_splits(args) or args.checkpoint_activations > 1:
        return None
    rows = args.batch_size // data_size // args.grad_accum
    return (activation_bytes(args.seq_len, rows, cfg.n_embd, cfg.n_head, cfg.n_layer,
                             checkpointing=bool(args.checkpoint_activations),
                             bytes_per_value=DTYPES[args.precision].itemsize,
                             moe=cfg if cfg.experts else None, ep=args.ep)
            + logits_bytes(args.seq_len, rows, cfg.vocab_size))
