"""bench.py end to end on 2 CPU ranks: the tables have every column, numbers and JSON agree.

A smoke test only: it checks that the benchmark runs and reports what it promises, never how
fast anything is (timings on a shared CPU say nothing a test could rely on).
"""
import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGY_COLUMNS = ["strategy", "ours ms/step", "torch ms/step", "ours/torch", "ours tokens/s",
                    "ours peak MiB", "torch peak MiB", "ours sent MiB/step (measured / napkin)",
                    "torch sent MiB/step", "ours MFU"]
COLLECTIVE_COLUMNS = ["all-reduce size", "ring us", "native us", "ring/native", "ring busbw GB/s",
                      "native busbw GB/s"]
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?%?")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One quick run: zero2 (ours vs ZeroRedundancyOptimizer) and the 1 KB and 4 KB all-reduces."""
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "bench.py", "--quick", "--strategies", "zero2,collectives", "--warmup", "1",
               "--steps", "2", "--repeats", "2", "--max-mb", "0.004", "--json", str(path)]
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(path) as f:
        return result.stdout, json.load(f)


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
    assert [row[0] for row in rows] == ["zero2"]
    row = rows[0]
    assert len(row) == len(columns), row
    assert row[STRATEGY_COLUMNS.index("torch sent MiB/step")] == "n/a"   # torch counts nothing
    assert row[STRATEGY_COLUMNS.index("ours MFU")] == "n/a"              # CPU: no MFU
    assert_finite_cells(row[1:])


def test_collectives_table_covers_the_sizes(bench):
    output, _ = bench
    columns, rows = table(output, "all-reduce size")
    assert columns == COLLECTIVE_COLUMNS
    assert [row[0] for row in rows] == ["1 KB", "4 KB"]
    for row in rows:
        assert_finite_cells(row[1:], allowed_text=())


def test_json_holds_the_same_numbers(bench):
    output, data = bench
    assert data["machine"]["world_size"] == 2 and data["machine"]["backend"] == "gloo"
    (row,) = data["strategies"]
    assert row["strategy"] == "zero2"
    for side in ("ours", "torch"):
        ms = row[side]["ms_per_step"]
        assert len(ms["samples"]) == 2                                  # --repeats 2
        assert all(math.isfinite(v) and v > 0 for v in ms["samples"])
        assert ms["min"] <= ms["median"] <= ms["max"]
        assert row[side]["peak_bytes"] > 0 and math.isfinite(row[side]["tokens_per_s"])
    assert row["torch"]["sent_per_step"] is None
    assert math.isclose(row["ratio"], row["ours"]["ms_per_step"]["median"]
                        / row["torch"]["ms_per_step"]["median"])
    # The counter and memory.comm_bytes agree: the tiny model is one bucket, so only the 8 bytes
    # of the gradient-norm all-reduce (clipping) are not in the napkin formula.
    ours = row["ours"]
    assert abs(ours["sent_per_step"] - ours["napkin_sent_per_step"]) <= 64, ours
    # ZeRO-2 holds fewer bytes than ZeroRedundancyOptimizer (stage 1): gradients are sharded.
    assert ours["peak_bytes"] < row["torch"]["peak_bytes"]
    # The table prints the JSON's numbers.
    _, rows = table(output, "strategy")
    assert rows[0][3] == f"{row['ratio']:.2f}"
    assert [r["bytes"] for r in data["collectives"]] == [1024, 4096]
    for r in data["collectives"]:
        for name in ("ring", "native"):
            assert math.isfinite(r[name]["busbw_GBps"]) and r[name]["busbw_GBps"] > 0
