"""Pipeline parallelism: cut the model into stages, stream micro-batches through them.

Cut the model into P stages of whole blocks, one per rank; a batch split into M micro-batches
flows through them, activations sent forward and their gradients back with point-to-point
messages. The order of each stage's forwards, backwards, sends and receives is a schedule,
data built and checked in schedules.py (GPipe, 1F1B, interleaved 1F1B, zero bubble ZB-H1; their
bubble and memory are worked out there); here one executor runs any such list on a stage of a
GPT: a stage may hold several chunks of blocks (interleaved), and a backward may be split in two
(zero bubble: B, the input's gradient now, W, the weights' gradient later; how: zero_bubble.py).
Run: python pipeline.py --stages 4 --microbatches 8 --schedule 1f1b (draws it: schedules.main);
     torchrun --nproc_per_node 4 train.py --strategy pipeline --pp 4 --microbatches 8
     (--schedule interleaved --virtual-stages 2, --schedule zb)
Test: python -m pytest tests/test_pipeline.py (the schedules: tests/test_schedules.py)

Shapes: P stages, M micro-batches, s stage, m micro-batch, v chunks per stage, B batch rows per
pipeline, b = B / M rows per micro-batch, T sequence, C channels.
"""
import contextlib
import math
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

from collectives import Comm, ring_bytes
from placements import place
from process_groups import subgroups
from schedules import (BUBBLE_FORMULAS, Action, bubble_formula, check_schedule, forwards_only, main, make_schedule,
                       nccl_program, run_under_nccl)
from zero_bubble import WeightGradients


# ---- the model, cut into stages ----------------------------------------------------------

def split_layers(n_layer: int, P: int, sizes: list[int] | None = None, v: int = 1) -> list[range]:
    """The blocks of each of the P v chunks (virtual stages; stage s holds chunks s, s + P, ...):
    `sizes` blocks each if given, else balanced by count (the first n_layer % Pv take one more;
    the last also computes the head and loss)."""
    P, pp = P * v, P
    if sizes is None:
        if n_layer < P:
            chunks = f" x {v} chunks each = {P} chunks" if v > 1 else ""
            raise ValueError(f"the model has {n_layer} blocks, fewer than {pp} pipeline stages{chunks}: "
                             f"every {'chunk' if v > 1 else 'stage'} needs a block; use "
                             + ("fewer --virtual-stages" if v > 1 else f"--pp {n_layer} or fewer")
                             + ", or a deeper --model")
        sizes = [n_layer // P + (s < n_layer % P) for s in range(P)]
    if len(sizes) != P or sum(sizes) != n_layer or min(sizes) < 1:
        raise ValueError(f"--stage-layers {','.join(map(str, sizes))}: give {P} numbers"
                         + (f" (--pp {pp} x --virtual-stages {v} chunks)" if v > 1 else "")
                         + f", each 1 or more, adding up to the model's {n_layer} blocks")
    starts = [sum(sizes[:s]) for s in range(P)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


class GPTStage(nn.Module):
    """One stage of a model.GPT: its blocks in `layers` (a range; interleaved, one range per
    chunk), with the embeddings on the first stage and the final norm, head and loss on the last
    (in the first and the last chunk). The other stages' parts are dropped from this rank, and
    what stays keeps the whole model's names (blocks.5.attn.query.weight), so the stages'
    checkpoints together read as one model's.

    A head tied to the token embedding (GPT-2) lives on both ends: the first and the last
    stage each hold a copy, `tied`, kept equal by summing their gradients (Pipeline does).
    """

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
        # Each stage holds its own parameters (sharded along "pp": their squares add up over the
        # stages in the norm); the last stage's tied copy is the first's, counted there.
        for p in self.parameters():
            place(p, shard={"pp": None})
        if tied and last:
            place(self.tied, counted=False)

    @property
    def tied(self) -> nn.Parameter | None:
        """This stage's copy of the tied weight (a property: an attribute would re-register it)."""
        return self.gpt.token_emb.weight if self._tied else None

    def forward(self, x, targets=None, chunk: int = 0):
        gpt = self.gpt                                   # model.GPT's own parts, a stage's share
        if self.first and chunk == 0:
            x = gpt.embed(x)                             # (b, T) token ids -> (b, T, C)
        x = gpt.run_blocks(x, self.chunks[chunk])        # (b, T, C)
        # With experts (moe.py), the routers' losses of this chunk's blocks: part of the model's
        # loss, so a chunk before the last returns them beside its activation (Pipeline adds
        # their gradient in its backward), and the last adds them to the loss.
        aux = sum(gpt.blocks[i].mlp.aux_loss for i in self.chunks[chunk]) if gpt.cfg.experts else None
        if not (self.last and chunk == len(self.chunks) - 1):
            return x if aux is None else (x, aux)
        logits = gpt.logits(x)                           # (b, T, V) (tensor parallel: V/tp)
        if targets is None:
            return logits
        loss = gpt.loss_fn(logits, targets)
        return loss if aux is None else loss + aux


# ---- the executor: one stage's list, run over send/recv --------------------------------------

class Pipeline:
    """Runs this rank's action list each step: the rank is stage comm.rank of comm.world_size.

    module: this rank's GPTStage, or DDP(stage) or FSDP(stage) over the stage's data-parallel
    group. The stage says the rest: its chunks of blocks (interleaved: one per virtual stage),
    its copy of a weight the first and the last stage share (GPTStage.tied: the two copies'
    gradients are summed after each step's backward, so both take one step), and the device
    it computes on, where every tensor it hands a collective lives (NCCL moves device memory).
    schedule, microbatches: schedules.make_schedule's name, and M.
    activation, dtype: what a stage sends, known before it arrives, so a receive is posted into
    a buffer of the right size with no message about sizes: C, the channels of a (b, t, C), or
    a function (b, t) -> its shape where that differs (sequence parallelism: (b, t/tp, C)).
    The rows it is given are this rank's: under context parallelism the caller keeps this
    rank's tokens of each sequence first (ContextParallelGPT.local_tokens), so t = T/cp.
    sync, an attribute: the gradient-sync protocol the backwards run under (_run says which) and
    train_step finishes once a step; the module's by default (DDP's, FSDP's), None with one
    replica per stage; a composition assigns its chain (parallelize.py: flat.GradientSyncs).
    Deadlock-free under gloo's rules and NCCL's: each stage runs nccl_program(its list), the
    sends and receives between two computations posted together, and the programs are played
    by run_under_nccl() (check_schedule) before the first message.
    """

    def __init__(self, module: nn.Module, comm: Comm, schedule: str, microbatches: int,
                 activation, dtype: torch.dtype):
        gpt_stage = getattr(module, "module", module)             # the GPTStage, inside DDP or FSDP
        self.module, self.comm, self.M, self.dtype = module, comm, microbatches, dtype
        self.activation = activation if callable(activation) else lambda b, t: (b, t, activation)
        self.stage, self.P, self.v = comm.rank, comm.world_size, len(gpt_stage.chunks)
        self.first, self.last = self.stage == 0, self.stage == self.P - 1
        stages = make_schedule(schedule, self.P, self.M, self.v)
        check_schedule(stages, self.M)           # NCCL's rules included (run_under_nccl)
        self.actions, self.schedule = stages[self.stage], schedule
        # Evaluation: every chunk's forwards (and their messages), no backward.
        forwards = forwards_only(self.P, self.M, self.v)
        run_under_nccl([nccl_program(actions) for actions in forwards])
        self.forward_actions = forwards[self.stage]
        self.weight_grads = WeightGradients(gpt_stage) if any(a.kind == "W" for a in self.actions) else None
        self.device = next(gpt_stage.parameters()).device     # under FSDP too: its units' views
        # NCCL: a batch_isend_irecv may be a group's first call only if every rank of the group
        # joins it (torch's documentation); the stages' first groups differ, so one small
        # all-reduce creates the communicator on every stage first (a set-up call, not counted).
        # It carries how many stages would run a W with nothing to compute, so that every stage
        # stops alike (cli.py refuses such a run first).
        idle = torch.tensor([float(self.weight_grads is not None and not self.weight_grads.layers)],
                            device=self.device)
        dist.all_reduce(idle, group=comm.group)
        if idle.item():
            raise ValueError(f"--schedule zb: {int(idle.item())} of the {self.P} stages hold no trained "
                             f"weight whose gradient W could compute (no trained nn.Linear or split "
                             f"or LoRA product): use --schedule 1f1b")
        self.tied = gpt_stage.tied                  # None unless this stage is an end of a tied pair
        self.sync = module if hasattr(module, "finish_gradient_sync") else None
        if self.P > 1:
            self.ends = self._ends_group(comm, self.device)
        self.peak_activations = 0         # most micro-batch chunks held at once (F run, B or W not)
        self.busy = self.wall = 0.0       # seconds computing, seconds in all, in the last step

    def _ends_group(self, comm: Comm, device) -> Comm | None:
        """A Comm over this pipeline's first and last stage if they share a tied weight.

        Collective over the world: every rank of every pipeline (data-parallel copies) learns
        all pipelines' ends and whether any is tied, and then creates every ends group, in one
        order, as new_group requires (process_groups.subgroups). Middle stages hold no tied copy
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
        """Forwards and backwards of the M micro-batches of x, y (B, t); the gradients of the
        mean loss over B accumulate in the stage's .grad (averaged over replicas, if any).
        Returns that loss on every stage. measure: synchronize CUDA around each compute, so busy
        and wall time, and timeline (each compute action's start and end) are exact."""
        if self.weight_grads is not None:
            self.weight_grads.computed.clear()
        with self._gathered():
            loss = self._run(self.actions, x, y, scale_loss, measure)
        # A tied weight's two ends add up first, while every .grad is whole (its backwards were
        # all held); then the sync protocol's finish: the tensor group's partial sums (W's among
        # them), the data dimension's reduction.
        if self.tied is not None:                          # the embedding's + the head's gradient
            self.ends.all_reduce(self.tied.grad)
        if self.sync is not None:
            self.sync.finish_gradient_sync()
        return self._sum_over_stages(loss)

    @torch.no_grad()
    def evaluate(self, x, y) -> torch.Tensor:
        """The mean loss over x, y (B, t), forwards only; on every stage."""
        with self._gathered():
            loss = self._run(self.forward_actions, x, y)
        return self._sum_over_stages(loss)

    def _sum_over_stages(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss lives on the last stage (with experts, each stage holds its routers' part):
        every stage returns the sum (a metric: not counted). Called once the step's reductions
        are over: with ring collectives none is then still to be launched, so this native call
        keeps every rank's one launch order (launch.Launcher)."""
        dist.all_reduce(loss, group=self.comm.group)
        return loss

    def _gathered(self):
        """FSDP's units stay gathered through the step (fsdp.FSDP.gathered_for_step): a schedule
        runs several micro-batches' forwards before their backwards."""
        return getattr(self.module, "gathered_for_step", contextlib.nullcontext)()

    def __call__(self, x, y):
        """(None, evaluate(x, y)): called as a GPT is, for the loss (no stage holds all logits)."""
        return None, self.evaluate(x, y)

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()

    def measured_bubbles(self) -> list[float]:
        """Each stage's idle share of its last step, 1 - busy / wall (collective: every stage)."""
        times = torch.tensor([self.busy, self.wall], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(times) for _ in range(self.P)]
        dist.all_gather(every, times, group=self.comm.group)      # a metric: not counted
        return [1 - (busy / wall).item() for busy, wall in every]

    def deferred_weights(self) -> int:
        """How many of this stage's weights got their gradient from W in the last step (zero
        bubble; 0 for a schedule whose backward is whole)."""
        return len(self.weight_grads.computed) if self.weight_grads is not None else 0

    def predicted_bubble(self) -> tuple[str, float]:
        """The schedule's idle share on schedules.py's clock: (formula, value)."""
        return BUBBLE_FORMULAS[self.schedule], bubble_formula(self.schedule, self.P, self.M, self.v)

    def bytes_per_step(self, batch: int, seq_len: int) -> int:
        """Bytes this stage sends per step for batch rows of seq_len tokens: one activation or
        gradient (the shape `activation` gives) per send in its list (1F1B: M forward unless it
        is the last stage, M back unless the first; interleaved: v times as many), the gradient
        norm's all-reduce, and at the two ends a tied weight's gradient (ring formulas)."""
        message = math.prod(self.activation(batch // self.M, seq_len)) * torch.finfo(self.dtype).bits // 8
        sends = sum(a.kind.startswith("send") for a in self.actions)
        norm = ring_bytes("all_reduce", 1, 4, self.P)                  # 1 fp32
        tied = (ring_bytes("all_reduce", self.tied.numel(), self.tied.element_size(), 2)
                if self.tied is not None else 0)
        return message * sends + norm + tied

    def _run(self, actions, x, y, scale_loss=None, measure=False):
        B, T = x.shape
        if B % self.M:
            raise ValueError(f"a batch of {B} rows does not split into {self.M} equal micro-batches: "
                             f"use a batch that is a multiple of {self.M}")
        xs, ys = x.chunk(self.M), y.chunk(self.M)                 # M x (b, T)
        shape = self.activation(B // self.M, T)                   # what a stage sends: (b, T, C)
        # By (micro-batch, chunk): received activations, computed outputs, received gradients,
        # with experts a chunk's routers' losses; the chunks whose F ran and B (or W) not yet;
        # posted receives, the sends to wait for at the end; this stage's part of the loss.
        flight = SimpleNamespace(inputs={}, outputs={}, grads={}, auxes={}, held=set(), posted={},
                                 sends=[], loss=torch.zeros((), device=x.device))
        split = self.weight_grads is not None
        # One gradient average per step, the last backward's, for the sum of all M. Every
        # backward is held (the finish reduces them all) when the stage has sums of its own to
        # make before the data dimension reduces: W's gradients after autograd, a tied weight's
        # two ends; else all but the last, where the gradients are whole anyway (DDP's).
        held_all = split or self.tied is not None
        accumulate = getattr(self.sync, "keeps_whole_gradients", False)
        last_backward = [a for a in actions if a.kind == "B"][-1:]
        self.timeline, start = [], self._clock(measure)       # (Action, start, end) per compute
        for item in nccl_program(actions):
            if not isinstance(item, Action):
                self._communicate(item, flight, shape, x.device)
                continue
            a, began = item, self._clock(measure)
            if a.kind == "F":
                self._forward(a, xs[a.m], ys[a.m], flight)
            elif a.kind == "B":
                hold = self.sync is not None and (held_all or ([a] != last_backward and accumulate))
                with (self.sync.no_sync() if hold else contextlib.nullcontext()), \
                        (self.weight_grads.collect((a.m, a.chunk)) if split else contextlib.nullcontext()):
                    self._backward(a, flight, scale_loss)
                if not split:
                    flight.held.discard((a.m, a.chunk))
            else:                                                  # "W"
                self.weight_grads.run((a.m, a.chunk))
                flight.held.discard((a.m, a.chunk))
            self.timeline.append((a, began, self._clock(measure)))   # exact only if measure (CUDA)
        for handle in flight.sends:
            handle.wait()
        self.wall, self.busy = self._clock(measure) - start, sum(e - b for _, b, e in self.timeline)
        return flight.loss                            # this stage's part: _sum_over_stages

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
        """A ("post", group) of nccl_program: one exchange() of the group's sends and receives;
        ("wait", group): wait for it and file what arrived."""
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
        after, before = (self.stage + 1) % self.P, (self.stage - 1) % self.P   # the ring's neighbours
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
            flight.sends.append(handle)      # waited at the end: nothing here reads them

    @staticmethod
    def _clock(synchronize: bool) -> float:
        if synchronize and torch.cuda.is_available():
            # The compute stream only: a device-wide synchronize would also wait for the p2p
            # stream, where a send may sit until the peer posts its receive after this very
            # stage's next send (run_under_nccl lets computation run on meanwhile).
            torch.cuda.current_stream().synchronize()
        return time.perf_counter()


if __name__ == "__main__":
    main()              # schedules.main: draws a schedule, as `python schedules.py` does
