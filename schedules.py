"""Pipeline schedules as data: which stage computes and sends what, in which order.

A pipeline of P stages runs M micro-batches a step. GPipe (Huang et al. 2019) runs every forward,
then every backward; 1F1B, PipeDream-flush (Narayanan et al. 2021, "Megatron-LM at scale",
section 2.2.1), starts backwards as soon as the last stage can, so a stage holds at most P
micro-batches of activations instead of M. Both idle (P-1)/(M+P-1) of the time when a forward
and a backward take one slot each: the bubble. Each schedule is a list of actions per stage,
checked (messages match, no deadlock under NCCL's p2p rules), simulated on a clock and drawn;
pipeline.py's executor runs any such list.

Two schedules shrink the bubble further. Interleaved 1F1B (PTD-P, Narayanan et al. 2021,
section 2.2.2) gives each rank v chunks of layers, r, r+P, r+2P, ...: a micro-batch goes round
the ring v times, each pass 1/v of the work, so the fill and drain last 1/v as long: bubble
(P-1)/(v M + P-1), for v times the messages. Zero bubble (ZB-H1, Qi et al. 2024, section 2.1)
splits each backward into B (the input's gradient, which the previous stage waits for) and W
(the weights' gradient, which nothing waits for) and runs the W's late, in 1F1B's idle slots:
with F, B and W one slot each the bubble is (P-1)/(3M + P-1), a third of 1F1B's, holding at
most P micro-batches per stage, 1F1B's peak. Left out: ZB-H2 and ZB-V (more memory or a V-shaped
placement for no bubble at all), interleaving combined with the B/W split.
Run: python schedules.py --stages 4 --microbatches 8 --schedule 1f1b (python pipeline.py: the same);
     --schedule interleaved --virtual-stages 2, --schedule zb
Test: python -m pytest tests/test_schedules.py

Shapes: P stages (ranks), M micro-batches, s stage, m micro-batch; interleaved: v chunks per
rank, V = P v virtual stages, chunk c of rank s is virtual stage c P + s.
"""
import argparse
from typing import NamedTuple


class Action(NamedTuple):
    """One step of a stage's list: kind in F, B, W (compute) or send/recv of act (activations,
    forward) or grad (their gradients, backward); m: the micro-batch it concerns; chunk: which
    of the rank's chunks of layers (interleaved schedules; 0 otherwise).

    B is the whole backward, unless the list also has W's (zero bubble): then B computes only
    the gradient of the chunk's input and W, later, the gradients of its weights."""
    kind: str
    m: int
    chunk: int = 0


COMPUTE = ("F", "B", "W")


def _forward(s: int, P: int, m: int, chunk: int = 0, V: int | None = None) -> list[Action]:
    """Forward of micro-batch m by chunk `chunk` of stage s, virtual stage c P + s of V (P):
    receive from the virtual stage before, compute, send to the one after."""
    vs, V = chunk * P + s, V or P
    return ([Action("recv_act", m, chunk)] if vs > 0 else []) + [Action("F", m, chunk)] + (
        [Action("send_act", m, chunk)] if vs < V - 1 else [])


def _backward(s: int, P: int, m: int, chunk: int = 0, V: int | None = None) -> list[Action]:
    """Backward of micro-batch m by chunk `chunk` of stage s: the gradient from the virtual
    stage after, compute, send to the one before."""
    vs, V = chunk * P + s, V or P
    return ([Action("recv_grad", m, chunk)] if vs < V - 1 else []) + [Action("B", m, chunk)] + (
        [Action("send_grad", m, chunk)] if vs > 0 else [])


def message(s: int, a: Action, P: int) -> tuple:
    """The message a send or receive of stage s (of P) concerns, the same key at both ends:
    (from stage, to stage, act or grad, micro-batch, the sender's virtual stage). Activations go
    to the next virtual stage, gradients to the one before; from the last rank's chunk c, the
    next is the first rank's chunk c+1: the ring."""
    vs, what = a.chunk * P + s, a.kind.split("_")[1]
    sender = vs if a.kind.startswith("send") else vs - 1 if what == "act" else vs + 1
    receiver = sender + 1 if what == "act" else sender - 1
    return sender % P, receiver % P, what, a.m, sender


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


def interleaved(P: int, M: int, v: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B, Megatron's order: v chunks per stage; the k-th forward of a stage runs
    micro-batch P (k // Pv) + k % P on chunk (k // P) % v (P micro-batches through one chunk,
    then the same P through the next), the k-th backward the same micro-batch on the chunks in
    reverse. Warm-up: 2(P-1-s) + (v-1)P forwards, then one forward and one backward in turn.
    Holds at most 2(P-1-s) + (v-1)P + 1 micro-batch chunks (each 1/v of a stage's activations)."""
    _check(P, M)
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
        actions = [a for k in range(warmup) for a in _forward(s, P, *pass_k(k, True), V)]
        for i in range(n - warmup):                      # steady state: F(newest), B(oldest)
            f = _forward(s, P, *pass_k(warmup + i, True), V)
            b = _backward(s, P, *pass_k(i, False), V)
            # As Megatron posts them: both inputs received before the pair, both results sent
            # after it, so each exchange is one group of up to four messages per pair. (Each
            # message posted beside its computation instead deadlocks under NCCL's rules at
            # P = 4, v = 2: check_schedule finds it.)
            for part in ("recv", "compute", "send"):
                actions += [a for a in f + b if (a.kind in COMPUTE if part == "compute"
                                                 else a.kind.startswith(part))]
        actions += [a for k in range(n - warmup, n) for a in _backward(s, P, *pass_k(k, False), V)]
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
    _check(P, M)
    stages = []
    for s in range(P):
        warmup, w = min(P - 1 - s, M), 0                 # w: the next W's micro-batch
        actions = [a for m in range(warmup) for a in _forward(s, P, m)]
        for i in range(M - warmup):                      # steady state: F, B, and W once s behind
            actions += _forward(s, P, warmup + i) + _backward(s, P, i)
            if i >= s:
                actions.append(Action("W", w))
                w += 1
        for m in range(M - warmup, M):
            actions += _backward(s, P, m)
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
    _check(P, M)
    return [[a for k in range(M * v) for a in _forward(s, P, *_interleaved_pass(k, P, v), P * v)]
            for s in range(P)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb": zero_bubble}


def make_schedule(name: str, P: int, M: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The lists of schedule `name`; virtual_stages: chunks per stage, interleaved only."""
    if name == "interleaved":
        return interleaved(P, M, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(f"--virtual-stages {virtual_stages}: only --schedule interleaved runs "
                         f"several chunks per stage")
    return SCHEDULES[name](P, M)


def chunks_of(stages: list[list[Action]]) -> int:
    """v: the chunks per stage the lists use."""
    return 1 + max(a.chunk for actions in stages for a in actions)


BUBBLE_FORMULAS = {"gpipe": "(P-1)/(M+P-1)", "1f1b": "(P-1)/(M+P-1)", "interleaved": "(P-1)/(vM+P-1)",
                   "zb": "(P-1)/(3M+P-1)"}


def bubble_formula(name: str, P: int, M: int, v: int = 1) -> float:
    """The idle share simulate() gives when F, B and W take one slot each (1F1B's and GPipe's B,
    the whole backward, one slot too): interleaved (P-1)/(vM + P-1), ZB-H1 (P-1)/(3M + P-1)
    (for M >= P: with fewer micro-batches the W's cannot fill the drain), else (P-1)/(M + P-1)."""
    if name == "zb":
        return (P - 1) / (3 * M + P - 1)
    return (P - 1) / ((v if name == "interleaved" else 1) * M + P - 1)


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
                (sent if a.kind.startswith("send") else received).setdefault(key[:2], []).append(key[2:])
    for a, b in sorted(sent.keys() | received.keys()):
        if sent.get((a, b), []) != received.get((a, b), []):
            raise ValueError(f"stage {a} sends (what, micro-batch, virtual stage) {sent.get((a, b), [])} "
                             f"to stage {b}, which receives {received.get((a, b), [])}: the "
                             f"messages would not match")
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
                    pending[s, item[1]] = {message(s, a, P) for a in item[1]}
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

def simulate(stages: list[list[Action]], slots: dict | None = None) -> list[list[str]]:
    """Run the lists on a clock where messages arrive at once and each computation takes
    slots[kind] slots (default one each; F, B and W of one chunk of layers).
    Returns one row per stage: what each slot computes ('F3', 'B0', 'W2'; with chunks 'F3.1':
    micro-batch 3 on chunk 1) or ''. A receive waits for its send; lists that wait on each other
    forever raise."""
    P, labelled = len(stages), chunks_of(stages) > 1
    slots = {"F": 1, "B": 1, "W": 1, **(slots or {})}
    position, clock = [0] * P, [0] * P                   # next action, first free slot, per stage
    arrived = {}                                         # message -> slot it is ready
    rows = [[] for _ in range(P)]
    while any(position[s] < len(stages[s]) for s in range(P)):
        moved = False
        for s in range(P):
            while position[s] < len(stages[s]):
                a = stages[s][position[s]]
                if a.kind.startswith("recv"):
                    key = message(s, a, P)
                    if key not in arrived:
                        break                            # wait for the neighbour
                    clock[s] = max(clock[s], arrived.pop(key))
                elif a.kind.startswith("send"):
                    arrived[message(s, a, P)] = clock[s]
                else:
                    label = f"{a.kind}{a.m}" + (f".{a.chunk}" if labelled else "")
                    rows[s] += [""] * (clock[s] - len(rows[s])) + [label] * slots[a.kind]
                    clock[s] += slots[a.kind]
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
    """Most micro-batch chunks whose forward ran and whose backward has not (its W, if the list
    splits the backward: W still needs the layers' inputs): activations held at once."""
    release = "W" if any(a.kind == "W" for a in actions) else "B"
    held = peak = 0
    for a in actions:
        held += (a.kind == "F") - (a.kind == release)
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
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="v, chunks of layers per stage (--schedule interleaved; default 2)")
    args = parser.parse_args(argv)
    if args.stages < 1 or args.microbatches < 1:
        parser.error(f"--stages and --microbatches must be at least 1, got {args.stages} and "
                     f"{args.microbatches}")
    P, M = args.stages, args.microbatches
    v = args.virtual_stages if args.virtual_stages is not None else 2 if args.schedule == "interleaved" else 1
    try:
        stages = make_schedule(args.schedule, P, M, v)
    except ValueError as e:
        parser.error(str(e))
    check_schedule(stages, M)
    rows = simulate(stages)
    split = args.schedule == "zb"
    print(f"{args.schedule}, {P} stages, {M} micro-batches"
          + (f", {v} chunks per stage" if v > 1 else "")
          + (" (F, B: input gradient, W: weight gradient, one slot each)" if split else
             " (F and B one slot each" + (", per chunk)" if v > 1 else ")")) + "\n")
    print(timeline(rows))
    print(f"\nbubble fraction {bubble_fraction(rows):.3f}, formula {BUBBLE_FORMULAS[args.schedule]} = "
          f"{bubble_formula(args.schedule, P, M, v):.3f}")
    print(f"peak {'micro-batch chunks' if v > 1 else 'micro-batches'} of activations held per stage: "
          + ", ".join(str(peak_activations(a)) for a in stages))


if __name__ == "__main__":
    main()
