"""Exercise: dynamic loss scaling for fp16 training (the solution: mixed_precision.py).

fp16 has 5 exponent bits: a gradient below about 6e-8 rounds to 0 and one above 65504 to inf.
Multiplying the loss by a scale S multiplies every gradient backward computes by S too, lifting
the small ones clear of 0; the optimizer takes the gradients back to their true size (/ S) in
fp32, where they fit. S is found while training: too large, and some gradient becomes inf or NaN.
Write the four parts below, in this order:
- DynamicLossScaler.scale_loss: the loss times the scale, as a tensor backward can go through
  (a disabled scaler, for bf16 or fp32, hands the loss back as it is).
- unscale_grads: each 16-bit gradient becomes its fp32 master's .grad, divided by the scale.
  Which comes first, the cast or the division, and why?
- MixedPrecisionOptimizer.update: given the global norm of the unscaled gradients (inf or NaN
  when any of them overflowed), either skip the step (nothing moves), or step the fp32 masters
  and round each into its fp16 parameter.
- DynamicLossScaler.update: the lecture's rule for finding the scale while training: shrink it
  after an overflow, grow it after a long enough run of clean steps.
Given (from mixed_precision.py, set by the constructors):
- DynamicLossScaler: self.enabled (False for bf16 and fp32: the scale stays 1), self._scale (the
  scale, a float; self.scale reads it, 1.0 when disabled), self._clean_steps (the clean steps in
  the current run, an int, 0 at the start), self.backoff_factor (0.5), self.growth_factor (2.0),
  self.growth_interval (2000 clean steps: the run that earns a growth).
- MixedPrecisionOptimizer: self.optimizer (the inner torch optimizer, over the masters),
  self._with_grad() ([(param, master)] for the parameters with a gradient this step; in fp32
  training a master is its param itself), self._release() (drops the fp32 .grad of the
  masters that are copies), self.last_grad_norm and self.last_step_skipped (read by the logs
  and by step(), which calls unscale_gradients, the global norm, update(norm), then
  scaler.update(self.last_step_skipped)).
Check: python -m exercises check mixed_precision (one process).

Shapes: grads[i] and masters[i] have the same shape; the loss is a scalar; scale a float.
"""
import math

import torch

import mixed_precision


class DynamicLossScaler(mixed_precision.DynamicLossScaler):
    """mixed_precision.DynamicLossScaler, with scale_loss and update yours (its state: above)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # TODO: enabled: the loss scaled (so that backward scales every gradient);
        # disabled: the loss itself.
        raise NotImplementedError

    def update(self, found_inf: bool):
        # TODO: a disabled scaler never moves. found_inf: back off; a clean step: count it,
        # and grow after growth_interval of them in a row. When does a run start again?
        raise NotImplementedError


def unscale_grads(grads: list, masters: list, scale: float) -> list:
    """Give each master the gradient grad / scale in the master's dtype; return them.

    grads[i] is the low-precision gradient for masters[i] (a model parameter's .grad, or a
    shard of a flat gradient buffer). A master that already holds grad as its own .grad
    (fp32 or fp64 training: the parameter is its own master) is unscaled in place, without a copy.
    """
    # TODO: each master's .grad: grad / scale in the master's dtype (a master that already
    # holds grad as its .grad: in place). Return the masters' .grad, in order.
    raise NotImplementedError


class MixedPrecisionOptimizer(mixed_precision.MixedPrecisionOptimizer):
    """mixed_precision.MixedPrecisionOptimizer, with update yours (its parts: above)."""

    @torch.no_grad()
    def update(self, norm: float, used=None):
        """Given the global norm, read on the host: skip, or step the masters and round them
        into the parameters. Then drop the fp32 gradients. (used: a sharded optimizer's
        update takes it, the mesh passes it to every part; unused here.)"""
        # TODO: keep the norm in self.last_grad_norm, and in self.last_step_skipped whether
        # this step is skipped (an overflow: inf or NaN), every step. Not skipped: the masters
        # step, and the 16-bit parameters take their values. Skipped or not, release.
        raise NotImplementedError
