"""Each concept file runs alone, as the README's reading table says: a demonstration of its idea in
seconds on 2 CPU ranks (or one process) that checks itself against one process and prints the
difference. The test runs each command exactly as the table writes it, in the README's environment,
and holds the file to passing its own check (its exit status) and saying what it compared."""
import pathlib
import re

import pytest

from test_docs import ALONE_COMMANDS, run_as_written
from test_layout import CONCEPTS

ROOT = pathlib.Path(__file__).resolve().parent.parent

# concept file -> the command the README's reading table gives for it
COMMANDS = {
    "ddp": "torchrun --nproc_per_node 2 ddp.py",
    "collectives": "torchrun --nproc_per_node 2 collectives.py",
    "tensor_parallel": "torchrun --nproc_per_node 2 tensor_parallel.py",
    "context_parallel": "torchrun --nproc_per_node 2 context_parallel.py",
    "fsdp": "torchrun --nproc_per_node 2 fsdp.py",
    "moe": "torchrun --nproc_per_node 2 moe.py",
    "lora": "python lora.py",
    "quantization": "python quantization.py",
    "checkpointing": "python checkpointing.py",
    "pipeline": "torchrun --nproc_per_node 2 pipeline.py",
    "mixed_precision": "python mixed_precision.py",
    "zero": "torchrun --nproc_per_node 2 zero.py",
}


@pytest.mark.parametrize("concept", COMMANDS)
def test_a_concept_file_runs_alone_and_checks_itself(concept):
    command = COMMANDS[concept]
    assert f"`{command}`" in (ROOT / "README.md").read_text(), f"the README's table should show `{command}`"
    status, output = run_as_written(command, ROOT, timeout=120)
    assert status == 0, f"`{command}` exited {status}:\n{output[-4000:]}"
    assert re.search(r"one process", output), f"`{command}` should print its difference from one process:\n{output}"


def test_the_reading_table_runs_every_concept_file_alone():
    """Every concept file has its command here and in the README's table, the same one (the pages'
    test, tests/test_docs.py, leaves these to this file)."""
    assert set(COMMANDS) == set(CONCEPTS), sorted(set(CONCEPTS) ^ set(COMMANDS))
    assert sorted(ALONE_COMMANDS) == sorted(COMMANDS.values()), sorted(set(ALONE_COMMANDS) ^ set(COMMANDS.values()))
