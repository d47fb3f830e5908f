"""What a built strategy sends per step, by the ring formula: the numbers the run's log prints beside
the bytes its Comm counted ("sent 3.34 MiB/step (ring formula 3.34)").

The concept files run the algorithm and their Comm counts what goes on the wire; the formula for
what should go is napkin math, kept here so that no step computes its own bookkeeping. Each
function reads a built wrapper's buckets, shards or stages (never runs it) and applies the
lecture's rule: a ring all-reduce sends 2(N-1)/N of a buffer, a reduce-scatter or an all-gather
(N-1)/N (foundations/comm.py: ring_bytes).
Test: python -m pytest tests/test_ddp.py tests/test_zero.py tests/test_fsdp.py tests/test_pipeline.py
"""


# ---- data parallelism: ddp.py ------------------------------------------------------------------


# ---- ZeRO stages 1 and 2: zero.py -----------------------------------------------------------------


# ---- FSDP: fsdp.py and its mechanics --------------------------------------------------------------


# ---- pipeline parallelism: pipeline.py ------------------------------------------------------------


# ---- tensor and context parallelism -----------------------------------------------------------------
