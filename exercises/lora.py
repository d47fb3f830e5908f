"""Exercise: the LoRA linear and its merge (the solution: lora.py's LoRALinear).

A pretrained W0 (d, k) and its bias b stay frozen; the layer learns two thin factors,
A (r, k) and B (d, r), and adds their product, scaled by alpha / r, to what W0 computes.
The constructor is given (lora.py): it freezes W0 and b, draws A at random, starts B at zero
(so the adapted layer starts as the base one) and sets self.scale = alpha / r.
Write the four methods below:
- delta: the d x k update the adapter stands for, (alpha / r) B A.
- forward: the frozen product (self.frozen_forward) plus the adapter's term, computed as two
  thin products through self.linear, x -> A x -> B A x, so that the d x k update is never built;
  in training, dropout (self.dropout) applies to the adapter's input only. A merged layer
  (self.merged) already holds the update in its weight.
- merge: add the update into W0, once, so inference costs one matmul; unmerge: take it out
  again, so the base comes back (up to rounding) and another task's adapter can go on top.
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
        # TODO: the product of the two factors, in the order that gives (d, k), times the scale.
        raise NotImplementedError

    def forward(self, x):                                       # x: (..., k) -> (..., d)
        # TODO: h, the frozen layer's output; a merged layer returns it as it is. Otherwise
        # dropout on x (only while self.training), then A, then B, each with self.linear,
        # scaled by alpha / r and added to h.
        raise NotImplementedError

    @torch.no_grad()
    def merge(self):
        # TODO: if not merged yet: add the update, in the weight's dtype, into W0 in place,
        # and remember that it is merged (merging twice must not add it twice).
        raise NotImplementedError

    @torch.no_grad()
    def unmerge(self):
        # TODO: the reverse of merge: only a merged layer takes the update back out of W0.
        raise NotImplementedError
