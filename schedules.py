"""Pipeline schedules as data: which stage computes and sends what, in which order.

A pipeline of P stages runs M micro-batches a step. GPipe (Huang et al. 2019) runs every forward,
then every backward; 1F1B, PipeDream-flush (Narayanan et al. 2021, "Megatron-LM at scale",
section 2.2.1), starts backwards as soon as the last stage can, so a stage holds at most P
micro-batches of activations instead of M. Both idle (P-1)/(M+P-1) of the time when a forward
and a backward take one slot each: the bubble. Each schedule is a list of actions per stage,
checked (messages match, no deadlock under NCCL's p2p rules), simulated on a clock and drawn;
pipeline.py's executor runs any such list. Left out: interleaved stages, zero-bubble schedules.
Run: python schedules.py --stages 4 --microbatches 8 --schedule 1f1b (python pipeline.py: the same)
Test: python -m pytest tests/test_schedules.py

Shapes: P stages, M micro-batches, s stage, m micro-batch.
"""
import argparse
from typing import NamedTuple


class Action(NamedTuple):
    """One step of a stage's list: kind in F, B (compute) or send/recv of act (activations,
    forward) or grad (their gradients, backward); m: the micro-batch it concerns."""
    kind: str
    m: int


COMPUTE = ("F", "B")


def _forward(s: int, P: int, m: int) -> list[Action]:
    """Stage s's forward of micro-batch m: receive from s-1, compute, send to s+1."""
    return ([Action("recv_act", m)] if s > 0 else []) + [Action("F", m)] + (
        [Action("send_act", m)] if s < P - 1 else [])


def _backward(s: int, P: int, m: int) -> list[Action]:
    """Stage s's backward of micro-batch m: gradient from s+1, compute, send to s-1."""
    return ([Action("recv_grad", m)] if s < P - 1 else []) + [Action("B", m)] + (
        [Action("send_grad", m)] if s > 0 else [])


def _check(P: int, M: int):
    if P < 1 or M < 1:
        raise ValueError(f"a pipeline needs at least 1 stage and 1 micro-batch, got "
                         f"{P} stages and {M} micro-batches")


def gpipe(P: int, M: int) -> list[list[Action]]:
    """GPipe: all M forwards, then all M backwards, on every stage. Holds M activations."""
    _check(P, M)
    return [[a for m in range(M) for a in _forward(s, P, m)] +
            [a for m in range(M) for a in _backward(s, P, m)] for s in range(P)]


def one_f_one_b(P: int, M: int) -> list[list[Action]]:
    """1F1B: P-1-s warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards. Stage s holds at most P-s micro-batches of activations."""
    _check(P, M)
    stages = []
    for s in range(P):
        warmup = min(P - 1 - s, M)
        actions = [a for m in range(warmup) for a in _forward(s, P, m)]
        for i in range(M - warmup):                      # steady state: F(newest), B(oldest)
            actions += _forward(s, P, warmup + i) + _backward(s, P, i)
        actions += [a for m in range(M - warmup, M) for a in _backward(s, P, m)]
        stages.append(actions)
    return stages


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def check_schedule(stages: list[list[Action]], M: int):
    """Raise if the lists cannot run: a micro-batch not computed once forward and once
    backward, a backward before its forward, or a send without its matching receive."""
    P = len(stages)
    for s, actions in enumerate(stages):
        for kind in COMPUTE:
            done = sorted(a.m for a in actions if a.kind == kind)
            if done != list(range(M)):
                raise ValueError(f"stage {s} runs {kind} on micro-batches {done}, not 0..{M - 1}")
        forwarded = set()
        for a in actions:
            if a.kind == "F":
                forwarded.add(a.m)
            if a.kind == "B" and a.m not in forwarded:
                raise ValueError(f"stage {s}: backward of micro-batch {a.m} before its forward")
    for s in range(P - 1):                               # the pair of neighbours s, s+1
        for send, recv, a, b in (("send_act", "recv_act", s, s + 1), ("send_grad", "recv_grad", s + 1, s)):
            sent = [x.m for x in stages[a] if x.kind == send]
            received = [x.m for x in stages[b] if x.kind == recv]
            if sent != received:
                raise ValueError(f"stage {a} sends {send[5:]} for micro-batches {sent} but stage "
                                 f"{b} receives {received}: the messages would not match")
    run_under_nccl([nccl_program(actions) for actions in stages])


# ---- what the executor (pipeline.py) posts, and NCCL's rules for it ----------------------------
#
# NCCL runs a rank's point-to-point calls on one stream, in the order they were posted: a send
# completes only once its partner has posted the matching receive, and everything posted after
# it waits. So a receive posted early (to overlap) can block this rank's own later send that its
# peer waits for: a deadlock gloo never shows. The executor therefore posts the sends and
# receives that sit between two computations together, as one group (one batch_isend_irecv, as
# torch.distributed.pipelining does), and waits for a group before the computation after it only
# if the group receives something. nccl_program() writes that down; run_under_nccl() plays it.

def nccl_program(actions: list[Action]) -> list:
    """The executor's program for a stage's list: compute actions as they are, and each run of
    sends and receives between two computations as ("post", group) then, if the group receives,
    ("wait", group); group is a tuple of Actions."""
    program, group = [], []

    def close():
        if group:
            program.append(("post", tuple(group)))
            if any(a.kind.startswith("recv") for a in group):
                program.append(("wait", tuple(group)))
            group.clear()
    for a in actions:
        if a.kind in COMPUTE:
            close()
            program.append(a)
        else:
            group.append(a)
    close()
    return program


def run_under_nccl(programs: list[list]):
    """Play each stage's program by NCCL's rules; raise if the stages would wait forever.

    A ("post", group) queues the group on the stage's p2p stream; the stream runs its oldest
    unfinished group, and an op of it completes when the matching op (the same message, the
    other end) is in the peer's running group. ("wait", group) blocks the stage until that group
    has completed. Compute actions always proceed.
    """
    P = len(programs)

    def message(s, a):                       # (from, to, what, m): the same key at both ends
        kind = a.kind.split("_")[1]
        peer = s + 1 if a.kind in ("send_act", "recv_grad") else s - 1
        return (s, peer, kind, a.m) if a.kind.startswith("send") else (peer, s, kind, a.m)
    pc = [0] * P
    streams = [[] for _ in range(P)]         # posted groups not yet complete, oldest first
    pending = {}                             # (stage, group) -> its messages not yet through
    while True:
        moved = False
        for s in range(P):
            while pc[s] < len(programs[s]):
                item = programs[s][pc[s]]
                if isinstance(item, Action):
                    pass                     # computation never waits on the p2p stream
                elif item[0] == "post":
                    pending[s, item[1]] = {message(s, a) for a in item[1]}
                    streams[s].append(item[1])
                elif (s, item[1]) in pending:
                    break                    # ("wait", group): still on the wire
                pc[s] += 1
                moved = True
        for s in range(P):
            if not streams[s]:
                continue
            for key in list(pending[s, streams[s][0]]):
                peer = key[1] if key[0] == s else key[0]
                if streams[peer] and key in pending[peer, streams[peer][0]]:
                    pending[s, streams[s][0]].discard(key)
                    pending[peer, streams[peer][0]].discard(key)
                    moved = True
        for s in range(P):
            while streams[s] and not pending[s, streams[s][0]]:
                del pending[s, streams[s].pop(0)]
        if all(pc[s] == len(programs[s]) and not streams[s] for s in range(P)):
            return
        if not moved:
            stuck = {s: (programs[s][pc[s]] if pc[s] < len(programs[s]) else "done",
                         streams[s][0] if streams[s] else None) for s in range(P)}
            raise ValueError(f"deadlock under NCCL's p2p rules (stage: next step, oldest group "
                             f"on its stream): {stuck}")


# ---- the lecture's clock: the bubble, the memory, the timeline ---------------------------------

def simulate(stages: list[list[Action]]) -> list[list[str]]:
    """Run the lists on a clock where F and B take one slot and messages arrive at once.
    Returns one row per stage: the micro-batch computed in each slot ('F3', 'B0') or ''.
    A receive waits for its send; lists that wait on each other forever raise."""
    P = len(stages)
    position, clock = [0] * P, [0] * P                   # next action, first free slot, per stage
    arrived = {}                                         # (kind, m, to stage) -> slot it is ready
    rows = [[] for _ in range(P)]
    while any(position[s] < len(stages[s]) for s in range(P)):
        moved = False
        for s in range(P):
            while position[s] < len(stages[s]):
                a = stages[s][position[s]]
                if a.kind.startswith("recv"):
                    key = (a.kind[5:], a.m, s)
                    if key not in arrived:
                        break                            # wait for the neighbour
                    clock[s] = max(clock[s], arrived.pop(key))
                elif a.kind.startswith("send"):
                    to = s + 1 if a.kind == "send_act" else s - 1
                    arrived[(a.kind[5:], a.m, to)] = clock[s]
                else:
                    rows[s] += [""] * (clock[s] - len(rows[s])) + [f"{a.kind}{a.m}"]
                    clock[s] += 1
                position[s] += 1
                moved = True
        if not moved:
            stuck = {s: stages[s][position[s]] for s in range(P) if position[s] < len(stages[s])}
            raise ValueError(f"deadlock: every unfinished stage waits on a receive: {stuck}")
    width = max(len(r) for r in rows)
    return [r + [""] * (width - len(r)) for r in rows]


def bubble_fraction(rows: list[list[str]]) -> float:
    """Idle slots over all slots, from the first to the last busy one of the whole pipeline."""
    slots = sum(len(r) for r in rows)
    return sum(cell == "" for r in rows for cell in r) / slots


def peak_activations(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and backward has not: activations held at once."""
    held = peak = 0
    for a in actions:
        held += (a.kind == "F") - (a.kind == "B")
        peak = max(peak, held)
    return peak


def timeline(rows: list[list[str]]) -> str:
    """The lecture's picture: one line per stage, one column per slot, '.' for idle."""
    width = max(len(cell) for r in rows for cell in r)
    return "\n".join(f"stage {s} | " + " ".join((cell or ".").ljust(width) for cell in r)
                     for s, r in enumerate(rows))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Print a pipeline schedule as a timeline")
    parser.add_argument("--stages", type=int, default=4, help="P, pipeline stages")
    parser.add_argument("--microbatches", type=int, default=8, help="M, micro-batches per step")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    args = parser.parse_args(argv)
    if args.stages < 1 or args.microbatches < 1:
        parser.error(f"--stages and --microbatches must be at least 1, got {args.stages} and "
                     f"{args.microbatches}")
    P, M = args.stages, args.microbatches
    stages = SCHEDULES[args.schedule](P, M)
    check_schedule(stages, M)
    rows = simulate(stages)
    print(f"{args.schedule}, {P} stages, {M} micro-batches (F and B one slot each)\n")
    print(timeline(rows))
    print(f"\nbubble fraction {bubble_fraction(rows):.3f}, formula (P-1)/(M+P-1) = "
          f"{(P - 1) / (M + P - 1):.3f}")
    print("peak micro-batches of activations held per stage: "
          + ", ".join(str(peak_activations(a)) for a in stages))


if __name__ == "__main__":
    main()
