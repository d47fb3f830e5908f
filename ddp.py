"""Distributed data parallel: every rank holds the whole model and averages its gradients.

Each rank runs forward and backward on its own slice of the global batch, then an all-reduce
averages the gradients so that every rank takes the same optimizer step (Li et al. 2020,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB, section 3.2),
here in the lecture's order: 1. the naive per-parameter all-reduce, 2. gradient buckets,
3. each bucket's all-reduce overlapped with backward, 4. the finish, 5. no_sync.
Left out: the autograd-graph walk that finds unused parameters early, rebuilding buckets in
the observed order, communication hooks, re-broadcasting buffers at every forward.
Run alone: torchrun --nproc_per_node 2 ddp.py (in training: train.py --strategy ddp); test:
python -m pytest tests/test_ddp.py

Shapes: N ranks in the group, P trainable parameters, L_b elements in bucket b's flat buffer.
"""
import os
import sys
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from foundations.comm import as_comm
from foundations.alone import start_alone
from foundations.flat import FlatParams, or_used_flags, split_into_buckets
from foundations.process_groups import check_same_parameters


# ---- 1. naive: one blocking all-reduce per parameter, after backward ---------------------------

def all_reduce_gradients(module: nn.Module, group=None):
    """Average every parameter's gradient over the group, one blocking all-reduce each.

    Correct, and the baseline the bucketed version must equal, but slow twice over: the network
    idles during backward and backward's caller during the network, and a model of hundreds of
    small tensors pays a message's latency hundreds of times. It assumes every rank produced a
    gradient for the same parameters (collectives match by order)."""
    comm = as_comm(group)
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
# Few large messages reach the link's bandwidth; too large a bucket starts too late to overlap:
# flat.split_into_buckets cuts them, the same cut ZeRO's buckets use.


class DDP(nn.Module):
    """Wrap `module` for data parallel training over `group` (a Comm, a ProcessGroup or None).

    Per step: forward and backward as usual (gradient hooks launch the buckets' all-reduces as
    backward runs), then call finish_gradient_sync() yourself, before optimizer.step() (torch's DDP
    finishes in a callback at the end of backward; here the wait is a line of the loop). For
    gradient accumulation, run all but the last micro-batch's backward inside `with ddp.no_sync():`.
    reduce_dtype: the dtype each bucket is averaged in (None: the gradients' own, as torch's DDP;
    torch.float32 for bf16/fp16 gradients: upcast before the all-reduce, the mean rounded back
    into the bucket once, where torch's DDP would need a communication hook: in bf16 each ring
    step would round a partial sum to 8 bits of mantissa).
    reductions: the parameters in parts, [((comm, op, divisor), parameters)], in an order every
    rank shares, comm a Comm (the caller wraps a process group, as_comm, once: parts on one group
    share one Comm): a part starts from its comm's rank 0, its gradients reduced by `op` over it,
    then divided by `divisor`. Default: one part, all averaged over `group`; where not every rank
    holds every parameter, the composition hands in the parts (parallelize.py).
    """

    keeps_whole_gradients = True        # GradientSyncs: every rank holds them all, always

    def __init__(self, module: nn.Module, group=None, bucket_mb: float = 25,
                 reduce_dtype: torch.dtype | None = None, reductions: list | None = None):
        super().__init__()
        self.module, self.reduce_dtype = module, reduce_dtype
        self.comm = as_comm(group)
        self.reductions = reductions or [((self.comm, "avg", 1), list(module.parameters()))]
        # Trainable parameters only: a frozen one gets no gradient, so it needs no hook, no slot
        # and no bytes. named_parameters() lists a tied (shared) weight once, and autograd
        # accumulates all its uses into one .grad before the post-accumulate hook fires once.
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("DDP: the module has no trainable parameters (requires_grad=True), "
                             "so there are no gradients to average; train at least one parameter")
        check_same_parameters(list(module.parameters()), self.comm)
        self._broadcast_from_rank0()
        # The buckets: each part's parameters in gradient-arrival order, cut into buckets.
        arrival = [p for _, p in reversed(trainable)]                               # (P,)
        self.buckets = []
        for how, part in self.reductions:
            ids = {id(p) for p in part}
            for params in split_into_buckets([p for p in arrival if id(p) in ids], bucket_mb):
                self.buckets.append(self._bucket(params, how))
        self.params, self._bucket_of = [], []                    # (P,) in bucket order
        for b, bucket in enumerate(self.buckets):
            bucket.indices = range(len(self.params), len(self.params) + len(bucket.params))
            self.params += bucket.params
            self._bucket_of += [b] * len(bucket.params)
        if len(self.params) != len(trainable):
            raise ValueError(f"DDP: reductions= places {len(self.params)} trainable parameters, "
                             f"the module has {len(trainable)}: put each in exactly one part")
        names = {id(p): name for name, p in trainable}
        self.names = [names[id(p)] for p in self.params]
        self._slot = [slot for bucket in self.buckets for slot in bucket.views(bucket.grad_flat)]
        self._hook_gradients()
        self._syncing = True                                     # False inside no_sync()
        self._hooked = [False] * len(self.params)                # hook has fired: .grad is its slot
        self._reset()

    @staticmethod
    def _bucket(params: list, how: tuple) -> FlatParams:
        """A bucket: the parameters laid end to end in one flat buffer (a FlatParams of one
        shard: this rank owns all of it), their gradients beside it in the same layout, and the
        comm, op and divisor that reduce them. Each param.grad is a view of its slot in the
        gradient buffer (PyTorch's gradient_as_bucket_view=True): the buckets are the gradients.
        DDP's attributes on it: comm, op, divide, grad_flat (here), indices (its parameters' places
        in self.params), pending (gradients still to come, _reset), used (finish_gradient_sync)."""
        bucket = FlatParams(params, world_size=1)
        bucket.comm, bucket.op, bucket.divide = how
        bucket.grad_flat = torch.zeros_like(bucket.flat)                          # (L_b,)
        return bucket

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._gradients_into_buckets()
        return self.module(*args, **kwargs)

    # ---- 3. during backward: the hook, then each full bucket's all-reduce, in order ---------

    def _hook_gradients(self):
        """Call _gradient_arrived(b, j) each time backward has accumulated the gradient of bucket
        b's parameter j into its .grad: a post-accumulate-grad hook on each parameter (FlatParams'
        hook_gradients; it holds DDP weakly: DDP -> module -> parameter -> hook -> DDP is never freed)."""
        for b, bucket in enumerate(self.buckets):
            bucket.hook_gradients(self._gradient_arrived, b)

    def _gradient_arrived(self, b: int, j: int):
        """The .grad of bucket b's parameter j, params[i], holds this backward's gradient: count it in."""
        i = self.buckets[b].indices[j]
        self._used[i] = self._hooked[i] = True
        if not self._syncing:
            return                                               # accumulate locally in .grad
        if self._ready[i]:
            raise RuntimeError(
                f"DDP: parameter {self.names[i]!r} received a second gradient before its first was "
                f"synchronised: call ddp.finish_gradient_sync() after each synchronised backward "
                f"(before optimizer.step()); for gradient accumulation run all but the last "
                f"micro-batch's backward inside `with ddp.no_sync():`.")
        p = self.params[i]
        if p.grad.data_ptr() != self._slot[i].data_ptr():    # autograd made a .grad of its own
            self._slot[i].copy_(p.grad)
            p.grad = self._slot[i]
        self._mark_ready(i)

    def _mark_ready(self, i: int):
        self._ready[i] = True
        bucket = self.buckets[self._bucket_of[i]]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_full_buckets()

    def _launch_full_buckets(self):
        """Start the all-reduce of every full bucket, in bucket order, without waiting for it.

        Collectives pair up by call order, not by name: a rank whose backward fills bucket 2
        before bucket 1 (control flow that depends on the data) must still launch bucket 1
        first, or it adds its bucket 2 to another rank's bucket 1. So a full bucket waits for
        every earlier one, then all the consecutive full ones go."""
        while self.launched < len(self.buckets) and self.buckets[self.launched].pending == 0:
            bucket = self.buckets[self.launched]
            wire = bucket.grad_flat                                             # (L_b,)
            if self.reduce_dtype not in (None, wire.dtype):
                wire = wire.to(self.reduce_dtype)    # an upcast copy: the sum in fp32, see above
            handle = bucket.comm.all_reduce(wire, op=bucket.op, async_op=True)
            self._in_flight.append((bucket, wire, handle))
            self.launched += 1

    # ---- 4. after backward ------------------------------------------------------------------

    def finish_gradient_sync(self):
        """Launch what backward did not, wait for every bucket, leave the averaged gradients in
        .grad. Call after the (last) backward of a step and before optimizer.step()."""
        # A parameter whose hook did not fire in this backward was not used by it, but may hold
        # a gradient accumulated under no_sync(); one with no gradient at all contributes zeros.
        for i, p in enumerate(self.params):
            if not self._ready[i]:
                if p.grad is None:
                    self._slot[i].zero_()
                elif p.grad.data_ptr() != self._slot[i].data_ptr():
                    self._slot[i].copy_(p.grad)
                self._mark_ready(i)                  # after this loop every bucket is launched
        # A parameter that no rank used must keep grad None, as one process would leave it (AdamW
        # would otherwise decay it): OR the "used" flags over each bucket's group, a P-byte message
        # launched behind every bucket (the same place on every rank), so it overlaps them. Used
        # here: its hook fired (no_sync's too), or a gradient came as a .grad of its own.
        local = [used or (p.grad is not None and p.grad.data_ptr() != slot.data_ptr())
                 for used, p, slot in zip(self._used, self.params, self._slot)]
        for bucket in self.buckets:
            bucket.used = [local[i] for i in bucket.indices]
        # (P,) flags OR'ed over the ranks, the all-reduce launched; agree() waits for it
        used, agree = or_used_flags(self.buckets, self.params[0].device)
        for bucket, wire, handle in self._in_flight:
            handle.wait()
            if bucket.divide != 1:
                wire.div_(bucket.divide)
            if wire is not bucket.grad_flat:
                bucket.grad_flat.copy_(wire)                 # the mean, rounded once
        agree()                                              # the flags' all-reduce, done
        # Read (a host sync on a GPU) only if this rank missed one: else every one was used.
        everywhere = local if all(local) else used.tolist()
        for p, slot, used_anywhere in zip(self.params, self._slot, everywhere):
            p.grad = slot if used_anywhere else None             # averaged in place
        self._reset()

    def _reset(self):
        self._ready = [False] * len(self.params)          # counted into its bucket, this sync
        self._used = [False] * len(self.params)           # got a gradient since the last sync
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)           # gradients still to come
        self.launched = 0                                 # buckets launched in this backward
        self._in_flight = []                              # [(bucket, what it sends, its handle)]

    # ---- 5. gradient accumulation -----------------------------------------------------------

    @contextmanager
    def no_sync(self):
        """Backwards inside accumulate into .grad locally; the next one outside syncs the sum."""
        outer, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = outer

    # ---- mechanics: the start, the gradient slots ----------------------------------------

    def _broadcast_from_rank0(self):
        """Ranks may have been seeded differently: rank 0's initial weights (and buffers) become
        everyone's, each part's from rank 0 of its group. One broadcast per dtype of a flat copy,
        not one per tensor, in first-seen order (dict keys): the same order on every rank."""
        parts = [(group, params) for (group, _, _), params in self.reductions]
        for group, tensors in [*parts, (self.comm, list(self.module.buffers()))]:
            for kind in dict.fromkeys((t.dtype, t.device) for t in tensors):
                same = [t for t in tensors if (t.dtype, t.device) == kind]
                flat = torch.cat([t.detach().reshape(-1) for t in same])      # (sum of numel,)
                group.broadcast(flat, src=0)
                with torch.no_grad():
                    for t, value in zip(same, flat.split([t.numel() for t in same])):
                        t.copy_(value.view_as(t))

    def _gradients_into_buckets(self):
        """Each parameter whose .grad was set to None (zero_grad(set_to_none=True)) gets its zeroed
        slot back as .grad, so autograd adds the coming gradient into the bucket in place. Only
        those whose hook has fired before, so a parameter's first backward is not zero-copy (its
        own .grad is copied into the slot, _gradient_arrived): until then .grad stays None, as
        without DDP, and a gradient written outside autograd (a zero-bubble pipeline's W, say)
        fires no hook: only its arrival as a .grad of its own says it was used."""
        for bucket in self.buckets:
            back = [i for i in bucket.indices if self._hooked[i] and self.params[i].grad is None]
            if len(back) == len(bucket.params):
                bucket.grad_flat.zero_()                         # one kernel for the bucket
            else:
                for i in back:
                    self._slot[i].zero_()
            for i in back:
                self.params[i].grad = self._slot[i]

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
         + " ".join("[" + " ".join(ddp.names[i] for i in b.indices) + "]" for b in ddp.buckets))
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
    os._exit(int(difference > BOUND))  # at once: gloo's threads may still hold tensors (exit_distributed)


if __name__ == "__main__":
    start_alone(torchrun=True)
    main()
