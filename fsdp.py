"""FSDP = ZeRO stage 3: shard the parameters too, and gather each unit only while it computes.

ZeRO stage 3 (Rajbhandari et al. 2020, 5.3), built as PyTorch's FSDP (Zhao et al. 2023, 3-4):
each unit of the model (a transformer block; the rest is the root unit) is one flat parameter
sharded 1/N. A unit's life in a training step, as FSDP below writes it:
    forward    all-gather its flat parameter (the next unit's starts meanwhile) -> compute -> free
    backward   all-gather it again -> compute -> free -> reduce-scatter its gradient
    step       on this rank's shard alone, no collective: any torch optimizer over FSDP.parameters(),
               the fp32 master shards (the demonstration's AdamW, at the end), as with fully_shard
3 (N-1)/N of the model on the wire per step, 1.5x DDP, for 1/N of every byte of training state:
a little less, as the root unit is gathered once; with gradients and parameters in one dtype
(bf16 gathers and an fp32 reduce, train.py's default for bf16, make it about 1x). Skip mechanics/fsdp_state.py (the wrap, the checks, what the program reads).
Read after: mechanics/fsdp_optimizer.py, extensions/fsdp_hybrid.py (HSDP), fsdp_offload.py, fsdp_frozen.py.
Left out: a stream of our own (NCCL's async collectives run on theirs), FSDP1's state API.
Run alone: torchrun --nproc_per_node 2 fsdp.py; test: python -m pytest tests/test_fsdp.py

Shapes: N ranks (of a shard group), r this rank, P elements in a unit, S = ceil(P / N) per shard.
"""
import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from foundations.alone import start_alone
from foundations.flat import FlatParams, InOrder
from mechanics.fsdp_state import FSDPState


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mp_policy: param_dtype, what units compute in and all-gather (None: fp32); reduce_dtype,
    what gradients are reduce-scattered in (None: param_dtype; fp32 under bf16/fp16: fewer roundings
    for twice the bytes). The master shards stay fp32 either way (an fp64 model's: fp64)."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


class Unit(FlatParams):
    """One FSDP unit: the parameters of a module (minus nested units') as one flat parameter.

        master  (S,)    fp32, this rank's shard: the nn.Parameter the optimizer updates
        flat    (N*S,)  compute dtype, gathered; its storage is resized to 0 between uses, and
                        the module's parameters stay views of it, so the module code never changes
    comm: the ranks it is sharded over; its gradient is reduce-scattered over them by `op`, then
    divided by `divide` (avg and 1: the mean; an expert's unit has its own, mechanics/fsdp_state.py)."""

    def __init__(self, index, module, params, comm, compute_dtype, device):
        super().__init__(params, comm.world_size)          # self.flat: (N*S,) fp32, params view it
        self.index, self.module, self.comm = index, module, comm
        flat = self.flat.to(device)          # one unit at a time on the device, never the model
        comm.broadcast(flat, src=0)          # ranks seeded differently: all start as rank 0's
        self.master = nn.Parameter(self.shard(flat, comm.rank).clone())        # (S,) fp32
        # The whole fp32 unit goes: the flat is now the compute-dtype buffer the all-gathers fill.
        self.flat = torch.empty(flat.numel(), dtype=compute_dtype, device=device)
        for p, view in zip(self.params, self.views(self.flat)):
            p.data = view
        self.flat.untyped_storage().resize_(0)
        self.gathering, self.gathered = (), False
        self.used = [False] * len(self.params)     # got a gradient since .grad was None (zero_grad)

    @property
    def grad(self):
        """(S,) fp32, this rank's reduced (accumulated) gradient: the master's .grad, for any optimizer."""
        return self.master.grad

    @grad.setter
    def grad(self, value):
        self.master.grad = value

    def to_send(self) -> torch.Tensor:
        """This rank's shard in the compute dtype, what its all-gather sends: (S,)."""
        return self.master.detach().to(self.flat.dtype)

    def sends(self) -> list[tuple]:
        """(this rank's shard, the flat its all-gather fills) for each flat buffer."""
        return [(self.to_send(), self.flat)]                                  # (S,) -> (N*S,)

    def flats(self) -> list[torch.Tensor]:
        return [self.flat]

    def kept(self) -> list[torch.Tensor]:
        """The shards kept between uses besides the master: none (the gathers send the master)."""
        return []

    def all_gather(self):
        """Launch (async) the all-gathers that fill each flat from every rank's shard."""
        self.gathering = []
        for shard, flat in self.sends():
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            self.gathering.append((self.comm.all_gather(flat, shard, async_op=True), shard))  # shard kept until sent
        self.gathered = True

    def wait(self):
        for handle, _ in self.gathering:
            handle.wait()
        self.gathering = ()

    def free(self):
        self.wait()
        for flat in self.flats():
            flat.untyped_storage().resize_(0)
        self.gathered = False

    def refresh(self):
        """The master changed (a step, a checkpoint's load): a copy still gathered is stale."""
        self.free()


class FSDP(FSDPState, nn.Module):
    """Wrap `module` in FSDP units; `.module` runs unchanged, `.parameters()` are the fp32 master
    shards, each .grad its reduced gradient after finish_gradient_sync(): any optimizer steps them.

    module: fp32, every parameter trained (a frozen base: extensions/fsdp_frozen.py). wrap: True for
    each submodule that becomes a unit (None: the GPT's blocks); the rest, and any parameter two
    units share (tied weights), is the root unit. mp_policy: the dtypes units compute and gather in
    and reduce in (fp32 by default). group: a collectives.Comm, a process group or None (the world).
    prefetch: units gathered ahead of the one computing (0: none). device: where shards and gathered
    units live (default: the module's; a model built on the CPU visits it unit by unit). FSDPState
    (mechanics/fsdp_state.py: skip it at first) wraps, checks, and offers what the program reads."""

    keeps_whole_gradients = False       # flat.GradientSyncs: each unit's reduced, then freed
    unit_type = Unit                    # what the wrap builds (extensions/fsdp_frozen.py's: its own)

    def __init__(self, module: nn.Module, wrap=None, mp_policy: MixedPrecisionPolicy | None = None,
                 group=None, prefetch: int = 1, device=None):
        super().__init__()
        policy = mp_policy or MixedPrecisionPolicy()
        # None: the masters' own, fp32 (fp64 for an fp64 model: where a strategy is checked exactly)
        trained = next((p.dtype for p in module.parameters() if p.requires_grad), torch.float32)
        self.compute_dtype = policy.param_dtype or (torch.float64 if trained == torch.float64
                                                    else torch.float32)
        self.reduce_dtype = policy.reduce_dtype or self.compute_dtype
        self.prefetch = prefetch
        # FSDPState checks the arguments (the same model on every rank): the group's Comm, the device.
        self.comm, self.device = self._checked(module, group, device)
        object.__setattr__(self, "module", module)   # not a submodule: parameters() are the shards
        # FSDPState's wrap: order, one Unit per module wrap(m) picks, in forward order; roots, [] or
        # [the root unit], every other parameter, gathered from forward's start to backward's end.
        self.roots, self.order = self._wrap(module, wrap)
        self.units = [u for u in self.roots + self.order if u.params]     # those that train
        self.root = next((u for u in self.roots if u.params), None)       # the root, if it trains
        # The reduce-scatters' order, the same on every rank: backward's (self.order reversed), root last.
        self.reduce_order = [u for u in self.order[::-1] if u.params] + ([self.root] if self.root else [])
        # At most FSDPState's reductions_in_flight (2) whole gradients wait for the wire (a third
        # waits for the oldest): memory bounded, the link kept busy.
        self._reductions = InOrder(self.reduce_order, self._reduce_scatter, self._retire,
                                   max_in_flight=self.reductions_in_flight)
        self.shards = nn.ParameterList([u.master for u in self.units])    # FSDP.parameters()
        module.to(self.device)            # the buffers; the parameters are there already
        for unit in self.order:
            unit.module.register_forward_pre_hook(lambda m, args, u=unit: self._before_forward(u))
            unit.module.register_forward_hook(lambda m, args, out, u=unit: self._after_forward(u, out))
        self._hook_gradients()
        self._backward_hooked = False
        self._sync = True                # False under no_sync(): gradients kept whole, reduced later
        self._unreduced = False          # the last backward ran under no_sync: gradients to reduce
        self._keep_gathered = False      # nothing freed: inside gathered_for_step() (a pipeline's)
        self._used_agreed = False        # this backward's used-flags OR'ed over the ranks
        self.events = []                 # this step's order of collectives and computation
        self.peak_gathered_bytes = 0     # most bytes of gathered units held at once, ever

    # ---- a unit's life: forward ----------------------------------------------------------------
    #   compute     | unit 0 fwd | unit 1 fwd | unit 2 fwd |      (prefetch = 1)
    #   network  |ag 0|ag 1 ......|ag 2 .......|ag 3 .......|
    #   memory      unit i and unit i+1 gathered; unit i freed as its forward returns

    def forward(self, *args, **kwargs):
        self.events = []
        for root in self.roots:                 # gathered for the whole step
            self._gather(root)
            root.wait()
        self._prefetch(-1, +1)                  # the first units, ahead of the first forward
        out = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            for root in self.roots:
                self._free(root)                     # no backward will come to free it
        return out

    def _before_forward(self, unit):
        """All-gather the unit (unless prefetched), wait for it; start the next one's gather."""
        self._gather(unit)
        unit.wait()
        self.events.append(("forward", unit.index))
        self._prefetch(self.order.index(unit), +1)    # overlaps with this unit's compute

    def _after_forward(self, unit, output):
        """Free it; its backward starts when the gradient of its output arrives: a hook on each
        output tensor (the first to fire gathers the unit; _gather skips it for the others)."""
        self.events.append(("forward done", unit.index))
        self._free(unit)
        if torch.is_grad_enabled():
            for t in tree_leaves(output):          # a tensor, or any tuple, list or dict of them
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, u=unit: self._before_backward(u))
        return output

    # ---- a unit's life: backward ---------------------------------------------------------------
    #   compute     | unit 2 bwd | unit 1 bwd | unit 0 bwd |
    #   network  |ag 2|ag 1 ......|ag 0 ......|
    #                        |rs 2 .....|rs 1 .......|rs 0|   (in flight: at most 2)

    def _before_backward(self, unit):
        """All-gather it again (its backward needs the weights); start the previous one's."""
        self._hook_end_of_backward()
        self._gather(unit)
        unit.wait()
        self.events.append(("backward", unit.index))
        self._prefetch(self.order.index(unit), -1)

    def _hook_gradients(self):
        """Have autograd call _gradient_ready(k, i) as it accumulates parameter i's gradient of unit k
        (FlatParams' hook: it holds FSDP weakly, so a wrapped model is still freed)."""
        for k, unit in enumerate(self.units):
            unit.hook_gradients(self._gradient_ready, k)

    def _gradient_ready(self, k: int, i: int):
        """Autograd accumulated a gradient (the i-th) of unit k; with its last one, the unit's backward is
        done. A parameter this backward does not use holds it (and, in reduce_order, the units after
        it) back until the end of backward: _finish_backward launches it."""
        unit = self.units[k]
        self._hook_end_of_backward()
        unit.pending -= 1                # its gradients still to come (FlatParams' count)
        if unit.pending == 0:
            unit.pending = len(unit.params)
            self._after_backward(unit)

    def _after_backward(self, unit):
        """Free it, and reduce-scatter its gradient: in reduce_order on every rank (flat.InOrder)."""
        self._free_after_backward(unit)
        self._reductions.ready(unit)             # -> _reduce_scatter(unit), when its turn comes

    def _reduce_scatter(self, unit):
        """Launch the reduce-scatter of unit's gradient, unless no_sync: each rank receives its
        shard of the sum (the mean: op avg). Returns (handle, output, used), or None."""
        started = None
        self._unreduced = not self._sync
        if self._sync:
            # A fresh (N*S,) buffer (zeros_like reads unit.flat's shape, not its freed storage), each
            # .grad (autograd's own tensor) copied in: the unit's whole gradient lives until its retire.
            grad = torch.zeros_like(unit.flat, dtype=self.reduce_dtype)
            used = [p.grad is not None for p in unit.params]
            for p, view in zip(unit.params, unit.views(grad)):
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = None
            output = grad.new_empty(unit.master.shape)     # (S,), on the gradient's device
            started = unit.comm.reduce_scatter(output, grad, op=unit.op, async_op=True), output, used
            self.events.append(("reduce-scatter", unit.index))
        self._free_after_backward(unit)   # again: a unit launch_rest launched skipped _after_backward
        return started

    def _retire(self, unit, started):
        handle, output, used = started
        handle.wait()
        self._add_gradient(unit, output, used)

    def _add_gradient(self, unit, output, used):
        """The reduce-scatter's output (S,), in the reduce dtype, joins the shard's gradient."""
        grad = output.to(unit.master.dtype)   # upcast after the wire: accumulation, update in fp32
        if unit.divide != 1:
            grad.div_(unit.divide)
        # The first reduction since .grad was None (a plain optimizer's zero_grad too) starts
        # the flags afresh; a later one (accumulation) adds its own. Retired in launch order.
        unit.used = used if unit.grad is None else [a or b for a, b in zip(unit.used, used)]
        unit.grad = grad if unit.grad is None else unit.grad.add_(grad)

    def _finish_backward(self):
        """Every rank launches every unit's reduce-scatter, its gradients come or not (order matches them)."""
        self._reductions.launch_rest()
        for unit in self.units:
            unit.pending = len(unit.params)
        self._backward_hooked = False
        self._used_agreed = False

    def finish_gradient_sync(self):
        """Wait for the outstanding reduce-scatters: each shard in FSDP.parameters() then holds its
        fp32 averaged gradient in .grad, for any torch.optim optimizer. Gradients accumulated
        under no_sync with no backward after it (a zero-bubble pipeline's W) are reduced now."""
        if self._unreduced:
            self._reductions.launch_rest()
        self._reductions.wait_all()
        if self._sync and not self._used_agreed:
            self._agree_used()      # a unit no rank used gets .grad None: an optimizer skips it
            self._used_agreed = True

    # ---- a unit's step: on its shard, no collective ----------------------------------------------
    #   FSDP.parameters() are the masters, (S,) fp32, each .grad its reduced gradient shard: any torch
    #   optimizer steps them (the demonstration's AdamW, below), its state 1/N of the model's too; the
    #   next all-gathers send the stepped shards. mechanics/fsdp_optimizer.py adds loss scale, clipping.

    # ---- the mechanics: gather, prefetch, free -------------------------------------------------

    def _gather(self, unit):
        """Launch unit's all-gathers, unless it is gathered or on its way."""
        if unit.gathered:
            return
        unit.all_gather()
        self.events.append(("all-gather", unit.index))
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, sum(          # the roots too
            flat.untyped_storage().nbytes() for u in self.roots + self.order for flat in u.flats()))

    def _prefetch(self, position: int, step: int):
        """Gather the `prefetch` units after order[position] (step +1: forward's way, -1: backward's)
        while at most `prefetch` others are gathered: 1 + prefetch at once (the roots do not count)."""
        for ahead in range(position + step, position + step * (self.prefetch + 1), step):
            if not 0 <= ahead < len(self.order) or sum(u.gathered for u in self.order) > self.prefetch:
                return
            self._gather(self.order[ahead])

    def _free(self, unit):
        if not self._keep_gathered:
            unit.free()

    def _free_after_backward(self, unit):      # its gradients are out: it goes, as after its forward
        self._free(unit)

    def _hook_end_of_backward(self):
        """Have autograd call _finish_backward once, when this backward pass ends."""
        if not self._backward_hooked:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._backward_hooked = True


# ---- run alone: torchrun --nproc_per_node 2 fsdp.py ------------------------------------------

_SAID = {"all-gather": "all-gather launched", "forward": "gathered: forward", "forward done": "freed",
         "backward": "gathered: backward",
         "reduce-scatter": "gradient reduce-scatter launched (freed as its backward ended)"}
# The root unit is gathered once for the whole step, and reduce-scattered after every other unit:
# a parameter it holds may be used anywhere in the model (a tied embedding), so its gradient is
# whole only when backward ends.
_SAID_ROOT = {"all-gather": "all-gather launched (the root: kept gathered until backward ends)",
              "reduce-scatter": "gradient reduce-scatter launched (the root's last: its gradient is "
                                "whole only when backward ends)"}


def _demonstrate(steps: int = 3, lr: float = 1e-2, rows: int = 8):
    """Three blocks as units, and a root, trained on 2 ranks by a plain AdamW on the shards; beside
    it one process's AdamW on the whole batch, its loss the mean of the two halves' means: the
    ranks' fp32 sums in the same order (one forward of all rows would reorder them), so equal."""
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3)]
    model = nn.Sequential(*blocks, nn.Linear(16, 4))
    alone = copy.deepcopy(model)                                  # the one process
    fsdp = FSDP(model, wrap=lambda m: m in blocks)
    step_on_shards = torch.optim.AdamW(fsdp.parameters(), lr=lr)    # this rank's fp32 shards only
    step_alone = torch.optim.AdamW(alone.parameters(), lr=lr)
    x, y = torch.randn(n * rows, 16), torch.randn(n * rows, 4)    # the whole batch, on every rank
    halves = [slice(r * rows, (r + 1) * rows) for r in range(n)]  # rank r's rows
    for step in range(steps):
        nn.functional.mse_loss(fsdp(x[halves[rank]]), y[halves[rank]]).backward()
        fsdp.finish_gradient_sync()             # each shard's .grad: its averaged gradient shard
        if step == 0 and rank == 0:
            print("FSDP's first step on rank 0 (unit 0 is the root: it holds the last Linear)")
            print("\n".join(f"  unit {i}: {(_SAID_ROOT if i == 0 else _SAID)[what]}"
                            for what, i in fsdp.events))
        (sum(nn.functional.mse_loss(alone(x[h]), y[h]) for h in halves) / n).backward()
        for optimizer in (step_on_shards, step_alone):
            optimizer.step()
            optimizer.zero_grad()
    held, whole = sum(p.numel() for p in fsdp.parameters()), sum(p.numel() for p in alone.parameters())
    sharded = fsdp.full_state_dict(all_ranks=True)                # collective: the whole model
    difference = max((sharded[name] - p).abs().max().item() for name, p in alone.named_parameters())
    if rank == 0:
        print(f"rank 0 holds {4 * held} of the model's {4 * whole} bytes of fp32 parameters (1/{n}, padded "
              f"to equal shards), and AdamW's two moments of those only\nmax |difference| from one process after "
              f"{steps} AdamW steps: {difference:.1e} (bound 0: the same fp32 sums in the same order)", flush=True)
    dist.destroy_process_group()
    os._exit(int(difference > 0))  # at once: gloo's threads may still hold tensors (exit_distributed)


if __name__ == "__main__":
    start_alone(torchrun=True, worlds=(2,))      # 2 halves' sums add in one order: bit for bit
    _demonstrate()
