"""Tensor parallelism: split the matrices inside each layer, so one layer runs on N ranks.

A pair of linears is split the Megatron way (Shoeybi et al. 2019, "Megatron-LM", section 3).
The first is split by output columns, the second by input rows.
So the nonlinearity between them is local, and the pair costs one all-reduce forward (g) and
one backward (f). The embedding is split over the vocabulary (section 3, "input embedding").
composition/tensor_parallel_gpt.py splits a whole GPT, its head and loss over the vocabulary too.
Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) turns each all-reduce into a
reduce-scatter and an all-gather, so norms and dropout work on 1/N of the tokens. (Korthikanti's
meaning: one sequence's tokens split over the tensor group, not sequences as separate examples.)
Left out: fused QKV, overlapping these collectives with the matmuls, an RNG tracker for dropout
(every rank draws the same masks: right for copies of one activation, but attention dropout on
rank r's heads, and dropout on rank r's tokens, should draw their own).
Run alone: torchrun --nproc_per_node 2 tensor_parallel.py;
in training: train.py --strategy tp --tp 2. Test: python -m pytest tests/test_tensor_parallel.py

Shapes: B batch, T sequence, C channels, H heads, V vocabulary, N tensor-parallel size, r rank
in the tensor group. "/N" marks this rank's part of a split dimension.
"""
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from foundations.comm import Comm
from model import MLP
from foundations.alone import start_alone
from foundations.placements import place

# ---- Megatron's f and g: a collective forward, its conjugate backward ------------------------
#
# A split region starts where every rank needs the whole activation and ends where each holds
# a partial sum of it. Each crossing moves activations forward with one collective and their
# gradients backward with its conjugate: f's forward is g's backward, and f's backward is g's
# forward.
#
#                      forward                 backward
#   f                  identity                all-reduce      enter a split region
#   g                  all-reduce              identity        leave it
#   gather_sequence    all-gather along T      reduce-scatter  f under sequence parallelism
#   scatter_sequence   reduce-scatter along T  all-gather      g under sequence parallelism
#   gather_features    all-gather along C      keep my slice   a column layer's gather_output
#   split_features     keep my slice of C      all-gather      a row layer's whole input
#   (f and g are the paper's names; F, below, is torch.nn.functional)


class _Conjugate(torch.autograd.Function):
    # One row of the table: `forward` moves x, `backward` moves its gradient.
    # Each takes the tensor and the group.
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


def _all_gathered(x, comm, dim=1):
    """(.., n, ..) on each rank -> (.., N*n, ..): the ranks' pieces in rank order along dim.

    dim 1 is T."""
    local = x.movedim(dim, 0).contiguous()                                       # (n, ...)
    out = local.new_empty((comm.world_size * local.shape[0], *local.shape[1:]))  # (N*n, ...)
    comm.all_gather(out.view(-1), local.view(-1))
    # Contiguous in the caller's layout: the linears that read it keep one copy for backward,
    # where a strided view would be copied (and kept) by each of them.
    return out.movedim(0, dim).contiguous()


def _reduce_scattered(x, comm, dim=1):
    """(.., N*n, ..) partial sums on each rank -> (.., n, ..) along dim (1: T): piece r of the
    sum, on rank r."""
    full = x.movedim(dim, 0).contiguous()                                        # (N*n, ...)
    out = full.new_empty((full.shape[0] // comm.world_size, *full.shape[1:]))    # (n, ...)
    comm.reduce_scatter(out.view(-1), full.view(-1))
    return out.movedim(0, dim).contiguous()


def _my_piece(x, comm, dim=-1):
    """(.., N*n) -> (.., n): my piece along dim (-1: the features, C)."""
    return x.chunk(comm.world_size, dim)[comm.rank].contiguous()


def f(x, comm: Comm):
    """Enter a split region. Every rank feeds the same x into its own columns; x's gradient is the
    sum of the parts each rank's columns contributed, so backward adds them up over the group."""
    return _Conjugate.apply(x, comm, _identity, _all_reduced)


def g(x, comm: Comm):
    """Leave a split region. Each rank holds a partial sum of the output (its rows of the second
    matrix): forward adds them; the sum's gradient flows unchanged to every addend."""
    return _Conjugate.apply(x, comm, _all_reduced, _identity)


def gather_sequence(x, comm: Comm):
    """f under sequence parallelism: (B, T/N, ..) -> (B, T, ..).

    Every rank's whole-sequence copy feeds its own columns.
    So the gradient of rank r's tokens is the sum over the ranks of their gradients' piece r
    (along T): a reduce-scatter."""
    return _Conjugate.apply(x, comm, _all_gathered, _reduce_scattered)


def scatter_sequence(x, comm: Comm):
    """g under sequence parallelism: partial (B, T, C) -> (B, T/N, C) of the sum.

    It is g's all-reduce (a reduce-scatter, then an all-gather) without its all-gather half.
    Every rank's row-layer product covered all T tokens, so each needs the whole gradient:
    all-gather."""
    return _Conjugate.apply(x, comm, _reduce_scattered, _all_gathered)


def gather_features(x, comm: Comm):
    """(.., out/N) -> (.., out): rank r's output columns came from its own weights only.

    Everything after the gather runs identically on every rank, so each rank's gradient of
    (.., out) is already the whole one: backward keeps its own columns of it, no sum needed."""
    return _Conjugate.apply(x, comm, partial(_all_gathered, dim=-1), _my_piece)


def split_features(x, comm: Comm):
    """(.., in) -> (.., in/N): the conjugate of gather_features."""
    return _Conjugate.apply(x, comm, _my_piece, partial(_all_gathered, dim=-1))


def enter_region(x, comm: Comm, sequence_parallel: bool):
    """f, or its sequence-parallel form: (B, T or T/N, C) -> (B, T, C)."""
    return gather_sequence(x, comm) if sequence_parallel else f(x, comm)


def leave_region(x, comm: Comm, sequence_parallel: bool):
    """g, or its sequence-parallel form: partial (B, T, C) -> (B, T or T/N, C)."""
    return scatter_sequence(x, comm) if sequence_parallel else g(x, comm)


# ---- the layers ---------------------------------------------------------------------------------
#
#   column-parallel  Y = X A,  A = [A_0 | A_1]            row-parallel  Z = Y B,  B = [B_0]
#                    rank r: Y_r = X A_r  (B, T, out/N)                             [B_1]
#                                                          rank r: Z_r = Y_r B_r, Z = sum_r Z_r
#
# A and B are (in, out), as the paper writes them; nn.Linear stores the transpose, its weight
# W = A^T (out, in), and computes x W^T. So "column" means A's columns, W's rows: a column layer
# keeps W's rows [r*out/N, (r+1)*out/N), a row layer W's columns [r*in/N, (r+1)*in/N).
# Every rank draws the same full init and keeps its slice, so the ranks' slices put together are
# the matrix one rank would have had.

def _shard(param: torch.Tensor, comm: Comm, dim: int | None) -> nn.Parameter:
    """This rank's slice of a full weight along dim, marked with the dim for checkpoints and norms.

    dim None gives a whole copy, the same on every rank of the group.
    A frozen weight (LoRA's base) stays frozen."""
    if dim is None:
        return nn.Parameter(param.detach().clone(), param.requires_grad)
    if param.shape[dim] % comm.world_size:          # chunk() would cut unequal slices: wrong sums
        raise ValueError(f"tensor parallelism cuts dim {dim} of a {tuple(param.shape)} weight "
                         f"into {comm.world_size} equal slices: give the layer sizes that divide "
                         f"by {comm.world_size}")
    shard = nn.Parameter(_my_piece(param.detach(), comm, dim).clone(), param.requires_grad)
    # Tag it: cut along dim over "tp" (foundations/placements.py).
    return place(shard, shard={"tp": dim})


class _SplitLinear(nn.Module):
    """An nn.Linear split over the group along its weight W's dim.

    group is a Comm, a process group or None (the world).
    dim 0 splits W's rows, the output features: a column layer.
    dim 1 splits W's columns, the input features: a row layer.
    source is an existing nn.Linear to split (from_linear), with its own term if it offers one.
    None makes a fresh one, initialised as on one rank.
    """

    # The local product x W_r^T, a plain matmul on this rank's shard: its weight gradient needs
    # no collective (f and g move the activations around it), so a zero-bubble pipeline may
    # swap in one that defers it (extensions/zero_bubble.py, WeightGradients).
    linear = staticmethod(F.linear)

    def __init__(self, in_features, out_features, group, bias, source, dim):
        super().__init__()
        self.comm, self.dim = Comm.from_group(group), dim   # dim: also read by an export
        source = source if source is not None else nn.Linear(in_features, out_features, bias=bias)
        self.weight = _shard(source.weight, self.comm, dim)       # (out/N, in) or (out, in/N)
        # QLoRA: lora.quantize_split deletes self.weight and keeps W_r here in 4 bits instead
        # (quantization.NF4Weight, as lora.QLoRALinear's base), a module that multiplies by it
        self.base = None
        # The bias goes with the output features: split in a column layer; whole in a row
        # layer, which adds it once, after the partial products are summed.
        bias_dim = 0 if dim == 0 else None
        self.bias = _shard(source.bias, self.comm, bias_dim) if source.bias is not None else None
        self.whole_in_region = []       # the term's whole parameters: partial gradients (below)
        self.term = None                # the source's own term, if it offers split_alongside
        if hasattr(source, "split_alongside"):
            self._take_term(source, dim)

    def _take_term(self, source, dim):
        """The source's own term and its parameters, each sliced along its dim or kept whole.

        A linear may add a term of its own beside x W^T (LoRA's low-rank update, lora.py).
        Such a linear offers the hook split_alongside(dim) -> (pieces, term), which this reads.
        pieces maps a parameter's name to (param, its dim).
        The split layer keeps param sliced along dim to match W's split (dim None: whole).
        term(layer, x) is added to the layer's local product, inside the region.
        So g sums it with the partial products.
        A whole parameter used there gets from each rank only its share of its gradient.
        This file sums no partial gradient: composition/tensor_parallel_gpt.py does, after
        backward (_partial_sums).
        """
        pieces, self.term = source.split_alongside(dim)
        for name, (param, piece_dim) in pieces.items():
            piece = _shard(param, self.comm, piece_dim)
            self.register_parameter(name, piece)
            if piece_dim is None:
                self.whole_in_region.append(piece)

    def local_product(self, x, bias=None):
        """This rank's product x W_r^T (+ b), plus the linear's own term if it brought one.
        A frozen W_r stored in 4 bits (self.base) makes the product itself, dequantized inside
        it and again in backward, never kept."""
        if self.base is None:
            y = self.linear(x, self.weight, bias)
        else:
            y = self.base(x, bias)
        return y if self.term is None else y + self.term(self, x)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **options):
        return cls(linear.in_features, linear.out_features, group,
                   bias=linear.bias is not None, source=linear, **options)


class ColumnParallelLinear(_SplitLinear):
    """Y = X A + b with A's columns (W's rows) split: rank r computes Y[..., r*out/N : (r+1)*out/N].

    enter: apply f (or, with sequence_parallel, gather the sequence) to the input here, as a
    layer used alone does (the demonstration, below). split_block passes enter=False: it enters
    the region once per sublayer instead, by a forward pre-hook on attention and on the MLP, so
    query, key and value share one f.
    gather_output: all-gather the full (.., out), not keep (.., out/N).
    """

    def __init__(self, in_features, out_features, group=None, bias=True, gather_output=False,
                 sequence_parallel=False, enter=True, source: nn.Linear | None = None):
        super().__init__(in_features, out_features, group, bias, source, dim=0)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.enter = enter

    def forward(self, x):                                 # (B, T, in), or (B, T/N, in) with SP
        if self.enter:
            x = enter_region(x, self.comm, self.sequence_parallel)          # (B, T, in)
        y = self.local_product(x, self.bias)                                  # (B, T, out/N)
        return gather_features(y, self.comm) if self.gather_output else y


class RowParallelLinear(_SplitLinear):
    """Z = Y B + b with B's rows (W's columns) split: rank r multiplies Y[..., r*in/N : (r+1)*in/N].

    input_is_parallel: y arrives already split (a column-parallel output); else each rank
    takes its slice. The partial products are summed by g (sequence_parallel: reduce-scattered
    along T), then the bias is added: under sequence parallelism to this rank's T/N tokens only,
    so its gradient is a partial sum (summed over the group in composition/tensor_parallel_gpt.py).
    """

    def __init__(self, in_features, out_features, group=None, bias=True, input_is_parallel=True,
                 sequence_parallel=False, source: nn.Linear | None = None):
        super().__init__(in_features, out_features, group, bias, source, dim=1)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel

    def forward(self, y):                                        # (B, T, in/N), or (B, T, in)
        if not self.input_is_parallel:
            y = split_features(y, self.comm)                    # (B, T, in/N)
        share = self.local_product(y)                             # (B, T, out): a partial sum
        z = leave_region(share, self.comm, self.sequence_parallel)    # (B, T or T/N, out)
        return z + self.bias if self.bias is not None else z


class VocabParallelEmbedding(nn.Module):
    """Rows split over the vocabulary: rank r looks up only ids in [r*V/N, (r+1)*V/N).

    Every other id gives a zero row here and its real row on the rank that holds it, so
    summing over the ranks (g, or a reduce-scatter along T) gives every token its embedding.
    """

    def __init__(self, num_embeddings, embedding_dim, group=None, sequence_parallel=False,
                 embedding: nn.Embedding | None = None):
        super().__init__()
        self.comm = Comm.from_group(group)
        if embedding is None:
            embedding = nn.Embedding(num_embeddings, embedding_dim)
        self.weight = _shard(embedding.weight, self.comm, 0)              # (V/N, C)
        self.sequence_parallel = sequence_parallel
        self.start = self.comm.rank * self.weight.shape[0]

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None, **options):
        return cls(embedding.num_embeddings, embedding.embedding_dim, group,
                   embedding=embedding, **options)

    def forward(self, idx):                                      # (B, T) token ids
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])  # (B, T): another rank's ids
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)      # (B, T, C)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(rows, self.comm, self.sequence_parallel)        # (B, T or T/N, C)


# ---- a transformer block, split --------------------------------------------------------------
#
#   x (B, T/N, C) --norm1--> f/gather --> query, key, value (columns: H/N heads each) --> attention
#     ^                                       --> output (rows) --> g/scatter --> + x --> norm2 ...
#   with sequence parallelism the residual stream, the norms and dropout hold T/N tokens per
#   rank; without it all T, the same on every rank of the tensor group. The whole GPT (its
#   embedding, head and loss split over the vocabulary too, and the partial gradients of what
#   works on T/N tokens, norms and row biases, summed over the group):
#   composition/tensor_parallel_gpt.py.

def check_divisible(cfg, n: int):
    """Raise one message naming the fix if the model does not split into n equal parts.

    The sequence's T/N under sequence parallelism is checked with the flags
    (composition/mesh_checks.py)."""
    for what, size in (("heads (n_head)", cfg.n_head), ("hidden size (n_embd)", cfg.n_embd),
                       ("vocabulary (vocab_size)", cfg.vocab_size)):
        if size % n:
            raise ValueError(f"tensor parallelism over {n} ranks splits the {what} = {size} "
                             f"into {n} equal parts, but {size} % {n} = {size % n}: use a --tp "
                             f"that divides n_head={cfg.n_head}, n_embd={cfg.n_embd} and "
                             f"vocab_size={cfg.vocab_size}")


def split_block(block, comm: Comm, sequence_parallel: bool = False):
    """model.py's Block split in place over the group: attention's heads (query, key and value
    by columns, H/N heads each, the output by rows), and the MLP's up by columns and down by rows
    if it is model.py's pair of linears; any other MLP (a mixture of experts) stays whole."""
    sp = dict(group=comm, sequence_parallel=sequence_parallel)
    attn, mlp = block.attn, block.mlp
    # enter=False: f (or gather_sequence) is applied once per sublayer by a forward pre-hook,
    # registered at the end.
    for name in ("query", "key", "value"):
        column = ColumnParallelLinear.from_linear(getattr(attn, name), enter=False, **sp)
        setattr(attn, name, column)
    attn.output = RowParallelLinear.from_linear(attn.output, **sp)
    # H/N heads per rank. model.py's attention runs unchanged: it reshapes with
    # view(B, T, n_head, -1), so each rank's out/N columns become its H/N heads.
    attn.n_head //= comm.world_size
    split = [attn]
    if isinstance(mlp, MLP):
        mlp.up = ColumnParallelLinear.from_linear(mlp.up, enter=False, **sp)
        mlp.down = RowParallelLinear.from_linear(mlp.down, **sp)
        split.append(mlp)
    # Query, key and value read one input: enter the region once for all three (the columns
    # above do not: enter=False), so backward sums their input gradients in one all-reduce, not
    # three. The hook replaces the sublayer's input x (args[0]) and passes any other on.
    for sublayer in split:
        sublayer.register_forward_pre_hook(
            lambda _, args: (enter_region(args[0], comm, sequence_parallel), *args[1:]))


# ---- run alone: torchrun --nproc_per_node 2 tensor_parallel.py ---------------------------------

def _split_mlp_against_one_process(comm: Comm, sequence_parallel: bool) -> dict:
    """An MLP, up (C -> 4C) split by columns then down (4C -> C) by rows, forward and backward
    on this rank against the unsplit MLP on one process, in fp64: {what: max |difference|}."""
    torch.manual_seed(0)                              # the same weights and batch on every rank
    up, down = nn.Linear(16, 64, dtype=torch.float64), nn.Linear(64, 16, dtype=torch.float64)
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)        # (B, T, C)
    probe = torch.randn(2, 8, 16, dtype=torch.float64)    # the loss: sum(output * probe)
    (down(F.gelu(up(x))) * probe).sum().backward()        # one process: the whole MLP
    column = ColumnParallelLinear.from_linear(up, comm, sequence_parallel=sequence_parallel)
    row = RowParallelLinear.from_linear(down, comm, sequence_parallel=sequence_parallel)
    # With sequence parallelism each rank holds T/N tokens outside the region: its slice of
    # x, of the output and of x's gradient.
    tokens = partial(_my_piece, comm=comm, dim=1) if sequence_parallel else (lambda t: t)
    mine = tokens(x.detach()).requires_grad_()
    out = row(F.gelu(column(mine)))                       # (B, T or T/N, C)
    (out * tokens(probe)).sum().backward()
    if sequence_parallel:      # the bias, added after g, saw this rank's tokens only: a partial sum
        comm.all_reduce(row.bias.grad)
    pairs = {"output": (out, tokens(down(F.gelu(up(x))))),
             "input gradient": (mine.grad, tokens(x.grad)),
             "column weight gradient": (column.weight.grad, _my_piece(up.weight.grad, comm, 0)),
             "row weight gradient": (row.weight.grad, _my_piece(down.weight.grad, comm, 1)),
             "biases' gradients": (torch.cat([column.bias.grad, row.bias.grad]),
                                   torch.cat([_my_piece(up.bias.grad, comm, 0), down.bias.grad]))}
    return {what: (a - b).abs().max().item() for what, (a, b) in pairs.items()}


def _run_against_one_process(check, cases: dict, why: str):
    """Each case's check(comm, case) -> {what: max |difference| from one process}.

    Rank 0 prints its differences. Any rank past 1e-12 exits 1.
    why says why the bound holds (in fp64, the split sums the same terms in another order).
    """
    dist.init_process_group("gloo")
    comm, bound, worst = Comm(), 1e-12, 0.0                 # Comm(): the world's collectives
    for label, case in cases.items():
        differences = check(comm, case)
        worst = max(worst, *differences.values())
        if comm.rank == 0:
            print(f"{label}: " + ", ".join(f"{what} {d:.1e}" for what, d in differences.items()))
    everywhere = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MAX)       # the worst on any rank
    dist.destroy_process_group()
    if comm.rank == 0:                            # flush: the whole buffer, before os._exit
        print(f"max |difference| from one process on {comm.world_size} ranks: "
              f"{everywhere.item():.1e} (bound {bound:g}: {why})", flush=True)
    # At once: gloo's threads may still hold tensors (world.exit_distributed).
    os._exit(int(everywhere.item() > bound))


if __name__ == "__main__":      # both forms, f and g then sequence parallelism's
    # The world sizes N it accepts: those dividing T = 8 tokens (SP) and 16 and 64 features.
    start_alone(torchrun=True, worlds=(1, 2, 4, 8))
    _run_against_one_process(_split_mlp_against_one_process,
                             {"f and g, rank 0's pieces": False,
                              "sequence parallel, rank 0's pieces": True},
                             "fp64 sums reordered")
