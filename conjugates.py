"""Conjugate collectives: a collective in forward whose backward is its conjugate, for autograd.

A layer or a sequence split over ranks moves its activations with a collective in forward, and
their gradients must come back with the conjugate one: identity forward, all-reduce backward
(Megatron's f, Shoeybi et al. 2019, section 3), all-reduce forward, identity backward (g), and
with the sequence split the all-gather whose backward is a reduce-scatter (Korthikanti et al.
2022, section 4.2.2). Tensor parallelism enters and leaves its split regions with them; context
parallelism gathers K/V with f's sequence form. Left out: overlapping them with the matmuls.
Test: python -m pytest tests/test_tensor_parallel.py tests/test_context_parallel.py

Shapes: B batch, T sequence, C channels, N ranks in the group, r this rank; "/N" marks this
rank's part of a split dimension.
"""
import torch

from collectives import Comm

# ---- the conjugate pair f and g, and their sequence-parallel forms -------------------------
#
# Each function moves activations forward and its gradients backward with conjugate
# collectives: what one does forward, the other does backward.
#
#                      forward                 backward
#   _f                 identity                all-reduce      (enter a split region)
#   _g                 all-reduce              identity        (leave a split region)
#   _gather_sequence   all-gather along T      reduce-scatter  (f with sequence parallelism)
#   _scatter_sequence  reduce-scatter along T  all-gather      (g with sequence parallelism)
#   _gather_features   all-gather along C      keep my slice   (gather_output=True)
#   _split_features    keep my slice of C      all-gather      (input_is_parallel=False)


class _Conjugate(torch.autograd.Function):
    # A collective forward whose backward is its conjugate (a row of the table above):
    # forward(x, comm) and backward(grad, comm) are plain functions, so one class serves all.
    @staticmethod
    def forward(ctx, x, comm, forward, backward):
        ctx.comm, ctx.conjugate = comm, backward
        return forward(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return ctx.conjugate(grad, ctx.comm), None, None, None


def _identity(x, comm):
    return x.view_as(x)             # a new tensor (a view) for autograd to attach to, not x itself


def _all_reduced(x, comm):
    out = x.contiguous().clone()    # a copy: x itself may be saved for backward or read elsewhere
    comm.all_reduce(out)
    return out


def _all_gather_dim(x, comm, dim):
    """(.., n, ..) on each rank -> (.., N*n, ..): the ranks' pieces in rank order along dim."""
    local = x.movedim(dim, 0).contiguous()                       # (n, ...)
    out = local.new_empty((comm.world_size * local.shape[0], *local.shape[1:]))  # (N*n, ...)
    comm.all_gather(out.view(-1), local.view(-1))
    # Contiguous in the caller's layout: the linears that read it keep one copy for backward,
    # where a strided view would be copied (and kept) by each of them.
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_dim(x, comm, dim):
    """(.., N*n, ..) partial sums on each rank -> (.., n, ..): piece r of the sum, on rank r."""
    full = x.movedim(dim, 0).contiguous()                        # (N*n, ...)
    out = full.new_empty((full.shape[0] // comm.world_size, *full.shape[1:]))    # (n, ...)
    comm.reduce_scatter(out.view(-1), full.view(-1))
    return out.movedim(0, dim).contiguous()


def _my_piece(x, comm, dim):
    return x.chunk(comm.world_size, dim)[comm.rank].contiguous()


def _f(x, comm):
    # Every rank feeds the same x into its own columns; x's gradient is the sum of the parts
    # each rank's columns contributed, so backward adds them up over the group.
    return _Conjugate.apply(x, comm, _identity, _all_reduced)


def _g(x, comm):
    # Each rank holds a partial sum of the output (its rows of the second matrix): forward
    # adds them. The sum's gradient flows unchanged to every addend, so backward is identity.
    return _Conjugate.apply(x, comm, _all_reduced, _identity)


def _gather_sequence(x, comm):
    # (B, T/N, C) -> (B, T, C). Every rank's full-sequence copy feeds its own columns, so the
    # gradient of rank r's tokens is the sum over ranks of their rows r: a reduce-scatter.
    return _Conjugate.apply(x, comm, lambda t, c: _all_gather_dim(t, c, 1),
                            lambda t, c: _reduce_scatter_dim(t, c, 1))


def _scatter_sequence(x, comm):
    # (B, T, C) partial sums -> (B, T/N, C) of the full sum: g's all-reduce without its
    # all-gather half. Rank r's tokens' gradient is needed by every rank's rows: all-gather.
    return _Conjugate.apply(x, comm, lambda t, c: _reduce_scatter_dim(t, c, 1),
                            lambda t, c: _all_gather_dim(t, c, 1))


def _gather_features(x, comm):
    # (.., out/N) -> (.., out): rank r's output columns came from its own weights only, so
    # backward keeps its own columns of the gradient.
    return _Conjugate.apply(x, comm, lambda t, c: _all_gather_dim(t, c, -1),
                            lambda t, c: _my_piece(t, c, -1))


def _split_features(x, comm):
    # (.., in) -> (.., in/N): the conjugate of _gather_features.
    return _Conjugate.apply(x, comm, lambda t, c: _my_piece(t, c, -1),
                            lambda t, c: _all_gather_dim(t, c, -1))


def enter_region(x, comm: Comm, sequence_parallel: bool = False):
    """f, or with sequence parallelism the all-gather that replaces it: (B, T or T/N, C) -> (B, T, C)."""
    return _gather_sequence(x, comm) if sequence_parallel else _f(x, comm)


def leave_region(x, comm: Comm, sequence_parallel: bool = False):
    """g, or with sequence parallelism the reduce-scatter: partial (B, T, C) -> (B, T or T/N, C)."""
    return _scatter_sequence(x, comm) if sequence_parallel else _g(x, comm)
