"""Exercise: NF4, a frozen weight in 4 bits a value (the solution: quantization.py).

NF4 (QLoRA's 4-bit NormalFloat) is a lookup table, not a float format: a weight is stored as
4-bit indices into 16 fixed levels, each times a scale. Trained weights are close to normally
distributed, so the levels are quantiles of the normal distribution N(0, 1) (dense near 0, where
most weights are, sparse in the tails), divided by the largest so that they span [-1, 1], with
an exact 0 among them. The weight is cut into blocks of BLOCK = 64 values, each with its own
scale, its absmax (largest magnitude): divided by it, the block's values lie in [-1, 1], where
the levels are, and each is stored as its nearest level's index. One outlier then costs
precision in its own block only. 4 bits + 32 bits / 64 = 4.5 bits a weight.
Write the two methods of NF4Weight below:
- __init__: quantize the weight (any shape, any dtype: in fp32) as above; the last block may
  need padding.
- dequantize: the weight back (level x scale), in its shape, in the dtype asked for.
Given: LEVELS, the 16 levels (fp32, sorted); BLOCK = 64. Facts the check holds you to:
- buffers: codes (G * 32,) uint8, two indices a byte, the even position's in the high 4 bits;
  levels (LEVELS, registered with persistent=False: the format's, not the weight's); scales (G,)
  fp32, the blocks' absmax (an all-zero block's raised to torch.finfo(torch.float32).tiny).
- self.shape (the weight's shape, a tuple) and self.double_quant. With double_quant, the
  scales are not registered: self._quantize_scales(scales) (given) stores them in 8 bits, and
  self.block_scales() (given) returns the (G,) fp32 scales either way.
Check: python -m exercises check quantization (one process).

Shapes: P values in the weight, G = ceil(P / 64) blocks, codes G * 32 bytes.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import quantization
from quantization import BLOCK, LEVELS


class NF4Weight(nn.Module):
    """quantization.NF4Weight, with __init__ and dequantize yours, the rest its own.

    An nn.Module, not a subclass of quantization.NF4Weight: __init__ starts with
    super().__init__(), which must be nn.Module's (NF4Weight's own would want a weight)."""

    _quantize_scales = quantization.NF4Weight._quantize_scales
    block_scales = quantization.NF4Weight.block_scales
    nbytes = quantization.NF4Weight.nbytes
    extra_repr = quantization.NF4Weight.extra_repr

    def __init__(self, weight: torch.Tensor, double_quant: bool = False):
        # TODO: nn.Module's __init__; the blocks, their scales, each value's nearest level's
        # index, packed; the buffers above.
        raise NotImplementedError

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        # TODO: the indices back from the bytes; level x its block's scale; the weight's shape.
        raise NotImplementedError
