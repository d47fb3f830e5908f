"""Exercise: the ring's collectives from point-to-point messages (the solution: collectives.py).

Write the three functions below with one ring step's messages (given, from collectives.py):
- send_right_receive_left(send, recv, group): sends the tensor `send` to rank r + 1 while the
  tensor `recv` (same shape, written in place) receives rank r - 1's; returns None. Both go at
  once, so every rank can call it at the same time without a deadlock.
- dist.get_world_size(group), dist.get_rank(group): N and r in the group.
- log: optional, a function taking one line of text; you may ignore it (or call it per step).
Each rank's tensor is cut into N chunks; rank r sends to r + 1 and receives from r - 1.
- reduce-scatter: N-1 steps; at each, a rank sends one chunk right and adds the chunk arriving
  from the left to its own copy of it, so that after the last step chunk r on rank r is the sum
  of every rank's chunk r.
- all-gather: N-1 more steps; each rank forwards the finished chunk it last got (its own first),
  and the one arriving lands in place, until every rank holds every chunk.
- all-reduce: the two in a row, on the tensor seen as (N, L/N).
Check: python -m exercises check collectives (on 3 ranks: with 2, some wrong chunk indices still
give the right sums).

Shapes: N ranks in the group, r this rank, L elements in the tensor, c = L / N per chunk.
"""
import torch
import torch.distributed as dist

from collectives import send_right_receive_left


def ring_reduce_scatter(chunks: torch.Tensor, group=None, log=None):
    """chunks (N, c), this rank's tensor, reduced in place.

    Afterwards chunks[r] is the sum of every rank's chunk r; the other chunks hold partial sums.
    log(line): called at each step."""
    # TODO: n, r from the group; a (c,) buffer for the arriving chunk; N-1 steps, each sending
    # one chunk right and adding the one that arrives into this rank's chunk of the same index.
    # Which chunk at step s? The last step must leave chunk r complete on rank r.
    raise NotImplementedError


def ring_all_gather(chunks: torch.Tensor, group=None, log=None):
    """chunks (N, c), with rank r's chunk in chunks[r]: afterwards every rank holds every chunk."""
    # TODO: N-1 steps; step 0 sends chunk r (the one this rank has complete), each later step
    # forwards the chunk just received; the arriving chunk is received straight into its place.
    raise NotImplementedError


def ring_all_reduce(tensor: torch.Tensor, group=None, log=None):
    """tensor (L,) contiguous, L a multiple of N, summed over the ranks in place: all-reduce =
    reduce-scatter + all-gather. Each rank sends 2(N-1) chunks of L/N: 2(N-1)/N of the tensor."""
    # TODO: refuse an L that does not split into N chunks (a ValueError), view the tensor as
    # (N, L/N) chunks, then the two collectives above.
    raise NotImplementedError
