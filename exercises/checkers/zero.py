"""Checks exercises/zero.py: ZeRO-1's step phase by phase, then ZeRO-2's reduce-scatter in
backward, on 3 ranks, against one process: the same fp64 model on the whole batch, its gradient
clipped by torch.nn.utils.clip_grad_norm_ and stepped by torch.optim.AdamW.

Each rank sees its 4 of the 12 rows (equal counts: the mean of the ranks' mean gradients is the
whole batch's). The model, 3 linears, lies in 3 buckets of 14, 25 and 15 elements, so 3 ranks
pad two of them. Between phases the checker reads the state they leave: the gradient shards,
the norm, the masters' clipped .grad, Adam's first moment and the masters before the all-gather,
then the whole model (and, for a bf16 model, the shard the all-gather sends: its master rounded).
Bounds, fp64: a gradient, norm, clipped gradient or moment summed in another order, under 1e-12
(1e-16 measured); AdamW's step divides by sqrt(v) + eps, which can magnify that rounding: 1e-10
on the weights. The bf16 shard against its own master rounded: exact.
"""
import torch

WORLD = 3
PARTS = ["ZeroOptimizer.global_norm", "ZeroOptimizer.clip", "ZeroOptimizer.update",
         "ZeroOptimizer.all_gather_parameters", "ZeroOptimizer.step",
         "Zero2Optimizer._take", "Zero2Optimizer._finish_reduction"]
GRAD, WHY_GRAD = 1e-12, "fp64 sums over the ranks' rows in another order"
WEIGHT, WHY_WEIGHT = 1e-10, "fp64 rounding, magnified by AdamW's 1 / (sqrt(v) + eps)"
ROWS, ADAMW = 4, dict(lr=0.05, weight_decay=0.01)
BUCKET_MB = 200 / 2**20        # 200 bytes: 25 fp64 elements at most, the model's 3 buckets


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4),
                               torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def batch(n: int, seed: int) -> tuple:
    """The whole batch, n ranks' rows: every rank builds it and keeps its own."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n * ROWS, 3, generator=generator, dtype=torch.float64),
            torch.randn(n * ROWS, 2, generator=generator, dtype=torch.float64))


def backward(net, x, y, rows=slice(None), micro=1):
    """The mean squared error on rows, backward in micro equal micro-batches (each / micro)."""
    for xs, ys in zip(x[rows].chunk(micro), y[rows].chunk(micro)):
        (torch.nn.functional.mse_loss(net(xs), ys) / micro).backward()


def shard_of(opt, net, tensors, b: int, rank: int) -> torch.Tensor:
    """Bucket b's shard rank of the one process's tensors (one per parameter of net), laid out
    as the optimizer lays its bucket: the bucket's parameters in order, zero padded to N*S."""
    bucket, index = opt.buckets[b], {id(p): k for k, p in enumerate(net.parameters())}
    flat = torch.zeros(bucket.flat.numel(), dtype=torch.float64)
    whole = torch.cat([tensors[index[id(p)]].flatten() for p in bucket.params])
    flat[:whole.numel()] = whole
    return bucket.shard(flat, rank)


def as_tensor(norm: float) -> torch.Tensor:
    """A norm the optimizer keeps as a float, as an fp64 tensor to compare."""
    return torch.tensor(norm, dtype=torch.float64)


def check(exercise, grader):
    n, r, group = grader.world, grader.rank, grader.group
    rows = slice(r * ROWS, (r + 1) * ROWS)                                 # this rank's

    # One process: the whole batch, the norm written out, clipped to half of it, AdamW.
    one, x, y = model(), *batch(n, 1)
    backward(one, x, y)
    grads = [p.grad.clone() for p in one.parameters()]
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
    max_norm = float(norm) / 2                                          # clipping bites
    torch.nn.utils.clip_grad_norm_(one.parameters(), max_norm)
    clipped = [p.grad.clone() for p in one.parameters()]
    adamw = torch.optim.AdamW(one.parameters(), **ADAMW)
    adamw.step()
    stepped = [p.detach().clone() for p in one.parameters()]
    moments = [adamw.state[p]["exp_avg"] for p in one.parameters()]

    net = model()
    opt = exercise.ZeroOptimizer(net.parameters(), group=group, bucket_mb=BUCKET_MB, **ADAMW)
    backward(net, x, y, rows)
    buckets = range(len(opt.buckets))

    with grader.step("reduce-scatter the gradients", "phase 1 (given): rank r keeps the mean "
                     "over the ranks of shard r of each bucket's gradient"):
        opt.reduce_gradients()
        for b, shard in zip(buckets, opt.gradient_shards()):
            grader.close(f"bucket {b}'s gradient shard", shard, shard_of(opt, net, grads, b, r),
                         GRAD, WHY_GRAD)

    with grader.step("the global norm", "the norm is the root of the sum over the ranks of "
                     "each rank's sum of squares of its own shards (disjoint pieces)"):
        got = opt.global_norm()
        grader.close("the norm", got, norm, GRAD, WHY_GRAD)

    with grader.step("clip", "the optimizer steps the masters: their .grad are scaled by "
                     "min(1, max_norm / norm), the global norm"):
        opt.clip(max_norm, got)
        for b, bucket in zip(buckets, opt.buckets):
            grader.close(f"bucket {b}'s master .grad", bucket.master.grad,
                         shard_of(opt, net, clipped, b, r), GRAD, WHY_GRAD)

    with grader.step("Adam on this rank's shard", "update(): the inner optimizer steps this "
                     "rank's masters, the norm it is given kept in last_grad_norm"):
        masters = []                 # the masters as the all-gather finds them (none: not called)
        gather = opt.all_gather_parameters

        def watched():
            masters.append([m.detach().clone() for m in opt.masters])
            gather()
        opt.all_gather_parameters = watched
        opt.update(float(got), None)
        del opt.all_gather_parameters
        grader.close("last_grad_norm", as_tensor(opt.last_grad_norm), norm, GRAD, WHY_GRAD)
        for b, master in zip(buckets, masters[0] if masters else opt.masters):
            grader.close(f"bucket {b}'s Adam exp_avg", opt.optimizer.state[opt.masters[b]][
                "exp_avg"], shard_of(opt, net, moments, b, r), GRAD, WHY_GRAD)
            grader.close(f"bucket {b}'s master", master, shard_of(opt, net, stepped, b, r),
                         WEIGHT, WHY_WEIGHT)

    with grader.step("all-gather the parameters", "after its step, each rank's shard goes to "
                     "every rank (all_gather_parameters, called by update)"):
        for k, (p, q) in enumerate(zip(net.parameters(), stepped)):
            grader.close(f"parameter {k}", p, q, WEIGHT, WHY_WEIGHT)

    half = model().bfloat16()                 # 16-bit: each master a separate fp32 tensor
    opt = exercise.ZeroOptimizer(half.parameters(), group=group, bucket_mb=BUCKET_MB, **ADAMW)
    backward(half, x.bfloat16(), y.bfloat16(), rows)
    with grader.step("all-gather 16-bit parameters", "a bf16 model's fp32 master is no view of "
                     "it: round the updated master into this rank's shard before sending it"):
        opt.update(float(opt.global_norm()), None)
        for b, bucket in enumerate(opt.buckets):
            grader.close(f"bucket {b}'s shard {r} of the model", bucket.shard(bucket.flat, r),
                         bucket.master.bfloat16(), 0.0, "the same rounding of the same master")

    # Two whole steps of the loop, the first clipped by clip_grad_norm_, the second not.
    x2, y2 = batch(n, 2)
    one = model()
    reference = torch.optim.AdamW(one.parameters(), **ADAMW)
    net = model()
    opt = exercise.ZeroOptimizer(net.parameters(), group=group, bucket_mb=BUCKET_MB, **ADAMW)
    with grader.step("the whole step", "step(): reduce-scatter, unscale, the global norm, clip "
                     "when clip_grad_norm_ asked for it, one host read, update"):
        for k, (xs, ys) in enumerate(((x, y), (x2, y2))):
            for m, o, part in ((one, reference, slice(None)), (net, opt, rows)):
                o.zero_grad()
                backward(m, xs, ys, part)
                if k == 0:
                    expected = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm) \
                        if o is reference else o.clip_grad_norm_(max_norm)
                o.step()
            if k == 0:
                grader.close("step 1's norm", as_tensor(opt.last_grad_norm), expected,
                             GRAD, WHY_GRAD)
            theirs = [reference.state[p]["exp_avg"] for p in one.parameters()]
            for b in buckets:        # (1 - beta1) times the clipped gradients, the step's input
                grader.close(f"after step {k + 1}, bucket {b}'s Adam exp_avg",
                             opt.optimizer.state[opt.masters[b]]["exp_avg"],
                             shard_of(opt, net, theirs, b, r), GRAD, WHY_GRAD)
            for j, (p, q) in enumerate(zip(net.parameters(), one.parameters())):
                grader.close(f"after step {k + 1}, parameter {j}", p, q, WEIGHT, WHY_WEIGHT)

    one, net = model(), model()
    opt = exercise.Zero2Optimizer(net.parameters(), group=group, bucket_mb=BUCKET_MB, **ADAMW)
    first, last = opt.buckets[0], opt.buckets[-1]
    seen = []              # at the last bucket's gradients: bucket 0 launched, its .grad freed?
    for p in last.params:
        p.register_post_accumulate_grad_hook(lambda _: seen.append(
            (opt._order.launched >= 1, all(q.grad is None for q in first.params))))

    with grader.step("ZeRO-2: reduce-scatter during backward", "_take: each gradient copied "
                     "into its bucket's buffer and its .grad freed; a full bucket goes at once; "
                     "_finish_reduction keeps the shard and frees the buffer; the buffer's "
                     "dtype is reduce_dtype, or the parameters' when that is None"):
        backward(net, x, y, rows)
        grader.same("bucket 0 launched before the last bucket's gradients",
                    all(launched for launched, _ in seen), True)
        grader.same("bucket 0's .grad freed before the last bucket's gradients",
                    all(freed for _, freed in seen), True)
        grader.same("parameters whose .grad is kept after backward",
                    [k for k, p in enumerate(net.parameters()) if p.grad is not None], [])
        grader.same("buckets whose whole gradient is kept after backward",
                    [b for b in buckets if opt.buckets[b].grad_flat is not None], [])
        for b, shard in zip(buckets, opt.gradient_shards()):      # reduce_dtype None: fp64
            grader.same(f"bucket {b}'s gradient shard's dtype (its buffer's)",
                        getattr(shard, "dtype", None), torch.float64)
            grader.close(f"bucket {b}'s gradient shard", shard, shard_of(opt, net, grads, b, r),
                         GRAD, WHY_GRAD)

    with grader.step("ZeRO-2: micro-batches add up", "_finish_reduction adds each micro-batch's "
                     "shard to the ones before it, until zero_grad()"):
        opt.zero_grad()
        backward(net, x, y, rows, micro=2)
        for b, shard in zip(buckets, opt.gradient_shards()):
            grader.close(f"bucket {b}'s gradient shard after 2 micro-batches", shard,
                         shard_of(opt, net, grads, b, r), GRAD, WHY_GRAD)

    with grader.step("ZeRO-2: the whole step", "stage 2's step is stage 1's, on the shards "
                     "backward left"):
        backward(one, x, y)
        torch.optim.AdamW(one.parameters(), **ADAMW).step()
        opt.step()
        for k, (p, q) in enumerate(zip(net.parameters(), one.parameters())):
            grader.close(f"parameter {k}", p, q, WEIGHT, WHY_WEIGHT)
