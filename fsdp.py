"""FSDP = ZeRO stage 3: shard the parameters too, and gather each unit only while it computes.

ZeRO stage 3 (Rajbhandari et al. 2020, 5.3), built as PyTorch's FSDP (Zhao et al. 2023, 3-4):
each unit of the model is one flat parameter sharded 1/N, all-gathered just before its forward
and again before its backward, freed after each, its gradient reduce-scattered: 3 (N-1)/N of
the model on the wire per step, 1.5x DDP, for 1/N of every byte of training state.
This file is that: the unit, then FSDP's forward and backward. Three parts a reader can skip
complete it: fsdp_wrap.py (the wrap and mixed-precision policies, the walk that makes the
units), fsdp_state.py (what memory.py, clipping and checkpoints read of the shards) and
fsdp_optimizer.py (FSDPOptimizer: ZeRO's sharded step on the shards; offload=True: offload.py).
The talk's additions build on this file, each a subclass read after it: fsdp_hybrid.py (HSDP:
shard within a group, copies across groups), fsdp_offload.py (the parameter shards in host
memory between uses), fsdp_frozen.py (a frozen base, QLoRA's 4-bit one too, sharded as bytes).
Left out: a stream of our own (NCCL's async collectives run on theirs; wait() orders the compute
stream after them), FSDP1's state API.
Run: torchrun --nproc_per_node 2 train.py --strategy fsdp; test: python -m pytest tests/test_fsdp.py

Shapes: N ranks (of a shard group), r this rank, P elements in a unit, S = ceil(P / N) elements
per shard.
"""
import contextlib
import math

import torch
import torch.nn as nn

from collectives import as_comm
from flat import MAX_REDUCTIONS_IN_FLIGHT, FlatParams, InOrder, agree_used, hook_gradient
from fsdp_optimizer import FSDPOptimizer  # noqa: F401  (re-exported: it steps on FSDP's shards)
from fsdp_state import FSDPState
from fsdp_wrap import MixedPrecisionPolicy, Wrapping, check_input, gpt_blocks
from offload import host_to_device
from process_groups import check_same_parameters


class Gathered:
    """A unit's flat buffers (flats()): gathered for its forward and again for its backward,
    freed after each (storage resized to 0)."""
    params, gathering, gathered = (), (), False

    def free(self):
        self.wait()
        for flat in self.flats():
            flat.untyped_storage().resize_(0)
        self.gathered = False

    def wait(self):
        for handle, _ in self.gathering:       # (handle, the shard it sends: kept alive till then)
            handle.wait()
        self.gathering = ()


class Unit(FlatParams, Gathered):
    """One FSDP unit: the parameters of a module (minus nested units') as one flat parameter.

        master  (S,)    fp32, this rank's shard: the nn.Parameter the optimizer updates
        grad    (S,)    fp32, this rank's reduced (and accumulated) gradient of the shard: the
                        master's own .grad, so any torch.optim optimizer over FSDP.parameters()
                        steps on it (offloaded, the master is on the host and this stays on the device)
        flat    (N*S,)  compute dtype, gathered; its storage is resized to 0 between uses, and
                        the module's parameters stay views of it, so the module code never changes
    Offloaded (FSDPOptimizer(offload=True)) the master lives on the host, and FSDP keeps
        compute_shard (S,) compute dtype, the master rounded: what the all-gathers send
    """
    replicas = None          # ranks holding copies of this shard (none; fsdp_hybrid.py's HSDP)
    compute_shard = None

    def __init__(self, index, module, params, comm, fsdp):
        super().__init__(params, comm.world_size)          # self.flat: (N*S,) fp32, params view it
        self.index, self.module, self.comm = index, module, comm
        flat = self.flat.to(fsdp.device)         # one unit at a time on the device, never the model
        fsdp._same_start(comm, flat)
        self.master = nn.Parameter(self.shard(flat, comm.rank).clone())        # (S,) fp32
        # The fp32 copy of the whole unit goes; the flat buffer is now the compute-dtype one
        # the all-gathers fill, empty (storage resized to 0) between uses.
        self.flat = torch.empty(flat.numel(), dtype=fsdp.compute_dtype, device=fsdp.device)
        for p, view in zip(self.params, self.views(self.flat)):
            p.data = view
        self.flat.untyped_storage().resize_(0)
        self._device_grad = None     # offload: the reduced gradient, on the device
        self.host_grad = None        # offload: (S,) fp32 host buffer the gradient is copied into
        # Which got a gradient here since the shard's .grad was last None (zero_grad); after
        # FSDP.finish_gradient_sync, on any rank.
        self.used = [False] * len(self.params)

    def flats(self) -> list[torch.Tensor]:
        return [self.flat]

    def sends(self) -> list[tuple]:
        """(this rank's shard, the flat its all-gather fills) for each flat buffer."""
        shard = (self.compute_shard if self.compute_shard is not None
                 else self.master.detach().to(self.flat.dtype))                     # (S,)
        return [(shard, self.flat)]                                                 # -> (N*S,)

    def kept(self) -> list[torch.Tensor]:
        """The shards kept besides the master (its compute-dtype copy, offloaded)."""
        return [self.compute_shard] if self.compute_shard is not None else []

    @property
    def offloaded(self) -> bool:
        """The master is on the host (FSDPOptimizer(offload=True)): the gradient stays apart."""
        return self.compute_shard is not None

    @property
    def grad(self):
        return self._device_grad if self.offloaded else self.master.grad

    @grad.setter
    def grad(self, value):
        if self.offloaded:
            self._device_grad = value
        else:
            self.master.grad = value

    def refresh(self):
        """The master changed: a gathered copy is stale, and an offloaded master is copied back
        to its compute shard (host -> device, asynchronous from pinned memory)."""
        if self.compute_shard is not None:
            host_to_device(self.compute_shard, self.master.detach())
        self.free()


class FSDP(Wrapping, FSDPState, nn.Module):
    """Wrap `module` in FSDP units; `.module` runs unchanged, `.parameters()` are the shards.

    module: fp32 parameters, every one trained (they become the fp32 master shards; a frozen
    base is fsdp_frozen.FrozenBaseFSDP's). wrap: a predicate over submodules, True for each that
    becomes a unit (default: the GPT's blocks); everything else, and any parameter two units
    share (tied weights), is the root unit, gathered from the start of forward to the end of its
    backward, as in PyTorch. mp_policy: a fsdp_wrap.MixedPrecisionPolicy (default: all fp32).
    group: a collectives.Comm, a process group or None. prefetch: units all-gathered ahead of the
    one computing (0: none), at most 1 + prefetch non-root units gathered at once.
    device: where the shards, the gathered units and the rest of the module live (default: where
    the module is). Build the module on the CPU and name the GPU here, and a model that fits
    only sharded can start: each unit visits the device alone, then only its shard stays.
    A unit whose parameters only some ranks hold (an expert: placements.py's holders; wrap it
    as a unit of its own) is sharded over its holders, its gradient reduced as
    placements.data_reduction says.
    """

    keeps_whole_gradients = False       # flat.GradientSyncs: each unit's reduced, then freed
    unit_type = Unit

    def __init__(self, module: nn.Module, wrap=gpt_blocks, mp_policy: MixedPrecisionPolicy | None = None,
                 group=None, prefetch: int = 1, device=None):
        super().__init__()
        policy = mp_policy or MixedPrecisionPolicy()
        self.compute_dtype = policy.param_dtype or torch.float32
        self.reduce_dtype = policy.reduce_dtype or self.compute_dtype
        trainable = check_input(module, self.compute_dtype, prefetch)
        self.comm, self.prefetch = as_comm(group), prefetch
        self.device = torch.device(device) if device is not None else trainable[0].device
        for comm in self._model_groups():                   # the same model on every rank
            check_same_parameters(list(module.parameters()), comm, self.device)
        # The data dimension's ranks (an expert's gradient is divided by all of them).
        self.data_world = math.prod(comm.world_size for comm in self._model_groups())
        object.__setattr__(self, "module", module)   # not a submodule: parameters() are the shards
        self._make_units(module, wrap)       # fsdp_wrap.py: self.roots, self.order, self.units
        # Backward's order, the root last: every rank launches its reduce-scatters in this order.
        self.reduce_order = [u for u in self.order[::-1] if u.params] + ([self.root] if self.root else [])
        self._order = InOrder(self.reduce_order, self._reduce, self._retire,
                              max_in_flight=MAX_REDUCTIONS_IN_FLIGHT)
        self.shards = nn.ParameterList([u.master for u in self.units])
        module.to(self.device)            # the buffers; the parameters are there already
        for unit in self.order:
            unit.module.register_forward_pre_hook(lambda m, args, u=unit: self._before_forward(u))
            unit.module.register_forward_hook(lambda m, args, out, u=unit: self._after_forward(u, out))
        for k, unit in enumerate(self.units):
            for p in unit.params:
                hook_gradient(p, self._gradient_ready, k)
        self._backward_hooked = False
        self._sync = True
        self._whole_step = False         # inside gathered_for_step(): nothing freed until its end
        self._unreduced = False          # the last backward ran under no_sync: gradients to reduce
        self._used_agreed = False        # this backward's used-flags OR'ed over the ranks
        self.events = []                 # this step's order of collectives and computation
        self.peak_gathered_bytes = 0     # most bytes of gathered units held at once, ever

    def train(self, mode: bool = True):
        self.module.train(mode)
        return super().train(mode)

    # ---- forward: gather, compute, free --------------------------------------------------
    #
    #   compute     | unit 0 fwd | unit 1 fwd | unit 2 fwd |      (prefetch = 1)
    #   network  |ag 0|ag 1 ......|ag 2 .......|ag 3 .......|
    #   memory      unit i and unit i+1 gathered; unit i freed as its forward returns

    def forward(self, *args, **kwargs):
        self.events = []
        for root in self.roots:
            self._gather(root)
            root.wait()
        self._prefetch(self.order[0] if self.order else None)
        out = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            for root in self.roots:
                self._free(root)                     # no backward will come to free it
        return out

    def _next(self, unit, step):
        """The unit after (step=+1) or before (-1) `unit` in forward order; None at the ends."""
        i = self.order.index(unit) + step
        return self.order[i] if 0 <= i < len(self.order) else None

    def _gather(self, unit):
        """Issue unit's all-gathers (async), each from this rank's shard, unless it is gathered
        or on its way."""
        if unit.gathered:
            return
        unit.gathering = []
        for shard, flat in unit.sends():
            shard = self._to_device(shard)
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            unit.gathering.append((unit.comm.all_gather(flat, shard, async_op=True), shard))
        unit.gathered = True
        self.events.append(("all-gather", unit.index))
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, sum(
            flat.untyped_storage().nbytes() for u in self.roots + self.order for flat in u.flats()))

    def _to_device(self, shard: torch.Tensor) -> torch.Tensor:
        """The shard an all-gather sends: kept on the device, as it is (fsdp_offload.py copies it
        over from the host)."""
        return shard

    def _prefetch(self, unit):
        # The limit keeps memory at 1 + prefetch units whatever runs ahead; a unit past the
        # limit is gathered on demand when its turn comes.
        busy = sum(u.gathered for u in self.order)
        if unit is not None and self.prefetch and busy <= self.prefetch:
            self._gather(unit)

    def _before_forward(self, unit):
        self._gather(unit)
        unit.wait()
        self.events.append(("forward", unit.index))
        self._prefetch(self._next(unit, +1))    # overlaps with this unit's compute

    def _after_forward(self, unit, output):
        self.events.append(("forward done", unit.index))
        self._free(unit)
        if torch.is_grad_enabled():
            # The gradient of the unit's output arrives just before its backward starts.
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outputs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, u=unit: self._before_backward(u))
        return output

    # ---- backward: gather again, reduce-scatter the gradient, free --------------------------
    #
    #   compute     | unit 2 bwd | unit 1 bwd | unit 0 bwd |
    #   network  |ag 2|ag 1 ......|ag 0 ......|
    #                        |rs 2 .....|rs 1 .......|rs 0|   (in flight: at most 2)

    def _before_backward(self, unit):
        self._hook_end_of_backward()
        self._gather(unit)
        unit.wait()
        self.events.append(("backward", unit.index))
        self._prefetch(self._next(unit, -1))

    def _hook_end_of_backward(self):
        if not self._backward_hooked:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._backward_hooked = True

    def _gradient_ready(self, k: int):
        unit = self.units[k]
        self._hook_end_of_backward()
        unit.pending -= 1
        if unit.pending == 0:
            unit.pending = len(unit.params)
            self._gradients_done(unit)
            # In reduce_order on every rank (flat.InOrder): a unit unused here waits for
            # the end of backward, and the units after it with it.
            self._order.ready(unit)

    def _gradients_done(self, unit):
        """unit's gradients are out: its gathered parameters can go."""
        self._free(unit)

    def _reduce(self, unit):
        """The unit's backward is over: reduce-scatter its gradient (unless no_sync), free it all.
        Returns (handle, output, used) of the reduce-scatter in flight, or None under no_sync."""
        started = None
        self._unreduced = not self._sync
        if self._sync:
            grad = torch.zeros_like(unit.flat, dtype=self.reduce_dtype)          # (N*S,)
            used = [p.grad is not None for p in unit.params]
            for p, view in zip(unit.params, unit.views(grad)):
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = None
            # On the gradient's device, not the master's: offloaded, the master lives on the
            # host, and NCCL reads and writes device memory only.
            output = grad.new_empty(unit.master.shape)                          # (S,)
            started = unit.comm.reduce_scatter(output, grad, op=unit.op, async_op=True), output, used
            self.events.append(("reduce-scatter", unit.index))
        self._gradients_done(unit)
        return started

    def _retire(self, unit, started):
        handle, output, used = started
        handle.wait()
        self._add_gradient(unit, output, used)

    def _add_gradient(self, unit, output, used):
        """The reduce-scatter's output (S,), in the reduce dtype, joins the shard's gradient."""
        # Upcast after the wire: accumulation and the update are fp32, whatever was sent.
        grad = output.float()
        if unit.divide != 1:
            grad.div_(unit.divide)
        # The first reduction since .grad was None (a plain optimizer's zero_grad too) starts
        # the flags afresh; a later one (accumulation) adds its own. Retired in launch order.
        unit.used = used if unit.grad is None else [a or b for a, b in zip(unit.used, used)]
        unit.grad = grad if unit.grad is None else unit.grad.add_(grad)

    def _finish_backward(self):
        # Units whose gradient never (fully) came still reduce-scatter: collectives match by
        # order, so every rank must launch every unit's, whatever this rank's graph used.
        self._order.launch_rest()
        for unit in self.units:
            unit.pending = len(unit.params)
        self._backward_hooked = False
        self._used_agreed = False

    def finish_gradient_sync(self):
        """Wait for the outstanding reduce-scatters: each shard in FSDP.parameters() then holds its
        fp32 averaged gradient in .grad, so a plain torch.optim optimizer can step on them. If
        the backwards since the last reduction all ran under no_sync (a zero-bubble pipeline's:
        its weight gradients come after autograd, W), their accumulated gradients go now."""
        if self._unreduced:
            self._order.launch_rest()
        self._order.wait_all()
        if self._sync and not self._used_agreed:
            # Once per backward (train.py calls this, and FSDPOptimizer again), after every
            # reduce-scatter is launched: a unit no rank used gets .grad None (flat.py).
            agree_used(self.units, self.device)
            self._used_agreed = True

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full (unsharded) gradients locally; the next backward outside reduces them.
        Saves the traffic of every micro-batch but one at the price of a full gradient per rank."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _free(self, unit):
        if not self._whole_step:
            unit.free()

    @contextlib.contextmanager
    def gathered_for_step(self):
        """Inside, a unit stays gathered from its first use to the end of the block: nothing is
        freed after a forward or a backward, so nothing is gathered twice. For a pipeline stage
        (pipeline.Pipeline enters it around each step), whose schedule runs several micro-batches'
        forwards before their backwards (GPipe: all of them), so a unit freed after one backward
        would be missing from the next: each unit is all-gathered once per step, not twice per
        micro-batch, and reduce-scattered once, at finish_gradient_sync() after the block (every
        backward inside runs as under no_sync), as torchtitan runs FSDP under pipeline
        parallelism (reshard_after_forward off). The price: the stage's whole parameters and
        gradients during the step; between steps everything is sharded as always."""
        self._whole_step, outer, self._sync = True, self._sync, False
        try:
            yield
        finally:
            self._whole_step, self._sync = False, outer
            for unit in self.roots + self.order:
                unit.free()

