"""Mixed precision: compute in 16 bits, keep the weights and their updates in 32.

Forward and backward run in fp16 or bf16; the optimizer updates an fp32 master copy of
each weight (Micikevicius et al. 2018, "Mixed Precision Training", 3.1) and fp16's narrow
range is stretched by a dynamic loss scale that backs off on overflow (3.2). bf16 keeps
fp32's exponent and needs no scaling (Kalamkar et al. 2019). Left out: autocast's per-op
casting (the whole model is in one dtype) and fp8.
Run: python mixed_precision.py; test: python -m pytest tests/test_mixed_precision.py
"""
import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from collectives import Comm, as_comm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_facts(dtype: torch.dtype) -> dict:
    """Bits, eps (the gap above 1.0), smallest normal number and largest finite number."""
    info = torch.finfo(dtype)
    return {"bits": info.bits, "eps": info.eps, "smallest_normal": info.smallest_normal,
            "max": info.max}


class DynamicLossScaler:
    """The loss scale of section 3.2, found at run time instead of picked by hand.

    Start high; a step whose gradients overflow is skipped and the scale shrinks by
    backoff_factor; after growth_interval clean steps in a row it grows by growth_factor,
    probing for the largest scale that does not overflow. The same rule, and the same
    defaults, as torch.amp.GradScaler. Disabled (bf16, fp32): the scale is 1 and never moves.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        self.enabled = enabled
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._scale = float(init_scale)
        self._clean_steps = 0

    @property
    def scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # Scaling the loss scales every gradient by the chain rule: small gradients move
        # up out of fp16's underflow zone before backward ever rounds them.
        return loss * self._scale if self.enabled else loss

    def update(self, found_inf: bool):
        if not self.enabled:
            return
        if found_inf:
            self._scale *= self.backoff_factor
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                self._scale *= self.growth_factor
                self._clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self._scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict):
        self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])


def unscale_grads(grads: list, masters: list, scale: float) -> list:
    """Give each fp32 master the gradient grad / scale in fp32; return the master gradients.

    grads[i] is the low-precision gradient for masters[i] (a model parameter's .grad, or a
    shard of a flat gradient buffer). A master that already holds grad as its own .grad
    (fp32 training: the parameter is its own master) is unscaled in place, without a copy.
    """
    for grad, master in zip(grads, masters):
        if master.grad is not grad:
            # Upcast before dividing: dividing in fp16 would push the small gradients that
            # the scale rescued straight back under fp16's smallest normal.
            master.grad = grad.float()
        if scale != 1.0:
            master.grad.div_(scale)
    return [master.grad for master in masters]


def found_overflow(grad_norm: torch.Tensor, comm: Comm | None = None) -> bool:
    """True if grad_norm is inf or NaN here or, with comm, on any rank of comm.

    One non-finite element makes the norm non-finite, so the norm doubles as the overflow
    check. Ranks whose gradients differ (before an all-reduce, or shards of them) must all
    skip or all step, else their weights drift apart: a max over a 0/1 flag agrees on it.
    """
    flag = (~torch.isfinite(grad_norm)).float()
    if comm is not None:
        comm.all_reduce(flag, op="max")
    return bool(flag.item())


class MixedPrecisionOptimizer:
    """fp32 master weights and loss scaling around any torch optimizer.

    params: the model's parameters, already in the dtype of `precision` ("fp32", "bf16"
    or "fp16"); those with requires_grad=False (frozen) are left out. The inner optimizer,
    optimizer_cls(masters, **optimizer_kwargs), is `.optimizer`; it only ever sees the fp32
    masters. For fp32 the parameters are their own masters: no copy, no extra bytes.
    comm: a collectives.Comm or process group over ranks whose gradients may differ, to
    agree on skipping; None when there is one rank or the gradients are already averaged.
    scaler: default DynamicLossScaler, enabled only for fp16.
    grad_norm: grad_norm(params, grads) -> the global norm, when the parameters are slices of
    larger ones (tensor parallelism); default: the norm of these gradients alone.

    Per step:  loss -> scale_loss -> backward (16-bit grads) -> step():
        master.grad = grad.float() / scale -> inf/NaN? skip, back off -> clip -> inner step
        -> copy masters into the 16-bit parameters -> grow the scale when due
    last_grad_norm: the norm of the unscaled fp32 gradients before clipping, every step
    (inf or NaN on a skipped step).
    """

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, precision: str = "fp32",
                 comm=None, scaler: DynamicLossScaler | None = None, grad_norm=None,
                 **optimizer_kwargs):
        if precision not in DTYPES:
            raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[precision]
        self.params = [p for p in params if p.requires_grad]
        for p in self.params:
            if p.dtype != dtype:
                raise ValueError(f"precision {precision!r} needs {dtype} parameters, got {p.dtype}: "
                                 f"cast the model first, e.g. model.to({dtype})")
        # .float() of a 16-bit tensor is a new fp32 leaf, never a view: the model's
        # parameters are overwritten from the masters after every step.
        self.masters = [p if dtype == torch.float32 else p.detach().float().requires_grad_()
                        for p in self.params]
        self.precision = precision
        self.comm = as_comm(comm) if comm is not None else None
        self.scaler = scaler if scaler is not None else DynamicLossScaler(enabled=precision == "fp16")
        self.optimizer = optimizer_cls(self.masters, **optimizer_kwargs)
        self.grad_norm = grad_norm
        self.last_grad_norm: float | None = None

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(loss)

    def step(self, clip_grad: float | None = None) -> bool:
        """Update the weights from the gradients of the scaled loss; False if skipped."""
        # A parameter without a gradient this step keeps master.grad None, so the inner
        # optimizer skips it exactly as it would skip a plain parameter.
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]
        masters = [m for _, m in pairs]
        grads = unscale_grads([p.grad for p, _ in pairs], masters, self.scaler.scale)
        # clip_grad_norm_ split in two: the same norm serves the overflow check and clipping.
        # (Finite gradients whose norm overflows fp32 are skipped too: no sane update there.)
        norm = (self.grad_norm([p for p, _ in pairs], grads) if self.grad_norm
                else get_total_norm(grads))
        skip = found_overflow(norm, self.comm)
        self.last_grad_norm = norm.item()
        if not skip:
            if clip_grad is not None:
                clip_grads_with_norm_(masters, clip_grad, norm)
            self.optimizer.step()
            with torch.no_grad():
                for p, m in pairs:
                    if m is not p:
                        p.copy_(m)                 # round to 16 bits for the next forward
        self._free_master_grads()
        self.scaler.update(skip)
        return not skip

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self._free_master_grads()

    def master_ranges(self) -> list[tuple]:
        """(param, start, stop, master, offset): where each parameter's fp32 master and its
        optimizer state live; here always the whole of it, in a master of its own."""
        return [(p, 0, p.numel(), m, 0) for p, m in zip(self.params, self.masters)]

    @torch.no_grad()
    def refresh_params(self):
        """After the masters were written (a loaded checkpoint): round them into the model."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)

    def _free_master_grads(self):
        # The fp32 gradients live only inside step(): between steps a rank holds the 2-byte
        # gradients of the memory table, not 4 more bytes per parameter.
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "masters": self.masters,
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict):
        masters = state["masters"]
        shapes = [tuple(m.shape) for m in masters]
        if shapes != [tuple(m.shape) for m in self.masters]:
            raise ValueError(f"the checkpoint holds {len(masters)} master weights that do not match "
                             f"this model's {len(self.masters)} trainable parameters: build the same "
                             f"model (and freeze the same parameters) before loading")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, masters):
                m.copy_(saved)
                if m is not p:
                    p.copy_(m)             # the model resumes from the masters' rounding


def _show(x: torch.Tensor) -> str:
    return f"{x.float().item():.4g}"


def main():
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
    main()
