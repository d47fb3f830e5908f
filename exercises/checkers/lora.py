"""Checks exercises/lora.py: the LoRA linear's update, forward, gradients, dropout, merge and
unmerge, on one process, against h = x W0^T + b + (alpha/r) (x A^T) B^T written with plain
torch matmuls (and torch's own F.dropout for the mask).

One layer, k = 6 in, d = 5 out, rank r = 3, alpha = 12 (a scale of 4, so a forgotten scale
shows), A and B set to seeded values (B nonzero, so the adapter's term shows), fp64 throughout.
Bounds: 1e-12 where the same products are summed in another grouping (x (B A)^T against
(x A^T) B^T, W0 + s B A - s B A against W0), rounding alone in fp64 on values of order 10;
exact (0) where the claim is "unchanged" (a second merge, a frozen weight's missing gradient).
Last, a bf16 layer's merge: W0 keeps its tensor and its dtype, against W0 + s B A in fp64 within
bf16's rounding of the update and of the sum.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

WORLD = 1
PARTS = ["LoRALinear.delta", "LoRALinear.forward", "LoRALinear.merge", "LoRALinear.unmerge"]
K, D, R, ALPHA, P = 6, 5, 3, 12.0, 0.5
BOUND, WHY = 1e-12, "fp64, the same products grouped another way"


def seeded(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def build(exercise, dropout: float = 0.0, dtype=torch.float64):
    """The student's layer over a seeded base (fp64 unless dtype), its A and B set to seeded
    values; and the plain tensors W0, b, A, B (in dtype) one process computes with."""
    base = nn.Linear(K, D, dtype=dtype)
    with torch.no_grad():
        base.weight.copy_(seeded(D, K, seed=1))
        base.bias.copy_(seeded(D, seed=2))
    W0, b = base.weight.detach().clone(), base.bias.detach().clone()
    layer = exercise.LoRALinear(base, rank=R, alpha=ALPHA, dropout=dropout)
    A, B = seeded(R, K, seed=3).to(dtype), seeded(D, R, seed=4).to(dtype)
    with torch.no_grad():
        layer.lora_A.copy_(A)
        layer.lora_B.copy_(B)
    return layer, W0, b, A, B


def plain(x, W0, b, A, B, adapter_input=None):
    """One process: x W0^T + b + (alpha/r) (x A^T) B^T, the adapter on adapter_input if given."""
    u = x if adapter_input is None else adapter_input
    return x @ W0.T + b + ALPHA / R * (u @ A.T) @ B.T


def check(exercise, grader):
    scale = ALPHA / R
    x = seeded(4, 2, K, seed=5)                                     # (batch, T, k)

    with grader.step("the update (alpha/r) B A", "LoRA's update is the product of the two "
                     "factors, B (d, r) times A (r, k), scaled by alpha / r"):
        layer, W0, b, A, B = build(exercise)
        grader.close("delta()", layer.delta(), scale * B @ A, BOUND, WHY)

    with grader.step("forward: W0 x + (alpha/r) B A x", "LoRA's forward adds (alpha/r) B (A x) "
                     "to the frozen layer's W0 x + b; self.linear(x, M) is x M^T (F.linear), "
                     "so x goes through A (k -> r), then B (r -> d)"):
        layer, W0, b, A, B = build(exercise)
        grader.close("h", layer(x), plain(x, W0, b, A, B), BOUND, WHY)

    with grader.step("gradients only on A and B", "LoRA trains only the factors: the frozen W0 "
                     "and b get no gradient, A and B get the gradient of the term they form"):
        layer, W0, b, A, B = build(exercise)
        A.requires_grad_()
        B.requires_grad_()
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        weights = seeded(4, 2, D, seed=6)                      # the loss: a weighted sum of h
        (layer(mine) * weights).sum().backward()
        (plain(theirs, W0, b, A, B) * weights).sum().backward()
        for name in ("weight", "bias"):
            if getattr(layer, name).grad is not None:
                grader.fail(f"the frozen {name} got a gradient: only lora_A and lora_B train")
        grader.close("lora_A.grad", layer.lora_A.grad, A.grad, BOUND, WHY)
        grader.close("lora_B.grad", layer.lora_B.grad, B.grad, BOUND, WHY)
        grader.close("x.grad", mine.grad, theirs.grad, BOUND, WHY)

    with grader.step("dropout on the adapter's input, in training", "LoRA's dropout drops "
                     "entries of the adapter's input x (once, before A); W0 x sees x whole"):
        layer, W0, b, A, B = build(exercise, dropout=P)
        layer.train()
        torch.manual_seed(7)
        got = layer(x)
        torch.manual_seed(7)                                   # the same mask, drawn by torch
        dropped = F.dropout(x, P, training=True)
        grader.close("h", got, plain(x, W0, b, A, B, adapter_input=dropped), BOUND,
                     WHY + ", with the mask F.dropout draws from the same seed")

    with grader.step("no dropout in evaluation", "dropout only while training: after .eval() "
                     "the adapter sees x whole (F.dropout's training argument)"):
        layer, W0, b, A, B = build(exercise, dropout=P)
        layer.eval()
        grader.close("h", layer(x), plain(x, W0, b, A, B), BOUND, WHY)

    with grader.step("merge, and merge again: W0 + (alpha/r) B A", "merging adds the update "
                     "into W0 in place, once: a second merge leaves the weight as it is"):
        layer, W0, b, A, B = build(exercise)
        layer.merge()
        merged = W0 + scale * B @ A
        grader.close("weight after merge()", layer.weight, merged, BOUND, WHY)
        layer.merge()
        grader.close("weight after a second merge()", layer.weight, merged, BOUND, WHY)

    with grader.step("a merged layer's forward", "a merged W0 already holds (alpha/r) B A: the "
                     "forward is then the frozen layer's alone, one matmul"):
        layer, W0, b, A, B = build(exercise)
        layer.merge()
        grader.close("h of the merged layer", layer(x), plain(x, W0, b, A, B), BOUND, WHY)

    with grader.step("unmerge, twice or unmerged: W0 back", "unmerging subtracts the update "
                     "that merge added, and only from a merged layer; the adapted forward then "
                     "comes back"):
        layer, W0, b, A, B = build(exercise)
        layer.unmerge()
        grader.close("weight after unmerge() of an unmerged layer", layer.weight, W0, 0.0,
                     "nothing was merged: W0 unchanged")
        layer.merge()
        layer.unmerge()
        grader.close("weight after merge(), unmerge()", layer.weight, W0, BOUND,
                     "fp64, W0 + s B A - s B A rounded twice")
        layer.unmerge()
        grader.close("weight after merge(), unmerge(), unmerge()", layer.weight, W0, BOUND,
                     "fp64, W0 + s B A - s B A rounded twice")
        grader.close("h after merge(), unmerge()", layer(x), plain(x, W0, b, A, B), BOUND, WHY)

    with grader.step("merge in the weight's dtype (bf16)", "merging adds the update into W0 in "
                     "place: the frozen layer's own tensor, in its own 16-bit dtype (the model "
                     "holds that tensor; a wider copy would take 2 or 4 times its bytes)"):
        layer, W0, b, A, B = build(exercise, dtype=torch.bfloat16)
        weight = layer.weight
        layer.merge()
        grader.same("the weight after merge() is the tensor it was (merged in place)",
                    layer.weight is weight, True)
        grader.same("the weight's dtype after merge()", layer.weight.dtype, torch.bfloat16)
        update = scale * B.double() @ A.double()
        grader.close("weight after merge()", layer.weight, W0.double() + update,
                     2**-8 * update.abs().max().item(), "bf16 rounds the update, then the sum: "
                     "2**-8 of each", rtol=2**-8)
