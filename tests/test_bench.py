"""bench/compare.py end to end on 2 CPU ranks: the tables have every column, numbers and JSON agree.

A smoke test only: it checks that the benchmark runs and reports what it promises, never how
fast anything is (timings on a shared CPU say nothing a test could rely on).
"""
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench.compare import inside_priced, parse_args, strategy_priced
from foundations.comm import ring_bytes
from foundations.flat import step_message_bytes
from model import build_model
from multiprocess import bench_logged, run_ranks
from napkin.machines import block_key, recorded
from napkin.step_time import predict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGY_COLUMNS = ["strategy", "ours ms/step", "torch ms/step", "predicted ms", "ours/torch", "ours tokens/s",
                    "ours peak MiB", "torch peak MiB", "activations MiB (ours / torch)",
                    "ours sent MiB/step (ring volume of the calls / napkin)",
                    "torch sent MiB/step", "ours MFU"]
COLLECTIVE_COLUMNS = ["ring us", "native us", "ring/native", "ring busbw GB/s", "native busbw GB/s",
                      "sent per rank, B (ring counter / formula)"]
MOE_COLUMNS = ["expert parallelism", "ms/step", "predicted ms", "tokens/s",
               "expert weights MiB per rank (measured / napkin)", "peak MiB per rank (measured / napkin)",
               "all-to-all MiB/step (counter / napkin)", "sent MiB/step (counter / napkin)", "loss"]
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?%?")


def run_bench(directory, ranks: int, strategies: str, *extra):
    """bench/compare.py --quick on `ranks` CPU ranks, 1 warm-up + 2 timed steps x 2 repetitions:
    (what it printed, its JSON)."""
    path = directory / "bench.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "-m", "bench", "--quick", "--strategies", strategies, "--warmup", "1", "--steps", "2",
               "--repeats", "2", *extra, "--json", str(path)]
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(path) as f:
        return result.stdout, json.load(f)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One quick run: zero2 (ours vs ZeroRedundancyOptimizer), fsdp (vs fully_shard), tp (vs
    parallelize_module), activation checkpointing (ours vs torch.utils.checkpoint), the 1F1B
    pipeline (ours vs torch.distributed.pipelining), tiny-moe at ep 2 against ep 1, and the
    1 KB and 4 KB all-reduces and all-to-alls."""
    return run_bench(tmp_path_factory.mktemp("bench"), 2,
                     "zero2,fsdp,tp,checkpointing,pipeline-1f1b,pipeline-interleaved,pipeline-zb,moe,collectives",
                     "--max-mb", "0.004")


def bench_in_ranks(directory, ranks: int, strategies: str, *extra, repeats: int):
    """run_bench's run, x `repeats` repetitions, in forked ranks (run_ranks: torchrun's workers would each import torch, bench's
    torch parts and torch._dynamo again; the quick fixture is bench/compare.py's torchrun launch)."""
    path = directory / "bench.json"
    output = run_ranks(bench_logged, ranks, ["--quick", "--strategies", strategies, "--warmup", "1", "--steps",
                                             "2", "--repeats", str(repeats), *extra, "--json", str(path)])[0]
    return output, json.loads(path.read_text())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The FSDP rows that need more: hsdp (2 shard groups of 2) and fsdp-lora on 4 ranks. One
    repetition: their tests read the last run's loss, bytes and peak, no timing statistics."""
    output, data = bench_in_ranks(tmp_path_factory.mktemp("sharded"), 4, "hsdp,fsdp-lora", repeats=1)
    return output, {r["strategy"]: r for r in data["strategies"]}


def table(output, first_column):
    """The Markdown table whose header starts with `first_column`: (header cells, rows of cells)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:                                   # after the header and ---
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    return cells(lines[start]), rows


def assert_finite_cells(row, allowed_text=("n/a",)):
    for cell in row:
        if cell in allowed_text:
            continue
        numbers = NUMBER.findall(cell)
        assert numbers, f"no number in cell {cell!r} of {row}"
        for number in numbers:
            value = float(number.replace(",", "").rstrip("%"))
            assert math.isfinite(value), f"{cell!r} in {row}"
        assert not re.search(r"nan|inf", cell, re.I), f"{cell!r} in {row}"


def test_header_names_the_machine_and_the_run(bench):
    output, _ = bench
    header = output.splitlines()[0]
    for words in ("cores", "torch", "gloo", "world size 2", "model tiny", "fp32",
                  "global batch 16 x seq len 64"):
        assert words in header, header


def test_strategy_table_has_every_column_and_finite_numbers(bench):
    output, _ = bench
    columns, rows = table(output, "strategy")
    assert columns == STRATEGY_COLUMNS
    assert [row[0] for row in rows] == ["zero2", "fsdp", "tp", "checkpointing", "pipeline-1f1b",
                                        "pipeline-interleaved", "pipeline-zb"]
    for row in rows:
        assert len(row) == len(columns), row
        assert row[STRATEGY_COLUMNS.index("ours MFU")] == "n/a"          # CPU: no MFU
        assert_finite_cells(row[1:])
    # torch's DDP counts nothing; the checkpointing row runs our DDP on both sides
    assert rows[0][STRATEGY_COLUMNS.index("torch sent MiB/step")] == "n/a"


@pytest.mark.parametrize("collective", ["all-reduce", "all-to-all"])
def test_collectives_tables_cover_the_sizes(bench, collective):
    output, _ = bench
    columns, rows = table(output, f"{collective} size")
    # all-reduce also times the ring's messages alone (no reduction): the floor under a ring
    floor = ["ring's messages alone / native"] if collective == "all-reduce" else []
    assert columns == [f"{collective} size", *COLLECTIVE_COLUMNS[:3], *floor, *COLLECTIVE_COLUMNS[3:]]
    assert [row[0] for row in rows] == ["1 KB", "4 KB"]
    for row in rows:
        assert_finite_cells(row[1:], allowed_text=())


def test_ring_collectives_send_what_the_formulas_say(bench):
    """Our ring's counter (what its sends carried) against collectives.ring_bytes and
    all_to_all_bytes, per call: all-reduce 2(N-1)/N of the size, all-to-all (N-1)/N of it."""
    _, data = bench
    for name, share in (("all_reduce", 1), ("all_to_all", 0.5)):              # N = 2
        rows = data["collectives"][name]
        assert [r["bytes"] for r in rows] == [1024, 4096]
        for r in rows:
            assert r["ring_sent_bytes"] == r["formula_bytes"] == share * r["bytes"], (name, r)
            for side in ("ring", "native", "transfer_only")[:3 if name == "all_reduce" else 2]:
                assert math.isfinite(r[side]["busbw_GBps"]) and r[side]["busbw_GBps"] > 0


def test_expert_parallelism_halves_the_experts_and_sends_the_formula(bench):
    """tiny-moe at ep 2 against ep 1 on 2 ranks, both our DDP: the same training (each rank
    routes its own tokens either way: fp32, only the order of cross-rank sums differs), half the
    expert weights per rank, and the all-to-all counter equal to napkin/memory.py's formula (capacity
    mode: a fixed buffer, whatever the routing); ep 1 sends none."""
    output, data = bench
    row = data["moe"]
    assert row["model"] == "tiny-moe" and [r["ep"] for r in row["runs"]] == [1, 2]
    ep1, ep2 = row["runs"]
    assert math.isclose(ep1["last_loss"], ep2["last_loss"], rel_tol=1e-5), (ep1, ep2)
    assert ep2["expert_bytes"] * 2 == ep1["expert_bytes"] == 4 * 8 * 4 * (8 * 128**2 + 5 * 128)
    for r in row["runs"]:
        assert r["expert_bytes"] == r["napkin_expert_bytes"]
        assert r["all_to_all_per_step"] == r["napkin_all_to_all_per_step"]
        # ddp's buckets and flags exactly; at ep 2 the clip's norm adds the experts' squares over
        # the expert group (the optimizer split over "ep", placements.grad_norm): one fp32 all-reduce,
        # not in ddp's formula
        norm = ring_bytes("all_reduce", 1, 4, 2) if r["ep"] > 1 else 0
        assert r["sent_per_step"] - r["napkin_sent_per_step"] == norm, r
        assert r["peak_bytes"] == pytest.approx(r["napkin_held_bytes"], rel=0.01)
        assert len(r["ms_per_step"]["samples"]) == 2 and r["ms_per_step"]["median"] > 0
    assert ep1["all_to_all_per_step"] == 0 < ep2["all_to_all_per_step"]
    assert ep2["peak_bytes"] < ep1["peak_bytes"] and ep2["sent_per_step"] < ep1["sent_per_step"]
    assert math.isclose(row["ratio"], ep2["ms_per_step"]["median"] / ep1["ms_per_step"]["median"])
    columns, rows = table(output, "expert parallelism")
    assert columns == MOE_COLUMNS
    assert [r[0] for r in rows] == ["ep 1: 8 of 8 experts per rank", "ep 2: 4 of 8 experts per rank"]
    for cells in rows:
        assert_finite_cells(cells[1:], allowed_text=())
    assert rows[1][MOE_COLUMNS.index("all-to-all MiB/step (counter / napkin)")] == \
        f"{ep2['all_to_all_per_step'] / 2**20:.2f} / {ep2['all_to_all_per_step'] / 2**20:.2f}"
    # napkin/step_time.py's napkin on every row: its parts add up, ep 2 prices its all-to-alls, ep 1 none
    assert "all_to_all" not in ep1["predicted"] and ep2["predicted"]["all_to_all"] > 0
    for r, cells in zip(row["runs"], rows):
        assert_napkin_beside(r, r["ms_per_step"], cells[MOE_COLUMNS.index("predicted ms")])


def assert_napkin_beside(row: dict, ms_per_step: dict, cell: str):
    """A row's napkin/step_time.py prediction: positive, its parts (all but the communication, of
    which they hold the exposed share) add up to it, printed beside its ratio to the median."""
    parts = {k: v for k, v in row["predicted"].items() if k not in ("step", "communication")}
    assert row["predicted_ms"] == row["predicted"]["step"] > 0 and math.isfinite(row["predicted_ms"])
    assert math.isclose(sum(parts.values()), row["predicted_ms"])
    assert cell == f"{row['predicted_ms']:.1f} ({row['predicted_ms'] / ms_per_step['median']:.2f})"


def test_a_run_from_before_the_napkin_prints_n_a(bench):
    """docs/generate.py renders committed JSON again: a moe row without "predicted_ms" prints n/a."""
    from bench.measure import moe_report
    _, data = bench
    old = {**data["moe"], "runs": [{k: v for k, v in r.items() if not k.startswith("predicted")}
                                   for r in data["moe"]["runs"]]}
    _, rows = table("\n".join(moe_report(old)), "expert parallelism")
    assert [cells[MOE_COLUMNS.index("predicted ms")] for cells in rows] == ["n/a", "n/a"]


def bench_here(directory, argv):
    """bench_logged(argv) run from `directory`, its working directory, as a user runs it there."""
    os.chdir(directory)
    return bench_logged(argv)


def test_the_default_json_is_written_in_the_working_directory(tmp_path):
    """bench/compare.py --quick with its default --json bench.json (no directory in it), from a fresh
    directory, on one rank as plain `python -m bench` runs: the strategy row is priced (machines.
    this writes bench-this.json beside the JSON) and the JSON written there. Short: one strategy,
    one step, one repetition."""
    run_ranks(bench_here, 1, str(tmp_path), ["--quick", "--strategies", "ddp", "--warmup", "0",
                                             "--steps", "1", "--repeats", "1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-this.json", "bench.json"]
    data = json.loads((tmp_path / "bench.json").read_text())
    [row] = data["strategies"]
    assert row["strategy"] == "ddp" and row["predicted_ms"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--json", "{tmp}/"], "--json {tmp}/ is a directory: name a file in it, e.g. --json {tmp}/bench.json"),
    (["--json", "{tmp}"], "--json {tmp} is a directory"),
    (["--json", "{tmp}/missing/x.json"], "there is no directory {tmp}/missing: create it"),
    (["--report", "{tmp}/missing.json"], "--report {tmp}/missing.json: No such file or directory: give the JSON"),
    (["--report", "{tmp}/text.json"], "--report {tmp}/text.json is not JSON (Expecting value: line 1"),
    (["--report", "{tmp}/x-this.json"], "--report {tmp}/x-this.json is not a bench.py run's JSON (no "
                                        "collectives, context_parallel, machine, moe, strategies)"),
])
def test_a_json_it_cannot_write_or_read_stops_before_any_work(argv, message, tmp_path, capsys):
    """--json's directory is checked as the run starts, not when it ends (the JSON's write) or
    midway (machines.this's file beside it, which made a missing directory); --report's files
    are read whole before a table is printed."""
    (tmp_path / "text.json").write_text("step 1 | loss 5.5\n")
    (tmp_path / "x-this.json").write_text(json.dumps({"x86_64 x 2, 1 threads, 2 ranks": {}}))
    with pytest.raises(SystemExit) as stop:
        parse_args(["--quick", *(a.format(tmp=tmp_path) for a in argv)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert stop.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert message.format(tmp=tmp_path) in errors[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.json", "x-this.json"]


def test_moe_rows_need_a_world_the_experts_split_over(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")                # the default list leaves moe out, says why
    assert "2 or more ranks" in parse_args(["--quick"]).skipped["moe"]
    monkeypatch.setenv("WORLD_SIZE", "6")                # tiny-moe: 8 experts
    with pytest.raises(SystemExit):                      # asked for by name: one clear error
        parse_args(["--quick", "--strategies", "moe", "--ep", "3"])
    assert "model tiny-moe's 8 experts; leave it out of --strategies" in capsys.readouterr().err


def test_json_holds_the_same_numbers(bench):
    output, data = bench
    assert data["machine"]["world_size"] == 2 and data["machine"]["backend"] == "gloo"
    rows = {r["strategy"]: r for r in data["strategies"]}
    row, checkpointed = rows["zero2"], rows["checkpointing"]
    # Ours and torch.utils.checkpoint keep the same: each block's input, nothing inside it.
    assert checkpointed["ours"]["activation_bytes"] == checkpointed["torch"]["activation_bytes"]
    assert checkpointed["ours"]["activation_bytes"] < row["ours"]["activation_bytes"] / 3
    for side in ("ours", "torch"):
        ms = row[side]["ms_per_step"]
        assert len(ms["samples"]) == 2                                  # --repeats 2
        assert all(math.isfinite(v) and v > 0 for v in ms["samples"])
        assert ms["min"] <= ms["median"] <= ms["max"]
        assert row[side]["peak_bytes"] > 0 and math.isfinite(row[side]["tokens_per_s"])
    assert row["torch"]["sent_per_step"] is None
    assert math.isclose(row["ratio"], row["ours"]["ms_per_step"]["median"]
                        / row["torch"]["ms_per_step"]["median"])
    # The counter and memory_math.comm_bytes agree: the tiny model is one bucket, so only the step's
    # small messages (the used-flags, one byte per parameter tensor, and the gradient norm's fp32
    # number, zero.step_message_bytes) and the bucket's padding are not in the napkin formula.
    ours, tensors = row["ours"], len(list(build_model("tiny").parameters()))
    small = step_message_bytes(tensors, 2)
    assert 0 <= ours["sent_per_step"] - ours["napkin_sent_per_step"] - small <= 64, (ours, small)
    # ZeRO-2 holds fewer bytes than ZeroRedundancyOptimizer (stage 1): gradients are sharded.
    assert ours["peak_bytes"] < row["torch"]["peak_bytes"]
    # The table prints the JSON's numbers (zero2 is the first row).
    _, rows = table(output, "strategy")
    assert rows[0][STRATEGY_COLUMNS.index("ours/torch")] == f"{row['ratio']:.2f}"


def test_every_row_has_the_napkins_step_time(bench):
    """napkin/step_time.py's prediction for every strategy row: the parts add up to the step, and the
    table prints it beside its ratio to our measured median."""
    output, data = bench
    _, printed = table(output, "strategy")
    for row, cells in zip(data["strategies"], printed):
        parts = {k: v for k, v in row["predicted"].items() if k not in ("step", "communication")}
        assert row["predicted_ms"] == row["predicted"]["step"] > 0 and math.isfinite(row["predicted_ms"])
        assert math.isclose(sum(parts.values()), row["predicted_ms"])
        ratio = row["predicted_ms"] / row["ours"]["ms_per_step"]["median"]
        assert cells[STRATEGY_COLUMNS.index("predicted ms")] == f"{row['predicted_ms']:.1f} ({ratio:.2f})"


def recorded_rows(name: str) -> tuple[dict, list]:
    """The committed run bench-results/NAME.json's header, and (row's name, row, measured ms, its
    Step, the block machines.this measured for it) for every row, priced as bench/compare.py
    prices it today."""
    with open(os.path.join(ROOT, "bench-results", f"{name}.json")) as f:
        data = json.load(f)
    m, N = data["machine"], data["machine"]["world_size"]
    args = SimpleNamespace(model=m["model"], batch_size=m["global_batch"], seq_len=m["seq_len"],
                           precision=m["precision"], microbatches=m["microbatches"],
                           bucket_mb=m["bucket_mb"])
    rows = [(r["strategy"], r, r["ours"]["ms_per_step"]["median"],
             *strategy_priced(r["strategy"], args, N)) for r in data["strategies"]]
    rows += [(f"ep {r['ep']}", r, r["ms_per_step"]["median"],
              *inside_priced(m["moe_model"], args, N, ep=r["ep"]))
             for r in (data["moe"]["runs"] if data["moe"] else [])]
    rows += [(f"cp {r['attention']}", r, r["ms_per_step"]["median"],
              *inside_priced(m["model"], args, N, cp=N, attention=r["attention"]))
             for r in data["context_parallel"]]
    return m, rows


# The committed runs whose every row has the napkin beside it: the strategies' rows at the medium
# size, expert and context parallelism's at tiny (docs/measured.md names their commands).
RECORDED = ["medium-napkin", "moe-cp-napkin"]


@pytest.mark.parametrize("name", RECORDED)
def test_each_committed_prediction_is_what_todays_napkin_computes(name):
    """Each row's predicted number in bench-results/NAME.json is what napkin/step_time.py computes
    today from the machines.this figures that run recorded (NAME-this.json): the code is bound
    to the committed numbers. A napkin that priced a cp rank's attention at model.py's fused
    rate again would find no such block in the file; one that changed a formula, another number."""
    this_file = os.path.join(ROOT, "bench-results", f"{name}-this.json")
    header, rows = recorded_rows(name)
    assert rows
    for label, row, _, step, block in rows:
        machine = recorded(this_file, block_key(**block), block["precision"],
                           on_gpu=header["gpu"] is not None)
        predicted_ms = 1e3 * predict(step, machine)["seconds"]
        assert predicted_ms == pytest.approx(row["predicted_ms"], rel=1e-9), label


@pytest.mark.parametrize("name", ["medium-napkin", "moe-cp-napkin"])
def test_the_napkin_is_within_0_8_to_1_25_of_every_committed_row(name):
    """Issue 55: napkin/step_time.py's prediction within 0.8-1.25 of the measured step on every row of
    a real run (the predictions themselves bound to the code by the test above)."""
    _, rows = recorded_rows(name)
    assert rows
    for label, row, measured, _, _ in rows:
        assert 0.8 <= row["predicted_ms"] / measured <= 1.25, (label, row["predicted_ms"], measured)


def test_report_from_the_json_prints_the_runs_tables(bench, tmp_path):
    """python -m bench --report FILE (how the README's tables are made) prints, from the JSON
    alone, every line the run printed but its wall time; the header names the date."""
    output, data = bench
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    result = subprocess.run([sys.executable, "-m", "bench", "--report", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    ran = [line for line in output.splitlines() if line.startswith("bench.py ran")]
    assert result.stdout.strip() == output[:output.index(ran[-1])].strip()
    assert data["machine"]["date"] in result.stdout.splitlines()[0]


def test_fsdp_and_tp_do_pytorchs_work(bench):
    _, data = bench
    rows = {r["strategy"]: r for r in data["strategies"]}
    for name in ("fsdp", "tp"):
        ours, theirs = rows[name]["ours"], rows[name]["torch"]
        # Same init, data and fp32 AdamW steps: only the order of cross-rank sums may differ.
        assert math.isclose(ours["last_loss"], theirs["last_loss"], rel_tol=1e-5), (name, ours, theirs)
        # The same split keeps the same activations (tp: within a few per-token numbers).
        assert math.isclose(ours["activation_bytes"], theirs["activation_bytes"], rel_tol=1e-3), name
    # Both FSDPs hold 1/N of every byte; our tp counter is tensor_parallel's ring formula exactly.
    fsdp, tp = rows["fsdp"], rows["tp"]
    assert math.isclose(fsdp["ours"]["peak_bytes"], fsdp["torch"]["peak_bytes"], rel_tol=0.01)
    assert tp["ours"]["sent_per_step"] == tp["ours"]["napkin_sent_per_step"]
    # FSDP sends more than ZeRO-2 (gathers twice), less than the napkin's 1.5x: the root is
    # gathered once per step.
    assert rows["zero2"]["ours"]["sent_per_step"] < fsdp["ours"]["sent_per_step"] < fsdp["ours"]["napkin_sent_per_step"]


@pytest.mark.parametrize("name", ["hsdp", "fsdp-lora"])
def test_hsdp_and_fsdp_lora_do_fully_shards_work_and_send_the_formula(sharded, name):
    """Against fully_shard on a (replicate 2, shard 2) mesh, and on the same LoRA model: the same
    init, data and fp32 AdamW steps (only the order of cross-rank sums may differ), and our
    counter equal to napkin/sent.py's fsdp_bytes_per_step (HSDP: the copies' all-reduce and its flags; LoRA: the
    frozen base's all-gathers, no reduce-scatter for it)."""
    _, rows = sharded
    ours, theirs = rows[name]["ours"], rows[name]["torch"]
    assert math.isclose(ours["last_loss"], theirs["last_loss"], rel_tol=1e-5), (name, ours, theirs)
    assert ours["sent_per_step"] == ours["napkin_sent_per_step"], name
    assert math.isclose(ours["peak_bytes"], theirs["peak_bytes"], rel_tol=0.01), name


def test_hsdp_holds_its_shard_groups_share(sharded):
    """HSDP shards over 2 of the 4 ranks: each holds half the model's state, as napkin/memory.py's zero3
    over 2 says (plain fsdp on 4 ranks would hold a quarter); it is skipped below 4 ranks."""
    _, rows = sharded
    ours = rows["hsdp"]["ours"]
    assert "2 x 2 (replicate, shard) mesh" in rows["hsdp"]["torch_counterpart"]
    assert ours["peak_bytes"] == ours["napkin_held"]["zero3 over 2"]


def test_fsdp_lora_shards_the_frozen_base(sharded):
    """Both FSDPs hold a quarter of the frozen base per rank (the tiny model's units split evenly:
    no padding), where DDP would hold it whole; ours holds napkin/memory.py's prediction in all."""
    output, rows = sharded
    ours, theirs = rows["fsdp-lora"]["ours"], rows["fsdp-lora"]["torch"]
    assert ours["frozen_whole"] == theirs["frozen_whole"] == 4 * build_model("tiny").num_parameters()
    assert ours["frozen_bytes"] == theirs["frozen_bytes"] == ours["frozen_whole"] / 4
    assert ours["peak_bytes"] == ours["napkin_held"]["zero3 over 4"]
    assert ours["peak_bytes"] < ours["napkin_held"]["ddp (the base whole)"] / 3
    whole = ours["frozen_whole"] / 2**20
    assert f"frozen base per rank {whole / 4:.2f} / {whole / 4:.2f} MiB (ours / torch), whole {whole:.2f}" in output


def test_hsdp_needs_two_shard_groups(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")                # the default list leaves hsdp out, says why
    args = parse_args(["--quick"])
    assert "hsdp" not in args.strategies and "fsdp-lora" in args.strategies
    assert args.skipped["hsdp"] == ("hsdp shards over groups of 2 ranks and keeps a copy per group: it "
                                    "needs a world of 4 or more ranks, a multiple of 2, not 2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(SystemExit):                      # asked for by name: one clear error
        parse_args(["--quick", "--strategies", "hsdp", "--batch-size", "5"])
    assert "a multiple of 2, not 5; leave hsdp out of --strategies" in capsys.readouterr().err


def test_pipeline_does_pytorchs_work_and_reports_its_bubble(bench):
    output, data = bench
    row = next(r for r in data["strategies"] if r["strategy"] == "pipeline-1f1b")
    ours, theirs = row["ours"], row["torch"]
    # The same stages, micro-batches and fp32 steps: the same loss, the same activations held
    # at the peak (1F1B: at most P micro-batches on a stage), our p2p bytes its formula exactly.
    assert math.isclose(ours["last_loss"], theirs["last_loss"], rel_tol=1e-5), (ours, theirs)
    assert math.isclose(ours["activation_bytes"], theirs["activation_bytes"], rel_tol=1e-3)
    assert ours["sent_per_step"] == ours["napkin_sent_per_step"]
    assert len(ours["bubbles"]) == 2 and all(0 <= b < 1 for b in ours["bubbles"])
    assert "formula (P-1)/(M+P-1) 0.20" in output                 # P=2, M=4


@pytest.mark.parametrize("name, formula", [("pipeline-interleaved", "formula (P-1)/(vM+P-1) 0.11"),
                                           ("pipeline-zb", "formula (P-1)/(3M+P-1) 0.08")])
def test_interleaved_and_zero_bubble_rows_run_torchs_schedules(bench, name, formula):
    """Ours against ScheduleInterleaved1F1B on the same two chunks per stage, and against
    ScheduleInterleavedZeroBubble: the same loss, our p2p bytes their formula, the bubble beside
    its formula. Interleaved sends 2(Pv-1)M activations and gradients in all to 1F1B's 2(P-1)M:
    3 times as many at P = v = 2 (each rank sends 3M, 1F1B's M); zero bubble sends 1F1B's."""
    output, data = bench
    row = next(r for r in data["strategies"] if r["strategy"] == name)
    one_f_one_b = next(r for r in data["strategies"] if r["strategy"] == "pipeline-1f1b")
    assert math.isclose(row["ours"]["last_loss"], row["torch"]["last_loss"], rel_tol=1e-5)
    assert row["ours"]["sent_per_step"] == row["ours"]["napkin_sent_per_step"]
    norm = ring_bytes("all_reduce", 1, 4, 2)                   # the clip's norm: one fp32
    times = 3 if name == "pipeline-interleaved" else 1
    assert row["ours"]["sent_per_step"] - norm == times * (one_f_one_b["ours"]["sent_per_step"] - norm)
    assert len(row["ours"]["bubbles"]) == 2 and formula in output


def test_pipeline_rows_need_a_model_that_splits(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "8")                # the tiny GPT: 4 blocks
    args = parse_args(["--quick"])
    assert "pipeline-1f1b" not in args.strategies
    assert "4 blocks, fewer than 8 stages" in args.skipped["pipeline-1f1b"]
    monkeypatch.setenv("WORLD_SIZE", "2")                # asked for by name: one clear error
    with pytest.raises(SystemExit):
        parse_args(["--quick", "--strategies", "pipeline-gpipe", "--microbatches", "3"])
    err = capsys.readouterr().err
    assert "--batch-size 16 does not split into --microbatches 3" in err
    assert "leave them out of --strategies" in err


def test_tp_needs_a_world_that_divides_the_model(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")                # the tiny GPT: 4 heads, width 128
    args = parse_args(["--quick"])                 # the default list leaves tp out, says why
    assert "tp" not in args.strategies and "3 does not divide n_head=4" in args.skipped["tp"]
    with pytest.raises(SystemExit):                      # asked for by name: one clear error
        parse_args(["--quick", "--strategies", "tp"])
    assert "leave tp out of --strategies" in capsys.readouterr().err


# ---- profiling aids: train.py --profile, --memory-snapshot ----------------------------------

def test_profile_writes_a_trace_per_rank_with_the_all_reduces(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "train.py", "--strategy", "ddp", "--steps", "5", "--eval-every", "0", "--seq-len", "32",
               "--batch-size", "8", "--profile", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        with open(tmp_path / f"trace-rank{rank}.json") as f:
            names = {event.get("name") for event in json.load(f)["traceEvents"]}
        # the three profiled steps, and DDP's bucket all-reduces inside them
        assert {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4", "gloo:all_reduce"} <= names


def test_memory_snapshot_is_written_on_a_gpu_and_refused_without_one(tmp_path):
    path = tmp_path / "m.pickle"
    result = subprocess.run([sys.executable, "train.py", "--steps", "6", "--eval-every", "0",
                             "--memory-snapshot", str(path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    if torch.cuda.is_available():
        assert result.returncode == 0 and path.stat().st_size > 0, result.stderr
    else:
        assert result.returncode == 2 and "use --profile DIR" in result.stderr, result.stderr


def test_scaling_counts_what_a_rank_holds_beside_memory_py(tmp_path):
    """python -m bench --scaling (2 steps of train.py per world size): FSDP on 2 ranks holds what
    napkin/memory.py predicts (to the log's 0.1 MiB), half of the 16 bytes per parameter, and sends the
    ring formula's bytes; the table has a cell pair per world size."""
    path = tmp_path / "scaling.json"
    result = subprocess.run([sys.executable, "-m", "bench", "--quick", "--scaling", "2", "--strategies",
                             "fsdp", "--json", str(path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    [row] = json.loads(path.read_text())["scaling"]
    assert row["world"] == 2 and row["held"] == row["napkin_held"], row
    assert row["sent"] == row["formula_sent"] > 0, row
    whole = build_model("tiny").num_parameters() * 16 / 2**20            # fp32 AdamW, MiB
    assert sum(row["held"]) == pytest.approx(whole / 2, abs=0.15), row
    assert "| fsdp | " in result.stdout and "world 2: held | sent" in result.stdout


def test_profile_puts_each_sides_operators_side_by_side_and_report_compares_sizes(tmp_path):
    """--profile: one more run of each side under torch.profiler, a table of the operators' self
    time per step (the matmuls on both sides). --report of two runs adds ddp by model size,
    smallest model first."""
    output, data = bench_in_ranks(tmp_path, 2, "ddp", "--profile", repeats=1)   # no timing statistics read
    header, rows = table(output, "operator")
    assert header == ["operator", "ours ms/step", "torch ms/step", "ours - torch"]
    by_op = {row[0]: row for row in rows}
    assert float(by_op["aten::mm"][1]) > 0 and float(by_op["aten::mm"][2]) > 0, rows
    profile = data["strategies"][0]["profile"]
    assert rows[-1] == ["every operator", f"{sum(profile['ours'].values()):.1f}",
                        f"{sum(profile['torch'].values()):.1f}",
                        f"{sum(profile['ours'].values()) - sum(profile['torch'].values()):+.1f}"]
    bigger = json.loads(json.dumps(data))
    bigger["machine"].update(model="medium", n_params=10 * data["machine"]["n_params"])
    paths = [tmp_path / "bigger.json", tmp_path / "small.json"]
    for path, run in zip(paths, (bigger, data)):
        path.write_text(json.dumps(run))
    result = subprocess.run([sys.executable, "-m", "bench", "--report", *map(str, paths)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    _, sizes = table(result.stdout, "model")
    assert [row[0] for row in sizes] == ["tiny", "medium"]
    assert all(row[5] == f"{data['strategies'][0]['ratio']:.2f}" for row in sizes), sizes


# ---- bench/gpu.py: a GPU window's one command, run here on the CPU so it runs first time there ----

def run_bench_gpu(directory, *flags) -> tuple:
    """python -m bench.gpu on the tiny model at a given peak: (its exit, stdout, JSON, files)."""
    out = directory / "window"
    result = subprocess.run([sys.executable, "-m", "bench.gpu", "--model", "tiny", "--seq-len", "64",
                             "--warmup", "1", "--steps", "2", "--peak-tflops", "0.05", "--out", str(out), *flags],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(f"{out}.json") as f:
        data = json.load(f)
    return result.stdout, data, sorted(p.name for p in directory.iterdir())


def test_the_gpu_window_command_runs_every_row_and_goes_on_past_a_failing_side(tmp_path):
    """Every row the window promises, ours and PyTorch's each timed with tokens/s and MFU (model
    FLOPs per token, written out here, x tokens/s / the peak given), the memory over a step drawn,
    one table and one JSON. On the CPU one side cannot run, fully_shard's CPUOffloadPolicy (it
    needs an accelerator): it is written down with its error, and the rows after it still run."""
    from bench.gpu import ROWS
    printed, data, files = run_bench_gpu(tmp_path)
    assert files == ["window-memory.svg", "window.json", "window.md"]
    assert [row["row"] for row in data["rows"]] == list(ROWS) == [
        "ddp", "zero1", "zero2", "fsdp", "qlora-fsdp", "zero2-offload", "tp", "pipeline-1f1b"]
    cfg, n_params = build_model("tiny").cfg, build_model("tiny").num_parameters()
    flops_per_token = 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * 64
    failed = []
    for row in data["rows"]:
        for who in ("ours", "torch"):
            result = row[who]
            if "error" in result:
                failed.append((row["row"], who))
                assert f"failed: {result['error']}" in printed
                continue
            tokens_per_s = 8 * 64 / result["ms_per_step"]["median"] * 1e3
            assert math.isclose(result["tokens_per_s"], tokens_per_s, rel_tol=1e-9)
            assert math.isclose(result["mfu"], flops_per_token * tokens_per_s / 0.05e12, rel_tol=1e-9)
            assert math.isfinite(result["last_loss"]) and result["peak_bytes"] > 0
    assert failed == [("zero2-offload", "torch")]
    assert data["machine"]["peak_tflops"] == 0.05 and data["machine"]["peak_from"] == "--peak-tflops"
    assert "<svg" in (tmp_path / "window-memory.svg").read_text()
    assert (tmp_path / "window.md").read_text() in printed + "\n"


def test_the_gpu_window_starts_no_row_past_its_budget(tmp_path):
    printed, data, _ = run_bench_gpu(tmp_path, "--budget-s", "0", "--rows", "ddp,tp")
    assert [(row["row"], row["skipped"]) for row in data["rows"]] == [
        ("ddp", "the --budget-s 0 s was spent"), ("tp", "the --budget-s 0 s was spent")]
    assert "| ddp | not run: the --budget-s 0 s was spent |" in printed
