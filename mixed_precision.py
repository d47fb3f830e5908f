"""Mixed precision: compute in 16 bits, keep the weights and their updates in 32.

Forward and backward run in fp16 or bf16; the optimizer updates an fp32 master copy of
each weight (Micikevicius et al. 2018, "Mixed Precision Training", 3.1) and fp16's narrow
range is stretched by a dynamic loss scale that backs off on overflow (3.2). bf16 keeps
fp32's exponent and needs no scaling (Kalamkar et al. 2019).
DynamicLossScaler and unscale_grads are the two pieces every optimizer of the project uses;
MixedPrecisionOptimizer puts them together with one fp32 master per parameter.
Left out: fp8, and autocast's per-op casting (here the whole model is in one dtype; autocast
keeps fp32 weights and casts each op's inputs instead, so it needs no master copy).
The formats' facts, and why fp16 needs a loss scale, are in foundations/dtypes.py (read first).
Run alone: python mixed_precision.py; test: python -m pytest tests/test_mixed_precision.py
"""
import copy
import math

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from foundations.comm import Comm
from foundations.alone import start_alone
from foundations.dtypes import DTYPES, demonstrate
from foundations.inner_optimizer import MasterWeightsOptimizer


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
    """Give each master the gradient grad / scale in the master's dtype; return them.

    grads[i] is the low-precision gradient for masters[i] (a model parameter's .grad, or a
    shard of a flat gradient buffer). A master that already holds grad as its own .grad
    (fp32 or fp64 training: the parameter is its own master) is unscaled in place, without a copy.
    """
    for grad, master in zip(grads, masters):
        if master.grad is not grad:              # not its own master (a 16-bit parameter):
            # Upcast before dividing: dividing in fp16 would push the small gradients that
            # the scale rescued straight back under fp16's smallest normal.
            master.grad = grad.to(master.dtype)
        if scale != 1.0:
            master.grad.div_(scale)
    return [master.grad for master in masters]


class MixedPrecisionOptimizer(MasterWeightsOptimizer):
    """fp32 master weights and loss scaling around any torch optimizer, one master per parameter.

    params: the model's parameters, already in the dtype of `precision` ("fp32", "bf16", "fp16",
    "fp64" for exact checks); those with requires_grad=False (frozen) are left out. The inner
    optimizer is optimizer_cls(masters, **optimizer_kwargs): its param_groups and state are this
    optimizer's own, so an lr scheduler drives it. For fp32 (and fp64) the parameters are their
    own masters: no copy.
    comm: a foundations/comm.py Comm or process group over ranks whose gradients may differ, to
    agree on skipping; None when there is one rank or the gradients are already averaged.
    scaler: default DynamicLossScaler, enabled only for fp16. In every precision a step whose
    gradients hold an inf/NaN is skipped (torch's GradScaler(enabled=False) would apply it).
    Loop: zero_grad(); scale_loss(loss).backward(); clip_grad_norm_(max_norm) if clipping; step().
    Compute the loss in fp32 (cast the logits first): a 16-bit loss x 2**16 overflows at 65504.
    A closure passed to step() calls scale_loss itself.
    """

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, precision: str = "fp32",
                 comm=None, scaler: DynamicLossScaler | None = None, **optimizer_kwargs):
        if precision not in DTYPES:
            raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[precision]
        params = list(params)
        if any(isinstance(p, dict) for p in params):   # one master each: no groups of settings
            raise ValueError("MixedPrecisionOptimizer takes the model's parameters (e.g. "
                             "model.parameters()), not parameter-group dicts: its options apply "
                             "to all of them")
        self.params = [p for p in params if p.requires_grad]
        for p in self.params:
            if p.dtype != dtype:
                raise ValueError(f"precision {precision!r} needs {dtype} parameters, got "
                                 f"{p.dtype}: cast the model first, e.g. model.to({dtype})")
        # A 16-bit parameter gets an fp32 copy (.float() copies), the master the step updates;
        # the parameter is then overwritten from it. In fp32 (fp64) the parameter is its own master.
        own = dtype in (torch.float32, torch.float64)
        self.masters = [p if own else p.detach().float().requires_grad_() for p in self.params]
        # device: where a mesh's norm is made (composition/mesh_optimizer.py reads its first part's)
        self.precision, self.device = precision, self.params[0].device if self.params else None
        self.comm = Comm.from_group(comm) if comm is not None else None
        self.scaler = scaler or DynamicLossScaler(enabled=precision == "fp16")
        # The inner optimizer sees only the masters. This optimizer shares its param_groups and
        # state, so an lr scheduler that sets group["lr"] here sets it for the inner step.
        inner = optimizer_cls(self.masters, **optimizer_kwargs)
        torch.optim.Optimizer.__init__(self, inner.param_groups, inner.defaults)
        # Once self.optimizer is set, add_param_group refuses (MasterWeightsOptimizer): a group
        # added here would miss its masters.
        self.state, self.optimizer = inner.state, inner
        self.last_grad_norm: float | None = None     # before clipping; inf/NaN on a skipped step
        self.last_step_skipped = False               # the last step found inf/NaN and did nothing
        self._norm = None                            # the global norm, from clipping to step()
        self._unscaled = False                       # the masters hold this step's gradients

    sharded = False                                  # every rank holds every master

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(loss)

    # ---- the step, as the lecture draws it ---------------------------------------------------

    def step(self, closure=None):
        """The lecture's step: the 16-bit gradients / the loss scale into the fp32 masters, then
        the global norm, which is inf/NaN if any gradient overflowed. Overflow: skip the step.
        Else the inner optimizer steps the masters and they are rounded into the model.
        Last, the loss scale backs off after an overflow or counts one more clean step.
        Clipping, if the loop asked for it, ran before (clip_grad_norm_), by the same norm."""
        with torch.enable_grad():
            loss = None if closure is None else closure()
        self.unscale_gradients()                       # once a step: clipping may have done it
        norm = self.global_norm().item()               # the step's one device-to-host read
        self.update(norm)                              # skip, or step the masters
        self.scaler.update(self.last_step_skipped)     # back off, or count a clean step
        return loss

    def global_norm(self) -> torch.Tensor:
        """The 2-norm of this rank's unscaled gradients, a device scalar.

        One inf/NaN element makes it inf/NaN, so it doubles as the overflow check. With comm,
        the ranks share only that check: if any rank overflowed, every rank's norm is inf and
        every rank skips. (Under DDP the gradients, hence the norms, are already equal.)"""
        if self._norm is None:
            norm = get_total_norm(self.unscale_gradients())
            if self.comm is not None:
                # Skipped on some rank: skipped here too. The flag's max over the ranks stays on
                # the device (no host read before step()'s own).
                flag = (~torch.isfinite(norm)).float().reshape(1)
                self.comm.all_reduce(flag, op="max")
                norm = torch.where(flag[0] > 0, torch.full_like(norm, float("inf")), norm)
            self._norm = norm
        return self._norm

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so their global 2-norm is at most max_norm; returns the norm
        before clipping. No host read here: an inf/NaN norm makes step() skip anyway."""
        if max_norm <= 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
        norm = self.global_norm()
        self.clip(max_norm, norm)
        return norm

    # ---- the phases, public: composition/mesh_optimizer.py runs them with a mesh's norm -----

    def unscale_gradients(self) -> list:
        """Give each master with a gradient this step grad.float() / scale; return those."""
        # A parameter without a gradient keeps master.grad None, so the inner optimizer skips
        # it exactly as it would skip a plain parameter.
        if not self._unscaled:
            unscale_grads([p.grad for p, _ in self._with_grad()], self._with_grad_masters(),
                          self.scaler.scale)
            self._unscaled = True
        return [m.grad for m in self._with_grad_masters()]

    def norm_pieces(self, weight_of=None) -> list:
        """[(unscaled gradient, weight_of(param), default 1)]: what a mesh's norm sums."""
        grads = self.unscale_gradients()
        return [(grad, 1.0 if weight_of is None else weight_of(p))
                for (p, _), grad in zip(self._with_grad(), grads)]

    def clip(self, max_norm: float, norm: torch.Tensor):
        """Scale the unscaled gradients by min(1, max_norm / norm)."""
        clip_grads_with_norm_(self._with_grad_masters(), max_norm, norm)

    @torch.no_grad()
    def update(self, norm: float, used=None):
        """Given the global norm, read on the host: skip, or step the masters and round them
        into the parameters. Then drop the fp32 gradients. (used: a sharded optimizer's
        update takes it, the mesh passes it to every part; unused here.)"""
        self.last_grad_norm = norm
        self.last_step_skipped = not math.isfinite(norm)
        if not self.last_step_skipped:
            self.optimizer.step()
            for p, m in self._with_grad():
                if m is not p:
                    p.copy_(m)                 # round to 16 bits for the next forward
        self._release()

    def _with_grad(self) -> list:
        return [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]

    def _with_grad_masters(self) -> list:
        return [m for _, m in self._with_grad()]

    def _release(self):
        # The fp32 gradients live only inside step(): between steps a rank holds the 2-byte
        # gradients of the lecture's 2 + 2 + 12 bytes per parameter, not 4 more.
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None
        self._norm, self._unscaled = None, False

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._release()

    # ---- bookkeeping (state_dict, load_state_dict, state_tensors: MasterWeightsOptimizer's) ----

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


def check_against_fp32(precision: str = "bf16", steps: int = 5, lr: float = 1e-2) -> float:
    """A few nn.Linear trained `steps` steps in `precision` with fp32 masters, beside the same
    model trained by plain torch AdamW in fp32 in one process: max |master - fp32 weight|."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 1))
    model = copy.deepcopy(reference).to(DTYPES[precision])
    plain = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.0)
    ours = MixedPrecisionOptimizer(model.parameters(), precision=precision, lr=lr, weight_decay=0.0)
    for _ in range(steps):
        x, y = torch.randn(64, 16), torch.randn(64, 1)
        runs = ((reference, plain, torch.float32), (model, ours, DTYPES[precision]))
        for net, opt, dtype in runs:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x.to(dtype)).float(), y)
            (ours.scale_loss(loss) if opt is ours else loss).backward()
            opt.step()
    return max((m - p).abs().max().item() for m, p in zip(ours.masters, reference.parameters()))


if __name__ == "__main__":
    start_alone()
    demonstrate()          # foundations/dtypes.py: what fp16 loses, and what a loss scale gets back
    steps, lr, failed = 5, 1e-2, False
    # 16-bit rounding perturbs AdamW's normalized steps, not their size (about lr each): the runs
    # part by a few hundredths of lr x steps or less (measured: bf16 8.2e-4, fp16 9.2e-5, against
    # lr x steps = 5e-2), while a master that missed its updates would be off by about lr x steps.
    # A quarter of it tells them apart.
    bound = lr * steps / 4
    for precision in ("bf16", "fp16"):
        difference = check_against_fp32(precision, steps, lr)
        failed |= not difference <= bound
        print(f"{precision} with fp32 masters, {steps} AdamW steps: max |difference| from one "
              f"process in fp32: {difference:.2e} (bound {bound:.2e}: a quarter of lr x steps, "
              f"what updates move)")
    raise SystemExit(1 if failed else 0)
