"""The talk's controlled experiment as one command: napkin/memory.py --advise ... --measure.

Every rung that fits (advisor_speed.every_rung), one knob at a time from plain data parallelism,
runs train.py for a few steps on this machine at the advice's world size, and the table puts
what it measured beside what was predicted: the state's bytes per rank (napkin/memory.py's napkin
against train.py's "memory per rank, measured" line) and tokens/s (napkin/step_time.py on this machine,
machines.this, against the log's last step line). A rung is kept when it fits and runs faster
than the last rung kept. One torchrun runs all the rungs: each rank calls train.main once per
rung, in turn (running/experiment_worker.py), so the launch and the imports are paid once.
On CPU ranks a model of more than CPU_PARAMS parameters, or a --params shape, is not run: the
tiny preset is, at seq len 64 and 8 sequences per rank, its rungs advised anew (and said so);
the CPU computes in fp32.
Run: python -m napkin.memory --advise --model tiny --world 2 --measure
Test: python -m pytest tests/test_advisor.py -k measure
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from napkin.advisor_speed import every_rung, rung_seconds
from napkin.machines import Link, Machine
from napkin.memory_math import MiB, human_bytes, model_params
from model import PRESETS

STEPS, LOG_EVERY = 6, 5       # the measured line is the last logged step's: steps 1 to 5, warm
CPU_PARAMS = 2_000_000         # the tiny preset's 0.87M runs a step in a blink on 2 CPU ranks
MEASURED_STATE = re.compile(r"memory per rank, measured: params ([\d.]+) MiB, grads ([\d.]+), optim "
                            r"([\d.]+) = ([\d.]+) on the device")
STEP = re.compile(r"\|\s+([\d.]+)k tok/s")
# What each rank runs under torchrun: the plan's train.py commands, then machines.this.
# The project's root, where `python -m running.experiment_worker` finds the packages.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def runnable(args) -> tuple[str, int, int, str, str]:
    """(model, seq_len, target batch, precision, what was scaled) of the run on this machine."""
    precision = ("bf16" if args.bf16 else "fp16") if torch.cuda.is_available() else "fp32"
    seq_len = args.seq_len or args.shape.block_size
    if args.model and (torch.cuda.is_available() or model_params(PRESETS[args.model]) <= CPU_PARAMS):
        return args.model, seq_len, args.target_batch, precision, ""
    what = args.model or "the assumed shape"
    return ("tiny", 64, 8 * args.world, precision,
            f"{what} is too big to run on CPU ranks: measuring the tiny preset instead, seq len 64, "
            f"batch {8 * args.world}, fp32, its rungs advised anew for {human_bytes(args.gpu_mem)} "
            f"a rank")


def rung_argv(model: str, precision: str, seq_len: int, target_batch: int, advice) -> list:
    return [*advice.argv(model, precision, seq_len, target_batch), "--steps", str(STEPS),
            "--log-every", str(LOG_EVERY), "--eval-every", "0"]


def plan_runs(model: str, precision: str, seq_len: int, target_batch: int, fitting: list, tmp: str) -> list:
    """train.py's words for each rung. LoRA's rungs fine-tune the first rung's trained model
    (saved to tmp/base), as train.py asks of a 4-bit base (--init-from)."""
    base, runs = os.path.join(tmp, "base"), []
    for a in fitting:
        argv = rung_argv(model, precision, seq_len, target_batch, a)
        if "--lora" in a.flags:
            argv += ["--init-from", base]
        elif not runs:
            argv += ["--out", base]
        runs.append(argv)
    return runs


def run_all(world: int, fitting: list, rows: int, model: str, seq_len: int, batch: int,
            precision: str) -> tuple[list, dict]:
    """Rank 0's log of each rung's run, one torchrun for all, and this machine (machines.this)."""
    with tempfile.TemporaryDirectory() as tmp:
        runs, plan = plan_runs(model, precision, seq_len, batch, fitting, tmp), os.path.join(tmp, "plan.json")
        with open(plan, "w") as f:
            json.dump({"runs": runs, "rows": rows, "model": model, "seq_len": seq_len,
                       "precision": precision}, f)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node", str(world), "-m", "running.experiment_worker", plan],
                              capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"--measure: the runs failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
                         f"{done.stderr[-3000:]}")
    sections = done.stdout.split("=== run ")[1:]
    return [s.split("\n", 1)[1] for s in sections[:-1]], json.loads(sections[-1].split("\n", 1)[1])


def machine_from(d: dict) -> Machine:
    return Machine(**{**d, "host_link": Link(**d["host_link"]),
                      "links": {k: Link(**v) for k, v in d["links"].items()}})


def measured(log: str) -> dict:
    """The state's MiB per rank (the device's total) and tokens/s of the last logged step."""
    state = MEASURED_STATE.search(log)
    return {"state_mib": float(state.group(4)), "tokens_per_s": 1e3 * float(STEP.findall(log)[-1])}


def table_row(advice, state_mib: float, measured_mib: float, tokens_per_s: float, measured_tokens_per_s: float,
              kept: bool) -> str:
    """One rung's line of the table: two spaces between columns however wide a number grows
    (a GPU's tokens/s run to 9 digits and more)."""
    return (f"{advice.rung:<60}  {f'{advice.micro_batch} x {advice.grad_accum}':>7}  "
            f"{state_mib:>10.1f} / {measured_mib:<10.1f}  "
            f"{tokens_per_s:>12,.0f} / {measured_tokens_per_s:<12,.0f}  {'kept' if kept else 'not'}")


def measure(args) -> list[dict]:
    """Run every fitting rung here, print the table; return its rows (with each run's log)."""
    model, seq_len, batch, precision, scaled = runnable(args)
    cfg = PRESETS[model]
    fitting = [a for a in every_rung(cfg, args.gpu_mem, args.world, seq_len, batch, precision)
               if a.fits]
    print(f"\nthe experiment: each rung that fits, {STEPS} steps on this machine, {args.world} rank(s), "
          f"{model} in {precision}, batch {batch} x {seq_len}"
          + (f"\n{scaled}" if scaled else ""))
    if not fitting:
        print("nothing fits: nothing to measure")
        return []
    logs, this = run_all(args.world, fitting, fitting[0].micro_batch, model, seq_len, batch, precision)
    machine, rows, kept = machine_from(this), [], None
    print(f"{'rung':<60}  {'b x k':>7}  {'state MiB pred. / meas.':>23}  {'tokens/s pred. / meas.':>27}  kept")
    for a, log in zip(fitting, logs):
        m = measured(log)
        predicted = rung_seconds(cfg, a, args.world, seq_len, precision, machine)["tokens_per_s"]
        state = (a.held["params"] + a.held["grads"] + a.held["optimizer"]) / MiB
        keep = kept is None or m["tokens_per_s"] > kept
        kept = m["tokens_per_s"] if keep else kept
        rows.append({"rung": a.rung, "predicted_mib": state, **m, "predicted_tokens_per_s": predicted,
                     "kept": keep, "log": log})
        print(table_row(a, state, m["state_mib"], predicted, m["tokens_per_s"], keep))
    print("kept: faster (measured) than the last rung kept; predicted tokens/s: step_time.py on "
          f"{machine.name}, measured by machines.this")
    return rows
