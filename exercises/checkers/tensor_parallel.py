"""Checks exercises/tensor_parallel.py on 2 ranks against one process: f and g alone, the
features' gather and split, the column layer, the row layer, then the MLP (column, GELU, row)
with and without sequence parallelism, against the unsplit nn.Linear / MLP run in the checker.

The one-process reference sees the loss once: where the ranks hold copies of one activation
(after g, or a gather), each rank's copy of the loss is that one loss, and each rank's probe
is the same; where they hold parts (a column layer's out/N, f's consumers), the loss is the sum
of the ranks' parts, and each rank's probe is its slice of the reference's. Compared: outputs,
input gradients, and the layers' weight and bias gradients (this rank's slice of the one
process's). The layers' steps count the all-reduces (f and g swapped show there: the column
layer's f has none forward and one backward, the row layer's g one forward, none backward);
the MLP steps count every collective: the pair costs one all-reduce forward and one backward
(with sequence parallelism an all-gather and a reduce-scatter each way).

fp64 everywhere: a split product sums the same terms in another order, so it differs from one
process by rounding alone, under 1e-12 for these sizes (sums of at most 16 terms of size ~1).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from foundations.comm import Comm

WORLD = 2
PARTS = ["f", "g", "gather_features", "split_features", "enter_region", "leave_region",
         "ColumnParallelLinear.forward", "RowParallelLinear.forward"]
BOUND, WHY = 1e-12, "fp64 sums of the same terms in another order"
B, T, C, HIDDEN = 2, 4, 6, 8          # T, C and HIDDEN divide by WORLD


class Counted(Comm):
    """The group's native collectives, each call's name noted in calls."""

    def __init__(self, group):
        super().__init__(group)
        self.calls = []

    def all_reduce(self, tensor, *args, **kwargs):
        self.calls.append("all_reduce")
        return super().all_reduce(tensor, *args, **kwargs)

    def all_gather(self, output, input, *args, **kwargs):
        self.calls.append("all_gather")
        return super().all_gather(output, input, *args, **kwargs)

    def reduce_scatter(self, output, input, *args, **kwargs):
        self.calls.append("reduce_scatter")
        return super().reduce_scatter(output, input, *args, **kwargs)

    def taken(self) -> list:
        """The calls since the last taken(), in order."""
        calls, self.calls = self.calls, []
        return calls


def randn(seed: int, *shape) -> torch.Tensor:
    """A tensor every rank rebuilds alike from its seed."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def linear(seed: int, n_in: int, n_out: int) -> nn.Linear:
    """An fp64 nn.Linear whose weight and bias every rank draws alike."""
    layer = nn.Linear(n_in, n_out, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(randn(seed, n_out, n_in))
        layer.bias.copy_(randn(seed + 1, n_out))
    return layer


def piece(x: torch.Tensor, rank: int, dim: int = -1) -> torch.Tensor:
    """Rank rank's slice of x along dim, of WORLD equal slices."""
    return x.chunk(WORLD, dim)[rank]


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def check(exercise, grader):
    r, comm = grader.rank, Counted(grader.group)

    with grader.step("f", "f enters the split region: forward, each rank's columns read the "
                     "same whole x; backward, x's gradient must sum what every rank's columns "
                     "gave it: which move does each need?"):
        x = leaf(randn(1, B, T, C))
        probes = [randn(10 + i, B, T, C) for i in range(WORLD)]       # rank i's consumer's
        y = exercise.f(x, comm)
        grader.close("f(x)", y, x, 0.0, "f's forward moves nothing")
        (y * probes[r]).sum().backward()
        grader.close("x.grad", x.grad, sum(probes), BOUND, WHY)

    with grader.step("g", "g leaves the split region: forward, the ranks' partial products "
                     "must add up to the output; backward, the gradient of a sum reaches each "
                     "addend as it is: which move does each need?"):
        parts = [randn(20 + i, B, T, C) for i in range(WORLD)]         # rank i's partial sum
        mine, probe = leaf(parts[r]), randn(30, B, T, C)
        z = exercise.g(mine, comm)
        grader.close("g(partial)", z, sum(parts), BOUND, WHY)
        (z * probe).sum().backward()
        grader.close("partial.grad", mine.grad, probe, 0.0, "g's backward moves nothing")

    with grader.step("gather and split the features", "gather_features all-gathers the last dim "
                     "and keeps this rank's slice of the gradient; split_features is its "
                     "conjugate, keep the slice forward and all-gather the gradient"):
        whole, probe = randn(40, B, T, HIDDEN), randn(41, B, T, HIDDEN)
        mine = leaf(piece(whole, r))
        gathered = exercise.gather_features(mine, comm)
        grader.close("gather_features(x_r)", gathered, whole, 0.0, "a gather only moves data")
        (gathered * probe).sum().backward()
        grader.close("x_r.grad", mine.grad, piece(probe, r), 0.0, "its own slice, not a sum")
        x = leaf(whole)
        split = exercise.split_features(x, comm)
        grader.close("split_features(x)", split, piece(whole, r), 0.0, "a slice only")
        (split * piece(probe, r)).sum().backward()
        grader.close("x.grad", x.grad, probe, 0.0, "every rank's slice of the gradient, gathered")

    with grader.step("the column linear", "a column layer: f on the input (enter_region), this "
                     "rank's product with its rows of W and slice of b, and gather_features only "
                     "if gather_output"):
        one, x, probe = linear(50, C, HIDDEN), randn(52, B, T, C), randn(53, B, T, HIDDEN)
        expected_x = leaf(x)                        # one process's gradients, for both cases
        (one(expected_x) * probe).sum().backward()
        for gather in (False, True):
            layer = exercise.ColumnParallelLinear.from_linear(one, comm, gather_output=gather)
            mine = leaf(x)
            comm.taken()
            y = layer(mine)
            said = f"(gather_output={gather})"
            grader.same(f"all-reduces in forward (gather_output={gather}; f: none, each rank "
                        f"reads x as it is)", comm.taken().count("all_reduce"), 0)
            grader.close(f"output {said}", y, one(x) if gather else piece(one(x), r),
                         BOUND, WHY)
            (y * (probe if gather else piece(probe, r))).sum().backward()
            grader.same(f"all-reduces in backward (gather_output={gather}; f: one, summing "
                        f"x's gradient)", comm.taken().count("all_reduce"), 1)
            grader.close(f"x.grad {said}", mine.grad, expected_x.grad, BOUND, WHY)
            grader.close(f"weight.grad {said}", layer.weight.grad,
                         piece(one.weight.grad, r, 0), BOUND, WHY)
            grader.close(f"bias.grad {said}", layer.bias.grad, piece(one.bias.grad, r),
                         BOUND, WHY)

    with grader.step("the row linear", "a row layer: its slice of a whole input, the product "
                     "with its columns of W and no bias, g (leave_region) to sum the partial "
                     "products, then the bias, once"):
        one, y, probe = linear(60, HIDDEN, C), randn(62, B, T, HIDDEN), randn(63, B, T, C)
        expected_y = leaf(y)
        (one(expected_y) * probe).sum().backward()
        for whole in (False, True):
            layer = exercise.RowParallelLinear.from_linear(one, comm, input_is_parallel=not whole)
            mine = leaf(y if whole else piece(y, r))
            comm.taken()
            z = layer(mine)
            said = f"(input_is_parallel={not whole})"
            grader.same(f"all-reduces in forward (input_is_parallel={not whole}; g: one, "
                        f"summing the partial products)", comm.taken().count("all_reduce"), 1)
            grader.close(f"output {said}", z, one(y), BOUND, WHY)
            (z * probe).sum().backward()
            grader.same(f"all-reduces in backward (input_is_parallel={not whole}; g: none, "
                        f"the gradient reaches each addend as it is)",
                        comm.taken().count("all_reduce"), 0)
            grader.close(f"y.grad {said}", mine.grad,
                         expected_y.grad if whole else piece(expected_y.grad, r), BOUND, WHY)
            grader.close(f"weight.grad {said}", layer.weight.grad,
                         piece(one.weight.grad, r, 1), BOUND, WHY)
            grader.close(f"bias.grad {said}", layer.bias.grad, one.bias.grad, BOUND, WHY)

    up, down = linear(70, C, HIDDEN), linear(72, HIDDEN, C)
    x, probe = randn(74, B, T, C), randn(75, B, T, C)
    expected_x = leaf(x)
    expected = down(F.gelu(up(expected_x)))                 # one process: the whole MLP
    (expected * probe).sum().backward()

    with grader.step("the MLP", "column then row, with nothing between them but the GELU: f "
                     "before the column layer, g after the row layer, one all-reduce each way"):
        column = exercise.ColumnParallelLinear.from_linear(up, comm)
        row = exercise.RowParallelLinear.from_linear(down, comm)
        mine = leaf(x)
        comm.taken()
        out = row(F.gelu(column(mine)))
        grader.same("collectives in forward (one all-reduce: g's, after the row layer)",
                    comm.taken(), ["all_reduce"])
        grader.close("output", out, expected, BOUND, WHY)
        (out * probe).sum().backward()
        grader.same("collectives in backward (one all-reduce: f's, before the column layer)",
                    comm.taken(), ["all_reduce"])
        grader.close("x.grad", mine.grad, expected_x.grad, BOUND, WHY)
        grader.close("up.weight.grad", column.weight.grad, piece(up.weight.grad, r, 0),
                     BOUND, WHY)
        grader.close("down.weight.grad", row.weight.grad, piece(down.weight.grad, r, 1),
                     BOUND, WHY)

    with grader.step("the MLP, sequence parallel", "with sequence parallelism each rank holds "
                     "T/N tokens outside the region: enter_region all-gathers them "
                     "(gather_sequence), leave_region reduce-scatters the sum (scatter_sequence)"):
        column = exercise.ColumnParallelLinear.from_linear(up, comm, sequence_parallel=True)
        row = exercise.RowParallelLinear.from_linear(down, comm, sequence_parallel=True)
        mine = leaf(piece(x, r, 1))                                     # (B, T/N, C)
        comm.taken()
        out = row(F.gelu(column(mine)))
        grader.same("collectives in forward", comm.taken(), ["all_gather", "reduce_scatter"])
        grader.close("output (this rank's tokens)", out, piece(expected, r, 1), BOUND, WHY)
        (out * piece(probe, r, 1)).sum().backward()
        grader.same("collectives in backward", comm.taken(), ["all_gather", "reduce_scatter"])
        grader.close("x.grad (this rank's tokens)", mine.grad, piece(expected_x.grad, r, 1),
                     BOUND, WHY)
