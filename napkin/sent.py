"""What a built strategy sends per step, by the ring formula: the numbers the run's log prints beside
the bytes its Comm counted ("sent 3.34 MiB/step (ring formula 3.34)").

The concept files run the algorithm and their Comm counts what goes on the wire; the formula for
what should go is napkin math, kept here so that no step computes its own bookkeeping. Each
function reads a built wrapper's buckets, shards or stages (never runs it) and applies the
lecture's rule: a ring all-reduce sends 2(N-1)/N of a buffer, a reduce-scatter or an all-gather
(N-1)/N (collectives.ring_bytes).
Test: python -m pytest tests/test_ddp.py tests/test_zero.py tests/test_fsdp.py tests/test_pipeline.py
"""
from collectives import ring_bytes


# ---- data parallelism: ddp.py ------------------------------------------------------------------


# ---- ZeRO stages 1 and 2: zero.py -----------------------------------------------------------------

def zero_bytes_per_step(optimizer, micro_batches: int = 1) -> int:
    """Bytes a ZeRO optimizer (zero.py's, either stage) sends per step, by the ring formula.

    Each bucket's reduce-scatter and all-gather send (N-1)/N of it each: DDP's 2(N-1)/N, when
    the gradients and the parameters share one dtype. Stage 1 reduce-scatters once a step,
    stage 2 once per micro-batch. Beside them go the used-flags and the norm's one number.
    A mesh's optimizer over ZeRO parts (composition/mesh_optimizer.py, its .parts) sends the
    parts' sum, the norm counted once: it is all-reduced over the first part's group only.
    """
    parts = getattr(optimizer, "parts", [optimizer])
    norm = parts[0].masters[0].element_size()
    return sum(_zero_part_bytes(part, micro_batches) for part in parts) - sum(
        ring_bytes("all_reduce", 1, norm, part.comm.world_size) for part in parts[1:])


def _zero_part_bytes(optimizer, micro_batches: int) -> int:
    reductions, n = micro_batches if optimizer.stage == 2 else 1, optimizer.comm.world_size
    sent = optimizer.buckets.flags_and_norm_bytes()
    for bucket in optimizer.buckets:
        wire = (optimizer.reduce_dtype or bucket.flat.dtype).itemsize     # the gradients' bytes
        sent += reductions * ring_bytes("reduce_scatter", bucket.flat.numel(), wire, n)
        sent += ring_bytes("all_gather", bucket.flat.numel(), bucket.flat.element_size(), n)
    return sent



# ---- FSDP: fsdp.py and its mechanics --------------------------------------------------------------


# ---- pipeline parallelism: pipeline.py ------------------------------------------------------------


# ---- tensor and context parallelism -----------------------------------------------------------------
