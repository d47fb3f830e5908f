"""pictures/draw.py: the lecture's and the talk's pictures, drawn from runs of this code (SVG files).

Three pictures, each from what a run records (pictures/traces.py) and drawn with pictures/svg.py:
  loss      the loss curve of one run or of several side by side, from their log.txt
  schedule  a pipeline's executed schedule (each stage's F, B and W on one clock) above the
            same schedule on extensions/schedules.py's clock, where every action takes one slot
  memory    bytes one rank holds over one training step (parameters, gradients, optimizer
            state, activations), single, ddp, zero1, zero2 and fsdp side by side on one scale,
            with napkin/memory.py's napkin math dashed over them
schedule and memory start their own ranks (gloo on the CPU, one thread each; NCCL on GPUs when
there are enough); loss reads directories train.py --out wrote.
Run: python -m pictures loss runs/single runs/fsdp -o docs/loss_fsdp_vs_single.svg
     python -m pictures schedule --schedule 1f1b --stages 2 --microbatches 4 -o docs/pipeline_executed.svg
     python -m pictures memory -o docs/memory_over_a_step.svg
Test: python -m pytest tests/test_pictures.py tests/test_writes.py
"""
import os
import sys

from pictures import traces
from mechanics.pipeline_mechanics import simulate
from extensions.schedules import SCHEDULES, make_schedule
from running.snapshot import unwritable_file, write_whole
from foundations.values import Parser, count, real, whole
from pictures.svg import PALETTE, Axes, Canvas, line_chart, nice_ticks

MiB = 2**20
# Stacked from the bottom: the constant optimizer state first, so the others' shapes read.
STACK = ("optimizer", "params", "grads", "activations")
COLORS = {"optimizer": "#999999", "params": PALETTE[0], "grads": PALETTE[1], "activations": PALETTE[2],
          "F": PALETTE[0], "B": PALETTE[1], "W": PALETTE[2]}
NAMES = {"optimizer": "optimizer state", "params": "parameters", "grads": "gradients",
         "activations": "activations saved for backward"}


# ---- the loss ----------------------------------------------------------------------------------

def draw_loss(runs: list[tuple[str, dict]]) -> str:
    """runs: (label, {step: loss}); one line each, every other one dashed (equal runs overlap)."""
    series = [{"label": label, "x": list(losses), "y": list(losses.values()),
               "dash": "6 4" if i % 2 else None} for i, (label, losses) in enumerate(runs)]
    return line_chart(series, "training loss", "step", "loss (mean over the global batch)")


# ---- the pipeline schedule ---------------------------------------------------------------------

def draw_schedule(executed: dict) -> str:
    """The executed rows (traces.executed_schedule) above schedules.simulate's for the same
    schedule, one row per stage; a bar per compute action, labelled F3 (micro-batch 3; with
    chunks F3.1: on chunk 1)."""
    P, M, v = executed["stages"], executed["microbatches"], executed["virtual_stages"]
    simulated = simulate(make_schedule(executed["schedule"], P, M, v))
    width, height = 900, 80 * P + 270
    c = Canvas(width, height)
    end = max(t1 for row in executed["rows"] for *_, t1 in row) * 1e3
    top = Axes(c, (90, 50, width - 120, 40 * P), (0, end), (0, 1), yticks=[0, 1])
    top.frame(f"{executed['schedule']}, {P} stages, {M} micro-batches: as it ran",
              "milliseconds from the step's start (every stage leaves one barrier)", show_y=False)
    for s, row in enumerate(executed["rows"]):
        c.text(top.left - 8, top.top + 40 * s + 24, f"stage {s}", size=11, anchor="end")
        for kind, m, chunk, t0, t1 in row:
            top.bar(s, P, t0 * 1e3, t1 * 1e3, COLORS[kind], _label(kind, m, chunk, v))
    slots = len(simulated[0])
    low = Axes(c, (90, top.top + top.h + 110, width - 120, 40 * P), (0, slots), (0, 1), yticks=[0, 1])
    low.frame("on schedules.py's clock: F, B and W one slot each, messages instant",
              "slot", xticks=list(range(0, slots + 1, max(1, slots // 12))), show_y=False)
    for s, row in enumerate(simulated):
        c.text(low.left - 8, low.top + 40 * s + 24, f"stage {s}", size=11, anchor="end")
        for slot, cell in enumerate(row):
            if cell:
                low.bar(s, P, slot, slot + 1, COLORS[cell[0]], cell)
    kinds = sorted({kind for row in executed["rows"] for kind, *_ in row}, key="FBW".index)
    names = {"F": "F: forward", "B": "B: backward" if "W" not in kinds else "B: the input's gradient",
             "W": "W: the weights' gradient"}
    c.legend(low.left, low.top + low.h + 56, [(names[k], COLORS[k], None, "box") for k in kinds])
    return c.svg()


def _label(kind: str, m: int, chunk: int, v: int) -> str:
    return f"{kind}{m}" + (f".{chunk}" if v > 1 else "")


# ---- memory over a step ------------------------------------------------------------------------

def draw_memory(panels: list[dict]) -> str:
    """One panel per strategy (traces.memory_over_a_step), one y scale: the categories stacked
    over the step's events, napkin/memory.py's prediction of each band's top dashed, and on a GPU the
    allocator's bytes as a black line."""
    panel_w, panel_h, left = 230, 300, 70
    c = Canvas(left + len(panels) * (panel_w + 20) + 10, panel_h + 200)
    tops = [_cumulative(p["predicted"])[-1] for p in panels]
    tops += [sum(r[k] for k in STACK) for p in panels for r in p["samples"]]
    tops += [r.get("allocated", 0) for p in panels for r in p["samples"]]
    yticks = nice_ticks(0, max(tops) / MiB)
    for i, panel in enumerate(panels):
        samples = panel["samples"]
        xs = list(range(len(samples)))
        ax = Axes(c, (left + i * (panel_w + 20), 50, panel_w, panel_h), (0, len(xs) - 1),
                  (0, yticks[-1]), yticks)
        ranks = panel["world_size"]
        ax.frame(f"{panel['strategy']}" + (f" (rank 0 of {ranks})" if ranks > 1 else ""),
                 "events of one step", "MiB held" if i == 0 else "", show_y=i == 0)
        ax.stacked(xs, {k: [r[k] / MiB for r in samples] for k in STACK}, COLORS)
        for k, level in zip(STACK, _cumulative(panel["predicted"])):
            ax.plot([xs[0], xs[-1]], [level / MiB] * 2, COLORS[k], f"predicted {k}", "5 3", 1.2)
        if "allocated" in samples[0]:
            ax.plot(xs, [r["allocated"] / MiB for r in samples], "#000", "cuda allocated")
        _phases(ax, [r["event"] for r in samples])
    c.legend(left, panel_h + 110, [(NAMES[k], COLORS[k], None, "box") for k in reversed(STACK)])
    c.legend(left + 300, panel_h + 110, [("memory.py's napkin math, each band's top (dashed)",
                                          "#555", "5 3", "line"),
                                         ("torch.cuda.memory_allocated() (GPU runs)", "#000", None, "line")])
    return c.svg()


def _cumulative(predicted: dict) -> list[float]:
    """Each band's predicted top, in STACK's order: the running sum."""
    levels, total = [], 0
    for k in STACK:
        total += predicted[k]
        levels.append(total)
    return levels


def _phases(ax: Axes, events: list[str]):
    """Dotted lines where forward ends (the loss) and backward ends, and the phases named."""
    marks = [0, events.index("loss"), events.index("backward done"), len(events) - 1]
    for x in marks[1:3]:
        ax.canvas.line(ax.x(x), ax.top, ax.x(x), ax.top + ax.h, "#333", 0.8, "2 2")
    for (a, b), name in zip(zip(marks, marks[1:]), ("forward", "backward", "step")):
        ax.canvas.text(ax.x((a + b) / 2), ax.top + 12, name, size=10, anchor="middle", color="#333")


# ---- the command line --------------------------------------------------------------------------

TINY_BLOCKS, MEMORY_BATCH = 4, 8          # model.py's tiny preset; its rows per step here
MEMORY_FLAGS = ["--model", "tiny", "--batch-size", str(MEMORY_BATCH), "--seq-len", "64"]


def parse_args(argv=None):
    p = Parser(prog="python -m pictures", description="Draw the lecture's pictures from runs (SVG)")
    sub = p.add_subparsers(dest="picture", required=True)
    loss = sub.add_parser("loss", help="loss curves from the log.txt of train.py --out directories")
    loss.add_argument("runs", nargs="+", metavar="RUN_DIR")
    pipe = sub.add_parser("schedule", help="a pipeline step as it ran, beside schedules.py's clock")
    pipe.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    pipe.add_argument("--stages", type=whole, default=2, help="P: ranks started, one stage each")
    pipe.add_argument("--microbatches", type=count(1), default=4)
    pipe.add_argument("--virtual-stages", type=whole, default=None, help="--schedule interleaved")
    memory = sub.add_parser("memory", help="bytes held over one step, strategy by strategy")
    memory.add_argument("--strategies", default="single,ddp,zero1,zero2,fsdp")
    memory.add_argument("--ranks", type=count(1, MEMORY_BATCH), default=2,
                        help="ranks for every strategy but single")
    memory.add_argument("--bucket-mb", type=real(0, above=True), default=0.25,
                        help="gradient buckets (small, so that the tiny model has several)")
    for command in (loss, pipe, memory):
        command.add_argument("-o", "--out", required=True, help="the .svg file to write")
    return p.parse_args(argv), p


def picture(args) -> str:
    """The SVG text the command line asks for."""
    if args.picture == "loss":
        return draw_loss([(traces.run_label(d), traces.logged_losses(d)) for d in args.runs])
    if args.picture == "schedule":
        flags = ["--pp", str(args.stages), "--microbatches", str(args.microbatches), "--schedule",
                 args.schedule, "--batch-size", str(2 * args.microbatches), "--seq-len", "64",
                 *(["--virtual-stages", str(args.virtual_stages)] if args.virtual_stages is not None else [])]
        print(f"running {args.schedule} on {args.stages} ranks ...", file=sys.stderr, flush=True)
        return draw_schedule(traces.spawn(traces.executed_schedule, args.stages, flags))
    flags = [*MEMORY_FLAGS, "--bucket-mb", str(args.bucket_mb)]
    strategies, panels = args.strategies.split(","), []
    for i, s in enumerate(strategies, 1):     # a line as each starts: the picture comes at the end
        ranks = 1 if s == "single" else args.ranks
        print(f"tracing {s} on {ranks} rank(s), {i} of {len(strategies)} ...", file=sys.stderr,
              flush=True)
        panels.append(traces.spawn(traces.memory_over_a_step, ranks, s, flags))
    return draw_memory(panels)


def check(args, parser):
    """Bad input stops here, with the flag and the fix, before any rank starts."""
    if not args.out.endswith(".svg"):
        parser.error(f"-o {args.out}: the picture is SVG; name a file ending in .svg")
    why = unwritable_file("-o", args.out, "picture.svg")
    if why:
        parser.error(why)
    if args.picture == "schedule":
        v = args.virtual_stages if args.virtual_stages is not None else 2 if args.schedule == "interleaved" else 1
        if v < 1:
            parser.error(f"--virtual-stages must be at least 1 (chunks per stage), got {v}")
        if not 2 <= args.stages * v <= TINY_BLOCKS or args.microbatches < 1:
            parser.error(f"--stages {args.stages} x {v} chunks: the tiny model's {TINY_BLOCKS} blocks "
                         f"need at least 2 stages and one block per chunk; give --stages 2 to "
                         f"{TINY_BLOCKS // v}, and --microbatches 1 or more")
        try:
            make_schedule(args.schedule, args.stages, args.microbatches, v)
        except ValueError as e:
            parser.error(str(e))
    if args.picture == "memory":
        wrong = set(args.strategies.split(",")) - {"single", "ddp", "zero1", "zero2", "zero3", "fsdp"}
        if wrong or MEMORY_BATCH % args.ranks:
            parser.error(f"--strategies {args.strategies} --ranks {args.ranks}: choose among single, "
                         f"ddp, zero1, zero2, fsdp, and ranks dividing the batch of {MEMORY_BATCH} "
                         f"(1, 2, 4 or 8)")


def main(argv=None):
    args, parser = parse_args(argv)
    check(args, parser)
    try:
        text = picture(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        write_whole(args.out, text.encode())
    except OSError as e:             # a full disk: nothing partial is left, the old file stays
        sys.exit(f"pictures.py: error: -o {args.out}: writing it failed ({e.strerror}); nothing "
                 f"partial was left: free space there, or write the picture elsewhere, and rerun")
    print(f"wrote {args.out}", file=sys.stderr)
