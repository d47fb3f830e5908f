"""Exercise: top-k routing with a capacity, and the tokens' trip to their experts' ranks by
all-to-all (the solution: moe.py).

- MoE.route: tokens (N, C), the layer's input flattened to rows. The router's logits for each
  token, a softmax over the E experts, the k largest probabilities (top-k) renormalised to sum
  to 1: the gates. Lay the A = k*N assignments (token, choice) out choice-major, every token's
  first choice before any second one, so that under capacity a second choice drops first. Each
  assignment queues at (its token's routing group, its expert); its position is how many of that
  queue come before it; it is kept when the position is under the capacity
  K = ceil(capacity_factor * k * S / E) (expert_capacity, given).
- _queue_positions: those positions, without a Python loop: a stable sort by queue, and each
  queue's start.
- _AllToAll, all_to_all: rank r sends its i-th block of rows to rank i and receives rank i's
  r-th block; backward sends each received row's gradient back where the row came from.
- MoE._exchange_static: the (E, G*K, C) slots go to the ranks holding their experts, each rank
  runs its E/P experts on every rank's slots for them, and the outputs come back the same way.
The rest (the dispatch into slots, the combine, the losses, shard_experts) is the concept's.

Given (moe.py; the constructor sets the attributes):
- self.router, nn.Linear(C, E, bias=False); self.experts, an nn.ModuleList: E is
  len(self.experts); self.top_k (k); self.capacity_factor (None: dropless, nothing dropped);
  self.group_size (S; None: one group of all N tokens).
- self.ep: the expert-parallel Comm, set by shard_experts: P is self.ep.world_size, this rank
  self.ep.rank; self.ep.all_to_all(output, input, output_splits=None, input_splits=None)
  fills output in place (splits: rows per rank, host ints; None: equal blocks). self.local: the
  range of the expert indices this rank runs (E/P of them, in order). self.experts keeps its E
  entries after shard_experts, indexed by the global expert index: self.experts[e] for e in
  self.local is an expert, the others are nn.Identity.
- expert_capacity(group_size, experts, top_k, capacity_factor) -> K, an int.
  Dropless has no factor: a token's k experts are distinct, so one (group, expert) queue holds at
  most S assignments, and K = group_size * k (more than enough) keeps every one.
- _count(index, bins, weight=None) -> (bins,): how many entries of index fall in each bin,
  counting only where weight (a bool tensor) is True.
- self._losses(logits, probs, per_queue, per_expert, A): logits and probs (N, E), per_queue
  (G, E) assignments per queue before capacity, per_expert (E,) kept; sets self.aux_loss and
  self.stats, returns None.
- Routing(token, expert, gate, group, position, keep, order, per_expert, groups, capacity), in
  that order: (A,) tensors token, expert, gate (the wide dtype), group, position, keep (bool),
  order (from _queue_positions); per_expert (E,); groups (G) and capacity (K), ints.
Check: python -m exercises check moe (on 2 ranks, 2 experts each).

Shapes: N tokens, S tokens per routing group, G = N/S groups, C channels, E experts, k choices
per token, A = k*N assignments, K slots per expert and group, P ranks, E/P experts per rank.
"""
import torch

import moe
from moe import Routing, _count, expert_capacity
from foundations.comm import Comm


class MoE(moe.MoE):
    """The concept's MoE (forward, the losses, shard_experts), routing and exchanging here."""

    def route(self, tokens: torch.Tensor) -> Routing:
        """Router -> top-k: each token's k experts and gates, and each assignment's slot.

        The matmul runs in the model's dtype (the router weight's).
        The softmax, gates and losses run in fp32, or fp64 when the model is fp64.
        bf16 would round every probability, and the z-loss's logsumexp.
        """
        # TODO: the router's logits, promoted to at least fp32; the softmax, top-k and gates.
        # Lay the assignments out choice-major ((N, k) -> (A,): which layout puts every first
        # choice first?). Routing groups of S tokens (a ValueError if N does not split); number
        # the (group, expert) queues 0 .. G*E-1 and find each assignment's position; the
        # capacity (dropless: group_size * k); what is kept, and the kept count per expert.
        # Then self._losses(..., A=k * N) and the Routing.
        raise NotImplementedError

    def _exchange_static(self, dispatched):
        """Capacity mode: the (E, G*K, C) buffer has a fixed shape (G routing groups, K slots).

        So both all-to-alls send equal blocks whatever the routing: no sizes to agree on.
        That assumes every rank routes the same N tokens (the same batch shape), so the same G.
        """
        # TODO: all_to_all the (E*G*K, C) rows over self.ep (equal blocks: rank q gets the
        # slots of its experts). In what order do the rows arrive? Run each of self.local's
        # experts on its slots from every source at once; the outputs must go home in the order
        # they came; return them as (E, G*K, C).
        raise NotImplementedError


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
    # TODO: sort by queue, keeping the priority order inside each queue. Where in that order
    # does each queue start, given how many each queue holds? Each position goes back to its
    # assignment's own index.
    raise NotImplementedError


class _AllToAll(torch.autograd.Function):
    """all-to-all whose backward is the mirror all-to-all: the gradient of each received row goes
    back to the rank that sent it."""

    @staticmethod
    def forward(ctx, x, comm, receive_splits, send_splits):
        # TODO: keep comm and the splits on ctx; an output of sum(receive_splits) rows (x's
        # when the splits are None: equal blocks); comm.all_to_all(out, x contiguous, ...),
        # which takes the output's splits first; return it.
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        # TODO: the mirror: the gradient goes back with the splits' roles exchanged, into a
        # tensor of x's rows; return it and None for comm and the two splits.
        raise NotImplementedError


def all_to_all(x, comm: Comm, receive_splits=None, send_splits=None):
    """Rows of x to the ranks of comm (splits: rows per rank; None: equal), differentiable. The
    receive splits first, as Comm.all_to_all takes output_splits before input_splits."""
    # TODO: _AllToAll's apply.
    raise NotImplementedError
