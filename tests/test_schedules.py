"""Pipeline schedules as data (extensions/schedules.py): GPipe, 1F1B, interleaved 1F1B and zero bubble
(ZB-H1) run, their messages match, they cannot deadlock under NCCL's p2p rules, and their bubble
and memory are the formulas, for many P, M (and v); the command line (python -m extensions.schedules)
draws them.
"""

import pytest

from extensions import schedules
from mechanics.pipeline_mechanics import bubble_formula, bubble_fraction, peak_activations, simulate
from extensions.schedules import Action, check_schedule, make_schedule

SIZES = [(P, M) for P in (1, 2, 3, 4, 8) for M in (1, 2, 4, 7, 8, 16)]
# Interleaved: at least 2 stages, M a multiple of P, v chunks per stage.
INTERLEAVED = [(P, k * P, v) for P in (2, 3, 4, 8) for k in (1, 2, 4) for v in (2, 3, 4)]
CASES = ([(name, P, M, 1) for name in ("gpipe", "1f1b", "zb") for P, M in SIZES]
         + [("interleaved", P, M, v) for P, M, v in INTERLEAVED])


@pytest.mark.parametrize("name, P, M, v", CASES)
def test_every_forward_precedes_its_backward_and_every_send_is_received(name, P, M, v):
    stages = make_schedule(name, P, M, v)
    # raises on a missing, misordered or unmatched action, and on a deadlock under NCCL's p2p
    # rules of the groups the executor posts (run_under_nccl), up to 8 stages
    check_schedule(stages, M)
    simulate(stages)                           # raises on a deadlock
    evaluation = schedules.forwards_only(P, M, v)
    schedules.run_under_nccl([schedules.nccl_program(actions) for actions in evaluation])


@pytest.mark.parametrize("name, P, M, v", CASES)
def test_bubble_is_the_formula(name, P, M, v):
    # F, B (and W) one slot each. GPipe and 1F1B: 2(M+P-1) slots per stage, 2M busy. Interleaved:
    # 2(vM+P-1) slots of a chunk each, 2vM busy. ZB-H1: 3M busy of 3M+P-1, once M >= P.
    if name == "zb" and M < P:
        return
    rows = simulate(make_schedule(name, P, M, v))
    busy = {"zb": 3 * M, "interleaved": 2 * v * M}.get(name, 2 * M)
    assert sum(cell != "" for cell in rows[0]) == busy
    assert bubble_fraction(rows) == pytest.approx(bubble_formula(name, P, M, v), abs=1e-12)


@pytest.mark.parametrize("P, M", [(P, M) for P, M in SIZES if M >= P > 1])
def test_zero_bubble_idles_a_third_of_1f1b_when_a_backward_is_b_plus_w(P, M):
    """Counted in the same units (F, B, W one slot; 1F1B's whole backward B + W, two slots):
    1F1B idles (P-1)(F+B+W) per stage, ZB-H1 (P-1)(F+B-W), a third."""
    one_f_one_b = simulate(schedules.one_f_one_b(P, M), {"B": 2})
    zb = simulate(schedules.zero_bubble(P, M))
    assert len(one_f_one_b[0]) == 3 * M + 3 * (P - 1) and len(zb[0]) == 3 * M + (P - 1)
    idle = [sum(cell == "" for r in rows for cell in r) for rows in (one_f_one_b, zb)]
    assert idle[1] * 3 == idle[0]


@pytest.mark.parametrize("F, B, W", [(2, 1, 1), (2, 2, 1), (3, 2, 1)])
@pytest.mark.parametrize("P, M", [(P, M) for P, M in SIZES if M >= P > 1])
def test_zero_bubble_idles_its_formula_when_a_forward_costs_more_than_w(F, B, W, P, M):
    """With F, B, W slots unequal (a forward as long as a whole backward, B + W = F, or longer),
    ZB-H1's stages idle (P-1)(F+B-W) of M(F+B+W) + (P-1)(F+B-W) slots (Qi et al. 2024)."""
    rows = simulate(schedules.zero_bubble(P, M), {"F": F, "B": B, "W": W})
    idle = (P - 1) * (F + B - W)
    assert bubble_fraction(rows) == pytest.approx(idle / (M * (F + B + W) + idle), abs=1e-12)


@pytest.mark.parametrize("P, M", SIZES)
def test_1f1b_holds_at_most_p_micro_batches_gpipe_holds_m(P, M):
    for s, actions in enumerate(schedules.gpipe(P, M)):
        assert peak_activations(actions) == M, s
    for s, actions in enumerate(schedules.one_f_one_b(P, M)):
        assert peak_activations(actions) == min(P - s, M), s


@pytest.mark.parametrize("P, M", SIZES)
def test_zero_bubble_holds_no_more_than_1f1b(P, M):
    """ZB-H1 keeps a micro-batch from its F to its W: every stage holds what 1F1B's stage 0 does."""
    for s, actions in enumerate(schedules.zero_bubble(P, M)):
        assert peak_activations(actions) == min(P, M) if M >= P else peak_activations(actions) <= M, s


@pytest.mark.parametrize("P, M, v", INTERLEAVED)
def test_interleaved_holds_the_warm_up_plus_one_chunk(P, M, v):
    """Stage s runs 2(P-1-s) + (v-1)P forwards before its first backward: that many micro-batch
    chunks plus one, each 1/v of a stage's activations (or all vM, if fewer)."""
    for s, actions in enumerate(schedules.interleaved(P, M, v)):
        assert peak_activations(actions) == min(v * M, 2 * (P - 1 - s) + (v - 1) * P + 1), s


def test_interleaved_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="6 micro-batches is not a multiple of 4; use --microbatches 8"):
        schedules.interleaved(4, 6, 2)
    with pytest.raises(ValueError, match="needs at least 2, got 1"):
        schedules.interleaved(1, 4, 2)
    with pytest.raises(ValueError, match="only --schedule interleaved runs several chunks"):
        make_schedule("1f1b", 2, 4, 2)
    assert schedules.interleaved(4, 8, 1) == schedules.one_f_one_b(4, 8)


def test_messages_between_two_stages_are_received_in_the_order_sent():
    """NCCL pairs a send with the peer's receive by order alone: two stages of an interleaved
    pipeline trade activations and gradients both ways, and swapping two of stage 0's sends
    to stage 1 would hand each receive the other's tensor."""
    stages = schedules.interleaved(2, 4, 2)
    sends = [i for i, a in enumerate(stages[0]) if a.kind.startswith("send")]
    i, j = next((i, j) for i, j in zip(sends, sends[1:]) if j == i + 1)      # two in one group
    swapped = list(stages[0])
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ValueError, match="would not match"):
        check_schedule([swapped, stages[1]], 4)


def test_evaluating_chunk_by_chunk_would_deadlock_under_nccl():
    """All M forwards through chunk 0, then chunk 1: the last stage sends chunk 0's outputs on to
    stage 0, whose stream is still blocked sending its own, unreceived; forwards_only goes P
    micro-batches at a time instead."""
    P, M, v = 2, 4, 2
    chunk_by_chunk = [[a for c in range(v) for m in range(M) for a in schedules.forward_actions(s, P, m, c, P * v)]
                      for s in range(P)]
    with pytest.raises(ValueError, match="deadlock under NCCL"):
        schedules.run_under_nccl([schedules.nccl_program(actions) for actions in chunk_by_chunk])
    schedules.run_under_nccl([schedules.nccl_program(a) for a in schedules.forwards_only(P, M, v)])


def test_checks_catch_broken_schedules():
    stages = schedules.gpipe(2, 2)
    with pytest.raises(ValueError, match="stage 1 runs F on micro-batches"):
        check_schedule([stages[0], [a for a in stages[1] if a != Action("F", 0)]], 2)
    with pytest.raises(ValueError, match="B of micro-batch 0 \\(chunk 0\\) before its F"):
        check_schedule([stages[0], [Action("B", 0)] + [a for a in stages[1] if a != Action("B", 0)]], 2)
    zb = schedules.zero_bubble(2, 2)
    with pytest.raises(ValueError, match="W of micro-batch 1 \\(chunk 0\\) before its B"):
        check_schedule([zb[0], [Action("W", 1)] + [a for a in zb[1] if a != Action("W", 1)]], 2)
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


@pytest.mark.parametrize("name", sorted(schedules.SCHEDULES))
def test_nccl_rules_catch_a_receive_posted_ahead_of_a_send(name):
    """Under gloo the old order worked; under NCCL stage 0's early receive of gradient 0 sits
    first on its p2p stream, and its send of activation 0, posted after it, waits behind it,
    while stage 1 waits for that activation."""
    stages = make_schedule(name, 2, 4, 2 if name == "interleaved" else 1)
    with pytest.raises(ValueError, match="deadlock under NCCL"):
        schedules.run_under_nccl([_receive_ahead(actions) for actions in stages])
    schedules.run_under_nccl([schedules.nccl_program(actions) for actions in stages])   # the fix


def test_command_line_prints_the_timeline_and_the_bubble(capsys):
    schedules.main(["--stages", "4", "--microbatches", "8", "--schedule", "1f1b"])
    out = capsys.readouterr().out
    assert out.count("stage ") == 4
    assert "bubble fraction 0.273, formula (P-1)/(M+P-1) = 0.273" in out
    assert "held per stage: 4, 3, 2, 1" in out


@pytest.mark.parametrize("schedule, v, bubble, held", [
    ("interleaved", "2", "bubble fraction 0.158, formula (P-1)/(vM+P-1) = 0.158", "11, 9, 7, 5"),
    ("zb", None, "bubble fraction 0.111, formula (P-1)/(3M+P-1) = 0.111", "4, 4, 4, 4")])
def test_command_line_draws_the_new_schedules(schedule, v, bubble, held, capsys):
    schedules.main(["--stages", "4", "--microbatches", "8", "--schedule", schedule]
                   + (["--virtual-stages", v] if v else []))
    out = capsys.readouterr().out
    assert sum(line.startswith("stage ") for line in out.splitlines()) == 4 and bubble in out and f"held per stage: {held}" in out
    assert ("F7.1" if v else "W7") in out


def test_command_line_refuses_an_empty_pipeline(capsys):
    with pytest.raises(SystemExit):
        schedules.main(["--stages", "0"])
    assert "--stages and --microbatches must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--virtual-stages", "0"], "--virtual-stages 0: only --schedule interleaved runs several chunks"),
    (["--schedule", "interleaved", "--virtual-stages", "0"], "--virtual-stages must be at least 1"),
    (["--microbatches", "0"], "--stages and --microbatches must be at least 1"),
])
def test_command_line_refuses_bad_input_in_one_line(argv, message, capsys):
    """--virtual-stages 0 is refused, not taken as the default 2 (interleaved) or 1."""
    with pytest.raises(SystemExit) as stop:
        schedules.main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert stop.value.code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err, err


@pytest.mark.parametrize("name, P, M, v", CASES)
def test_a_schedules_forwards_are_the_evaluation_checked_for_nccl(name, P, M, v):
    """The executor evaluates with its training list's forwards (and their messages), in order
    (pipeline.Pipeline): for every schedule those are forwards_only's lists, which the test above
    plays under NCCL's rules."""
    forwards = [[a for a in actions if a.kind in ("F", "recv_act", "send_act")]
                for actions in make_schedule(name, P, M, v)]
    assert forwards == schedules.forwards_only(P, M, v)
