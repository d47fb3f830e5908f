"""FSDP = ZeRO stage 3: shard the parameters too, and gather each unit only while it computes.

ZeRO stage 3 (Rajbhandari et al. 2020, 5.3), built as PyTorch's FSDP (Zhao et al. 2023, 3-4):
each unit of the model (a transformer block; the rest is the root unit) is one flat parameter
sharded 1/N. A unit's life in a training step, as FSDP below writes it:
    forward    all-gather its flat parameter (the next unit's starts meanwhile) -> compute -> free
    backward   all-gather it again -> compute -> free -> reduce-scatter its gradient
    step       on this rank's shard alone, no collective: any torch optimizer steps
               FSDP.parameters(), the fp32 master shards (the demonstration's AdamW, at the end),
               as with PyTorch's own FSDP2 (torch.distributed.fsdp.fully_shard). The lecture's
               "synchronization" after the step is the next forward's all-gathers.
Bytes on the wire per step: two all-gathers + one reduce-scatter = 3(N-1)/N x the model,
1.5x DDP's all-reduce (2(N-1)/N), in the same dtype; a little less, as the root unit is
gathered once. With bf16 gathers and an fp32 reduce (train.py's default for bf16), per
parameter 2 + 2 + 4 = 8 bytes against DDP's fp32 all-reduce, 4 + 4: about 1x. In return,
every rank holds only 1/N of every byte of training state.
Skip mechanics/fsdp_state.py (the wrap, the checks, what the program reads).
Two corner cases ride along the core path, and a first reading can skip them: the used-flags
(a parameter no rank used this step gets .grad None, as DDP's find_unused_parameters), and
an expert unit's `divide` (its gradient is summed over the ranks that hold it, then divided by
the data world: the same mean).
Read after: mechanics/fsdp_optimizer.py, extensions/fsdp_hybrid.py (HSDP),
extensions/fsdp_offload.py, extensions/fsdp_frozen.py.
Left out: a CUDA stream of our own for the collectives (NCCL's async collectives already run
on theirs), and FSDP1's state-dict API (torch's older FSDP class and its state_dict_type modes).
Run alone: torchrun --nproc_per_node 2 fsdp.py; test: python -m pytest tests/test_fsdp.py

Shapes: N ranks (of a shard group), r this rank, P elements in a unit, S = ceil(P / N) per shard.
"""
import contextlib
import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from foundations.alone import start_alone
from foundations.flat import FlatParams, InOrder
from mechanics.fsdp_state import FSDPState, FSDPTrace


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """The dtypes, as PyTorch's FSDP2 (fully_shard) names them in its mp_policy.
    param_dtype: what units compute in and all-gather (None: the model's, fp32 or fp64).
    reduce_dtype: what gradients are reduce-scattered in (None: param_dtype). Under bf16/fp16,
    pass fp32 (train.py does): fewer roundings for twice the bytes. The master shards stay fp32
    either way (an fp64 model's: fp64)."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


class Unit(FlatParams):
    """One FSDP unit: the parameters of a module (minus nested units') as one flat parameter.

        master  (S,)    fp32, this rank's shard: the nn.Parameter the optimizer updates
        flat    (N*S,)  compute dtype, gathered; its storage is resized to 0 between uses, and
                        the module's parameters stay views of it, so the module code never changes
    comm: the ranks it is sharded over; its gradient is reduce-scattered over them by `op`, then
    divided by `divide` (avg and 1: the mean; an expert's unit has its own, set by
    mechanics/fsdp_state.py)."""

    def __init__(self, index, module, params, comm, compute_dtype, device):
        super().__init__(params, comm.world_size)  # self.flat: (N*S,) params' dtype, they view it
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
        # ZeRO-Offload's MasterOnHost (mechanics/offload.py) once the master is on the host
        self.offloaded = None

    @property
    def grad(self):
        """(S,) fp32, this rank's reduced (accumulated) gradient: the master's .grad (on the
        device: an offloaded master's is MasterOnHost's)."""
        return (self.master if self.offloaded is None else self.offloaded).grad

    @grad.setter
    def grad(self, value):
        (self.master if self.offloaded is None else self.offloaded).grad = value

    # Hooks for subclasses (HSDP, frozen); here each is the trivial case.

    def to_send(self) -> torch.Tensor:
        """This rank's shard in the compute dtype, what its all-gather sends: (S,)."""
        if self.offloaded is not None:
            return self.offloaded.compute_shard
        return self.master.detach().to(self.flat.dtype)

    def sends(self) -> list[tuple]:
        """(this rank's shard, the flat its all-gather fills) for each flat buffer."""
        return [(self.to_send(), self.flat)]                                  # (S,) -> (N*S,)

    def flats(self) -> list[torch.Tensor]:
        return [self.flat]

    def kept(self) -> list[torch.Tensor]:
        """The shards kept between uses besides the master: none, or the offloaded one's."""
        return [] if self.offloaded is None else [self.offloaded.compute_shard]

    def all_gather(self):
        """Launch (async) the all-gathers that fill each flat from every rank's shard."""
        self.gathering = []
        for shard, flat in self.sends():
            # A shard kept in host memory (extensions/fsdp_offload.py) crosses to the device.
            shard = shard.to(flat.device, non_blocking=True)
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            handle = self.comm.all_gather(flat, shard, async_op=True)
            self.gathering.append((handle, shard))              # the shard kept until it is sent
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

    def refresh(self):                                          # a hook for subclasses too
        """The master changed (a step, a checkpoint's load): a copy still gathered is stale."""
        self.refresh_offloaded()
        self.free()

    def refresh_offloaded(self):                   # its compute shard copied from it again
        if self.offloaded is not None:
            self.offloaded.refresh(self.master)


class FSDP(FSDPState, nn.Module):
    """Wrap `module` in FSDP units; `.module` runs unchanged, `.parameters()` are the fp32 master
    shards, each .grad its reduced gradient after finish_gradient_sync(): any optimizer steps them.

    module: fp32 (or fp64), every parameter trained (a frozen base: extensions/fsdp_frozen.py).
    wrap: True for each submodule that becomes a unit (None: the GPT's blocks); the rest, and any
    parameter two units share (tied weights), is the root unit. mp_policy: the dtypes units
    compute and gather in and reduce in (the model's, fp32 or fp64, by default). group: a
    foundations/comm.py Comm, a process group or None (the world). prefetch: units gathered
    ahead of the one computing (0: none). device: where shards and gathered units live (default: the
    module's; a model built on the CPU visits it unit by unit). FSDPState
    (mechanics/fsdp_state.py: skip it at first) wraps, checks, and offers what the program reads."""

    keeps_whole_gradients = False       # flat.GradientSyncs: each unit's reduced, then freed
    unit_type = Unit                    # what the wrap builds (extensions/fsdp_frozen.py: its own)

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
        # FSDPState checks the arguments (the same model on every rank): the Comm, the device.
        self.comm, self.device = self._checked(module, group, device)
        object.__setattr__(self, "module", module)   # not a submodule: parameters() are the shards
        # FSDPState's wrap. forward_order: one Unit per module wrap(m) picks, in registration
        # order, which is the order a GPT's forward calls them (prefetch relies on it).
        # root_units: [] or [the root unit: every parameter no wrapped module took]. Numbered
        # first (unit 0, so the lecture's first layer is unit 1): gathered first, reduced last.
        self.root_units, self.forward_order = self._wrap(module, wrap)
        # Those that train (a frozen unit has no params).
        self.units = [u for u in self.root_units + self.forward_order if u.params]
        self.root = next((u for u in self.root_units if u.params), None)  # the root, if it trains
        # The reduce-scatters' order, the same on every rank: backward's, the root last.
        self.reduce_order = ([u for u in self.forward_order[::-1] if u.params]
                             + ([self.root] if self.root else []))
        # At most FSDPState's reductions_in_flight (2) whole gradients wait for the wire (a third
        # waits for the oldest): memory bounded, the link kept busy.
        self._reductions = InOrder(self.reduce_order, self._reduce_scatter,
                                   self._wait_reduce_scatter,
                                   max_in_flight=self.reductions_in_flight)
        self.shards = nn.ParameterList([u.master for u in self.units])    # FSDP.parameters()
        module.to(self.device)            # the buffers; the parameters are there already
        for unit in self.forward_order:
            unit.module.register_forward_pre_hook(
                lambda m, args, u=unit: self._before_forward(u))
            unit.module.register_forward_hook(
                lambda m, args, out, u=unit: self._after_forward(u, out))
        self._hook_gradients()
        self._backward_hooked = False
        self._sync = True                # False under no_sync(): gradients kept whole, for later
        self._grads_to_reduce = False    # the last backward ran under no_sync: gradients wait
        self._gathered_for_step = False  # nothing freed: inside gathered_for_step() (a pipeline's)
        self._used_agreed = False        # this backward's used-flags OR'ed over the ranks
        self.observers = []    # f(what, unit), told of each gather, compute, reduce (FSDPTrace)

    # ---- a unit's life: forward ----------------------------------------------------------------
    #   compute     | unit 1 fwd | unit 2 fwd | unit 3 fwd |      (prefetch = 1)
    #   network  |ag 1|ag 2 ......|ag 3 .......|
    #   memory      unit i and unit i+1 gathered; unit i freed as its forward returns

    def forward(self, *args, **kwargs):
        for root in self.root_units:       # gathered until its last gradient arrives in backward
            self._gather(root)
            root.wait()
        self._prefetch(-1, +1)         # position -1: gathers from forward_order[0] on
        out = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            for root in self.root_units:
                self._free(root)                     # no backward will come to free it
        return out

    def _before_forward(self, unit):
        """All-gather the unit (unless prefetched), wait for it; start the next one's gather."""
        self._gather(unit)
        unit.wait()
        self._tell("forward", unit)
        self._prefetch(self.forward_order.index(unit), +1)    # overlaps with this unit's compute

    def _after_forward(self, unit, output):
        """Free it; its backward starts when the gradient of its output arrives: a hook on each
        output tensor (the first to fire gathers the unit; _gather skips it for the others)."""
        self._free(unit)
        if torch.is_grad_enabled():
            for t in tree_leaves(output):          # a tensor, or any tuple, list or dict of them
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, u=unit: self._before_backward(u))
        return output

    # ---- a unit's life: backward ---------------------------------------------------------------
    #   compute     | unit 3 bwd | unit 2 bwd | unit 1 bwd |
    #   network  |ag 3|ag 2 ......|ag 1 ......|
    #                        |rs 3 .....|rs 2 .......|rs 1|   (in flight: at most 2)

    def _before_backward(self, unit):
        """All-gather it again (its backward needs the weights); start the previous one's."""
        self._hook_end_of_backward()
        self._gather(unit)
        unit.wait()
        self._tell("backward", unit)
        self._prefetch(self.forward_order.index(unit), -1)

    def _hook_gradients(self):
        """Have autograd call _gradient_ready(k, i) as it accumulates parameter i's gradient of
        unit k (FlatParams' hook: it holds FSDP weakly, so a wrapped model is still freed)."""
        for k, unit in enumerate(self.units):
            unit.hook_gradients(self._gradient_ready, k)

    def _gradient_ready(self, k: int, i: int):
        """Autograd accumulated a gradient (the i-th) of unit k; with its last one, the unit's
        backward is done (the root's too): it is freed. A parameter this backward does not use
        holds the unit (and, in reduce_order, the units after it) back until the end of
        backward: _finish_backward launches it."""
        unit = self.units[k]
        self._hook_end_of_backward()
        unit.pending -= 1                # its gradients still to come (FlatParams' count)
        if unit.pending == 0:
            unit.pending = len(unit.params)
            self._after_backward(unit)

    def _after_backward(self, unit):
        """Free it, and reduce-scatter its gradient, in reduce_order on every rank (InOrder)."""
        self._free_after_backward(unit)
        self._reductions.ready(unit)             # -> _reduce_scatter(unit), when its turn comes

    def _reduce_scatter(self, unit):
        """Launch the reduce-scatter of unit's gradient, unless no_sync: each rank receives its
        shard of the sum (the mean: op avg). Returns (handle, output, used), or None."""
        started = None
        self._grads_to_reduce = not self._sync
        if self._sync:
            # A fresh (N*S,) buffer (zeros_like reads unit.flat's shape, not its freed storage),
            # each .grad (autograd's own tensor) copied in: the unit's whole gradient lives until
            # _wait_reduce_scatter.
            grad = torch.zeros_like(unit.flat, dtype=self.reduce_dtype)
            used = [p.grad is not None for p in unit.params]
            for p, view in zip(unit.params, unit.views(grad)):
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = None
            output = grad.new_empty(unit.master.shape)     # (S,), on the gradient's device
            handle = unit.comm.reduce_scatter(output, grad, op=unit.op, async_op=True)
            started = handle, output, used
            self._tell("reduce-scatter", unit)
        # Again, for a unit whose last gradient never came (a parameter unused this backward):
        # _after_backward never ran for it, and _finish_backward's launch_rest launched it.
        self._free_after_backward(unit)
        return started

    def _wait_reduce_scatter(self, unit, started):
        """Wait for unit's reduce-scatter (InOrder's retire), and add its output to the grad."""
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
        """Every rank launches every unit's reduce-scatter, its gradients come or not (so the
        collectives match across ranks)."""
        self._reductions.launch_rest()
        for unit in self.units:
            unit.pending = len(unit.params)
        self._backward_hooked = False
        self._used_agreed = False

    def finish_gradient_sync(self):
        """Wait for the outstanding reduce-scatters: each shard in FSDP.parameters() then holds its
        fp32 averaged gradient in .grad, for any torch.optim optimizer. Gradients accumulated
        under no_sync with no backward after it (a zero-bubble pipeline's W) are reduced now."""
        if self._grads_to_reduce:
            self._reductions.launch_rest()
        self._reductions.wait_all()
        if self._sync and not self._used_agreed:
            self._agree_used()      # a unit no rank used gets .grad None: an optimizer skips it
            self._used_agreed = True

    # ---- a unit's step: on its shard, no collective ----------------------------------------------
    #   FSDP.parameters() are the masters, (S,) fp32, each .grad its reduced gradient shard:
    #   any torch optimizer steps them (the demonstration's AdamW, below), its state 1/N of the
    #   model's too; the next all-gathers send the stepped shards.
    #   mechanics/fsdp_optimizer.py adds loss scale, clipping.

    # ---- the mechanics: gather, prefetch, free -------------------------------------------------

    def _gather(self, unit):
        """Launch unit's all-gathers, unless it is gathered or on its way."""
        if unit.gathered:
            return
        unit.all_gather()
        self._tell("all-gather", unit)

    def _prefetch(self, position: int, step: int):
        """Gather up to `prefetch` units after forward_order[position] (step +1: forward's way,
        -1: backward's), while fewer than limit = 1 + prefetch units are gathered: the one
        computing and those ahead of it (the root does not count)."""
        limit = 1 + self.prefetch
        for ahead in range(position + step, position + step * limit, step):
            gathered = sum(u.gathered for u in self.forward_order)
            if not 0 <= ahead < len(self.forward_order) or gathered >= limit:
                return
            self._gather(self.forward_order[ahead])

    def _free(self, unit):
        if not self._gathered_for_step:
            unit.free()

    def _free_after_backward(self, unit):   # its gradients are out: it goes, as after forward
        self._free(unit)

    def _hook_end_of_backward(self):
        """Have autograd call _finish_backward once, when this backward pass ends. Called on
        backward's first event of either kind: a parameter's gradient comes first for the root."""
        if not self._backward_hooked:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._backward_hooked = True

    # ---- after the core: gradient accumulation ---------------------------------------------------
    # Every micro-batch's reduce-scatter but the last is traffic a step can skip, at the price of
    # a whole gradient per rank (DDP's no_sync, FSDP2's set_requires_gradient_sync(False)).

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward keeps whole gradients in each .grad; the next backward outside
        reduce-scatters them with its own."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True


# ---- run alone: torchrun --nproc_per_node 2 fsdp.py ------------------------------------------

# What each event FSDPTrace records means, as the demonstration prints it.
_EVENT_TEXT = {"all-gather": "all-gather launched", "forward": "gathered: forward",
               "forward done": "freed", "backward": "gathered: backward",
               "reduce-scatter": "gradient reduce-scatter launched (freed as its backward ended)"}
# The root unit is gathered once per step: through forward, and in backward until its last
# gradient arrives (here the head Linear's, among the first). Its reduce-scatter comes after
# every other unit's, on every rank: a parameter it holds may be used anywhere in the model
# (a GPT's tied embedding), so its gradient may be whole only when backward ends.
_ROOT_EVENT_TEXT = {
    "all-gather": "all-gather launched (the root: kept gathered until its last gradient "
                  "arrives, here among backward's first)",
    "reduce-scatter": "gradient reduce-scatter launched (the root's, last by rule: its gradient "
                      "came first, and it was freed then; it waited for the blocks')"}


def _demonstrate(trace_type, steps: int = 3, lr: float = 1e-2, rows: int = 8):
    """Three blocks as units, and a root, trained on 2 ranks by a plain AdamW on the shards; beside
    it one process's AdamW on the whole batch, its loss the mean of the two halves' means: the
    ranks' fp32 sums in the same order (one forward of all rows would reorder them), so equal.
    trace_type(fsdp) watches it from outside (FSDPTrace): the first step's events are printed."""
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3)]
    model = nn.Sequential(*blocks, nn.Linear(16, 4))
    alone = copy.deepcopy(model)                                  # the one process
    fsdp = FSDP(model, wrap=lambda m: m in blocks)
    trace = trace_type(fsdp)                       # the order of a step's gathers and computes
    step_on_shards = torch.optim.AdamW(fsdp.parameters(), lr=lr)    # this rank's fp32 shards only
    step_alone = torch.optim.AdamW(alone.parameters(), lr=lr)
    x, y = torch.randn(n * rows, 16), torch.randn(n * rows, 4)    # the whole batch, on every rank
    halves = [slice(r * rows, (r + 1) * rows) for r in range(n)]  # rank r's rows
    for step in range(steps):
        nn.functional.mse_loss(fsdp(x[halves[rank]]), y[halves[rank]]).backward()
        fsdp.finish_gradient_sync()             # each shard's .grad: its averaged gradient shard
        if step == 0 and rank == 0:
            print("FSDP's first step on rank 0 (units 1-3: the blocks, in forward order; "
                  "unit 0: the root, numbered first, holds the last Linear)")
            print("\n".join(f"  unit {i}: {(_ROOT_EVENT_TEXT if i == 0 else _EVENT_TEXT)[what]}"
                            for what, i in trace.events))
        (sum(nn.functional.mse_loss(alone(x[h]), y[h]) for h in halves) / n).backward()
        for optimizer in (step_on_shards, step_alone):
            optimizer.step()
            optimizer.zero_grad()
    held = sum(p.numel() for p in fsdp.parameters())
    whole = sum(p.numel() for p in alone.parameters())
    sharded = fsdp.full_state_dict(all_ranks=True)                # collective: the whole model
    difference = max((sharded[name] - p).abs().max().item()
                     for name, p in alone.named_parameters())
    if rank == 0:
        print(f"rank 0 holds {4 * held} of the model's {4 * whole} bytes of fp32 parameters "
              f"(1/{n}, padded to equal shards), and AdamW's two moments of those only\n"
              f"max |difference| from one process after {steps} AdamW steps: {difference:.1e} "
              f"(bound 0: the same fp32 sums in the same order)", flush=True)
    dist.destroy_process_group()
    # At once: gloo's threads may still hold tensors (exit_distributed).
    os._exit(int(difference > 0))


if __name__ == "__main__":
    start_alone(torchrun=True, worlds=(2,))      # 2 halves' sums add in one order: bit for bit
    _demonstrate(FSDPTrace)
