"""Pipeline parallelism: cut the model into stages, stream micro-batches through them.

Cut the model into P stages of whole blocks, one per rank; a batch split into M micro-batches flows
through them, activations sent forward and their gradients back with point-to-point messages. The order
of each stage's forwards, backwards, sends and receives is a schedule: GPipe (Huang et al. 2019) and
1F1B (PipeDream-flush, Narayanan et al. 2021, section 2.2.1) are made here, as lists, in their phases;
one executor runs a stage's list over send/recv, by NCCL's rules. Read after: extensions/schedules.py
(interleaved 1F1B, zero bubble's list, the checks, the drawn timeline), extensions/zero_bubble.py (the
backward split in two), mechanics/pipeline_mechanics.py (the bubble on the lecture's clock, NCCL's rules
played out, the executor's bookkeeping).
Run: torchrun --nproc_per_node 2 pipeline.py (GPipe and 1F1B against one process);
     python -m extensions.schedules --stages 4 --microbatches 8 --schedule 1f1b (draws a schedule)
Test: python -m pytest tests/test_pipeline.py (the schedules: tests/test_schedules.py)

Shapes: P stages, M micro-batches, s stage, m micro-batch, B batch rows per pipeline, b = B / M rows
per micro-batch, T sequence, C channels. Interleaving (schedules.py): v chunks of blocks per stage,
V = P*v virtual stages; GPipe and 1F1B here have v = 1 (chunk 0, V = P).
"""
import contextlib
import itertools
import os
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from collectives import Comm
from model import build_model
from foundations.alone import start_alone
from mechanics.pipeline_mechanics import PipelineMechanics, check_sizes, place_stage, split_layers


# ---- the model, cut into stages ----------------------------------------------------------

class GPTStage(nn.Module):
    """One stage of a model.GPT: its blocks in `layers` (a range; interleaved, one per chunk; cut by
    pipeline_mechanics.split_layers), the embeddings on the first stage, the final norm, head and
    loss on the last. The rest is dropped from this rank; what stays keeps the whole model's names
    (blocks.5.attn.query.weight), so the stages' checkpoints together read as one model's. A head
    tied to the token embedding (GPT-2) lives on both ends: each holds a copy, `tied`, kept equal
    by summing their gradients."""

    def __init__(self, gpt: nn.Module, layers: range | list[range], first: bool, last: bool):
        super().__init__()
        tied = gpt.cfg.tie_embeddings and first != last
        self.chunks = [layers] if isinstance(layers, range) else list(layers)
        for i in range(len(gpt.blocks)):
            if not any(i in chunk for chunk in self.chunks):
                gpt.blocks[i] = nn.Identity()           # freed; the indices keep their names
        if not first:
            gpt.pos_emb = None
            if not (last and tied):      # the last stage keeps the tied copy under its own name
                gpt.token_emb = None
        if not last:
            gpt.norm = gpt.head = None
        self.gpt, self.first, self.last, self._tied = gpt, first, last, tied
        place_stage(self)   # tag the parameters: each stage holds other tensors (the norm, checkpoints read it)

    @property
    def tied(self) -> nn.Parameter | None:
        """This stage's copy of the tied weight (a property: an attribute would re-register it)."""
        return self.gpt.token_emb.weight if self._tied else None

    def forward(self, x, targets=None, chunk: int = 0):
        """Chunk `chunk` on x. Returns the activation (b, T, C), or (it, the routers' losses) with experts;
        on the model's last chunk the logits (b, T, vocab) without targets, else the loss (+ the routers')."""
        gpt = self.gpt                                   # model.GPT's own parts, a stage's share
        if self.first and chunk == 0:
            x = gpt.embed(x)                             # (b, T) token ids -> (b, T, C)
        x = gpt.run_blocks(x, self.chunks[chunk])        # (b, T, C)
        # With experts (moe.py), the routers' losses of this chunk's blocks join the loss: before
        # the last chunk, returned beside its activation (Pipeline's backward adds them).
        aux = sum(gpt.blocks[i].mlp.aux_loss for i in self.chunks[chunk]) if gpt.cfg.experts else None
        if not (self.last and chunk == len(self.chunks) - 1):
            return x if aux is None else (x, aux)
        logits = gpt.logits(x)                           # (b, T, vocab) (tensor parallel: vocab/tp)
        if targets is None:
            return logits
        loss = gpt.loss_fn(logits, targets)
        return loss if aux is None else loss + aux


# ---- the schedule: each stage's list of actions --------------------------------------------
# GPipe, then 1F1B, on P = 3 stages, M = 4 micro-batches, a forward and a backward one slot each
# ('.' idle: the bubble, (P-1)/(M+P-1) of the time under both; python -m extensions.schedules draws):
#
#   GPipe  stage 0 | F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3     holds M = 4 micro-batches
#          stage 1 | .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .
#          stage 2 | .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .
#
#   1F1B   stage 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3     holds P - s: 3, 2, 1
#          stage 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
#          stage 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .

class Action(NamedTuple):
    """One step of a stage's list: kind F, B (compute; W too in zero bubble's, zero_bubble.py) or
    send/recv of act (activations, forward) or grad (their gradients, backward); m: the
    micro-batch it concerns; chunk: which of the rank's chunks of layers (interleaved; else 0)."""
    kind: str
    m: int
    chunk: int = 0


def forward_actions(s: int, P: int, m: int, chunk: int = 0, V: int | None = None) -> list[Action]:
    """Forward of micro-batch m by chunk `chunk` of stage s, virtual stage vs = chunk*P + s of V
    (P*v; default P, chunk 0: GPipe, 1F1B): receive from the one before, compute, send on."""
    vs, V = chunk * P + s, V or P
    return ([Action("recv_act", m, chunk)] if vs > 0 else []) + [Action("F", m, chunk)] + (
        [Action("send_act", m, chunk)] if vs < V - 1 else [])


def backward_actions(s: int, P: int, m: int, chunk: int = 0, V: int | None = None) -> list[Action]:
    """Backward of micro-batch m by chunk `chunk` of stage s: its gradient from the next, compute, send back."""
    vs, V = chunk * P + s, V or P
    return ([Action("recv_grad", m, chunk)] if vs < V - 1 else []) + [Action("B", m, chunk)] + (
        [Action("send_grad", m, chunk)] if vs > 0 else [])


def gpipe(P: int, M: int) -> list[list[Action]]:
    """GPipe in two phases: fill, all M forwards; drain, all M backwards. Holds M activations."""
    return [[a for m in range(M) for a in forward_actions(s, P, m)] +                     # fill
            [a for m in range(M) for a in backward_actions(s, P, m)] for s in range(P)]   # drain


def one_f_one_b(P: int, M: int) -> list[list[Action]]:
    """1F1B in three phases: warm-up, P-1-s forwards (the stages after it stay busy until the
    first backward comes back); steady state, one forward and one backward in turn; cool-down,
    the remaining backwards. Stage s holds at most P-s micro-batches, GPipe M."""
    stages = []
    for s in range(P):
        warmup = min(P - 1 - s, M)
        actions = [a for m in range(warmup) for a in forward_actions(s, P, m)]            # warm-up
        for i in range(M - warmup):                      # steady state: F of the newest, B of the oldest
            actions += forward_actions(s, P, warmup + i) + backward_actions(s, P, i)
        actions += [a for m in range(M - warmup, M) for a in backward_actions(s, P, m)]   # cool-down
        stages.append(actions)
    return stages


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}      # the others: schedules.py


# ---- the executor: one stage's list, run over send/recv --------------------------------------
# NCCL runs a rank's point-to-point calls on one stream, in the order they are posted: a send
# completes only once its peer has posted the matching receive, and all posted after it waits. A
# receive posted early (to overlap) could block this rank's own later send that the peer waits for:
# a deadlock gloo never shows. So the messages between two computations are posted together, as
# one batch_isend_irecv (one work to wait for: Comm.exchange), waited for before the next
# computation only if they receive; every rank posts in its list's order, so the two ends of each
# message meet in order (mechanics/pipeline_mechanics.py's run_under_nccl plays these rules).

def nccl_program(actions: list[Action]) -> list:
    """The executor's program for a stage's list: its computations as they are, and each run of
    messages between two as ("post", group), then ("wait", group) if it receives (group: Actions)."""
    program = []
    for messages, run in itertools.groupby(actions, key=lambda a: a.kind.startswith(("send", "recv"))):
        if not messages:
            program += run                               # F, B (or W): computations, as they are
            continue
        group = tuple(run)
        program.append(("post", group))
        if any(a.kind.startswith("recv") for a in group):
            program.append(("wait", group))
    return program


class Pipeline(PipelineMechanics):
    """Runs this rank's action list each step: the rank is stage comm.rank of comm.world_size.

    module: this rank's GPTStage (its chunks, its tied copy, its device), or DDP(stage) or FSDP(stage) over
    the stage's data-parallel group. schedule: "gpipe" or "1f1b", or every stage's list made elsewhere
    (schedules.make_pipeline: interleaved, zero bubble). activation, dtype: what a stage sends, known before
    it arrives, so a receive is posted into a buffer of the right size: C, the channels of a (b, t, C), or a
    function (b, t) -> its shape (sequence parallelism: (b, t/tp, C)). sync, an attribute: the gradient-sync
    protocol the backwards run under and train_step finishes (the module's: DDP's, FSDP's; None with one
    replica per stage; parallelize.py assigns its chain, flat.GradientSyncs). Its base class holds the
    bookkeeping: the loop's calls (eval(), measured bubble), the tied ends' group, the clock."""

    def __init__(self, module: nn.Module, comm: Comm, schedule, microbatches: int,
                 activation, dtype: torch.dtype):
        gpt_stage = getattr(module, "module", module)             # the GPTStage, inside DDP or FSDP
        self.module, self.comm, self.M, self.dtype = module, comm, microbatches, dtype
        self.activation = activation if callable(activation) else lambda b, t: (b, t, activation)
        self.stage, self.P, self.v = comm.rank, comm.world_size, len(gpt_stage.chunks)
        self.first, self.last = self.stage == 0, self.stage == self.P - 1
        check_sizes(self.P, self.M)                     # a stage and a micro-batch: one clear error, first
        self.stages = SCHEDULES[schedule](self.P, self.M) if isinstance(schedule, str) else schedule
        self.actions = self.stages[self.stage]
        self.evaluation_actions = [a for a in self.actions if a.kind in ("F", "recv_act", "send_act")]
        self.device = next(gpt_stage.parameters()).device     # under FSDP too: its units' views
        # Set-up, not a message: NCCL makes a group's communicator at its first call, which a batch_isend_irecv
        # may be only if every rank joins it (the stages' first differ): one small all-reduce, all joining.
        dist.all_reduce(torch.zeros(1, device=self.device), group=comm.group)
        self.tied = gpt_stage.tied                  # None unless this stage is an end of a tied pair
        self.sync = module if hasattr(module, "finish_gradient_sync") else None
        # A Comm over the first and last stage if they hold a tied weight, else None (collective).
        self.ends = self._ends_group(comm, self.device) if self.P > 1 else None
        self.peak_activations, self.busy, self.wall = 0, 0.0, 0.0   # readings: held at most; seconds

    def train_step(self, x, y, scale_loss=lambda loss: loss, measure=False) -> torch.Tensor:
        """Forwards and backwards of the M micro-batches of x, y (B, t): the mean loss's gradients
        accumulate in .grad (averaged over replicas); returns the loss, on every stage. measure:
        synchronize CUDA around each compute, so busy, wall and timeline (start, end) are exact."""
        loss = self._run(self.actions, x, y, scale_loss, measure)
        # A tied weight's two ends add up first (every backward was held); then the sync's finish.
        if self.tied is not None:                          # the embedding's + the head's gradient
            self.ends.all_reduce(self.tied.grad)
        if self.sync is not None:
            self.sync.finish_gradient_sync()
        # The loss summed over the stages (routers' parts on each), after every reduction: one launch order.
        dist.all_reduce(loss, group=self.comm.group)
        return loss

    @torch.no_grad()
    def evaluate(self, x, y) -> torch.Tensor:
        """The mean loss over x, y (B, t), on every stage: the list's forwards, in order, with their messages."""
        loss = self._run(self.evaluation_actions, x, y)
        dist.all_reduce(loss, group=self.comm.group)       # the sum over the stages, as train_step's
        return loss

    def _run(self, actions, x, y, scale_loss=None, measure=False):
        """Play a stage's list: its computations in turn, its messages as nccl_program groups them."""
        B, T = x.shape
        if B % self.M:
            raise ValueError(f"a batch of {B} rows does not split into {self.M} equal micro-batches: "
                             f"use a batch that is a multiple of {self.M}")
        micro_x, micro_y = x.chunk(self.M), y.chunk(self.M)       # M micro-batches (b, T) each
        shape = self.activation(B // self.M, T)                   # what a stage sends: (b, T, C)
        # By (micro-batch, chunk): received activations, outputs, received gradients, routers' losses;
        # (micro-batch, chunk) whose F ran, B (or W) not yet; posted receives, sends; this stage's loss.
        flight = SimpleNamespace(inputs={}, outputs={}, grads={}, auxes={}, held=set(), posted={},
                                 sends=[], loss=torch.zeros((), device=x.device),
                                 last_backward=([a for a in actions if a.kind == "B"] or [None])[-1])
        # FSDP's units stay gathered through the step: a schedule runs several forwards before their backwards.
        with getattr(self.module, "gathered_for_step", contextlib.nullcontext)():
            # (Action, start, end) per computation, on the base class's clock (exact on CUDA if measure)
            self.timeline, start = [], self._clock(measure)
            for item in nccl_program(actions):   # messages posted in groups, by NCCL's rules (above)
                if not isinstance(item, Action):
                    self._communicate(item, flight, shape, x.device)
                    continue
                began = self._clock(measure)
                self._compute(item, micro_x, micro_y, flight, scale_loss)
                self.timeline.append((item, began, self._clock(measure)))
            for handle in flight.sends:          # each holds its sent tensor alive until waited for
                handle.wait()
            self.wall, self.busy = self._clock(measure) - start, sum(e - b for _, b, e in self.timeline)
        return flight.loss                            # this stage's part of the loss

    def _compute(self, a: Action, micro_x, micro_y, flight, scale_loss):
        """F or B (the whole backward: no activation of it is held after) of micro-batch a.m."""
        if a.kind == "F":
            self._forward(a, micro_x[a.m], micro_y[a.m], flight)
            return
        with self._holding(a, flight):
            self._backward(a, flight, scale_loss)
        flight.held.discard((a.m, a.chunk))

    def _holding(self, a: Action, flight):
        """One gradient average per step, after the last backward, for the sum of all M: every backward
        before it runs under the sync's no_sync() where it keeps whole gradients (DDP: whole anyway).
        A tied weight's two ends are summed before the data dimension reduces: every backward held."""
        whole = getattr(self.sync, "keeps_whole_gradients", False)
        ends_to_sum_first = self.tied is not None
        reduce_after_the_last = whole and a != flight.last_backward
        hold = self.sync is not None and (ends_to_sum_first or reduce_after_the_last)
        return self.sync.no_sync() if hold else contextlib.nullcontext()

    def _forward(self, a: Action, x, y, flight):
        """F: chunk a.chunk on micro-batch a.m (its tokens x (b, T) on the first chunk, else the
        activation received); the loss (last chunk) and routers' losses join the step's, 1/M each."""
        key, last = (a.m, a.chunk), self.last and a.chunk == self.v - 1      # computes the loss
        inp = x if self.first and a.chunk == 0 else flight.inputs[key]
        out = self.module(inp, y, chunk=a.chunk) if last else self.module(inp, chunk=a.chunk)
        if isinstance(out, tuple):                 # (activation, routers' losses): GPTStage
            out, aux = out
            flight.loss += aux.detach().float() / self.M
            if torch.is_grad_enabled():
                flight.auxes[key] = aux
        if last:
            flight.loss += out.detach().float() / self.M
        if torch.is_grad_enabled() or not last:    # B's, or the send's (evaluation keeps no graph)
            flight.outputs[key] = out
        if torch.is_grad_enabled():
            flight.held.add(key)
            self.peak_activations = max(self.peak_activations, len(flight.held))

    def _backward(self, a: Action, flight, scale_loss):
        """B: chunk a.chunk's backward on micro-batch a.m, from the loss or the gradient received."""
        key = a.m, a.chunk
        if self.last and a.chunk == self.v - 1:       # the loss's: the mean over micro-batches, 1/M each
            scale_loss(flight.outputs.pop(key) / self.M).backward()
        elif key in flight.auxes:   # the routers' losses join the loss here, 1/M each too
            torch.autograd.backward([flight.outputs.pop(key), scale_loss(flight.auxes.pop(key) / self.M)],
                                    [flight.grads.pop(key), None])
        else:
            flight.outputs.pop(key).backward(flight.grads.pop(key))

    def _communicate(self, item, flight, shape, device):
        """A ("post", group) of nccl_program: one exchange() of the group's sends and receives (one
        coalesced batch_isend_irecv, one work); ("wait", group): wait for it and file what arrived."""
        if item[0] == "wait":
            handle, received = flight.posted.pop(item[1])
            handle.wait()
            for a, buffer in received.items():
                if a.kind == "recv_act":
                    flight.inputs[a.m, a.chunk] = buffer.requires_grad_(torch.is_grad_enabled())
                else:
                    flight.grads[a.m, a.chunk] = buffer
            return
        ops, received = [], {}
        # The next, previous stage; % P wraps round only when interleaved (last stage -> first's next chunk)
        after, before = (self.stage + 1) % self.P, (self.stage - 1) % self.P
        for a in item[1]:
            key = (a.m, a.chunk)
            if a.kind == "send_act":         # (evaluation keeps no graph: nothing to hold for B)
                out = flight.outputs[key] if torch.is_grad_enabled() else flight.outputs.pop(key)
                ops.append(("send", out.detach(), after))
            elif a.kind == "send_grad":
                ops.append(("send", flight.inputs.pop(key).grad, before))
            else:                            # a fresh buffer of the known shape: (b, T, C)
                received[a] = torch.empty(shape, dtype=self.dtype, device=device)
                ops.append(("recv", received[a], before if a.kind == "recv_act" else after))
        handle = self.comm.exchange(ops)
        if received:
            flight.posted[item[1]] = handle, received
        else:
            flight.sends.append(handle)      # waited at the end: nothing here reads them (it keeps them)


# ---- run alone: check GPipe and 1F1B against one process (torchrun) ---------------------------

def demo(M: int = 4, bounds=(1e-6, 1e-12)) -> bool:
    """torchrun --nproc_per_node 2 pipeline.py: model.py's tiny GPT, one stage per rank, runs one step's
    forwards and backwards under GPipe, then 1F1B, in fp64, each stage printing the order it computed in;
    the loss and every gradient against one process's on the whole batch. Bounds: the loss, relative, a
    metric the executor sums in fp32; the gradients, fp64, the mean taken as M means of B/M rows."""
    s, P = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (2 * M, 33))                         # (B, T+1) byte tokens

    def tiny():                                                       # the same weights each time
        torch.manual_seed(1)
        return build_model("tiny").double()
    whole, passed = tiny(), True
    _, loss = whole(batch[:, :-1], batch[:, 1:])                      # one process, every row
    loss.backward()
    for schedule in SCHEDULES:
        stage = GPTStage(tiny(), split_layers(whole.cfg.n_layer, P)[s], first=s == 0, last=s == P - 1)
        runner = Pipeline(stage, Comm(), schedule, M, whole.cfg.n_embd, torch.float64)
        ours = runner.train_step(batch[:, :-1], batch[:, 1:])
        for rank in range(P):                                          # in stage order
            if rank == s:
                print(f"{schedule} stage {s} computed:", *(f"{a.kind}{a.m}" for a, _, _ in runner.timeline),
                      flush=True)
            dist.barrier()
        grads = [(p.grad - whole.get_parameter(name.removeprefix("gpt.")).grad).abs().max()
                 for name, p in stage.named_parameters()]
        difference = torch.stack([((ours - loss.detach()) / loss.detach()).abs(), max(grads)])
        dist.all_reduce(difference, op=dist.ReduceOp.MAX)
        passed &= all(d <= bound for d, bound in zip(difference.tolist(), bounds))
        if s == 0:
            print(f"{schedule}: max |difference| from one process: loss {difference[0]:.1e} relative "
                  f"(bound {bounds[0]:.0e}: summed in fp32), gradients {difference[1]:.1e} "
                  f"(bound {bounds[1]:.0e}: fp64, sums reordered)", flush=True)
    return passed


if __name__ == "__main__":
    start_alone(torchrun=True, worlds=(1, 2, 3, 4))            # a stage: 1 or more of 4 blocks
    dist.init_process_group("gloo")
    passed = demo()
    dist.destroy_process_group()                      # (every print above flushed)
    os._exit(0 if passed else 1)  # at once: gloo's threads may still hold tensors (exit_distributed)
