"""FSDP's state as the rest of the program reads it: a part of fsdp.FSDP a reader can skip.

fsdp.py is the lecture: units gathered, freed, their gradients reduce-scattered. Around it,
other code asks an FSDP about its shards: memory.py counts the bytes each rank holds, the
optimizer moves the masters to the host (ZeRO-Offload), a plain torch optimizer clips the
global norm, a checkpoint reads the whole model, and the napkin math checks the bytes a step
sends. Those answers live here, in FSDPState, a base class of fsdp.FSDP (reading its units,
roots, comm and dtypes); HSDP, parameter offload and the frozen base override some of them.
Test: python -m pytest tests/test_fsdp.py
"""
import contextlib

import torch

from collectives import ring_bytes
from flat import flags_and_norm_bytes, shards_norm
from offload import host_buffer, host_copy


class FSDPState:
    """The shards, their gradients and the bytes a step sends, read from an FSDP's units."""

    # ---- the shards and their gradients (memory.py, the optimizer) ---------------------------

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The gradient shards this rank holds (fp32, on the device)."""
        return [u.grad for u in self.units if u.grad is not None]

    def kept_shards(self) -> list[torch.Tensor]:
        """The shards every unit keeps besides FSDP.parameters() (the compute-dtype copies when
        the masters are offloaded)."""
        return [shard for unit in self.roots + self.order for shard in unit.kept()]

    def device_shards(self) -> list[torch.Tensor]:
        """The kept shards that live on the device (memory.py counts them): all of them here."""
        return self.kept_shards()

    def host_shards(self) -> list[torch.Tensor]:
        """The kept shards that wait in host memory: none here (fsdp_offload.py's)."""
        return []

    def offload_masters(self):
        """ZeRO-Offload (FSDPOptimizer(offload=True)): each fp32 master shard moves to the host,
        where the optimizer steps; the device keeps it rounded, for the all-gathers."""
        for unit in self.units:
            unit.compute_shard = unit.master.detach().to(self.compute_dtype, copy=True)    # (S,)
            unit.host_grad = host_buffer(unit.compute_shard)
            unit.master.data = host_copy(unit.master)          # the device's fp32 copy is freed

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
        # torch's rule (clip_grad_norm_): scale by max_norm / norm when that is below 1.
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in self.gradient_buffers():                                   # (S,) each, fp32
            g.mul_(scale)
        return norm

    # ---- the bytes a step sends (the napkin math's check) -------------------------------------

    def _gathers_per_step(self, unit, micro_batches: int, gathered_for_step: bool) -> int:
        """All-gathers of unit per step: per micro-batch one for forward, one more for backward
        except the root's (it stays gathered); under gathered_for_step, one."""
        return 1 if gathered_for_step else micro_batches * (1 if unit in self.roots else 2)

    def bytes_per_step(self, micro_batches: int = 1, gathered_for_step: bool = False) -> int:
        """Bytes this rank sends per step (ring): each unit's all-gathers, and per micro-batch one
        reduce-scatter per unit; plus the used-flags and FSDPOptimizer's norm (flat.py).
        3 (N-1)/N of the model: 1.5x DDP. gathered_for_step (a pipeline's step): one
        all-gather and one reduce-scatter per unit for all the micro-batches, 2 (N-1)/N of the
        stage, DDP's volume."""
        size, wire = self.compute_dtype.itemsize, self.reduce_dtype.itemsize     # gathered, reduced
        reductions = 1 if gathered_for_step else micro_batches
        return sum(self._gathers_per_step(u, micro_batches, gathered_for_step)
                   * ring_bytes("all_gather", u.flat.numel(), size, u.comm.world_size)
                   + reductions * ring_bytes("reduce_scatter", u.flat.numel(), wire, u.comm.world_size)
                   for u in self.units) + flags_and_norm_bytes(self.units, self.comm)

    # ---- the whole model (checkpoints) ----------------------------------------------------------

    def frozen_gathered(self):
        """A checkpoint reads and writes the frozen weights inside this (collective): whole here,
        as there are none (fsdp_frozen.py gathers its sharded base)."""
        return contextlib.nullcontext()

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
        return out if all_ranks or self.comm.rank == 0 else {}
