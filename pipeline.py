"""Pipeline parallelism: cut the model into stages, stream micro-batches through them.

Cut the model into P stages, one per rank; a batch split into M micro-batches flows through
them, activations sent forward and their gradients back with point-to-point messages. GPipe
(Huang et al. 2019) runs every forward, then every backward; 1F1B, PipeDream-flush (Narayanan
et al. 2021, "Megatron-LM at scale", section 2.2.1), starts backwards as soon as the last stage
can, so a stage holds at most P micro-batches of activations instead of M. Both idle
(P-1)/(M+P-1) of the time when a forward and a backward take one slot each: the bubble.
A schedule is data (each stage's list of actions) and one executor runs any list. Left out:
interleaved stages (virtual pipelines), zero-bubble schedules.
Run: python pipeline.py --stages 4 --microbatches 8 --schedule 1f1b;
     torchrun --nproc_per_node 4 train.py --strategy pipeline --pp 4 --microbatches 8
Test: python -m pytest tests/test_pipeline.py

Shapes: P stages, M micro-batches, s stage, m micro-batch, B batch rows per pipeline,
b = B / M rows per micro-batch, T sequence, C channels.
"""
import argparse
import contextlib
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from collectives import Comm, ring_bytes, split_norm, subgroups
from ddp import DDP
from mixed_precision import DTYPES, MixedPrecisionOptimizer
from model import cross_entropy


class Action(NamedTuple):
    """One step of a stage's list: kind in F, B (compute) or send/recv of act (activations,
    forward) or grad (their gradients, backward); m: the micro-batch it concerns."""
    kind: str
    m: int


COMPUTE = ("F", "B")


def _forward(s: int, P: int, m: int) -> list[Action]:
    """Stage s's forward of micro-batch m: receive from s-1, compute, send to s+1."""
    return ([Action("recv_act", m)] if s > 0 else []) + [Action("F", m)] + (
        [Action("send_act", m)] if s < P - 1 else [])


def _backward(s: int, P: int, m: int) -> list[Action]:
    """Stage s's backward of micro-batch m: gradient from s+1, compute, send to s-1."""
    return ([Action("recv_grad", m)] if s < P - 1 else []) + [Action("B", m)] + (
        [Action("send_grad", m)] if s > 0 else [])


def _check(P: int, M: int):
    if P < 1 or M < 1:
        raise ValueError(f"a pipeline needs at least 1 stage and 1 micro-batch, got "
                         f"{P} stages and {M} micro-batches")


def gpipe(P: int, M: int) -> list[list[Action]]:
    """GPipe: all M forwards, then all M backwards, on every stage. Holds M activations."""
    _check(P, M)
    return [[a for m in range(M) for a in _forward(s, P, m)] +
            [a for m in range(M) for a in _backward(s, P, m)] for s in range(P)]


def one_f_one_b(P: int, M: int) -> list[list[Action]]:
    """1F1B: P-1-s warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards. Stage s holds at most P-s micro-batches of activations."""
    _check(P, M)
    stages = []
    for s in range(P):
        warmup = min(P - 1 - s, M)
        actions = [a for m in range(warmup) for a in _forward(s, P, m)]
        for i in range(M - warmup):                      # steady state: F(newest), B(oldest)
            actions += _forward(s, P, warmup + i) + _backward(s, P, i)
        actions += [a for m in range(M - warmup, M) for a in _backward(s, P, m)]
        stages.append(actions)
    return stages


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def check_schedule(stages: list[list[Action]], M: int):
    """Raise if the lists cannot run: a micro-batch not computed once forward and once
    backward, a backward before its forward, or a send without its matching receive."""
    P = len(stages)
    for s, actions in enumerate(stages):
        for kind in COMPUTE:
            done = sorted(a.m for a in actions if a.kind == kind)
            if done != list(range(M)):
                raise ValueError(f"stage {s} runs {kind} on micro-batches {done}, not 0..{M - 1}")
        forwarded = set()
        for a in actions:
            if a.kind == "F":
                forwarded.add(a.m)
            if a.kind == "B" and a.m not in forwarded:
                raise ValueError(f"stage {s}: backward of micro-batch {a.m} before its forward")
    for s in range(P - 1):                               # the pair of neighbours s, s+1
        for send, recv, a, b in (("send_act", "recv_act", s, s + 1), ("send_grad", "recv_grad", s + 1, s)):
            sent = [x.m for x in stages[a] if x.kind == send]
            received = [x.m for x in stages[b] if x.kind == recv]
            if sent != received:
                raise ValueError(f"stage {a} sends {send[5:]} for micro-batches {sent} but stage "
                                 f"{b} receives {received}: the messages would not match")
    run_under_nccl([nccl_program(actions) for actions in stages])


# ---- what the executor posts, and NCCL's rules for it ------------------------------------------
#
# NCCL runs a rank's point-to-point calls on one stream, in the order they were posted: a send
# completes only once its partner has posted the matching receive, and everything posted after
# it waits. So a receive posted early (to overlap) can block this rank's own later send that its
# peer waits for: a deadlock gloo never shows. The executor therefore posts the sends and
# receives that sit between two computations together, as one group (one batch_isend_irecv, as
# torch.distributed.pipelining does), and waits for a group before the computation after it only
# if the group receives something. nccl_program() writes that down; run_under_nccl() plays it.

def nccl_program(actions: list[Action]) -> list:
    """The executor's program for a stage's list: compute actions as they are, and each run of
    sends and receives between two computations as ("post", group) then, if the group receives,
    ("wait", group); group is a tuple of Actions."""
    program, group = [], []

    def close():
        if group:
            program.append(("post", tuple(group)))
            if any(a.kind.startswith("recv") for a in group):
                program.append(("wait", tuple(group)))
            group.clear()
    for a in actions:
        if a.kind in COMPUTE:
            close()
            program.append(a)
        else:
            group.append(a)
    close()
    return program


def run_under_nccl(programs: list[list]):
    """Play each stage's program by NCCL's rules; raise if the stages would wait forever.

    A ("post", group) queues the group on the stage's p2p stream; the stream runs its oldest
    unfinished group, and an op of it completes when the matching op (the same message, the
    other end) is in the peer's running group. ("wait", group) blocks the stage until that group
    has completed. Compute actions always proceed.
    """
    P = len(programs)

    def message(s, a):                       # (from, to, what, m): the same key at both ends
        kind = a.kind.split("_")[1]
        peer = s + 1 if a.kind in ("send_act", "recv_grad") else s - 1
        return (s, peer, kind, a.m) if a.kind.startswith("send") else (peer, s, kind, a.m)
    pc = [0] * P
    streams = [[] for _ in range(P)]         # posted groups not yet complete, oldest first
    pending = {}                             # (stage, group) -> its messages not yet through
    while True:
        moved = False
        for s in range(P):
            while pc[s] < len(programs[s]):
                item = programs[s][pc[s]]
                if isinstance(item, Action):
                    pass                     # computation never waits on the p2p stream
                elif item[0] == "post":
                    pending[s, item[1]] = {message(s, a) for a in item[1]}
                    streams[s].append(item[1])
                elif (s, item[1]) in pending:
                    break                    # ("wait", group): still on the wire
                pc[s] += 1
                moved = True
        for s in range(P):
            if not streams[s]:
                continue
            for key in list(pending[s, streams[s][0]]):
                peer = key[1] if key[0] == s else key[0]
                if streams[peer] and key in pending[peer, streams[peer][0]]:
                    pending[s, streams[s][0]].discard(key)
                    pending[peer, streams[peer][0]].discard(key)
                    moved = True
        for s in range(P):
            while streams[s] and not pending[s, streams[s][0]]:
                del pending[s, streams[s].pop(0)]
        if all(pc[s] == len(programs[s]) and not streams[s] for s in range(P)):
            return
        if not moved:
            stuck = {s: (programs[s][pc[s]] if pc[s] < len(programs[s]) else "done",
                         streams[s][0] if streams[s] else None) for s in range(P)}
            raise ValueError(f"deadlock under NCCL's p2p rules (stage: next step, oldest group "
                             f"on its stream): {stuck}")


def simulate(stages: list[list[Action]]) -> list[list[str]]:
    """Run the lists on a clock where F and B take one slot and messages arrive at once.
    Returns one row per stage: the micro-batch computed in each slot ('F3', 'B0') or ''.
    A receive waits for its send; lists that wait on each other forever raise."""
    P = len(stages)
    position, clock = [0] * P, [0] * P                   # next action, first free slot, per stage
    arrived = {}                                         # (kind, m, to stage) -> slot it is ready
    rows = [[] for _ in range(P)]
    while any(position[s] < len(stages[s]) for s in range(P)):
        moved = False
        for s in range(P):
            while position[s] < len(stages[s]):
                a = stages[s][position[s]]
                if a.kind.startswith("recv"):
                    key = (a.kind[5:], a.m, s)
                    if key not in arrived:
                        break                            # wait for the neighbour
                    clock[s] = max(clock[s], arrived.pop(key))
                elif a.kind.startswith("send"):
                    to = s + 1 if a.kind == "send_act" else s - 1
                    arrived[(a.kind[5:], a.m, to)] = clock[s]
                else:
                    rows[s] += [""] * (clock[s] - len(rows[s])) + [f"{a.kind}{a.m}"]
                    clock[s] += 1
                position[s] += 1
                moved = True
        if not moved:
            stuck = {s: stages[s][position[s]] for s in range(P) if position[s] < len(stages[s])}
            raise ValueError(f"deadlock: every unfinished stage waits on a receive: {stuck}")
    width = max(len(r) for r in rows)
    return [r + [""] * (width - len(r)) for r in rows]


def bubble_fraction(rows: list[list[str]]) -> float:
    """Idle slots over all slots, from the first to the last busy one of the whole pipeline."""
    slots = sum(len(r) for r in rows)
    return sum(cell == "" for r in rows for cell in r) / slots


def peak_activations(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and backward has not: activations held at once."""
    held = peak = 0
    for a in actions:
        held += (a.kind == "F") - (a.kind == "B")
        peak = max(peak, held)
    return peak


def timeline(rows: list[list[str]]) -> str:
    """The lecture's picture: one line per stage, one column per slot, '.' for idle."""
    width = max(len(cell) for r in rows for cell in r)
    return "\n".join(f"stage {s} | " + " ".join((cell or ".").ljust(width) for cell in r)
                     for s, r in enumerate(rows))


# ---- the model, cut into stages ----------------------------------------------------------

def split_layers(n_layer: int, P: int, sizes: list[int] | None = None) -> list[range]:
    """The blocks of each stage: `sizes` blocks each if given, else balanced by count (the
    first n_layer % P stages take one more; the last stage also computes the head and loss)."""
    if sizes is None:
        if n_layer < P:
            raise ValueError(f"the model has {n_layer} blocks, fewer than {P} pipeline stages: "
                             f"every stage needs a block; use --pp {n_layer} or fewer, or a deeper --model")
        sizes = [n_layer // P + (s < n_layer % P) for s in range(P)]
    if len(sizes) != P or sum(sizes) != n_layer or min(sizes) < 1:
        raise ValueError(f"--stage-layers {','.join(map(str, sizes))}: give {P} numbers, each 1 or "
                         f"more, adding up to the model's {n_layer} blocks")
    starts = [sum(sizes[:s]) for s in range(P)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


class GPTStage(nn.Module):
    """One stage of a model.GPT: its blocks in `layers`, with the embeddings on the first stage
    and the final norm, head and loss on the last. The other stages' parts are dropped from
    this rank, and what stays keeps the whole model's names (blocks.5.attn.query.weight), so
    the stages' checkpoints together read as one model's.

    A head tied to the token embedding (GPT-2) lives on both ends: the first and the last
    stage each hold a copy, `tied`, kept equal by summing their gradients (Pipeline does).
    """

    def __init__(self, gpt: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        tied = gpt.cfg.tie_embeddings and first != last
        for i in range(len(gpt.blocks)):
            if i not in layers:
                gpt.blocks[i] = nn.Identity()           # freed; the indices keep their names
        if not first:
            gpt.pos_emb = None
            if not (last and tied):      # the last stage keeps the tied copy under its own name
                gpt.token_emb = None
        if not last:
            gpt.norm = gpt.head = None
        self.gpt, self.layers, self.first, self.last, self._tied = gpt, layers, first, last, tied

    @property
    def tied(self) -> nn.Parameter | None:
        """This stage's copy of the tied weight (a property: an attribute would re-register it)."""
        return self.gpt.token_emb.weight if self._tied else None

    def forward(self, x, targets=None):
        gpt = self.gpt                                   # model.GPT's own parts, a stage's share
        if self.first:
            x = gpt.embed(x)                             # (b, T) token ids -> (b, T, C)
        x = gpt.run_blocks(x, self.layers)               # (b, T, C)
        if not self.last:
            return x
        logits = gpt.logits(x)                           # (b, T, V)
        return logits if targets is None else cross_entropy(logits, targets)


# ---- the executor: one stage's list, run over send/recv --------------------------------------

class Pipeline:
    """Runs this rank's action list each step: the rank is stage comm.rank of comm.world_size.

    module: this rank's GPTStage, or DDP(stage) over the stage's data-parallel group; then the
    backwards of all but the last micro-batch run under its no_sync(), and train_step ends with
    its finish_gradient_sync(): the gradients are averaged once per step.
    hidden, dtype: the activation a stage sends is (b, T, hidden) of dtype, known before it
    arrives, so a receive is posted into a buffer of the right size with no message about sizes.
    tied: the stage's copy of a weight the first and the last stage share (GPTStage.tied);
    after each step's backward the two copies' gradients are summed, so both take one step.
    Deadlock-free under gloo's rules and NCCL's: each stage runs nccl_program(its list), the
    sends and receives between two computations posted together, and the programs are played
    by run_under_nccl() (check_schedule) before the first message.
    """

    def __init__(self, module: nn.Module, comm: Comm, schedule: str, microbatches: int,
                 hidden: int, dtype: torch.dtype, tied: nn.Parameter | None = None):
        self.module, self.comm, self.M = module, comm, microbatches
        self.stage, self.P = comm.rank, comm.world_size
        self.first, self.last = self.stage == 0, self.stage == self.P - 1
        stages = SCHEDULES[schedule](self.P, self.M)
        check_schedule(stages, self.M)           # NCCL's rules included (run_under_nccl)
        self.actions = stages[self.stage]
        # Evaluation: the forwards (and their messages) of GPipe's lists, no backward.
        forwards = [[a for a in actions if a.kind in ("F", "send_act", "recv_act")]
                    for actions in gpipe(self.P, self.M)]
        run_under_nccl([nccl_program(actions) for actions in forwards])
        self.forward_actions = forwards[self.stage]
        # NCCL: a batch_isend_irecv may be a group's first call only if every rank of the group
        # joins it (torch's documentation); the stages' first groups differ, so one small
        # all-reduce creates the communicator on every stage first (a set-up call, not counted).
        device = next(module.parameters()).device
        dist.all_reduce(torch.zeros(1, device=device), group=comm.group)
        self.hidden, self.dtype = hidden, dtype
        self.tied = tied if self.P > 1 else None
        if self.P > 1:
            self.ends = self._ends_group(comm, device)
        self.peak_activations = 0         # most micro-batches held at once (a graph kept for B)
        self.busy = self.wall = 0.0       # seconds computing, seconds in all, in the last step

    def _ends_group(self, comm: Comm, device) -> Comm | None:
        """A Comm over this pipeline's first and last stage if they share a tied weight.

        Collective over the world: every rank of every pipeline (data-parallel copies) learns
        all pipelines' ends and whether any is tied, and then creates every ends group, in one
        order, as new_group requires (collectives.subgroups). Middle stages hold no tied copy
        but create the groups too."""
        ranks = dist.get_process_group_ranks(comm.group)
        mine = torch.tensor([ranks[0], ranks[-1], self.tied is not None], device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)                             # set-up, not counted
        if not any(t[2] for t in every):
            return None
        ends = sorted({(t[0].item(), t[1].item()) for t in every})
        group = subgroups(comm, ends)
        return group if self.tied is not None else None

    def train_step(self, x, y, scale_loss=lambda loss: loss, measure=False) -> torch.Tensor:
        """Forwards and backwards of the M micro-batches of x, y (B, T); the gradients of the
        mean loss over B accumulate in the stage's .grad (averaged over replicas, if any).
        Returns that loss on every stage.
        measure: synchronize CUDA around each compute, so busy and wall time are exact."""
        loss = self._run(self.actions, x, y, scale_loss, measure)
        if hasattr(self.module, "finish_gradient_sync"):
            self.module.finish_gradient_sync()
        if self.tied is not None:         # the embedding's gradient + the head's: one weight's
            self.ends.all_reduce(self.tied.grad)
        return loss

    @torch.no_grad()
    def evaluate(self, x, y) -> torch.Tensor:
        """The mean loss over x, y (B, T), forwards only; on every stage."""
        return self._run(self.forward_actions, x, y)

    def grad_norm(self, params, grads) -> torch.Tensor:
        """mixed_precision's norm hook: each stage holds its own parameters, so the squares add up
        over the stages (a data group holds copies: not summed); a tied weight counts once, on
        the first stage."""
        return split_norm([g for p, g in zip(params, grads) if not (p is self.tied and self.last)],
                                self.comm, grads[0].device)

    def measured_bubbles(self) -> list[float]:
        """Each stage's idle share of its last step, 1 - busy / wall (collective: every stage)."""
        times = torch.tensor([self.busy, self.wall], dtype=torch.float64,
                             device=next(self.module.parameters()).device)
        every = [torch.zeros_like(times) for _ in range(self.P)]
        dist.all_gather(every, times, group=self.comm.group)      # a metric: not counted
        return [1 - (busy / wall).item() for busy, wall in every]

    def bytes_per_step(self, batch: int, seq_len: int) -> int:
        """Bytes this stage sends per step: M activations forward unless it is the last stage,
        M of their gradients back unless it is the first, the gradient norm's all-reduce, and
        at the two ends a tied weight's gradient (ring formulas)."""
        message = batch * seq_len * self.hidden * torch.finfo(self.dtype).bits // 8
        norm = ring_bytes("all_reduce", 1, 4, self.P)                  # 1 fp32
        tied = (ring_bytes("all_reduce", self.tied.numel(), self.tied.element_size(), 2)
                if self.tied is not None else 0)
        return message * ((not self.last) + (not self.first)) + norm + tied

    def _run(self, actions, x, y, scale_loss=None, measure=False):
        B, T = x.shape
        if B % self.M:
            raise ValueError(f"a batch of {B} rows does not split into {self.M} equal micro-batches: "
                             f"use a batch that is a multiple of {self.M}")
        xs, ys = x.chunk(self.M), y.chunk(self.M)                 # M x (b, T)
        shape = (B // self.M, T, self.hidden)
        device = x.device
        inputs, outputs, grads = {}, {}, {}      # by micro-batch: received, computed, received grad
        posted, sends, loss = {}, [], torch.zeros((), device=device)
        backwards = [a.m for a in actions if a.kind == "B"]
        no_sync = getattr(self.module, "no_sync", contextlib.nullcontext)
        self.busy, start = 0.0, self._clock(measure)
        for item in nccl_program(actions):
            if isinstance(item, Action) and item.kind == "F":
                a, began = item, self._clock(measure)
                inp = xs[a.m] if self.first else inputs[a.m]
                outputs[a.m] = self.module(inp, ys[a.m]) if self.last else self.module(inp)
                if self.last:
                    loss += outputs[a.m].detach().float() / self.M
                    if not torch.is_grad_enabled():
                        del outputs[a.m]
                self.peak_activations = max(self.peak_activations, len(outputs))
                self.busy += self._clock(measure) - began
            elif isinstance(item, Action):                         # "B"
                a, began = item, self._clock(measure)
                # One gradient average per step: the last backward's, for the sum of all M.
                with no_sync() if a.m != backwards[-1] else contextlib.nullcontext():
                    if self.last:   # the step's loss is the mean over micro-batches: 1/M each
                        scale_loss(outputs.pop(a.m) / self.M).backward()
                    else:
                        outputs.pop(a.m).backward(grads.pop(a.m))
                self.busy += self._clock(measure) - began
            elif item[0] == "post":
                ops, received = [], {}
                for a in item[1]:
                    if a.kind == "send_act":     # (evaluation keeps no graph: nothing to hold for B)
                        out = outputs[a.m] if torch.is_grad_enabled() else outputs.pop(a.m)
                        ops.append(("send", out.detach(), self.stage + 1))
                    elif a.kind == "send_grad":
                        ops.append(("send", inputs.pop(a.m).grad, self.stage - 1))
                    else:                        # a fresh buffer of the known shape: (b, T, hidden)
                        received[a] = torch.empty(shape, dtype=self.dtype, device=device)
                        ops.append(("recv", received[a], self.stage - 1 if a.kind == "recv_act"
                                    else self.stage + 1))
                handle = self.comm.exchange(ops)
                if received:
                    posted[item[1]] = handle, received
                else:
                    sends.append(handle)         # waited at the end: nothing here reads them
            else:                                                  # "wait"
                handle, received = posted.pop(item[1])
                handle.wait()
                for a, buffer in received.items():
                    if a.kind == "recv_act":
                        inputs[a.m] = buffer.requires_grad_(torch.is_grad_enabled())
                    else:
                        grads[a.m] = buffer
        for handle in sends:
            handle.wait()
        self.wall = self._clock(measure) - start
        # The loss lives on the last stage; every stage returns it (a metric: not counted).
        dist.broadcast(loss, group=self.comm.group, group_src=self.P - 1)
        return loss

    @staticmethod
    def _clock(synchronize: bool) -> float:
        if synchronize and torch.cuda.is_available():
            # The compute stream only: a device-wide synchronize would also wait for the p2p
            # stream, where a send may sit until the peer posts its receive after this very
            # stage's next send (run_under_nccl lets computation run on meanwhile).
            torch.cuda.current_stream().synchronize()
        return time.perf_counter()


# ---- train.py's row ---------------------------------------------------------------------------

def stage_layers(option: str | None, n_layer: int, P: int) -> list[range]:
    """The blocks of each stage from --stage-layers "N,N,..." (None: balanced)."""
    try:
        sizes = [int(n) for n in option.split(",")] if option else None
    except ValueError:
        raise ValueError(f"--stage-layers {option}: give whole numbers separated by commas, one "
                         f"per stage") from None
    return split_layers(n_layer, P, sizes)


def build(gpt, options, data, split, device, adamw: dict):
    """--strategy pipeline: (this rank's stage, under DDP over data when the pipeline has
    replicas, run by Pipeline; MixedPrecisionOptimizer(AdamW) with the norm over every stage;
    the bytes per step).

    options: train.py's parsed command line; data, split: the data-parallel group and the
    group that splits one model (None unless tp or pipeline); adamw: the optimizer's settings.
    gpt keeps this stage's parts under their whole-model names (checkpoints); the rest is gone.
    """
    stage = GPTStage(gpt, stage_layers(options.stage_layers, gpt.cfg.n_layer, options.pp)[split.rank],
                     first=split.rank == 0, last=split.rank == options.pp - 1)
    replicas = DDP(stage, data, bucket_mb=options.bucket_mb) if data.world_size > 1 else stage
    model = Pipeline(replicas, split, options.schedule, options.microbatches, gpt.cfg.n_embd,
                     DTYPES[options.precision], tied=stage.tied)
    optimizer = MixedPrecisionOptimizer(gpt.parameters(), torch.optim.AdamW, precision=options.precision,
                                        grad_norm=model.grad_norm, **adamw)
    predicted = model.bytes_per_step(options.batch_size // data.world_size, options.seq_len)
    return model, optimizer, predicted + (replicas.bytes_per_step() if replicas is not stage else 0)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Print a pipeline schedule as a timeline")
    parser.add_argument("--stages", type=int, default=4, help="P, pipeline stages")
    parser.add_argument("--microbatches", type=int, default=8, help="M, micro-batches per step")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    args = parser.parse_args(argv)
    if args.stages < 1 or args.microbatches < 1:
        parser.error(f"--stages and --microbatches must be at least 1, got {args.stages} and "
                     f"{args.microbatches}")
    P, M = args.stages, args.microbatches
    stages = SCHEDULES[args.schedule](P, M)
    check_schedule(stages, M)
    rows = simulate(stages)
    print(f"{args.schedule}, {P} stages, {M} micro-batches (F and B one slot each)\n")
    print(timeline(rows))
    print(f"\nbubble fraction {bubble_fraction(rows):.3f}, formula (P-1)/(M+P-1) = "
          f"{(P - 1) / (M + P - 1):.3f}")
    print("peak micro-batches of activations held per stage: "
          + ", ".join(str(peak_activations(a)) for a in stages))


if __name__ == "__main__":
    main()
