"""ZeRO-Offload's host memory: the sharded optimizer's fp32 masters and Adam moments on the CPU.

ZeRO-Offload (Ren et al. 2021, section 4) keeps each rank's shard of the fp32 master and the
optimizer state in host memory and runs the step there: the device holds only the parameters
and the gradient shards; each step a gradient shard crosses to the host and its updated master
back. This file is that delta on the sharded step (zero.py's, mechanics/fsdp_optimizer.py's):
pinned host buffers, the copies between host and device, what an FSDP unit keeps on the device
once its master is on the host (MasterOnHost), and a step whose norm, used-flags and gradients
reach the host in one wait (OffloadedStep). ZeRO-Offload on stage 1 or 2
(extensions/zero_offload.py) and FSDP (mechanics/fsdp_optimizer.py's offload, and
extensions/fsdp_offload.py's of its parameters) use it.
Left out: the paper's one-step delayed update and its vectorised CPU Adam (torch's own runs).
Test: python -m pytest tests/test_zero.py -k offload

Shapes: S elements per shard, P parameters of the sharded flats.
"""
import weakref

import torch

from foundations.dtypes import master_dtype
from mixed_precision import unscale_grads


def host_buffer(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty host tensor shaped like `like`, in dtype (default: the master dtype of like's,
    fp32, or fp64 for fp64: dtypes.master_dtype), pinned when `like` is on a GPU: only from
    pinned (page-locked) memory can a copy run as a DMA transfer that does not block the CPU."""
    buffer = torch.empty(like.shape, dtype=dtype or master_dtype(like.dtype))
    if like.is_cuda:
        lock_pages(buffer)
    return buffer


def lock_pages(t: torch.Tensor):
    """Pin t's own memory where it is (cudaHostRegister), until its storage is freed: exactly its
    bytes, as napkin/memory.py counts them. torch.empty(..., pin_memory=True) would take a block of
    torch's caching host allocator, rounded up to a power of two: up to twice the bytes, for
    buffers held the whole run. (Copies from registered memory run asynchronously too.)"""
    if t.nbytes == 0:
        return
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(t.data_ptr(), t.nbytes, 0))
    # The storage outlives this tensor object (a parameter's .data, views): unpin when it goes.
    weakref.finalize(t.untyped_storage(), cudart.cudaHostUnregister, t.data_ptr())


def host_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of `t` in (pinned) host memory, in dtype (default: host_buffer's, fp32 or fp64)."""
    return host_buffer(t, dtype).copy_(t.detach())


def host_to_device(device_tensor: torch.Tensor, host: torch.Tensor):
    """Copy a pinned host tensor into a device tensor (of another dtype: the fp32 master into a
    16-bit shard) without the host waiting. torch converts a dtype on the source's side, and a
    converted host tensor is pageable memory, which the host copies out itself: so the bytes
    cross in the host's dtype, from pinned memory, and are rounded on the device."""
    if host.dtype != device_tensor.dtype:
        host = host.to(device_tensor.device, non_blocking=True)
    device_tensor.copy_(host, non_blocking=True)


def gradients_to_host(grads: list, buffers: list) -> list:
    """Copy each device gradient shard (S,) into its fp32 host buffer (S,); return the buffers."""
    for grad, buffer in zip(grads, buffers):
        buffer.copy_(grad, non_blocking=True)    # queued behind the reduce-scatter that made grad
    if grads and grads[0].is_cuda:
        # One wait for all of them (the copies run back to back): the CPU step must not read a
        # buffer before its bytes have landed.
        torch.cuda.current_stream(grads[0].device).synchronize()
    return buffers


class MasterOnHost:
    """Where an FSDP unit keeps what the device still needs once ZeRO-Offload moved its fp32 master
    to host memory (fsdp.Unit.offloaded), where FSDPOptimizer(offload=True) steps on it:
        compute_shard (S,) compute dtype, on the device: the master rounded, what the gathers send
        grad          (S,) fp32, on the device: the reduced gradient (a host master's .grad
                      cannot live there)
        host_grad     (S,) fp32, on the host: where the optimizer copies the gradient."""

    def __init__(self, master: torch.Tensor, compute_dtype: torch.dtype):
        self.compute_shard = master.detach().to(compute_dtype, copy=True)    # (S,)
        self.host_grad = host_buffer(self.compute_shard)
        master.data = host_copy(master)          # the device's fp32 copy is freed
        self.grad = None

    def refresh(self, master: torch.Tensor):
        """The master changed: copied back to its compute shard (host -> device, asynchronous
        from pinned memory)."""
        host_to_device(self.compute_shard, master.detach())


class OffloadedStep:
    """The sharded step with its masters in host memory, mixed into a sharded optimizer: zero.py's
    (by extensions/zero_offload.py) or mechanics/fsdp_optimizer.py's FSDPOptimizer.
    Each flat's `master` (S,) fp32 and the inner optimizer's state live on the host, beside
    `host_grad`, the (S,) fp32 host buffer its reduced gradient is copied into. The inner
    optimizer (torch's) steps there. The norm is taken on the device, where the gradient shards
    are (and NCCL reduces), and copied to the host with them: one wait for all, the step's one
    host sync. Clipping and the inf/NaN check then read host memory only.
    offload: True for ZeRO-Offload; FSDP decides per instance."""

    offload = True
    _decision_host = None   # the norm and flags land here, beside the gradients

    def unscale_gradients(self) -> list:
        if not self.offload:
            return super().unscale_gradients()
        self.reduce_gradients()
        return self.gradient_shards()              # (S,) each, on the device, still scaled: to_host

    def norm_pieces(self, weight_of=None) -> list:
        if not self.offload:
            return super().norm_pieces(weight_of)
        # The squares of the scaled gradients over scale^2 (a power of 4: exact), in the weight.
        scale2 = self.scaler.scale ** 2
        return super().norm_pieces(lambda p, n: (weight_of(p, n) if weight_of else 1.0) / scale2)

    def global_norm(self) -> torch.Tensor:
        if not self.offload or self._norm is not None:
            return super().global_norm()
        norm = super().global_norm().reshape(1)                         # on the device
        flags = [] if self._used is None else [self._used.to(norm.dtype)]
        decision = self.to_host(torch.cat([norm, *flags]))
        self._norm, self._used = decision[0], (decision[1:] if self._used is not None else None)
        return self._norm

    def to_host(self, decision: torch.Tensor) -> torch.Tensor:
        """This rank's gradient shards and decision (the norm, maybe the flags: (1,) or (1 + P,))
        to host memory in one wait, the shards unscaled there into the masters' .grad; returns
        the decision, on the host."""
        shards = [(flat, grad, host) for flat, grad, host
                  in zip(self.flats, self.gradient_shards(), self.host_grads()) if grad is not None]
        if self._decision_host is None or self._decision_host.numel() < decision.numel():
            flags = sum(len(flat.params) for flat in self.flats)
            self._decision_host = host_buffer(decision.new_empty(max(1 + flags, decision.numel())))
        *grads, decision = gradients_to_host([*(grad for _, grad, _ in shards), decision],
                                             [*(host for _, _, host in shards),
                                              self._decision_host[: decision.numel()]])
        unscale_grads(grads, [flat.master for flat, _, _ in shards], self.scaler.scale)
        return decision

    def host_tensors(self) -> list[torch.Tensor]:
        """What offload keeps in host memory: fp32 masters, optimizer state, gradient buffers."""
        if not self.offload:
            return []
        return [*self.state_tensors(), *self.host_grads()]

    def host_grads(self) -> list[torch.Tensor]:
        """Each flat's (S,) fp32 host buffer for its reduced gradient."""
        return [flat.host_grad for flat in self.flats]

    @staticmethod
    def _host_master(flat, shard: torch.Tensor) -> torch.Tensor:
        """An (S,) fp32 host copy of `shard` for flat's master, and flat.host_grad, the (S,) fp32
        host buffer its reduced gradient is copied into. Even in fp32 the host needs its own
        copy: the CPU cannot update device memory."""
        flat.host_grad = host_buffer(shard)
        return host_copy(shard)
