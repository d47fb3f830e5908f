"""pictures/traces.py: what a run records of itself for pictures/draw.py to draw.

Three records: the losses a run's log.txt holds (train.py writes one line per logged step); the
bytes one rank holds over one training step, by category (parameters, gradients, optimizer
state, and the activations autograd keeps for backward), sampled at the step's events; and a
pipeline's executed schedule, each stage's compute actions with their start and end on one
clock. The strategies are built as train.py builds them (parallelize.build), over ranks this
file spawns (gloo on the CPU, one thread each; NCCL, one GPU each, where there are enough).
Left out: the allocator's fragmentation, the bytes of messages in flight.
Test: python -m pytest tests/test_pictures.py
"""
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from running.cli import parse_args
from running.data import TextData
from napkin.memory_math import activation_bytes, held_bytes, logits_bytes
from composition.mesh_checks import ParallelDims
from composition.parallelize import build, new_gpt
from extensions.schedules import COMPUTE

# ---- the loss of a run, from its log ---------------------------------------------------------

LOSS_LINE = re.compile(r"^step\s+(\d+) \| loss (\S+) \|")


def logged_losses(run_dir: str) -> dict[int, float]:
    """{step: loss} of the lines `step N | loss X | ...` of RUN_DIR/log.txt (train.py --out).
    The log is appended to: a run resumed from an earlier checkpoint, or started again with
    --overwrite, logs from an earlier step on, and what it logs replaces every later step of
    the run before it. A loss of inf or NaN (a run that diverged) has no place on the axis: it
    is left out, and a note on stderr names its steps. Bytes that are not UTF-8 (a damaged
    line) match no loss line."""
    path = os.path.join(run_dir, "log.txt")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir}: no log.txt in it; give a directory train.py --out wrote")
    losses = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for step, loss in (((int(m[1]), float(m[2])) for m in map(LOSS_LINE.match, f) if m)):
            if losses and step <= max(losses):
                losses = {s: v for s, v in losses.items() if s < step}
            losses[step] = loss
    diverged = [str(step) for step, loss in losses.items() if not math.isfinite(loss)]
    if diverged:
        print(f"pictures: note: {path}: step {', '.join(diverged)} logged a loss of inf or NaN "
              f"(the run diverged), left out of the curve", file=sys.stderr)
    losses = {step: loss for step, loss in losses.items() if math.isfinite(loss)}
    if not losses:
        raise ValueError(f"{path} holds no 'step N | loss X' line with a finite loss: did the run "
                         f"log a step?")
    return dict(sorted(losses.items()))


def run_label(run_dir: str) -> str:
    """'fsdp x 2 (runs/fsdp)' from the run's config.json, else the directory's name."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
        name = os.path.basename(os.path.normpath(run_dir))
        return f"{config['strategy']} x {config['world_size']} ({name})"
    except (OSError, KeyError, ValueError):
        return os.path.basename(os.path.normpath(run_dir))


# ---- ranks of our own: a world of N processes, as torchrun would start ------------------------

def spawn(fn, world_size: int, *args):
    """fn(*args) on world_size fresh processes joined in one group; returns rank 0's result
    (JSON). NCCL with a GPU each where there are enough GPUs, else gloo on the CPU."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_rank_main, (fn, world_size, tmp, args), nprocs=world_size)
        with open(os.path.join(tmp, "result.json")) as f:
            return json.load(f)


def _rank_main(rank, fn, world_size, tmp, args):
    torch.set_num_threads(1)                       # the cores shared among the ranks
    cuda = torch.cuda.device_count() >= world_size
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size,
                            store=dist.FileStore(os.path.join(tmp, "store"), world_size))
    try:
        result = fn(*args)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(tmp, "result.json"), "w") as f:
            json.dump(result, f)


def built(argv: list[str]):
    """train.py's run for these flags on this rank (parallelize.build): (run, args, data, device)."""
    args = parse_args(argv)
    args.timeout = 120 if args.timeout is None else args.timeout
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    dims = ParallelDims.from_args(args, dist.get_world_size())
    return build(args, device, dims, new_gpt(args)), args, TextData.from_file(args.data), device


def batch(data, args, run, step: int, device):
    """This data-parallel rank's rows of the global batch of `step` (B/D, T), on the device."""
    x, y = data.batch(step, args.batch_size, args.seq_len, args.seed, rank=run.mesh.dp.rank,
                      world_size=run.mesh.dp.world_size)
    return x.to(device), y.to(device)


# ---- memory over one step -------------------------------------------------------------------

CATEGORIES = ("params", "grads", "optimizer", "activations")


class _Saved:
    """A tensor autograd keeps for backward, counted while the graph holds it: the graph drops
    it once the backward that needed it has run (or the graph is freed)."""
    __slots__ = ("tensor", "ptr", "trace")

    def __init__(self, tensor, ptr, trace):
        self.tensor, self.ptr, self.trace = tensor, ptr, trace
        nbytes, holders = trace.saved.get(ptr, (tensor.untyped_storage().nbytes(), 0))
        trace.saved[ptr] = (nbytes, holders + 1)

    def __del__(self):
        nbytes, holders = self.trace.saved[self.ptr]
        if holders == 1:
            del self.trace.saved[self.ptr]
        else:
            self.trace.saved[self.ptr] = (nbytes, holders - 1)


class MemoryTrace:
    """Bytes this rank holds, by category, at the events of a step: before and after each
    block's attention and MLP in forward, as the gradient of each reaches them in backward, as
    each parameter's gradient lands, and around the gradient sync and the optimizer's step.
    Parameters, gradients and optimizer state as memory_math.held_bytes counts them (FSDP's gathered
    units and ZeRO-2's buckets in flight included: their storage is empty when freed);
    activations: every storage autograd saved for backward (saved-tensor hooks, as
    meters.saved_activation_bytes counts them) and holds still, parameters left out. On a GPU
    also torch.cuda.memory_allocated() (the allocator's count: no host sync)."""

    def __init__(self, gpt, model, optimizer, device):
        self.gpt, self.model, self.optimizer, self.device = gpt, model, optimizer, device
        self.samples, self.saved, self.handles = [], {}, []
        for i, block in enumerate(gpt.blocks):
            for name, module in (("attn", block.attn), ("mlp", block.mlp), ("block", block)):
                self._hook(module, f"{name} {i}")
        # After each gradient lands (and the strategy's own hook, registered first, has bucketed,
        # reduced or freed what it reduces): ZeRO-2's buckets, FSDP's units freed in backward.
        for name, p in gpt.named_parameters():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, name=name: self.sample(f"gradient {name}")))

    def _hook(self, module, where: str):
        def before(m, inputs):
            self.sample(f"forward {where}")

        def after(m, inputs, output):
            self.sample(f"forward {where} done")
            if output.requires_grad:        # its gradient arrives as its backward begins
                output.register_hook(lambda grad: self.sample(f"backward {where}"))
        # Registered after the strategy's own (FSDP gathers in its pre-hook, frees in its
        # post-hook): a sample sees what the strategy left.
        self.handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def sample(self, event: str):
        held = held_bytes(self.model, self.optimizer)
        row = {"event": event, **{k: held[k] for k in CATEGORIES[:3]},
               "activations": sum(nbytes for nbytes, _ in self.saved.values())}
        if self.device.type == "cuda":
            row["allocated"] = torch.cuda.memory_allocated(self.device)
        self.samples.append(row)

    def saving(self):
        """Inside, every tensor autograd saves is counted until the graph lets it go."""
        def pack(t):
            # Weights are not activations (FSDP's: views of the unit gathered now, looked up
            # at each save); nor is a storage already freed.
            ptr = t.untyped_storage().data_ptr()
            weights = {w.untyped_storage().data_ptr() for w in (*self.gpt.parameters(), *self.gpt.buffers())}
            return t if ptr in weights or not t.untyped_storage().nbytes() else _Saved(t, ptr, self)

        def unpack(saved):
            return saved.tensor if isinstance(saved, _Saved) else saved
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def training_step(run, x, y, sample=lambda event: None, saving=contextlib.nullcontext):
    """train.py's step for one micro-batch (its train_step and update), calling sample(event)
    at its events and running forward and backward inside saving()."""
    run.optimizer.zero_grad(set_to_none=True)
    sample("start")
    with saving():
        _, loss = run.model(x, y)
        sample("loss")
        run.optimizer.scale_loss(loss).backward()
    sample("backward done")
    run.sync.finish_gradient_sync()
    sample("gradients synced")
    run.optimizer.step()
    sample("optimizer step")


def memory_over_a_step(strategy: str, flags: list[str]) -> dict:
    """On every rank: train.py's run for --strategy and flags, one step taken (the optimizer's
    state then exists, as in every later step) and the next traced. Returns this rank's
    samples and napkin/memory.py's prediction per category for this rank."""
    run, args, data, device = built(["--strategy", strategy, *flags])
    training_step(run, *batch(data, args, run, 0, device))
    x, y = batch(data, args, run, 1, device)
    trace = MemoryTrace(run.gpt, run.model, run.optimizer, device)
    training_step(run, x, y, trace.sample, trace.saving)
    trace.remove()
    return {"strategy": strategy, "world_size": dist.get_world_size(), "samples": trace.samples,
            "predicted": predicted_bytes(args, run, x.shape[0])}


def predicted_bytes(args, run, rows: int) -> dict:
    """napkin/memory.py's napkin math for this rank: parameters, gradients and optimizer state as
    parallelize.build predicted them (run.napkin), activations by the per-layer formula
    (Korthikanti et al.: 16-bit values and dropout masks, scaled to the run's value size; an
    upper bound here) plus the loss's fp32 log-probabilities, for this rank's rows."""
    cfg, value = run.gpt.cfg, next(run.gpt.parameters()).element_size()
    kept = activation_bytes(args.seq_len, rows, cfg.n_embd, cfg.n_head, cfg.n_layer,
                            bytes_per_value=value) + logits_bytes(args.seq_len, rows, cfg.vocab_size)
    return {**{k: run.napkin[k] for k in CATEGORIES[:3]}, "activations": kept}


# ---- a pipeline's executed schedule ------------------------------------------------------------

def executed_schedule(flags: list[str]) -> dict:
    """On every stage: train.py's --strategy pipeline run for flags (--pp P --microbatches M
    --schedule ...), one step to warm up, then one measured (pipeline.Pipeline.train_step's
    measure: on CUDA each compute action's end is synchronized, so its times are the device's).
    Every stage's compute actions, (kind, micro-batch, chunk, start, end) in seconds from the
    barrier every stage leaves together just before the step, gathered to every rank."""
    run, args, data, device = built(["--strategy", "pipeline", *flags])
    for step in range(2):
        x, y = batch(data, args, run, step, device)
        run.optimizer.zero_grad(set_to_none=True)
        dist.barrier(group=run.mesh.pp.group)     # one start: the stages' clocks differ by its skew
        start = time.perf_counter()
        run.model.train_step(x, y, run.optimizer.scale_loss, measure=True)
        run.optimizer.step()
    # Every stage runs M v forwards and as many backwards (and W's): one shape, (actions, 5).
    mine = torch.tensor([(COMPUTE.index(a.kind), a.m, a.chunk, began - start, ended - start)
                         for a, began, ended in run.model.observer.timeline], dtype=torch.float64, device=device)
    stages = [torch.empty_like(mine) for _ in range(run.mesh.pp.world_size)]
    dist.all_gather(stages, mine, group=run.mesh.pp.group)             # a picture's: not counted
    rows = [[(COMPUTE[int(k)], int(m), int(c), t0, t1) for k, m, c, t0, t1 in s.tolist()] for s in stages]
    return {"schedule": args.schedule, "stages": len(rows), "microbatches": args.microbatches,
            "virtual_stages": args.virtual_stages, "rows": rows}
