"""FSDP = ZeRO stage 3: shard the parameters too, and gather each unit only while it computes.

ZeRO stage 3 (Rajbhandari et al. 2020, 5.3), built as PyTorch's FSDP (Zhao et al. 2023, 3-4):
each unit of the model is one flat parameter sharded 1/N, all-gathered just before its forward
and again before its backward, freed after each, its gradient reduce-scattered: 3 (N-1)/N of
the model on the wire per step, 1.5x DDP, for 1/N of every byte of training state.

The talk's QLoRA + FSDP case adds three things. A unit's frozen weights (LoRA's base) are a
second flat buffer of raw bytes, sharded and gathered beside the trained one, never reduced; a
4-bit NF4 base goes over the wire as its packed codes and scales, 4.5 bits a weight, and is
dequantized after the gather. Offloaded (offload_params), the shards wait in host memory and
visit the device only for their all-gather. Hybrid sharding (HSDP, replicate_group) shards
within a group (one node's fast links) and keeps a copy per group: the gradient is
reduce-scattered in the group, then its shard all-reduced across the copies.
FSDPOptimizer(offload=True) keeps the fp32 master shards and Adam's moments on the host (zero.py).
Left out: a stream of our own (NCCL's async collectives run on theirs; wait() orders the compute
stream after them), FSDP1's state API.
Run: torchrun --nproc_per_node 2 train.py --strategy fsdp; test: python -m pytest tests/test_fsdp.py

Shapes: N ranks (of a shard group), r this rank, P elements in a unit, S = ceil(P / N) elements
per shard; frozen: B bytes, ceil(B / N) per shard.
"""
import contextlib

import torch
import torch.nn as nn

from collectives import as_comm, flags_to_device, ring_bytes
from flat import (MAX_REDUCTIONS_IN_FLIGHT, FlatParams, InOrder, flags_and_norm_bytes, hook_gradient,
                  or_used_flags, shards_norm)
from mixed_precision import DynamicLossScaler
from model import Block
from offload import OffloadedOptimizer as ShardedOptimizer, host_buffer, host_copy, host_to_device
from placements import data_reduction, placement
from quantization import NF4Weight
from process_groups import check_same_parameters


def gpt_blocks(module: nn.Module) -> bool:
    """The default wrap policy: one unit per transformer block; the rest is the root unit.
    (Under expert parallelism train.py wraps each expert a rank holds as a unit of its own too.)"""
    return isinstance(module, Block)


class FrozenBytes:
    """A unit's frozen tensors laid end to end as raw bytes in one flat buffer, sharded 1/N:
    frozen parameters (in the compute dtype) and QLoRA's NF4 codes and scales (quantization.py),
    all-gathered with the unit as they are stored (a 4-bit weight stays 4 bits on the wire),
    never reduced.

        shard  (ceil(B/N),)  uint8, this rank's bytes: what stays between uses
        flat   (N*ceil(B/N),) uint8, gathered; each frozen tensor is a view into it (of its own
                             dtype and shape), storage resized to 0 between uses
    Each tensor starts at a multiple of 16 bytes, so its bytes can be viewed as its dtype.
    """

    ALIGN = 16

    def __init__(self, tensors: list[torch.Tensor], comm, device, replicas=None):
        self.tensors, self.offsets, end = tensors, [], 0
        for t in tensors:
            start = -(-end // self.ALIGN) * self.ALIGN
            self.offsets.append(start)
            end = start + t.numel() * t.element_size()
        self.shard_bytes = -(-end // comm.world_size)
        self.flat = torch.zeros(comm.world_size * self.shard_bytes, dtype=torch.uint8, device=device)
        for t, start in zip(tensors, self.offsets):
            raw = t.detach().to(device).reshape(-1).view(torch.uint8)
            self.flat[start: start + raw.numel()] = raw
        for group in (comm, replicas):                       # every copy starts as rank 0's
            if group is not None:
                group.broadcast(self.flat, src=0)
        self.shard = self.flat[comm.rank * self.shard_bytes: (comm.rank + 1) * self.shard_bytes].clone()
        with torch.no_grad():
            for t, start in zip(tensors, self.offsets):
                t.data = self.flat[start: start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        self.flat.untyped_storage().resize_(0)


class Gathered:
    """What every unit shares: its flat buffers are gathered for its forward and again for its
    backward, and freed after each (a frozen-only unit has no trained flat)."""
    params, frozen, gathering, gathered = (), None, (), False

    def flats(self, frozen: bool = True) -> list[torch.Tensor]:
        return ([self.flat] if self.params else []) + ([self.frozen.flat] if self.frozen and frozen else [])

    def free(self, frozen: bool = True):
        """Drop the gathered copies; frozen=False keeps the frozen bytes (still gathered, if they
        were: a zero-bubble pipeline's reductions come after its step freed everything)."""
        self.wait()
        for flat in self.flats(frozen):
            flat.untyped_storage().resize_(0)
        self.gathered = self.gathered and self.frozen is not None and not frozen

    def wait(self):
        for handle, _ in self.gathering:       # (handle, the shard it sends: kept alive till then)
            handle.wait()
        self.gathering = ()


class FrozenUnit(Gathered):
    """A module whose parameters are all frozen (LoRA's embeddings and head, a frozen block):
    only its FrozenBytes, gathered and freed as a Unit's are."""

    def __init__(self, index, module, frozen: FrozenBytes, comm):
        self.index, self.module, self.frozen, self.comm = index, module, frozen, comm


class Unit(FlatParams, Gathered):
    """One FSDP unit: the parameters of a module (minus nested units') as one flat parameter.

        master  (S,)    fp32, this rank's shard: the nn.Parameter the optimizer updates
        grad    (S,)    fp32, this rank's reduced (and accumulated) gradient of the shard: the
                        master's own .grad, so any torch.optim optimizer over FSDP.parameters()
                        steps on it (offloaded, the master is on the host and this stays on the device)
        flat    (N*S,)  compute dtype, gathered; its storage is resized to 0 between uses, and
                        the module's parameters stay views of it, so the module code never changes
        frozen  FrozenBytes of the module's frozen weights, or None
    Offloaded (FSDPOptimizer(offload=True)) the master lives on the host, and the device keeps
        device_shard (S,) compute dtype, the master rounded: what the all-gathers send
    and with the parameters offloaded too (FSDP(offload_params=True)) that copy is on the host,
        host_shard   (S,) compute dtype, copied to the device just before each all-gather
    """

    def __init__(self, index, module, params, comm, compute_dtype, device, frozen=None, replicas=None):
        super().__init__(params, comm.world_size)          # self.flat: (N*S,) fp32, params view it
        self.index, self.module, self.comm, self.frozen = index, module, comm, frozen
        self.replicas = replicas                 # HSDP: the ranks holding copies of this shard
        flat = self.flat.to(device)              # one unit at a time on the device, never the model
        for group in (comm, replicas):                       # every copy starts as rank 0's
            if group is not None:
                group.broadcast(flat, src=0)
        self.master = nn.Parameter(self.shard(flat, comm.rank).clone())        # (S,) fp32
        # The fp32 copy of the whole unit goes; the flat buffer is now the compute-dtype one
        # the all-gathers fill, empty (storage resized to 0) between uses.
        self.flat = torch.empty(flat.numel(), dtype=compute_dtype, device=device)
        for p, view in zip(self.params, self.views(self.flat)):
            p.data = view
        self.flat.untyped_storage().resize_(0)
        self.device_shard = self.host_shard = None
        self._device_grad = None     # offload: the reduced gradient, on the device
        self.host_grad = None        # offload: (S,) fp32 host buffer the gradient is copied into
        # Which got a gradient here since the shard's .grad was last None (zero_grad); after
        # FSDP.finish_gradient_sync, on any rank.
        self.used = [False] * len(self.params)

    @property
    def offloaded(self) -> bool:
        """The master is on the host (FSDPOptimizer(offload=True)): the gradient stays apart."""
        return self.device_shard is not None or self.host_shard is not None

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
        to its device shard (host -> device, asynchronous from pinned memory; with the
        parameters offloaded, host -> host)."""
        for copy in (self.device_shard, self.host_shard):
            if copy is not None:
                host_to_device(copy, self.master.detach())
        self.free()


class FSDP(nn.Module):
    """Wrap `module` in FSDP units; `.module` runs unchanged, `.parameters()` are the shards.

    module: fp32 parameters (they become the fp32 master shards). wrap: a predicate over
    submodules, True for each that becomes a unit (default: the GPT's blocks); everything else,
    and any parameter two units share (tied weights), is the root unit, gathered from the
    start of forward to the end of its backward, as in PyTorch. Frozen parameters
    (requires_grad=False, cast to compute_dtype) and QLoRA's 4-bit weights are sharded too, as
    each unit's FrozenBytes (a module with nothing to train is a FrozenUnit).
    compute_dtype: what forward and backward run in and what the all-gathers send (default fp32).
    reduce_dtype: what the gradients are reduce-scattered in (default: compute_dtype, as FSDP2's
    MixedPrecisionPolicy; torch.float32 under bf16/fp16: upcast before the collective, fewer
    roundings for twice the bytes); the shard is fp32 after the wire either way.
    prefetch: units all-gathered ahead of the one computing (0: none), at most 1 + prefetch
    non-root units gathered at once. group: a collectives.Comm, a process group or None.
    device: where the shards, the gathered units and the rest of the module live (default: where
    the module is). Build the module on the CPU and name the GPU here, and a model that fits
    only sharded can start: each unit visits the device alone, then only its shard stays.
    A unit whose parameters only some ranks hold (an expert: placements.py's holders; wrap it
    as a unit of its own) is sharded over its holders, its gradient reduced as
    placements.data_reduction says.
    replicate_group: hybrid sharding (HSDP): group shards the model, and the ranks holding the
    same shard in the other groups (process_groups.make_mesh's outer group) keep copies: each
    reduce-scattered gradient shard is then all-reduced over them (the mean over both). An
    expert's unit is not copied: it stays sharded over its holders.
    offload_params: the shards (trained ones rounded to compute_dtype, frozen ones) live in host
    memory, copied to the device just before each all-gather; the optimizer must step on the
    host too (FSDPOptimizer(offload=True)).
    """

    keeps_whole_gradients = False       # flat.GradientSyncs: each unit's reduced, then freed

    def __init__(self, module: nn.Module, wrap=gpt_blocks, compute_dtype=None, group=None,
                 prefetch: int = 1, device=None, replicate_group=None,
                 offload_params: bool = False, reduce_dtype=None):
        super().__init__()
        compute_dtype = compute_dtype or torch.float32
        if compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"FSDP compute_dtype must be torch.float32, bfloat16 or float16, "
                             f"got {compute_dtype}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"FSDP prefetch must be a whole number of units >= 0, got {prefetch!r}")
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("FSDP: the module has no trainable parameters (requires_grad=True)")
        if any(p.dtype != torch.float32 for p in trainable):
            raise ValueError("FSDP keeps fp32 master shards: pass the fp32 model and pick the "
                             "compute precision with compute_dtype (e.g. torch.bfloat16), do not "
                             "cast the model first")
        self.comm = as_comm(group)
        self.replicas = None if replicate_group is None else as_comm(replicate_group)
        device = torch.device(device) if device is not None else trainable[0].device
        for comm in (self.comm, self.replicas):             # the same model on every rank
            if comm is not None:
                check_same_parameters(list(module.parameters()), comm, device)
        object.__setattr__(self, "module", module)   # not a submodule: parameters() are the shards
        self.compute_dtype, self.prefetch, self.offload_params = compute_dtype, prefetch, offload_params
        self.reduce_dtype = reduce_dtype or compute_dtype
        self.device = device
        # Owner of each parameter (and 4-bit buffer): the nearest wrapped module above it, or the
        # root (None).
        owner = {}

        def visit(m, unit):
            unit = m if m is not module and wrap(m) else unit
            quantized = [b for name, b in m.named_buffers(recurse=False)
                         if isinstance(m, NF4Weight) and name != "levels"]   # levels: a constant
            for t in [*m.parameters(recurse=False), *quantized]:
                if owner.setdefault(t, unit) is not unit:
                    owner[t] = None                          # shared by two units: the root's
            for child in m.children():
                visit(child, unit)
        visit(module, None)
        with torch.no_grad():
            for p in module.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(dtype=compute_dtype)
        units = [None] + [m for m in module.modules() if m is not module and wrap(m)]
        data_world = self.comm.world_size * (self.replicas.world_size if self.replicas is not None else 1)
        self.units, self.frozen_units, self.root, frozen_root, in_order = [], [], None, None, []
        for m in units:
            params = [p for p in trainable if owner[p] is m]
            kept = [t for t, o in owner.items() if o is m and not t.requires_grad]   # frozen, 4-bit
            frozen = FrozenBytes(kept, self.comm, device, self.replicas) if kept else None
            index = len(self.units) + len(self.frozen_units)
            if params:
                # HSDP with experts: an expert's unit is sharded over the ranks holding that
                # expert, each holding a different part (no copies); the rest as HSDP says.
                holders = {placement(p).holders for p in params}
                if len(holders) > 1:
                    raise ValueError("FSDP: a unit mixes parameters held by different ranks (an "
                                     "expert beside shared weights): wrap each expert as a unit")
                comm, op, divide = data_reduction(params[0], self.comm, data_world)
                self.units.append(Unit(index, m or module, params, comm, compute_dtype, device,
                                       frozen, self.replicas if holders == {None} else None))
                self.units[-1].op, self.units[-1].divide = op, divide
                self.root = self.units[-1] if m is None else self.root
                in_order.append(self.units[-1])
            elif frozen is not None:
                self.frozen_units.append(FrozenUnit(index, m or module, frozen, self.comm))
                frozen_root = self.frozen_units[-1] if m is None else frozen_root
                in_order.append(self.frozen_units[-1])
        # The root's own tensors (trained or frozen) stay gathered from the start of forward to
        # the end of backward; every other unit is gathered around each of its uses, in this
        # order (forward's, the root aside).
        self.roots = [u for u in (self.root, frozen_root) if u is not None]
        self.order = [u for u in in_order if u not in self.roots]
        # Backward's order, the root last: every rank launches its reduce-scatters in this order.
        self.reduce_order = [u for u in self.order[::-1] if u.params] + ([self.root] if self.root else [])
        self._order = InOrder(self.reduce_order, self._reduce, self._retire,
                              max_in_flight=MAX_REDUCTIONS_IN_FLIGHT)
        self.shards = nn.ParameterList([u.master for u in self.units])
        if offload_params:                       # the frozen shards to (pinned) host memory
            for unit in in_order:
                if unit.frozen is not None:
                    unit.frozen.shard = host_copy(unit.frozen.shard, dtype=torch.uint8)
        module.to(device)          # buffers (the 4-bit levels); the parameters are there
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
        """Issue unit's all-gathers (async) unless it is gathered or on its way: its trained flat
        and its frozen bytes, each from this rank's shard."""
        if unit.gathered:
            return
        sends = []                                                # (shard, flat it fills)
        if unit.params:
            shard = (self._visit_device(unit.host_shard) if unit.host_shard is not None
                     else unit.device_shard if unit.device_shard is not None
                     else unit.master.detach().to(self.compute_dtype))              # (S,)
            sends.append((shard, unit.flat))                                        # -> (N*S,)
        if unit.frozen is not None:
            shard = unit.frozen.shard
            sends.append((self._visit_device(shard) if self.offload_params else shard, unit.frozen.flat))
        unit.gathering = []
        for shard, flat in sends:
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            unit.gathering.append((unit.comm.all_gather(flat, shard, async_op=True), shard))
        unit.gathered = True
        self.events.append(("all-gather", unit.index))
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, sum(
            flat.untyped_storage().nbytes() for u in self.units + self.frozen_units for flat in u.flats()))

    def _visit_device(self, host_shard: torch.Tensor) -> torch.Tensor:
        """offload_params: a shard's copy on the device, made just before its all-gather (which
        keeps it alive until it is sent) and dropped after. From pinned memory the copy runs
        beside compute on a GPU; on CPU ranks it is a CPU-to-CPU copy, the same steps."""
        return host_shard.to(self.device, non_blocking=True, copy=True)

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
        after = self._next(unit, +1)
        if after is not None and after.frozen is not None:
            self._free(after)  # its backward is over: its frozen bytes go (see _gradient_ready)
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
            # The gradients are out: the gathered parameters can go. Not the frozen ones: the
            # unit's backward may still need them (LoRA's dx = dy W0 can come after the adapters'
            # gradients), so they go when the unit before it starts its backward, or at the end.
            self._free(unit, frozen=False)
            # In reduce_order on every rank (ddp.InOrder): a unit unused here waits for
            # the end of backward, and the units after it with it.
            self._order.ready(unit)

    def _reduce(self, unit):
        """The unit's backward is over: reduce-scatter its gradient (unless no_sync), free it all.
        Returns (handle, output) of the reduce-scatter in flight, or None under no_sync."""
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
        self._free(unit, frozen=False)
        return started

    def _retire(self, unit, started):
        handle, output, used = started
        handle.wait()
        if unit.replicas is not None:            # HSDP: the shard's mean over the copies too
            unit.replicas.all_reduce(output, op=unit.op)
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
        for unit in self.units + self.frozen_units:
            if unit.frozen is not None:
                self._free(unit)
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
            # Once per backward: train.py calls this, and FSDPOptimizer calls it again.
            self._agree_used()
            self._used_agreed = True

    def _agree_used(self):
        """OR each unit's "used" flags over the ranks holding its shards (and HSDP's copies); a
        unit no rank used then has no gradient, .grad None, as in one process: a plain torch
        optimizer skips it, where a zero gradient would still be decayed by AdamW (and moved by
        its moments). A parameter unused inside a used unit keeps a zero slice of the shard's
        gradient: FSDPOptimizer keeps it unchanged (zero.py's keep_unchanged), a plain optimizer
        does not. Sent after every reduce-scatter is launched (the same place on every rank)."""
        local = [u for unit in self.units for u in unit.used]
        used, agree = or_used_flags(self.units, self.device)                    # (P,) uint8
        agree()
        if all(local):
            return               # every parameter was used here: no read (a host sync on a GPU)
        flags = iter(used.bool().tolist())
        for unit in self.units:
            unit.used = [next(flags) for _ in unit.params]
            if not any(unit.used):
                unit.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """For a plain torch optimizer over FSDP.parameters(): scale the shards' gradients so the
        whole model's gradient has 2-norm at most max_norm; returns the norm before clipping.
        Collective (an all-reduce of the squares): call on every rank, after
        finish_gradient_sync(). torch.nn.utils.clip_grad_norm_ would see this rank's shards only.
        FSDPOptimizer has its own, which also unscales fp16's loss scale first."""
        if max_norm <= 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
        norm = shards_norm(self.units, [u.grad for u in self.units], self.comm, {})
        grads = self.gradient_buffers()                                     # (S,) each, fp32
        # torch's rule (clip_grad_norm_): scale by max_norm / norm when that is below 1.
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale)
        return norm

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full (unsharded) gradients locally; the next backward outside reduces them.
        Saves the traffic of every micro-batch but one at the price of a full gradient per rank."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _free(self, unit, frozen: bool = True):
        if not self._whole_step:
            unit.free(frozen)

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
            for unit in self.units + self.frozen_units:
                unit.free()

    # ---- state ------------------------------------------------------------------------------

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The gradient shards this rank holds (fp32, on the device)."""
        return [u.grad for u in self.units if u.grad is not None]

    def frozen_shards(self) -> list[torch.Tensor]:
        """This rank's shards of the frozen weights (bytes): on the host under offload_params."""
        return [u.frozen.shard for u in self.units + self.frozen_units if u.frozen is not None]

    def device_shards(self) -> list[torch.Tensor]:
        """The parameter shards the device keeps besides FSDP.parameters(): the compute-dtype
        copies when the masters are offloaded, and the frozen shards (none under offload_params)."""
        return ([u.device_shard for u in self.units if u.device_shard is not None]
                + ([] if self.offload_params else self.frozen_shards()))

    def host_shards(self) -> list[torch.Tensor]:
        """offload_params: the shards that wait in host memory between their uses."""
        if not self.offload_params:
            return []
        return [u.host_shard for u in self.units if u.host_shard is not None] + self.frozen_shards()

    def bytes_per_step(self, micro_batches: int = 1, gathered_for_step: bool = False) -> int:
        """Bytes this rank sends per step (ring): per micro-batch one all-gather per unit for
        forward, one more for backward except the root's (it stays gathered), of its trained flat
        and of its frozen bytes; one reduce-scatter per unit with something to train (HSDP: and
        the shard's all-reduce over the copies); plus the used-flags (HSDP: OR'ed over the copies
        too) and FSDPOptimizer's norm (zero.py). 3 (N-1)/N of the trained model: 1.5x DDP.
        gathered_for_step (a pipeline's step): one all-gather and one reduce-scatter per unit
        for all the micro-batches, 2 (N-1)/N of the stage, DDP's volume."""
        size, wire = self.compute_dtype.itemsize, self.reduce_dtype.itemsize     # gathered, reduced
        gathers = lambda u: 1 if gathered_for_step else micro_batches * (1 if u in self.roots else 2)
        reductions = 1 if gathered_for_step else micro_batches
        trained = sum(gathers(u) * ring_bytes("all_gather", u.flat.numel(), size, u.comm.world_size)
                      + reductions * ring_bytes("reduce_scatter", u.flat.numel(), wire, u.comm.world_size)
                      + reductions * (ring_bytes("all_reduce", u.shard_numel, wire, u.replicas.world_size)
                                      if u.replicas is not None else 0)
                      for u in self.units)
        frozen = sum(gathers(u) * ring_bytes("all_gather", u.frozen.flat.numel(), 1, u.comm.world_size)
                     for u in self.units + self.frozen_units if u.frozen is not None)
        flags = norm = 0
        if self.replicas is not None:
            flags = ring_bytes("all_reduce", sum(len(u.params) for u in self.units if u.replicas), 1,
                               self.replicas.world_size)
            if any(u.replicas is None for u in self.units):   # experts: squares over the copies
                norm = ring_bytes("all_reduce", 1, 4, self.replicas.world_size)
        return trained + frozen + flags_and_norm_bytes(self.units, self.comm) + flags + norm

    @contextlib.contextmanager
    def frozen_gathered(self):
        """Inside, every frozen weight is whole on this rank (a checkpoint saves or loads them);
        on the way out, what was written into them goes back into this rank's shards.
        Collective (all-gathers): every rank enters. For checkpoints, not for training steps.
        Nested, only the outermost gathers and frees."""
        units = [u for u in self.units + self.frozen_units if u.frozen is not None]
        self._frozen_depth = getattr(self, "_frozen_depth", 0) + 1
        if self._frozen_depth == 1:
            for unit in units:
                flat = unit.frozen.flat
                flat.untyped_storage().resize_(flat.numel())
                unit.comm.all_gather(flat, unit.frozen.shard.to(self.device))
        try:
            yield
        finally:
            self._frozen_depth -= 1
            for unit in units if self._frozen_depth == 0 else ():
                frozen = unit.frozen
                frozen.shard.copy_(frozen.flat[unit.comm.rank * frozen.shard_bytes:
                                               (unit.comm.rank + 1) * frozen.shard_bytes])
                frozen.flat.untyped_storage().resize_(0)

    def names(self) -> dict:
        """{original parameter: its name in .module}."""
        return {p: name for name, p in self.module.named_parameters()}

    @torch.no_grad()
    def full_state_dict(self, all_ranks: bool = False) -> dict:
        """{name: fp32 tensor of its original shape}, on rank 0 (empty elsewhere) or all_ranks.
        Collective: every rank calls it. Under expert parallelism, only this rank's experts."""
        names, out = self.names(), {}
        for unit in self.units:
            flat = torch.empty(unit.flat.numel(), device=unit.flat.device)    # (N*S,) fp32
            unit.comm.all_gather(flat, unit.master.detach().to(flat.device, copy=True))
            out.update({names[p]: view.clone() for p, view in zip(unit.params, unit.views(flat))})
        with self.frozen_gathered():
            out.update({name: p.detach().float().clone() for name, p in self.module.named_parameters()
                        if not p.requires_grad})
        return out if all_ranks or self.comm.rank == 0 else {}


class FSDPOptimizer(ShardedOptimizer):
    """Any element-wise torch optimizer on the FSDP shards, with ZeRO's sharded step.

    The gradients arrive as fp32 shards (the reduce-scatter did ZeRO-2's work), so the update is
    zero.py's: unscale (fp16 loss scale), one global norm across ranks for clipping and for the
    inf/NaN skip that every rank agrees on, the inner step. No all-gather after it: the next
    forward gathers. Loop: zero_grad(); scale_loss(loss).backward() per micro-batch;
    clip_grad_norm_(max_norm) if clipping; step(). A torch.optim.Optimizer: schedulers drive it.
    offload: ZeRO-Offload, as ZeroOptimizer's: the fp32 master shards (FSDP's parameters) and
    the optimizer state move to the host and the step runs there; the device keeps each shard
    in the compute dtype for the all-gathers, and the gradient shards.
    """

    def __init__(self, fsdp: FSDP, optimizer_cls=torch.optim.AdamW,
                 scaler: DynamicLossScaler | None = None, offload: bool = False, **optimizer_kwargs):
        if offload not in (True, False):
            raise ValueError(f"FSDPOptimizer offload must be True (the optimizer on the CPU) or "
                             f"False, got {offload!r}")
        # Parameters on the host: so are their fp32 masters, so the step runs there too.
        offload = offload or fsdp.offload_params
        self.fsdp, self.offload, self.comm = fsdp, offload, fsdp.comm
        # HSDP: the copies hold the same shards; the first copy's ranks write checkpoints.
        self.replica_rank = fsdp.replicas.rank if fsdp.replicas is not None else 0
        if offload:
            for unit in fsdp.units:
                rounded = unit.master.detach().to(fsdp.compute_dtype, copy=True)         # (S,)
                if fsdp.offload_params:
                    unit.host_shard = host_copy(rounded, dtype=fsdp.compute_dtype)
                else:
                    unit.device_shard = rounded
                unit.host_grad = host_buffer(rounded)
                unit.master.data = host_copy(unit.master)          # the device's fp32 copy is freed
        self.flats, self.masters = fsdp.units, [u.master for u in fsdp.units]
        super().__init__(self.masters, optimizer_cls, optimizer_kwargs,
                         scaler or DynamicLossScaler(enabled=fsdp.compute_dtype == torch.float16))

    def _gradients(self):
        self.fsdp.finish_gradient_sync()
        # Offloaded, zero.py's ShardedOptimizer._unscale copies them out, Adam steps on the CPU,
        # the updated shards go back in (Unit.refresh), where the next forward's all-gathers wait.
        units = [u for u in self.fsdp.units if u.grad is not None]
        return [u.grad for u in units], [u.master for u in units]        # (S,) each, on the device

    def _used_anywhere_flags(self, device) -> tuple:
        # FSDP.finish_gradient_sync (in _gradients) OR'ed the flags over the ranks already.
        used = flags_to_device([u for unit in self.fsdp.units for u in unit.used], device)
        return used, lambda: None

    def _write_back(self):
        if self.offload:
            self.refresh_params()

    def host_tensors(self) -> list[torch.Tensor]:
        return super().host_tensors() + self.fsdp.host_shards()

    def frozen_gathered(self):
        """FSDP.frozen_gathered: the frozen weights whole, for a checkpoint (collective)."""
        return self.fsdp.frozen_gathered()

    def zero_grad(self, set_to_none: bool = True):
        for unit in self.fsdp.units:
            unit.used = [False] * len(unit.params)
            if set_to_none:
                unit.grad = unit.master.grad = None
            elif unit.grad is not None:
                unit.grad.zero_()

    def refresh_params(self):
        """After the masters were written: drop any gathered copy; the next forward gathers."""
        for unit in self.fsdp.units:
            unit.refresh()
