"""Checks exercises/collectives.py: the ring's reduce-scatter, all-gather and all-reduce on 3
ranks, against one process's sum of every rank's tensor (each rank builds every rank's input).

fp64 inputs: a sum in another order differs by rounding alone, under 1e-12 here. The ring's
messages are counted through the exercise's send_right_receive_left: N-1 per collective.
"""
import contextlib

import torch

WORLD = 3
PARTS = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"]
BOUND, WHY = 1e-12, "fp64 sums of 3 terms in another order"


def rank_tensor(rank: int, n: int, c: int) -> torch.Tensor:
    """Rank rank's (n, c) input: every rank can build any rank's."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, c, generator=generator, dtype=torch.float64)


@contextlib.contextmanager
def counted(exercise, grader, what: str, expected: int):
    """Counts the calls of the exercise's send_right_receive_left inside the block."""
    calls, send = [], exercise.send_right_receive_left

    def counting(*args, **kwargs):
        calls.append(1)
        return send(*args, **kwargs)
    exercise.send_right_receive_left = counting
    try:
        yield
    finally:
        exercise.send_right_receive_left = send
    grader.same(f"the number of ring steps (send_right_receive_left calls) in {what}",
                len(calls), expected)


def check(exercise, grader):
    n, r, c = grader.world, grader.rank, 5
    total = sum(rank_tensor(i, n, c) for i in range(n))              # one process: (N, c)

    with grader.step("reduce-scatter", "the lecture's reduce-scatter: after N-1 ring steps rank r "
                     "holds the sum of chunk r. After the last step chunk r must be complete on "
                     "rank r, and the chunk arriving at step s holds s+1 ranks' copies (its "
                     "sender's own copy added to what it received at step s-1); work the chunk "
                     "indices back from there, modulo N"):
        chunks = rank_tensor(r, n, c)
        with counted(exercise, grader, "ring_reduce_scatter", n - 1):
            exercise.ring_reduce_scatter(chunks, grader.group)
        grader.close(f"chunks[{r}]", chunks[r], total[r], BOUND, WHY)

    with grader.step("all-gather", "the lecture's all-gather: rank r starts with chunk r "
                     "complete and sends it first; each later step forwards the chunk it received "
                     "the step before, and the chunk arriving from r-1 lands at its own index"):
        chunks = torch.zeros(n, c, dtype=torch.float64)
        chunks[r] = total[r]
        with counted(exercise, grader, "ring_all_gather", n - 1):
            exercise.ring_all_gather(chunks, grader.group)
        for j in range(n):
            grader.close(f"chunks[{j}]", chunks[j], total[j], BOUND, WHY)

    with grader.step("all-reduce", "the lecture's all-reduce is a reduce-scatter then an "
                     "all-gather, on the tensor viewed as (N, L/N) chunks"):
        tensor = rank_tensor(r, n, c).flatten()
        with counted(exercise, grader, "ring_all_reduce", 2 * (n - 1)):
            exercise.ring_all_reduce(tensor, grader.group)
        grader.close("tensor", tensor, total.flatten(), BOUND, WHY)

    with grader.step("a length that does not split", "ring_all_reduce refuses a tensor whose "
                     "length is not a multiple of N with a ValueError, before any message"):
        try:
            exercise.ring_all_reduce(torch.zeros(n * c + 1, dtype=torch.float64), grader.group)
        except ValueError:
            return
        grader.fail(f"ring_all_reduce accepted {n * c + 1} elements on {n} ranks")
