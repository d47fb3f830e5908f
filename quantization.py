"""4-bit NormalFloat (NF4): a frozen weight in half a byte per value, for QLoRA.

NF4 is not a float format (no exponent, no mantissa): each value is a 4-bit index into 16
fixed values (a lookup table, LEVELS below), times its block's scale.

Trained weights are close to normally distributed, so the 16 levels of a 4-bit code are put at
quantiles of N(0, 1), scaled to [-1, 1] with an exact 0 (Dettmers et al. 2023, "QLoRA",
section 3). Each block of 64 weights is divided by its largest magnitude (its scale) and every
value stored as the nearest level's index; double quantization stores those fp32 scales in 8
bits too, blocks of 256, taking the overhead from 0.5 to about 0.13 bits per weight.
Dequantization (level x scale) happens on the fly, in forward and again in backward, so the
full-precision weight never stays alive: calling an NF4Weight computes x W^T + b so (through
NF4Linear, the autograd Function that dequantizes W again in backward). FrozenNF4Linear is a
frozen nn.Linear stored so.
Left out: 8-bit float scales (ours are int8 linear), paged optimizers, fused dequantizing kernels.
Run alone: python quantization.py (a weight's round trip against its fp32 self, and its bytes);
in training: python train.py --init-from RUN --lora --quantize-base nf4;
test: python -m pytest tests/test_quantization.py

Shapes: P values in a weight W (d, k), G = ceil(P / 64) blocks, S = ceil(G / 256) blocks of
scales; a linear maps (..., k) to (..., d).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from foundations.alone import start_alone

BLOCK = 64              # weights per scale
SCALE_BLOCK = 256       # scales per second-level scale (double quantization)


def normal_float_levels() -> torch.Tensor:
    """The 16 NF4 levels: 8 quantiles of N(0, 1) above 0, 7 below, and 0 itself.

    Each level is divided by the largest one, so the levels span [-1, 1].
    The top level would be the quantile at probability 1, which is infinite.
    So its probability is pulled in by half a gap: 16 levels spread over [0, 1] leave 15 gaps
    (1 - 1/(2*15)), or 16 counting the one below the first level (1 - 1/(2*16)).
    The mean of the two, 0.9677, is the QLoRA paper's empirical choice.
    8 levels on one side and 7 on the other leave room for an exact 0. Each side spreads its
    points evenly in probability from `outer` to 0.5, so the side with fewer points takes wider
    steps: the levels are not a mirror image (-0.0910 below 0, 0.0796 above).
    """
    normal = torch.distributions.Normal(0.0, 1.0)
    outer = ((1 - 1 / 30) + (1 - 1 / 32)) / 2
    # [:-1] drops the last point, probability 0.5: the median, which is 0 (added once below).
    positive = normal.icdf(torch.linspace(outer, 0.5, 9, dtype=torch.float64)[:-1])       # (8,)
    negative = -normal.icdf(torch.linspace(outer, 0.5, 8, dtype=torch.float64)[:-1])      # (7,)
    levels = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).sort().values
    return (levels / levels.max()).float()                                                # (16,)


LEVELS = normal_float_levels()


class NF4Weight(nn.Module):
    """A weight stored as packed 4-bit codes and per-block scales (buffers: nothing trains).
    Called on x, it is the frozen linear x W^T + b."""

    def __init__(self, weight: torch.Tensor, double_quant: bool = False):
        super().__init__()
        self.shape, self.double_quant = tuple(weight.shape), double_quant
        flat = weight.detach().float().reshape(-1)                               # (P,)
        # -P % 64 is (-P) % 64, Python's non-negative remainder: the zeros that pad P up to G x 64.
        padded = F.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)        # (G, 64)
        # An all-zero block would divide by 0: its scale is raised to the smallest normal float.
        scales = padded.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)   # (G,)
        normalized = padded / scales[:, None]                                     # in [-1, 1]
        # Each value's code: the argmin of its distances to the 16 levels. Computed for a 16th
        # of the blocks at a time only to bound memory (each (G/16, 64, 16) fp32 temporary is
        # the weight's size, not 16x it: 0.9 GB for a 70B's MLP matrix); the codes are the same.
        levels = LEVELS.to(flat.device)
        codes = torch.cat([(part[..., None] - levels).abs().argmin(dim=-1).to(torch.uint8)
                           for part in normalized.chunk(16)]).reshape(-1)       # (G*64,) 0..15
        # Two codes per byte: even positions in the high nibble, odd ones in the low one.
        self.register_buffer("codes", codes[0::2] << 4 | codes[1::2])            # (G * 32,) uint8
        # The 16 levels ride along with the codes (a buffer moves with .to(device)).
        # So no forward or backward copies them to the GPU. Not saved: they are the format's.
        self.register_buffer("levels", LEVELS.to(flat.device), persistent=False)
        if double_quant:
            self._quantize_scales(scales)
        else:
            self.register_buffer("scales", scales)

    def _quantize_scales(self, scales: torch.Tensor):
        """Double quantization: the (G,) fp32 scales, centred, stored as int8 in blocks of 256.

        Scales are all positive: subtracting their mean lets the symmetric int8 code use both
        signs. scale_mean is not saved: a run re-quantizes the base from the pretrained weights.
        """
        G = scales.numel()
        self.scale_mean = scales.mean().item()       # a plain float: not in the state dict
        centered = F.pad(scales - self.scale_mean, (0, -G % SCALE_BLOCK))         # (S * 256,)
        centered = centered.view(-1, SCALE_BLOCK)                                 # (S, 256)
        absmax = centered.abs().amax(dim=1)                                       # (S,)
        absmax = absmax.clamp(min=torch.finfo(torch.float32).tiny)
        scale_codes = torch.round(centered / absmax[:, None] * 127).to(torch.int8)  # (S, 256)
        # (G,) int8, a copy: a view would keep the padding's storage (up to 255 bytes) alive
        self.register_buffer("scale_codes", scale_codes.view(-1)[:G].clone())
        self.register_buffer("scale_absmax", absmax)

    def block_scales(self) -> torch.Tensor:                                      # (G,) fp32
        if not self.double_quant:
            return self.scales
        G = self.scale_codes.numel()
        codes = F.pad(self.scale_codes.float(), (0, -G % SCALE_BLOCK))            # (S * 256,)
        centered = codes.view(-1, SCALE_BLOCK) / 127 * self.scale_absmax[:, None]  # (S, 256)
        return centered.view(-1)[:G] + self.scale_mean

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        codes = torch.stack([self.codes >> 4, self.codes & 0xF], dim=1).view(-1, BLOCK)  # (G, 64)
        values = self.levels[codes.long()] * self.block_scales()[:, None]
        numel = torch.Size(self.shape).numel()
        return values.view(-1)[:numel].view(self.shape).to(dtype)

    def forward(self, x, bias=None):                                      # (..., k) -> (..., d)
        """x W^T (+ b) for a layer that holds this weight, W never kept in full precision (W and
        b frozen: NF4Linear, below, gives them no gradient)."""
        return NF4Linear.apply(x, self, bias)

    def nbytes(self) -> int:
        """The stored weight's bytes: codes and scales (not the shared levels, nor scale_mean)."""
        stored = [b for name, b in self.named_buffers() if name != "levels"]
        return sum(b.numel() * b.element_size() for b in stored)

    def extra_repr(self):
        return f"shape={self.shape}, double_quant={self.double_quant}, {self.nbytes():,} bytes"


class NF4Linear(torch.autograd.Function):
    """y = x W^T + b with W dequantized in forward and again in backward, never kept.

    Why a Function: plain F.linear(x, W.dequantize()) would save the dequantized W for backward,
    keeping it alive until then; here backward dequantizes W again instead.
    Only x needs a gradient (W and b are frozen): grad_x = grad_y W, the one matrix product
    F.linear's backward would do, so the result equals nn.Linear's on the dequantized W.
    """

    @staticmethod
    def forward(ctx, x, weight: NF4Weight, bias):
        ctx.weight = weight
        return F.linear(x, weight.dequantize(x.dtype), bias)                    # (..., d)

    @staticmethod
    def backward(ctx, grad_y):                 # None for b: its callers freeze the bias
        return grad_y @ ctx.weight.dequantize(grad_y.dtype), None, None         # (..., k)


class FrozenNF4Linear(nn.Module):
    """A frozen nn.Linear kept as its NF4 copy: QLoRA's base beside the adapted layers.

    The weight becomes NF4Weight's codes and scales (self.base). The bias stays as it was."""

    def __init__(self, linear: nn.Linear, double_quant: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.base = NF4Weight(linear.weight, double_quant)     # 4.5 bits a weight (4.13 double)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x):                                       # (..., k) -> (..., d)
        return self.base(x, self.bias)                          # W dequantized, used, dropped

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}"



# ---- run alone: a weight's round trip against the fp32 weight itself --------------------------

def _round_to_levels(weight: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Each block of 64 over its absmax, rounded to the nearest of `levels`, scaled back (no
    packing): what a weight keeps of itself in those 16 levels."""
    blocks = weight.reshape(-1, BLOCK)                                            # (G, 64)
    scales = blocks.abs().amax(dim=1, keepdim=True)                               # (G, 1)
    nearest = ((blocks / scales)[..., None] - levels).abs().argmin(dim=-1)        # (G, 64)
    return (levels[nearest] * scales).view_as(weight)


def _demonstrate() -> bool:
    """Quantize a weight shaped like a trained one (normal, std 0.02), dequantize it, and hold
    every value's error to the format's bound, against the fp32 original.
    True when every error is within its bound."""
    torch.manual_seed(0)
    weight = torch.randn(512, 1024) * 0.02                                         # P = 512K
    naive, nf4 = (_round_to_levels(weight, levels) - weight for levels in
                  (torch.linspace(-1, 1, 16), LEVELS))            # 16 evenly spaced levels, NF4
    print(f"a {tuple(weight.shape)} weight ~ N(0, 0.02^2) in blocks of {BLOCK}: mean |error| "
          f"{naive.abs().mean():.2e} with 16 evenly spaced levels, {nf4.abs().mean():.2e} with "
          f"NF4's (quantiles of N(0, 1): levels dense where the weights are)")
    scales = weight.reshape(-1, BLOCK).abs().amax(dim=1, keepdim=True)            # (G, 1)
    # The nearest level is at most half the widest gap away (between -1 and the next level),
    # times the block's scale; fp32's rounding of x / scale and of level x scale adds ulps:
    # 2^-21 is 4 fp32 ulps at 1.0 (an ulp there is 2^-23).
    bound = scales * ((LEVELS[1] - LEVELS[0]) / 2 + 2 ** -21)                      # (G, 1)
    within = True
    for double_quant in (False, True):
        stored = NF4Weight(weight, double_quant)
        error = (stored.dequantize() - weight).reshape(-1, BLOCK).abs()           # (G, 64)
        # Double quantization rounds each scale too (int8): |level| <= 1 times the scale's error.
        allowed = bound + (stored.block_scales()[:, None] - scales).abs() if double_quant else bound
        within &= bool((error <= allowed).all())
        print(f"{'NF4 + double quantization' if double_quant else 'NF4':25s} "
              f"{stored.nbytes() / weight.numel():.4f} bytes per weight "
              f"({8 * stored.nbytes() / weight.numel():.3f} bits; fp32: 32)")
        print(f"  max |difference| against the fp32 original (one process): {error.max():.2e} "
              f"(bound {allowed.max():.2e}: half the widest gap between levels x the block's "
              f"absmax{' + the scale rounded' if double_quant else ''}; tight: the worst weight "
              f"reaches {100 * (error / allowed).max():.2f}% of its block's bound)")
    return within


if __name__ == "__main__":
    start_alone()
    raise SystemExit(0 if _demonstrate() else 1)
