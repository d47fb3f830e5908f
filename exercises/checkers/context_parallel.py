"""Checks exercises/context_parallel.py: the online softmax one key block at a time, then ring
attention on 3 ranks (zigzag: 6 chunks), against causal softmax attention over the whole sequence
written out below (scores, mask, softmax, times V) on one process.

_fold_in's state after each block is compared with the softmax's pieces over the keys folded so
far: the max score m, the sum of exp(score - m) and the unnormalised exp(score - m) V. The ring's
output, and the gradients the concept's backward computes from the log-sum-exp the forward kept,
are compared with the whole sequence's, cut to this rank's tokens (first: no output row NaN,
which a wrong chunk size leaves). 3 ranks: with 2, a ring
turning the wrong way (rank r+s's block for r-s's) still brings the right blocks.
fp64 throughout: the same sums in another order (the blocks one by one, each rescaled), so the
differences are rounding alone, under 1e-12 here.
"""
import torch

from context_parallel import SequenceSplit, split_sequence
from foundations.comm import Comm

WORLD = 3
PARTS = ["_fold_in", "RingAttention.forward"]
BOUND, WHY = 1e-12, "fp64, the same sums in another order"
B, H, G, D, C = 2, 4, 2, 8, 3        # batch, query heads, K/V heads, channels per head, chunk


def randn(seed: int, *shape) -> torch.Tensor:
    """The same tensor on every rank: seeded by its name, fp64, scaled so the scores spread."""
    return 2 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                           dtype=torch.float64)


def scores(q, k, causal: bool):
    """q k^T / sqrt(D), each K head repeated for the H/G query heads it serves; causal: the
    query at x sees the keys at y <= x."""
    s = q @ k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-2, -1) / D ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


def softmax_pieces(q, blocks):
    """What the online softmax holds after folding blocks [(k, v, causal)]: the max m, the sum
    of exp(s - m) and exp(s - m) V, over every block's keys at once."""
    s = torch.cat([scores(q, k, causal) for k, v, causal in blocks], dim=-1)
    v = torch.cat([v.repeat_interleave(H // G, dim=1) for k, v, causal in blocks], dim=2)
    m = s.amax(-1)
    p = (s - m.unsqueeze(-1)).exp()
    return m, p.sum(-1), p @ v


def attention(q, k, v):
    """Causal softmax attention over the whole sequence, one process: (B, H, T, D)."""
    return scores(q, k, causal=True).softmax(-1) @ v.repeat_interleave(H // G, dim=1)


def fold(exercise, q, blocks):
    """Fresh state (m = -inf, sums 0), the exercise's _fold_in for each block: (m, denom, acc)."""
    m = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
    denom, acc = torch.zeros_like(m), torch.zeros_like(q)
    for k, v, causal in blocks:
        exercise._fold_in(m, denom, acc, q, k, v, causal)
    return m, denom, acc


def compare(grader, got, expected):
    for what, a, b in zip(("m", "denom", "acc"), got, expected):
        grader.close(what, a, b, BOUND, WHY)


def check(exercise, grader):
    q = randn(1, B, H, C, D)
    k1, v1, k2, v2 = (randn(seed, B, G, C, D) for seed in (2, 3, 4, 5))

    with grader.step("one key block", "the online softmax's first block: m = the row's max "
                     "score, denom = sum exp(score - m), acc = exp(score - m) V, unnormalised, "
                     "written in place into m, denom and acc (the caller's views), the first "
                     "block too"):
        blocks = [(k1, v1, False)]
        compare(grader, fold(exercise, q, blocks), softmax_pieces(q, blocks))

    with grader.step("a second key block", "a new block may raise the max: what was summed "
                     "before, against the old max, is scaled by exp(m_old - m_new), denom and "
                     "acc alike"):
        blocks = [(k1, v1, False), (k2, v2, False)]
        compare(grader, fold(exercise, q, blocks), softmax_pieces(q, blocks))

    with grader.step("the diagonal block", "a chunk's queries against its own keys: each query "
                     "sees the keys up to itself, the later ones masked to -inf before the max"):
        blocks = [(k1, v1, True)]
        compare(grader, fold(exercise, q, blocks), softmax_pieces(q, blocks))

    n, r = grader.world, grader.rank
    comm, split = Comm(grader.group), SequenceSplit(n)
    T = split.n_chunks * C
    whole = [randn(seed, B, heads, T, D).requires_grad_()
             for seed, heads in ((6, H), (7, G), (8, G))]
    probe = randn(9, B, H, T, D)
    expected = attention(*whole)
    (expected * probe).sum().backward()
    mine = [split_sequence(x.detach(), split, r, dim=2).requires_grad_() for x in whole]

    with grader.step("every query row folded in", "a rank holds two chunks of c = t / 2 tokens "
                     "(zigzag): its slot a is c rows of q, m, denom and acc, a block's slot b c "
                     "keys; a row no block reaches ends as 0 / 0 = NaN"):
        out = exercise.RingAttention.apply(*mine, comm, split)
        grader.same("the query rows of out holding NaN",
                    out.isnan().flatten(0, 1).any(0).any(-1).nonzero().flatten().tolist(), [])

    with grader.step("the ring", "at step s rank r holds rank r-s's K/V block, sends it to r+1 "
                     "as the next arrives from r-1, folds in the blocks split.blocks names (the "
                     "causal mask on the diagonal ones only), and divides by denom at the end"):
        grader.close("out", out, split_sequence(expected.detach(), split, r, dim=2), BOUND, WHY)

    with grader.step("the log-sum-exp kept for backward", "backward recomputes each block's "
                     "probabilities as exp(score - lse), lse = m + log(denom) from the forward"):
        (out * split_sequence(probe, split, r, dim=2)).sum().backward()
        for name, x, w in zip(("dq", "dk", "dv"), mine, whole):
            grader.close(name, x.grad, split_sequence(w.grad, split, r, dim=2), BOUND, WHY)
