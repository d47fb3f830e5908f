"""Mixture of experts: each token runs through k of E expert MLPs, picked by a learned router.

A block's MLP becomes E copies (experts) and a linear router; each token goes to its top-k
experts and their outputs are summed, weighted by the router's gate values. Parameters grow
E-fold, the compute per token only k-fold (Shazeer et al. 2017). GShard (Lepikhin et al. 2020,
section 2.2) routes to 2 experts with a capacity per expert, Switch (Fedus et al. 2021, section
2.2) to 1, with the load-balancing loss E * sum_e f_e P_e; ST-MoE (Zoph et al. 2022, section 3)
adds the router z-loss. Left out: expert parallelism's all-to-all (next), shared experts,
token-choice alternatives (expert choice), jitter noise. Test: python -m pytest tests/test_moe.py

Shapes: S tokens in a routing group (B*T by default), C channels, E experts, k choices per token,
A = k*S assignments (token, choice), K = ceil(capacity_factor * k * S / E) slots per expert.
"""
import math
from typing import Callable

import torch
import torch.nn as nn


class MoE(nn.Module):
    """A drop-in for a block's MLP: E experts behind a top-k router.

    n_embd: C; make_expert: builds one expert, a module (.., C) -> (.., C) (model.py passes
    its MLP, so that an MoE of one expert is exactly the dense block).
    top_k: experts per token (1: Switch, 2: GShard, any k <= E); the k gate values are the
    router's softmax probabilities of the chosen experts, renormalised to sum to 1 over them.
    capacity_factor: each expert takes at most K = ceil(capacity_factor * k * S / E) of a routing
    group's assignments; the rest are dropped (a token whose every choice is dropped adds
    nothing: the block's residual carries it through). None: dropless, every assignment runs.
    group_size: tokens per routing group (None: every token of the forward, one group).
    aux_loss_weight, z_loss_weight: the weights of the load-balancing and router z-losses; after
    each forward `aux_loss` holds their weighted sum, for the model to add to its loss, and
    `stats` what the routing did, as tensors (no host read in forward): routing_summary() reads it.
    """

    def __init__(self, n_embd: int, make_expert: Callable[[], nn.Module], experts: int = 8,
                 top_k: int = 2, capacity_factor: float | None = 1.25, group_size: int | None = None,
                 aux_loss_weight: float = 0.01, z_loss_weight: float = 0.0):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"MoE: top_k must be between 1 and the {experts} experts, got {top_k}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor must be > 0 (or None: dropless), got "
                             f"{capacity_factor}")
        self.router = nn.Linear(n_embd, experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(experts))
        self.top_k, self.capacity_factor, self.group_size = top_k, capacity_factor, group_size
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        self.aux_loss, self.stats = None, {}

    def forward(self, x):                                     # (B, T, C)
        tokens = x.reshape(-1, x.shape[-1])                   # (S, C)
        route = self.route(tokens)
        # Dispatch: the kept assignments' tokens, expert by expert (route sorted them so), each
        # expert's run through it, and combine: every output back to its token, times its gate.
        inputs = tokens[route["token"]].split(route["per_expert"])          # E x (n_e, C)
        outputs = torch.cat([expert(chunk) for expert, chunk in zip(self.experts, inputs)])
        weighted = outputs * route["gate"].unsqueeze(1).to(outputs.dtype)  # (kept, C)
        y = torch.zeros_like(tokens).index_add_(0, route["token"], weighted)  # (S, C)
        return y.view_as(x)

    def route(self, tokens: torch.Tensor) -> dict:
        """Which expert each token goes to, in which slot, with which gate; the losses.

        Returns the kept assignments sorted by expert (then by priority): "token" (kept,)
        indices into tokens, "gate" (kept,) fp32, "per_expert" counts (E numbers), and
        "expert" and "position" (kept,) for a dispatch buffer (E, K, C) of static shape.
        """
        S, E, k = tokens.shape[0], len(self.experts), self.top_k
        logits = self.router(tokens).float()                              # (S, E), fp32 softmax
        probs = logits.softmax(dim=-1)
        top_probs, top_experts = probs.topk(k, dim=-1)                    # (S, k)
        gates = top_probs / top_probs.sum(dim=-1, keepdim=True)           # renormalised over k
        # Assignments choice-major: every token's first choice comes before any token's second
        # choice, so under capacity a second choice is dropped before a first (GShard's order).
        expert = top_experts.t().reshape(-1)                              # (A,)
        token = torch.arange(S, device=tokens.device).repeat(k)           # (A,)
        gate = gates.t().reshape(-1)                                      # (A,)
        group_size = self.group_size or S
        if S % group_size:
            raise ValueError(f"MoE: {S} tokens do not split into routing groups of {group_size}")
        groups = S // group_size
        # One queue per (group, expert); an assignment's position in its queue is how many of
        # that queue's assignments come before it in priority order (a stable sort keeps it).
        queue = (token // group_size) * E + expert                        # (A,)
        order = torch.argsort(queue, stable=True)                         # by queue, then priority
        per_queue = torch.bincount(queue, minlength=groups * E)           # (groups*E,)
        starts = per_queue.cumsum(0) - per_queue
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=order.device) - starts[queue[order]]
        capacity = (math.ceil(self.capacity_factor * k * group_size / E)
                    if self.capacity_factor is not None else group_size * k)   # K
        kept = order[position[order] < capacity]                          # sorted by queue
        # Sorted by expert across groups for the dispatch (a stable sort: priority order stays).
        kept = kept[torch.argsort(expert[kept], stable=True)]
        per_expert = torch.bincount(expert[kept], minlength=E)
        self._losses(logits, probs, per_queue.view(groups, E), per_expert, A=k * S)
        # The split sizes are read on the host: the step's one sync per layer.
        return {"token": token[kept], "gate": gate[kept], "expert": expert[kept],
                "position": position[kept], "per_expert": per_expert.tolist(), "capacity": capacity}

    def _losses(self, logits, probs, per_queue, per_expert, A):
        """Switch's load balancing, E * sum_e f_e P_e with f_e the share of a routing group's
        assignments routed to e (before any drop) and P_e its mean router probability of e:
        1 when balanced, E when everything goes to one expert; averaged over the groups, so
        that ranks routing their own tokens average to one process routing the same groups.
        The z-loss, mean (logsumexp logits)^2, keeps the router's logits small."""
        groups, E = per_queue.shape                                       # (groups, E) counts
        share = per_queue.float() / per_queue.sum(dim=1, keepdim=True)    # f, no gradient
        mean_probs = probs.view(groups, -1, E).mean(dim=1)                # P: (groups, E)
        balance = E * (share * mean_probs).sum(dim=1).mean()
        z = logits.logsumexp(dim=-1).pow(2).mean()
        self.aux_loss = self.aux_loss_weight * balance + self.z_loss_weight * z
        self.stats = {"per_expert": per_expert, "assignments": A, "balance_loss": balance.detach()}


def routing_summary(model: nn.Module) -> dict:
    """What the last forward's routing did, over every MoE layer of model: assignments per expert
    (min, mean, max over experts and layers), the share of assignments dropped, and the mean
    load-balancing loss (1 when balanced). One host read, for the log."""
    layers = [m.stats for m in model.modules() if isinstance(m, MoE) and m.stats]
    per_expert = torch.stack([s["per_expert"] for s in layers]).float()      # (layers, E)
    balance = torch.stack([s["balance_loss"] for s in layers]).mean()
    kept = per_expert.sum(dim=1) / torch.tensor([s["assignments"] for s in layers], device=per_expert.device)
    low, mean, high, dropped, balance = torch.stack(
        [per_expert.min(), per_expert.mean(), per_expert.max(), 1 - kept.mean(), balance]).tolist()
    return {"tokens_per_expert": (low, mean, high), "dropped": dropped, "balance_loss": balance}
