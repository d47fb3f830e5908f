"""Checks exercises/checkpointing.py: a block with dropout run through the student's
CheckpointFunction, against the same block run by plain autograd in one process (the same seed
before each, so the same dropout masks): the same output, only the inputs kept for backward,
the same gradients, the parameters' ones returned (torch.autograd.grad gets them, no .grad written
on the side), the RNG stream outside left as it was, a frozen input, two blocks in a row.

The block: x + dropout(tanh((x + shift) W1^T), p) W2^T, x (B, T, C), shift (C,) a second input,
p a non-tensor argument between them in the call (the layout), W1 (H, C) and W2 (C, H) the
parameters; fp64, p = 0.5 so a different mask changes every gradient. Bounds are 0: the
recomputation runs the same operations on the same inputs with the same random numbers, so its
output and gradients are plain autograd's bit for bit (checkpointing.py's own demo, bound 0).
"""
import torch
import torch.nn.functional as F

from checkpointing import _TENSOR
from foundations.meters import saved_activation_bytes

WORLD = 1
PARTS = ["CheckpointFunction.forward", "CheckpointFunction.backward"]
B, T, C, H, P = 2, 3, 4, 8, 0.5
EXACT = "the same operations recomputed on the same inputs and random numbers"


def seeded(*shape, seed: int, grad: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_(grad)


def block(x, p, shift, W1, W2):
    """The block, with dropout: x + dropout(tanh((x + shift) W1^T), p) W2^T."""
    return x + F.dropout(torch.tanh((x + shift) @ W1.T), p, training=True) @ W2.T


def weights(seed: int):
    return seeded(H, C, seed=seed, grad=True), seeded(C, H, seed=seed + 1, grad=True)


def checkpointed(function, x, shift, W1, W2):
    """block(x, P, shift) through the student's Function: the call's layout, two inputs, then
    the parameters (as checkpointing.py's checkpoint() passes them)."""
    return function.apply(lambda x, p, shift: block(x, p, shift, W1, W2),
                                             [_TENSOR, P, _TENSOR], 2, x, shift, W1, W2)


def inputs(grad: bool = True):
    return seeded(B, T, C, seed=1, grad=grad), seeded(C, seed=2, grad=grad)


def check(exercise, grader):
    g = seeded(B, T, C, seed=3)                              # the gradient arriving from above
    function = exercise.CheckpointFunction                   # the student's

    with grader.step("forward: the block's output", "checkpointing's forward runs the block as "
                     "it is, once, with its arguments rebuilt from the layout (_rebuild)"):
        torch.manual_seed(10)
        got = checkpointed(function, *inputs(), *weights(20))
        torch.manual_seed(10)
        grader.close("output", got, block(inputs()[0], P, inputs()[1], *weights(20)), 0.0,
                     EXACT)

    with grader.step("forward keeps only the inputs", "checkpointing's forward records no graph "
                     "(torch.no_grad) and saves only the block's inputs for backward"):
        x, shift = inputs()
        W1, W2 = weights(20)
        kept, _ = saved_activation_bytes(lambda: checkpointed(function, x, shift, W1, W2),
                                         exclude=[W1, W2])
        plain, _ = saved_activation_bytes(lambda: block(x, P, shift, W1, W2), exclude=[W1, W2])
        expected = x.untyped_storage().nbytes() + shift.untyped_storage().nbytes()
        if kept != expected:
            grader.fail(f"forward kept {kept} bytes for backward (the parameters aside), the "
                        f"inputs are {expected} (plain autograd keeps {plain})")

    with grader.step("backward: recompute with the RNG restored", "checkpointing's backward "
                     "runs the block again, recording, from the RNG state forward started "
                     "from (the same dropout masks), and backpropagates through it"):
        (x, shift), (W1, W2) = inputs(), weights(20)
        (px, pshift), (pW1, pW2) = inputs(), weights(20)
        torch.manual_seed(10)
        out = checkpointed(function, x, shift, W1, W2)
        torch.rand(100)                         # later blocks draw their own masks meanwhile
        out.backward(g)
        torch.manual_seed(10)
        block(px, P, pshift, pW1, pW2).backward(g)
        for name, mine, theirs in (("x", x, px), ("shift", shift, pshift), ("W1", W1, pW1),
                                   ("W2", W2, pW2)):
            grader.close(f"{name}.grad", mine.grad, theirs.grad, 0.0, EXACT)

    with grader.step("backward returns the parameters' gradients", "checkpointing's backward "
                     "returns one gradient per parameter, as autograd's own functions do: "
                     "autograd then accumulates them (gradient hooks fire) or hands them to "
                     "torch.autograd.grad; backward writes no .grad itself"):
        (x, shift), (W1, W2) = inputs(), weights(20)
        (px, pshift), (pW1, pW2) = inputs(), weights(20)
        torch.manual_seed(10)
        out = checkpointed(function, x, shift, W1, W2)
        got = torch.autograd.grad(out, [W1, W2], g, allow_unused=True)
        torch.manual_seed(10)
        expected = torch.autograd.grad(block(px, P, pshift, pW1, pW2), [pW1, pW2], g)
        for name, param, mine, theirs in (("W1", W1, got[0], expected[0]),
                                          ("W2", W2, got[1], expected[1])):
            grader.close(f"torch.autograd.grad's gradient for {name}", mine, theirs, 0.0, EXACT)
            grader.same(f"{name}.grad after torch.autograd.grad (which writes none)",
                        param.grad, None)

    with grader.step("backward leaves the RNG stream alone", "checkpointing's backward sets "
                     "the RNG back only inside torch.random.fork_rng: the stream the rest of "
                     "training draws from goes on as if backward had drawn nothing"):
        torch.manual_seed(10)
        out = checkpointed(function, *inputs(), *weights(20))
        torch.rand(100)
        before = torch.get_rng_state()
        out.backward(g)
        if not torch.equal(torch.get_rng_state(), before):
            grader.fail("the CPU RNG state after backward is not the one before it: the next "
                        "dropout mask would repeat one already drawn")

    with grader.step("an input that needs no gradient", "checkpointing's backward "
                     "differentiates only the inputs that need a gradient (LoRA behind frozen "
                     "embeddings: only the parameters do) and returns None for the others"):
        (x, shift), (W1, W2) = inputs(grad=False), weights(20)
        pW1, pW2 = weights(20)
        returned = []                              # what the student's backward returns

        class Watched(function):
            @staticmethod
            def backward(ctx, grad_output):
                returned.append(function.backward(ctx, grad_output))
                return returned[-1]
        torch.manual_seed(10)
        out = checkpointed(Watched, x, shift, W1, W2)
        if not out.requires_grad:
            grader.fail("the output does not require grad: the parameters' gradients are lost")
        out.backward(g)
        grader.same("the inputs that need no gradient but got one from backward",
                    [name for name, grad in zip(("x", "shift"), returned[0][3:5])
                     if grad is not None], [])
        torch.manual_seed(10)
        block(x, P, shift, pW1, pW2).backward(g)
        grader.close("W1.grad", W1.grad, pW1.grad, 0.0, EXACT)
        grader.close("W2.grad", W2.grad, pW2.grad, 0.0, EXACT)

    with grader.step("two checkpointed blocks in a row", "each checkpointed block keeps its own "
                     "input and RNG state: backward recomputes the second, then the first"):
        (x, shift), first, second = inputs(), weights(20), weights(30)
        (px, pshift), pfirst, psecond = inputs(), weights(20), weights(30)
        torch.manual_seed(10)
        out = checkpointed(function, checkpointed(function, x, shift, *first), shift, *second)
        torch.manual_seed(10)
        plain = block(block(px, P, pshift, *pfirst), P, pshift, *psecond)
        grader.close("output", out, plain, 0.0, EXACT)
        out.backward(g)
        plain.backward(g)
        for name, mine, theirs in (("x", x, px), ("shift", shift, pshift),
                                   ("first W1", first[0], pfirst[0]),
                                   ("second W2", second[1], psecond[1])):
            grader.close(f"{name}.grad", mine.grad, theirs.grad, 0.0, EXACT)
