"""Exercise: the LoRA linear and its merge (the solution: lora.py's LoRALinear).

A pretrained W0 (d, k) and its bias b stay frozen; the layer learns two thin factors,
A (r, k) and B (d, r), and adds their product, scaled by alpha / r, to what W0 computes.
Write the four methods below:
- delta: the d x k update the adapter stands for.
- forward: the frozen layer's output plus the adapter's term. Which input does LoRA's dropout
  see, and when? The adapter is low rank: in what order can its products run so that the d x k
  update is never built? What is left to add once a layer is merged?
- merge: fold the update into W0 so that inference costs one matmul (the model holds W0's
  tensor: it must stay that tensor, in its dtype); unmerge: the base back (up to rounding), so
  another task's adapter can go on top. What if either is called twice, or unmerge first?
Given by the constructor (lora.py; fp64 in the check, bf16 in one of its steps):
- self.weight (d, k) W0 and self.bias (d,) b: the frozen nn.Linear's own tensors.
- self.lora_A (r, k) and self.lora_B (d, r): the trainable factors (nn.Parameter).
- self.scale: alpha / r, a float. self.dropout: the dropout probability p, a float, not a
  module (F.dropout takes it; self.training says whether the layer is in training).
  self.merged: False until merge() says otherwise.
- self.frozen_forward(x): x W0^T + b, (..., d). self.linear(x, M): x M^T (it is F.linear; a
  zero-bubble pipeline swaps it for its own, so the adapter's products go through it).
Only A and B should ever get a gradient: W0 and b are frozen.
Check: python -m exercises check lora (one process, against plain torch matmuls in fp64).

Shapes: k in features, d out features, r rank; "..." for batch dimensions.
"""
import torch
import torch.nn.functional as F

import lora


class LoRALinear(lora.LoRALinear):
    """lora.py's LoRALinear (its constructor, frozen_forward, linear) with your four methods."""

    def delta(self) -> torch.Tensor:
        """The update the adapter adds to W0: (alpha / r) B A, (d, k)."""
        # TODO: LoRA's update, (d, k).
        raise NotImplementedError

    def forward(self, x):                                       # x: (..., k) -> (..., d)
        # TODO: the frozen output plus the adapter's term (its products through self.linear).
        raise NotImplementedError

    @torch.no_grad()
    def merge(self):
        # TODO: the update into W0.
        raise NotImplementedError

    @torch.no_grad()
    def unmerge(self):
        # TODO: the reverse of merge.
        raise NotImplementedError
