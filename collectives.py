"""Collectives: how ranks combine tensors, built from point-to-point messages on a ring.

Every strategy here is a choice of which rank holds which bytes and which collective moves them.
The lecture names the three collectives; this file is the ring algorithm NCCL runs for them on
large messages (Patarasuk & Yuan, 2009), written plainly. The lecture draws all-reduce as gather
on one rank, then send back out; the ring gets the same result with every rank sending the same
amount at every step, so no one rank's link is the bottleneck.
A reduce-scatter takes N-1 steps, each rank sending one chunk of L/N per step.
An all-gather takes N-1 more.
An all-reduce is the two in a row, so each rank sends 2(N-1)/N of the tensor: under twice the
tensor however many ranks there are. The lecture's 2 bytes per parameter is the bf16 gradient;
the ring sends it about twice, and ZeRO's reduce-scatter plus all-gather send the same, which is
why the lecture calls ZeRO-1 free.
Time: 2(N-1) steps each pay a message's latency, plus 2(N-1)/N of the bytes over the link's
bandwidth; the latency term grows with N, which is why small messages use trees (left out).
The strategies call foundations/comm.py's Comm, which counts the bytes: it runs torch.distributed's
own collectives, or with ring=True its own segmented copy of these steps (not these functions).
Run: torchrun --nproc_per_node 2 collectives.py. Test: python -m pytest tests/test_collectives.py

Shapes: N ranks in the group, r this rank, L elements in the tensor, c = L / N per chunk;
rank r's neighbours: r - 1 (left), r + 1 (right), modulo N.
"""
import os

import torch
import torch.distributed as dist

from foundations.alone import start_alone
from foundations.comm import ring_bytes

# ---- The ring: N-1 steps, one message per step and rank ------------------------------------
#
#   rank 0 -> rank 1 -> ... -> rank N-1 -> rank 0        each rank's tensor cut into N chunks
#   reduce-scatter, N = 3: at step s rank r sends chunk r-1-s right, adds chunk r-2-s from the left
#                  rank 0          rank 1          rank 2
#     step 0    sends chunk 2   sends chunk 0   sends chunk 1     (its own copy)
#     step 1    sends chunk 1   sends chunk 2   sends chunk 0     (a sum of 2 ranks' copies)
#     then      holds chunk 0   holds chunk 1   holds chunk 2     (the sum of all 3)
#   all-gather: N-1 more steps, each finished chunk forwarded N-1 hops until every rank has it.


def send_right_receive_left(send: torch.Tensor, recv: torch.Tensor, group=None):
    """One ring step's messages: `send` goes to rank r+1 while `recv` arrives from rank r-1."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    # Posted together: a blocking send on every rank would wait for a receive no rank has posted.
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, group=group, group_peer=(r + 1) % n),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(r - 1) % n)])
    for work in works:                        # NCCL returns one work for the batch, gloo one each
        work.wait()
    # Why one batch, even on NCCL: a rank's p2p calls run in order on one stream, so a separate
    # isend then irecv can hang: rank r's send waits for rank r+1's receive, queued behind rank
    # r+1's own send, which waits for rank r+2, and so on round the ring back to r.


def ring_reduce_scatter(chunks: torch.Tensor, group=None, log=None):
    """chunks (N, c), this rank's tensor, reduced in place.

    Afterwards chunks[r] is the sum of every rank's chunk r; the other chunks hold partial sums.
    log(line): called at each step."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    arrived = torch.empty_like(chunks[0])                  # (c,)
    for step in range(n - 1):
        # The arriving chunk holds step+1 ranks' copies summed; this rank adds its own copy of
        # that chunk to it. At the last step, N-2, the chunk arriving is chunk r, now complete.
        sent, received = (r - 1 - step) % n, (r - 2 - step) % n
        if log:
            log(f"reduce-scatter step {step}: rank {r} sends chunk {sent} to rank {(r + 1) % n}, "
                f"receives chunk {received} from rank {(r - 1) % n}, adds it to its own")
        send_right_receive_left(chunks[sent], arrived, group)
        chunks[received] += arrived


def ring_all_gather(chunks: torch.Tensor, group=None, log=None):
    """chunks (N, c), with rank r's chunk in chunks[r]: afterwards every rank holds every chunk."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    for step in range(n - 1):
        # Forward chunk r-step (its own, then the one just received); chunk r-1-step lands in place.
        # Step 0 sends chunk r, the one the reduce-scatter left complete on rank r.
        # N = 3, rank 0: step 0 sends chunk 0, receives 2; step 1 sends 2, receives 1.
        sent, received = (r - step) % n, (r - 1 - step) % n
        if log:
            log(f"all-gather step {step}: rank {r} sends chunk {sent} to rank {(r + 1) % n}, "
                f"receives chunk {received} from rank {(r - 1) % n} into place")
        send_right_receive_left(chunks[sent], chunks[received], group)


def ring_all_reduce(tensor: torch.Tensor, group=None, log=None):
    """tensor (L,) contiguous, L a multiple of N, summed over the ranks in place: all-reduce =
    reduce-scatter + all-gather. Each rank sends 2(N-1) chunks of L/N: 2(N-1)/N of the tensor."""
    n = dist.get_world_size(group)
    if tensor.numel() % n:
        raise ValueError(f"ring_all_reduce: {tensor.numel()} elements do not split into N={n} "
                         f"equal chunks: pad the tensor to a multiple of N "
                         f"(foundations/comm.py's Comm.all_reduce pads itself)")
    chunks = tensor.view(n, -1)                            # (N, c)
    ring_reduce_scatter(chunks, group, log)
    ring_all_gather(chunks, group, log)


def _demonstrate():
    """The plain ring's steps as they happen, then its all-reduce checked against one process
    (every rank's tensor remade here from its seed, summed) and torch.distributed's all_reduce."""
    dist.init_process_group("gloo")
    n, r = dist.get_world_size(), dist.get_rank()
    every = [torch.randn(n * 3, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
             for i in range(n)]                            # each rank's (N*3,) tensor, by its seed
    ours, native = every[r].clone(), every[r].clone()
    ring_all_reduce(ours, log=lambda line: print(line, flush=True))
    dist.all_reduce(native)
    worst = torch.stack([(ours - sum(every)).abs().max(), (ours - native).abs().max()])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)           # (2,): the largest on any rank
    bound = 1e-12                                          # fp64 sums of N terms, in another order
    if r == 0:
        print(f"ring all-reduce of ({n * 3},) fp64 on {n} ranks, each sending 2(N-1)/N of it "
              f"({ring_bytes('all_reduce', n * 3, 8, n)} bytes):\n"
              f"  max |difference| from one process: "
              f"{worst[0]:.1e} (bound {bound:g}: fp64 sums in another order)\n"
              f"  max |difference| from torch.distributed.all_reduce: {worst[1]:.1e}", flush=True)
    dist.destroy_process_group()
    # Exit at once: gloo's threads may still hold tensors at interpreter shutdown
    # (foundations/world.py's exit_distributed says more).
    os._exit(0 if worst.max() <= bound else 1)


if __name__ == "__main__":
    start_alone(torchrun=True)
    _demonstrate()
