"""Exercise: ring attention with the online softmax (the solution: context_parallel.py).

Each of cp ranks holds t of the sequence's T tokens (zigzag: two chunks of c, SequenceSplit) and
their queries, keys and values. Causal attention needs every earlier key, so the K/V blocks go
round the ring while each rank folds them into its queries' softmax, one block at a time:
- _fold_in: the online softmax. Per query row keep a running max m, a running sum of
  exponentials denom and an unnormalised output acc. A new block's scores raise the max to m_new;
  the new exponentials are taken against m_new, and what was summed before, against the old max,
  is scaled by exp(m_old - m_new) first. Dividing acc by denom waits for the last block.
- RingAttention.forward: cp steps. At step s the rank holds rank r-s's K/V block; it posts the
  send of that block to r+1 and the receive of the next from r-1, folds in the blocks its
  query chunks see (SequenceSplit.blocks: which ones, and which get the causal mask), then waits
  and takes the arrived block. After the last, out = acc / denom, and it keeps the log-sum-exp
  m + log(denom) for backward (given: the concept file's).
Given (context_parallel.py), all in the wide dtype (fp32, or fp64 for fp64 inputs):
- _scores(q, k, causal): q (B, H, c, D), k (B, G, c, D) -> (B, H, c, c), q k^T / sqrt(D), with
  each query's later keys at -inf when causal.
- _grouped(k, q): K or V (B, G, c, D) repeated to q's H heads, (B, H, c, D); _upcast(t): t in
  the wide dtype.
- comm.rank, comm.world_size (r and cp); comm.exchange(ops), ops a list of ("send", tensor,
  peer) and ("recv", tensor, peer), posted together; returns a handle: .wait() before reading
  what was received.
- split.blocks(rank, source): [(a, b, causal)], rank's slot a queries against source's slot b
  keys, causal when the two are the same chunk (later chunks are left out).
- check_group(comm, split): raises unless split.cp is the group's size.
Check: python -m exercises check context_parallel (on 3 ranks: with 2, rank r-s and r+s are the
same rank, so a ring turning the wrong way still meets every block).

Shapes: B batch, H query heads, G K/V heads (H/G queries share one: grouped-query attention),
D channels per head, c tokens per chunk, t per rank; m, denom (B, H, c), acc (B, H, c, D) in
_fold_in; q (B, H, t, D), k and v (B, G, t, D) in forward.
"""
import torch

import context_parallel
from context_parallel import Comm, SequenceSplit, _grouped, _scores, _upcast, check_group


def _fold_in(m, denom, acc, q, k, v, causal: bool):
    """The online softmax: fold one key block into a query chunk's running max m (B, H, c), sum of
    exponentials denom (B, H, c; FlashAttention's l) and unnormalised output acc (B, H, c, D), in
    place: the caller passes views of its (B, H, t) tensors. The scores are exponentiated against
    the new max, so none overflows; what was summed under the old max is rescaled by
    exp(m_old - m_new): 0 at a row's first block, where m_old = -inf. m_new is always finite (no
    -inf - -inf = NaN): every block gives each row a finite score, the diagonal one its own key."""
    # TODO: the block's scores, then the online softmax's update of m, denom and acc (v lined
    # up with q's heads, in the wide dtype). At the first block m is -inf and the sums 0: what
    # must the old-sums' factor be then? m, denom and acc change in place (mul_, add_,
    # copy_), at the first block too: the caller reads them back through views.
    raise NotImplementedError


class RingAttention(context_parallel.RingAttention):
    """The concept's RingAttention (its backward), with the forward written here."""

    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, split: SequenceSplit):
        # TODO: check_group; r, cp (comm.rank, comm.world_size); c, the tokens of one chunk (a
        # rank holds two). m, denom (B, H, t) and acc (B, H, t, D) start as no key folded yet,
        # in fp32 or wider. For each of the cp steps: whose K/V block is held now? Post the
        # exchange of the next one before computing, so the two overlap; fold in the blocks
        # split.blocks names, on views of m, denom, acc, q and the held K/V; then wait.
        # out = acc / denom in q's dtype; ctx.save_for_backward(q, k, v, out, lse = m +
        # log(denom)); ctx.comm, ctx.split for backward; return out.
        raise NotImplementedError
