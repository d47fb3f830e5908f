"""Context parallelism: every sequence split over cp ranks; only attention looks across the split.

Activations grow with the sequence, and neither data parallelism nor ZeRO nor FSDP splits them.
Context parallelism cuts each sequence into cp parts, one per rank: embeddings, norms, MLPs and
the loss only ever see their own tokens, and attention, which needs every earlier key and value,
gets them from the other ranks in one of two ways, the naive one beside the one optimised for
memory (the ring keeps only its own K/V block, but sends 1.5x to 2x the all-gather's bytes):
- all-gather K/V (Llama 3: Grattafiori et al. 2024, arXiv 2407.21783): gather the whole
  sequence's keys and values, attend, reduce-scatter their gradients in backward;
- ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): K/V blocks go
  round the ring while each rank folds them into its queries' online softmax (FlashAttention's
  running max and sum, Dao et al. 2022, algorithm 1), the next block in flight while this one
  computes; backward sends the blocks round the other way, their dK/dV travelling with them.
Causal masking leaves the rank with the first tokens idle; Llama 3's split (rank r holds chunks r
and 2cp-1-r of 2cp, "zigzag") gives every rank the same work. Left out: attention dropout, lengths
that do not divide into the chunks, fused attention kernels inside the ring, Ulysses' all-to-all.
Run alone: torchrun --nproc_per_node 2 context_parallel.py.
The GPT over a split sequence: composition/context_parallel_gpt.py.
In training: train.py --strategy cp --cp 2 [--cp-attention allgather] [--cp-balance none].
Test: python -m pytest tests/test_context_parallel.py

Shapes: B batch, T sequence, H heads, D channels per head, C = H x D, cp ranks in the group, r
this rank, t = T/cp tokens per rank, c tokens per chunk (t, or t/2 under zigzag). K and V may
have G heads, each serving H/G query heads (grouped-query attention): G travel, not H.
"""
import os
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from foundations.comm import Comm, ring_bytes
from foundations.alone import start_alone
from tensor_parallel import gather_sequence

# ---- the split: which tokens a rank holds -------------------------------------------------------
#
#   T = 16, cp = 2.  zigzag: 2cp = 4 chunks of c = 4         no zigzag (--cp-balance none):
#                                                             cp = 2 chunks of c = 8
#     chunk   0     1     2     3                             chunk   0         1
#     rank    0     1     1     0                             rank    0         1
#
#   Causal attention: query chunk i sees key chunks j <= i, the diagonal one (j = i) under a
#   causal mask, those before it whole. Zigzag gives every rank as many blocks to compute:
#                keys 0  1  2  3
#     queries 0       \                  rank 0 (chunks 0, 3): 1 + 4 = 5 blocks of c x c
#             1       #  \               rank 1 (chunks 1, 2): 2 + 3 = 5
#             2       #  #  \
#             3       #  #  #  \
#   Without it rank 0 computes one block of 8 x 8 and rank 1 two: rank 0 idles half the time
#   (a diagonal block counts whole: it is computed in full, then masked).
#   Zigzag also balances each ring step: every rank computes 2 blocks per step, 3 at step 0
#   (its own K/V: its two diagonal blocks, and its later chunk's queries on its earlier keys).


@dataclass(frozen=True)
class SequenceSplit:
    """How every sequence is cut over the cp ranks of a group."""
    cp: int
    zigzag: bool = True

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp if self.zigzag else self.cp

    def chunks(self, rank: int) -> list[int]:
        """The chunks `rank` holds, in the order its t tokens are laid out."""
        return [rank, 2 * self.cp - 1 - rank] if self.zigzag else [rank]

    def positions(self, rank: int, seq_len: int, device=None) -> torch.Tensor:
        """Where in the sequence `rank`'s tokens sit: (t,) positions, chunk by chunk."""
        if seq_len % self.n_chunks:
            layout = "two per rank, zigzag" if self.zigzag else "one per rank"
            raise ValueError(f"context parallelism over {self.cp} ranks cuts each sequence into "
                             f"{self.n_chunks} equal chunks ({layout}), and {seq_len} tokens do "
                             f"not divide by {self.n_chunks}: use a sequence length divisible by "
                             f"{self.n_chunks}")
        c = seq_len // self.n_chunks
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                          for i in self.chunks(rank)])

    def sequence_order(self, seq_len: int, device=None) -> torch.Tensor:
        """(T,): which row of the ranks' pieces laid end to end, in rank order, holds position p.

        E.g. T = 16, cp = 2, zigzag: the pieces hold positions 0-3, 12-15, 4-7, 8-11.
        Their argsort gives the rows in sequence order: 0-3, 8-11, 12-15, 4-7.
        """
        every = torch.cat([self.positions(r, seq_len, device) for r in range(self.cp)])   # (T,)
        return every.argsort()

    def blocks(self, rank: int, source: int) -> list[tuple[int, int, bool]]:
        """The blocks `rank`'s queries compute against `source`'s keys: [(a, b, causal)].

        a and b are slots (0 or 1): which of rank's chunks, which of source's.
        i and j are those slots' chunk numbers in the sequence.
        causal: the same chunk (j == i), so masked; chunks wholly in the future (j > i) are skipped.
        """
        return [(a, b, j == i) for a, i in enumerate(self.chunks(rank))
                for b, j in enumerate(self.chunks(source)) if j <= i]

    def predicted_idle(self) -> list[float]:
        """Each rank's idle share of attention's compute: 1 - its blocks / the busiest rank's.

        A diagonal block costs a whole one here: it is computed in full, then masked.
        """
        work = [sum(len(self.blocks(r, s)) for s in range(self.cp)) for r in range(self.cp)]
        return [1 - w / max(work) for w in work]


def check_group(comm: Comm, split: SequenceSplit):
    """Raise unless split.cp equals the group's size.

    Otherwise each rank would treat another rank's chunks as its own: silently wrong attention.
    """
    if split.cp != comm.world_size:
        raise ValueError(f"the sequence is split for {split.cp} context-parallel ranks, but "
                         f"attention runs over a group of {comm.world_size}: make the split "
                         f"SequenceSplit({comm.world_size})")


def split_sequence(x: torch.Tensor, split: SequenceSplit, rank: int, dim: int = 1) -> torch.Tensor:
    """`rank`'s tokens of the whole sequences x: (.., T, ..) -> (.., t, ..) along dim."""
    return x.index_select(dim, split.positions(rank, x.shape[dim], x.device))


def unsplit_sequence(x: torch.Tensor, comm: Comm, split: SequenceSplit,
                     dim: int = 1) -> torch.Tensor:
    """The group's pieces gathered back into whole sequences: (.., t, ..) -> (.., T, ..) along dim,
    on every rank (an all-gather of every rank's piece, then put in sequence order)."""
    local = x.movedim(dim, 0).contiguous()                                     # (t, ...)
    # (T, ...), in rank order
    every = local.new_empty((comm.world_size * local.shape[0], *local.shape[1:]))
    comm.all_gather(every.view(-1), local.view(-1))
    return every.index_select(0, split.sequence_order(every.shape[0], x.device)).movedim(0, dim)


# ---- one block of attention, in fp32 (or wider) -------------------------------------------------

def _upcast(t: torch.Tensor) -> torch.Tensor:
    """t in the dtype the ring sums in: fp32, or t's own if wider (fp64, for tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _grouped(k, q):                        # (B, G, c, D) -> (B, H, c, D)
    """K or V lined up with q's H heads: grouped-query attention's G heads each serve H/G query
    heads (G = H: k itself). The ring sends the G heads, and repeats them only to compute."""
    return k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)


def _summed_over_groups(dk, k):            # (B, H, c, D) -> (B, G, c, D)
    """The gradient of K or V's G heads: the sum over the H/G query heads each one served."""
    return dk.unflatten(1, (k.shape[1], -1)).sum(2)


def _scores(q, k, causal: bool):           # (B, H, c, D), (B, G, c, D) -> (B, H, c, c)
    """q k^T / sqrt(D); a chunk against itself masks each query's future keys."""
    scores = _upcast(q) @ _upcast(_grouped(k, q)).transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _fold_in(m, denom, acc, q, k, v, causal: bool):
    """The online softmax: fold one key block into a query chunk's running max m (B, H, c), sum of
    exponentials denom (B, H, c; FlashAttention's l) and unnormalised output acc (B, H, c, D), in
    place: the caller passes views of its (B, H, t) tensors. The scores are exponentiated against
    the new max, so none overflows; what was summed under the old max is rescaled by
    exp(m_old - m_new): 0 at a row's first block, where m_old = -inf. m_new is always finite (no
    -inf - -inf = NaN): every block gives each row a finite score, the diagonal one its own key."""
    scores = _scores(q, k, causal)                                             # (B, H, c, c)
    m_new = torch.maximum(m, scores.amax(-1))                                  # (B, H, c)
    p = (scores - m_new.unsqueeze(-1)).exp()                                   # (B, H, c, c)
    rescale = (m - m_new).exp()                                                # (B, H, c)
    denom.mul_(rescale).add_(p.sum(-1))
    acc.mul_(rescale.unsqueeze(-1)).add_(p @ _upcast(_grouped(v, q)))
    m.copy_(m_new)


def _block_grads(q, k, v, dout, lse, delta, causal: bool):
    """One block's gradients (FlashAttention's backward, Dao et al. 2022, appendix B), in fp32:
    the forward's probabilities recomputed from the log-sum-exp it kept, never stored.
    dout (B, H, c, D), lse and delta = rowsum(dout * out) (B, H, c) -> dq (B, H, c, D), dk, dv
    (B, G, c, D)."""
    scale = q.shape[-1] ** -0.5
    p = (_scores(q, k, causal) - lse.unsqueeze(-1)).exp()                     # (B, H, c, c)
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ _upcast(_grouped(v, q)).transpose(-2, -1)                     # (B, H, c, c)
    # The softmax's Jacobian; masked entries have p = 0, so ds = 0 there.
    ds = p * (dp - delta.unsqueeze(-1))
    dk = ds.transpose(-2, -1) @ _upcast(q) * scale
    return (ds @ _upcast(_grouped(k, q)) * scale, _summed_over_groups(dk, k),
            _summed_over_groups(dv, v))


# ---- all-gather K/V (Llama 3): the naive one ---------------------------------------------------

def allgather_attention(q, k, v, comm: Comm, split: SequenceSplit):
    """Causal attention of this rank's queries over the whole sequence.

    q (B, H, t, D), k and v (B, G, t, D) -> (B, H, t, D).

    Every rank gathers every rank's K and V, and each query chunk attends to the keys up to its
    own end. Gathering forward and reduce-scattering backward is sequence parallelism's conjugate
    pair (tensor_parallel.gather_sequence): the gradient of this rank's keys is the sum of what
    every rank's queries put into it. Autograd keeps the gathered K/V of the whole sequence per
    layer: the memory this naive version pays, where the ring keeps only its own block.
    """
    check_group(comm, split)
    r, t = comm.rank, q.shape[2]
    # gather_sequence gathers dim 1: put the sequence there.
    kv = torch.stack([k, v]).permute(1, 3, 0, 2, 4)                           # (B, t, 2, G, D)
    kv = gather_sequence(kv, comm)                                  # (B, T, 2, G, D), rank order
    T = kv.shape[1]
    kv = kv.index_select(1, split.sequence_order(T, q.device))                 # sequence order
    keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)   # (B, G, T, D) each
    c = t // len(split.chunks(r))
    out = []
    for a, i in enumerate(split.chunks(r)):
        end = (i + 1) * c        # chunk i's queries (positions i c .. end-1) see keys 0 .. end-1
        # query x of the chunk, at position i c + x, sees key y when y <= i c + x
        visible = torch.ones(c, end, dtype=torch.bool, device=q.device).tril(i * c)
        out.append(F.scaled_dot_product_attention(q[:, :, a * c:(a + 1) * c], keys[:, :, :end],
                                                  values[:, :, :end], attn_mask=visible,
                                                  enable_gqa=True))
    return torch.cat(out, dim=2)                                               # (B, H, t, D)


# ---- ring attention (Liu et al. 2023): the one optimised for memory ----------------------------
#
#   forward, cp = 4: at step s rank r holds rank r-s's K/V block and sends it on to r+1
#     step 0      step 1      step 2      step 3
#     r0: kv0     r0: kv3     r0: kv2     r0: kv1        while step s computes, the block for
#     r1: kv1     r1: kv0     r1: kv3     r1: kv2        step s+1 is on the wire: each step
#     r2: kv2     r2: kv1     r2: kv0     r2: kv3        posts its send and its receive
#     r3: kv3     r3: kv2     r3: kv1     r3: kv0        together, computes, then waits
#   backward: the mirror image, blocks moving to r-1; rank r's share of block j's dK/dV joins the
#   partial sum travelling with block j, which reaches its owner after the last step.

class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence, its K/V blocks passed round
    the ring: q (B, H, t, D), k and v (B, G, t, D) -> (B, H, t, D). Keeps q, k, v, the output
    and its log-sum-exp (B, H, t) for backward: the rank's own block, never the sequence's."""

    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, split: SequenceSplit):
        check_group(comm, split)
        r, cp = comm.rank, comm.world_size
        c = q.shape[2] // len(split.chunks(r))
        wide = torch.promote_types(q.dtype, torch.float32)                     # as _upcast
        # (B, H, t): the running max and the running sum
        m = torch.full(q.shape[:3], float("-inf"), dtype=wide, device=q.device)
        denom = torch.zeros_like(m)
        acc = torch.zeros(q.shape, dtype=wide, device=q.device)                # (B, H, t, D)
        kv = torch.stack([k, v])                                 # (2, B, G, t, D): one message
        for step in range(cp):
            source = (r - step) % cp                                           # whose block kv is
            if step < cp - 1:
                # One batched send and receive (Comm.exchange): NCCL runs two ranks' p2p calls in
                # the order they were posted, so a send posted apart from its receive would wait
                # for a peer that is itself waiting in its send. Every rank of the group joins each
                # batch, which NCCL requires of a group's first p2p call.
                arriving = torch.empty_like(kv)
                handle = comm.exchange([("send", kv, (r + 1) % cp),
                                        ("recv", arriving, (r - 1) % cp)])
            for a, b, causal in split.blocks(r, source):
                rows, cols = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                # Views (basic slicing): _fold_in's in-place updates land in m, denom, acc.
                _fold_in(m[:, :, rows], denom[:, :, rows], acc[:, :, rows], q[:, :, rows],
                         kv[0][:, :, cols], kv[1][:, :, cols], causal)
            if step < cp - 1:
                handle.wait()    # CUDA: the compute stream waits for NCCL's, the host does not
                kv = arriving
        out = (acc / denom.unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, m + denom.log())                  # lse: (B, H, t)
        ctx.comm, ctx.split = comm, split
        return out

    @staticmethod
    def backward(ctx, dout):                                                   # (B, H, t, D)
        q, k, v, out, lse = ctx.saved_tensors
        comm, split = ctx.comm, ctx.split
        r, cp = comm.rank, comm.world_size
        left, right = (r - 1) % cp, (r + 1) % cp
        c = q.shape[2] // len(split.chunks(r))
        dout = _upcast(dout)
        delta = (dout * _upcast(out)).sum(-1)                                  # (B, H, t)
        dq = torch.zeros_like(dout)                                            # (B, H, t, D), fp32
        kv = torch.stack([k, v])                                               # (2, B, G, t, D)
        incoming = None          # (handle, buffer): a partial sum of dK, dV on its way from r+1
        for step in range(cp):
            source = (r + step) % cp                  # the other way round: blocks move to r-1
            if step < cp - 1:                         # the next block in flight, as in forward
                arriving = torch.empty_like(kv)
                kv_handle = comm.exchange([("send", kv, left), ("recv", arriving, right)])
            # This rank's share of source's dK, dV: fp32, as the shares add up over the ranks.
            dkv = torch.zeros(kv.shape, dtype=dq.dtype, device=q.device)       # (2, B, G, t, D)
            for a, b, causal in split.blocks(r, source):
                rows, cols = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                dq_a, dk_b, dv_b = _block_grads(
                    q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                    dout[:, :, rows], lse[:, :, rows], delta[:, :, rows], causal)
                dq[:, :, rows] += dq_a
                dkv[0][:, :, cols] += dk_b
                dkv[1][:, :, cols] += dv_b
            if step == 0:
                own_dkv = dkv             # this rank's block: the others' shares come home
            else:
                # What r+1 sent at step s-1 is its share of the block r holds now (it held it
                # then): added here, the sum moves on with the block.
                if incoming is not None:  # the shares of the ranks this block met before
                    handle, partial_sum = incoming
                    handle.wait()
                    dkv += partial_sum
                # On to r-1, in the same order on every rank as the K/V batches (NCCL pairs two
                # ranks' p2p calls by their order); the last step's reaches the block's owner.
                partial_sum = torch.empty_like(dkv)
                handle = comm.exchange([("send", dkv, left), ("recv", partial_sum, right)])
                incoming = handle, partial_sum
            if step < cp - 1:
                kv_handle.wait()
                kv = arriving
        if incoming is not None:
            handle, partial_sum = incoming
            handle.wait()
            own_dkv += partial_sum                    # every other rank's share of this block
        return dq.to(q.dtype), own_dkv[0].to(k.dtype), own_dkv[1].to(v.dtype), None, None


ring_attention = RingAttention.apply       # (q, k, v, comm, split), as allgather_attention
ATTENTIONS = {"ring": ring_attention, "allgather": allgather_attention}


# ---- bookkeeping: what the attention sends ------------------------------------------------------

# The collectives that move K/V and their gradients, by the byte counter's names (the ring's
# sends, the all-gather and its reduce-scatter). The data-parallel gradient average, an
# all_reduce, is not among them.
KV_COLLECTIVES = ("send", "all_gather", "reduce_scatter")


def cp_kv_bytes(seq_len: int, batch: int, hidden: int, cp: int, attention: str = "ring",
                bytes_per_value: int = 2) -> dict:
    """Bytes one of cp context-parallel ranks sends per layer and micro-batch.

    They are what its queries need to meet every key: {"forward": ..., "backward": ...}.
    A rank's K and V are kv = 2 (T/cp) B C values (hidden = C = H x D; under grouped-query
    attention the K/V width G x D, what travels).
    All-gather K/V, forward: the all-gather of every rank's K/V, (cp-1) kv.
    All-gather K/V, backward: the reduce-scatter of dK and dV, the same volume.
    Ring attention, forward: cp-1 steps of one K/V block.
    Ring attention, backward: the blocks go round again ((cp-1) kv).
    And dK, dV travel beside them cp-1 steps in fp32, or wider (they add up over the ranks).
    In fp32 the ring sends 1.5x the all-gather's, as FSDP sends 1.5x DDP's.
    The ring sends K/V again in backward because it kept only its own block.
    The all-gather keeps them and sends only their gradients.
    In bf16 the ring sends 2x: its fp32 dK/dV are twice the bytes of the bf16 K/V.
    """
    kv = 2 * (seq_len // cp) * batch * hidden
    if attention == "allgather":            # the collectives' own count (foundations/comm.py)
        return {"forward": ring_bytes("all_gather", cp * kv, bytes_per_value, cp),
                "backward": ring_bytes("reduce_scatter", cp * kv, bytes_per_value, cp)}
    return {"forward": (cp - 1) * kv * bytes_per_value,
            "backward": (cp - 1) * kv * (bytes_per_value + max(bytes_per_value, 4))}


# ---- run alone: torchrun --nproc_per_node 2 context_parallel.py --------------------------------

def _attention_against_one_process(comm: Comm, attention: str) -> dict:
    """`attention` on this rank's zigzag chunks of a sequence against causal attention over the
    whole sequence on one process, in fp64: {what: max |difference|} for the output (gathered back
    into whole sequences) and the gradients of this rank's queries, keys and values."""
    torch.manual_seed(0)                                           # the same sequence on every rank
    # (B, H, T, D) each
    q, k, v, probe = (torch.randn(2, 4, 32, 8, dtype=torch.float64) for _ in range(4))
    whole = [t.requires_grad_() for t in (q, k, v)]
    one_process = F.scaled_dot_product_attention(*whole, is_causal=True)
    (one_process * probe).sum().backward()                         # the loss: sum(output * probe)
    split = SequenceSplit(comm.world_size)
    # (B, H, T, D) -> (B, H, t, D)
    my_part = partial(split_sequence, split=split, rank=comm.rank, dim=2)
    inputs = [my_part(t.detach()).requires_grad_() for t in whole]
    out = ATTENTIONS[attention](*inputs, comm, split)
    (out * my_part(probe)).sum().backward()
    pairs = {"output": (unsplit_sequence(out.detach(), comm, split, dim=2), one_process),
             **{f"d{name}": (x.grad, my_part(t.grad)) for name, x, t in zip("qkv", inputs, whole)}}
    return {what: (a - b).abs().max().item() for what, (a, b) in pairs.items()}


def _run_against_one_process(cases: dict) -> float:
    """Each attention on this rank's tokens against one process: rank 0 prints its differences.

    Returns the worst difference on any rank.
    """
    comm, worst = Comm(), 0.0                               # Comm(): the world's collectives
    for label, attention in cases.items():
        differences = _attention_against_one_process(comm, attention)
        worst = max(worst, *differences.values())
        if comm.rank == 0:
            print(f"{label}: " + ", ".join(f"{what} {d:.1e}" for what, d in differences.items()))
    everywhere = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MAX)       # the worst on any rank
    return everywhere.item()


if __name__ == "__main__":      # both attentions, the ring and the naive all-gather
    start_alone(torchrun=True, worlds=(1, 2, 4, 8, 16))      # zigzag: 2N chunks of the 32 tokens
    dist.init_process_group("gloo")
    worst = _run_against_one_process({f"{name} attention, rank 0's tokens": name
                                      for name in ATTENTIONS})
    if dist.get_rank() == 0:                      # flush: the whole buffer, before os._exit
        print(f"max |difference| from one process on {dist.get_world_size()} ranks: {worst:.1e} "
              f"(bound 1e-12: fp64 sums in another order, the ring's online softmax)", flush=True)
    dist.destroy_process_group()
    # At once: gloo's threads may still hold tensors (world.exit_distributed).
    os._exit(int(worst > 1e-12))
