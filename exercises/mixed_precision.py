"""Exercise: dynamic loss scaling for fp16 training (the solution: mixed_precision.py).

fp16 has 5 exponent bits: a gradient below about 6e-8 rounds to 0 and one above 65504 to inf.
Multiplying the loss by a scale S multiplies every gradient backward computes by S too, lifting
the small ones clear of 0; the optimizer takes the gradients back to their true size (/ S) in
fp32, where they fit. S is found while training: too large, and some gradient becomes inf or NaN.
Write the four parts below, in this order:
- DynamicLossScaler.scale_loss: the loss times the scale, as a tensor backward can go through
  (a disabled scaler, for bf16 or fp32, hands the loss back as it is).
- unscale_grads: each 16-bit gradient becomes its fp32 master's .grad, divided by the scale
  there, after the cast (divided while still in fp16, the small ones would drop back to 0).
- MixedPrecisionOptimizer.update: given the global norm of the unscaled gradients (inf or NaN
  when any of them overflowed), either skip the step (nothing moves), or step the fp32 masters
  and round each into its fp16 parameter.
- DynamicLossScaler.update: after an overflow, shrink the scale by backoff_factor and count the
  clean steps from 0 again; after growth_interval clean steps in a row, grow it by growth_factor
  (and count from 0 again).
The rest (the scaler's settings in __init__, the optimizer's step() that calls unscale, the norm,
update and the scaler's update) comes from mixed_precision.py.
Check: python -m exercises check mixed_precision (one process).

Shapes: grads[i] and masters[i] have the same shape; the loss is a scalar; scale a float.
"""
import math

import torch

import mixed_precision


class DynamicLossScaler(mixed_precision.DynamicLossScaler):
    """mixed_precision.DynamicLossScaler, with scale_loss and update yours. Its state:
    self._scale (the scale, a float), self._clean_steps (clean steps in a row), self.enabled."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # TODO: enabled: the loss times the scale (a tensor op, so backward scales every
        # gradient); disabled: the loss itself.
        raise NotImplementedError

    def update(self, found_inf: bool):
        # TODO: nothing when disabled. An overflow: multiply the scale by backoff_factor, and
        # the run of clean steps is over. A clean step: one more in the run; when the run
        # reaches growth_interval, multiply the scale by growth_factor and start a new run.
        raise NotImplementedError


def unscale_grads(grads: list, masters: list, scale: float) -> list:
    """Give each master the gradient grad / scale in the master's dtype; return them.

    grads[i] is the low-precision gradient for masters[i] (a model parameter's .grad, or a
    shard of a flat gradient buffer). A master that already holds grad as its own .grad
    (fp32 or fp64 training: the parameter is its own master) is unscaled in place, without a copy.
    """
    # TODO: for each pair: unless the master's .grad already is grad, set it to grad cast to
    # the master's dtype (cast first, then divide); divide it by the scale in place (nothing
    # to do when the scale is 1). Return the masters' .grad, in order.
    raise NotImplementedError


class MixedPrecisionOptimizer(mixed_precision.MixedPrecisionOptimizer):
    """mixed_precision.MixedPrecisionOptimizer, with update yours. Its parts: self.optimizer
    (the inner optimizer, over the masters), self._with_grad() ((param, master) pairs with a
    gradient this step; a master is its param in fp32 training), self._release()."""

    @torch.no_grad()
    def update(self, norm: float, used=None):
        """Given the global norm, read on the host: skip, or step the masters and round them
        into the parameters. Then drop the fp32 gradients. (used: a sharded optimizer's
        update takes it, the mesh passes it to every part; unused here.)"""
        # TODO: keep the norm in self.last_grad_norm; the step is skipped (last_step_skipped)
        # when the norm is not a finite number (inf or NaN). Not skipped: the inner optimizer
        # steps the masters, then each parameter that is not its own master takes its master's
        # values (rounded to 16 bits). Skipped or not, release the fp32 gradients.
        raise NotImplementedError
