"""Pipeline schedules as data (schedules.py): GPipe and 1F1B run, their messages match, they
cannot deadlock under NCCL's p2p rules, and their bubble and memory are the lecture's, for many
P and M; the command line (python schedules.py, and python pipeline.py, the same) draws them.
"""
import importlib

import pytest

import schedules
from schedules import Action, SCHEDULES, bubble_fraction, check_schedule, peak_activations, simulate

SIZES = [(P, M) for P in (1, 2, 3, 4, 8) for M in (1, 2, 4, 7, 8, 16)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("P, M", SIZES)
def test_every_forward_precedes_its_backward_and_every_send_is_received(name, P, M):
    stages = SCHEDULES[name](P, M)
    # raises on a missing, misordered or unmatched action, and on a deadlock under NCCL's p2p
    # rules of the groups the executor posts (run_under_nccl), up to 8 stages
    check_schedule(stages, M)
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
    for s, actions in enumerate(schedules.gpipe(P, M)):
        assert peak_activations(actions) == M, s
    for s, actions in enumerate(schedules.one_f_one_b(P, M)):
        assert peak_activations(actions) == min(P - s, M), s


def test_checks_catch_broken_schedules():
    stages = schedules.gpipe(2, 2)
    with pytest.raises(ValueError, match="stage 1 runs F on micro-batches"):
        check_schedule([stages[0], [a for a in stages[1] if a != Action("F", 0)]], 2)
    with pytest.raises(ValueError, match="backward of micro-batch 0 before its forward"):
        check_schedule([stages[0], [Action("B", 0)] + [a for a in stages[1] if a != Action("B", 0)]], 2)
    with pytest.raises(ValueError, match="would not match"):
        check_schedule([[a for a in stages[0] if a != Action("send_act", 1)], stages[1]], 2)
    # Stage 0 first waits for a gradient that stage 1 sends only after stage 0's activations.
    with pytest.raises(ValueError, match="deadlock"):
        simulate([[Action("recv_grad", 0)] + stages[0], stages[1]])


def _receive_ahead(actions):
    """The executor before NCCL's rules were checked: each send posted alone and never waited
    for in the step, the next receive posted as soon as the previous one arrived."""
    receives = [(a,) for a in actions if a.kind.startswith("recv")]
    program = [("post", receives[0])] if receives else []
    for a in actions:
        if a.kind.startswith("recv"):
            k = receives.index((a,))
            program.append(("wait", receives[k]))
            if k + 1 < len(receives):
                program.append(("post", receives[k + 1]))
        else:
            program.append(("post", (a,)) if a.kind.startswith("send") else a)
    return program


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_nccl_rules_catch_a_receive_posted_ahead_of_a_send(name):
    """Under gloo the old order worked; under NCCL stage 0's early receive of gradient 0 sits
    first on its p2p stream, and its send of activation 0, posted after it, waits behind it,
    while stage 1 waits for that activation."""
    stages = SCHEDULES[name](2, 4)
    with pytest.raises(ValueError, match="deadlock under NCCL"):
        schedules.run_under_nccl([_receive_ahead(actions) for actions in stages])
    schedules.run_under_nccl([schedules.nccl_program(actions) for actions in stages])   # the fix


@pytest.mark.parametrize("command", ["schedules", "pipeline"])    # python schedules.py, pipeline.py
def test_command_line_prints_the_timeline_and_the_bubble(command, capsys):
    importlib.import_module(command).main(["--stages", "4", "--microbatches", "8", "--schedule", "1f1b"])
    out = capsys.readouterr().out
    assert out.count("stage ") == 4
    assert "bubble fraction 0.273, formula (P-1)/(M+P-1) = 0.273" in out
    assert "held per stage: 4, 3, 2, 1" in out


def test_command_line_refuses_an_empty_pipeline(capsys):
    with pytest.raises(SystemExit):
        schedules.main(["--stages", "0"])
    assert "--stages and --microbatches must be at least 1" in capsys.readouterr().err
