"""pictures/draw.py, pictures/traces.py and pictures/svg.py: the pictures are well-formed SVG holding the series they
name, and what they draw is what the run did: the log's losses, each stage's actions in
extensions/schedules.py's order, the bytes a strategy holds over a step against references written here."""
import math
import xml.etree.ElementTree as ET

import pytest

from pictures import draw as pictures
from pictures import traces
from running.data import TextData
from foundations.meters import saved_activation_bytes
from model import build_model
from multiprocess import run_ranks, train_logged
from extensions.schedules import COMPUTE, make_schedule
from foundations.flat import MAX_REDUCTIONS_IN_FLIGHT

SVG = "{http://www.w3.org/2000/svg}"
FLAGS = [*pictures.MEMORY_FLAGS, "--bucket-mb", "0.25"]
ROWS, SEQ = pictures.MEMORY_BATCH, 64


def series(svg: str) -> dict:
    """{data-label: [elements]} of the drawn series; parsing fails on malformed XML."""
    found = {}
    for element in ET.fromstring(svg).iter():
        if element.get("class") == "series":
            found.setdefault(element.get("data-label"), []).append(element)
    return found


def points(polyline) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in polyline.get("points").split()]


def test_the_loss_curve_reads_the_numbers_the_log_holds(tmp_path):
    history, _ = run_ranks(train_logged, 1, ["--steps", "4", "--log-every", "1", "--batch-size", "4",
                                             "--seq-len", "32", "--eval-every", "0", "--eval-batches", "1",
                                             "--out", str(tmp_path)])[0]
    logged = traces.logged_losses(str(tmp_path))
    assert list(logged) == [0, 1, 2, 3] == list(history["losses"])
    for step, loss in logged.items():       # the log prints 4 decimals: half a unit of the last
        assert abs(loss - history["losses"][step]) <= 5e-5
    other = {step: loss + 0.5 for step, loss in logged.items()}
    svg = pictures.draw_loss([("run a", logged), ("run b", other)])
    drawn = series(svg)
    assert set(drawn) == {"run a", "run b"}
    a, b = points(drawn["run a"][0]), points(drawn["run b"][0])
    assert len(a) == len(b) == 4
    # Pixels back to losses: the y axis is linear, so run b sits 0.5 above run a at every step,
    # the same pixel gap everywhere (printed to a tenth of a pixel: 0.1 at most apart).
    gaps = [ya - yb for (_, ya), (_, yb) in zip(a, b)]
    assert max(gaps) - min(gaps) <= 0.1 and min(gaps) > 0
    assert "training loss" in svg and pictures.draw_loss([("run a", logged)]) == \
        pictures.draw_loss([("run a", logged)])                               # deterministic


def test_a_log_appended_to_keeps_the_run_that_continued(tmp_path):
    # A 6-step run, then one resumed from step 2's checkpoint with another learning rate: its
    # lines replace steps 2 on; a run started over (--overwrite) replaces everything.
    lines = [f"step {s:5d} | loss {5 - s / 10:.4f} | lr 1e-3" for s in range(6)]
    lines += ["ddp on 2 x cpu (gloo) | model tiny"] + [f"step {s:5d} | loss {9 - s:.4f} |" for s in (2, 3)]
    (tmp_path / "log.txt").write_text("\n".join(lines) + "\n")
    assert traces.logged_losses(str(tmp_path)) == {0: 5.0, 1: 4.9, 2: 7.0, 3: 6.0}
    (tmp_path / "log.txt").write_text("\n".join(lines + ["step     0 | loss 1.0000 |"]) + "\n")
    assert traces.logged_losses(str(tmp_path)) == {0: 1.0}


def test_a_missing_log_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no log.txt"):
        traces.logged_losses(str(tmp_path))
    with pytest.raises(SystemExit):
        pictures.main(["memory", "--ranks", "3", "-o", str(tmp_path / "m.svg")])
    with pytest.raises(SystemExit):
        pictures.main(["schedule", "--schedule", "interleaved", "--stages", "2", "--microbatches", "3",
                       "-o", str(tmp_path / "s.svg")])


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_the_executed_schedule_is_schedules_order_one_action_at_a_time(schedule):
    P, M = 2, 4
    run = run_ranks(traces.executed_schedule, P, ["--pp", str(P), "--microbatches", str(M), "--schedule",
                                                  schedule, "--batch-size", "8", "--seq-len", "32"])[0]
    planned = make_schedule(schedule, P, M)
    for s, row in enumerate(run["rows"]):
        assert [(k, m, c) for k, m, c, _, _ in row] == \
               [(a.kind, a.m, a.chunk) for a in planned[s] if a.kind in COMPUTE]
        for (*_, t0, t1), (*_, u0, _) in zip(row, row[1:] + [(None,) * 3 + (math.inf, None)]):
            assert 0 <= t0 <= t1 <= u0          # one rank computes one action at a time, in order
    drawn = series(pictures.draw_schedule(run))
    actions = 2 * sum(len(row) for row in run["rows"])          # executed + simulated bars
    assert sum(len(bars) for bars in drawn.values()) == actions
    assert len(drawn["F0"]) == 2 * P                            # F0 on each stage, twice


@pytest.fixture(scope="module")
def memory():
    """rank 0's trace of each strategy, 2 ranks (single: 1), the tiny model, 8 x 64 tokens."""
    return {s: run_ranks(traces.memory_over_a_step, 1 if s == "single" else 2, s, FLAGS)[0]
            for s in ("single", "ddp", "zero2", "fsdp")}


def _column(trace, key):
    return [row[key] for row in trace["samples"]]


def _tiny_units() -> tuple[int, int, int]:
    """(parameters, one block's, the root's: embeddings, final norm and head) of the tiny GPT."""
    gpt = build_model("tiny")
    block = sum(p.numel() for p in gpt.blocks[0].parameters())
    total = sum(p.numel() for p in gpt.parameters())
    return total, block, total - gpt.cfg.n_layer * block


def test_activations_rise_through_forward_fall_through_backward(memory):
    for strategy, trace in memory.items():
        events, acts = _column(trace, "event"), _column(trace, "activations")
        loss, done = events.index("loss"), events.index("backward done")
        assert acts[:loss + 1] == sorted(acts[:loss + 1]), strategy            # forward: only up
        assert acts[loss:done + 1] == sorted(acts[loss:done + 1], reverse=True), strategy
        assert acts[0] == acts[done] == 0, strategy                            # all released
        # The reference: one process, the traced step's rows of rank 0 (the batch's storages
        # count too: the embedding keeps its token ids), every storage autograd saved (foundations/meters.py).
        gpt = build_model("tiny")
        x, y = TextData.from_file().batch(1, ROWS, SEQ, 0, rank=0, world_size=trace["world_size"])
        saved, _ = saved_activation_bytes(lambda: gpt(x, y), [*gpt.parameters(), *gpt.buffers()])
        assert max(acts) == acts[loss] == saved, strategy


def test_fsdp_gathers_unit_by_unit_and_returns_to_shards(memory):
    total, block, root = _tiny_units()
    shard = lambda numel: -(-numel // 2) * 4                   # noqa: E731  fp32, padded over 2
    shards = 4 * shard(block) + shard(root)
    params = _column(memory["fsdp"], "params")
    assert params[0] == params[-1] == min(params) == shards
    # At most the root and two blocks gathered at once (a block and the one prefetched).
    assert max(params) == shards + 2 * shard(root) + 2 * 2 * shard(block)
    rises = sum(b > a for a, b in zip(params, params[1:]))
    assert rises >= 5                                     # every unit: 4 blocks and the root


def test_zero2_frees_gradient_buckets_as_reduced(memory):
    total, _, _ = _tiny_units()
    assert max(_column(memory["ddp"], "grads")) == 4 * total          # ddp: the whole gradient
    zero2 = _column(memory["zero2"], "grads")
    # Its shard of every reduced bucket, plus whole buckets only while filled or in flight: each
    # at most 0.25 MiB (--bucket-mb; tiny's largest parameter, 128 x 512 fp32, is exactly that).
    bound = -(-total // 2) * 4 + (MAX_REDUCTIONS_IN_FLIGHT + 1) * 2**18
    assert max(zero2) <= bound < 4 * total
    assert zero2[-1] == -(-total // 2) * 4                         # then the shards alone


def test_the_memory_picture_has_a_panel_per_strategy_on_one_scale(memory):
    svg = pictures.draw_memory(list(memory.values()))
    drawn = series(svg)
    for k in pictures.STACK:
        assert len(drawn[k]) == len(memory)                  # one band per panel
        assert len(drawn[f"predicted {k}"]) == len(memory)   # napkin/memory.py's line per panel
    titles = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text") if t.get("font-weight") == "bold"]
    assert titles == ["single", "ddp (rank 0 of 2)", "zero2 (rank 0 of 2)", "fsdp (rank 0 of 2)"]


@pytest.mark.parametrize("argv, message", [
    (["memory", "-o", "{missing}/m.svg"], "there is no directory {missing}: create it"),
    (["loss", "{tmp}", "-o", "{missing}/l.svg"], "there is no directory {missing}: create it"),
    (["schedule", "-o", "{tmp}"], "-o {tmp}: the picture is SVG"),
    (["schedule", "-o", "{tmp}/d.svg"], "-o {tmp}/d.svg is a directory: name a file in it"),
    (["schedule", "--schedule", "interleaved", "--virtual-stages", "0", "-o", "{tmp}/s.svg"],
     "--virtual-stages must be at least 1"),
])
def test_bad_input_stops_in_one_line_before_any_rank_starts(argv, message, tmp_path, capsys, monkeypatch):
    """Checked before the runs that draw the picture (seconds of them): traces.spawn is never
    reached, and nothing is created."""
    (tmp_path / "d.svg").mkdir()
    monkeypatch.setattr(traces, "spawn", None)                   # a rank started would fail here
    paths = {"tmp": str(tmp_path), "missing": str(tmp_path / "missing")}
    with pytest.raises(SystemExit) as stop:
        pictures.main([a.format(**paths) for a in argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert stop.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert message.format(**paths) in errors[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.svg"]


def test_a_diverged_or_damaged_log_draws_its_finite_losses(tmp_path, capsys):
    """A loss of NaN or inf (a run that diverged) is left out of the curve, its step named on
    stderr; a line of bytes that are not UTF-8 is skipped, not a codec error."""
    (tmp_path / "log.txt").write_bytes(b"step     0 | loss 5.0000 |\nstep     1 | loss nan |\n"
                                       b"\xff\xfe damaged\nstep     2 | loss inf |\n"
                                       b"step     3 | loss 4.0000 |\n")
    assert traces.logged_losses(str(tmp_path)) == {0: 5.0, 3: 4.0}
    assert "step 1, 2 logged a loss of inf or NaN" in capsys.readouterr().err
    pictures.main(["loss", str(tmp_path), "-o", str(tmp_path / "loss.svg")])
    assert len(series((tmp_path / "loss.svg").read_text())) == 1
