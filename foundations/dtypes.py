"""fp32, fp16 and bf16: what each 16-bit format gives up, and so why mixed_precision.py exists.

A float is a sign, an exponent (its range) and a mantissa (its precision): fp32 has 8 and 23
bits, fp16 5 and 10, bf16 8 and 7. fp16's eps (the gap above 1.0) is 2**-10 and its smallest
normal 2**-14: below it precision drains away (subnormals), and below 2**-24 a small
gradient rounds to zero, unless the loss is scaled up first
(Micikevicius et al. 2018, section 3.2); bf16 keeps fp32's exponent, hence its range, at a
coarser precision (Kalamkar et al. 2019).
Run: python mixed_precision.py (or python -m foundations.dtypes); test: python -m pytest tests/test_mixed_precision.py
"""
import torch

# fp64 trains nothing faster or better, but there "equal to one process" is exact: the ranks' sums
# in another order round at 1e-16 of their terms, not fp32's 1e-7 (the tests check strategies so).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}

# The dtype gradients are averaged across ranks in when --reduce-dtype is not given (train.py's,
# the napkin's): fp32 whatever the --precision, as FSDP2's MixedPrecisionPolicy(reduce_dtype=
# torch.float32). Averaged in bf16, every step of the ring rounds a partial sum to bf16's 8 bits
# of precision (7 stored), an error that grows with the ranks; in fp32 only the finished mean is
# rounded, once, for twice the bytes.
REDUCE_DTYPE = "fp32"


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an optimizer updates `dtype` weights in, and gradients are summed and squared in:
    fp32 for fp32/bf16/fp16 (mixed_precision.py's masters), fp64 for fp64 (nothing in a strategy
    depends on fp32: fp64 runs it with every sum exact to 1e-16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dtype_facts(dtype: torch.dtype) -> dict:
    """Bits, eps (the gap above 1.0), smallest normal number and largest finite number."""
    info = torch.finfo(dtype)
    return {"bits": info.bits, "eps": info.eps, "smallest_normal": info.smallest_normal,
            "max": info.max}


def _show(x: torch.Tensor) -> str:
    return f"{x.float().item():.4g}"


def demonstrate():
    """Print the facts, then the lecture's three cases: precision, range, and loss scaling."""
    print(f"{'dtype':6} {'bits':>4} {'eps':>10} {'smallest normal':>16} {'max':>10}")
    for name in ("fp32", "fp16", "bf16"):
        f = dtype_facts(DTYPES[name])
        print(f"{name:6} {f['bits']:>4} {f['eps']:>10.3e} {f['smallest_normal']:>16.3e} {f['max']:>10.3e}")
    fp16, bf16 = torch.float16, torch.bfloat16
    print("\nprecision: 1.0001 is 1 + 1e-4, and 1e-4 is less than half of fp16's eps")
    print(f"  1.0001 in fp16 -> {_show(torch.tensor(1.0001, dtype=fp16))}")
    grad = torch.tensor(1e-8)
    print("range: a gradient of 1e-8 is under half of fp16's smallest subnormal (2**-24), "
          "far above bf16's")
    print(f"  1e-8 in fp16 -> {_show(grad.to(fp16))}")
    print(f"  1e-8 in bf16 -> {_show(grad.to(bf16))}")
    scaled = (grad * 2**16).to(fp16)                       # what backward computes with scaling
    print("loss scaling: multiply by 2**16 before fp16, divide in fp32 after")
    print(f"  1e-8 * 2**16 in fp16 -> {_show(scaled)}, / 2**16 in fp32 -> {_show(scaled.float() / 2**16)}")


if __name__ == "__main__":
    demonstrate()
