"""Pipeline parallelism (pipeline.py): the schedules as data, and the executor against one process.

The schedules: they run, their messages match, their bubble and memory are the lecture's,
for many P and M. The executor: P = 2 and 4 stages, M in {1, 4, 8}, GPipe and 1F1B, and
P = 2 x D = 2, train a few clipped AdamW steps (fp32) of a small GPT on CPU ranks, against
one process training on the same whole batches.
"""
import pytest
import torch
import torch.distributed as dist

import pipeline
from collectives import Comm, make_mesh
from ddp import DDP
from mixed_precision import MixedPrecisionOptimizer
from model import GPT, GPTConfig
from multiprocess import assert_tensors_close, run_ranks
from pipeline import Action, SCHEDULES, bubble_fraction, check_schedule, peak_activations, simulate

SIZES = [(P, M) for P in (1, 2, 3, 4, 8) for M in (1, 2, 4, 7, 8, 16)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("P, M", SIZES)
def test_every_forward_precedes_its_backward_and_every_send_is_received(name, P, M):
    stages = SCHEDULES[name](P, M)
    check_schedule(stages, M)                  # raises on a missing, misordered or unmatched action
    simulate(stages)                           # raises on a deadlock


@pytest.mark.parametrize("P, M", SIZES)
def test_bubble_is_the_formula_for_both_schedules(P, M):
    # F and B one slot each: 2(M+P-1) slots per stage, 2M of them busy, for GPipe and 1F1B alike.
    for name in SCHEDULES:
        rows = simulate(SCHEDULES[name](P, M))
        assert len(rows[0]) == 2 * (M + P - 1), name
        assert bubble_fraction(rows) == pytest.approx((P - 1) / (M + P - 1), abs=1e-12), name


@pytest.mark.parametrize("P, M", SIZES)
def test_1f1b_holds_at_most_p_micro_batches_gpipe_holds_m(P, M):
    for s, actions in enumerate(pipeline.gpipe(P, M)):
        assert peak_activations(actions) == M, s
    for s, actions in enumerate(pipeline.one_f_one_b(P, M)):
        assert peak_activations(actions) == min(P - s, M), s


def test_checks_catch_broken_schedules():
    stages = pipeline.gpipe(2, 2)
    with pytest.raises(ValueError, match="stage 1 runs F on micro-batches"):
        check_schedule([stages[0], [a for a in stages[1] if a != Action("F", 0)]], 2)
    with pytest.raises(ValueError, match="backward of micro-batch 0 before its forward"):
        check_schedule([stages[0], [Action("B", 0)] + [a for a in stages[1] if a != Action("B", 0)]], 2)
    with pytest.raises(ValueError, match="would not match"):
        check_schedule([[a for a in stages[0] if a != Action("send_act", 1)], stages[1]], 2)
    # Stage 0 first waits for a gradient that stage 1 sends only after stage 0's activations.
    with pytest.raises(ValueError, match="deadlock"):
        simulate([[Action("recv_grad", 0)] + stages[0], stages[1]])


def test_command_line_prints_the_timeline_and_the_bubble(capsys):
    pipeline.main(["--stages", "4", "--microbatches", "8", "--schedule", "1f1b"])
    out = capsys.readouterr().out
    assert out.count("stage ") == 4
    assert "bubble fraction 0.273, formula (P-1)/(M+P-1) = 0.273" in out
    assert "held per stage: 4, 3, 2, 1" in out


def test_command_line_refuses_an_empty_pipeline(capsys):
    with pytest.raises(SystemExit):
        pipeline.main(["--stages", "0"])
    assert "--stages and --microbatches must be at least 1" in capsys.readouterr().err


# ---- the executor, against one process -----------------------------------------------------------

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=64)
B, T, STEPS = 8, 16, 3
MICROBATCHES = (1, 4, 8)


def _batches():
    torch.manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (B, T + 1)) for _ in range(STEPS)]


def _optimizer(params, grad_norm=None):
    return MixedPrecisionOptimizer(params, torch.optim.AdamW, precision="fp32", grad_norm=grad_norm,
                                   lr=1e-2, weight_decay=0.1)


def _single():
    """One process, whole batches: losses, first step's gradients, final parameters."""
    torch.manual_seed(0)
    gpt = GPT(CFG)
    optimizer = _optimizer(gpt.parameters())
    losses, grads = [], None
    for batch in _batches():
        _, loss = gpt(batch[:, :-1], batch[:, 1:])
        loss.backward()
        grads = grads or {n: p.grad.clone() for n, p in gpt.named_parameters()}
        optimizer.step(clip_grad=0.5)                     # clipped: the global norm matters
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach() for n, p in gpt.named_parameters()}}


def _pipeline_trains(P, runs):
    """On P x D ranks: each (schedule, M) in runs trained from the same init; per run this rank's
    losses, first gradients, final parameters, and the executor's counts."""
    comm = Comm()
    pipe, data = make_mesh(comm, P)                       # stage = pipe.rank, replica = data.rank
    results = []
    for schedule, M in runs:
        torch.manual_seed(0)
        gpt = GPT(CFG)
        layers = pipeline.split_layers(CFG.n_layer, P)[pipe.rank]
        stage = pipeline.GPTStage(gpt, layers, first=pipe.rank == 0, last=pipe.rank == P - 1)
        module = DDP(stage, data) if data.world_size > 1 else stage
        runner = pipeline.Pipeline(module, pipe, schedule, M, CFG.n_embd, torch.float32)
        optimizer = _optimizer(gpt.parameters(), runner.grad_norm)
        losses, grads = [], None
        for batch in _batches():
            rows = batch.chunk(data.world_size)[data.rank]                # (B/D, T+1)
            loss = runner.train_step(rows[:, :-1], rows[:, 1:])
            if data.world_size > 1:
                module.finish_gradient_sync()
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=data.group)
            grads = grads or {n: p.grad.clone() for n, p in gpt.named_parameters()}
            optimizer.step(clip_grad=0.5)
            optimizer.zero_grad()
            losses.append(loss.item())
        results.append({"losses": losses, "grads": grads, "peak": runner.peak_activations,
                        "params": {n: p.detach() for n, p in gpt.named_parameters()},
                        "busy": runner.busy, "wall": runner.wall})
    return results


def _whole(ranks, run, key):
    """One {name: tensor} over the stages (replicas hold the same, rank order keeps stage 0 first)."""
    return {name: t for rank in ranks for name, t in rank[run][key].items()}


# Micro-batches and stages change only the order of sums: the mean over B as M means over B/M,
# gradients accumulated over M backwards, the clipping norm summed over stages. Losses and
# first-step gradients: measured 1.2e-7 relative and 2.4e-8 absolute, allowed 1e-6 and 1e-7.
# Parameters after 3 Adam steps: Adam's division by sqrt(v) amplifies that noise on elements
# whose gradients are near zero (as in tensor parallelism's tests): measured 1.2e-6, allowed 5e-6.
RTOL, ATOL, PARAM_ATOL = 1e-6, 1e-7, 5e-6


@pytest.mark.parametrize("P", [2, 4])
def test_pipeline_equals_one_process(P):
    runs = [(schedule, M) for M in MICROBATCHES for schedule in ("gpipe", "1f1b")]
    ranks = run_ranks(_pipeline_trains, P, P, runs)
    single = _single()
    for i, (schedule, M) in enumerate(runs):
        what = f"P={P} M={M} {schedule}"
        assert ranks[0][i]["losses"] == pytest.approx(single["losses"], rel=RTOL), what
        assert_tensors_close(_whole(ranks, i, "grads"), single["grads"], RTOL, ATOL, what + " grads")
        assert_tensors_close(_whole(ranks, i, "params"), single["params"], RTOL, PARAM_ATOL, what + " params")
        if schedule == "1f1b":   # the same micro-batches, backwards in the same order: bit for bit
            for key in ("grads", "params"):
                assert_tensors_close(_whole(ranks, i, key), _whole(ranks, i - 1, key), 0, 0,
                                     what + " vs gpipe " + key)


@pytest.mark.parametrize("P", [2, 4])
def test_executor_holds_what_the_schedule_says(P):
    """Counted by the executor: GPipe keeps M micro-batches' graphs, 1F1B at most P - s."""
    runs = [(schedule, M) for M in (4, 8) for schedule in ("gpipe", "1f1b")]
    ranks = run_ranks(_pipeline_trains, P, P, runs)
    for s, rank in enumerate(ranks):
        for i, (schedule, M) in enumerate(runs):
            assert rank[i]["peak"] == (M if schedule == "gpipe" else min(P - s, M)), (s, schedule, M)
            assert 0 < rank[i]["busy"] < rank[i]["wall"]


def test_pipeline_times_data_parallel_equals_one_process():
    ranks = run_ranks(_pipeline_trains, 4, 2, [("1f1b", 2), ("gpipe", 2)])   # P=2 x D=2
    single = _single()
    for i in range(2):
        assert ranks[0][i]["losses"] == pytest.approx(single["losses"], rel=RTOL)
        # Replicas 0 and 1 of each stage: ranks (0, 2) hold stage 0, (1, 3) stage 1.
        for replica in (ranks[:2], ranks[2:]):
            assert_tensors_close(_whole(replica, i, "params"), single["params"], RTOL, PARAM_ATOL, "P=2 x D=2")


def test_stage_split_balanced_by_blocks_or_given():
    assert pipeline.split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert pipeline.split_layers(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert pipeline.split_layers(4, 2, [3, 1]) == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match="4 blocks, fewer than 8 pipeline stages"):
        pipeline.split_layers(4, 8)
    with pytest.raises(ValueError, match="give 2 numbers, each 1 or more, adding up to the model's 4"):
        pipeline.split_layers(4, 2, [4, 0])


def test_stage_keeps_only_its_parameters_under_their_whole_model_names():
    gpt = GPT(CFG)
    names = {n for n, _ in gpt.named_parameters()}
    stage = pipeline.GPTStage(gpt, range(2, 4), first=False, last=True)
    kept = {n for n, _ in gpt.named_parameters()}
    assert kept == {n for n in names if n.startswith(("blocks.2.", "blocks.3.", "norm.", "head."))}
    assert {"gpt." + n for n in kept} == {n for n, _ in stage.named_parameters()}
    with pytest.raises(ValueError, match="ties its head to its token embedding"):
        pipeline.GPTStage(GPT(GPTConfig(**{**CFG.__dict__, "tie_embeddings": True})), range(2),
                          first=True, last=False)
