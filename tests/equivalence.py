"""What an "equals one process" test needs beyond tests/multiprocess.py: a bound on fp32 differences
that Adam amplifies, element by element, and an fp64 optimizer, where the same claim is exact.

Two runs whose gradients differ by rounding alone (the ranks' sums in another order; how they
round depends on the CPU's vector width, ATEN_CPU_CAPABILITY) end apart after a few AdamW steps by
what Adam makes of that rounding. In fp64 that stays near 1e-12 (Fp64AdamW); in fp32 it is
bounded by its cause, Adam's denominator (assert_adam_close), not by what one machine measured.
"""
import math

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mixed_precision import DynamicLossScaler
from model import build_model
from moe import feed_forward
from multiprocess import train_logged
from foundations.placements import norm_weight

# ---- Adam's amplification: how far an fp32 difference may grow, element by element -------------
#
# AdamW moves an element by lr * m_hat / (sqrt(v_hat) + eps): a gradient that differs by dg (the
# ranks' sums in another order: rounding of the terms summed, which depends on the CPU's vector
# width, ATEN_CPU_CAPABILITY) moves it by about lr * dg / d, d = sqrt(v_hat) + eps its
# denominator. Where d stayed at or above ADAM_AMPLIFIED (100 x AdamW's eps) a test's stated
# atol holds; where it fell towards eps (an element whose gradients nearly cancel) the same dg
# moves it up to 100 x more. So each element is bounded by atol x max(1, ADAM_AMPLIFIED / d), d
# the smallest denominator it was divided by in the one-process run (AdamDenominators), and the
# mean difference over every element (assert_mean_close) still catches a bug that moves many.
ADAM_AMPLIFIED = 1e-6


class AdamDenominators:
    """The smallest denominator sqrt(v_hat) + eps each element's AdamW update was divided by while
    its first moment was nonzero (inf where it never was), one tensor per parameter named in
    `names` (the optimizer's order): note() after each step of `optimizer` (a torch AdamW, or a
    MixedPrecisionOptimizer's inner one; of() registers it as the optimizer's step hook)."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: list):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        assert len(names) == len(params), (len(names), len(params))
        self.smallest = {name: torch.full_like(p, math.inf) for name, p in zip(names, params)}

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, names: list) -> "AdamDenominators":
        noted = cls(optimizer, names)
        optimizer.register_step_post_hook(noted.note)
        return noted

    def note(self, optimizer, args=(), kwargs=None):
        params = [(group, p) for group in optimizer.param_groups for p in group["params"]]
        for name, (group, p) in zip(self.smallest, params):
            state = optimizer.state.get(p)
            if not state:                                        # never stepped: no update yet
                continue
            v_hat = state["exp_avg_sq"] / (1 - group["betas"][1] ** float(state["step"]))
            denominator = torch.where(state["exp_avg"] != 0, v_hat.sqrt() + group["eps"], math.inf)
            self.smallest[name] = torch.minimum(self.smallest[name], denominator)


def assert_adam_close(actual: dict, expected: dict, denominators: AdamDenominators, atol: float,
                      what: str = ""):
    """Each element of `actual` within atol x max(1, ADAM_AMPLIFIED / d) of `expected`, the
    one-process run's weights, d its smallest Adam denominator there; a failure names the
    tensor, the element, the difference, its bound and its d."""
    assert actual.keys() == expected.keys(), f"{what}: different names {set(actual) ^ set(expected)}"
    for name, want in expected.items():
        d = denominators.smallest[name].to(want.device)
        bound = (atol * (ADAM_AMPLIFIED / d).clamp(min=1)).flatten()
        difference = (actual[name].double() - want.double()).abs().flatten()
        worst = (difference / bound).argmax()
        assert difference[worst] <= bound[worst], (
            f"{what} {name}: {difference[worst]:.3g} > {bound[worst]:.3g} at element {worst.item()} "
            f"(Adam's denominator there {d.flatten()[worst]:.3g})")


def train_noting_adam(argv, model: str):
    """train_logged(argv) on this rank, and the AdamDenominators of the run's AdamW (`model` names
    the preset, for the parameters' names). Only the model's AdamW is noted: on a clone with no
    .cache/, machines.this times an AdamW step of its own (one 4M-element parameter) first."""
    names, shapes = zip(*[(n, p.shape) for n, p in build_model(model, feed_forward=feed_forward).named_parameters()])
    noted = {}

    def note_the_model(optimizer, args, kwargs):
        if isinstance(optimizer, torch.optim.AdamW) and \
                tuple(p.shape for g in optimizer.param_groups for p in g["params"]) == shapes:
            if id(optimizer) not in noted:
                noted[id(optimizer)] = AdamDenominators(optimizer, names)
            noted[id(optimizer)].note(optimizer)
    hook = register_optimizer_step_post_hook(note_the_model)
    try:
        history, out = train_logged(argv)
    finally:
        hook.remove()
    assert len(noted) == 1, f"{len(noted)} AdamWs over the model's parameters stepped"
    return history, out, next(iter(noted.values()))


# ---- fp64: the claim where it can be exact -------------------------------------------------------

class Fp64AdamW:
    """For fp64 runs (MixedPrecisionOptimizer takes fp32, bf16 and fp16): torch's AdamW on the
    parameters themselves, clipped by the global norm summed in fp64 over the groups of `split`
    ({mesh dim: group}, as mesh_optimizer.on_mesh; each value's squares counted once,
    placements.norm_weight). The part of MixedPrecisionOptimizer's interface the tests' loops use."""

    scaler, last_step_skipped = DynamicLossScaler(enabled=False), False

    def __init__(self, params, split: dict | None = None, **adamw):
        self.masters, self.split = list(params), {k: g for k, g in (split or {}).items() if g}
        self.optimizer = torch.optim.AdamW(self.masters, **adamw)
        self.last_grad_norm = None

    def scale_loss(self, loss):
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        squares = sum(p.grad.pow(2).sum() * norm_weight(p, self.split) for p in self.masters).reshape(1)
        for group in self.split.values():
            group.all_reduce(squares)
        norm = squares.sqrt()[0]
        self.last_grad_norm = norm.item()
        torch.nn.utils.clip_grads_with_norm_(self.masters, max_norm, norm)
        return norm

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()
