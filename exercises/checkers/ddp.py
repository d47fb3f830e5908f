"""Checks exercises/ddp.py on 3 ranks: when backward's gradients launch their buckets, each
bucket's all-reduce, the finish, no_sync, then whole training steps. The reference is one
process, written here: the mean over the ranks of every rank's gradients (each rank builds every
rank's from seeds), and a model trained on the whole batch.

Bounds: fp64 wherever the claim is exact, so that the ranks' sums, done in another order, differ
by rounding alone (under 1e-12 here); a bucket's buffer at launch is a copy (exact). The finish's
fp32 case (reduce_dtype fp64) rounds the fp64 mean to fp32 once: within 2^-23 relative, one fp32
ulp (gloo's fp64 sum, in another order, can put the mean across a rounding boundary).

Steps 1 to 4 run on a network of the checker's own (SlowNetwork): an asynchronous all-reduce
moves nothing until its work is waited for, as when the network lags backward. So a wait left
out leaves the gradients local every time, and one put inside _all_reduce shows before any wait.
Its all-reduces first compare the ranks' (numel, dtype, op): ranks launching different buckets
then fail on every rank with that message, not in gloo (which aborts the process).
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from foundations.comm import Comm
from foundations.launch import Handle

WORLD = 3
PARTS = ["DDP.mark_param_as_ready", "DDP._all_reduce", "DDP.finish_gradient_sync", "DDP.no_sync"]
BOUND, WHY = 1e-12, "fp64 sums of 3 ranks' terms in another order"
FP32, WHY32 = 2.0**-23, "one fp32 ulp: the fp64 mean rounded to fp32 once"
# 600 bytes: the tiny model's fp64 tensors, in gradient-arrival order, make 3 buckets:
# [4.bias 4.weight 2.bias] [2.weight 0.bias] [0.weight]
BUCKET_MB = 600 / 2**20
ROWS, STEPS, LR = 4, 4, 0.1           # rows a rank per step; the odd steps in 2 micro-batches


class SlowNetwork(Comm):
    """Native collectives, except all-reduces: one started asynchronously moves only at its
    wait(), and each first checks that the ranks' calls pair up (sizes, dtypes, ops)."""

    def all_reduce(self, tensor, op="sum", async_op=False):
        if async_op:
            return Handle(lambda: self.all_reduce(tensor, op))
        every = [None] * self.world_size
        mine = (tensor.numel(), str(tensor.dtype).removeprefix("torch."), op)
        dist.all_gather_object(every, mine, group=self.group)
        for rank, theirs in enumerate(every):
            if theirs != every[0]:
                raise RuntimeError(f"the ranks' all-reduces do not pair up: rank 0 sends "
                                   f"{every[0]}, rank {rank} {theirs} (numel, dtype, op): every "
                                   f"rank launches every bucket, in one order")
        return super().all_reduce(tensor, op)


def tiny_model(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 1)).to(dtype)


def gradients(rank: int, seed: int, like: list) -> list:
    """Rank rank's gradients (one per tensor of like): every rank can build any rank's."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.dtype)
            for t in like]


def batch(step: int):
    """The whole batch of a step: x (N*ROWS, 4), y (N*ROWS, 1); rank r's rows are chunk r."""
    generator = torch.Generator().manual_seed(7 + step)
    x = torch.randn(WORLD * ROWS, 4, generator=generator, dtype=torch.float64)
    return x, x.sum(-1, keepdim=True).sin()


def spy_launches(ddp, forward: bool) -> list:
    """Record each bucket ddp launches, (b, its buffer then); forward: launch it too."""
    launches, launch = [], ddp._all_reduce
    index = {id(bucket): b for b, bucket in enumerate(ddp.buckets)}

    def _all_reduce(bucket):
        launches.append((index[id(bucket)], bucket.grad_flat.clone()))
        if forward:
            launch(bucket)
    ddp._all_reduce = _all_reduce
    return launches


def hand_in(ddp, grads: list, used: list):
    """What backward's hooks do, by hand: parameter i's gradient grads[i] arrives as a .grad of
    its own, bucket by bucket, where used[i]; an unused one's .grad is None."""
    for b in range(len(ddp.buckets)):
        for j, i in enumerate(ddp.bucket_indices[b]):
            ddp.params[i].grad = grads[i].clone() if used[i] else None
            if used[i]:
                ddp.mark_param_as_ready(b, j)


def check(exercise, grader):
    n, r = grader.world, grader.rank

    with grader.step("bucket launches", "the lecture's overlap: a gradient goes into its bucket "
                     "slot and is counted off; when may a full bucket launch, if another rank's "
                     "backward fills the buckets in another order?"):
        ddp = exercise.DDP(tiny_model(), SlowNetwork(grader.group), bucket_mb=BUCKET_MB)
        launches = spy_launches(ddp, forward=False)
        grads, arrived = gradients(r, 1, ddp.params), set()
        for b in (0, 2, 1):                  # bucket 2 fills before bucket 1
            for j, i in enumerate(ddp.bucket_indices[b]):
                ddp.params[i].grad = grads[i].clone()
                ddp.mark_param_as_ready(b, j)
                arrived.add(i)
                full = [set(indices) <= arrived for indices in ddp.bucket_indices] + [False]
                grader.same(f"buckets launched once {ddp.names[i]}'s gradient came",
                            [b for b, _ in launches], list(range(full.index(False))))
        for b, flat in launches:
            expected = torch.cat([grads[i].flatten() for i in ddp.bucket_indices[b]])
            grader.close(f"bucket {b}'s buffer when it launched", flat, expected, 0.0,
                         "the gradients copied into their slots: exact")

    with grader.step("bucket all-reduce", "the lecture's all-reduce of a bucket: the wire "
                     "_upcast gives, reduced with the bucket's own comm and op, started but not "
                     "waited for, and remembered in self._in_flight for the finish"):
        for dtype, reduce_dtype, op in ((torch.float64, None, "avg"),
                                        (torch.float32, torch.float64, "sum")):
            comm = SlowNetwork(grader.group)
            model = tiny_model(dtype)
            reductions = [((comm, op, 1), list(model.parameters()))]
            ddp = exercise.DDP(model, comm, BUCKET_MB, reduce_dtype, reductions)
            every = [gradients(rank, 2, [b.grad_flat for b in ddp.buckets]) for rank in range(n)]
            for bucket, mine in zip(ddp.buckets, every[r]):
                bucket.grad_flat.copy_(mine)
                ddp._all_reduce(bucket)
            in_flight = [ddp.buckets.index(entry[0]) for entry in ddp._in_flight]
            grader.same("buckets in _in_flight", in_flight, list(range(len(ddp.buckets))))
            for b, (bucket, wire, work) in enumerate(ddp._in_flight):
                grader.same(f"bucket {b}'s wire dtype", wire.dtype, reduce_dtype or dtype)
                grader.close(f"bucket {b}'s wire before any wait (async on bucket.comm: unmoved)",
                             wire, every[r][b], 0.0, "nothing moves before the wait: exact")
                work.wait()
                total = sum(grads[b].double() for grads in every)
                grader.close(f"bucket {b}'s wire all-reduced ({op}, {wire.dtype})", wire,
                             total / n if op == "avg" else total, BOUND, WHY)

    with grader.step("finish", "the lecture's finish: which buckets has backward not launched "
                     "yet? Once a bucket's work is waited for, is the mean in grad_flat (its "
                     "op and divide, a wire that may be a copy)? Which .grad stays None?"):
        ddp = exercise.DDP(tiny_model(), SlowNetwork(grader.group), bucket_mb=BUCKET_MB)
        only = {"0.bias": [], "4.weight": [0]}         # no rank uses 0.bias, rank 0 4.weight
        users = [only.get(name, range(n)) for name in ddp.names]
        for sync in (1, 2):                            # twice: the state starts over
            every = [gradients(rank, 2 + sync, ddp.params) for rank in range(n)]
            hand_in(ddp, every[r], [r in ranks for ranks in users])
            ddp.finish_gradient_sync()
            for i, (name, p) in enumerate(zip(ddp.names, ddp.params)):
                if not users[i]:
                    grader.same(f"{name}.grad (no rank used it)",
                                None if p.grad is None else "a tensor", None)
                    continue
                mean = sum(every[rank][i] for rank in users[i]) / n
                grader.close(f"{name}.grad (sync {sync})", p.grad, mean, BOUND, WHY)
        comm = SlowNetwork(grader.group)                # fp32, summed in fp64, divided by N
        model = tiny_model(torch.float32)
        ddp = exercise.DDP(model, comm, BUCKET_MB, torch.float64,
                           [((comm, "sum", n), list(model.parameters()))])
        every = [gradients(rank, 5, ddp.params) for rank in range(n)]
        hand_in(ddp, every[r], [True] * len(ddp.params))
        ddp.finish_gradient_sync()
        for i, (name, p) in enumerate(zip(ddp.names, ddp.params)):
            mean = (sum(grads[i].double() for grads in every) / n).float()
            grader.close(f"{name}.grad (fp32, reduced in fp64, summed then divided by {n})",
                         p.grad, mean, 0.0, WHY32, rtol=FP32)

    with grader.step("no_sync", "the lecture's gradient accumulation: inside no_sync a backward "
                     "leaves its gradient in .grad and launches nothing; after it the flag has "
                     "the value it had before (inside an outer no_sync: still off), also when "
                     "the body raised"):
        ddp = exercise.DDP(tiny_model(), SlowNetwork(grader.group), bucket_mb=BUCKET_MB)
        launches = spy_launches(ddp, forward=True)
        one = tiny_model()
        x, y = batch(0)
        xs, ys = x.chunk(n)[r].chunk(2), y.chunk(n)[r].chunk(2)
        names, params = zip(*one.named_parameters())
        first = dict(zip(names, torch.autograd.grad(F.mse_loss(one(xs[0]), ys[0]) / 2, params)))
        whole = dict(zip(names, torch.autograd.grad(F.mse_loss(one(x), y), params)))
        with ddp.no_sync():
            with ddp.no_sync():
                pass
            grader.same("require_backward_grad_sync after a nested no_sync, inside the outer",
                        ddp.require_backward_grad_sync, False)
            (F.mse_loss(ddp(xs[0]), ys[0]) / 2).backward()
        grader.same("require_backward_grad_sync after the outer no_sync",
                    ddp.require_backward_grad_sync, True)
        raised = False
        try:
            with ddp.no_sync():
                raise KeyError("the body of the with")
        except KeyError:
            raised = True
        grader.same("the body's exception, out of no_sync", raised, True)
        grader.same("require_backward_grad_sync after a no_sync whose body raised",
                    ddp.require_backward_grad_sync, True)
        grader.same("buckets launched by a backward inside no_sync", [b for b, _ in launches],
                    [])
        for name, p in zip(ddp.names, ddp.params):
            grader.close(f"{name}.grad after no_sync's backward (this rank's own)", p.grad,
                         first[name], BOUND, "fp64: the same sums in another order")
        (F.mse_loss(ddp(xs[1]), ys[1]) / 2).backward()
        grader.same("buckets launched by the last micro-batch's backward",
                    [b for b, _ in launches], list(range(len(ddp.buckets))))
        ddp.finish_gradient_sync()
        for name, p in zip(ddp.names, ddp.params):
            grader.close(f"{name}.grad (the whole batch's, accumulated)", p.grad, whole[name],
                         BOUND, WHY)

    with grader.step("training steps", "the steps together: each rank's mean gradient over "
                     "equal slices, averaged, is the whole batch's, so every SGD step equals one "
                     "process's"):
        ddp = exercise.DDP(tiny_model(), grader.group, bucket_mb=BUCKET_MB)
        one = tiny_model()
        sgd, reference = (torch.optim.SGD(m.parameters(), lr=LR) for m in (ddp, one))
        for step in range(STEPS):
            x, y = batch(1 + step)
            micro = 1 + step % 2
            sgd.zero_grad()
            for m, (xm, ym) in enumerate(zip(x.chunk(n)[r].chunk(micro),
                                             y.chunk(n)[r].chunk(micro))):
                if m < micro - 1:
                    with ddp.no_sync():
                        (F.mse_loss(ddp(xm), ym) / micro).backward()
                else:
                    (F.mse_loss(ddp(xm), ym) / micro).backward()
            ddp.finish_gradient_sync()
            sgd.step()
            reference.zero_grad()
            F.mse_loss(one(x), y).backward()
            reference.step()
        for (name, p), q in zip(ddp.module.named_parameters(), one.parameters()):
            grader.close(f"{name} after {STEPS} SGD steps", p, q, BOUND,
                         "fp64 sums reordered, over a few steps")
