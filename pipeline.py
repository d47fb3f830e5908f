"""Pipeline parallelism: cut the model into stages, stream micro-batches through them.

Cut the model into P stages of whole blocks, one per rank. A batch split into M micro-batches
flows through them. Activations go forward and their gradients come back as point-to-point
messages. The order of each stage's forwards, backwards, sends and receives is a schedule.
GPipe (Huang et al. 2019) and 1F1B (PipeDream-flush, Narayanan et al. 2021, section 2.2.1) are
made here, as lists, in their phases. One executor runs a stage's list over point-to-point
sends and receives, posted so that NCCL cannot deadlock (the executor's comment says how).
Comm (foundations/comm.py) is a process group with its rank and world_size; comm.exchange(ops)
posts [("send" | "recv", tensor, peer rank)] as one dist.batch_isend_irecv, bytes counted.
Read after: extensions/schedules.py (interleaved 1F1B, zero bubble's list, the drawn timeline),
extensions/zero_bubble.py (the backward split in two), mechanics/pipeline_mechanics.py (the
bubble measured, NCCL's rules played out, the step observed from outside).
Run: torchrun --nproc_per_node 2 pipeline.py (GPipe and 1F1B against one process);
     python -m extensions.schedules --stages 4 --microbatches 8 --schedule 1f1b (draws one)
Test: python -m pytest tests/test_pipeline.py (the schedules: tests/test_schedules.py)

Shapes: P stages, M micro-batches, s stage, m micro-batch, B batch rows per pipeline, b = B / M
rows per micro-batch, T sequence, C channels. Interleaving (extensions/schedules.py): v chunks
of blocks per stage, V = P*v virtual stages; GPipe and 1F1B here have v = 1 (chunk 0, V = P).
"""
import contextlib
import copy
import itertools
import os
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from foundations.comm import Comm
from model import build_model
from foundations.alone import start_alone
from mechanics.pipeline_mechanics import PipelineMechanics, place_stage, split_layers


# ---- the model, cut into stages ----------------------------------------------------------

class GPTStage(nn.Module):
    """One stage of a model.GPT.

    Its blocks are `layers`: a range of consecutive block indices (one range per chunk when
    interleaved), cut for each stage by the caller.
    The first stage also holds the embeddings; the last, the final norm, the head and the loss.
    The rest is dropped from this rank. What stays keeps the whole model's names
    (gpt.blocks.5.attn.query.weight: the GPT under the stage's `gpt`), so the stages'
    checkpoints together read as one model's.
    A head tied to the token embedding (GPT-2) lives on both ends. Each end holds a copy,
    `tied`, and the two are kept equal by summing their gradients."""

    def __init__(self, gpt: nn.Module, layers: range | list[range], first: bool, last: bool):
        super().__init__()
        tied = gpt.cfg.tie_embeddings and first != last
        self.chunks = [layers] if isinstance(layers, range) else list(layers)
        for i in range(len(gpt.blocks)):
            if not any(i in chunk for chunk in self.chunks):
                gpt.blocks[i] = nn.Identity()           # freed; the indices keep their names
        if not first:
            gpt.pos_emb = None
            if not (last and tied):   # the last stage keeps its tied copy as gpt.token_emb
                gpt.token_emb = None
        if not last:
            gpt.norm = gpt.head = None
        self.gpt, self.first, self.last, self._tied = gpt, first, last, tied
        # Record that each stage holds different parameters (sharded along "pp"), so that the
        # gradient norm adds the stages' squares and a checkpoint saves each stage's own.
        place_stage(self)

    @property
    def tied(self) -> nn.Parameter | None:
        """This stage's copy of the tied weight (a property: an attribute would re-register it)."""
        return self.gpt.token_emb.weight if self._tied else None

    def forward(self, x, targets=None, chunk: int = 0):
        """Chunk `chunk` on x. Returns the activation (b, T, C), or with experts (it, the
        routers' losses). The model's last chunk returns the logits (b, T, vocab) without
        targets, else the loss (plus the routers')."""
        # model.GPT's forward in parts: embed, the blocks, logits (norm, head), loss_fn
        gpt = self.gpt
        if self.first and chunk == 0:
            x = gpt.embed(x)                             # (b, T) token ids -> (b, T, C)
        for i in self.chunks[chunk]:
            x = gpt.blocks[i](x)                         # (b, T, C)
        # With experts, each block's mlp (moe.MoE) holds its routers' losses as .aux_loss; this
        # chunk's join the loss, or before the last chunk go beside the activation (B adds them).
        experts = gpt.cfg.experts
        aux = sum(gpt.blocks[i].mlp.aux_loss for i in self.chunks[chunk]) if experts else None
        if not (self.last and chunk == len(self.chunks) - 1):
            return x if aux is None else (x, aux)
        logits = gpt.logits(x)                   # (b, T, vocab) (tensor parallel: vocab/tp)
        if targets is None:
            return logits
        loss = gpt.loss_fn(logits, targets)
        return loss if aux is None else loss + aux


# ---- the schedule: each stage's list of actions --------------------------------------------
# GPipe, then 1F1B, on P = 3 stages, M = 4 micro-batches, a forward and a backward one slot each.
# '.' is idle: the bubble, (P-1)/(M+P-1) of the time under both (python -m extensions.schedules).
#
#   GPipe  stage 0 | F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3     max activations held: M = 4
#          stage 1 | .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .
#          stage 2 | .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .
#
#   1F1B   stage 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3     max activations held: P - s = 3, 2, 1
#          stage 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
#          stage 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .

class Action(NamedTuple):
    """One step of a stage's list.

    kind: "F" (a forward) or "B" (a backward) computes (zero bubble's lists add "W":
    extensions/zero_bubble.py); "send_act" and "recv_act" move activations forward,
    "send_grad" and "recv_grad" their gradients back.
    m: the micro-batch it concerns. chunk: which of the rank's chunks of layers (interleaved;
    else 0)."""
    kind: str
    m: int
    chunk: int = 0


def forward_actions(s: int, P: int, m: int, chunk: int = 0, V: int | None = None) -> list[Action]:
    """Forward of micro-batch m by chunk `chunk` of stage s: receive, compute, send on.

    The chunk is virtual stage vs = chunk*P + s of V (P*v). The defaults, V = P and chunk 0,
    are GPipe's and 1F1B's."""
    vs, V = chunk * P + s, V or P
    return ([Action("recv_act", m, chunk)] if vs > 0 else []) + [Action("F", m, chunk)] + (
        [Action("send_act", m, chunk)] if vs < V - 1 else [])


def backward_actions(s: int, P: int, m: int, chunk: int = 0, V: int | None = None) -> list[Action]:
    """Backward of micro-batch m by chunk `chunk` of stage s: receive, compute, send back."""
    vs, V = chunk * P + s, V or P
    return ([Action("recv_grad", m, chunk)] if vs < V - 1 else []) + [Action("B", m, chunk)] + (
        [Action("send_grad", m, chunk)] if vs > 0 else [])


def gpipe(P: int, M: int) -> list[list[Action]]:
    """GPipe in two phases: fill, all M forwards; drain, all M backwards. Holds M activations."""
    return [[a for m in range(M) for a in forward_actions(s, P, m)] +                   # fill
            [a for m in range(M) for a in backward_actions(s, P, m)] for s in range(P)]  # drain


def one_f_one_b(P: int, M: int) -> list[list[Action]]:
    """1F1B in three phases. Warm-up: P-1-s forwards, so that the stages after it stay busy
    until the first backward comes back. Steady state: one forward and one backward in turn.
    Cool-down: the remaining backwards. Stage s holds at most P-s micro-batches, GPipe M."""
    stages = []
    for s in range(P):
        warmup = min(P - 1 - s, M)
        actions = [a for m in range(warmup) for a in forward_actions(s, P, m)]       # warm-up
        for i in range(M - warmup):               # steady state: F of the newest, B of the oldest
            actions += forward_actions(s, P, warmup + i) + backward_actions(s, P, i)
        cooldown = range(M - warmup, M)
        actions += [a for m in cooldown for a in backward_actions(s, P, m)]          # cool-down
        stages.append(actions)
    return stages


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}      # the others: extensions/schedules.py


# ---- the executor: one stage's list, run over send/recv --------------------------------------
# NCCL runs a rank's point-to-point calls on one stream, in the order they are posted. A send
# completes only once its peer has posted the matching receive, and every call this rank posts
# after it waits behind it. Posted one by one, in 1F1B's own order, two stages deadlock (gloo,
# the demonstration's, never shows it): stage 0 posts send_act 1, then recv_grad 0; stage 1
# posts send_grad 0, then recv_act 1. Each send waits for a receive its peer queued behind its
# own send.
# The fix: the messages between two computations are posted together, as one batch_isend_irecv
# (Comm.exchange). A batch's sends and receives start together and progress together, none
# queued behind another, so neither end can block the other. A batch is waited for before the
# next computation only if it receives. Every rank posts in its list's order, so the two ends of
# each message meet in order (mechanics/pipeline_mechanics.py's run_under_nccl plays these rules).
#
# 1F1B's three phases on the middle stage of P = 3 (M = 4), as the executor plays them. Each
# "|" posts the messages beside it as one group and waits for its receives. A group may join
# two phases: warm-up's last receives F1's input, cool-down's first sends B2's gradient.
#   warm-up    recv_act 0 | F0 | send_act 0, recv_act 1 |
#   steady     F1 | send_act 1, recv_grad 0 | B0 | send_grad 0, recv_act 2 | F2 | ... | B2 |
#   cool-down  send_grad 2, recv_grad 3 | B3 | send_grad 3

def nccl_program(actions: list[Action]) -> list:
    """The executor's program for a stage's list: its computations as they are, and each run of
    messages between two computations as ("post", group), then ("wait", group) if it receives.
    A group is a tuple of Actions."""
    program = []
    for messages, run in itertools.groupby(
            actions, key=lambda a: a.kind.startswith(("send", "recv"))):
        if not messages:
            program += run                               # F, B (or W): computations, as they are
            continue
        group = tuple(run)
        program.append(("post", group))
        if any(a.kind.startswith("recv") for a in group):
            program.append(("wait", group))
    return program


class StepCache:
    """What one step keeps between a stage's actions, by (micro-batch, chunk)."""

    def __init__(self, device, last_backward: Action | None):
        self.inputs = {}           # received activations: B sends their .grad back
        self.outputs = {}          # what F returned, until its B (or, evaluating, its send)
        self.output_grads = {}     # received gradients of the outputs, until their B
        self.aux_losses = {}       # the routers' losses of a chunk with experts, until its B
        self.recvs = {}            # a posted group that receives -> (its work, its buffers)
        self.sends_to_wait = []    # works of groups that only send, waited for at the end
        self.loss = torch.zeros((), device=device)     # this stage's part of the step's loss
        self.last_backward = last_backward             # after it, the replicas reduce


class Pipeline(PipelineMechanics):
    """Runs this rank's list of actions each step, as stage comm.rank of comm.world_size.

    module: this rank's GPTStage (its chunks, its tied copy, its device). It may be wrapped in
    DDP or FSDP over the stage's data-parallel group.
    schedule: "gpipe" or "1f1b", or every stage's list made elsewhere (schedules.make_pipeline:
    interleaved, zero bubble).
    activation, dtype: what a stage sends. A receive needs a buffer of the right size before
    the message arrives. activation is C, the channels of a (b, T, C), or a function (b, T) ->
    its shape (sequence parallelism sends (b, T/tp, C)).
    sync, an attribute: the module's (DDP's, FSDP's) gradient sync. Its no_sync() holds the
    replicas' reduction during a backward; train_step's finish_gradient_sync() runs what it held.
    None with one replica per stage; a mesh chains several, in order (composition/parallelize.py).
    The base class (mechanics/pipeline_mechanics.py) holds the loop's interface, the tied ends'
    group and `observer`, which watches the step from outside (times, activations held)."""

    def __init__(self, module: nn.Module, comm: Comm, schedule, microbatches: int,
                 activation, dtype: torch.dtype):
        super().__init__(comm.world_size, microbatches)   # checks P, M >= 1; makes .observer
        gpt_stage = getattr(module, "module", module)        # the GPTStage, inside DDP or FSDP
        self.module, self.comm, self.M, self.dtype = module, comm, microbatches, dtype
        self.activation = activation if callable(activation) else lambda b, t: (b, t, activation)
        self.stage, self.P, self.v = comm.rank, comm.world_size, len(gpt_stage.chunks)
        self.first, self.last = self.stage == 0, self.stage == self.P - 1
        self.stages = (SCHEDULES[schedule](self.P, self.M) if isinstance(schedule, str)
                       else schedule)
        self.actions = self.stages[self.stage]
        forwards = ("F", "recv_act", "send_act")
        self.evaluation_actions = [a for a in self.actions if a.kind in forwards]
        self.device = next(gpt_stage.parameters()).device   # FSDP's: views of a unit's flat buffer
        # Set-up, not a message: NCCL makes a group's communicator at its first call. A
        # batch_isend_irecv may be that call only if every rank joins it, and the stages' first
        # calls differ. So one small all-reduce goes first, every rank joining.
        dist.all_reduce(torch.zeros(1, device=self.device), group=comm.group)
        self.tied = gpt_stage.tied              # None unless this stage is an end of a tied pair
        self.sync = module if hasattr(module, "finish_gradient_sync") else None
        # A Comm over the first and last stage if they hold a tied weight, else None. Every rank
        # calls this: making a group is a collective call.
        self.ends = self._ends_group(comm, self.device) if self.P > 1 else None

    def train_step(self, x, y, scale_loss=lambda loss: loss, measure=False) -> torch.Tensor:
        """Forwards and backwards of the M micro-batches of x, y (B, T); returns the loss, on
        every stage; the mean loss's gradients accumulate in .grad (averaged over replicas).
        scale_loss: fp16's loss scale (mixed_precision.py). measure: time CUDA exactly."""
        loss = self._run(self.actions, x, y, scale_loss, measure)
        self._sum_tied_gradients()
        if self.sync is not None:
            self.sync.finish_gradient_sync()      # the replicas' reduction, held until now
        # Only the last stage holds the loss (with experts, each its routers'): the sum gives it to
        # every stage. After every reduction, so every rank launches its collectives in one order.
        dist.all_reduce(loss, group=self.comm.group)
        return loss

    @torch.no_grad()
    def evaluate(self, x, y) -> torch.Tensor:
        """The mean loss over x, y (B, T), on every stage: the list's forwards and messages."""
        loss = self._run(self.evaluation_actions, x, y)
        dist.all_reduce(loss, group=self.comm.group)     # the sum over the stages, as train_step's
        return loss

    def _run(self, actions, x, y, scale_loss=None, measure=False) -> torch.Tensor:
        """Play a stage's list; return this stage's part of the loss. For each nccl_program item:
        ("post", group) -> _post: its messages as one batch; ("wait", group) -> _wait: files what
        it received by (m, chunk); F, B -> _compute -> _forward (keeps its output) or _backward."""
        micro_x, micro_y = self._micro_batches(x, y)              # M micro-batches (b, T) each
        shape = self.activation(x.shape[0] // self.M, x.shape[1])   # what a stage sends: (b, T, C)
        backwards = [a for a in actions if a.kind == "B"]
        cache = StepCache(x.device, backwards[-1] if backwards else None)
        # FSDP's units stay gathered for the step; the observer only watches it, from outside.
        with self._gathered_for_step(), self.observer.step(measure):
            for item in nccl_program(actions):
                if item[0] == "post":
                    self._post(item[1], cache, shape, x.device)
                elif item[0] == "wait":
                    self._wait(item[1], cache)
                else:                                             # F or B (zero bubble: W too)
                    with self.observer.compute(item):
                        self._compute(item, micro_x[item.m], micro_y[item.m], cache, scale_loss)
            for work in cache.sends_to_wait:   # each holds its sent tensor alive until waited for
                work.wait()
        return cache.loss

    def _compute(self, a: Action, x, y, cache: StepCache, scale_loss):
        """F of micro-batch a.m (its tokens x, targets y), or B: its whole backward.
        (Zero bubble's W, half a backward, is extensions/zero_bubble.py's override of this.)"""
        if a.kind == "F":
            self._forward(a, x, y, cache)
            return
        with self._no_sync(a, cache):
            self._backward(a, cache, scale_loss)

    def _forward(self, a: Action, x, y, cache: StepCache):
        """F: chunk a.chunk on micro-batch a.m, from its tokens x (b, T) or the activation
        received. The last chunk's loss joins the step's, 1/M each."""
        key, has_loss = (a.m, a.chunk), self.last and a.chunk == self.v - 1   # the model's end
        inputs = x if self.first and a.chunk == 0 else cache.inputs[key]
        targets = (y,) if has_loss else ()
        output = self.module(inputs, *targets, chunk=a.chunk)
        output = self._keep_aux_loss(output, key, cache)
        if has_loss:
            cache.loss += output.detach().float() / self.M
        if torch.is_grad_enabled() or not has_loss:   # kept for B, or (evaluating) for send_act
            cache.outputs[key] = output

    def _backward(self, a: Action, cache: StepCache, scale_loss):
        """B: chunk a.chunk's backward on micro-batch a.m, from the loss or a received gradient."""
        key = a.m, a.chunk
        if self.last and a.chunk == self.v - 1:       # the loss's: the mean over micro-batches
            scale_loss(cache.outputs.pop(key) / self.M).backward()
        elif key in cache.aux_losses:
            self._backward_with_aux_loss(key, cache, scale_loss)
        else:
            cache.outputs.pop(key).backward(cache.output_grads.pop(key))

    def _post(self, group: tuple, cache: StepCache, shape, device):
        """Post a group's sends and receives as one batch_isend_irecv (Comm.exchange: one work)."""
        ops, buffers = [], {}
        # The next and previous stage. % P wraps round only when interleaved: the last stage's
        # chunk sends to the first stage's next chunk.
        after, before = (self.stage + 1) % self.P, (self.stage - 1) % self.P
        for a in group:
            key = a.m, a.chunk
            if a.kind == "send_act":             # evaluation keeps no graph: nothing for B
                output = cache.outputs[key] if torch.is_grad_enabled() else cache.outputs.pop(key)
                ops.append(("send", output.detach(), after))
            elif a.kind == "send_grad":
                ops.append(("send", cache.inputs.pop(key).grad, before))
            else:                                # a fresh buffer of the known shape: (b, T, C)
                buffers[a] = torch.empty(shape, dtype=self.dtype, device=device)
                ops.append(("recv", buffers[a], before if a.kind == "recv_act" else after))
        work = self.comm.exchange(ops)
        if buffers:
            cache.recvs[group] = work, buffers
        else:
            cache.sends_to_wait.append(work)     # nothing here reads them: waited for at the end

    def _wait(self, group: tuple, cache: StepCache):
        """Wait for a posted group; file what it received: activations for F, gradients for B."""
        work, buffers = cache.recvs.pop(group)
        work.wait()
        for a, buffer in buffers.items():
            if a.kind == "recv_act":             # training: B sends this input's gradient back
                cache.inputs[a.m, a.chunk] = buffer.requires_grad_(torch.is_grad_enabled())
            else:
                cache.output_grads[a.m, a.chunk] = buffer

    # ---- corner cases, after the core: each for one reason ----------------------------------

    def _micro_batches(self, x, y) -> tuple:
        """x, y (B, T) as M micro-batches (b, T) each; a batch that does not split stops here."""
        if x.shape[0] % self.M:
            raise ValueError(f"a batch of {x.shape[0]} rows does not split into {self.M} equal "
                             f"micro-batches: use a batch that is a multiple of {self.M}")
        return x.chunk(self.M), y.chunk(self.M)

    def _gathered_for_step(self):
        """FSDP's units stay gathered for the step: a schedule runs forwards before backwards."""
        return getattr(self.module, "gathered_for_step", contextlib.nullcontext)()

    def _no_sync(self, a: Action, cache: StepCache):
        """Hold the replicas' gradient reduction under the sync's no_sync() while it must wait.

        A sync that keeps whole gradients (keeps_whole_gradients: DDP's) reduces once, after the
        step's last backward (FSDP's, holding shards, in each backward).
        A tied weight's two ends must add up before any reduction, so every backward is held."""
        whole = getattr(self.sync, "keeps_whole_gradients", False)
        hold = self.tied is not None or (whole and a != cache.last_backward)
        return self.sync.no_sync() if self.sync is not None and hold else contextlib.nullcontext()

    def _keep_aux_loss(self, output, key: tuple, cache: StepCache):
        """With experts a chunk also returns its routers' losses (moe.py's balance loss).
        They join the step's loss, 1/M each, and B's backward. Returns the activation."""
        if not isinstance(output, tuple):
            return output
        output, aux = output
        cache.loss += aux.detach().float() / self.M
        if torch.is_grad_enabled():
            cache.aux_losses[key] = aux
        return output

    def _backward_with_aux_loss(self, key: tuple, cache: StepCache, scale_loss):
        """B of a chunk with experts: the gradient received, and the routers' losses, 1/M each."""
        aux = scale_loss(cache.aux_losses.pop(key) / self.M)
        torch.autograd.backward([cache.outputs.pop(key), aux], [cache.output_grads.pop(key), None])

    def _sum_tied_gradients(self):
        """A head tied to the token embedding has a copy on each end: each copy's gradient
        becomes the sum of both, so the copies stay equal (a frozen one, LoRA's base: none)."""
        if self.tied is not None and self.tied.requires_grad:
            self.ends.all_reduce(self.tied.grad)       # Comm: the sum over both ends, in place


# ---- run alone: check GPipe and 1F1B against one process (torchrun) ---------------------------

def demo(gpt: nn.Module, layers: range, M: int = 4, bounds=(1e-6, 1e-12)) -> bool:
    """torchrun --nproc_per_node 2 pipeline.py: `gpt` (model.py's tiny GPT in fp64), one stage per
    rank, this rank's blocks `layers`. It runs one step's forwards and backwards under GPipe,
    then 1F1B. Each stage prints the order it computed in. The loss and every gradient are
    checked against one process's on the whole batch. Bounds: the loss, relative, is a metric
    the executor sums in fp32. The gradients are fp64, the mean taken as M means of B/M rows."""
    s, P = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (2 * M, 33))                         # (B, T+1) byte tokens
    whole, passed = copy.deepcopy(gpt), True                          # gpt stays as built
    _, loss = whole(batch[:, :-1], batch[:, 1:])                      # one process, every row
    loss.backward()
    for schedule in SCHEDULES:
        stage = GPTStage(copy.deepcopy(gpt), layers, first=s == 0, last=s == P - 1)
        runner = Pipeline(stage, Comm(), schedule, M, whole.cfg.n_embd, torch.float64)
        ours = runner.train_step(batch[:, :-1], batch[:, 1:])
        for rank in range(P):                                          # in stage order
            if rank == s:
                computed = (f"{a.kind}{a.m}" for a, _start, _end in runner.observer.timeline)
                print(f"{schedule} stage {s} computed:", *computed, flush=True)
            dist.barrier()
        grads = [(p.grad - whole.get_parameter(name.removeprefix("gpt.")).grad).abs().max()
                 for name, p in stage.named_parameters()]
        difference = torch.stack([((ours - loss.detach()) / loss.detach()).abs(), max(grads)])
        dist.all_reduce(difference, op=dist.ReduceOp.MAX)
        passed &= all(d <= bound for d, bound in zip(difference.tolist(), bounds))
        if s == 0:
            print(f"{schedule}: max |difference| from one process: loss {difference[0]:.1e} "
                  f"relative (bound {bounds[0]:.0e}: summed in fp32), gradients "
                  f"{difference[1]:.1e} (bound {bounds[1]:.0e}: fp64, sums reordered)", flush=True)
    return passed


if __name__ == "__main__":
    start_alone(torchrun=True, worlds=(1, 2, 3, 4))            # a stage: 1 or more of 4 blocks
    dist.init_process_group("gloo")
    torch.manual_seed(1)
    tiny = build_model("tiny").double()
    passed = demo(tiny, split_layers(tiny.cfg.n_layer, dist.get_world_size())[dist.get_rank()])
    dist.destroy_process_group()                      # (every print above flushed)
    os._exit(0 if passed else 1)   # at once: gloo's threads may hold tensors (exit_distributed)
