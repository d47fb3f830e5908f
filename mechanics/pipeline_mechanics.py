"""The pipeline's mechanics, read after pipeline.py: a schedule on two clocks, the blocks each
stage holds, and the executor's bookkeeping.

NCCL's clock: whether the stages, each playing the program pipeline.py's executor posts for its
list (pipeline.nccl_program: the sends and receives between two computations as one group) by
NCCL's point-to-point rules, can wait on each other forever (run_under_nccl). The lecture's
clock: every computation one slot, messages instant (simulate), from which the bubble (the idle
share, beside its formula), the activations a stage holds at most, and the timeline the lecture
draws (describe). The blocks of each stage (split_layers) and their placements' records
(place_stage). Then what the executor keeps beside running its list (PipelineMechanics, its
base class): the tied ends' group, the loop's interface, the bubble it measured. The step's
clock observes it from outside (StepObserver). A list is any stage's list of pipeline.Action
(kind, m, chunk): this file imports no schedule.
Test: python -m pytest tests/test_schedules.py tests/test_pipeline.py

Shapes: P stages (ranks), M micro-batches, s stage, m micro-batch; v chunks per rank, chunk c of
rank s is virtual stage c P + s.
"""
import contextlib
import time

import torch
import torch.distributed as dist

from foundations.comm import Comm
from foundations.placements import place
from foundations.process_groups import subgroups
from foundations.values import Parser, whole

COMPUTE = ("F", "B", "W")          # an Action's kinds that compute; the others send or receive


def message(s: int, a, P: int) -> tuple:
    """The message a send or receive of stage s (of P) concerns, the same key at both ends:
    (from stage, to stage, act or grad, micro-batch, the sender's virtual stage). Activations go
    to the next virtual stage, gradients to the one before; from the last rank's chunk c, the
    next is the first rank's chunk c+1: the ring."""
    vs, what = a.chunk * P + s, a.kind.split("_")[1]
    sender = vs if a.kind.startswith("send") else vs - 1 if what == "act" else vs + 1
    receiver = sender + 1 if what == "act" else sender - 1
    return sender % P, receiver % P, what, a.m, sender


def chunks_of(stages: list[list]) -> int:
    """v: the chunks per stage the lists use."""
    return 1 + max(a.chunk for actions in stages for a in actions)


BUBBLE_FORMULAS = {"gpipe": "(P-1)/(M+P-1)", "1f1b": "(P-1)/(M+P-1)",
                   "interleaved": "(P-1)/(vM+P-1)", "zb": "(P-1)/(3M+P-1)"}


def bubble_formula(name: str, P: int, M: int, v: int = 1) -> float:
    """The idle share simulate() gives when F, B and W take one slot each (1F1B's and GPipe's B,
    the whole backward, one slot too): interleaved (P-1)/(vM + P-1), ZB-H1 (P-1)/(3M + P-1)
    (for M >= P: with fewer micro-batches the W's cannot fill the drain), else (P-1)/(M + P-1)."""
    if name == "zb":
        return (P - 1) / (3 * M + P - 1)
    return (P - 1) / ((v if name == "interleaved" else 1) * M + P - 1)


# ---- NCCL's clock: the executor's programs (pipeline.nccl_program) played by NCCL's rules -----
#
# The rules are written where the program is made (pipeline.py, above nccl_program): one stream of
# point-to-point calls per rank, in posting order; the messages between two computations posted as
# one group, waited for only if it receives. run_under_nccl() plays every stage's program by them.

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
                if item[0] in COMPUTE:
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

def simulate(stages: list[list], slots: dict | None = None) -> list[list[str]]:
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


def peak_activations(actions: list) -> int:
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


def describe(name: str, stages: list[list], M: int) -> str:
    """Schedule `name`'s lists as the lecture draws them: the timeline on the clock, its bubble
    beside the formula, and the activations each stage holds at most."""
    P, v = len(stages), chunks_of(stages)
    rows = simulate(stages)
    header = (f"{name}, {P} stages, {M} micro-batches"
              + (f", {v} chunks per stage" if v > 1 else "")
              + (" (F, B: input gradient, W: weight gradient, one slot each)" if name == "zb" else
                 " (F and B one slot each" + (", per chunk)" if v > 1 else ")")))
    bubble = (f"bubble fraction {bubble_fraction(rows):.3f}, formula {BUBBLE_FORMULAS[name]} = "
              f"{bubble_formula(name, P, M, v):.3f}")
    held = (f"peak {'micro-batch chunks' if v > 1 else 'micro-batches'} of activations held "
            "per stage: " + ", ".join(str(peak_activations(a)) for a in stages))
    return f"{header}\n\n{timeline(rows)}\n\n{bubble}\n{held}"


# ---- the command line, and bad sizes in one line ------------------------------------------------

def schedule_parser(schedules: dict) -> Parser:
    """python -m extensions.schedules's options: P, M and a schedule's name."""
    parser = Parser(prog="python -m extensions.schedules",
                    description="Print a pipeline schedule as a timeline")
    parser.add_argument("--stages", type=whole, default=4, help="P, pipeline stages")
    parser.add_argument("--microbatches", type=whole, default=8, help="M, micro-batches per step")
    parser.add_argument("--schedule", choices=sorted(schedules), default="1f1b")
    return parser


def check_sizes(P: int, M: int):
    """Raise unless a pipeline has a stage and a micro-batch."""
    if P < 1 or M < 1:
        raise ValueError(f"a pipeline needs at least 1 stage and 1 micro-batch, got "
                         f"{P} stages and {M} micro-batches")


def check_layers(n_layer: int, P: int, sizes: list[int] | None, v: int = 1):
    """Raise unless n_layer blocks cut into P stages of v chunks each (split_layers):
    balanced (sizes None), every chunk needs a block; given, P v sizes of 1 or more adding up."""
    chunks = P * v
    if sizes is None and n_layer < chunks:
        raise ValueError(f"the model has {n_layer} blocks, fewer than {P} pipeline stages"
                         + (f" x {v} chunks each = {chunks} chunks" if v > 1 else "")
                         + f": every {'chunk' if v > 1 else 'stage'} needs a block; use "
                         + ("fewer --virtual-stages" if v > 1 else f"--pp {n_layer} or fewer")
                         + ", or a deeper --model")
    if sizes is not None and (len(sizes) != chunks or sum(sizes) != n_layer or min(sizes) < 1):
        raise ValueError(f"--stage-layers {','.join(map(str, sizes))}: give {chunks} numbers"
                         + (f" (--pp {P} x --virtual-stages {v} chunks)" if v > 1 else "")
                         + f", each 1 or more, adding up to the model's {n_layer} blocks")


# ---- the stages' blocks, and their placements' records ------------------------------------------

def split_layers(n_layer: int, P: int, sizes: list[int] | None = None, v: int = 1) -> list[range]:
    """The blocks of each of the P*v chunks (virtual stages; stage s holds chunks s, s + P, ...):
    `sizes` blocks each if given (--stage-layers), else balanced by count (the first n_layer % (P*v)
    take one more; the last also computes the head and loss)."""
    check_layers(n_layer, P, sizes, v)        # every chunk at least one block, all of them used
    if sizes is None:
        sizes = [n_layer // (P * v) + (c < n_layer % (P * v)) for c in range(P * v)]
    starts = [sum(sizes[:c]) for c in range(P * v)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def place_stage(stage):
    """foundations/placements.py's records for a pipeline.GPTStage's parameters: sharded along "pp",
    None (no tensor cut: each stage holds different ones, their squares add up over the stages in
    the norm); the last stage's copy of a tied weight is the first's, counted there."""
    for p in stage.parameters():
        place(p, shard={"pp": None})
    if stage.tied is not None and stage.last:
        place(stage.tied, counted=False)


# ---- the executor's mechanics: its set-up, the loop's interface, the step observed -----------

class StepObserver:
    """A pipeline step observed from outside its algorithm: when each computation ran, the
    step's busy and wall seconds, and the activations it held at most.

    The executor enters step() around a step and compute() around each computation. measure:
    on CUDA the clock first waits for this rank's computations, so the times are the device's."""

    def __init__(self):
        self.timeline = []            # (Action, start, end) per computation of the last step
        self.busy = self.wall = 0.0   # the last step's seconds computing, and in all
        self.peak_activations = 0     # micro-batch chunks held at once, at most, over training
        self.synchronize = False      # the step's measure

    @contextlib.contextmanager
    def step(self, measure: bool):
        """Around one step (training or evaluation): its wall and busy seconds, its peak."""
        self.timeline, self.synchronize = [], measure
        start = self._clock()
        yield
        self.wall = self._clock() - start
        self.busy = sum(end - began for _, began, end in self.timeline)
        if torch.is_grad_enabled():                       # evaluation keeps no activations
            computed = [a for a, _, _ in self.timeline]
            self.peak_activations = max(self.peak_activations, peak_activations(computed))

    @contextlib.contextmanager
    def compute(self, action):
        """Around one computation (F, B or W): its start and end on the timeline."""
        began = self._clock()
        yield
        self.timeline.append((action, began, self._clock()))

    def _clock(self) -> float:
        if self.synchronize and torch.cuda.is_available():
            # The compute stream only: a device-wide synchronize would also wait for the p2p
            # stream, where a send may sit until the peer posts its receive after this very
            # stage's next send (run_under_nccl lets computation run on meanwhile).
            torch.cuda.current_stream().synchronize()
        return time.perf_counter()


class PipelineMechanics:
    """What pipeline.Pipeline (this is its base class) keeps beside running its list: the tied
    ends' group, the loop's interface (called as a GPT is, eval(), train()), the bubble it
    measured, and the observer of its steps. Reads the executor's attributes: module, comm, P,
    tied and device. Built with the P stages and M micro-batches, checked before any work."""

    def __init__(self, P: int, M: int):
        check_sizes(P, M)                   # at least 1 stage and 1 micro-batch
        self.observer = StepObserver()

    def _ends_group(self, comm: Comm, device) -> Comm | None:
        """A Comm over this pipeline's first and last stage if they share a tied weight.

        Collective over the world: every rank of every pipeline (data-parallel copies) learns
        all pipelines' ends and whether any is tied, and then creates every ends group, in one
        order, as new_group requires (process_groups.subgroups). Middle stages hold no tied copy
        but create the groups too."""
        ranks = dist.get_process_group_ranks(comm.group)
        mine = torch.tensor([ranks[0], ranks[-1], self.tied is not None], device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)                             # set-up, not counted
        if not any(t[2] for t in every):
            return None
        ends = sorted({(t[0].item(), t[1].item()) for t in every})
        group = subgroups(comm, ends)
        return group if self.tied is not None else None

    def __call__(self, x, y):
        """(None, evaluate(x, y)): called as a GPT is, for the loss (no stage holds all logits)."""
        return None, self.evaluate(x, y)

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()

    def measured_bubbles(self) -> list[float]:
        """Each stage's idle share of its last step, 1 - busy / wall (collective: every stage)."""
        seconds = [self.observer.busy, self.observer.wall]
        times = torch.tensor(seconds, dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(times) for _ in range(self.P)]
        dist.all_gather(every, times, group=self.comm.group)      # a metric: not counted
        return [1 - (busy / wall).item() for busy, wall in every]
