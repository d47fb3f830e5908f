"""Zero bubble's backward in two halves (ZB-H1, Qi et al. 2024, section 2.1): B now, W later.

extensions/schedules.py's zb list splits each backward in two and runs the second half late,
in 1F1B's idle slots. ZeroBubblePipeline plays such a list: it is pipeline.Pipeline run with a
WeightGradients over its stage. Each B runs autograd's backward inside collect(); each W calls
run().

A linear layer y = x W^T + b has three gradients: dx = dy W (the previous layer, and the
previous stage, wait for it), dW = dy^T x and db = sum(dy) (nothing waits for them until the
optimizer). B runs autograd's backward with every trainable weight's product swapped for
DeferredLinear, whose backward returns dx only and leaves (x, dy) in a list; W runs that
list's two matmuls later. Which products: every nn.Linear's, and those of any module that
computes them as self.linear(x, weight, bias) (the protocol: tensor_parallel's split layers,
whose f and g collectives stay in B around the product, and LoRA's thin factors); W swaps
its own function in. The other parameters (norms, embeddings) are small: their gradients come
in B, as usual. Under FSDP the stage's weights are views of a gathered unit (the pipeline
keeps it gathered through the step): W writes .grad as autograd would, and the unit's
reduce-scatter, held until the step's finish, takes it.

Read after pipeline.py. Test: python -m pytest tests/test_pipeline.py -k zb
"""
import contextlib
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from pipeline import Pipeline


class DeferredLinear(torch.autograd.Function):
    """F.linear whose backward computes the input's gradient and defers the weight's and bias's:
    (weight, bias, x, dy) goes into later.pending, the list of the backward now running."""

    @staticmethod
    def forward(ctx, x, weight, bias, later):
        # The weight itself, not saved: W writes its .grad, and a saved tensor comes back from
        # saved-tensor hooks (train.py's meter of a pipeline's activations) as another object.
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.later = weight, bias, later
        return F.linear(x, weight, bias)                            # (..., k) -> (..., d)

    @staticmethod
    def backward(ctx, dy):                                          # dy: (..., d)
        x, = ctx.saved_tensors
        weight = ctx.weight
        ctx.later.pending.append((weight, ctx.bias, x, dy))
        return dy @ weight, None, None, None                        # dx: (..., k)


class WeightGradients:
    """The deferred halves of a stage's backwards, by micro-batch and chunk (module: the stage,
    pipeline.GPTStage, the module inside its DDP or FSDP wrapper)."""

    def __init__(self, module: nn.Module):
        self.pending, self.by_pass = [], {}
        self.layers = 0                  # layers whose products defer a trained weight's gradient
        self.computed = set()            # the weights W gave a gradient, since clear()
        for layer in module.modules():
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
        as autograd would: the same products over the folded rows, dW = dy^T x laid out as the
        weight (a transposed .grad holds the same values, but a norm over it, the clipping's,
        adds them in another order)."""
        for weight, bias, x, dy in self.by_pass.pop(key):
            x2 = x.reshape(-1, x.shape[-1])                                    # (rows, k)
            dy2 = dy.reshape(-1, dy.shape[-1])                                 # (rows, d)
            _accumulate(weight, dy2.t().mm(x2))                                # (d, k)
            self.computed.add(weight)
            if bias is not None and bias.requires_grad:
                _accumulate(bias, dy2.sum(0))                                      # (d,)


def _accumulate(param: nn.Parameter, grad: torch.Tensor):
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


class ZeroBubblePipeline(Pipeline):
    """pipeline.Pipeline for a list whose backwards are split (schedules.zero_bubble): B, under
    WeightGradients.collect, computes the input's gradient; W, the weights' from what B filed.
    A micro-batch's activations are held from its F to its W. Every backward is held from the
    data dimension's reduction (no_sync): W's gradients come after autograd's, so the step's
    finish reduces them all."""

    def __init__(self, module: nn.Module, comm, schedule, microbatches: int, activation, dtype):
        self.weight_grads = WeightGradients(getattr(module, "module", module))
        super().__init__(module, comm, schedule, microbatches, activation, dtype)
        # Every stage stops alike if one has no trained weight for W (running/cli.py refuses it
        # first).
        idle = torch.tensor([float(not self.weight_grads.layers)], device=self.device)
        dist.all_reduce(idle, group=comm.group)                       # set-up, not counted
        if idle.item():
            raise ValueError(f"--schedule zb: {int(idle.item())} of the {self.P} stages hold no "
                             f"trained weight whose gradient W could compute (no trained "
                             f"nn.Linear or split or LoRA product): use --schedule 1f1b")

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        self.weight_grads.computed.clear()
        return super().train_step(*args, **kwargs)

    def _compute(self, a, x, y, cache, scale_loss):
        """F as Pipeline runs it; B filing its weights' halves under (m, chunk); W running them."""
        key = a.m, a.chunk
        if a.kind == "F":
            super()._compute(a, x, y, cache, scale_loss)
        elif a.kind == "B":
            with (self.sync.no_sync() if self.sync is not None else contextlib.nullcontext()), \
                    self.weight_grads.collect(key):
                self._backward(a, cache, scale_loss)
        else:                                                       # "W"
            self.weight_grads.run(key)

    def deferred_weights(self) -> int:
        """How many of this stage's weights got their gradient from W in the last step."""
        return len(self.weight_grads.computed)
