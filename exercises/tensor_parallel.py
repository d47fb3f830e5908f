"""Exercise: Megatron's f and g, and the column- and row-parallel linears that use them (the
solution: tensor_parallel.py).

A pair of linears split over N ranks: the first by its output features (a column layer: rank r
keeps W's rows r*out/N .. (r+1)*out/N and its slice of the bias), the second by its input
features (a row layer: rank r keeps W's columns r*in/N .. (r+1)*in/N, and the whole bias).
Write, in this order:
- f: entering the split region. Every rank reads the same x; going back, x's gradient is the
  sum of what each rank's columns contributed.
- g: leaving it. Each rank holds a partial sum of the output; going forward they are added up,
  going back the gradient reaches every addend as it is.
- gather_features / split_features: all-gather the output's features, and its conjugate.
- enter_region / leave_region: f and g, or the sequence-parallel gather and scatter (given).
- ColumnParallelLinear.forward and RowParallelLinear.forward, with the pieces above. The bias of
  the row layer is added once, after the partial products are summed.
Column then row is the MLP: one all-reduce forward (g), one backward (f).

Given (tensor_parallel.py): _Conjugate.apply(x, comm, forward, backward), an autograd function
that runs forward(x, comm) and, on the gradient, backward(grad, comm); the moves it takes,
each returning a tensor: _identity(x, comm), _all_reduced(x, comm) (the sum over the group),
_all_gathered(x, comm, dim=1) (the ranks' pieces concatenated along dim), _my_piece(x, comm,
dim=-1) (this rank's 1/N of x along dim). _Conjugate passes (tensor, comm) only: a move
that needs a dim gets it bound beforehand (functools.partial, imported). And
gather_sequence(x, comm) / scatter_sequence(x, comm), sequence parallelism's moves along T.
The layers' __init__ (tensor_parallel.py) sets self.comm, self.weight, self.bias (or None),
self.sequence_parallel; the column layer's self.enter and self.gather_output, the row layer's
self.input_is_parallel; self.local_product(x, bias=None) is this rank's x W_r^T (+ bias).
Check: python -m exercises check tensor_parallel (on 2 ranks, against the unsplit nn.Linear and
MLP on one process, in fp64: outputs and input gradients).

Shapes: B batch, T sequence, N ranks in the tensor group, r this rank; "/N" marks this rank's
part of a split dimension.
"""
from functools import partial

import tensor_parallel
from foundations.comm import Comm
from tensor_parallel import (_Conjugate, _all_gathered, _all_reduced, _identity, _my_piece,
                             gather_sequence, scatter_sequence)


def f(x, comm: Comm):
    """Enter a split region. Every rank feeds the same x into its own columns; x's gradient is the
    sum of the parts each rank's columns contributed, so backward adds them up over the group."""
    # TODO: one _Conjugate.apply. Which move runs forward, which on the gradient, and why?
    raise NotImplementedError


def g(x, comm: Comm):
    """Leave a split region. Each rank holds a partial sum of the output (its rows of the second
    matrix): forward adds them; the sum's gradient flows unchanged to every addend."""
    # TODO: one _Conjugate.apply. What does forward need to turn the partial sums into the
    # output, and what does each addend's gradient need?
    raise NotImplementedError


def gather_features(x, comm: Comm):
    """(.., out/N) -> (.., out): rank r's output columns came from its own weights only.

    Everything after the gather runs identically on every rank, so each rank's gradient of
    (.., out) is already the whole one: backward keeps its own columns of it, no sum needed."""
    # TODO: one _Conjugate.apply, along the last dim. Which move makes (.., out) from every
    # rank's (.., out/N), and which gives back the part of the gradient this rank's own columns
    # produced?
    raise NotImplementedError


def split_features(x, comm: Comm):
    """(.., in) -> (.., in/N): the conjugate of gather_features."""
    # TODO: one _Conjugate.apply, along the last dim: what does forward keep of x, and what
    # must backward build from the ranks' gradients of their slices?
    raise NotImplementedError


def enter_region(x, comm: Comm, sequence_parallel: bool):
    """f, or its sequence-parallel form: (B, T or T/N, C) -> (B, T, C)."""
    # TODO: with sequence parallelism the tokens are gathered (gather_sequence), else f.
    raise NotImplementedError


def leave_region(x, comm: Comm, sequence_parallel: bool):
    """g, or its sequence-parallel form: partial (B, T, C) -> (B, T or T/N, C)."""
    # TODO: with sequence parallelism the sum is scattered along T (scatter_sequence), else g.
    raise NotImplementedError


class ColumnParallelLinear(tensor_parallel.ColumnParallelLinear):

    def forward(self, x):                                 # (B, T, in), or (B, T/N, in) with SP
        # TODO: enter the region if self.enter (self.sequence_parallel says how); this rank's
        # product with its rows of W and its slice of the bias, (B, T, out/N); the whole
        # (B, T, out) only if self.gather_output.
        raise NotImplementedError


class RowParallelLinear(tensor_parallel.RowParallelLinear):

    def forward(self, y):                                        # (B, T, in/N), or (B, T, in)
        # TODO: take this rank's slice of y unless self.input_is_parallel; its product with
        # this rank's columns of W, a partial sum (B, T, out); leave the region to add the
        # partial sums; then the bias (if any), once.
        raise NotImplementedError
