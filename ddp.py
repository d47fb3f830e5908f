"""Distributed data parallel: every rank holds the whole model and averages its gradients.

Each rank runs forward and backward on its own slice of the global batch, then an all-reduce
averages the gradients so that every rank takes the same optimizer step (Li et al. 2020,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB, section 3.2),
here in that section's order: 1. the naive per-parameter all-reduce, 2. gradient buckets,
3. each bucket's all-reduce overlapped with backward, 4. the finish, 5. no_sync.
(The lecture shows step 1 for DDP; it meets the overlap of step 3 under ZeRO-2, zero.py.)
Left out: the autograd-graph walk that finds unused parameters early, rebuilding buckets in
the observed order, communication hooks, re-broadcasting buffers at every forward.
Run alone: torchrun --nproc_per_node 2 ddp.py (in training: train.py --strategy ddp); test:
python -m pytest tests/test_ddp.py

Shapes: N ranks in the group, P trainable parameter tensors (not elements), L_b elements in
bucket b's flat buffer.
"""
import itertools
import os
import sys
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from foundations.comm import Comm
from foundations.alone import start_alone
from foundations.flat import FlatParams
from foundations.process_groups import check_same_parameters


# ---- 1. naive: one blocking all-reduce per parameter, after backward ---------------------------

def all_reduce_gradients(module: nn.Module, group=None):
    """Average every parameter's gradient over the group, one blocking all-reduce each.

    Correct, and the baseline the bucketed version must equal, but slow twice over: the network
    idles during backward and backward's caller during the network, and a model of hundreds of
    small tensors pays a message's latency hundreds of times. It assumes every rank produced a
    gradient for the same parameters (collectives match by order)."""
    comm = Comm.from_group(group)
    for p in module.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, op="avg")


# ---- 2. buckets, 3. overlapped with backward, as PyTorch's reducer does it ---------------------
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
# A bucket's all-reduce starts the moment its last gradient lands, while backward computes the
# next layers: if backward takes longer than the communication, only the last bucket's is exposed.
# Few large messages reach the link's bandwidth; too large a bucket starts too late to overlap.
# ZeRO's buckets are cut the same way (foundations/flat.py's split_into_buckets, this one's twin).


def split_into_buckets(tensors: list, bucket_mb: float) -> list[list]:
    """Consecutive tensors grouped into buckets of at most bucket_mb MiB, one dtype and device
    each. A tensor larger than the cap gets a bucket of its own."""
    cap = bucket_mb * 2**20
    buckets, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > cap or (t.dtype, t.device) != (buckets[-1][-1].dtype,
                                                                        buckets[-1][-1].device):
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


class DDP(nn.Module):
    """Wrap `module` for data parallel training over `group` (a Comm, a ProcessGroup or None).

    Per step: forward and backward as usual, then finish_gradient_sync(), then optimizer.step().
    Backward's gradient hooks launch the buckets' all-reduces as it runs. finish_gradient_sync()
    waits for them; torch's DDP does this in a callback at the end of backward.
    For gradient accumulation, run all but the last micro-batch's backward inside `ddp.no_sync()`.
    reduce_dtype: the dtype each bucket is averaged in (None: the gradients' own, as torch's DDP).
    reductions: the parameters in parts, [((comm, op, divide), parameters)], in an order every
    rank shares. A part's gradients are reduced by `op` over comm, then divided by `divide`.
    comm is a Comm (Comm.from_group wraps a process group once): parts on one group share one Comm.
    Default: one part, all averaged over `group`. Where not every rank holds every parameter, the
    composition hands in the parts (composition/parallelize.py).
    """

    # Read by foundations/flat.py's GradientSyncs (for pipeline.py and the loop): True, every
    # rank holds whole gradients anyway, so all micro-batches but the last run under no_sync(),
    # one reduction a step. False (ZeRO-2, FSDP): each micro-batch's backward reduces.
    keeps_whole_gradients = True

    def __init__(self, module: nn.Module, group=None, bucket_mb: float = 25,
                 reduce_dtype: torch.dtype | None = None, reductions: list | None = None):
        super().__init__()
        self.module, self.reduce_dtype = module, reduce_dtype
        self.comm = Comm.from_group(group)
        self.reductions = reductions or [((self.comm, "avg", 1), list(module.parameters()))]
        # Trainable parameters only: a frozen one gets no gradient, so it needs no hook and no slot.
        # named_parameters() lists a tied (shared) weight once; autograd sums all its uses into
        # one .grad, then its post-accumulate hook fires once.
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("DDP: the module has no trainable parameters (requires_grad=True), "
                             "so there are no gradients to average; train at least one parameter")
        check_same_parameters(list(module.parameters()), self.comm)
        self._broadcast_from_rank0()
        self.buckets = self._make_buckets([p for _, p in reversed(trainable)], bucket_mb)
        self.params = [p for bucket in self.buckets for p in bucket.params]  # (P,) bucket order
        if len(self.params) != len(trainable):
            raise ValueError(f"DDP: reductions= places {len(self.params)} trainable parameters, "
                             f"the module has {len(trainable)}: put each in exactly one part")
        names = {id(p): name for name, p in trainable}
        self.names = [names[id(p)] for p in self.params]
        # bucket b holds params[i] for i in bucket_indices[b]; slot i is params[i]'s .grad
        sizes = [len(bucket.params) for bucket in self.buckets]
        self.bucket_indices = [range(sum(sizes[:b]), sum(sizes[:b + 1])) for b in range(len(sizes))]
        self._slot = [slot for bucket in self.buckets for slot in bucket.views(bucket.grad_flat)]
        # FlatParams.hook_gradients registers p.register_post_accumulate_grad_hook on each of
        # bucket b's parameters: it calls mark_param_as_ready(b, j) once autograd has added
        # into .grad. The hook holds self weakly (see FlatParams).
        for b, bucket in enumerate(self.buckets):
            bucket.hook_gradients(self.mark_param_as_ready, b)
        # The reducer's state, all of it (i: a parameter, b: a bucket):
        #   require_backward_grad_sync  False inside no_sync(): gradients stay in .grad
        #   _hooked[i]   its hook has fired once: .grad is its slot (forward gives it back)
        #   _used[i]     it got a gradient since the last sync, no_sync()'s included
        #   _ready[i]    its gradient is counted into its bucket, this sync
        #   pending[b]   gradients bucket b still waits for; 0: full
        #   launched     buckets launched so far, in bucket order, this sync
        #   _in_flight   [(bucket, what it sends, its work)], waited for at the finish
        # _reset() renews all but require_backward_grad_sync and _hooked after each sync.
        self.require_backward_grad_sync = True
        self._hooked = [False] * len(self.params)
        self._reset()

    def _make_buckets(self, arrival: list, bucket_mb: float) -> list[FlatParams]:
        """Each part's parameters, in gradient-arrival order, cut into buckets of bucket_mb MiB.

        A bucket lays its parameters end to end in one flat buffer, their gradients beside it.
        Each param.grad is a view of its slot in the gradient buffer: the buckets are the
        gradients (PyTorch's gradient_as_bucket_view=True)."""
        buckets = []
        for (comm, op, divide), part in self.reductions:
            ids = {id(p) for p in part}
            for params in split_into_buckets([p for p in arrival if id(p) in ids], bucket_mb):
                buckets.append(FlatParams(params, world_size=1, comm=comm, op=op, divide=divide,
                                          with_grad=True))             # grad_flat: (L_b,)
        return buckets

    def forward(self, *args, **kwargs):
        # zero_grad(set_to_none=True) dropped each .grad: give back its bucket slot, so the
        # coming backward accumulates into the bucket.
        if torch.is_grad_enabled():
            self._gradients_into_buckets()
        return self.module(*args, **kwargs)

    # ---- 3. during backward: a gradient is ready; a full bucket's all-reduce starts -----------

    def mark_param_as_ready(self, b: int, j: int):
        """Backward has accumulated bucket b's parameter j into its .grad (the gradient hook)."""
        i = self.bucket_indices[b][j]
        self._used[i] = self._hooked[i] = True
        if not self.require_backward_grad_sync:
            return                                               # no_sync(): stay in .grad
        self._check_first_gradient(i)
        self._grad_into_slot(i)
        self._ready[i] = True
        self.pending[b] -= 1
        if self.pending[b] == 0:
            # launches b, and any full buckets after it, once every earlier bucket has launched
            self._launch_full_buckets()

    def _all_reduce(self, bucket: FlatParams):
        """Start the bucket's all-reduce and return without waiting for it."""
        wire = self._upcast(bucket.grad_flat)                                   # (L_b,)
        work = bucket.comm.all_reduce(wire, op=bucket.op, async_op=True)
        self._in_flight.append((bucket, wire, work))

    # ---- 4. after backward: wait for every bucket --------------------------------------------

    def finish_gradient_sync(self):
        """Wait for every bucket's all-reduce and leave the averaged gradients in .grad.

        Call it after the step's last backward, before optimizer.step()."""
        self._launch_unused()                        # buckets whose gradients never came
        wait_used_flags = self._launch_used_flags()  # did any rank use each parameter?
        for bucket, wire, work in self._in_flight:
            work.wait()
            if bucket.divide != 1:
                wire.div_(bucket.divide)
            if wire is not bucket.grad_flat:
                bucket.grad_flat.copy_(wire)                     # the upcast mean, rounded once
        for p, slot, used in zip(self.params, self._slot, wait_used_flags()):
            p.grad = slot if used else None          # averaged in place; no rank used: None
        self._reset()

    # ---- 5. gradient accumulation -----------------------------------------------------------

    @contextmanager
    def no_sync(self):
        """Backwards inside accumulate into .grad locally; the next one outside syncs the sum."""
        outer, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = outer

    # ---- the corner cases --------------------------------------------------------------------

    def _launch_full_buckets(self):
        """Launch order: collectives pair by call order, so a full bucket waits for earlier ones.

        A rank whose backward fills bucket 2 before bucket 1 (control flow that depends on the
        data) would otherwise add its bucket 2 to another rank's bucket 1."""
        while self.launched < len(self.buckets) and self.pending[self.launched] == 0:
            self._all_reduce(self.buckets[self.launched])
            self.launched += 1

    def _upcast(self, grad_flat: torch.Tensor) -> torch.Tensor:
        """Upcast buckets: with reduce_dtype=torch.float32, a bf16 bucket is summed in an fp32 copy.

        In bf16, each ring step would round a partial sum to 8 significant bits (7 stored).
        The mean is rounded back into the bucket once (torch's DDP needs a communication hook
        for this)."""
        if self.reduce_dtype in (None, grad_flat.dtype):
            return grad_flat
        return grad_flat.to(self.reduce_dtype)

    def _check_first_gradient(self, i: int):
        """A second synchronised gradient would be summed into a bucket already on the wire."""
        if self._ready[i]:
            raise RuntimeError(
                f"DDP: parameter {self.names[i]!r} received a second gradient before its first "
                f"was synchronised: call ddp.finish_gradient_sync() after each synchronised "
                f"backward (before optimizer.step()); for gradient accumulation run all but the "
                f"last micro-batch's backward inside `with ddp.no_sync():`.")

    def _grad_into_slot(self, i: int):
        """Autograd made a .grad of its own (the first backward, say): it moves into its slot."""
        p, slot = self.params[i], self._slot[i]
        if p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
            p.grad = slot

    def _launch_unused(self):
        """Unused parameters: every rank must launch every bucket, or the collectives mismatch.

        A parameter whose hook did not fire in this backward may hold a gradient accumulated
        under no_sync(): it goes into its slot. One with no gradient at all contributes zeros."""
        for b, indices in enumerate(self.bucket_indices):
            for i in indices:
                if not self._ready[i]:
                    p, slot = self.params[i], self._slot[i]
                    if p.grad is None:
                        slot.zero_()
                    elif p.grad.data_ptr() != slot.data_ptr():
                        slot.copy_(p.grad)
                    self._ready[i] = True
                    self.pending[b] -= 1
        self._launch_full_buckets()                              # every bucket is full now

    def _launch_used_flags(self):
        """Unused parameters: one that no rank used keeps grad None, as one process leaves it.

        (AdamW would otherwise decay it.) Each rank's "used" flags are OR'ed over the ranks: a
        P-byte all-reduce launched behind every bucket's, the same place on every rank. Used
        here: its hook fired (no_sync's too), or a gradient came as a .grad of its own.
        Returns the function wait_used_flags: called, it waits for the flags and lists
        them (P,)."""
        local = [used or (p.grad is not None and p.grad.data_ptr() != slot.data_ptr())
                 for used, p, slot in zip(self._used, self.params, self._slot)]
        flags, device = torch.tensor(local, dtype=torch.uint8), self.params[0].device   # (P,)
        if device.type == "cuda":
            flags = flags.pin_memory()      # a copy queued on the stream: no host sync here
        flags = flags.to(device, non_blocking=True)
        # OR'ed over each part's comm: one all-reduce per run of buckets on one comm, in order.
        works, start = [], 0
        for comm, run in itertools.groupby(self.buckets, key=lambda bucket: bucket.comm):
            stop = start + sum(len(bucket.params) for bucket in run)
            works.append(comm.all_reduce(flags[start: stop], op="max", async_op=True))
            start = stop

        def wait_used_flags() -> list:
            for work in works:
                work.wait()
            return local if all(local) else flags.tolist()  # read (a GPU host sync) if needed
        return wait_used_flags

    def _gradients_into_buckets(self):
        """Each .grad set to None (zero_grad(set_to_none=True)) gets its zeroed slot back.

        Autograd then adds the coming gradient into the bucket in place. Only a parameter whose
        hook has fired before gets it: until then .grad stays None, as without DDP. A gradient
        written outside autograd (a zero-bubble pipeline's W, say) fires no hook; only its
        arrival as a .grad of its own says it was used."""
        for bucket, indices in zip(self.buckets, self.bucket_indices):
            back = [i for i in indices if self._hooked[i] and self.params[i].grad is None]
            if len(back) == len(bucket.params):
                bucket.grad_flat.zero_()                         # one kernel for the bucket
            else:
                for i in back:
                    self._slot[i].zero_()
            for i in back:
                self.params[i].grad = self._slot[i]

    def _reset(self):
        """After each sync: the per-sync state (listed in __init__) starts over."""
        self._ready = [False] * len(self.params)
        self._used = [False] * len(self.params)
        self.pending = [len(bucket.params) for bucket in self.buckets]
        self.launched = 0
        self._in_flight = []

    def _broadcast_from_rank0(self):
        """Ranks may have been seeded differently: rank 0's initial weights become everyone's.

        Each part's parameters come from rank 0 of its group, the buffers from the whole
        group's. One broadcast per (dtype, device) of a flat copy, not one per tensor. They go in
        first-seen order (dict keys): the same order on every rank."""
        parts = [(comm, params) for (comm, _, _), params in self.reductions]
        for comm, tensors in [*parts, (self.comm, list(self.module.buffers()))]:
            for kind in dict.fromkeys((t.dtype, t.device) for t in tensors):
                same = [t for t in tensors if (t.dtype, t.device) == kind]
                flat = torch.cat([t.detach().reshape(-1) for t in same])      # (sum of numel,)
                comm.broadcast(flat, src=0)
                with torch.no_grad():
                    for t, value in zip(same, flat.split([t.numel() for t in same])):
                        t.copy_(value.view_as(t))

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The buckets' flat buffers: the gradients themselves (each param.grad a view of one)."""
        return [bucket.grad_flat for bucket in self.buckets]


# ---- run alone: torchrun --nproc_per_node 2 ddp.py ---------------------------------------------

STEPS, ACCUM, ROWS, LR = 6, 2, 8, 0.1     # 8 rows a rank; the last 3 steps: 2 micro-batches of 4
BOUND = 1e-12                             # fp64: the same sums in another order, ~1e-16 each


def _tiny_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 1)).double()


def _data_parallel(x, y, show) -> nn.Module:
    """DDP over the world, each rank its rows of each step's batch (seeded differently: the
    broadcast makes rank 0's weights everyone's), the last steps accumulating under no_sync()."""
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(_tiny_model(seed=rank), bucket_mb=8 / 1024)                 # 8 KiB buckets
    show("buckets, in gradient-arrival order: "
         + " ".join("[" + " ".join(ddp.names[i] for i in indices) + "]"
                    for indices in ddp.bucket_indices))
    timeline = []          # by a hook after DDP's: each gradient as it arrives, what it launched

    def arrived(name):
        done = sum(word.startswith("->") for word in timeline)
        timeline.extend([name] + [f"-> all-reduce {b} |" for b in range(done, ddp.launched)])
    for name, p in zip(ddp.names, ddp.params):
        p.register_post_accumulate_grad_hook(lambda _, name=name: arrived(name))
    sgd = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step, (xs, ys) in enumerate(zip(x, y)):
        micro = 1 if step < STEPS // 2 else ACCUM
        sgd.zero_grad()
        for m, (xm, ym) in enumerate(zip(xs.chunk(n)[rank].chunk(micro),
                                         ys.chunk(n)[rank].chunk(micro))):
            timeline.clear()
            with ddp.no_sync() if m < micro - 1 else nullcontext():
                (F.mse_loss(ddp(xm), ym) / micro).backward()
            if step in (0, STEPS // 2):
                show(f"step {step}, backward {m + 1} of {micro}"
                     f"{' (no_sync)' if m < micro - 1 else ''}: {' '.join(timeline)}")
        ddp.finish_gradient_sync()
        sgd.step()
    return ddp.module


def main():
    """Train the tiny model both ways on the same batches; every rank checks its parameters."""
    dist.init_process_group("gloo")
    show = print if dist.get_rank() == 0 else lambda line: None
    g = torch.Generator().manual_seed(0)
    rows = ROWS * dist.get_world_size()     # equal rows a rank: their means average to the whole's
    x = torch.randn(STEPS, rows, 8, generator=g, dtype=torch.float64)      # (STEPS, N*ROWS, 8)
    y = x.sum(-1, keepdim=True).sin()                                        # (STEPS, N*ROWS, 1)
    ddp = _data_parallel(x, y, show)
    one = _tiny_model(seed=0)      # one process: rank 0's initial weights, the whole batch a step
    sgd = torch.optim.SGD(one.parameters(), lr=LR)
    for xs, ys in zip(x, y):
        sgd.zero_grad()
        F.mse_loss(one(xs), ys).backward()
        sgd.step()
    difference = max((p - q).abs().max().item() for p, q in zip(ddp.parameters(), one.parameters()))
    dist.destroy_process_group()
    show(f"max |difference| from one process after {STEPS} SGD steps, the last "
         f"{STEPS - STEPS // 2} accumulating under no_sync: {difference:.1e} "
         f"(bound {BOUND:g}: fp64 sums reordered)")
    sys.stdout.flush()
    os._exit(int(difference > BOUND))  # at once: gloo's threads may still hold tensors


if __name__ == "__main__":
    start_alone(torchrun=True)
    main()
