"""Mixed precision: compute in 16 bits, keep the weights and their updates in 32.

Forward and backward run in fp16 or bf16; the optimizer updates an fp32 master copy of
each weight (Micikevicius et al. 2018, "Mixed Precision Training", 3.1) and fp16's narrow
range is stretched by a dynamic loss scale that backs off on overflow (3.2). bf16 keeps
fp32's exponent and needs no scaling (Kalamkar et al. 2019). MasterOptimizer, the base of every
optimizer in the project (ZeRO's and FSDP's too), is a torch.optim.Optimizer around any torch
optimizer on the masters: unscale, one global norm for clipping and the inf/NaN skip, the step.
Left out: autocast's per-op casting (the whole model is in one dtype) and fp8. The formats'
facts, and why fp16 needs a loss scale, are in dtypes.py (read first).
Run: python mixed_precision.py; test: python -m pytest tests/test_mixed_precision.py
"""
import contextlib
import math

import no_numpy  # noqa: F401  (first: torch warns as it is imported when numpy is absent)
import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from collectives import as_comm
from dtypes import DTYPES, demonstrate
from placements import grad_norm, norm_weight


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


class MasterOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer that runs any torch optimizer on fp32 master weights.

    The base of every optimizer in this project: MixedPrecisionOptimizer below (one master
    per parameter), ZeroOptimizer and FSDPOptimizer (one master shard per flat buffer, zero.py
    and fsdp_optimizer.py). `.optimizer`, the inner optimizer, only ever sees the masters; its
    param_groups and state are this optimizer's own, so an lr scheduler, a param-group edit or
    a look at the Adam moments works as on any torch optimizer. A subclass says where things are:
        _gradients() -> (grads, masters): this rank's gradients of the scaled loss and the
                        masters they update, only those that have one
        _total_norm(grads, masters) -> the whole model's gradient norm, the same on every rank
        _unused() -> [(master, start, stop)]: elements no rank computed a gradient for
        _write_back(): after the update, the model's parameters follow their masters
        _release(): drop what this step's gradients held
    Loop:  zero_grad(); scale_loss(loss).backward(); clip_grad_norm_(max_norm) if clipping; step()
    """

    def __init__(self, masters: list, optimizer_cls, optimizer_kwargs: dict,
                 scaler: DynamicLossScaler):
        self.optimizer = optimizer_cls(masters, **optimizer_kwargs)
        # The inner optimizer's group dicts themselves (add_param_group keeps the dict it is
        # given): a scheduler that sets group["lr"] here sets it for the inner step.
        super().__init__(self.optimizer.param_groups, self.optimizer.defaults)
        self.state = self.optimizer.state
        self.scaler = scaler
        self.last_grad_norm: float | None = None     # before clipping; inf/NaN on a skipped step
        self.last_step_skipped = False               # the last step found inf/NaN and did nothing
        self._unscaled = None                        # (masters, norm) between clipping and step
        self.split = {}                              # split_model()'s {mesh dim: group}

    def split_model(self, split: dict):
        """Where the model is split further than this optimizer's own ranks: {mesh dimension:
        its group} ("tp" tensor, "pp" pipeline, "ep" experts; None or one rank: not split). The
        global norm sums the pieces over them, each value counted once (placements.py's records
        say which parameter is sharded along which). Call once, before the first step."""
        self.split = {dim: group for dim, group in split.items()
                      if group is not None and group.world_size > 1}

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(loss)

    def add_param_group(self, param_group: dict):
        if hasattr(self, "scaler"):                  # after __init__: the masters are laid out
            raise ValueError(f"{type(self).__name__} lays out its fp32 masters once, when it is "
                             f"built: pass every parameter to the constructor")
        super().add_param_group(param_group)

    def _unscale(self):
        """Give the masters their fp32 gradients, divided by the loss scale; their global norm."""
        if self._unscaled is None:
            grads, masters = self._gradients()
            grads = unscale_grads(grads, masters, self.scaler.scale)
            self._unscaled = masters, self._total_norm(grads, masters)
        return self._unscaled

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so their global 2-norm is at most max_norm; returns the norm
        before clipping, over every rank's share. Call after backward, before step():
        torch.nn.utils.clip_grad_norm_ would see only this rank's (or no) gradients."""
        if max_norm <= 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
        masters, norm = self._unscale()
        # No check of the norm here (a host read): an inf or NaN norm makes step() skip anyway.
        clip_grads_with_norm_(masters, max_norm, norm)
        return norm

    def step(self, closure=None):
        """Update the masters from the gradients (skipped, on every rank, if any is inf/NaN),
        then the model's parameters from the masters. Returns closure()'s loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _, norm = self._unscale()
        # One non-finite element makes the norm non-finite: the norm doubles as the overflow
        # check, and as it is global, every rank takes the same decision without a message.
        # Reading it is the step's one device-to-host copy (a host sync on a GPU).
        self.last_grad_norm, self._flags_read = self._read_decision(norm)
        skip = self.last_step_skipped = not math.isfinite(self.last_grad_norm)
        if not skip:
            with keep_unchanged(self._unused(), self.optimizer.state):
                self.optimizer.step()
            self._write_back()
        self._release()
        self._unscaled = None
        self.scaler.update(skip)
        return loss

    def _read_decision(self, norm: torch.Tensor) -> tuple[float, list | None]:
        """The step's one device-to-host read: the norm, and in the same copy the flags a
        subclass wants on the host (_flags_to_read(), a device tensor, or None)."""
        flags = self._flags_to_read()
        if flags is None:
            return norm.item(), None
        norm, *flags = torch.cat([norm.reshape(1).float(), flags.float()]).tolist()
        return norm, flags

    def _flags_to_read(self):
        return None

    def _unused(self) -> list:
        return []

    def _release(self):
        pass

    def state_dict(self) -> dict:
        """This rank's optimizer: inner state, fp32 masters, loss scale (plus, sharded, which
        shard). train.py's checkpoints save by parameter name instead (snapshot.py)."""
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                "masters": [m.detach().clone() for m in self.masters], **self._shard_id()}

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        if self._shard_id() and (state["rank"], state["world_size"]) != tuple(self._shard_id().values()):
            raise ValueError(f"this state is rank {state['rank']} of {state['world_size']}'s shard; "
                             f"load it on rank {state['rank']} of a world of {state['world_size']}")
        if [m.shape for m in state["masters"]] != [m.shape for m in self.masters]:
            raise ValueError(f"the state holds {len(state['masters'])} master weights that do not "
                             f"match this optimizer's {len(self.masters)}: build the same model (and "
                             f"freeze the same parameters) before loading")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        for master, saved in zip(self.masters, state["masters"]):
            master.copy_(saved)
        self.refresh_params()                    # the model follows the masters

    def _shard_id(self) -> dict:
        return {}

    @property
    def sharded(self) -> bool:
        """Does each rank hold only its shard of the masters (ZeRO, FSDP), not all of them?"""
        return bool(self._shard_id())

    def state_tensors(self) -> list[torch.Tensor]:
        """What this optimizer holds per element: the fp32 masters and the inner optimizer's
        state. memory_math.held_bytes counts them."""
        return [*self.masters, *element_state(self.optimizer)]


def element_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """A torch optimizer's per-element state (Adam's moments), not its step counts."""
    return [v for s in optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


@contextlib.contextmanager
def keep_unchanged(ranges: list, state: dict):
    """Elements master[start:stop] of each (master, start, stop), and the same elements of the
    optimizer's per-element state (Adam's moments), come out as they went in.

    A flat master holds parameters that got no gradient beside ones that did. torch's
    optimizers skip a parameter whose .grad is None: no update, no weight decay, no moment
    change. A shard sees a zero gradient instead, which AdamW would still decay, so the
    elements are put back. (The shard's step count still advances: a parameter unused for
    some steps and then used again gets the bias correction of the shard's count.)
    """
    saved = []
    for master, start, stop in ranges:
        moments = {k: v[start:stop].clone() for k, v in state.get(master, {}).items()
                   if isinstance(v, torch.Tensor) and v.shape == master.shape}
        saved.append((master, start, stop, master.detach()[start:stop].clone(), moments))
    yield
    with torch.no_grad():
        for master, start, stop, values, moments in saved:
            master[start:stop] = values
            for key, v in state[master].items():
                if isinstance(v, torch.Tensor) and v.shape == master.shape:
                    # State the step created (the first one) starts from zero, as it would
                    # the first time this parameter has a gradient.
                    v[start:stop] = moments[key] if key in moments else 0


class MixedPrecisionOptimizer(MasterOptimizer):
    """fp32 master weights and loss scaling around any torch optimizer, one master per parameter.

    params: the model's parameters, already in the dtype of `precision` ("fp32", "bf16"
    or "fp16"); those with requires_grad=False (frozen) are left out. The inner optimizer is
    optimizer_cls(masters, **optimizer_kwargs). For fp32 the parameters are their own masters:
    no copy, no extra bytes.
    comm: a collectives.Comm or process group over ranks whose gradients may differ, to
    agree on skipping; None when there is one rank or the gradients are already averaged.
    scaler: default DynamicLossScaler, enabled only for fp16.
    split_model(): the mesh dimensions the parameters are split over (tensor parallelism's
    slices, a pipeline's stages, the experts), for the global norm; default: these gradients'.

    Per step:  loss -> scale_loss -> backward (16-bit grads) -> [clip_grad_norm_] -> step():
        master.grad = grad.float() / scale -> inf/NaN? skip, back off -> clip -> inner step
        -> copy masters into the 16-bit parameters -> grow the scale when due
    """

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, precision: str = "fp32",
                 comm=None, scaler: DynamicLossScaler | None = None, **optimizer_kwargs):
        if precision not in DTYPES:
            raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[precision]
        self.params = [p for p in parameters_only(params, "MixedPrecisionOptimizer") if p.requires_grad]
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
        super().__init__(self.masters, optimizer_cls, optimizer_kwargs,
                         scaler or DynamicLossScaler(enabled=precision == "fp16"))

    def _with_grad(self) -> list:
        # A parameter without a gradient this step keeps master.grad None, so the inner
        # optimizer skips it exactly as it would skip a plain parameter.
        return [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]

    def _gradients(self):
        pairs = self._with_grad()
        return [p.grad for p, _ in pairs], [m for _, m in pairs]

    def _total_norm(self, grads, masters):
        # (Finite gradients whose norm overflows fp32 are skipped too: no sane update there.)
        pieces = [(g, norm_weight(p, self.split)) for (p, _), g in zip(self._with_grad(), grads)]
        norm = (grad_norm(pieces, self.split.values(), self.params[0].device) if self.split
                else get_total_norm(grads))
        if self.comm is not None:
            # Skipped on some rank: skipped here too. The flag's max over the ranks stays on the
            # device (no host read before step()'s own).
            flag = (~torch.isfinite(norm)).float().reshape(1)
            self.comm.all_reduce(flag, op="max")
            norm = torch.where(flag[0] > 0, torch.full_like(norm, float("inf")), norm)
        return norm

    @torch.no_grad()
    def _write_back(self):
        for p, m in self._with_grad():
            if m is not p:
                p.copy_(m)                 # round to 16 bits for the next forward

    def _release(self):
        # The fp32 gradients live only inside step(): between steps a rank holds the 2-byte
        # gradients of the memory table, not 4 more bytes per parameter.
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._release()

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


# train.py's --reduce-dtype when not given, and memory.py's: gradients averaged across ranks in
# fp32 whatever the --precision (FSDP2's MixedPrecisionPolicy(reduce_dtype=torch.float32)).
REDUCE_DTYPE = "fp32"


def on_the_wire(grad: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    """What a collective reduces for a gradient buffer: the buffer itself, or an upcast copy.
    Averaged in bf16, every step of the ring rounds a partial sum to 8 bits of mantissa, an error
    that grows with the ranks; in fp32 only the finished mean is rounded, once (FSDP2's
    MixedPrecisionPolicy(reduce_dtype=torch.float32)), for twice the bytes."""
    return grad if reduce_dtype in (None, grad.dtype) else grad.to(reduce_dtype)


def parameters_only(params, who: str) -> list:
    """params as a list of tensors; our optimizers lay out their masters themselves, so they
    take one group of parameters (settings are keyword arguments), not group dicts."""
    params = list(params)
    if any(isinstance(p, dict) for p in params):
        raise ValueError(f"{who} takes the model's parameters (e.g. model.parameters()), not "
                         f"parameter-group dicts: its options apply to all of them")
    return params


if __name__ == "__main__":
    demonstrate()          # dtypes.py: what fp16 loses, and what a loss scale gets back
