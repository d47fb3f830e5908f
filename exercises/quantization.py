"""Exercise: NF4, a frozen weight in 4 bits a value (the solution: quantization.py).

NF4 stores each weight as the index (0..15) of one of 16 fixed levels in [-1, 1] (LEVELS, given:
quantiles of a normal distribution, dense near 0 where trained weights are), times a scale shared
by a block of BLOCK = 64 weights. Write the two methods of NF4Weight below:
- __init__: flatten the weight to fp32 and pad it with zeros to whole blocks of 64; each block's
  scale is its largest magnitude (an all-zero block would divide by 0: its scale is raised to
  fp32's smallest normal); divide each block by its scale, so every value lies in [-1, 1], and
  keep the index of the nearest level; pack two indices into each byte, the even position in the
  high 4 bits and the odd one in the low 4. Buffers: codes (G * 32,) uint8, levels (LEVELS, not
  saved with the state), scales (G,) fp32; with double_quant, self._quantize_scales(scales)
  (given) stores the scales in 8 bits instead.
- dequantize: unpack the indices, look each up in the levels, times its block's scale
  (self.block_scales(), given: it reads either way of storing them), drop the padding, reshape to
  the weight's shape, cast to dtype.
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
        # TODO: nn.Module's __init__; keep self.shape (a tuple) and self.double_quant.
        # The weight flat in fp32, zero-padded to (G, 64); each block's absmax (at least fp32's
        # tiny); the blocks over their scales; for each value the index of the nearest of the
        # 16 levels; two indices a byte (even: high nibble); register the buffers.
        raise NotImplementedError

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        # TODO: each byte back into its two indices, in order, as (G, 64); level x block scale;
        # the first P values, in the weight's shape and the asked dtype.
        raise NotImplementedError
