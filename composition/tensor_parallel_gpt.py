"""Tensor parallelism over the whole GPT: every block split (tensor_parallel.split_block), the
embedding and head split over the vocabulary and the loss computed on the split logits (Shoeybi
et al. 2019, section 3, "input embedding"); with sequence parallelism (Korthikanti et al. 2022,
section 4.2.2) each rank embeds its 1/N of the tokens, and the weights used on those tokens get
partial gradients, summed over the group after backward. Megatron's f and g and the split layers
are in tensor_parallel.py: read it first.
Run: torchrun --nproc_per_node 2 train.py --strategy tp --tp 2.
Test: pytest tests/test_tensor_parallel.py

Shapes: B batch, T sequence, C channels, V vocabulary, N tensor-parallel size, r rank in the
tensor group; M = B x T tokens. "/N" marks this rank's part of a split dimension.
"""
import contextlib

import torch
import torch.nn as nn

from foundations.comm import Comm
from model import at_least_fp32
from pretrained.llama import LlamaBlock
from tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                             check_divisible, enter_region, split_block)

# ---- the loss over the split vocabulary ------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    # log-softmax needs two numbers per token over the whole vocabulary, the max and the sum
    # of exponentials, plus the target's logit, held by one rank: three all-reduces of M
    # numbers instead of gathering M x V logits. The gradient, softmax - one_hot, is local.
    @staticmethod
    def forward(ctx, logits, targets, comm):                     # logits (M, V/N), targets (M,)
        shard = logits.shape[-1]
        top = logits.max(dim=-1).values                          # (M,)
        comm.all_reduce(top, op="max")
        shifted = logits - top.unsqueeze(-1)           # (M, V/N), at most 0: exp cannot overflow
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
    return _VocabParallelCrossEntropy.apply(logits, targets, Comm.from_group(group)).mean()


# ---- a Llama's block (pretrained/llama.py) ----------------------------------------------------

def check_llama_divisible(cfg, n: int):
    """One message if a Llama's key/value heads or MLP width do not split into n equal parts."""
    for what, size in (("key/value heads (n_kv_head)", cfg.n_kv_head),
                       ("MLP width (hidden)", cfg.hidden)):
        if size % n:
            raise ValueError(f"tensor parallelism over {n} ranks splits the {what} = {size} into "
                             f"{n} equal parts, but {size} % {n} = {size % n}: use a --tp that "
                             f"divides n_kv_head={cfg.n_kv_head} and hidden={cfg.hidden}")


def split_llama_block(block, comm, sequence_parallel: bool = False):
    """split_block for a LlamaBlock, in place: query by columns (H/N query heads), key and value
    by columns too (G/N key/value heads, the ones this rank's query heads share), the output by
    rows; SwiGLU's gate and up by columns, down by rows, so silu(gate) * up stays local."""
    sp = dict(group=comm, sequence_parallel=sequence_parallel)
    attn, mlp = block.attn, block.mlp
    for layer, name in ((attn, "query"), (attn, "key"), (attn, "value"), (mlp, "gate"),
                        (mlp, "up")):
        column = ColumnParallelLinear.from_linear(getattr(layer, name), enter=False, **sp)
        setattr(layer, name, column)
    attn.output = RowParallelLinear.from_linear(attn.output, **sp)
    mlp.down = RowParallelLinear.from_linear(mlp.down, **sp)
    # Each sublayer enters the region once for its columns, as split_block's do.
    for sublayer in (attn, mlp):
        sublayer.register_forward_pre_hook(
            lambda _, args: (enter_region(args[0], comm, sequence_parallel), *args[1:]))


# ---- the GPT, parallelized ------------------------------------------------------------------

class TensorParallelGPT(nn.Module):
    """model.py's GPT with its matrices split, in place, over the tensor group (group: a Comm, a
    process group or None, the world): each rank keeps its slices, the module to train. Every
    rank must start from the same weights (the same seed). before_split: called with each
    module just before it is split (a model read from files as it is split, so that no rank
    holds it whole: pretrained/streamed.py); after_split: just after (QLoRA's slices quantized
    a block at a time: lora.quantize_split)."""

    def __init__(self, gpt, group=None, sequence_parallel: bool = False, before_split=None,
                 after_split=None):
        super().__init__()
        self.comm = comm = Comm.from_group(group)
        check_divisible(gpt.cfg, comm.world_size)
        llama = isinstance(gpt.blocks[0], LlamaBlock)
        if llama:
            check_llama_divisible(gpt.cfg, comm.world_size)
        self.gpt, self.sequence_parallel = gpt, sequence_parallel
        sp = dict(group=comm, sequence_parallel=sequence_parallel)
        before_split = before_split or (lambda module: None)
        after_split = after_split or (lambda module: None)
        for block in gpt.blocks:
            before_split(block)
            (split_llama_block if llama else split_block)(block, comm, sequence_parallel)
            after_split(block)
        before_split(gpt.token_emb)
        gpt.token_emb = VocabParallelEmbedding.from_embedding(gpt.token_emb, **sp)
        before_split(gpt.head)
        gpt.head = ColumnParallelLinear.from_linear(gpt.head, **sp)  # logits (B, T, V/N)
        if gpt.cfg.tie_embeddings:
            gpt.head.weight = gpt.token_emb.weight               # the same (V/N, C) rows
        after_split(gpt.head)                                    # after the tie: its rows
        self.partial = self._partial_sums()
        # model.py's own forward runs on the split layers: (B, T or T/N, C) through the blocks,
        # then logits (B, T, V/N), never gathered, into the loss over the split vocabulary.
        gpt.loss_fn = lambda logits, targets: vocab_parallel_cross_entropy(
            at_least_fp32(logits).flatten(0, 1), targets.flatten(), comm)
        if sequence_parallel and not llama:
            # The positions of the T tokens the group holds (whole sequences, unless the caller
            # has split them further and says so here), of which this rank embeds 1/N. (A
            # Llama embeds no positions: its attention rotates the group's tokens, gathered.)
            self.group_positions = gpt.positions_of
            gpt.positions_of = self._my_positions

    def _partial_sums(self) -> list:
        """The trained parameters whose gradient on each rank is only its share of the sum over
        the group: a whole parameter a split layer's term uses inside the region (LoRA's factor),
        and under sequence parallelism every parameter used outside the regions, where each rank
        computes its T/N tokens only (norms, position embedding, an MLP left whole, and the row
        layers' biases, added after g)."""
        linears = [m for m in self.gpt.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        layers = linears + [self.gpt.token_emb]
        inside = ({id(p) for layer in layers for p in layer.parameters()}
                  - {id(layer.bias) for layer in linears if isinstance(layer, RowParallelLinear)})
        whole_inside = {id(p) for layer in linears for p in layer.whole_in_region}
        return [p for p in self.gpt.parameters() if p.requires_grad and
                (id(p) in whole_inside or self.sequence_parallel and id(p) not in inside)]

    def _my_positions(self, T: int, device) -> torch.Tensor:        # sequence parallelism: (T/N,)
        n = self.comm.world_size
        if T % n:
            raise ValueError(f"sequence parallelism splits the sequence ({T} tokens) into "
                             f"{n} equal parts: use a --seq-len divisible by {n}")
        return self.group_positions(T, device).chunk(n)[self.comm.rank]

    def forward(self, idx, targets=None):              # idx: (B, T), the same on the group
        return self.gpt(idx, targets)

    def sum_partial_in_backward(self):
        """Sum each partial gradient over the group as autograd computes it, one all-reduce per
        weight and micro-batch, instead of once after backward: for a caller whose own hooks read
        .grad as soon as it is accumulated. Every rank of the group runs the same graph, so the
        all-reduces come in the same order on all of them."""
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
        """After backward: sum the partial gradients (_partial_sums) over the group, unless
        backward did (sum_partial_in_backward)."""
        if self.summed_in_backward:
            return
        grads = [p.grad for p in self.partial if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])     # one message, not one per tensor
            self.comm.all_reduce(flat)
            for g, total in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(total.view_as(g))
