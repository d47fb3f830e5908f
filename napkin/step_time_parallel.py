"""napkin/step_time_parallel.py: napkin/step_time.py's napkin for the splits inside a block, under DDP.

Expert parallelism (moe.py): each rank computes its own tokens with the active experts (top_k
per token: flops.step_flops), sends them to their experts' ranks and back by four
all-to-alls per MoE layer, and all-reduces the gradients: the shared parameters over the world,
each expert's over the ranks holding it. Context parallelism (context_parallel.py): each rank
computes 1/cp of every sequence's tokens, its queries against the whole sequence's keys, and
meets the other ranks' keys by a ring of K/V passes or one all-gather per layer; then DDP's
all-reduce. A collective = messages x latency + bytes sent / bandwidth
(machines.collective_seconds). On `this`, a cp rank's compute goes at the rate measured for
the block it runs, its attention the ring's or the all-gather's (machines.rank_block).
Test: python -m pytest tests/test_step_time.py

Shapes: L layers, C width, T sequence, E experts, k top_k, ep ranks an MoE layer's experts are
split over, cp ranks a sequence is split over, B rows a cp rank reads (the batch / (world / cp)).
"""
from context_parallel import cp_kv_bytes
from napkin.flops import Shape
from napkin.machines import Link, Machine, collective_seconds, overlapped
from napkin.memory_math import _element_size
from moe import layer_exchange_bytes


def all_to_all_seconds(shape: Shape, tokens: int, ep: int, size: int, link: Link) -> float:
    """Seconds of every MoE layer's four all-to-alls (dispatch and combine in forward, their
    mirrors in backward) on a rank's `tokens` tokens: 4 L (ep-1) messages (one to each other
    rank of the group) and moe.layer_exchange_bytes each layer ((ep-1)/ep of the rows the router
    dispatched: capacity mode the E x groups x K slots, dropless k x tokens, as memory.
    moe_exchange_bytes counts them). All of it exposed: each sits between the router and the
    expert matmuls that wait for its rows (the combine, between them and the residual)."""
    if ep == 1 or not shape.experts:
        return 0.0
    nbytes = shape.layers * layer_exchange_bytes(
        tokens, shape.width, shape.experts, shape.top_k, shape.capacity_factor,
        shape.routing_group, ep, size)
    return link.seconds(nbytes, 4 * shape.layers * (ep - 1))


def expert_gradient_seconds(shape: Shape, world: int, ep: int, size: int, link: Link, bucket: int,
                            backward: float) -> tuple[float, float]:
    """(seconds, exposed) of DDP's all-reduce with the experts split over ep: the shared
    parameters (attention, routers, embeddings, head) over the world, a rank's E/ep experts over
    the world/ep ranks holding the same ones (none when ep = world), each in buckets of its own
    that hide under backward (the experts' under what the shared ones leave of it); and the
    clip's norm, one fp32 all-reduce over ep (the experts' squares add up over the group)."""
    experts = shape.expert_matrices(shape.experts // ep)
    shared = shape.held_params(ep) - experts
    total, exposed = overlapped("all_reduce", shared, size, world, link, bucket, backward)
    rest, rest_exposed = overlapped("all_reduce", experts, size, world // ep, link, bucket,
                                    max(0.0, backward - total))
    norm = collective_seconds("all_reduce", 1, 4, ep, link)
    return total + rest + norm, exposed + rest_exposed + norm


def kv_seconds(shape: Shape, rows: int, seq_len: int, cp: int, attention: str, size: int,
               link: Link) -> dict:
    """Seconds of every layer's K/V exchange on a cp rank of `rows` rows, {forward, backward}.
    A rank's K and V: kv = 2 (T/cp) B kv_heads D values (context_parallel.cp_kv_bytes'
    volumes). ring: forward cp-1 passes of one kv block, one message each; backward cp-1 passes
    of the block again and cp-1 of its dK, dV (fp32, or wider: they add up over the ranks), one
    message each. allgather: forward the all-gather of the cp blocks, backward the
    reduce-scatter of their gradients, cp-1 ring steps each."""
    hidden = shape.kv_heads * shape.D
    if attention == "allgather":
        kv = 2 * (seq_len // cp) * rows * hidden
        return {phase: shape.layers * collective_seconds(kind, cp * kv, size, cp, link)
                for phase, kind in (("forward", "all_gather"), ("backward", "reduce_scatter"))}
    volume = cp_kv_bytes(seq_len, rows, hidden, cp, "ring", size)
    return {"forward": shape.layers * link.seconds(volume["forward"], cp - 1),
            "backward": shape.layers * link.seconds(volume["backward"], 2 * (cp - 1))}


def attention_seconds(shape: Shape, tokens: int, seq_len: int, rate: float) -> dict:
    """A rank's seconds in attention's scores and weighted sum, {forward, backward}: its tokens'
    queries against the whole sequence's keys, 4 T H D per query and layer (flops.block_flops'
    count), backward twice forward."""
    forward = tokens * shape.layers * 4 * seq_len * shape.heads * shape.D / rate
    return {"forward": forward, "backward": 2 * forward}


def exposed_kv(kv: dict, attention: str, computing: dict, overlaps: bool) -> float:
    """What of the K/V exchange attention's compute does not hide. The ring posts each pass
    before computing the block it holds and waits for it after (context_parallel.RingAttention),
    so on a GPU (NCCL's stream beside the compute's) a pass hides under that attention compute,
    in each phase; the all-gather's K/V is needed before attention starts: all exposed. On a CPU
    (machine.overlaps False) gloo's thread takes the compute's cores: nothing hides."""
    if attention == "allgather" or not overlaps:
        return kv["forward"] + kv["backward"]
    return sum(max(0.0, kv[phase] - computing[phase]) for phase in ("forward", "backward"))


def inside_blocks(step, machine: Machine, compute: dict, tokens: int) -> dict:
    """step_time.predict's communication parts for `step` (a step_time.Step: ddp, ep or cp > 1):
    "communication" and "exposed", DDP's gradient all-reduce (plus the clip's norm at ep > 1);
    "all_to_all", the experts' exchanges; "kv_exchange", the exposed K/V exchange. compute: this
    rank's forward and backward seconds (step_time._compute: its tokens, the active experts'
    FLOPs)."""
    s, N = step.shape, step.world
    if step.strategy != "ddp" or step.ep > 1 and step.cp > 1 or N % max(step.ep, step.cp):
        raise ValueError(f"ep {step.ep}, cp {step.cp} over {N} ranks: priced under --strategy ddp, "
                         f"one of them, dividing the world")
    size, link = _element_size(step.precision), machine.link(N)
    bucket = int(step.bucket_mb * 2**20) // size
    if step.ep > 1:
        seconds, exposed = expert_gradient_seconds(s, N, step.ep, size, link, bucket,
                                                   compute["backward"])
        return {"communication": seconds, "exposed": exposed,
                "all_to_all": all_to_all_seconds(s, tokens, step.ep, size, machine.link(step.ep))}
    if step.attention not in ("ring", "allgather"):
        raise ValueError(f"cp attention {step.attention!r}: ring or allgather")
    seconds, exposed = overlapped("all_reduce", s.params(), size, N, link, bucket,
                                  compute["backward"])
    rows = step.batch * step.cp // N                                 # a cp rank reads B rows
    kv = kv_seconds(s, rows, step.seq_len, step.cp, step.attention, size, machine.link(step.cp))
    computing = attention_seconds(s, tokens, step.seq_len, machine.flops[step.precision])
    return {"communication": seconds, "exposed": exposed,
            "kv_exchange": exposed_kv(kv, step.attention, computing, machine.overlaps)}
