"""A frozen base sharded too: the talk's QLoRA + FSDP case, as a delta on fsdp.py (read that first).

fsdp.FSDP shards what trains. Fine-tuning with LoRA trains a few adapters beside a frozen base
that is nearly the whole model, so here each unit's frozen tensors (LoRA's base weights, and
QLoRA's 4-bit NF4 codes and scales, quantization.py) are a second flat buffer of raw bytes,
sharded 1/N and all-gathered beside the trained one, never reduced. A 4-bit base goes over the
wire as it is stored, 4.5 bits a weight (4.13 with double quantization), and is dequantized
after the gather, in forward and again in backward (QLoRA: Dettmers et al. 2023). A module
with nothing to train (LoRA's embeddings and head, a frozen block) is a unit of frozen bytes only.
Left out: mixing frozen and trained values in one flat buffer (FSDP1's use_orig_params).
Run: torchrun --nproc_per_node 2 train.py --lora --quantize-base nf4 --strategy fsdp;
test: python -m pytest tests/test_fsdp_qlora.py

Shapes: N ranks (of a shard group), B bytes of a unit's frozen tensors, ceil(B / N) per shard.
"""
import contextlib

import torch
import torch.nn as nn

from fsdp import FSDP, Unit
from quantization import NF4Weight


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

    def __init__(self, tensors: list[torch.Tensor], comm, device):
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
        comm.broadcast(self.flat, src=0)         # ranks seeded differently: all start as rank 0's
        self.shard = self.flat[comm.rank * self.shard_bytes: (comm.rank + 1) * self.shard_bytes].clone()
        with torch.no_grad():
            for t, start in zip(tensors, self.offsets):
                t.data = self.flat[start: start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        self.flat.untyped_storage().resize_(0)


class FrozenBaseUnit(Unit):
    """A Unit whose module has frozen tensors too: its FrozenBytes (or None), gathered with it."""
    frozen = None

    def flats(self) -> list[torch.Tensor]:
        return super().flats() + ([self.frozen.flat] if self.frozen else [])

    def sends(self) -> list[tuple]:
        return super().sends() + ([(self.frozen.shard, self.frozen.flat)] if self.frozen else [])

    def kept(self) -> list[torch.Tensor]:
        return super().kept() + ([self.frozen.shard] if self.frozen else [])

    def refresh(self):
        """The master changed: the trained flat's gathered copy is stale, not the frozen bytes.
        Those stay as they are: a checkpoint's load writes them whole inside frozen_gathered and
        refreshes the masters there too, and frozen_gathered copies them back to the shards at
        its end (freed here, what it wrote would be lost). The unit gathers again at its next use."""
        self.refresh_offloaded()
        self.free_trained()
        self.gathered = False                      # the trained flat is gathered again at its use

    def free_trained(self):
        """Drop the gathered trained flat only: the frozen bytes stay gathered, if they were
        (and the unit with them: a zero-bubble pipeline's reductions come after its step freed
        everything)."""
        self.wait()
        self.flat.untyped_storage().resize_(0)
        self.gathered = self.gathered and self.frozen is not None


class FrozenUnit(Unit):
    """A module whose tensors are all frozen (LoRA's embeddings and head, a frozen block): only
    its FrozenBytes, gathered and freed as a Unit's are. No flat parameter, so not Unit's
    constructor: nothing here is trained, reduced or stepped."""
    params = ()

    def __init__(self, index, module, frozen: FrozenBytes, comm):
        self.index, self.module, self.frozen, self.comm = index, module, frozen, comm
        self.gathering, self.gathered = (), False

    def flats(self) -> list[torch.Tensor]:
        return [self.frozen.flat]

    def sends(self) -> list[tuple]:
        return [(self.frozen.shard, self.frozen.flat)]

    def kept(self) -> list[torch.Tensor]:
        return [self.frozen.shard]


class FrozenBaseFSDP(FSDP):
    """FSDP(module, **options) for a module with frozen parameters (requires_grad=False, cast
    to the compute dtype) and QLoRA's 4-bit weights: each unit's are sharded as its FrozenBytes,
    a module with nothing to train is a FrozenUnit (in frozen_units). FSDPOptimizer and
    checkpoints see frozen_gathered(), every frozen weight whole."""

    unit_type = FrozenBaseUnit

    def __init__(self, module, **options):
        super().__init__(module, **options)
        self.frozen_units = [u for u in self.root_units + self.forward_order if not u.params]

    def _tensors_of(self, m: nn.Module) -> list[torch.Tensor]:
        quantized = [b for name, b in m.named_buffers(recurse=False)
                     if isinstance(m, NF4Weight) and name != "levels"]   # levels: a constant
        return super()._tensors_of(m) + quantized

    def _make_unit(self, index, module, tensors):
        params = [t for t in tensors if t.requires_grad]
        kept = [t for t in tensors if not t.requires_grad]                # frozen, 4-bit
        with torch.no_grad():
            for t in kept:
                if isinstance(t, nn.Parameter):      # (the 4-bit codes and scales stay as stored)
                    t.data = t.data.to(self.compute_dtype)
        if not params:
            return FrozenUnit(index, module, FrozenBytes(kept, self.comm, self.device), self.comm)
        unit = super()._make_unit(index, module, params)
        unit.frozen = FrozenBytes(kept, unit.comm, self.device) if kept else None
        return unit

    def _before_backward(self, unit):
        i = self.forward_order.index(unit) + 1
        # The unit after it in forward, if any.
        after = self.forward_order[i] if i < len(self.forward_order) else None
        if after is not None and after.frozen is not None:
            self._free(after)  # its backward is over: its frozen bytes go (_free_after_backward)
        super()._before_backward(unit)

    def _free_after_backward(self, unit):
        """The gradients are out: the gathered trained parameters can go. Not the frozen ones:
        the unit's backward may still need them (LoRA's dx = dy W0 can come after the adapters'
        gradients), so they go when the unit before it starts its backward, or at the end."""
        if not self._gathered_for_step:
            unit.free_trained()

    def _finish_backward(self):
        super()._finish_backward()
        for unit in self.root_units + self.forward_order:
            if unit.frozen is not None:
                self._free(unit)

    def frozen_shards(self) -> list[torch.Tensor]:
        """This rank's shards of the frozen weights (bytes): on the host under fsdp_offload."""
        return [u.frozen.shard for u in self.root_units + self.forward_order
                if u.frozen is not None]

    @contextlib.contextmanager
    def frozen_gathered(self):
        """Inside, every frozen weight is whole on this rank (a checkpoint saves or loads them);
        on the way out, what was written into them goes back into this rank's shards.
        Collective (all-gathers): every rank enters. For checkpoints, not for training steps.
        Nested, only the outermost gathers and frees."""
        units = [u for u in self.root_units + self.forward_order if u.frozen is not None]
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

    @torch.no_grad()
    def full_state_dict(self, all_ranks: bool = False) -> dict:
        """FSDP's, with the frozen parameters (fp32)."""
        out = super().full_state_dict(all_ranks)
        with self.frozen_gathered():                                    # collective: every rank
            frozen = {name: p.detach().float().clone() for name, p in self.module.named_parameters()
                      if not p.requires_grad}
        return {**out, **frozen} if all_ranks or self.comm.rank == 0 else {}
