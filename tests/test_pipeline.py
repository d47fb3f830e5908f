"""pipeline.py's schedules as data: they run, they match, their bubble and memory are the lecture's."""
import pytest

import pipeline
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
