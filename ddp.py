"""Distributed data parallel: every rank holds the whole model and averages its gradients.

Each rank runs forward and backward on its own slice of the global batch, then an all-reduce
averages the gradients so that every rank takes the same optimizer step (Li et al. 2020,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB, section 3.2:
the naive solution, gradient bucketing, overlapping communication with backward, no_sync).
Left out: the autograd-graph walk that finds unused parameters early, rebuilding buckets in
the observed order, communication hooks, re-broadcasting buffers at every forward.
Run: torchrun --nproc_per_node 2 train.py --strategy ddp; test: python -m pytest tests/test_ddp.py

Shapes: N ranks in the group, P trainable parameters, L_b elements in bucket b's flat buffer.
"""
from contextlib import contextmanager

import torch
import torch.nn as nn

from collectives import as_comm, ring_bytes
from launch import flags_to_device
from flat import FlatParams, InOrder, hook_gradient, split_into_buckets
from mixed_precision import on_the_wire
from placements import by_reduction
from process_groups import check_same_parameters


# ---- naive: one blocking all-reduce per parameter, after backward -----------------------------

def all_reduce_gradients(module: nn.Module, group=None):
    """Average every parameter's gradient over the group, one blocking all-reduce each.

    Correct, and the baseline the bucketed version must equal, but slow twice over: the network
    idles during backward and backward's caller idles during the network, and a model of
    hundreds of small tensors pays each message's latency hundreds of times. It assumes every
    rank produced a gradient for the same parameters (collectives match by order).
    """
    comm = as_comm(group)
    for p in module.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, op="avg")


# ---- bucketed and overlapped, as PyTorch's reducer does it -------------------------------------
#
#   registration order:  p0  p1  p2  p3  p4  p5     forward runs roughly left to right,
#   gradients arrive:    p5  p4  p3  p2  p1  p0     so backward produces them right to left
#
#   buckets (at most bucket_mb MiB, one flat buffer each, filled in arrival order):
#      bucket 0: [p5 | p4]   bucket 1: [p3 | p2 | p1]   bucket 2: [p0]
#
#   time ->  backward  | p5 p4 | p3 p2 p1 | p0 |
#            network           |== all-reduce b0 ==|== b1 ==|== b2 ==|   finish_gradient_sync()
#
# A bucket's all-reduce starts the moment its last gradient lands, while backward goes on
# computing the next layers: for a model whose backward takes longer than its communication,
# only the last bucket's all-reduce is exposed. Few large messages instead of one per tensor
# reach the link's bandwidth; too large a bucket would start its message too late to overlap.
# The pieces are flat.py's, shared with ZeRO and FSDP: split_into_buckets, a FlatParams per
# bucket, hook_gradient, and InOrder, which launches the buckets in one order on every rank.

class DDP(nn.Module):
    """Wrap `module` for data parallel training over `group` (a Comm, a ProcessGroup or None).

    Per step: forward and backward as usual (gradient hooks launch the buckets' all-reduces as
    backward runs), then finish_gradient_sync() before optimizer.step(). For gradient
    accumulation, run the backwards of all but the last micro-batch inside `with ddp.no_sync():`.
    A parameter only some ranks hold (an expert, placements.py's holders) starts from and is
    reduced over its holders.
    reduce_dtype: the dtype each bucket is averaged in (None: the gradients' own, as torch's DDP;
    torch.float32 for bf16/fp16 gradients: upcast before the all-reduce, the mean rounded back
    into the bucket once, where torch's DDP would need a communication hook).
    """

    keeps_whole_gradients = True        # GradientSyncs: every rank holds them all, always

    def __init__(self, module: nn.Module, group=None, bucket_mb: float = 25,
                 reduce_dtype: torch.dtype | None = None):
        super().__init__()
        self.module, self.reduce_dtype = module, reduce_dtype
        self.comm = as_comm(group)
        # Trainable parameters only: a frozen one gets no gradient, so it needs no hook, no slot
        # and no bytes. named_parameters() lists a tied (shared) weight once, and autograd
        # accumulates all its uses into one .grad before the post-accumulate hook fires once.
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        names = {p: name for name, p in trainable}
        self.params = [p for _, p in reversed(trainable)]        # (P,) in gradient-arrival order
        if not self.params:
            raise ValueError("DDP: the module has no trainable parameters (requires_grad=True), "
                             "so there are no gradients to average; train at least one parameter")
        check_same_parameters(list(module.parameters()), self.comm)
        self._broadcast_from_rank0()
        # Consecutive parameters in gradient-arrival order, one dtype and device per bucket.
        # Each bucket is a FlatParams of one shard (this rank owns all of it), and beside it a
        # gradient buffer of the same layout. Memory: param.grad is its slot in the buffer (a
        # view, as PyTorch's gradient_as_bucket_view=True), pointed there by forward, so backward
        # accumulates into the bucket itself: the buckets are the gradients, with no fresh .grad
        # allocated and copied in each step after zero_grad(set_to_none=True).
        # Experts (moe.py's expert parallelism) go in buckets of their own: their placements say how.
        self.buckets = []
        for how, params in by_reduction(self.params, self.comm):
            for chunk in split_into_buckets(params, bucket_mb):
                bucket = FlatParams(chunk, world_size=1)
                bucket.comm, bucket.op, bucket.divide = how
                bucket.grad_flat = torch.zeros_like(bucket.flat)                 # (L_b,)
                self.buckets.append(bucket)
        self.params = [p for bucket in self.buckets for p in bucket.params]      # bucket order
        self.names = [names[p] for p in self.params]
        self._bucket_of = [b for b, bucket in enumerate(self.buckets) for _ in bucket.params]
        self._slot = [slot for bucket in self.buckets for slot in bucket.views(bucket.grad_flat)]
        for i, p in enumerate(self.params):
            hook_gradient(p, self._grad_ready, i)
        # Each full bucket's all-reduce starts at once, in bucket order on every rank.
        self._order = InOrder(self.buckets, launch=self._launch, retire=self._retire)
        self._syncing = True                                     # False inside no_sync()
        self._hooked = [False] * len(self.params)                # hook has fired: .grad is its slot
        self._reset()

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._gradients_into_buckets()
        return self.module(*args, **kwargs)

    def _gradients_into_buckets(self):
        """Each parameter whose .grad was set to None (zero_grad(set_to_none=True)) gets its zeroed
        slot back as .grad, so autograd adds the coming gradient into the bucket in place. Only
        those whose hook has fired before: a gradient written outside autograd (a zero-bubble
        pipeline's W) fires none, and only its arrival as a .grad says it was used."""
        start = 0
        for bucket in self.buckets:
            params, slots = bucket.params, self._slot[start: start + len(bucket.params)]
            hooked = self._hooked[start: start + len(bucket.params)]
            start += len(params)
            if all(hooked) and all(p.grad is None for p in params):
                bucket.grad_flat.zero_()                         # one kernel for the bucket
                for p, slot in zip(params, slots):
                    p.grad = slot
                continue
            for p, slot, fired in zip(params, slots, hooked):
                if fired and p.grad is None:
                    slot.zero_()
                    p.grad = slot

    def _by_group(self, tensors) -> list:
        """[(the group tensors are reduced over, tensors)]: placements.by_reduction's groups."""
        return [(comm, part) for (comm, _, _), part in by_reduction(tensors, self.comm)]

    def _broadcast_from_rank0(self):
        # Ranks may have been seeded differently: rank 0's initial weights (and buffers) become
        # everyone's (an expert's: its group's rank 0's). One broadcast per dtype of a flat copy,
        # not one per tensor; dict keys keep first-seen order, so every rank issues the
        # broadcasts in the same order.
        for comm, tensors in self._by_group([*self.module.parameters(), *self.module.buffers()]):
            for kind in dict.fromkeys((t.dtype, t.device) for t in tensors):
                group = [t for t in tensors if (t.dtype, t.device) == kind]
                flat = torch.cat([t.detach().reshape(-1) for t in group])    # (sum of numel,)
                comm.broadcast(flat, src=0)
                with torch.no_grad():
                    for t, value in zip(group, flat.split([t.numel() for t in group])):
                        t.copy_(value.view_as(t))

    def _launch(self, bucket):
        wire = on_the_wire(bucket.grad_flat, self.reduce_dtype)          # (L_b,) the reduce dtype
        return bucket.comm.all_reduce(wire, op=bucket.op, async_op=True), wire

    @staticmethod
    def _retire(bucket, started):
        handle, wire = started
        handle.wait()
        if bucket.divide != 1:
            wire.div_(bucket.divide)
        if wire is not bucket.grad_flat:
            bucket.grad_flat.copy_(wire)                     # the mean, rounded once

    def _reset(self):
        self._ready = [False] * len(self.params)
        self._used = [False] * len(self.params)                  # got a gradient since the last sync
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)

    # ---- during backward ------------------------------------------------------------------

    def _grad_ready(self, i: int):
        """Post-accumulate hook of self.params[i]: its .grad holds this backward's gradient."""
        self._used[i] = self._hooked[i] = True
        if not self._syncing:
            return                                               # accumulate locally in .grad
        if self._ready[i]:
            raise RuntimeError(
                f"DDP: parameter {self.names[i]!r} received a second gradient before its first was "
                f"synchronised. For gradient accumulation run all but the last micro-batch's "
                f"backward inside `with ddp.no_sync():`, and call ddp.finish_gradient_sync() after "
                f"each synchronised backward (before optimizer.step()).")
        p = self.params[i]
        if p.grad.data_ptr() != self._slot[i].data_ptr():
            self._slot[i].copy_(p.grad)
            p.grad = self._slot[i]
        self._mark_ready(i)

    def _mark_ready(self, i: int):
        self._ready[i] = True
        bucket = self.buckets[self._bucket_of[i]]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._order.ready(bucket)

    # ---- after backward -------------------------------------------------------------------

    def finish_gradient_sync(self):
        """Launch what backward did not, wait for every bucket, write averaged gradients to .grad.

        Call after the (last) backward of a step and before optimizer.step().
        """
        # A parameter whose hook did not fire in this backward was not used by it, but may hold
        # a gradient accumulated under no_sync(); one with no gradient at all contributes zeros.
        for i, p in enumerate(self.params):
            if not self._ready[i]:
                if p.grad is None:
                    self._slot[i].zero_()
                elif p.grad.data_ptr() != self._slot[i].data_ptr():
                    self._slot[i].copy_(p.grad)
                self._mark_ready(i)
        # A parameter that no rank used must keep grad None, as a single process would leave
        # it (AdamW would otherwise decay it): OR the local "used" flags over the ranks, a P-byte
        # message launched after every bucket (the same position on every rank) so it overlaps.
        # (An expert's flag over the ranks holding that expert: a second, shorter message.)
        # Used here: its hook fired (no_sync's too), or a gradient came as a .grad of its own.
        local = [used or (p.grad is not None and p.grad.data_ptr() != slot.data_ptr())
                 for used, p, slot in zip(self._used, self.params, self._slot)]
        used = flags_to_device(local, self.params[0].device)                              # (P,)
        flags, start = [], 0
        for comm, params in self._by_group(self.params):
            flags.append(comm.all_reduce(used[start: start + len(params)], op="max", async_op=True))
            start += len(params)
        self._order.launch_rest()                                # (every bucket is full by now)
        self._order.wait_all()
        for handle in flags:
            handle.wait()
        # Read (a host sync on a GPU) only if this rank missed one: else every one was used.
        everywhere = local if all(local) else used.tolist()
        for p, slot, used_anywhere in zip(self.params, self._slot, everywhere):
            p.grad = slot if used_anywhere else None             # averaged in place
        self._reset()

    @contextmanager
    def no_sync(self):
        """Backwards inside accumulate into .grad locally; the next one outside syncs the sum."""
        outer, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = outer

    # ---- bookkeeping ------------------------------------------------------------------------

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The buckets' flat buffers: the gradients themselves (each param.grad is a view into one)."""
        return [bucket.grad_flat for bucket in self.buckets]

    def bytes_per_step(self) -> int:
        """Bytes this rank sends per synchronised step, as the ring schedule sends them.

        2(N-1)/N x each bucket (padded to N equal chunks) in the reduce dtype, plus the P-byte
        used-flag vector: about twice the gradients' bytes, nearly independent of N.
        """
        grads = sum(ring_bytes("all_reduce", b.grad_flat.numel(),
                               (self.reduce_dtype or b.grad_flat.dtype).itemsize,
                               b.comm.world_size) for b in self.buckets)
        flags = sum(ring_bytes("all_reduce", len(params), 1, comm.world_size)
                    for comm, params in self._by_group(self.params))
        return grads + flags
