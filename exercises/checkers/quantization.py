"""Checks exercises/quantization.py: NF4Weight's blocks, codes, packing and dequantization in one
process, against a loop over the blocks written out here (and the concept file's class, for
double quantization).

The weight is (6, 48): 288 values, 4.5 blocks of 64, so the last block is padded; its third block
is all zeros (the scale that must not be 0). Every bound is 0: the reference does the same fp32
operations value by value (a max of magnitudes, one division, the nearest of 16 levels, one
product), so any difference is a mistake, not rounding; a bf16 dequantize is that fp32 product
rounded once.
"""
import torch

import quantization
from quantization import BLOCK, LEVELS

WORLD = 1
PARTS = ["NF4Weight.__init__", "NF4Weight.dequantize"]
EXACT = "the same fp32 operations, value by value: exact"


def the_weight() -> torch.Tensor:
    """(6, 48): 288 values, blocks of 64 with the last one half padding; block 2 all zero."""
    weight = torch.randn(6, 48, generator=torch.Generator().manual_seed(0)) * 0.02
    weight.view(-1)[2 * BLOCK:3 * BLOCK] = 0.0
    return weight


def reference(weight: torch.Tensor):
    """A loop over the blocks: each block's scale (G,) and its values' level indices (G * 64,)."""
    flat = weight.reshape(-1).tolist()
    flat += [0.0] * (-len(flat) % BLOCK)
    scales, codes = [], []
    for start in range(0, len(flat), BLOCK):
        block = torch.tensor(flat[start:start + BLOCK])
        scale = max(block.abs().max(), torch.tensor(torch.finfo(torch.float32).tiny))
        scales.append(scale)
        for value in block:
            codes.append(int((value / scale - LEVELS).abs().argmin()))
    return torch.stack(scales), torch.tensor(codes)


def unpacked(packed: torch.Tensor) -> torch.Tensor:
    """Each byte as its two codes, high nibble first: (2 x bytes,)."""
    return torch.tensor([code for byte in packed.tolist() for code in (byte >> 4, byte & 15)])


def check(exercise, grader):
    weight = the_weight()
    scales, codes = reference(weight)
    G = scales.numel()

    with grader.step("blockwise absmax scales", "pad the flat weight to whole blocks of 64; "
                     "each block's scale is its largest |value|, raised to fp32's tiny when the "
                     "block is all zeros"):
        nf4 = exercise.NF4Weight(weight)
        grader.same("the buffers", sorted(name for name, _ in nf4.named_buffers()),
                    ["codes", "levels", "scales"])
        grader.close("scales", nf4.scales, scales, 0.0, EXACT)

    with grader.step("round to the nearest level", "divide each block by its scale (into "
                     "[-1, 1]) and keep the index of the nearest of the 16 levels"):
        grader.same("codes' dtype and shape", (nf4.codes.dtype, tuple(nf4.codes.shape)),
                    (torch.uint8, (G * BLOCK // 2,)))
        # The two codes of each byte in either order: which goes high is the next step's.
        grader.close("the codes (each byte's two, sorted)",
                     unpacked(nf4.codes).view(-1, 2).sort(dim=1).values,
                     codes.view(-1, 2).sort(dim=1).values, 0.0, "indices: exact")

    with grader.step("pack two codes a byte", "the code of an even position goes in the high "
                     "4 bits of its byte, the next (odd) one in the low 4"):
        grader.close("the codes, unpacked high nibble first", unpacked(nf4.codes), codes, 0.0,
                     "indices: exact")

    with grader.step("dequantize", "unpack each byte into its two codes, in order; each code's "
                     "level times its block's scale; cut the padding off and reshape. In a "
                     "16-bit dtype, how many times is each value rounded?"):
        restored = nf4.dequantize()
        expected = (LEVELS[codes].view(G, BLOCK) * scales[:, None]).view(-1)[:weight.numel()]
        grader.close("dequantize()", restored, expected.view(weight.shape), 0.0, EXACT)
        low = nf4.dequantize(torch.bfloat16)
        grader.same("dequantize(torch.bfloat16)'s dtype", low.dtype, torch.bfloat16)
        grader.close("dequantize(torch.bfloat16)", low, expected.view(weight.shape).bfloat16(),
                     0.0, "the fp32 product rounded once into bf16: exact")

    with grader.step("double quantization", "the scales are the concept's to store in 8 bits "
                     "(_quantize_scales); dequantize reads them through self.block_scales()"):
        nf4 = exercise.NF4Weight(weight, double_quant=True)
        concept = quantization.NF4Weight(weight, double_quant=True)
        grader.close("dequantize() with double quantization", nf4.dequantize(),
                     concept.dequantize(), 0.0, "the concept file's NF4Weight, the same "
                     "operations: exact")
        grader.same("nbytes() with double quantization", nf4.nbytes(), concept.nbytes())
