"""Pipeline parallelism (pipeline.py): the executor against one process (the schedules it runs
are tested in tests/test_schedules.py).

The executor: P = 2 and 4 stages, M in {1, 4, 8}, GPipe and 1F1B, and P = 2 x D = 2, train
a few clipped AdamW steps (fp32) of a small GPT on CPU ranks, against one process training on
the same whole batches, and against torch.distributed.pipelining's schedules on the same split.
train.py --strategy pipeline: the same loss curve as one process, bit-exact resume, its
checkpoints read by one process, bad input stopped early.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipeline
from foundations.comm import Comm
from ddp import DDP
from equivalence import AdamDenominators, Fp64AdamW, assert_adam_close
from composition.mesh_optimizer import on_mesh
from mixed_precision import DTYPES as PRECISIONS, DynamicLossScaler, MixedPrecisionOptimizer
from model import GPT, GPTConfig
from multiprocess import assert_mean_close, assert_tensors_close, run_ranks, torchrun_worker
from foundations.process_groups import make_mesh
from composition.parallelize import bubble_why, replayed_idle, stage_seconds
from mechanics.pipeline_mechanics import bubble_formula, split_layers
from extensions.schedules import SCHEDULES, gpipe, make_pipeline, make_schedule, nccl_program

# ---- the executor, against one process -----------------------------------------------------------

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=64)
DTYPES = {**PRECISIONS, "fp64": torch.float64}          # fp64: where equal to one process is exact
B, T, STEPS = 8, 16, 3
MICROBATCHES = (1, 4, 8)


def _batches():
    torch.manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (B, T + 1)) for _ in range(STEPS)]


def _optimizer(params, stages=None, precision="fp32"):
    if precision == "fp64":
        return Fp64AdamW(params, {"pp": stages}, lr=1e-2, weight_decay=0.1)
    # fp16: the scale starts low enough for every stage and grows every 2 clean steps, so it moves.
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2) if precision == "fp16" else None
    optimizer = MixedPrecisionOptimizer(params, torch.optim.AdamW, precision=precision,
                                        scaler=scaler, lr=1e-2, weight_decay=0.1)
    return on_mesh([optimizer], {"pp": stages})    # the norm sums the stages' squares


def _masters(gpt, optimizer):
    return {n: m.detach() for (n, _), m in zip(gpt.named_parameters(), optimizer.masters)}


TIED = GPTConfig(**{**CFG.__dict__, "tie_embeddings": True})      # the head is the token embedding


def _single(cfg=CFG, precision="fp32"):
    """One process, whole batches: losses, first step's gradients, final (master) parameters."""
    torch.manual_seed(0)
    gpt = GPT(cfg).to(DTYPES[precision])
    optimizer = _optimizer(gpt.parameters(), precision=precision)
    denominators = AdamDenominators.of(optimizer.optimizer, [name for name, _ in gpt.named_parameters()])
    losses, grads, scales, norms = [], None, [], []
    for batch in _batches():
        _, loss = gpt(batch[:, :-1], batch[:, 1:])
        scales.append(optimizer.scaler.scale)
        optimizer.scale_loss(loss).backward()
        grads = grads or {n: p.grad.clone() for n, p in gpt.named_parameters()}
        norms.append(optimizer.clip_grad_norm_(0.5).item())     # clipped: the global norm matters
        optimizer.step()
        assert not optimizer.last_step_skipped
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": _masters(gpt, optimizer), "scales": scales,
            "norms": norms, "denominators": denominators}


def _pipeline_trains(P, runs, cfg=CFG, precision="fp32"):
    """On P x D ranks: each (schedule, M) or (schedule, M, v chunks per stage) in runs trained from
    the same init; per run this rank's losses, first gradients, final (master) parameters, loss
    scales, and the executor's counts."""
    comm = Comm()
    pipe, data = make_mesh(comm, P)                       # stage = pipe.rank, replica = data.rank
    results = []
    for schedule, M, *v in runs:
        v = v[0] if v else 1
        torch.manual_seed(0)
        gpt = GPT(cfg).to(DTYPES[precision])
        layers = split_layers(cfg.n_layer, P, v=v)[pipe.rank::P]
        stage = pipeline.GPTStage(gpt, layers, first=pipe.rank == 0, last=pipe.rank == P - 1)
        module = DDP(stage, data) if data.world_size > 1 else stage
        runner = make_pipeline(module, pipe, schedule, M, cfg.n_embd, DTYPES[precision])
        optimizer = _optimizer(gpt.parameters(), pipe, precision)
        losses, grads, scales = [], None, []
        for batch in _batches():
            rows = batch.chunk(data.world_size)[data.rank]                # (B/D, T+1)
            scales.append(optimizer.scaler.scale)
            loss = runner.train_step(rows[:, :-1], rows[:, 1:], optimizer.scale_loss)
            if data.world_size > 1:
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=data.group)
            grads = grads or {n: p.grad.clone() for n, p in gpt.named_parameters()}
            optimizer.clip_grad_norm_(0.5)
            optimizer.step()
            assert not optimizer.last_step_skipped
            optimizer.zero_grad()
            losses.append(loss.item())
        results.append({"losses": losses, "grads": grads, "peak": runner.observer.peak_activations,
                        "params": _masters(gpt, optimizer), "scales": scales,
                        "busy": runner.observer.busy, "wall": runner.observer.wall,
                        "seconds": stage_seconds(runner)})
    return results


def _whole(ranks, run, key):
    """One {name: tensor} over the stages (replicas hold the same, rank order keeps stage 0 first;
    a tied weight's copy on the last stage is compared with stage 0's apart)."""
    return {name: t for rank in reversed(ranks) for name, t in rank[run][key].items()}


# Micro-batches and stages change only the order of sums: the mean over B as M means over B/M,
# gradients accumulated over M backwards, the clipping norm summed over stages. Losses and
# first-step gradients: measured 1.2e-7 relative and 2.4e-8 absolute, allowed 1e-6 and 1e-7.
# Parameters after 3 Adam steps: Adam's division by sqrt(v) amplifies that noise on elements
# whose gradients are near zero (as in tensor parallelism's tests): each within PARAM_ATOL x
# max(1, ADAM_AMPLIFIED / d), d its smallest Adam denominator in one process
# (equivalence.assert_adam_close; measured at most 2.4e-6 x that under ATEN_CPU_CAPABILITY
# default, 1.2e-6 under avx512, 5.2e-7 under avx2). In fp64 the same arithmetic agrees to
# FP64_ATOL (test_tensor_parallel's reasoning; measured under 1e-13); its losses are the
# executor's fp32 metric (pipeline.py sums the micro-batches' in fp32): RTOL.
RTOL, ATOL, PARAM_ATOL = 1e-6, 1e-7, 5e-6
FP64_ATOL = 1e-10


@pytest.mark.equivalence
def test_every_schedule_in_fp64_is_one_process_up_to_rounding():
    """GPipe, 1F1B, interleaved (2 chunks a stage) and zero bubble on 2 stages, 4 micro-batches,
    in fp64 (torch's AdamW, clipped by the norm summed over the stages in fp64) against one fp64
    process: first-step gradients and every weight after 3 steps to fp64's rounding (FP64_ATOL),
    on any CPU; the fp32 tests bound the same runs by Adam's amplification of fp32's rounding."""
    runs = [("gpipe", 4), ("1f1b", 4), ("interleaved", 4, 2), ("zb", 4)]
    ranks = run_ranks(_pipeline_trains, 2, 2, runs, CFG, "fp64")
    single = _single(CFG, "fp64")
    for i, run in enumerate(runs):
        what = f"fp64 P=2 {run}"
        assert ranks[0][i]["losses"] == pytest.approx(single["losses"], rel=RTOL), what
        for key in ("grads", "params"):
            assert_tensors_close(_whole(ranks, i, key), single[key], 0, FP64_ATOL, f"{what} {key}")


@pytest.mark.equivalence
@pytest.mark.parametrize("P", [2, 4])
def test_pipeline_equals_one_process_and_holds_what_the_schedule_says(P):
    runs = [(schedule, M) for M in MICROBATCHES for schedule in ("gpipe", "1f1b")]
    ranks = run_ranks(_pipeline_trains, P, P, runs)
    single = _single()
    for i, (schedule, M) in enumerate(runs):
        what = f"P={P} M={M} {schedule}"
        assert ranks[0][i]["losses"] == pytest.approx(single["losses"], rel=RTOL), what
        assert_tensors_close(_whole(ranks, i, "grads"), single["grads"], RTOL, ATOL, what + " grads")
        assert_adam_close(_whole(ranks, i, "params"), single["params"], single["denominators"], PARAM_ATOL,
                          what + " params")
        if schedule == "1f1b":   # the same micro-batches, backwards in the same order: bit for bit
            for key in ("grads", "params"):
                assert_tensors_close(_whole(ranks, i, key), _whole(ranks, i - 1, key), 0, 0,
                                     what + " vs gpipe " + key)
        # Counted by the executor: GPipe keeps M micro-batches' graphs, 1F1B at most P - s.
        for s, rank in enumerate(ranks):
            assert rank[i]["peak"] == (M if schedule == "gpipe" else min(P - s, M)), (what, s)
            assert 0 < rank[i]["busy"] < rank[i]["wall"]
            # The bubble's why replays every stage's compute actions: each stage's, gathered.
            assert len(rank[i]["seconds"][s]) == 2 * M, (what, s)
            assert sum(rank[i]["seconds"][s]) == pytest.approx(rank[i]["busy"], rel=1e-12), (what, s)


# Interleaved stages and zero bubble at P = 2 and 4 on a model of 8 blocks (P v chunks of at least
# one): the same sums in the same order as 1F1B (each parameter's gradient accumulated over the
# micro-batches in order; zero bubble's W the same products autograd's backward runs), so the
# losses and gradients are 1F1B's bit for bit, and one process's within the tolerances above.
# Parameters: zero bubble's are 1F1B's bit for bit; interleaved stages hold other blocks, so the
# clipping norm adds its squares in another order (measured 3.7e-7 from 1F1B after 3 steps,
# allowed PARAM_ATOL). Against one process they are not compared on this model: 1F1B's own
# parameters differ by 3.4e-5 there after 3 steps (Adam's amplified noise, as above; 8 blocks
# hold more near-zero gradients than 4), which 1F1B's test on CFG bounds instead.
DEEP = GPTConfig(**{**CFG.__dict__, "n_layer": 8})
NEW_SCHEDULES = {2: [("interleaved", 4, 2), ("interleaved", 4, 4), ("interleaved", 8, 2),
                     ("zb", 4), ("zb", 8)],
                 4: [("interleaved", 4, 2), ("interleaved", 8, 2), ("zb", 4), ("zb", 8)]}


@pytest.mark.equivalence
@pytest.mark.parametrize("P", [2, 4])
def test_interleaved_and_zero_bubble_equal_1f1b_and_one_process(P):
    runs = NEW_SCHEDULES[P] + [("1f1b", M) for M in (4, 8)]
    ranks = run_ranks(_pipeline_trains, P, P, runs, DEEP)
    single = _single(DEEP)
    for i, (schedule, M, *v) in enumerate(NEW_SCHEDULES[P]):
        what = f"P={P} M={M} {schedule} {v}"
        assert ranks[0][i]["losses"] == pytest.approx(single["losses"], rel=RTOL), what
        assert_tensors_close(_whole(ranks, i, "grads"), single["grads"], RTOL, ATOL, what + " grads")
        one_f_one_b = runs.index(("1f1b", M))
        assert ranks[0][i]["losses"][0] == ranks[0][one_f_one_b]["losses"][0], what
        assert_tensors_close(_whole(ranks, i, "grads"), _whole(ranks, one_f_one_b, "grads"), 0, 0,
                             what + " vs 1f1b grads")
        assert_tensors_close(_whole(ranks, i, "params"), _whole(ranks, one_f_one_b, "params"), 0,
                             PARAM_ATOL if schedule == "interleaved" else 0, what + " vs 1f1b params")
        # Counted by the executor, against the formulas in extensions/schedules.py: interleaved holds up
        # to 2(P-1-s) + (v-1)P + 1 micro-batch chunks, ZB-H1 P micro-batches on every stage.
        for s, rank in enumerate(ranks):
            expected = (min(v[0] * M, 2 * (P - 1 - s) + (v[0] - 1) * P + 1) if schedule == "interleaved"
                        else min(P, M))
            assert rank[i]["peak"] == expected, (what, s)


@pytest.mark.equivalence
def test_pipeline_times_data_parallel_equals_one_process():
    # Interleaved: DDP over the stage's two chunks; zero bubble: every backward under no_sync(),
    # the W's gradients averaged by finish_gradient_sync() at the end.
    runs = [("1f1b", 2), ("gpipe", 2), ("interleaved", 2, 2), ("zb", 2)]
    ranks = run_ranks(_pipeline_trains, 4, 2, runs)   # P=2 x D=2
    single = _single()
    for i, run in enumerate(runs):
        assert ranks[0][i]["losses"] == pytest.approx(single["losses"], rel=RTOL), run
        # Replicas 0 and 1 of each stage: ranks (0, 2) hold stage 0, (1, 3) stage 1.
        for replica in (ranks[:2], ranks[2:]):
            assert_adam_close(_whole(replica, i, "params"), single["params"], single["denominators"],
                              PARAM_ATOL, f"P=2 x D=2 {run}")


def _ours_and_torchs(P, runs, cfg=CFG):
    """This stage's first-step gradients from our executor and from torch.distributed.pipelining
    (ScheduleGPipe, Schedule1F1B; ScheduleInterleaved1F1B on the same chunks; for zero bubble
    ScheduleInterleavedZeroBubble, its B/W split, with one chunk per stage), on the same split,
    weights and batch; runs: (schedule, M) or (schedule, M, v)."""
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)
    from bench.compare import torch_pipeline_stage
    s = dist.get_rank()
    batch = _batches()[0]
    x, y = batch[:, :-1], batch[:, 1:]
    results = []
    for schedule, M, *v in runs:
        v, grads = v[0] if v else 1, []
        for whose in ("ours", "torch"):
            torch.manual_seed(0)
            gpt = GPT(cfg)
            stage = pipeline.GPTStage(gpt, split_layers(cfg.n_layer, P, v=v)[s::P], s == 0, s == P - 1)
            if whose == "ours":
                make_pipeline(stage, Comm(), schedule, M, cfg.n_embd, torch.float32).train_step(x, y)
            else:
                # torch's last stage returns logits and applies loss_fn itself, then divides the
                # gradients by M; ours divides each micro-batch's loss by M: the same mean.
                stages = [torch_pipeline_stage(stage, s, P, len(x) // M, x.shape[1], torch.float32, c)
                          for c in range(v)]
                kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                        "zb": ScheduleInterleavedZeroBubble}[schedule]
                theirs = kind(stages if schedule in ("interleaved", "zb") else stages[0],   # a list: several
                              n_microbatches=M,
                              loss_fn=lambda logits, t: F.cross_entropy(logits.float().flatten(0, 1), t.flatten()))
                theirs.step(*([x] if s == 0 else []), **({"target": y} if s == P - 1 else {}))
            grads.append({n: p.grad.clone() for n, p in gpt.named_parameters()})
        results.append(grads)
    return results


@pytest.mark.equivalence
@pytest.mark.parametrize("P", [2, 4])
def test_interleaved_and_zero_bubble_equal_torchs(P):
    runs = [("interleaved", 2 * P, 2), ("zb", 2 * P)] + ([("interleaved", 4, 4)] if P == 2 else [])
    ranks = run_ranks(_ours_and_torchs, P, P, runs, DEEP)
    for i, (schedule, M, *v) in enumerate(runs):
        ours = {n: g for rank in ranks for n, g in rank[i][0].items()}
        theirs = {n: g for rank in ranks for n, g in rank[i][1].items()}
        assert_tensors_close(ours, theirs, RTOL, ATOL, f"P={P} M={M} {schedule} {v} vs torch")


@pytest.mark.equivalence
@pytest.mark.parametrize("P", [2, 4])
def test_executor_equals_torch_distributed_pipelining(P):
    runs = [("gpipe", 4), ("1f1b", 4), ("1f1b", 8)]
    ranks = run_ranks(_ours_and_torchs, P, P, runs)
    for i, (schedule, M) in enumerate(runs):
        ours = {n: g for rank in ranks for n, g in rank[i][0].items()}
        theirs = {n: g for rank in ranks for n, g in rank[i][1].items()}
        assert_tensors_close(ours, theirs, RTOL, ATOL, f"P={P} M={M} {schedule} vs torch")


def test_zero_bubbles_w_writes_each_gradient_as_autograd_does():
    """W (zero_bubble.WeightGradients.run) after B's backwards of 4 micro-batches: every .grad
    equals autograd's bit for bit and is laid out as autograd lays it, as its parameter (a
    transposed .grad holds the same values, but the clipping norm adds them in another order:
    a zero-bubble run then drifts from GPipe's by an ulp a step). One process, no pipeline."""
    from extensions.zero_bubble import WeightGradients
    torch.manual_seed(0)
    plain, split = GPT(CFG), GPT(CFG)
    split.load_state_dict(plain.state_dict())
    deferred = WeightGradients(split)
    for m, batch in enumerate(_batches()[0].chunk(4)):                   # (B/4, T+1) each
        plain(batch[:, :-1], batch[:, 1:])[1].div(4).backward()
        with deferred.collect(m):
            split(batch[:, :-1], batch[:, 1:])[1].div(4).backward()
    for m in range(4):
        deferred.run(m)
    assert deferred.computed and all(p.grad is not None for p in deferred.computed)
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        assert torch.equal(q.grad, p.grad), name
        assert q.grad.stride() == p.grad.stride() == p.stride(), (name, q.grad.stride(), p.stride())
    norms = [torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) for model in (plain, split)]
    assert torch.equal(*norms), norms


@pytest.mark.equivalence
@pytest.mark.parametrize("P", [2, 4])
def test_tied_head_and_embedding_on_two_stages_equal_one_process(P):
    """GPT-2 ties its head to its token embedding: the first and last stage each hold a copy,
    their gradients summed every step, so the copies stay equal and equal one process's."""
    ranks = run_ranks(_pipeline_trains, P, P, [("1f1b", 4)], TIED)
    single = _single(TIED)
    assert ranks[0][0]["losses"] == pytest.approx(single["losses"], rel=RTOL)
    # The summed gradient (embedding's + head's) equals one process's; parameters are not
    # compared after the steps: the head's gradient reaches every embedding row, some of them
    # ~1e-8, where Adam's first step (g / (|g| + eps)) turns fp32 noise into lr-sized moves.
    assert_tensors_close(_whole(ranks, 0, "grads"), single["grads"], RTOL, ATOL, f"tied P={P} grads")
    for key in ("grads", "params"):
        first, last = ranks[0][0][key]["token_emb.weight"], ranks[-1][0][key]["token_emb.weight"]
        torch.testing.assert_close(last, first, rtol=0, atol=0)         # the same sum, both ends


# 16 bits: micro-batches and stages round their partial sums (the loss's mean, gradients
# accumulated over M backwards) to 16 bits where one process rounds once, and Adam turns a
# near-zero gradient's rounding into a step of either sign: up to 2 lr per step and element
# (measured over 3 steps at lr 1e-2: 2.1e-2 in bf16, 1.5e-2 in fp16). The mean over the model
# stays within 0.05 lr (measured 1.7e-4 bf16, 1.9e-5 fp16); a stage left out of the update, or
# one that scaled differently, moves it by about lr. Losses: measured 8e-5 bf16, 1.4e-6 fp16.
MIXED_ATOL, MIXED_MEAN_ATOL = 2 * STEPS * 1e-2, 0.05 * 1e-2
MIXED_LOSS_RTOL = {"bf16": 1e-3, "fp16": 1e-4}


@pytest.mark.equivalence
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_precisions_equal_one_process_in_the_same_precision(precision):
    """bf16, and fp16 with its loss scale: every stage scales its micro-batches' losses by the
    same factor, and the inf/NaN decision comes from the norm over every stage, so all skip or
    all step and the scale moves alike everywhere."""
    ranks = run_ranks(_pipeline_trains, 2, 2, [("1f1b", 4)], CFG, precision)
    single = _single(CFG, precision)
    what = f"P=2 M=4 1f1b {precision}"
    for s, rank in enumerate(ranks):
        assert rank[0]["scales"] == single["scales"], (what, s)             # fp16: 2^10, 2^10, 2^11
    assert ranks[0][0]["losses"] == pytest.approx(single["losses"], rel=MIXED_LOSS_RTOL[precision]), what
    params = _whole(ranks, 0, "params")
    assert_tensors_close(params, single["params"], 0, MIXED_ATOL, what)
    assert_mean_close(params, single["params"], MIXED_MEAN_ATOL, what)


def _posted_groups(P, runs):
    """Each exchange() call this stage's executor makes in one training step and one evaluation:
    [(send or recv, peer), ...] per call, in order."""
    calls, exchange = [], Comm.exchange

    def record(comm, ops):
        calls[-1].append([(kind, peer) for kind, _, peer in ops])
        return exchange(comm, ops)
    Comm.exchange = record
    batch = _batches()[0]
    for schedule, M in runs:
        torch.manual_seed(0)
        gpt = GPT(CFG)
        s = dist.get_rank()
        stage = pipeline.GPTStage(gpt, split_layers(CFG.n_layer, P)[s], s == 0, s == P - 1)
        runner = pipeline.Pipeline(stage, Comm(), schedule, M, CFG.n_embd, torch.float32)
        calls.append([])
        runner.train_step(batch[:, :-1], batch[:, 1:])
        calls.append([])
        runner.evaluate(batch[:, :-1], batch[:, 1:])
    return calls


@pytest.mark.parametrize("P", [2, 4])
def test_executor_posts_the_groups_the_nccl_check_played(P):
    """run_under_nccl proves nccl_program deadlock-free; this checks the executor posts exactly
    those groups, in that order (one exchange(), i.e. one batch_isend_irecv, per group)."""
    runs = [("gpipe", 4), ("1f1b", 4)]
    ranks = run_ranks(_posted_groups, P, P, runs)
    peer = {"send_act": 1, "recv_grad": 1, "recv_act": -1, "send_grad": -1}
    for i, (schedule, M) in enumerate(runs):
        stages = SCHEDULES[schedule](P, M)
        forwards = [[a for a in actions if a.kind in ("F", "send_act", "recv_act")]
                    for actions in gpipe(P, M)]
        for s, calls in enumerate(ranks):
            for lists, posted in ((stages, calls[2 * i]), (forwards, calls[2 * i + 1])):
                expected = [[(a.kind[:4], s + peer[a.kind]) for a in item[1]]
                            for item in nccl_program(lists[s]) if item[0] == "post"]
                assert posted == expected, (schedule, s)


def _sharded_pipeline_trains(P, cfg, strategy):
    """On P x 2 ranks: a 1F1B pipeline whose data dimension is ZeRO-1 (each stage's optimizer
    state sharded over its 2 replicas), ZeRO-2 (its gradients too) or FSDP (its units too), as
    composition/parallelize.py builds it;
    this rank's averaged losses, clipped norms, and its copy of a tied weight after the steps."""
    from fsdp import FSDP
    from mechanics.fsdp_optimizer import FSDPOptimizer
    from extensions.zero_offload import zero_optimizer
    pipe, data = make_mesh(Comm(), P)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    stage = pipeline.GPTStage(gpt, split_layers(cfg.n_layer, P)[pipe.rank],
                              first=pipe.rank == 0, last=pipe.rank == P - 1)
    module = FSDP(stage, group=data) if strategy == "fsdp" else stage
    optimizer = (FSDPOptimizer(module, lr=1e-2, weight_decay=0.1) if strategy == "fsdp" else
                 zero_optimizer(gpt.parameters(), stage=int(strategy[-1]), group=data, lr=1e-2,
                                weight_decay=0.1))
    # ZeRO's optimizer speaks the gradient-sync protocol (FSDP's module does, the default)
    runner = pipeline.Pipeline(module, pipe, "1f1b", 4, cfg.n_embd, torch.float32)
    if strategy != "fsdp":
        runner.sync = optimizer
    optimizer = on_mesh([optimizer], {"pp": pipe})  # the last stage's tied copy: not counted (GPTStage)
    losses, norms = [], []
    for batch in _batches():
        rows = batch.chunk(data.world_size)[data.rank]                # (B/2, T+1)
        loss = runner.train_step(rows[:, :-1], rows[:, 1:])
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=data.group)
        norms.append(optimizer.clip_grad_norm_(0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if strategy == "fsdp":                    # the tied copy's shards, whole: collective
        tied = module.full_state_dict(all_ranks=True).get("gpt.token_emb.weight")
    else:
        tied = stage.tied.detach().clone() if stage.tied is not None else None
    return {"losses": losses, "norms": norms, "tied": tied}


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_sharded_pipeline_with_a_tied_head_equals_one_process(strategy):
    """ZeRO-1, ZeRO-2 or FSDP over each stage's 2 replicas, the head tied to the token embedding
    on 2 stages (world 4): the ends sum the two gradients before they are reduce-scattered (ZeRO-1
    at the step; ZeRO-2, every backward under its no_sync, at the step too; FSDP, likewise, at the
    pipeline's finish), the last stage's
    copy is left out of the sharded norm (its placement), so every step's loss and the first
    step's clipped norm equal one process's (1e-6 relative; the tied weight counted twice would
    add its squares again), and the copies stay equal. The later norms read weights that Adam's
    first steps moved by amplified fp32 noise (see the test above): measured 5.4e-6 relative,
    allowed 1e-5."""
    ranks = run_ranks(_sharded_pipeline_trains, 4, 2, TIED, strategy)
    single = _single(TIED)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(single["losses"], rel=RTOL), rank["losses"]
        assert rank["norms"][0] == pytest.approx(single["norms"][0], rel=RTOL), (rank["norms"], single["norms"])
        assert rank["norms"] == pytest.approx(single["norms"], rel=1e-5), (rank["norms"], single["norms"])
    first, last = ranks[0]["tied"], ranks[1]["tied"]                 # stage 0, stage 1 (replica 0)
    torch.testing.assert_close(last, first, rtol=0, atol=0)


def _groups_created(P):
    """Every new_group call this rank makes while building ring and native meshes and a
    pipeline of P stages with a tied head (world: P x D ranks)."""
    from foundations.process_groups import make_mesh
    calls, new_group = [], dist.new_group

    def record(ranks=None, **kwargs):
        calls.append((list(ranks), sorted(kwargs)))
        return new_group(ranks, **kwargs)
    dist.new_group = record
    ring = Comm(ring=True)
    pipe, data = make_mesh(ring, P)
    make_mesh(Comm(), P)
    torch.manual_seed(0)
    s = pipe.rank
    stage = pipeline.GPTStage(GPT(TIED), split_layers(TIED.n_layer, P)[s], s == 0, s == P - 1)
    pipeline.Pipeline(stage, pipe, "1f1b", 4, TIED.n_embd, torch.float32)
    return calls


@pytest.mark.parametrize("P, world", [(4, 4), (2, 4)])
def test_every_rank_creates_the_same_groups_in_the_same_order(P, world):
    """NCCL with a bound device splits every new group from the world's communicator: every
    rank must create every group, in one order, the tied ends' too (a group made by the two ends
    alone hangs the first GPU run), and ring mode's private twins."""
    ranks = run_ranks(_groups_created, world, P)
    for r, calls in enumerate(ranks):
        assert calls == ranks[0], f"rank {r} created other groups than rank 0"
    # Each with the run's timeout (issue 37: a stalled rank must not block a subgroup for
    # torch's default), and no use_local_synchronization.
    assert all(kwargs == ["timeout"] for _, kwargs in ranks[0]), ranks[0]
    assert [0, P - 1] in [r for r, _ in ranks[0]]               # the first pipeline's tied ends


# ---- the log's bubble: why the measured one is not the formula's ---------------------------------

def test_replay_with_measured_times_waits_as_the_schedule_does():
    """1F1B, P = 2, M = 1, stage 0's F 1 s and B 2 s, stage 1's F 3 s and B 1 s, messages free:
    stage 0 computes F in 0-1, waits for the gradient (stage 1: F 1-4, B 4-5) and computes B in
    5-7: idle 4 of 7; stage 1 waits 1 and computes 4: idle 1 of 5. One slot each, stage 0's idle
    is each schedule's formula (it starts first and ends last)."""
    assert replayed_idle(make_schedule("1f1b", 2, 1), [[1, 2], [3, 1]]) == pytest.approx([4 / 7, 1 / 5])
    for name, P, M, v in (("gpipe", 4, 8, 1), ("1f1b", 2, 4, 1), ("interleaved", 2, 4, 2), ("zb", 4, 8, 1)):
        stages = make_schedule(name, P, M, v)
        ones = [[1.0] * sum(a.kind in "FBW" for a in actions) for actions in stages]
        assert replayed_idle(stages, ones)[0] == pytest.approx(bubble_formula(name, P, M, v)), name


def test_the_bubble_line_says_why_where_it_is_off_by_more_than_a_compute_slot():
    """zb, P = 2, M = 4: its clock idles each stage 1/13 (0.077); a stage's 12 actions make one
    slot (1 - idle) / 12 of its step. Within a slot: nothing said. Equal compute times and 0.40
    idle: the messages' 0.32 (0.40 - 0.077). Stage 1 computing 3 times as long, no time in
    messages: unequal compute, F, B, W 20 ms on average, the stages 120 and 360 ms."""
    stages = make_schedule("zb", 2, 4)
    equal, uneven = [[0.01] * 12] * 2, [[0.01] * 12, [0.03] * 12]
    assert bubble_why([1 / 13 + 0.07, 1 / 13], stages, equal) == ""            # slot 0.071 here
    said = bubble_why([0.40, 0.40], stages, equal)
    assert said.startswith("; each stage as the schedule runs it (F, B, W a slot each, messages free: "
                           "a later stage ends sooner) idles 0.08 0.08 | measured is off that by more "
                           "than one slot (0.05 0.05 of the step), why: messages: send/recv and the time between computations take 0.32 0.32 "
                           "of the step beyond the schedule's own waits"), said
    replayed = replayed_idle(stages, uneven)
    said = bubble_why(replayed, stages, uneven)
    assert replayed[0] > 0.5 and (f"why: unequal compute: with the measured compute times (F 20.0, B 20.0, "
                                  f"W 20.0 ms on average; the stages computed 120 and 360 ms) and free "
                                  f"messages the schedule idles {replayed[0]:.2f} {replayed[1]:.2f}; send/recv "
                                  f"and the time between computations add 0.00 0.00") in said, said


def test_stage_split_balanced_by_blocks_or_given():
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert split_layers(4, 2, [3, 1]) == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match="4 blocks, fewer than 8 pipeline stages"):
        split_layers(4, 8)
    with pytest.raises(ValueError, match="give 2 numbers, each 1 or more, adding up to the model's 4"):
        split_layers(4, 2, [4, 0])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_without_micro_batches_is_one_clear_error(schedule):
    """Pipeline(..., microbatches=0) made with a schedule's name: one ValueError naming what is
    missing, raised before the constructor's first collective (the comm here has no group)."""
    stage = pipeline.GPTStage(GPT(CFG), range(0, 2), first=True, last=False)
    comm = Comm.__new__(Comm)
    comm.rank, comm.world_size = 0, 2                      # stage 0 of 2, no process group
    with pytest.raises(ValueError, match="at least 1 stage and 1 micro-batch, got 2 stages and 0"):
        pipeline.Pipeline(stage, comm, schedule, 0, CFG.n_embd, torch.float32)


def test_stage_keeps_only_its_parameters_under_their_whole_model_names():
    gpt = GPT(CFG)
    names = {n for n, _ in gpt.named_parameters()}
    stage = pipeline.GPTStage(gpt, range(2, 4), first=False, last=True)
    kept = {n for n, _ in gpt.named_parameters()}
    assert kept == {n for n in names if n.startswith(("blocks.2.", "blocks.3.", "norm.", "head."))}
    assert {"gpt." + n for n in kept} == {n for n, _ in stage.named_parameters()}
    assert stage.tied is None
    tied_last = pipeline.GPTStage(GPT(TIED), range(2, 4), first=False, last=True)
    assert tied_last.tied is tied_last.gpt.head.weight                 # kept as token_emb.weight
    assert "gpt.token_emb.weight" in dict(tied_last.named_parameters())


# ---- train.py --strategy pipeline: same curve as one process, checkpoints, bad input ----------

# The runs, their resume from step 3 and one process's, as tensor parallelism's tests run them.
from test_tensor_parallel import (_copy_first_checkpoint, _single_runs,  # noqa: E402
                                  _straight_and_resumed, _train, _usage_errors, _weights)


def _resumed_as(saved, to, argv):
    """Resume the run in `saved` from its step-3 checkpoint with other flags (another schedule)."""
    _copy_first_checkpoint(saved, to)
    return _train([*argv, "--out", to, "--resume", "--export", to + ".pt"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pp_runs"))
    paths = {name: os.path.join(root, name) for name in ("pp2", "pp4", "single", "interleaved", "zb")}
    for p in paths.values():
        os.makedirs(p)
    pp2 = run_ranks(_straight_and_resumed, 2, paths["pp2"],
                    ["--strategy", "pipeline", "--pp", "2", "--microbatches", "4", "--schedule", "gpipe"], [])[0]
    # The command, shortened: 4 stages, 8 micro-batches, 1F1B.
    pp4 = run_ranks(_train, 4, ["--strategy", "pipeline", "--pp", "4", "--microbatches", "8",
                                "--export", os.path.join(paths["pp4"], "straight.pt")])[0]
    single = run_ranks(_single_runs, 1, paths["single"], paths["pp2"])[0]
    # pp 2 x dp 2 interleaved, two chunks of one block per stage, straight through; zero bubble
    # resumed from the GPipe run's step-3 checkpoint (whole-model names: any schedule reads it).
    pp = ["--strategy", "pipeline", "--pp", "2", "--microbatches", "4"]
    # The interleaved run saves at step 3 too: one process resumes its chunks' checkpoint.
    interleaved = run_ranks(_train, 4, [*pp, "--schedule", "interleaved", "--virtual-stages", "2",
                                        "--out", os.path.join(paths["interleaved"], "saved"),
                                        "--save-every", "3",
                                        "--export", os.path.join(paths["interleaved"], "straight.pt")])[0]
    single["from_interleaved"] = run_ranks(_resumed_as, 1, os.path.join(paths["interleaved"], "saved"),
                                           os.path.join(paths["single"], "from_interleaved"),
                                           ["--strategy", "single"])[0]
    zb = run_ranks(_resumed_as, 2, os.path.join(paths["pp2"], "saved"), os.path.join(paths["zb"], "resumed"),
                   [*pp, "--schedule", "zb"])[0]
    return {"pp2": pp2, "pp4": pp4, "single": single, "interleaved": interleaved, "zb": zb,
            "paths": paths}


# train.py's runs: 6 steps with a warmed-up learning rate; the same fp32 noise as above, grown by
# three more Adam steps (measured: losses 1.1e-7 relative, weights 4e-6 absolute), each weight
# within TRAIN_ATOL x max(1, ADAM_AMPLIFIED / d) where the one-process run's d is known.
TRAIN_RTOL, TRAIN_ATOL = 1e-6, 1e-5


@pytest.mark.equivalence
@pytest.mark.parametrize("name", ["pp2", "pp4", "interleaved"])
def test_train_pipeline_matches_single_process_step_by_step(runs, name):
    run = runs[name]["straight"] if name == "pp2" else runs[name]
    single = runs["single"]["straight"]
    torch.testing.assert_close(list(run["losses"].values()), list(single["losses"].values()),
                               rtol=TRAIN_RTOL, atol=0)
    assert_adam_close(_weights(os.path.join(runs["paths"][name], "straight.pt")),
                      _weights(os.path.join(runs["paths"]["single"], "single.pt")),
                      runs["single"]["adam"]["straight"], TRAIN_ATOL, f"{name} vs single after 6 steps")
    assert all(0 <= b < 1 for bubbles in run["bubble"].values() for b in bubbles)


def test_zero_bubble_resumes_a_gpipe_checkpoint_as_if_uninterrupted(runs):
    # The same sums as GPipe's (tests above): bit for bit the straight GPipe run's steps 3 to 5.
    straight, zb = runs["pp2"]["straight"], runs["zb"]
    assert zb["losses"] == {s: straight["losses"][s] for s in (3, 5)}
    assert_tensors_close(_weights(os.path.join(runs["paths"]["zb"], "resumed.pt")),
                         _weights(os.path.join(runs["paths"]["pp2"], "straight.pt")), rtol=0, atol=0,
                         what="zb resumed from gpipe vs gpipe straight")
    assert all(0 <= b < 1 for bubbles in zb["bubble"].values() for b in bubbles)


def test_pipeline_resume_is_bit_exact(runs):
    straight, again = runs["pp2"]["straight"], runs["pp2"]["resumed"]
    assert list(again["losses"]) == [3, 5]                       # logged every 3 steps and the last
    assert again["losses"] == {s: straight["losses"][s] for s in (3, 5)}
    assert again["eval_loss"] == straight["eval_loss"]
    a, b = (_weights(os.path.join(runs["paths"]["pp2"], f)) for f in ("resumed.pt", "straight.pt"))
    assert_tensors_close(a, b, rtol=0, atol=0, what="resumed pipeline vs uninterrupted")


@pytest.mark.equivalence
def test_pipeline_checkpoint_resumes_and_exports_on_one_process(runs):
    # Each stage wrote its own parameters under whole-model names: one process reads them all.
    from_pp, straight = runs["single"]["from_split"], runs["pp2"]["straight"]
    torch.testing.assert_close([from_pp["losses"][s] for s in (3, 5)],
                               [straight["losses"][s] for s in (3, 5)], rtol=TRAIN_RTOL, atol=0)
    assert_adam_close(_weights(os.path.join(runs["paths"]["pp2"], "straight.pt")),
                      _weights(os.path.join(runs["paths"]["single"], "from_split.pt")),
                      runs["single"]["adam"]["from_split"], TRAIN_ATOL, "pipeline checkpoint resumed on one process")


@pytest.mark.equivalence
def test_interleaved_checkpoint_holds_whole_model_names_and_resumes_on_one_process(runs):
    # Rank r wrote chunks r and r + 2 (blocks r and r + 2) under their whole-model names.
    resumed, straight = runs["single"]["from_interleaved"], runs["interleaved"]
    torch.testing.assert_close([resumed["losses"][s] for s in (3, 5)],
                               [straight["losses"][s] for s in (3, 5)], rtol=TRAIN_RTOL, atol=0)
    assert_tensors_close(_weights(os.path.join(runs["paths"]["single"], "from_interleaved.pt")),
                         _weights(os.path.join(runs["paths"]["interleaved"], "straight.pt")),
                         rtol=0, atol=TRAIN_ATOL, what="interleaved checkpoint resumed on one process")


def _bad_pipeline_inputs():
    return _usage_errors({"world": ["--strategy", "pipeline", "--pp", "3"],
                          "no_strategy": ["--strategy", "ddp", "--schedule", "gpipe"],
                          "batch": ["--strategy", "pipeline", "--pp", "2", "--microbatches", "3"],
                          "grad_accum": ["--strategy", "pipeline", "--pp", "2", "--grad-accum", "2"],
                          "split": ["--strategy", "pipeline", "--pp", "2", "--stage-layers", "3,2"],
                          "chunks": ["--strategy", "pipeline", "--pp", "2", "--schedule", "interleaved",
                                     "--virtual-stages", "4"],
                          "ring": ["--strategy", "pipeline", "--pp", "2", "--schedule", "interleaved",
                                   "--microbatches", "3", "--batch-size", "12"],
                          "virtual": ["--strategy", "pipeline", "--pp", "2", "--virtual-stages", "2"]})


@pytest.fixture(scope="module")
def bad_pp():
    return run_ranks(_bad_pipeline_inputs, 2)


@pytest.mark.parametrize("case, fix", [
    ("world", "world size 2 is not --pp 3 x a data-parallel size: launch a multiple of 3"),
    ("no_strategy", "--microbatches, --schedule, --virtual-stages and --stage-layers cut the model "
                    "into stages: add --pp N (--strategy ddp without it runs the whole model"),
    ("batch", "--batch-size 8 does not divide into 1 data-parallel ranks x --microbatches 3 = 3 equal "
              "micro-batches: use a multiple of 3, e.g. --batch-size 9"),
    ("grad_accum", "use --microbatches instead"),
    ("split", "--stage-layers 3,2: give 2 numbers, each 1 or more, adding up to the model's 4 blocks"),
    ("chunks", "--model tiny: the model has 4 blocks, fewer than 2 pipeline stages x 4 chunks each = 8 "
               "chunks: every chunk needs a block; use fewer --virtual-stages, or a deeper --model"),
    ("ring", "3 micro-batches is not a multiple of 2; use --microbatches 4"),
    ("virtual", "--virtual-stages 2: only --schedule interleaved runs several chunks per stage"),
])
def test_bad_pipeline_input_stops_every_rank_with_the_same_message(bad_pp, case, fix):
    assert bad_pp[0][case] == bad_pp[1][case], bad_pp
    assert fix in bad_pp[0][case], bad_pp[0][case]


def test_fewer_blocks_than_stages_names_the_fix(monkeypatch, capsys):
    import train
    torchrun_worker(monkeypatch, 8)
    with pytest.raises(SystemExit):                              # tiny has 4 blocks
        train.parse_args(["--strategy", "pipeline", "--pp", "8"])
    assert "4 blocks, fewer than 8 pipeline stages: every stage needs a block; use --pp 4" in \
        capsys.readouterr().err


# ---- the textbook's form (issue 56) ---------------------------------------------------------------

def test_the_executor_reads_no_clock_and_its_lines_stay_under_100_characters():
    """The step's timing is observed from outside (mechanics/pipeline_mechanics.py's StepObserver):
    pipeline.py reads no clock and synchronizes no device itself. Its lines stay under 100
    characters, and its engine files' at most 100."""
    import ast
    import pathlib
    root = pathlib.Path(pipeline.__file__).parent
    tree = ast.parse((root / "pipeline.py").read_text())
    used = ({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)})
    clocks = used & {"time", "perf_counter", "monotonic", "synchronize", "_clock"}
    assert not clocks, f"pipeline.py reads a clock itself: {sorted(clocks)}"
    for name, most in [("pipeline.py", 99), ("mechanics/pipeline_mechanics.py", 100),
                       ("extensions/schedules.py", 100), ("extensions/zero_bubble.py", 100)]:
        lines = (root / name).read_text().splitlines()
        long = [i for i, line in enumerate(lines, 1) if len(line) > most]
        assert not long, f"{name}: lines {long} are over {most} characters"
