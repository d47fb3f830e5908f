"""The exercises: each blank is cut from its concept file, the concept file's own code passes its
checker, the blank gets "not implemented yet", and typical mistakes, written into the reference,
are each caught at the step they concern.

A mistake is (what it is, text of the concept file's code, what the student wrote instead, the
checker's step that must name it): fill() puts the concept file's functions into the blank, then
the mistake replaces its text, which must occur exactly once in the filled parts.
"""
import ast
import os
import subprocess
import sys

import pytest

from exercises import EXERCISES
from exercises.grading import checker, grade, grade_on_rank
from multiprocess import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MISTAKES = {
    # ---- collectives ----
    "collectives": [
        ("the reduce-scatter adds the chunk it sends, not the one arriving (off by one)",
         "sent, received = (r - 1 - step) % n, (r - 2 - step) % n",
         "sent, received = (r - 1 - step) % n, (r - 1 - step) % n", "reduce-scatter"),
        ("the all-gather starts by sending chunk r + 1, which this rank does not have whole",
         "sent, received = (r - step) % n, (r - 1 - step) % n",
         "sent, received = (r + 1 - step) % n, (r - step) % n", "all-gather"),
        ("one ring step too few: N-2 steps leave chunk r missing one rank's copy",
         "    for step in range(n - 1):\n        # The arriving",
         "    for step in range(n - 2):\n        # The arriving", "reduce-scatter"),
        ("the all-reduce forgets the all-gather: each rank holds only its own chunk's sum",
         "    ring_reduce_scatter(chunks, group, log)\n    ring_all_gather(chunks, group, log)",
         "    ring_reduce_scatter(chunks, group, log)", "all-reduce"),
    ],

    # ---- mixed_precision ----
    "mixed_precision": [
    ],

    # ---- ddp ----
    "ddp": [
    ],

    # ---- zero ----
    "zero": [
        ("the norm left squared: the sum of squares without its root",
         "self._norm, self._used = squares.sqrt()[0], used",
         "self._norm, self._used = squares[0], used", "the global norm"),
        ("the norm of this rank's shards only: the squares never summed over the ranks",
         'self.comm.all_reduce(squares, op="sum")', "pass", "the global norm"),
        ("the ranks' norms summed, not their squares",
         'self.comm.all_reduce(squares, op="sum")',
         'self.comm.all_reduce(squares.sqrt_(), op="sum")\n                squares.pow_(2)',
         "the global norm"),
        ("the squares averaged over the ranks: divided by N where the shards add up",
         'self.comm.all_reduce(squares, op="sum")', 'self.comm.all_reduce(squares, op="avg")',
         "the global norm"),
        ("the model's whole gradients clipped, not the masters' shards the optimizer steps",
         "[b.master for b, g in zip(self.buckets, grads) if g is not None]",
         "[p for b in self.buckets for p in b.params]", "clip"),
        ("the all-gather forgotten: each rank holds only its own shard's update",
         "            self.all_gather_parameters()       # 7",
         "            pass       # 7", "all-gather the parameters"),
        ("a bf16 model's shard never gets its fp32 master: the all-gather sends the old one",
         "self._master_into_model(shard, bucket.master)", "pass",
         "all-gather 16-bit parameters"),
        ("step() never clips, though clip_grad_norm_ asked for it",
         "self.clip(self.max_norm, norm)", "pass", "the whole step"),
        ("ZeRO-2 keeps each whole gradient: its .grad not dropped once copied",
         "bucket.params[i].grad = None", "pass", "ZeRO-2: reduce-scatter during backward"),
        ("ZeRO-2 never hands a full bucket on: every reduce-scatter waits for backward's end",
         "            self._order.ready(bucket)", "            pass",
         "ZeRO-2: reduce-scatter during backward"),
        ("ZeRO-2's second micro-batch overwrites the first's shard instead of adding to it",
         "output if bucket.grad_shard is None else bucket.grad_shard.add_(output)", "output",
         "ZeRO-2: micro-batches add up"),
    ],

    # ---- fsdp ----
    "fsdp": [
    ],

    # ---- pipeline ----
    "pipeline": [
    ],

    # ---- tensor_parallel ----
    "tensor_parallel": [
    ],

    # ---- context_parallel ----
    "context_parallel": [
    ],

    # ---- moe ----
    "moe": [
    ],

    # ---- lora ----
    "lora": [
    ],

    # ---- quantization ----
    "quantization": [
    ],

    # ---- checkpointing ----
    "checkpointing": [
    ],
}


# ---- filling a blank with its concept file's code ------------------------------------------

def definitions(source: str) -> dict:
    """{qualified name: the def node} of every function in source, methods as Class.name."""
    found = {}

    def visit(node, prefix):
        for child in node.body:
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef):
                found[f"{prefix}{child.name}"] = child
    visit(ast.parse(source), "")
    return found


def segment(source: str, node) -> str:
    """The def's lines, decorators included."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return "".join(source.splitlines(True)[first - 1:node.end_lineno])


def blank_path(name: str) -> str:
    return os.path.join(ROOT, "exercises", f"{name}.py")


def concept_source(name: str) -> str:
    return open(os.path.join(ROOT, f"{name}.py")).read()


def fill(name: str, mistake: tuple | None = None) -> str:
    """The blank with each part replaced by the concept file's def of the same name; then the
    mistake's text replaced, where it occurs once in those parts."""
    blank, concept = open(blank_path(name)).read(), concept_source(name)
    theirs, ours = definitions(blank), definitions(concept)
    filled = blank
    parts = "".join(segment(concept, ours[part]) for part in checker(name).PARTS)
    for part in checker(name).PARTS:
        filled = filled.replace(segment(blank, theirs[part]), segment(concept, ours[part]))
    if mistake:
        _, text, wrong, _ = mistake
        assert parts.count(text) == 1, f"the mistake's text occurs {parts.count(text)} times"
        filled = filled.replace(text, wrong)
    return filled


def run_check(name: str, source: str, tmp_path) -> dict:
    """The checker's verdict on source, on the ranks the checker names (rank 0's combined)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    world = checker(name).WORLD
    if world == 1:
        return grade(name, str(path))
    from exercises.grading import combine
    return combine(run_ranks(grade_on_rank, world, name, str(path)))


# ---- the tests -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", EXERCISES)
def test_each_blank_is_cut_from_its_concept_file(name):
    """Every part the blank asks for has the concept file's signature and docstring, word for
    word, and only a TODO (comments and a raise NotImplementedError) for a body."""
    blank, concept = definitions(open(blank_path(name)).read()), definitions(concept_source(name))
    assert checker(name).PARTS, f"{name}'s checker names no part to write"
    for part in checker(name).PARTS:
        assert part in blank, f"exercises/{name}.py has no {part}"
        assert part in concept, f"{name}.py has no {part}: the exercise drifted from it"
        mine, source = blank[part], concept[part]
        assert ast.dump(mine.args) == ast.dump(source.args), f"{part}'s arguments drifted"
        assert ast.dump(mine.returns) == ast.dump(source.returns) if source.returns else \
            mine.returns is None, f"{part}'s return annotation drifted"
        assert [ast.dump(d) for d in mine.decorator_list] == \
            [ast.dump(d) for d in source.decorator_list], f"{part}'s decorators drifted"
        assert ast.get_docstring(mine) == ast.get_docstring(source), f"{part}'s docstring drifted"
        body = [n for n in mine.body[1:]]
        assert len(body) == 1 and isinstance(body[0], ast.Raise) and \
            "NotImplementedError" in ast.unparse(body[0]), f"{part}'s body is more than its TODO"


@pytest.mark.parametrize("name", EXERCISES)
def test_the_blank_is_not_implemented_yet(name, tmp_path):
    verdict = run_check(name, open(blank_path(name)).read(), tmp_path)
    assert verdict["status"] == "todo", verdict
    assert verdict["line"].startswith("not implemented yet: "), verdict
    assert "\n" not in verdict["line"]


@pytest.mark.parametrize("name", EXERCISES)
def test_the_concept_file_passes_its_checker(name, tmp_path):
    verdict = run_check(name, fill(name), tmp_path)
    assert verdict["status"] == "passed", verdict
    assert len(verdict["passed"]) >= 3, verdict


@pytest.mark.parametrize("name", EXERCISES)
def test_at_least_three_mistakes_each(name):
    assert len(MISTAKES.get(name, [])) >= 3


@pytest.mark.parametrize("name, mistake", [(name, m) for name in EXERCISES
                                           for m in MISTAKES.get(name, [])],
                         ids=lambda v: v if isinstance(v, str) else v[0][:50])
def test_a_mistake_is_caught_at_its_step(name, mistake, tmp_path):
    verdict = run_check(name, fill(name, mistake), tmp_path)
    assert verdict["status"] == "differs", verdict
    assert verdict["step"] == mistake[3], verdict
    assert verdict["line"].startswith(mistake[3] + ":") and verdict["hint"], verdict


def test_the_commands_print_a_few_lines():
    """python -m exercises list and check, as the student types them: no traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    listed = subprocess.run([sys.executable, "-m", "exercises", "list"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and not listed.stderr, listed.stderr
    for name in EXERCISES:
        assert f"\n{name} " in listed.stdout
    checked = subprocess.run([sys.executable, "-m", "exercises", "check", "collectives"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0 and not checked.stderr, checked.stderr
    assert checked.stdout.splitlines()[-1].strip().startswith(
        "not implemented yet: ring_reduce_scatter (exercises/collectives.py, line "), checked.stdout
    wrong = subprocess.run([sys.executable, "-m", "exercises", "check", "zero3"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "no exercise 'zero3'" in wrong.stderr.splitlines()[-1]
