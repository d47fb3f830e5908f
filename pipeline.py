"""Pipeline parallelism: cut the model into stages, stream micro-batches through them.

Cut the model into P stages of whole blocks, one per rank; a batch split into M micro-batches
flows through them, activations sent forward and their gradients back with point-to-point
messages. The order of each stage's forwards, backwards, sends and receives is a schedule,
data built and checked in schedules.py (GPipe, 1F1B, interleaved 1F1B, zero bubble ZB-H1; their
bubble and memory are worked out there); here one executor runs any such list on a stage of a
GPT: a stage may hold several chunks of blocks (interleaved), and a backward may be split in two
(zero bubble: B, the input's gradient now, W, the weights' gradient later; how below, at
DeferredLinear).
Run: python pipeline.py --stages 4 --microbatches 8 --schedule 1f1b (draws it: schedules.main);
     torchrun --nproc_per_node 4 train.py --strategy pipeline --pp 4 --microbatches 8
     (--schedule interleaved --virtual-stages 2, --schedule zb)
Test: python -m pytest tests/test_pipeline.py (the schedules: tests/test_schedules.py)

Shapes: P stages, M micro-batches, s stage, m micro-batch, v chunks per stage, B batch rows per
pipeline, b = B / M rows per micro-batch, T sequence, C channels.
"""
import contextlib
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from collectives import Comm, ring_bytes
from placements import place
from process_groups import subgroups
from schedules import (BUBBLE_FORMULAS, Action, bubble_formula, check_schedule, chunks_of, forwards_only, main, make_schedule,
                       nccl_program, run_under_nccl)


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


# ---- zero bubble: a backward in two halves ------------------------------------------------------
#
# A linear layer y = x W^T + b has three gradients: dx = dy W (the previous layer, and the
# previous stage, wait for it), dW = dy^T x and db = sum(dy) (nothing waits for them until the
# optimizer). B runs autograd's backward with every trainable weight's product swapped for
# DeferredLinear, whose backward returns dx only and leaves (x, dy) in a list; W runs that
# list's two matmuls later. Which products: every nn.Linear's, and those of any module that
# computes them as self.linear(x, weight, bias) (the protocol: tensor_parallel's split layers,
# whose f and g collectives stay in B around the product, and LoRA's thin factors); W swaps
# its own function in. The other parameters (norms, embeddings) are small: their gradients come
# in B, as usual. Under FSDP the module is not a submodule (FSDP.module) and the weights are
# views of a gathered unit (the pipeline keeps it gathered through the step): W writes .grad as
# autograd would, and the unit's reduce-scatter, held until the step's finish, takes it.

class DeferredLinear(torch.autograd.Function):
    """F.linear whose backward computes the input's gradient and defers the weight's and bias's:
    (weight, bias, x, dy) goes into later.pending, the list of the backward now running."""

    @staticmethod
    def forward(ctx, x, weight, bias, later):
        ctx.save_for_backward(x, weight)
        ctx.bias, ctx.later = bias, later
        return F.linear(x, weight, bias)                            # (..., k) -> (..., d)

    @staticmethod
    def backward(ctx, dy):                                          # dy: (..., d)
        x, weight = ctx.saved_tensors
        ctx.later.pending.append((weight, ctx.bias, x, dy))
        return dy @ weight, None, None, None                        # dx: (..., k)


class WeightGradients:
    """The deferred halves of a stage's backwards, by micro-batch and chunk.
    module: the stage, or a wrapper holding it as .module (DDP, FSDP)."""

    def __init__(self, module: nn.Module):
        self.pending, self.by_pass = [], {}
        self.layers = 0                  # layers whose products defer a trained weight's gradient
        self.computed = set()            # the weights W gave a gradient, since clear()
        for layer in getattr(module, "module", module).modules():
            if isinstance(layer, nn.Linear) and layer.weight.requires_grad:
                layer.forward = partial(self._nn_linear, layer)
                self.layers += 1
            elif hasattr(layer, "linear"):
                layer.linear = self.linear
                self.layers += any(p.requires_grad for p in layer.parameters(recurse=False))

    def _nn_linear(self, layer, x):
        return DeferredLinear.apply(x, layer.weight, layer.bias, self)

    def linear(self, x, weight, bias=None):
        """The protocol's F.linear: the weight's gradient waits for W if it trains (a frozen
        weight has none to compute)."""
        if not weight.requires_grad:
            return F.linear(x, weight, bias)
        return DeferredLinear.apply(x, weight, bias, self)

    @contextlib.contextmanager
    def collect(self, key):
        """Inside: a backward (B) whose deferred halves are filed under key."""
        self.pending = self.by_pass[key] = []
        yield
        self.pending = []

    @torch.no_grad()
    def run(self, key):
        """W: the weight and bias gradients of the backward filed under key, accumulated in .grad
        as autograd would (the same products: dW = (x^T dy)^T over the folded rows)."""
        for weight, bias, x, dy in self.by_pass.pop(key):
            x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])     # (rows, k), (rows, d)
            _accumulate(weight, x2.t().mm(dy2).t())                                # (d, k)
            self.computed.add(weight)
            if bias is not None and bias.requires_grad:
                _accumulate(bias, dy2.sum(0))                                      # (d,)


def _accumulate(param: nn.Parameter, grad: torch.Tensor):
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


# ---- the executor: one stage's list, run over send/recv --------------------------------------

class Pipeline:
    """Runs this rank's action list each step: the rank is stage comm.rank of comm.world_size.

    module: this rank's GPTStage, or DDP(stage) or FSDP(stage) over the stage's data-parallel
    group. sync: the gradient-sync protocol (ddp.GradientSyncs) the backwards run under; default
    the module's (DDP's, FSDP's). The backwards of all but the last micro-batch run under its
    no_sync() where the gradients are whole anyway (DDP), every backward where the stage has
    sums of its own first (zero bubble's W, after autograd; a tied weight's two ends), and
    train_step ends with its finish_gradient_sync(): the gradients are reduced once per step.
    schedule, virtual_stages: schedules.make_schedule's; interleaved, module holds one chunk of
    blocks per virtual stage (GPTStage(layers=[...]), called with chunk=c).
    hidden, dtype: the activation a stage sends is (b, T, hidden) of dtype, known before it
    arrives, so a receive is posted into a buffer of the right size with no message about sizes.
    tied: the stage's copy of a weight the first and the last stage share (GPTStage.tied);
    after each step's backward the two copies' gradients are summed, so both take one step.
    Deadlock-free under gloo's rules and NCCL's: each stage runs nccl_program(its list), the
    sends and receives between two computations posted together, and the programs are played
    by run_under_nccl() (check_schedule) before the first message.
    Inside a mesh (train.py): local_tokens,
    context parallelism's (x, y) -> this rank's tokens of them, applied before the micro-batches;
    sequence_split, the parts each activation is cut into along T (sequence parallelism: a stage
    sends its rank's (b, T/tp, hidden)). device: where the stage computes, and so where every
    tensor it hands a collective lives (NCCL moves device memory only); default: where the
    module's first parameter is, which is the host for FSDP's offloaded masters: pass it then.
    """

    def __init__(self, module: nn.Module, comm: Comm, schedule: str, microbatches: int,
                 hidden: int, dtype: torch.dtype, tied: nn.Parameter | None = None,
                 virtual_stages: int = 1, local_tokens=None, sync=None,
                 sequence_split: int = 1, device=None):
        self.module, self.comm, self.M = module, comm, microbatches
        self.local_tokens = local_tokens
        self.sequence_split = sequence_split
        self.stage, self.P = comm.rank, comm.world_size
        self.first, self.last = self.stage == 0, self.stage == self.P - 1
        stages = make_schedule(schedule, self.P, self.M, virtual_stages)
        check_schedule(stages, self.M)           # NCCL's rules included (run_under_nccl)
        self.actions, self.v, self.schedule = stages[self.stage], chunks_of(stages), schedule
        # Evaluation: every chunk's forwards (and their messages), no backward.
        forwards = forwards_only(self.P, self.M, self.v)
        run_under_nccl([nccl_program(actions) for actions in forwards])
        self.forward_actions = forwards[self.stage]
        self.weight_grads = (WeightGradients(module) if any(a.kind == "W" for a in self.actions)
                             else None)
        # NCCL: a batch_isend_irecv may be a group's first call only if every rank of the group
        # joins it (torch's documentation); the stages' first groups differ, so one small
        # all-reduce creates the communicator on every stage first (a set-up call, not counted).
        # It carries how many stages would run a W with nothing to compute, so that every stage
        # stops alike (cli.py refuses such a run first).
        self.device = device = device or next(module.parameters()).device
        idle = torch.tensor([float(self.weight_grads is not None and not self.weight_grads.layers)],
                            device=device)
        dist.all_reduce(idle, group=comm.group)
        if idle.item():
            raise ValueError(f"--schedule zb: {int(idle.item())} of the {self.P} stages hold no trained "
                             f"weight whose gradient W could compute (no trained nn.Linear or split "
                             f"or LoRA product): use --schedule 1f1b")
        self.hidden, self.dtype = hidden, dtype
        self.tied = tied if self.P > 1 else None
        # The gradient-sync protocol around the backwards (ddp.GradientSyncs): given, or the
        # module's own (DDP's, FSDP's), or none (one replica per stage).
        self.sync = sync or (module if hasattr(module, "finish_gradient_sync") else None)
        if self.P > 1:
            self.ends = self._ends_group(comm, device)
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
        """Forwards and backwards of the M micro-batches of x, y (B, T); the gradients of the
        mean loss over B accumulate in the stage's .grad (averaged over replicas, if any).
        Returns that loss on every stage.
        measure: synchronize CUDA around each compute, so busy and wall time are exact."""
        if self.local_tokens:
            x, y = self.local_tokens(x, y)                        # (B, t) each
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

    def _no_sync(self):
        return self.sync.no_sync() if self.sync is not None else contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self, x, y) -> torch.Tensor:
        """The mean loss over x, y (B, T), forwards only; on every stage."""
        if self.local_tokens:
            x, y = self.local_tokens(x, y)
        with self._gathered():
            loss = self._run(self.forward_actions, x, y)
        return self._sum_over_stages(loss)

    def _sum_over_stages(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss lives on the last stage (with experts, each stage holds its routers' part):
        every stage returns the sum (a metric: not counted). Called once the step's reductions
        are over: with ring collectives none is then still to be launched, so this native call
        keeps every rank's one launch order (collectives._Launcher)."""
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
        """Bytes this stage sends per step: one (b, T, hidden) activation or gradient per send in
        its list (1F1B: M forward unless it is the last stage, M back unless the first;
        interleaved: v times as many), the gradient norm's all-reduce, and at the two ends a
        tied weight's gradient (ring formulas)."""
        message = batch // self.M * seq_len * self.hidden * torch.finfo(self.dtype).bits // 8
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
        shape = (B // self.M, T // self.sequence_split, self.hidden)   # what a stage sends
        device = x.device
        # By (micro-batch, chunk): received activations, computed outputs, received gradients,
        # and with experts a chunk's routers' losses.
        inputs, outputs, grads, auxes = {}, {}, {}, {}
        held = set()                             # F run, B (or W, if the backward is split) not
        posted, sends, loss = {}, [], torch.zeros((), device=device)
        split = self.weight_grads is not None
        last_backward = [a for a in actions if a.kind == "B"][-1:]
        # Every backward is held when the stage has sums of its own to make before the data
        # dimension reduces (W's gradients after autograd, a tied weight's two ends); else all
        # but the last, where the gradients are whole anyway (DDP's: GradientSyncs).
        held_all = split or self.tied is not None
        accumulate = getattr(self.sync, "keeps_whole_gradients", False)
        self.busy, start = 0.0, self._clock(measure)
        for item in nccl_program(actions):
            if not isinstance(item, Action):
                self._communicate(item, inputs, outputs, grads, posted, sends, shape, device)
                continue
            a, began = item, self._clock(measure)
            key, first, last = (a.m, a.chunk), self.first and a.chunk == 0, self.last and a.chunk == self.v - 1
            if a.kind == "F":
                inp = xs[a.m] if first else inputs[key]
                outputs[key] = self.module(inp, ys[a.m], chunk=a.chunk) if last else self.module(inp, chunk=a.chunk)
                if isinstance(outputs[key], tuple):    # (activation, routers' losses): GPTStage
                    outputs[key], auxes[key] = outputs[key]
                    loss += auxes[key].detach().float() / self.M
                    if not torch.is_grad_enabled():
                        del auxes[key]
                if last:
                    loss += outputs[key].detach().float() / self.M
                    if not torch.is_grad_enabled():
                        del outputs[key]
                if torch.is_grad_enabled():
                    held.add(key)
                    self.peak_activations = max(self.peak_activations, len(held))
            elif a.kind == "B":
                # One gradient average per step: the last backward's, for the sum of all M
                # (held: none; the finish reduces them all).
                with (self._no_sync() if held_all or ([a] != last_backward and accumulate)
                      else contextlib.nullcontext()), \
                        (self.weight_grads.collect(key) if split else contextlib.nullcontext()):
                    if last:        # the step's loss is the mean over micro-batches: 1/M each
                        scale_loss(outputs.pop(key) / self.M).backward()
                    elif key in auxes:  # the routers' losses join the loss here, 1/M each too
                        torch.autograd.backward([outputs.pop(key), scale_loss(auxes.pop(key) / self.M)],
                                                [grads.pop(key), None])
                    else:
                        outputs.pop(key).backward(grads.pop(key))
                if not split:
                    held.discard(key)
            else:                                                  # "W"
                self.weight_grads.run(key)
                held.discard(key)
            self.busy += self._clock(measure) - began
        for handle in sends:
            handle.wait()
        self.wall = self._clock(measure) - start
        return loss                                   # this stage's part: _sum_over_stages

    def _communicate(self, item, inputs, outputs, grads, posted, sends, shape, device):
        """A ("post", group) of nccl_program: one exchange() of the group's sends and receives;
        ("wait", group): wait for it and file what arrived."""
        if item[0] == "wait":
            handle, received = posted.pop(item[1])
            handle.wait()
            for a, buffer in received.items():
                if a.kind == "recv_act":
                    inputs[a.m, a.chunk] = buffer.requires_grad_(torch.is_grad_enabled())
                else:
                    grads[a.m, a.chunk] = buffer
            return
        ops, received = [], {}
        after, before = (self.stage + 1) % self.P, (self.stage - 1) % self.P   # the ring's neighbours
        for a in item[1]:
            key = (a.m, a.chunk)
            if a.kind == "send_act":         # (evaluation keeps no graph: nothing to hold for B)
                out = outputs[key] if torch.is_grad_enabled() else outputs.pop(key)
                ops.append(("send", out.detach(), after))
            elif a.kind == "send_grad":
                ops.append(("send", inputs.pop(key).grad, before))
            else:                            # a fresh buffer of the known shape: (b, T, hidden)
                received[a] = torch.empty(shape, dtype=self.dtype, device=device)
                ops.append(("recv", received[a], before if a.kind == "recv_act" else after))
        handle = self.comm.exchange(ops)
        if received:
            posted[item[1]] = handle, received
        else:
            sends.append(handle)             # waited at the end: nothing here reads them

    @staticmethod
    def _clock(synchronize: bool) -> float:
        if synchronize and torch.cuda.is_available():
            # The compute stream only: a device-wide synchronize would also wait for the p2p
            # stream, where a send may sit until the peer posts its receive after this very
            # stage's next send (run_under_nccl lets computation run on meanwhile).
            torch.cuda.current_stream().synchronize()
        return time.perf_counter()


# ---- train.py's row ---------------------------------------------------------------------------

def stage_layers(option: str | None, n_layer: int, P: int, v: int = 1) -> list[list[range]]:
    """Each stage's chunks of blocks (one chunk unless interleaved: stage s holds chunks s, s + P,
    ...) from --stage-layers "N,N,..." (blocks per chunk; None: balanced)."""
    try:
        sizes = [int(n) for n in option.split(",")] if option else None
    except ValueError:
        raise ValueError(f"--stage-layers {option}: give whole numbers separated by commas, one "
                         f"per {'chunk' if v > 1 else 'stage'}") from None
    chunks = split_layers(n_layer, P, sizes, v)
    return [chunks[s::P] for s in range(P)]


if __name__ == "__main__":
    main()              # schedules.main: draws a schedule, as `python schedules.py` does
