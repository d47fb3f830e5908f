"""Checks exercises/fsdp.py: a unit's life (gathered before forward and again before backward,
freed after each, its gradient reduce-scattered) and prefetch, on 2 ranks, watched from outside.

The model: 3 blocks (the units 1-3, each of a different size) and a head Linear (the root unit,
0), fp64. At the end of each block a probe, an identity with no parameters, records in its
forward and its backward which blocks hold gathered memory and whether the computing block's
parameters are the model's; a hook after each block's forward sees it freed, and a Comm that
records each all-gather and reduce-scatter (the unit known by its size) gives their order. The
reference is one process: the same fp64 model, its output on this rank's rows, its gradient of
the mean loss over the whole batch. Bounds: gathered values are copies (exact, 0); the output
and gradients are fp64 sums in another order (the 2 ranks' means averaged), under 1e-12.
Steps: all-gather, free (one unit, alone), forward, prefetch, backward, prefetch in backward,
reduce-scatter, then prefetch's limit: a forward inside gathered_for_step (a pipeline's step,
which frees nothing), where 1 + prefetch units gathered stop the prefetch. 2 ranks: the parts
index no chunk themselves (the Comm cuts the shards), and the units' sizes (31, 49, 67, 10)
already leave padding.
"""
import copy

import torch
import torch.nn as nn

from foundations.comm import Comm

WORLD = 2
PARTS = ["Unit.all_gather", "Unit.free", "FSDP._before_forward", "FSDP._after_forward",
         "FSDP._before_backward", "FSDP._reduce_scatter", "FSDP._prefetch"]
EXACT, COPY = 0.0, "a gathered parameter is a copy of the shards"
BOUND, WHY = 1e-12, "fp64 sums in another order"
WIDTH, HIDDEN, ROWS = 4, (3, 5, 7), 3        # the blocks' hidden widths differ: units differ


class Recorder(Comm):
    """The world's Comm, recording each all-gather's and reduce-scatter's size, in order."""

    def __init__(self, group):
        super().__init__(group)
        self.calls = []

    def all_gather(self, output, input, async_op=False):
        self.calls.append(("all-gather", output.numel()))
        return super().all_gather(output, input, async_op)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        self.calls.append(("reduce-scatter", input.numel()))
        return super().reduce_scatter(output, input, op, async_op)


class See(torch.autograd.Function):
    """The identity; look(phase) called as it runs forward and as its backward runs."""

    @staticmethod
    def forward(ctx, x, look):
        ctx.look = look
        look("forward")
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.look("backward")
        return grad, None


class Probe(nn.Module):
    def __init__(self, watch, index):
        super().__init__()
        self.look = lambda phase: watch.look(phase, index)

    def forward(self, x):
        return See.apply(x, self.look)


class Watch:
    """What the probes and hooks saw: seen[(phase, unit)] = (the blocks gathered, the largest
    difference of that unit's parameters from the model's, or None: not gathered);
    kept_after_forward: the units still gathered as their forward hook ran."""

    def __init__(self, blocks, reference_blocks):
        self.blocks, self.reference = blocks, reference_blocks
        self.seen, self.kept_after_forward, self.fsdp = {}, [], None

    def gathered(self) -> list:
        return [unit.index for unit in self.fsdp.forward_order
                if unit.flat.untyped_storage().nbytes() > 0]

    def look(self, phase, index):
        block, reference = self.blocks[index - 1], self.reference[index - 1]
        unit = self.fsdp.forward_order[index - 1]
        difference = None
        if unit.flat.untyped_storage().nbytes() > 0:
            difference = max((p - q).abs().max().item()
                             for p, q in zip(block.parameters(), reference.parameters()))
        self.seen[(phase, index)] = (self.gathered(), difference)

    def after_forward(self, index):
        if self.fsdp.forward_order[index - 1].flat.untyped_storage().nbytes() > 0:
            self.kept_after_forward.append(index)


def build(exercise, grader):
    """The FSDP of the student's file on a fresh model, the one process's copy, the Watch."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, h), nn.Tanh(), nn.Linear(h, WIDTH))
              for h in HIDDEN]
    model = nn.Sequential(*blocks, nn.Linear(WIDTH, 2)).double()
    alone = copy.deepcopy(model)
    watch = Watch(blocks, list(alone)[:len(blocks)])
    for i, block in enumerate(blocks):
        block.append(Probe(watch, i + 1))
    comm = Recorder(grader.group)
    sharded = exercise.FSDP(model, wrap=lambda m: m in blocks, group=comm, prefetch=1)
    watch.fsdp = sharded
    del comm.calls[:]                   # the wrap's own checks: not a unit's life
    for unit in sharded.forward_order:        # after FSDP's own hook: the unit should be freed
        unit.module.register_forward_hook(lambda m, args, out, i=unit.index:
                                          watch.after_forward(i))
    return sharded, model, alone, watch, comm


def units_of(sharded, calls) -> list:
    """The calls as (collective, unit index): each unit's flat has its own size."""
    index = {unit.flat.numel(): unit.index for unit in sharded.units}
    return [(what, index.get(numel, f"a tensor of {numel}")) for what, numel in calls]


def computed_with_its_parameters(grader, watch, phase: str, i: int):
    """Unit i's forward or backward ran with its parameters gathered, equal to the model's."""
    _, difference = watch.seen[(phase, i)]
    if difference is None:
        grader.fail(f"unit {i}'s {phase} ran without its gathered parameters")
    if difference > EXACT:
        grader.fail(f"unit {i}'s parameters in its {phase} are off by {difference:.3g} "
                    f"(bound {EXACT}: {COPY})")


def check(exercise, grader):
    n, r = grader.world, grader.rank
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n * ROWS, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.randn(n * ROWS, 2, generator=generator, dtype=torch.float64)
    rows = slice(r * ROWS, (r + 1) * ROWS)
    blocks = list(range(1, len(HIDDEN) + 1))

    with grader.step("all-gather", "the lecture's all-gather: the flat gets its memory back "
                     "(its storage resized), every rank's shard lands in it, launched, not "
                     "waited for, as the pairs wait() reads, and the unit is marked gathered"):
        sharded, _, alone, _, _ = build(exercise, grader)
        unit = sharded.forward_order[1]
        expected = torch.zeros(unit.flat.numel(), dtype=torch.float64)
        expected[:unit.numel] = torch.cat([p.flatten() for p in alone[1].parameters()])
        unit.all_gather()
        pairs = [tuple(type(t).__name__ for t in pair) if isinstance(pair, tuple) else
                 type(pair).__name__ for pair in unit.gathering]
        if len(pairs) != 1 or len(pairs[0]) != 2 or not hasattr(unit.gathering[0][0], "wait") \
                or not isinstance(unit.gathering[0][1], torch.Tensor):
            grader.fail(f"unit {unit.index}'s gathering holds {pairs}: wait() reads a list of "
                        "(handle, shard) pairs, the handle first, one per flat")
        unit.wait()
        grader.close(f"unit {unit.index}'s gathered flat", unit.flat, expected, EXACT, COPY)
        grader.same(f"unit {unit.index}'s gathered", unit.gathered, True)

    with grader.step("free", "the lecture's free: the flat's storage goes back to 0 bytes, "
                     "the parameters staying views of it, and the unit is marked not gathered"):
        unit.free()
        grader.same(f"unit {unit.index}'s flat's bytes after free",
                    unit.flat.untyped_storage().nbytes(), 0)
        grader.same(f"unit {unit.index}'s gathered after free", unit.gathered, False)
        unit.all_gather()                  # gathered again: into the block's own parameters?
        unit.wait()
        for (name, p), q in zip(sharded.module[1].named_parameters(), alone[1].parameters()):
            grader.close(f"block 2's {name} gathered again after free", p, q, EXACT, COPY)
        unit.free()

    sharded, model, alone, watch, comm = build(exercise, grader)
    with grader.step("forward", "the lecture's forward: each unit is gathered (and waited "
                     "for) before it computes, and freed as soon as its forward returns"):
        out = sharded(x[rows])
        for i in blocks:
            computed_with_its_parameters(grader, watch, "forward", i)
        if watch.kept_after_forward:
            grader.fail(f"units {watch.kept_after_forward} still gathered after their forward "
                        "(not freed)")
        grader.close("the output", out, alone(x[rows]), BOUND, WHY)

    with grader.step("prefetch", "the lecture's prefetch: while unit i computes its forward, "
                     "unit i+1's all-gather is already on its way, and no other block's"):
        for i in blocks:
            grader.same(f"the blocks gathered while unit {i} computes its forward",
                        watch.seen[("forward", i)][0], [j for j in (i, i + 1) if j in blocks])
        grader.same("the forward's all-gathers", units_of(sharded, comm.calls),
                    [("all-gather", i) for i in [0] + blocks])

    del comm.calls[:]
    with grader.step("backward", "the lecture's backward: a unit's weights were freed after "
                     "forward, so it is gathered again (and waited for) before its backward"):
        loss = nn.functional.mse_loss(out, y[rows])
        try:
            loss.backward()
        except RuntimeError:
            missing = [i for i in blocks if watch.seen.get(("backward", i), (0, 0))[1] is None]
            if missing:
                grader.fail(f"unit {missing[0]}'s backward began without its gathered "
                            "parameters")
            raise
        sharded.finish_gradient_sync()
        for i in blocks[::-1]:
            computed_with_its_parameters(grader, watch, "backward", i)

    with grader.step("prefetch in backward", "backward's prefetch goes the other way: while "
                     "unit i computes its backward, unit i-1's all-gather is on its way"):
        for i in blocks[::-1]:
            grader.same(f"the blocks gathered while unit {i} computes its backward",
                        watch.seen[("backward", i)][0], [j for j in (i - 1, i) if j in blocks])
        grader.same("the backward's all-gathers",
                    [c for c in units_of(sharded, comm.calls) if c[0] == "all-gather"],
                    [("all-gather", i) for i in blocks[::-1]])

    with grader.step("reduce-scatter", "the lecture's end of a unit's backward: it is freed, "
                     "its whole gradient reduced to the mean over the ranks, rank r keeping "
                     "shard r, and the whole gradients dropped"):
        kept = [u.index for u in sharded.units if u.flat.untyped_storage().nbytes() > 0]
        if kept:
            grader.fail(f"units {kept} still gathered after backward (not freed)")
        nn.functional.mse_loss(alone(x), y).backward()            # one process, the whole batch
        names = {p: name for name, p in model.named_parameters()}
        reference = dict(alone.named_parameters())
        for unit in sharded.reduce_order:
            whole = torch.zeros(unit.flat.numel(), dtype=torch.float64)
            whole[:unit.numel] = torch.cat([reference[names[p]].grad.flatten()
                                            for p in unit.params])
            expected = whole.view(n, -1)[r]
            grader.close(f"unit {unit.index}'s gradient shard", unit.grad, expected, BOUND, WHY)
        left = [names[p] for p in model.parameters() if p.grad is not None]
        if left:
            grader.fail(f"{left[0]}.grad still holds a whole gradient after the reduce-scatter")
        grader.same("the reduce-scatters", [c for c in units_of(sharded, comm.calls)
                                            if c[0] == "reduce-scatter"],
                    [("reduce-scatter", i) for i in blocks[::-1] + [0]])

    with grader.step("prefetch's limit", "the lecture's prefetch bounds memory: it gathers only "
                     "while fewer than 1 + prefetch units are gathered (the one computing "
                     "included), and a pipeline's step frees none"):
        sharded, _, _, watch, comm = build(exercise, grader)
        with sharded.gathered_for_step():
            sharded(x[rows])
        limit = 1 + sharded.prefetch
        for i in blocks:
            expected = [j for j in blocks if j <= max(i, limit)]
            grader.same(f"the blocks gathered while unit {i} computes its forward (a "
                        f"pipeline's step frees none: prefetch gathers up to {limit} blocks; "
                        f"past them, only the block that runs is gathered)",
                        watch.seen[("forward", i)][0], expected)
