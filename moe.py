"""Mixture of experts: each token runs through k of E expert MLPs, picked by a learned router.

A block's MLP becomes E copies (experts) and a linear router.
Each token goes to its top-k experts, and their outputs are summed, weighted by the router's gates.
Parameters grow E-fold, the compute per token only k-fold (Shazeer et al. 2017).
GShard (Lepikhin et al. 2020, section 2.2) routes to 2 experts with a capacity per expert.
Switch (Fedus et al. 2021, section 2.2) routes to 1, with the load-balancing loss E * sum_e f_e P_e.
ST-MoE (Zoph et al. 2022, section 3) adds the router z-loss.
Expert parallelism (as GShard's) puts E/P experts on each of P ranks.
An all-to-all sends the tokens to their experts' ranks, and a second one brings them back.
Left out: shared experts, expert-choice routing, jitter noise.
feed_forward builds a GPT's blocks with it.
Run alone: torchrun --nproc_per_node 2 moe.py (the experts split over 2 ranks, compared with
the whole layer on one process); in training: train.py --model tiny-moe --ep 2;
test: python -m pytest tests/test_moe.py

Shapes: N tokens in a forward (B*T), S tokens in a routing group (N by default), C channels,
E experts, k choices per token, A = k*N assignments (token, choice),
K = ceil(capacity_factor * k * S / E) slots per expert and group.
"""
import contextlib
import copy
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from foundations.comm import Comm
from model import MLP
from foundations.alone import start_alone
from foundations.placements import place


@dataclass
class Routing:
    """The router's decision for the A = k*N assignments (token, choice), choice-major.

    Every first choice comes before any second one: under capacity a second choice drops first.
    """
    token: torch.Tensor         # (A,) the assignment's token, an index into the N tokens
    expert: torch.Tensor        # (A,) its expert
    gate: torch.Tensor          # (A,) its weight in the token's output, fp32 (fp64 if the model is)
    group: torch.Tensor         # (A,) its token's routing group
    position: torch.Tensor      # (A,) how many of its (group, expert) queue come before it
    keep: torch.Tensor          # (A,) whether it fits the capacity: position < K
    order: torch.Tensor         # (A,) the assignments sorted by queue, then priority
    per_expert: torch.Tensor    # (E,) kept assignments per expert
    groups: int                 # G routing groups
    capacity: int               # K slots per expert and group


class MoE(nn.Module):
    """A drop-in for a block's MLP: E experts behind a top-k router.

    n_embd is C.
    make_expert builds one expert, a module (.., C) -> (.., C).
    feed_forward below passes model.py's MLP.
    So an MoE of one expert with capacity_factor >= 1 (or None) is the dense block plus aux_loss.
    top_k is the experts per token (1 as Switch, 2 as GShard, any k <= E).
    The k gate values are the router's softmax probabilities of the chosen experts, renormalised.
    With k = 1 that makes the gate p / p = 1, so the router learns from the aux losses alone:
    unlike Switch, whose gate is p itself, which the task loss also trains.
    capacity_factor sets K = ceil(capacity_factor * k * S / E), the most one expert takes of a
    routing group's assignments; the rest are dropped.
    A token whose every choice is dropped adds nothing: the residual carries it.
    capacity_factor None is dropless: every assignment runs.
    group_size is the tokens per routing group (None: every token of the forward, one group).
    aux_loss_weight and z_loss_weight weigh the load-balancing and router z-losses.
    After each forward, `aux_loss` holds their weighted sum, for the model to add to its loss.
    `stats` holds what the routing did, as tensors (no host read in forward): routing_summary().
    """

    def __init__(self, n_embd: int, make_expert: Callable[[], nn.Module], experts: int = 8,
                 top_k: int = 2, capacity_factor: float | None = 1.25,
                 group_size: int | None = None, aux_loss_weight: float = 0.01,
                 z_loss_weight: float = 0.0):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"MoE: top_k must be between 1 and the {experts} experts, "
                             f"got {top_k}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor must be > 0 (or None: dropless), got "
                             f"{capacity_factor}")
        self.router = nn.Linear(n_embd, experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(experts))
        self.top_k, self.capacity_factor, self.group_size = top_k, capacity_factor, group_size
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        self.aux_loss, self.stats = None, {}
        self.ep, self.local = None, range(experts)     # expert parallelism: shard_experts()

    def forward(self, x):                                     # (B, T, C)
        """Router -> top-k -> dispatch -> experts -> combine, in shapes fixed by the options.

        Each expert gets a (G*K, C) block of slots, so the host never reads the routing.
        Empty slots are zeros, computed and thrown away: the price of no host sync.
        """
        tokens = x.reshape(-1, x.shape[-1])                   # (N, C)
        routing = self.route(tokens)
        if self.capacity_factor is None:
            return self._forward_dropless(tokens, routing).view_as(x)
        E, C = len(self.experts), tokens.shape[1]
        K, slots = routing.capacity, routing.groups * routing.capacity           # G*K
        # Dispatch: each kept assignment's token into its slot, expert by expert.
        # Every dropped one writes the spare last row, cut off (whichever write wins).
        slot = routing.expert * slots + routing.group * K + routing.position       # (A,)
        row = torch.where(routing.keep, slot, E * slots)
        buffer = tokens.new_zeros(E * slots + 1, C).index_put((row,), tokens[routing.token])
        dispatched = buffer[: E * slots].view(E, slots, C)                         # (E, G*K, C)
        # Experts: each runs on its own slots.
        if self.ep is None:
            outputs = torch.stack([expert(chunk)
                                   for expert, chunk in zip(self.experts, dispatched)])
        else:
            outputs = self._exchange_static(dispatched)                             # (E, G*K, C)
        # Combine: each assignment reads its slot's output back, times its gate, into its token.
        # A dropped one reads row 0 and adds nothing: its gate times keep (0 or 1) is 0.
        # So its gate gets no gradient either.
        gate = (routing.gate * routing.keep).unsqueeze(1).to(outputs.dtype)        # (A, 1)
        read = torch.where(routing.keep, row, 0)
        weighted = outputs.view(E * slots, C)[read] * gate                         # (A, C)
        y = torch.zeros_like(tokens).index_add_(0, routing.token, weighted)        # (N, C)
        return y.view_as(x)

    def route(self, tokens: torch.Tensor) -> Routing:
        """Router -> top-k: each token's k experts and gates, and each assignment's slot.

        The matmul runs in the model's dtype (the router weight's).
        The softmax, gates and losses run in fp32, or fp64 when the model is fp64.
        bf16 would round every probability, and the z-loss's logsumexp.
        """
        N, E, k = tokens.shape[0], len(self.experts), self.top_k
        logits = self.router(tokens)                                      # (N, E)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        probs = logits.softmax(dim=-1)
        top_probs, top_experts = probs.topk(k, dim=-1)                    # (N, k)
        gates = top_probs / top_probs.sum(dim=-1, keepdim=True)           # renormalised over k
        # The assignments choice-major (GShard's priority order).
        expert = top_experts.t().reshape(-1)                              # (A,)
        token = torch.arange(N, device=tokens.device).repeat(k)           # (A,)
        gate = gates.t().reshape(-1)                                      # (A,)
        group_size = self.group_size or N
        if N % group_size:
            raise ValueError(f"MoE: {N} tokens do not split into routing groups of {group_size}")
        groups = N // group_size
        queue = (token // group_size) * E + expert                        # (A,) (group, expert)
        order, position, per_queue = _queue_positions(queue, groups * E)
        # Dropless keeps every assignment: a token's k experts differ, so a queue holds at most
        # group_size assignments, and K = group_size * k is more than enough.
        capacity = (expert_capacity(group_size, E, k, self.capacity_factor)
                    if self.capacity_factor is not None else group_size * k)
        keep = position < capacity                                        # (A,)
        per_expert = _count(expert, E, keep)                              # (E,) kept
        self._losses(logits, probs, per_queue.view(groups, E), per_expert, A=k * N)
        return Routing(token, expert, gate, token // group_size, position, keep, order,
                       per_expert, groups, capacity)

    def _losses(self, logits, probs, per_queue, per_expert, A):
        """Switch's load balancing and ST-MoE's z-loss, into aux_loss; the routing into stats.

        The balance is E * sum_e f_e P_e: 1 when balanced, at most E/k (every token picking the
        same k experts with all its probability).
        f_e is the share of a routing group's assignments routed to e (all k choices, no drop).
        GShard counts first choices only.
        P_e is the group's mean router probability of e.
        It is averaged over the groups.
        So when each rank routes its own groups, the mean of the ranks' losses is the loss of one
        process routing all of them (_demonstrate checks it).
        The z-loss, mean (logsumexp logits)^2, keeps the router's logits small.
        """
        groups, E = per_queue.shape                                       # (groups, E) counts
        share = per_queue.to(probs.dtype) / per_queue.sum(dim=1, keepdim=True)  # f: no gradient
        mean_probs = probs.view(groups, -1, E).mean(dim=1)                # P: (groups, E)
        balance = E * (share * mean_probs).sum(dim=1).mean()
        z = logits.logsumexp(dim=-1).pow(2).mean()
        self.aux_loss = self.aux_loss_weight * balance + self.z_loss_weight * z
        self.stats = {"per_expert": per_expert, "assignments": A, "balance_loss": balance.detach()}

    # ---- corner cases: dropless routing, generation -----------------------------------------

    def _forward_dropless(self, tokens, routing: Routing):
        """Dropless: every assignment runs, so the rows per expert follow the routing.

        Their count is read on the host to cut the rows: the layer's one host sync.
        A static shape would run every token through every expert.
        """
        # The assignments sorted by expert; any order within an expert would work.
        # The stable sort keeps the queue's priority order: a fixed order, fixed fp sums.
        by_expert = routing.order[torch.argsort(routing.expert[routing.order], stable=True)]
        token, gate = routing.token[by_expert], routing.gate[by_expert]   # (A,)
        inputs = tokens[token]                                            # (A, C)
        if self.ep is None:
            chunks = inputs.split(routing.per_expert.tolist())
            outputs = torch.cat([expert(chunk) for expert, chunk in zip(self.experts, chunks)])
        else:
            outputs = self._exchange_dropless(inputs, routing.per_expert)
        weighted = outputs * gate.unsqueeze(1).to(outputs.dtype)                # (A, C)
        return torch.zeros_like(tokens).index_add_(0, token, weighted)          # (N, C)

    @contextlib.contextmanager
    def generating(self):
        """Inside, this layer routes each forward's tokens as one group (model.GPT.generate).

        Routing groups are a training choice: a capacity and a balancing loss per group.
        Generating, a forward has its window's tokens, which need not divide into groups.
        """
        size, self.group_size = self.group_size, None
        try:
            yield
        finally:
            self.group_size = size

    # ---- expert parallelism: the tokens travel to their experts' ranks and back ---------------
    #
    #   rank 0: tokens -> route -> [for experts 0,1 | for experts 2,3]    all-to-all   rank 0 runs
    #   rank 1: tokens -> route -> [for experts 0,1 | for experts 2,3]    ---------->  experts 0,1
    #   on rank p's tokens for rank q's experts go to q; the outputs come back by the mirror
    #   all-to-all, and backward runs the same two exchanges the other way round.

    def shard_experts(self, ep: Comm):
        """Expert parallelism over the ep group's P ranks: rank r keeps experts r*E/P to
        (r+1)*E/P - 1 and drops the others.

        An nn.Identity keeps each dropped index, so parameters keep their names.
        experts.5.up.weight is on whichever rank holds expert 5.
        Every rank must hold the same model before (the same seed), as in tensor parallelism.
        The router stays replicated; each rank's router gradient comes from its own tokens.
        In training, data parallelism averages it over every dp x cp rank, the ep ranks among
        them (composition/parallelize.py's wrap_data).
        """
        E, P = len(self.experts), ep.world_size
        if E % P:
            raise ValueError(f"{E} experts do not split over --ep {P} ranks: "
                             f"use an --ep dividing {E}")
        self.ep, self.local = ep, range(ep.rank * E // P, (ep.rank + 1) * E // P)
        for e in range(E):
            if e not in self.local:
                self.experts[e] = nn.Identity()
        for e in self.local:
            # Sharded over ep, each rank its own experts: foundations/placements.py's record.
            # The global norm counts each rank's own.
            for p in self.experts[e].parameters():
                place(p, shard={"ep": None})                  # None: whole tensors, no split dim

    def _exchange_static(self, dispatched):
        """Capacity mode: the (E, G*K, C) buffer has a fixed shape (G routing groups, K slots).

        So both all-to-alls send equal blocks whatever the routing: no sizes to agree on.
        That assumes every rank routes the same N tokens (the same batch shape), so the same G.
        """
        E, slots, C = dispatched.shape
        P = self.ep.world_size
        received = all_to_all(dispatched.reshape(E * slots, C), self.ep)         # (E*G*K, C)
        # From each source rank, its slots for each of my experts: run expert by expert.
        mine = received.view(P, len(self.local), slots, C).transpose(0, 1)  # (E/P, P, G*K, C)
        outputs = torch.stack([self.experts[e](chunk.reshape(P * slots, C))
                               for e, chunk in zip(self.local, mine)])      # (E/P, P*G*K, C)
        back = outputs.view(len(self.local), P, slots, C).transpose(0, 1)   # (P, E/P, G*K, C)
        return all_to_all(back.reshape(E * slots, C), self.ep).view(E, slots, C)

    def _exchange_dropless(self, inputs, counts):
        """Dropless: each rank sends exactly its kept tokens, so the block sizes vary.

        The ranks first swap their counts per expert (E numbers) to size the receiving buffers.
        """
        P, L = self.ep.world_size, len(self.local)
        their_counts = torch.empty_like(counts)                              # counts: (E,)
        self.ep.all_to_all(their_counts, counts)                             # (P*L,) for my experts
        # Both sizes in one read (the layer's one host sync).
        # NCCL's all-to-all takes its splits as host integers.
        # And the receiving buffer's size must be known to allocate it.
        sizes = torch.cat([their_counts, counts.view(P, L).sum(dim=1)]).tolist()
        incoming = [sizes[p * L: (p + 1) * L] for p in range(P)]             # [source][expert]
        send_splits = sizes[P * L:]
        receive_splits = [sum(row) for row in incoming]
        received = all_to_all(inputs, self.ep, receive_splits, send_splits)  # [source][expert]
        # Regroup by expert: expert l's rows from source 0, from source 1, ...; run; put back.
        blocks = received.split([n for row in incoming for n in row])       # P*L blocks
        by_expert = [torch.cat([blocks[p * L + l] for p in range(P)]) for l in range(L)]
        outputs = [self.experts[e](chunk) for e, chunk in zip(self.local, by_expert)]
        pieces = [o.split([incoming[p][l] for p in range(P)]) for l, o in enumerate(outputs)]
        back = torch.cat([pieces[l][p] for p in range(P) for l in range(L)])  # [source][expert]
        return all_to_all(back, self.ep, send_splits, receive_splits)       # (kept, C)


def feed_forward(cfg) -> nn.Module:
    """A block's feed-forward for model.py's GPT (build_model(name, feed_forward=feed_forward)):
    with cfg.experts, an MoE of that many of model.py's MLPs behind a router, as cfg's fields
    say; without, the dense MLP itself."""
    if not cfg.experts:
        return MLP(cfg)
    return MoE(cfg.n_embd, lambda: MLP(cfg), cfg.experts, cfg.top_k, cfg.capacity_factor,
               cfg.routing_group, cfg.aux_loss_weight, cfg.z_loss_weight)


def _count(index: torch.Tensor, bins: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """(bins,) how many of index's entries (counted where weight is True) fall in each bin:
    torch.bincount's answer without its host sync (on CUDA it reads index's max to size the
    output)."""
    ones = torch.ones_like(index) if weight is None else weight.to(index.dtype)
    return torch.zeros(bins, dtype=index.dtype, device=index.device).index_add_(0, index, ones)


def _queue_positions(queue: torch.Tensor, queues: int):
    """Each assignment's position in its queue, how many of its queue come before it.

    queue (A,) holds each assignment's queue, in priority order.
    The position is its place in the stable sort by queue minus its queue's start.
    E.g. queues [1, 0, 1, 1]: order [1, 0, 2, 3], starts [0, 1].
    Assignment 1 is 0 - 0 = 0th of queue 0.
    Assignments 0, 2, 3 are 1 - 1, 2 - 1, 3 - 1 = 0th, 1st, 2nd of queue 1.
    Shapes fixed by A alone: nothing here waits for the device.
    Returns the order (A,), the positions (A,) and the count per queue (queues,).
    """
    order = torch.argsort(queue, stable=True)                         # by queue, then priority
    per_queue = _count(queue, queues)                                 # (queues,)
    starts = per_queue.cumsum(0) - per_queue
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device) - starts[queue[order]]
    return order, position, per_queue


def expert_capacity(group_size: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """K, the assignments one expert takes from a routing group.

    K = ceil(capacity_factor * k * S / E), S the group's tokens.
    """
    return math.ceil(capacity_factor * top_k * group_size / experts)


def layer_exchange_bytes(tokens: int, channels: int, experts: int, top_k: int,
                         capacity_factor: float | None, group_size: int | None, ep: int,
                         element_size: int) -> int:
    """Bytes a rank sends per forward and backward of one MoE layer on `tokens` tokens.

    Its experts are split over ep ranks.
    It runs four all-to-alls: dispatch and combine, and their mirrors in backward.
    Each sends (ep-1)/ep of the rank's dispatch rows of C channels.
    Capacity mode sends the static buffer's E x G x K rows, whatever the routing.
    Dropless (capacity_factor None) sends the k x tokens assignments.
    Of those, (ep-1)/ep leave when the routing is balanced: an estimate (napkin/memory.py's).
    """
    group = group_size or tokens
    rows = (tokens // group * experts * expert_capacity(group, experts, top_k, capacity_factor)
            if capacity_factor is not None else top_k * tokens)
    return 4 * (ep - 1) * rows * channels * element_size // ep


class _AllToAll(torch.autograd.Function):
    """all-to-all whose backward is the mirror all-to-all: the gradient of each received row goes
    back to the rank that sent it."""

    @staticmethod
    def forward(ctx, x, comm, receive_splits, send_splits):
        ctx.comm, ctx.splits = comm, (receive_splits, send_splits)
        rows = x.shape[0] if receive_splits is None else sum(receive_splits)
        out = x.new_empty(rows, *x.shape[1:])
        comm.all_to_all(out, x.contiguous(), receive_splits, send_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        receive_splits, send_splits = ctx.splits
        out = grad.new_empty(sum(send_splits) if send_splits else grad.shape[0], *grad.shape[1:])
        ctx.comm.all_to_all(out, grad.contiguous(), send_splits, receive_splits)
        return out, None, None, None


def all_to_all(x, comm: Comm, receive_splits=None, send_splits=None):
    """Rows of x to the ranks of comm (splits: rows per rank; None: equal), differentiable. The
    receive splits first, as Comm.all_to_all takes output_splits before input_splits."""
    return _AllToAll.apply(x, comm, receive_splits, send_splits)


def routing_summary(model: nn.Module) -> dict:
    """What the last forward's routing did, over every MoE layer of model: assignments per expert
    (min, mean, max over experts and layers), the share of assignments dropped, and the mean
    load-balancing loss (1 when balanced). One host read, for the log."""
    layers = [m.stats for m in model.modules() if isinstance(m, MoE) and m.stats]
    per_expert = torch.stack([s["per_expert"] for s in layers]).float()      # (layers, E)
    balance = torch.stack([s["balance_loss"] for s in layers]).mean()
    assignments = torch.tensor([s["assignments"] for s in layers], device=per_expert.device)
    kept = per_expert.sum(dim=1) / assignments
    low, mean, high, dropped, balance = torch.stack(
        [per_expert.min(), per_expert.mean(), per_expert.max(), 1 - kept.mean(), balance]).tolist()
    return {"tokens_per_expert": (low, mean, high), "dropped": dropped, "balance_loss": balance}


# ---- run alone: the experts split over the ranks against the same layer whole on one process ---

def _demonstrate(ep: Comm, capacity_factor: float | None) -> float:
    """One MoE layer (E = 4 experts of C = 16 channels, top-2) in fp64, E/P experts a rank, each
    routing its own S = 64 tokens, against the layer whole routing all P*S tokens as P groups. Loss:
    a fixed readout of the outputs plus the routers' (the whole's: the ranks' mean, as data
    parallelism averages). Returns the largest difference (outputs, input, router, expert grads)."""
    torch.manual_seed(0)                                              # the same layer everywhere
    C, E, S, P, r = 16, 4, 64, ep.world_size, ep.rank
    whole = MoE(C, lambda: nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C)),
                experts=E, top_k=2, capacity_factor=capacity_factor, group_size=S).double()
    split = copy.deepcopy(whole)
    split.shard_experts(ep)                                           # experts r*E/P .. on rank r
    x = torch.randn(P, S, C, dtype=torch.float64, requires_grad=True)  # every rank's tokens
    readout = torch.randn(P, S, C, dtype=torch.float64)
    expected = whole(x)                                               # one process, all P groups
    ((expected * readout).mean() + whole.aux_loss).backward()
    mine = x[r].detach().clone().requires_grad_()                     # (S, C): this rank's
    y = split(mine)
    ((y * readout[r]).mean() + split.aux_loss).backward()
    router = split.router.weight.grad.clone()
    ep.all_reduce(router)                                 # replicated: the ranks' parts add up
    # An expert's gradient sums every rank's tokens (the all-to-all brought them) over P ranks'
    # losses, whose mean is the whole's: / P, as the input's and the router's.
    differences = [(y - expected[r]).abs().max(), (mine.grad / P - x.grad[r]).abs().max(),
                   (router / P - whole.router.weight.grad).abs().max()]
    differences += [(p.grad / P - q.grad).abs().max() for e in split.local for p, q in
                    zip(split.experts[e].parameters(), whole.experts[e].parameters())]
    worst = torch.stack(differences).max()
    ep.all_reduce(worst, op="max")
    if r == 0:
        load = whole.stats["per_expert"].tolist()                     # kept, all P groups
        drops = "dropless" if capacity_factor is None else (
            f"capacity {expert_capacity(S, E, 2, capacity_factor)} a group, "
            f"{100 * (1 - sum(load) / (2 * P * S)):.0f}% dropped")
        print(f"{P} ranks x {S} tokens, top-2 of {E} experts ({E // P} a rank), {drops}: "
              f"assignments per expert {load}, balance loss "
              f"{whole.stats['balance_loss']:.3f} (1: balanced)")
        print(f"  max |difference| from one process (outputs, input, router and expert gradients): "
              f"{worst:.1e} (bound 1e-12: fp64, the same sums in another order)")
    return worst.item()


if __name__ == "__main__":
    start_alone(torchrun=True, worlds=(1, 2, 4))                # E = 4 experts over the ranks
    dist.init_process_group("gloo")
    ep = Comm()                                                       # every rank: the ep group
    worst = max(_demonstrate(ep, capacity) for capacity in (1.0, None))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0 if worst <= 1e-12 else 1)     # skip finalizing, as world.exit_distributed
