"""Tensor parallelism: split the matrices inside each layer, so one layer runs on N ranks.

A pair of linears is split the Megatron way (Shoeybi et al. 2019, "Megatron-LM", section 3):
the first by output columns, the second by input rows, so the nonlinearity between them is
local and the pair costs one all-reduce forward (g) and one backward (f). Embedding, head and
loss are split over the vocabulary (section 3, "input embedding"), and sequence parallelism
(Korthikanti et al. 2022, section 4.2.2) turns each all-reduce into a reduce-scatter and an
all-gather so norms and dropout work on 1/N of the tokens. Left out: fused QKV, an RNG tracker
for dropout inside the split region, overlapping these collectives with the matmuls. f and g
and their sequence-parallel forms (enter_region, leave_region), which the layers call, are in
conjugates.py: read it first.
Run: torchrun --nproc_per_node 2 train.py --strategy tp --tp 2; test: pytest tests/test_tensor_parallel.py

Shapes: B batch, T sequence, C channels, H heads, V vocabulary, N tensor-parallel size, r rank
in the tensor group; M = B x T tokens. "/N" marks this rank's part of a split dimension.
"""
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from collectives import Comm, as_comm, ring_bytes
# Megatron's f and g and their sequence-parallel forms, shared with context parallelism:
from conjugates import _gather_features, _my_piece, _split_features, enter_region, leave_region
from model import MLP, at_least_fp32
from placements import place, placement

# ---- the layers ---------------------------------------------------------------------------------
#
#   column-parallel  Y = X A,  A = [A_0 | A_1]            row-parallel  Z = Y B,  B = [B_0]
#                    rank r: Y_r = X A_r  (B, T, out/N)                             [B_1]
#                                                          rank r: Z_r = Y_r B_r, Z = sum_r Z_r
#
# nn.Linear stores weight as (out, in): column r is weight rows r*out/N..., row r is weight
# columns r*in/N... Every rank draws the same full init and keeps its slice, so the ranks'
# slices put together are exactly the matrix one rank would have had.
#
# A linear may add a term of its own beside x W^T (LoRA's low-rank update, lora.py). It then
# carries split_alongside(layer, dim, shard): it puts its parameters on the split layer, sliced
# to match W's split (shard(param, dim), dim None: whole), and returns term(layer, x), which the
# layer adds to its local product, inside the region: g sums it with the partial products.

def _shard(param: torch.Tensor, comm: Comm, dim: int | None) -> nn.Parameter:
    """This rank's slice of a full weight along dim, marked with the dim for checkpoints and norms;
    dim None: a whole copy, the same on every rank of the group. A frozen weight (LoRA's base)
    stays frozen. The sizes divide by N: TensorParallelGPT checks them first (check_divisible)."""
    if dim is None:
        return nn.Parameter(param.detach().clone(), param.requires_grad)
    shard = nn.Parameter(_my_piece(param.detach(), comm, dim).clone(), param.requires_grad)
    return place(shard, shard={"tp": dim})


class _SplitLinear(nn.Module):
    """An nn.Linear split over the group along dim: 0 the output features (a column layer), 1 the
    input features (a row layer). linear: an existing nn.Linear to split (from_linear; default:
    a fresh one, initialised as on one rank), with its own term, if any (split_alongside)."""

    # The local product x W_r^T, a plain matmul on this rank's shard: its weight gradient needs
    # no collective (f and g move the activations around it), so a zero-bubble pipeline may
    # swap in one that defers it (pipeline.WeightGradients' protocol).
    linear = staticmethod(F.linear)

    def __init__(self, in_features, out_features, group, bias, linear, dim):
        super().__init__()
        self.comm = as_comm(group)
        linear = linear if linear is not None else nn.Linear(in_features, out_features, bias=bias)
        self.weight = _shard(linear.weight, self.comm, dim)       # (out/N, in) or (out, in/N)
        # The bias goes with the output features: split in a column layer; whole in a row
        # layer, which adds it once, after the partial products are summed.
        bias_dim = 0 if dim == 0 else None
        self.bias = _shard(linear.bias, self.comm, bias_dim) if linear.bias is not None else None
        split = getattr(linear, "split_alongside", None)
        self.term = split(self, dim, self._term_shard) if split else None

    def _term_shard(self, param: torch.Tensor, dim: int | None) -> nn.Parameter:
        """A parameter of the linear's own term, split along dim like W (None: whole). A whole one
        meets only this rank's part of the layer, so its gradient is a partial sum over the group."""
        shard = _shard(param, self.comm, dim)
        return shard if dim is not None else place(shard, partial="tp")

    def local_product(self, x, bias=None):
        """This rank's product x W_r^T (+ b), plus the linear's own term if it brought one."""
        y = self.linear(x, self.weight, bias)
        return y if self.term is None else y + self.term(self, x)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **options):
        return cls(linear.in_features, linear.out_features, group,
                   bias=linear.bias is not None, linear=linear, **options)


class ColumnParallelLinear(_SplitLinear):
    """y = x A^T + b with A's output features split: rank r computes y[..., r*out/N : (r+1)*out/N].

    enter: apply f (or, with sequence_parallel, gather the sequence) to the input here; False
    when the caller entered the region once for several layers sharing an input (query, key
    and value). gather_output: all-gather the full (.., out) instead of keeping (.., out/N).
    """

    def __init__(self, in_features, out_features, group=None, bias=True, gather_output=False,
                 sequence_parallel=False, enter=True, linear: nn.Linear | None = None):
        super().__init__(in_features, out_features, group, bias, linear, dim=0)
        self.gather_output, self.sequence_parallel, self.enter = gather_output, sequence_parallel, enter

    def forward(self, x):                                        # (B, T, in), or (B, T/N, in) with SP
        if self.enter:
            x = enter_region(x, self.comm, self.sequence_parallel)          # (B, T, in)
        y = self.local_product(x, self.bias)                                  # (B, T, out/N)
        return _gather_features(y, self.comm) if self.gather_output else y


class RowParallelLinear(_SplitLinear):
    """z = y B^T + b with B's input features split: rank r multiplies y[..., r*in/N : (r+1)*in/N].

    input_is_parallel: y arrives already split (a column-parallel output); else each rank
    takes its slice. The partial products are summed by g (sequence_parallel: reduce-scattered
    along T), then the bias is added.
    """

    def __init__(self, in_features, out_features, group=None, bias=True, input_is_parallel=True,
                 sequence_parallel=False, linear: nn.Linear | None = None):
        super().__init__(in_features, out_features, group, bias, linear, dim=1)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel

    def forward(self, y):                                        # (B, T, in/N), or (B, T, in)
        if not self.input_is_parallel:
            y = _split_features(y, self.comm)                   # (B, T, in/N)
        partial = self.local_product(y)                           # (B, T, out): this rank's share
        z = leave_region(partial, self.comm, self.sequence_parallel)  # (B, T or T/N, out)
        return z + self.bias if self.bias is not None else z


class VocabParallelEmbedding(nn.Module):
    """Rows split over the vocabulary: rank r looks up only ids in [r*V/N, (r+1)*V/N).

    Every other id gives a zero row here and its real row on the rank that holds it, so
    summing over the ranks (g, or a reduce-scatter along T) gives every token its embedding.
    """

    def __init__(self, num_embeddings, embedding_dim, group=None, sequence_parallel=False,
                 embedding: nn.Embedding | None = None):
        super().__init__()
        self.comm = as_comm(group)
        embedding = embedding if embedding is not None else nn.Embedding(num_embeddings, embedding_dim)
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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    # log-softmax needs two numbers per token over the whole vocabulary, the max and the sum
    # of exponentials, plus the target's logit, held by one rank: three all-reduces of M
    # numbers instead of gathering M x V logits. The gradient, softmax - one_hot, is local.
    @staticmethod
    def forward(ctx, logits, targets, comm):                     # logits (M, V/N), targets (M,)
        shard = logits.shape[-1]
        top = logits.max(dim=-1).values                          # (M,)
        comm.all_reduce(top, op="max")
        shifted = logits - top.unsqueeze(-1)                     # (M, V/N), at most 0: exp cannot overflow
        local = targets - comm.rank * shard
        mine = (local >= 0) & (local < shard)                    # (M,): this rank holds the target
        local = local.clamp(0, shard - 1)
        target_logit = shifted.gather(1, local.unsqueeze(1)).squeeze(1) * mine   # (M,)
        comm.all_reduce(target_logit)
        exp = shifted.exp()
        total = exp.sum(dim=-1)                                  # (M,)
        comm.all_reduce(total)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, mine)
        return total.log() - target_logit                        # (M,) per-token loss

    @staticmethod
    def backward(ctx, grad):                                     # grad (M,)
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax.clone()                            # (M, V/N)
        rows = torch.arange(grad_logits.shape[0], device=grad.device)
        grad_logits[rows, local] -= mine.to(grad_logits.dtype)
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits, targets, group=None):
    """Mean cross-entropy of (M, V/N) logit shards against (M,) targets; equals F.cross_entropy."""
    return _VocabParallelCrossEntropy.apply(logits, targets, as_comm(group)).mean()


# ---- the GPT, parallelized ------------------------------------------------------------------
#
#   x (B, T/N, C) --norm1--> f/gather --> query, key, value (columns: H/N heads each) --> attention
#     ^                                       --> output (rows) --> g/scatter --> + x --> norm2 ...
#   with sequence parallelism the residual stream, the norms and dropout hold T/N tokens per
#   rank; without it all T, the same on every rank of the tensor group.

def check_divisible(cfg, n: int):
    """Raise one message naming the fix if the model does not split into n equal parts."""
    for what, size in (("heads (n_head)", cfg.n_head), ("hidden size (n_embd)", cfg.n_embd),
                       ("vocabulary (vocab_size)", cfg.vocab_size)):
        if size % n:
            raise ValueError(f"tensor parallelism over {n} ranks splits the {what} = {size} into "
                             f"{n} equal parts, but {size} % {n} = {size % n}: use a --tp that "
                             f"divides n_head={cfg.n_head}, n_embd={cfg.n_embd} and "
                             f"vocab_size={cfg.vocab_size}")


class TensorParallelGPT(nn.Module):
    """model.py's GPT with its matrices split, in place, over the tensor group (group: a Comm, a
    process group or None, the world): each rank keeps its slices, the module to train. Every
    rank must start from the same weights (the same seed)."""

    def __init__(self, gpt, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.comm = comm = as_comm(group)
        check_divisible(gpt.cfg, comm.world_size)
        self.gpt, self.sequence_parallel = gpt, sequence_parallel
        sp = dict(group=comm, sequence_parallel=sequence_parallel)
        for block in gpt.blocks:
            self._split_block(block)
        gpt.token_emb = VocabParallelEmbedding.from_embedding(gpt.token_emb, **sp)
        gpt.head = ColumnParallelLinear.from_linear(gpt.head, **sp)  # logits (B, T, V/N)
        if gpt.cfg.tie_embeddings:
            gpt.head.weight = gpt.token_emb.weight               # the same (V/N, C) rows
        # With sequence parallelism a replicated weight (norms, position embedding, the row
        # layers' biases) sees only this rank's tokens: its gradient is a partial sum. So is a
        # whole parameter of a split layer's own term (split_alongside: LoRA's), with or without it.
        if sequence_parallel:
            for p in gpt.parameters():
                if "tp" not in placement(p).shard:
                    place(p, partial="tp")
        self.partial = [p for p in gpt.parameters() if p.requires_grad and placement(p).partial == "tp"]
        # model.py's own forward runs on the split layers: (B, T or T/N, C) through the blocks,
        # then logits (B, T, V/N), never gathered, into the loss over the split vocabulary.
        gpt.loss_fn = lambda logits, targets: vocab_parallel_cross_entropy(
            at_least_fp32(logits).flatten(0, 1), targets.flatten(), comm)
        if sequence_parallel:
            # The positions of the T tokens this rank's group holds (whole sequences, or with
            # context parallelism its chunks of them: parallelize.py sets it), of which this
            # rank embeds 1/N.
            self.group_positions = gpt.positions_of
            gpt.positions_of = self._my_positions

    def _split_block(self, block):
        """Attention's heads over the group, and the MLP's columns if it is model.py's pair of
        linears; any other MLP (a mixture of experts: parallelize.py) stays whole on every rank."""
        comm, sequence_parallel = self.comm, self.sequence_parallel
        sp = dict(group=comm, sequence_parallel=sequence_parallel)
        attn, mlp = block.attn, block.mlp
        for name in ("query", "key", "value"):
            setattr(attn, name, ColumnParallelLinear.from_linear(getattr(attn, name), comm, enter=False))
        attn.output = RowParallelLinear.from_linear(attn.output, **sp)
        attn.n_head //= comm.world_size                           # H/N heads per rank, same code
        split = [attn]
        if isinstance(mlp, MLP):
            mlp.up = ColumnParallelLinear.from_linear(mlp.up, comm, enter=False)
            mlp.down = RowParallelLinear.from_linear(mlp.down, **sp)
            split.append(mlp)
        # Query, key and value read one input: enter the region once for all three, so
        # backward sums their input gradients in one all-reduce, not three.
        for sublayer in split:
            sublayer.register_forward_pre_hook(
                lambda _, args: (enter_region(args[0], comm, sequence_parallel),))

    def _my_positions(self, T: int, device) -> torch.Tensor:        # sequence parallelism: (T/N,)
        n = self.comm.world_size
        if T % n:
            raise ValueError(f"sequence parallelism splits the sequence ({T} tokens) into "
                             f"{n} equal parts: use a --seq-len divisible by {n}")
        return self.group_positions(T, device).chunk(n)[self.comm.rank]

    def forward(self, idx, targets=None):                        # idx: (B, T), the same on the group
        return self.gpt(idx, targets)

    def sum_partial_in_backward(self):
        """For a data dimension that reduces gradients during backward (ZeRO-2's buckets, FSDP's
        units: their hooks read .grad as soon as it is accumulated): sum each partial gradient
        over the group as autograd computes it, before those hooks, one all-reduce per weight
        and micro-batch, instead of once after backward. Every rank of the group runs the same
        graph, so the all-reduces come in the same order on all of them."""
        for p in self.partial:
            p.register_hook(self._summed)
        self.summed_in_backward = True

    def _summed(self, grad):
        total = grad.contiguous().clone()
        self.comm.all_reduce(total)
        return total

    summed_in_backward = False

    keeps_whole_gradients = True        # flat.GradientSyncs: partial sums add up unreduced

    def no_sync(self):
        """Partial gradients of several backwards add up where they are and are summed once, at
        the finish (or each in its own backward: sum_partial_in_backward): nothing to hold."""
        return contextlib.nullcontext()

    def finish_gradient_sync(self):
        """After backward: sum the partial gradients of replicated weights (sequence parallelism,
        LoRA factors), unless backward did (sum_partial_in_backward)."""
        if self.summed_in_backward:
            return
        grads = [p.grad for p in self.partial if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])     # one message, not one per tensor
            self.comm.all_reduce(flat)
            for g, total in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(total.view_as(g))

    def bytes_per_step(self, batch: int, seq_len: int, micro_batches: int = 1) -> int:
        """Bytes this rank sends per step for the activations (ring formula), batch rows per rank
        (seq_len: its tokens of each, under context parallelism).

        Each split sublayer (attention, and model.py's MLP) sends 1 all-reduce forward and 1
        backward of (B, T, C); embedding and head one each; with sequence parallelism each
        all-reduce is a reduce-scatter + all-gather pair of the same volume. The loss adds 3 x M
        fp32 numbers; the gradient norm one; the partial gradients one all-reduce a step (summed
        in backward: one per weight and micro-batch). A pipeline stage (pipeline.GPTStage) counts
        its own blocks, and the embedding or head if it has them.
        """
        gpt, n = self.gpt, self.comm.world_size
        # Each split sublayer ends in one row layer: its g (attention's output, the MLP's down).
        sublayers = sum(isinstance(m, RowParallelLinear) for m in gpt.modules())
        first, last = gpt.pos_emb is not None, gpt.head is not None
        # With the embeddings frozen (LoRA) nothing before the first block needs its input's
        # gradient: autograd never computes it, nor the first sublayer's backward all-reduce.
        skipped = first and not (gpt.token_emb.weight.requires_grad or gpt.pos_emb.weight.requires_grad)
        size = next(gpt.parameters()).element_size()
        m = batch // micro_batches * seq_len
        per_micro = (2 * sublayers + first + last - skipped) * ring_bytes("all_reduce", m * gpt.cfg.n_embd,
                                                                         size, n)
        per_micro += 3 * ring_bytes("all_reduce", m, 4, n) if last else 0
        held = {id(p) for p in gpt.parameters()}        # a pipeline stage's: its own parts only
        partial = [p.numel() for p in self.partial if id(p) in held]
        sync = (micro_batches * sum(ring_bytes("all_reduce", numel, size, n) for numel in partial)
                if self.summed_in_backward else ring_bytes("all_reduce", sum(partial), size, n))
        return micro_batches * per_micro + sync + ring_bytes("all_reduce", 1, 4, n)
