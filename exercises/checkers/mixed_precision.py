"""Checks exercises/mixed_precision.py: dynamic loss scaling in one process, part by part.

- scale the loss: the scaled loss and the fp16 gradient backward makes of it, against the loss and
  the gradient computed in fp64 times the scale. The scale is a power of two, so the scaled loss
  is exact; the gradient is rounded once, into fp16 (11 significant bits: 2**-11 relative).
- unscale: each fp32 master's gradient against the fp16 gradient in fp64 / the scale. Exact: an
  fp16 value is exact in fp32, and so is its quotient by a power of two. The gradients are chosen
  so that dividing while still in fp16 loses them (below fp16's smallest normal).
- skip on inf/NaN: the student's optimizer update with the concept file's scaler (so only the skip
  is checked), plain SGD: a clean step against master - lr x gradient in fp64 (one fp32 rounding
  of the result, 2**-24 relative, bounded by 2**-23), then an inf and a NaN step that must leave
  the masters and the parameters bit for bit as they were, then a clean step again (no longer
  skipped: the flag is set on every step, not only on an overflow).
- back off, grow: the scale after each step of a sequence of clean and overflowed steps, against
  torch.amp.GradScaler's on the same sequence (torch's own rule; powers of two: exact).
"""
import torch

import mixed_precision

WORLD = 1
PARTS = ["DynamicLossScaler.scale_loss", "unscale_grads", "MixedPrecisionOptimizer.update",
         "DynamicLossScaler.update"]
SCALE = 2.0**16
EXACT = "exact: an exact value times or over a power of two"


def grad_scaler_scales(flags: list, init_scale: float, growth_interval: int) -> list:
    """torch.amp.GradScaler's scale after each step; flags[i]: step i's gradient overflowed."""
    reference = torch.amp.GradScaler("cpu", init_scale=init_scale,
                                     growth_interval=growth_interval)
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.0)
    scales = []
    for overflow in flags:
        reference.scale(torch.ones(()))                  # GradScaler creates its scale here
        p.grad = torch.full((1,), float("inf") if overflow else 1.0)
        reference.step(optimizer)
        reference.update()
        scales.append(reference.get_scale())
    return scales


def check_scales(grader, scaler, flags: list, expected: list):
    """scaler.update(flag) for each flag; its scale after each against expected."""
    for i, (overflow, scale) in enumerate(zip(flags, expected)):
        scaler.update(overflow)
        steps = ", ".join("overflow" if o else "clean" for o in flags[:i + 1])
        grader.same(f"the scale after step {i} (the steps so far: {steps})", scaler.scale,
                    scale)


def check(exercise, grader):
    generator = torch.Generator().manual_seed(0)

    with grader.step("scale the loss", "scale_loss multiplies the loss by the scale (a tensor "
                     "op, so backward scales every gradient); a disabled scaler leaves it be"):
        w = torch.nn.Parameter(torch.ones(6, dtype=torch.float16))
        # The gradient of the loss in w: 1e-8 to 2e-8, which fp16 rounds to 0; times the scale
        # it is an fp16 normal number.
        x = (1 + torch.rand(6, generator=generator)) * 1e-8
        loss = (w.float() * x).sum()
        scaled = exercise.DynamicLossScaler(init_scale=SCALE).scale_loss(loss)
        grader.close("the scaled loss", scaled, loss.double() * SCALE, 0.0, EXACT)
        scaled.backward()
        grader.close("w.grad (fp16)", w.grad, x.double() * SCALE, 0.0,
                     "one rounding into fp16: 11 significant bits", rtol=2**-11)
        unscaled = exercise.DynamicLossScaler(enabled=False).scale_loss(loss)
        grader.close("a disabled scaler's loss", unscaled, loss.double(), 0.0,
                     "disabled (bf16, fp32 training): the loss as it is")

    with grader.step("unscale the gradients", "unscaled, these gradients are 1e-6 to "
                     "1e-8: below fp16's smallest normal number (6e-5) fp16 keeps few of their "
                     "bits or rounds them to 0, fp32 keeps them whole. A master that is its own "
                     "parameter is divided in place"):
        # Scaled gradients as backward leaves them; / SCALE they are about 1e-6 to 1e-8.
        grads = [(torch.randn(n, generator=generator) * 1e-7 * SCALE).half() for n in (5, 3)]
        masters = [torch.zeros(n, requires_grad=True) for n in (5, 3)]
        unscaled = exercise.unscale_grads(grads, masters, SCALE)
        for i, (grad, master) in enumerate(zip(grads, masters)):
            grader.same(f"masters[{i}].grad's dtype", getattr(master.grad, "dtype", None),
                        torch.float32)
            grader.close(f"masters[{i}].grad", master.grad, grad.double() / SCALE, 0.0, EXACT)
        grader.same("the returned gradients are the masters' .grad",
                    [g is m.grad for g, m in zip(unscaled, masters)], [True, True])
        own = torch.nn.Parameter(torch.zeros(4))                 # fp32 training: its own master
        own.grad = torch.randn(4, generator=generator) * SCALE
        before, expected = own.grad, own.grad.double() / SCALE
        exercise.unscale_grads([own.grad], [own], SCALE)
        grader.same("an fp32 master's .grad is the tensor it had (unscaled in place)",
                    own.grad is before, True)
        grader.close("the fp32 master's grad", own.grad, expected, 0.0, EXACT)

    with grader.step("skip the step on inf/NaN", "update: a norm that is not finite (inf or "
                     "NaN) skips the step; else the inner optimizer steps the fp32 masters and "
                     "each is rounded into its fp16 parameter"):
        lr, init = 0.5, 2.0**10
        p = torch.nn.Parameter(torch.randn(4, generator=generator).half())
        scaler = mixed_precision.DynamicLossScaler(init_scale=init)    # the concept's own
        opt = exercise.MixedPrecisionOptimizer([p], torch.optim.SGD, precision="fp16",
                                               scaler=scaler, lr=lr)
        p.grad = (torch.randn(4, generator=generator) * init).half()
        master, grad = opt.masters[0].detach().double(), p.grad.double() / init
        opt.step()
        grader.same("last_step_skipped after a clean step", opt.last_step_skipped, False)
        grader.close("the master after a clean SGD step", opt.masters[0], master - lr * grad,
                     0.0, "one fp32 rounding of master - lr x grad", rtol=2**-23)
        grader.close("the fp16 parameter", p, opt.masters[0].half(), 0.0,
                     "the master rounded to fp16: the same cast")
        grader.same("the master's fp32 .grad after the step (released)", opt.masters[0].grad,
                    None)
        for bad in (float("inf"), float("nan")):
            param, master = p.detach().clone(), opt.masters[0].detach().clone()
            p.grad = torch.tensor([1.0, bad, -1.0, 2.0], dtype=torch.float16)
            opt.step()
            grader.same(f"last_step_skipped after a gradient holding {bad}",
                        opt.last_step_skipped, True)
            grader.close(f"the master after a skipped step ({bad})", opt.masters[0], master,
                         0.0, "a skipped step moves nothing")
            grader.close(f"the parameter after a skipped step ({bad})", p, param, 0.0,
                         "a skipped step moves nothing")
        # A clean step after the skipped ones: the scaler has backed off twice since.
        p.grad = (torch.randn(4, generator=generator) * opt.scaler.scale).half()
        master, grad = opt.masters[0].detach().double(), p.grad.double() / opt.scaler.scale
        opt.step()
        grader.same("last_step_skipped after a clean step that follows a skipped one",
                    opt.last_step_skipped, False)
        grader.close("the master after that clean step", opt.masters[0], master - lr * grad,
                     0.0, "one fp32 rounding of master - lr x grad", rtol=2**-23)

    with grader.step("back off on overflow", "update(found_inf=True) multiplies the scale by "
                     "backoff_factor (0.5): every overflow halves it"):
        flags = [False, True, True, False, True]
        scaler = exercise.DynamicLossScaler(init_scale=SCALE, growth_interval=1000)
        check_scales(grader, scaler, flags, grad_scaler_scales(flags, SCALE, 1000))

    with grader.step("grow after a run of clean steps", "the scale grows by growth_factor "
                     "after growth_interval clean steps in a row; growing, and an overflow, "
                     "each start the count again from 0"):
        flags = [False] * 6 + [False, True] + [False] * 3 + [False] * 2
        scaler = exercise.DynamicLossScaler(init_scale=SCALE, growth_interval=3)
        check_scales(grader, scaler, flags, grad_scaler_scales(flags, SCALE, 3))
