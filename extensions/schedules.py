"""Pipeline schedules as data beyond pipeline.py's GPipe and 1F1B: interleaved 1F1B, zero bubble.

pipeline.py makes GPipe's and 1F1B's lists (both idle (P-1)/(M+P-1) of the time when a forward and
a backward take one slot each: the bubble). Two schedules shrink the bubble further. Interleaved
1F1B (PTD-P, Narayanan et al. 2021, section 2.2.2) gives each rank v chunks of layers, r, r+P,
r+2P, ...: a micro-batch goes round the ring v times, each pass 1/v of the work, so the fill and
drain last 1/v as long: bubble (P-1)/(v M + P-1), for v times the messages. Zero bubble (ZB-H1,
Qi et al. 2024, section 2.1) splits each backward into B (the input's gradient, which the
previous stage waits for) and W (the weights' gradient, which nothing waits for) and runs the
W's late, in 1F1B's idle slots: with F, B and W one slot each the bubble is (P-1)/(3M + P-1), a
third of 1F1B's, holding at most P micro-batches per stage, 1F1B's peak (its executor:
extensions/zero_bubble.py). Every schedule by name (make_schedule), its lists checked (messages
match, no deadlock under NCCL's p2p rules: mechanics/pipeline_mechanics.py) and its executor
(make_pipeline).
Left out: ZB-H2 and ZB-V (more memory or a V-shaped placement for no bubble at all),
interleaving combined with the B/W split.
Run: python -m extensions.schedules --stages 4 --microbatches 8 --schedule 1f1b (draws a schedule:
     gpipe and 1f1b, pipeline.py's; interleaved --virtual-stages 2; zb)
Test: python -m pytest tests/test_schedules.py

Shapes: P stages (ranks), M micro-batches, s stage, m micro-batch; interleaved: v chunks per
rank, V = P v virtual stages, chunk c of rank s is virtual stage c P + s.
"""
import torch
import torch.nn as nn

from pipeline import (Action, Pipeline, backward_actions, forward_actions, gpipe, nccl_program,
                      one_f_one_b)
from mechanics.pipeline_mechanics import (COMPUTE, check_sizes, chunks_of, describe, message,
                                          run_under_nccl, schedule_parser)
from extensions.zero_bubble import ZeroBubblePipeline
from foundations.values import whole


def interleaved(P: int, M: int, v: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B, Megatron's order: v chunks per stage; the k-th forward of a stage runs
    micro-batch P (k // Pv) + k % P on chunk (k // P) % v (P micro-batches through one chunk,
    then the same P through the next), the k-th backward the same micro-batch on the chunks in
    reverse. Warm-up: 2(P-1-s) + (v-1)P forwards, then one forward and one backward in turn.
    Holds at most 2(P-1-s) + (v-1)P + 1 micro-batch chunks (each 1/v of a stage's activations)."""
    if v < 1:
        raise ValueError(f"--virtual-stages must be at least 1, got {v}")
    if v == 1:
        return one_f_one_b(P, M)                         # one chunk per stage: plain 1F1B
    if P < 2:
        raise ValueError(f"interleaving passes micro-batches round a ring of stages: it needs at "
                         f"least 2, got {P}; use --schedule 1f1b for one stage")
    if M % P:
        raise ValueError(f"interleaved 1F1B sends micro-batches round the ring P = {P} at a time: "
                         f"{M} micro-batches is not a multiple of {P}; use --microbatches "
                         f"{-(-M // P) * P}")
    V, n = P * v, M * v                                  # virtual stages; chunk passes per stage

    def pass_k(k: int, forward: bool) -> tuple[int, int]:                    # (m, chunk)
        m, chunk = _interleaved_pass(k, P, v)
        return m, chunk if forward else v - 1 - chunk
    stages = []
    for s in range(P):
        warmup = min(n, 2 * (P - 1 - s) + (v - 1) * P)
        actions = [a for k in range(warmup) for a in forward_actions(s, P, *pass_k(k, True), V)]
        for i in range(n - warmup):                      # steady state: F(newest), B(oldest)
            f = forward_actions(s, P, *pass_k(warmup + i, True), V)
            b = backward_actions(s, P, *pass_k(i, False), V)
            # As Megatron posts them: both inputs received before the pair, both results sent
            # after it, so each exchange is one group of up to four messages per pair. (Each
            # message posted beside its computation instead deadlocks under NCCL's rules at
            # P = 4, v = 2: check_schedule finds it.)
            for part in ("recv", "compute", "send"):
                actions += [a for a in f + b if (a.kind in COMPUTE if part == "compute"
                                                 else a.kind.startswith(part))]
        actions += [a for k in range(n - warmup, n)
                    for a in backward_actions(s, P, *pass_k(k, False), V)]
        stages.append(actions)
    return stages


def _interleaved_pass(k: int, P: int, v: int) -> tuple[int, int]:
    """(micro-batch, chunk) of a stage's k-th forward in Megatron's interleaved order: P
    micro-batches through chunk 0, the same P through chunk 1, ..., then the next P."""
    return k // (P * v) * P + k % P, (k // P) % v


def zero_bubble(P: int, M: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's forwards and B's (input gradients only), each W (weight gradients) run as
    late as the memory allows. A micro-batch is held from its F to its W; stage s delays its W's
    by s micro-batches, so every stage holds P, the most 1F1B holds (on stage 0), and the last
    stages, idle at the end under 1F1B, fill that time with their delayed W's. In the drain each
    B is followed by one W while W's remain."""
    stages = []
    for s in range(P):
        warmup, w = min(P - 1 - s, M), 0                 # w: the next W's micro-batch
        actions = [a for m in range(warmup) for a in forward_actions(s, P, m)]
        for i in range(M - warmup):                      # steady state: F, B, and W once s behind
            actions += forward_actions(s, P, warmup + i) + backward_actions(s, P, i)
            if i >= s:
                actions.append(Action("W", w))
                w += 1
        for m in range(M - warmup, M):
            actions += backward_actions(s, P, m)
            if w < M:
                actions.append(Action("W", w))
                w += 1
        actions += [Action("W", m) for m in range(w, M)]
        stages.append(actions)
    return stages


def forwards_only(P: int, M: int, v: int = 1) -> list[list[Action]]:
    """Evaluation: the forwards alone, in GPipe's order (interleaved: Megatron's order, P at a
    time round the ring; all M through chunk 0 first would deadlock under NCCL, the last stage
    sending chunk 0's outputs to a first stage still blocked sending its own)."""
    return [[a for k in range(M * v)
             for a in forward_actions(s, P, *_interleaved_pass(k, P, v), P * v)]
            for s in range(P)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb": zero_bubble}


def make_schedule(name: str, P: int, M: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The lists of schedule `name`; virtual_stages: chunks per stage, interleaved only. Raises on
    sizes no schedule can run, naming the fix."""
    check_sizes(P, M)
    if name == "interleaved":
        return interleaved(P, M, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(f"--virtual-stages {virtual_stages}: only --schedule interleaved runs "
                         f"several chunks per stage")
    return SCHEDULES[name](P, M)


def check_schedule(stages: list[list[Action]], M: int):
    """Raise if the lists cannot run: a chunk's micro-batch not computed once forward and once
    backward (and once W, if the lists split the backward), a backward before its forward, a
    W before its B, or a send without its matching receive (between two stages the messages
    must be received in the order they are sent: NCCL matches them by order alone)."""
    P, v = len(stages), chunks_of(stages)
    split = any(a.kind == "W" for actions in stages for a in actions)
    for s, actions in enumerate(stages):
        for chunk in range(v):
            for kind in COMPUTE if split else ("F", "B"):
                done = sorted(a.m for a in actions if a.kind == kind and a.chunk == chunk)
                if done != list(range(M)):
                    raise ValueError(f"stage {s} runs {kind} on micro-batches {done} of chunk "
                                     f"{chunk}, not 0..{M - 1}")
        ran = set()
        for a in actions:
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and (before, a.m, a.chunk) not in ran:
                raise ValueError(f"stage {s}: {a.kind} of micro-batch {a.m} (chunk {a.chunk}) "
                                 f"before its {before}")
            ran.add((a.kind, a.m, a.chunk))
    sent, received = {}, {}                   # (from stage, to stage) -> messages, in list order
    for s, actions in enumerate(stages):
        for a in actions:
            if a.kind not in COMPUTE:
                key = message(s, a, P)
                ends = sent if a.kind.startswith("send") else received
                ends.setdefault(key[:2], []).append(key[2:])
    for a, b in sorted(sent.keys() | received.keys()):
        if sent.get((a, b), []) != received.get((a, b), []):
            raise ValueError(f"stage {a} sends (what, micro-batch, virtual stage) "
                             f"{sent.get((a, b), [])} to stage {b}, which receives "
                             f"{received.get((a, b), [])}: the messages would not match")
    run_under_nccl([nccl_program(actions) for actions in stages])


def make_pipeline(module: nn.Module, comm, schedule: str, microbatches: int, activation,
                  dtype: torch.dtype) -> Pipeline:
    """The executor of schedule `schedule`, by name, for this stage (pipeline.Pipeline's
    arguments; zero bubble's runs its W's: zero_bubble.ZeroBubblePipeline). The lists, and the
    evaluation's, are checked first (NCCL's rules included); v: the stage's chunks."""
    P, v = comm.world_size, len(getattr(module, "module", module).chunks)
    stages = make_schedule(schedule, P, microbatches, v)
    check_schedule(stages, microbatches)
    run_under_nccl([nccl_program(actions) for actions in forwards_only(P, microbatches, v)])
    executor = ZeroBubblePipeline if schedule == "zb" else Pipeline
    return executor(module, comm, stages, microbatches, activation, dtype)


def main(argv=None):
    parser = schedule_parser(SCHEDULES)
    parser.add_argument("--virtual-stages", type=whole, default=None,
                        help="v, chunks of layers per stage (--schedule interleaved; default 2)")
    args = parser.parse_args(argv)
    if args.stages < 1 or args.microbatches < 1:
        parser.error(f"--stages and --microbatches must be at least 1, got {args.stages} and "
                     f"{args.microbatches}")
    P, M = args.stages, args.microbatches
    default_v = 2 if args.schedule == "interleaved" else 1
    v = args.virtual_stages if args.virtual_stages is not None else default_v
    try:
        stages = make_schedule(args.schedule, P, M, v)
    except ValueError as e:
        parser.error(str(e))
    check_schedule(stages, M)
    print(describe(args.schedule, stages, M))

if __name__ == "__main__":
    main()
