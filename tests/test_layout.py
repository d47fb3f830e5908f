"""The layout is the architecture (docs/design.md): the top level is the textbook (the lecture's concept
files, the model and train.py, nothing else of the code) and the engine is in packages named for what
they are. Each concept file reads in one sitting, is followed through at most three names from
at most three project modules (what only its demonstration under `if __name__ == "__main__":`
uses aside: how it starts, the model it runs), and builds only on the foundations (never on an
extension, the composition, the run or the napkin math)."""
import ast
import io
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest

from test_imports import _imported, _project_files

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The lecture's concepts in reading order (the README's table), and what each may build on beside
# the foundations package and the lecture's first rungs (BASES): the concepts the lecture builds it on,
# and its own mechanics (mechanics/: what the file leaves out to read in one sitting).
BASES = {"collectives", "mixed_precision", "model"}
CONCEPTS = {"mixed_precision": set(), "collectives": set(), "ddp": set(),
            "zero": {"mechanics.sharded_step"},
            "fsdp": {"mechanics.fsdp_state", "mechanics.fsdp_optimizer"},
            "pipeline": {"mechanics.pipeline_mechanics"}, "tensor_parallel": set(),
            "context_parallel": {"tensor_parallel"}, "moe": set(), "lora": {"quantization"},
            "quantization": set(), "checkpointing": set()}
TOP_LEVEL = {*CONCEPTS, "model", "train"}
PACKAGES = {"foundations", "mechanics", "extensions", "composition", "running", "napkin", "bench", "pictures",
            "pretrained", "exercises"}
# The files that are a concept's own beyond it (its mechanics; an extension that reads as a delta
# after its core), held to the same sitting.
OWN = {"zero": {"mechanics.sharded_step", "mechanics.offload", "extensions.zero_offload"},
       "fsdp": {"mechanics.fsdp_state", "mechanics.fsdp_optimizer", "extensions.fsdp_hybrid",
                "extensions.fsdp_offload", "extensions.fsdp_frozen"},
       "pipeline": {"mechanics.pipeline_mechanics", "extensions.schedules", "extensions.zero_bubble"},
       "tensor_parallel": {"composition.tensor_parallel_gpt"},
       "context_parallel": {"composition.context_parallel_gpt"}}
LIMITS = {"lines": 450, "function": 60, "constructor": 6, "modules": 3}


def _imports(module: str) -> set:
    """The project modules `module` imports, its demonstration's included."""
    modules = _project_files()
    path, found = modules[module], set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= _imported(node, module, path, modules)
    return found


def _used_outside_main(tree: ast.Module) -> set:
    """The names a module's code reads outside `if __name__ == "__main__":`, its imports aside."""
    main = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    return {n.id for node in tree.body if node not in main
            and not isinstance(node, (ast.Import, ast.ImportFrom))
            for n in ast.walk(node) if isinstance(n, ast.Name)}


def _followed(concept: str) -> dict:
    """{name: the project module it comes from} for each name `concept` imports from the project
    and uses outside `if __name__ == "__main__":`. What only the demonstration uses (how it
    starts, foundations/alone.py; the model it runs) is not what the idea is followed through."""
    modules, path = _project_files(), _path(concept)
    tree, found = ast.parse(path.read_text()), {}
    used = _used_outside_main(tree)
    for node in tree.body:
        for alias in node.names if isinstance(node, (ast.Import, ast.ImportFrom)) else ():
            name = alias.asname or alias.name.split(".")[0]
            one = (ast.Import(names=[alias]) if isinstance(node, ast.Import) else
                   ast.ImportFrom(module=node.module, names=[alias], level=node.level))
            if name in used:
                found |= {name: module for module in _imported(one, concept, path, modules)}
    return found


def _path(module: str) -> pathlib.Path:
    return ROOT / (module.replace(".", "/") + ".py")


def test_the_top_level_is_the_textbook():
    top = {p.stem for p in ROOT.glob("*.py")}
    assert top == TOP_LEVEL, (f"the top level holds the concept files, model.py and train.py only: "
                              f"{sorted(top - TOP_LEVEL)} belong in a package, {sorted(TOP_LEVEL - top)} are missing")


def test_the_engine_is_in_packages_named_for_what_they_are():
    folders = {p.relative_to(ROOT).parts[0] for p in ROOT.glob("*/**/*.py")} - {"tests", "docs", "examples"}
    assert {f for f in folders if not f.startswith(".")} == PACKAGES
    for package in PACKAGES:
        init = ast.parse((ROOT / package / "__init__.py").read_text())
        assert ast.get_docstring(init), f"{package}/__init__.py should say what the package holds"


@pytest.mark.parametrize("concept", CONCEPTS)
def test_a_concept_file_builds_only_on_the_foundations(concept):
    allowed = (CONCEPTS[concept] | BASES) - {concept}
    wrong = {m for m in _imports(concept) if not m.startswith("foundations.") and m not in allowed}
    assert not wrong, (f"{concept}.py imports {sorted(wrong)}: a concept file builds on the foundations "
                       f"package and {sorted(allowed)} only; an extension wraps it "
                       f"from outside, the composition (composition/parallelize.py) puts strategies together")


@pytest.mark.parametrize("concept", CONCEPTS)
def test_a_concept_file_is_followed_through_at_most_three_project_modules(concept):
    modules = set(_followed(concept).values())
    assert len(modules) <= LIMITS["modules"], \
        f"{concept}.py is followed through {len(modules)} project modules: {sorted(modules)}"


@pytest.mark.parametrize("concept", CONCEPTS)
def test_a_concept_file_is_followed_with_at_most_three_names_from_elsewhere(concept):
    names = set(_followed(concept))
    assert len(names) <= 3, (f"{concept}.py uses {len(names)} names from other project files, "
                             f"{sorted(names)}: a reader opens each one")


@pytest.mark.parametrize("foundation", sorted(m for m in _project_files() if m.startswith("foundations.")))
def test_a_foundation_imports_only_foundations(foundation):
    """The concepts build on the foundations, never the other way round (the model knows no mixture
    of experts: moe.py hands it one through its feed_forward). What the foundations need of the
    lecture's first rungs lives in them: the counted collectives (foundations/comm.py), the optimizer around
    the inner one (foundations/inner_optimizer.py); a step that needs the loss scale is a mechanic."""
    wrong = {m for m in _imports(foundation) if not m.startswith("foundations.")}
    assert not wrong, f"{foundation} imports {sorted(wrong)}: a foundation builds on foundations only"
    assert not _imports("model"), f"model.py imports {sorted(_imports('model'))}: the model is a foundation"


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.mark.parametrize("concept", CONCEPTS)
def test_a_concept_file_reads_in_one_sitting(concept):
    for module in {concept} | OWN.get(concept, set()):
        text = _path(module).read_text()
        lines = len(text.splitlines())
        assert lines <= LIMITS["lines"], f"{module} is {lines} lines, over {LIMITS['lines']}"
        for f in _functions(ast.parse(text)):
            length = f.end_lineno - f.lineno + 1
            assert length <= LIMITS["function"], f"{module}: {f.name} is {length} lines"


@pytest.mark.parametrize("module, cls", [("pipeline", "Pipeline"), ("fsdp", "FSDP"),
                                         ("zero", "ZeroOptimizer")])
def test_a_main_class_takes_the_few_arguments_its_idea_needs(module, cls):
    tree = ast.parse((ROOT / f"{module}.py").read_text())
    init = next(f for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == cls
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    arguments = init.args.args[1:] + init.args.kwonlyargs + [a for a in (init.args.vararg,) if a]
    assert len(arguments) <= LIMITS["constructor"], \
        f"{cls} takes {len(arguments)}: {[a.arg for a in arguments]}"


def test_train_py_is_the_loop_and_its_log():
    assert len((ROOT / "train.py").read_text().splitlines()) <= 250


def test_train_py_builds_the_data_parallel_rungs():
    """As nanoGPT's train.py wraps its model in DDP itself, train.py builds the lecture's rungs:
    its functions use each rung's class, imported from the concept file that teaches it."""
    rungs = {"DDP": "ddp", "ZeroOptimizer": "zero", "Zero2Optimizer": "zero", "FSDP": "fsdp"}
    tree = ast.parse(_path("train").read_text())
    imported = {a.name: node.module for node in tree.body if isinstance(node, ast.ImportFrom)
                for a in node.names}
    used = {n.id for f in _functions(tree) for n in ast.walk(f) if isinstance(n, ast.Name)}
    for name, concept in rungs.items():
        assert imported.get(name) == concept, f"train.py should import {name} from {concept}.py"
        assert name in used, f"train.py imports {name} but builds no {name} in a function"


def test_every_concept_file_has_a_test_in_the_quick_tier():
    """`python -m pytest -m quick` (conftest.QUICK) checks each concept file once, and pipeline's
    schedules, the model, the data, train.py and the README's loop, each with a test from its own
    test file; and every test QUICK names is still there: collected under -m quick, one each."""
    from conftest import QUICK
    missing = (set(CONCEPTS) | {"schedules", "model", "data", "train", "examples"}) - QUICK.keys()
    assert not missing, f"no quick test for {sorted(missing)}: name one in tests/conftest.py's QUICK"
    for name, test in QUICK.items():
        assert test.startswith(f"test_{name}.py::"), f"QUICK[{name!r}] = {test}: not in test_{name}.py"
    files = sorted({f"tests/{test.split('::')[0]}" for test in QUICK.values()})
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "quick", *files],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = [line.removeprefix("tests/") for line in result.stdout.splitlines()
                 if line.startswith("tests/")]
    assert sorted(collected) == sorted(QUICK.values()), \
        f"QUICK names tests that were not collected (renamed?): {set(QUICK.values()) - set(collected)}" \
        f"\n{result.stdout[-2000:]}{result.stderr[-2000:]}"


def test_zero_and_fsdp_compose_one_sharded_step():
    """FSDP's optimizer composes mechanics/sharded_step.py's ShardedStep and writes none of its
    step again: no unscaling, norm pieces, finite check, kept-unchanged ranges or inner optimizer
    wrapping of its own. ZeRO's step() is the lecture's, in zero.py itself: its body, or the
    zero.py methods it reaches, calls the reduce-scatter, the norm's all-reduce, the clip, the
    inner optimizer's step and the all-gather, and no phase of ShardedStep's step."""
    step_only = {"unscale_grads", "shard_pieces", "squares_of", "keep_unchanged", "unused_ranges",
                 "isfinite", "wrap_inner", "clip_grads_with_norm_", "ShardBookkeeping"}
    tree = ast.parse(_path("mechanics.fsdp_optimizer").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "ShardedStep" in names, "fsdp_optimizer should compose sharded_step.py's ShardedStep"
    assert not names & step_only, f"fsdp_optimizer repeats ShardedStep: {sorted(names & step_only)}"

    tree = ast.parse(_path("zero").read_text())
    zero = next(c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "ZeroOptimizer")
    methods = {f.name: f for f in zero.body if isinstance(f, ast.FunctionDef)}
    reached, todo = set(), ["step"]          # step() and the methods of self it names, onwards
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += [n.attr for n in ast.walk(methods[name]) if isinstance(n, ast.Attribute)
                     and ast.unparse(n.value) == "self" and n.attr in methods]
    calls = [n.func for name in reached for n in ast.walk(methods[name])
             if isinstance(n, ast.Call)]
    called = {f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None) for f in calls}
    for name in ("reduce_scatter", "all_reduce", "clip_grads_with_norm_", "all_gather"):
        assert name in called, f"ZeroOptimizer.step() reaches no {name}: {sorted(reached)}"
    assert "self.optimizer.step" in {ast.unparse(f) for f in calls}, \
        "ZeroOptimizer.step() should call the inner optimizer's step() itself"
    through = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and ast.unparse(n.value) == "self.shard_step"}
    # The squares themselves are summed in one place, placements.add_squares (test_placements
    # holds that); zero.py reaches it through ShardedStep.squares and all-reduces them itself.
    phases = {"unscale", "read_decision", "clip", "step", "new_step"}
    assert not through & phases, f"zero.py steps through ShardedStep: {sorted(through & phases)}"


def test_the_parallel_layout_is_computed_once():
    """train.py makes the run's ParallelDims once (composition/mesh_checks.py) and passes it down: the
    composition, the report and the run log never derive the layout from args again."""
    for module in ("train", "composition.parallelize", "running.report", "running.run_log"):
        text = _path(module).read_text()
        assert "mesh_splits" not in text, f"{module} re-derives the layout: read the ParallelDims"
    assert "ParallelDims.from_args" in _path("train").read_text()


def _comments_and_docstrings(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and triple-quoted string in a Python source."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and
                                              token.string.lstrip("rbuRBUfF")[:3] in ('"""', "'''")):
            found.append((token.start[0], token.string))
    return found


def test_every_file_a_comment_names_exists():
    """A file named in a comment or a docstring (a word ending in .py) exists: from the root, or
    beside the file that names it. A placeholder is written in capitals (python CONCEPT.py)."""
    named = re.compile(r"(?<![\w/.{-])((?:[\w-]+/)*[\w-]+\.py)\b")
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split()
    missing = [f"{path}:{line} {name}" for path in files
               for line, text in _comments_and_docstrings((ROOT / path).read_text())
               for name in named.findall(text)
               if not name.split("/")[-1][:-3].isupper()
               and not (ROOT / name).exists() and not (ROOT / path).parent.joinpath(name).exists()]
    assert not missing, "comments name files that do not exist (write the path from the root):\n" \
                        + "\n".join(missing)


@pytest.mark.parametrize("module", sorted(TOP_LEVEL) + ["exercises"])
def test_no_textbook_line_is_over_100_characters(module):
    """The concept files, the model and train.py are read, not scrolled: no line over 100; nor
    the exercises' blanks and checkers, which a student reads beside them."""
    paths = sorted((ROOT / module).rglob("*.py")) if module == "exercises" else [_path(module)]
    long = [f"{path.relative_to(ROOT)}:{n}" for path in paths
            for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 100]
    assert not long, f"lines over 100 characters: {long}"


def test_no_class_is_swapped_at_run_time():
    """An object keeps the class it was built as: no file assigns `__class__` (by `=` or
    setattr); what an object can become is declared in its class (fsdp.Unit.offloaded)."""
    swaps = []
    for module, path in _project_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            named = [t for t in targets if isinstance(t, ast.Attribute) and t.attr == "__class__"]
            called = (isinstance(node, ast.Call) and "setattr" in ast.unparse(node.func)
                      and any(isinstance(a, ast.Constant) and a.value == "__class__"
                              for a in node.args))
            if named or called:
                swaps.append(f"{module}:{node.lineno}")
    assert not swaps, f"a class swapped at run time: {swaps}"


def test_fsdp_algorithm_keeps_no_bookkeeping():
    """fsdp.py's Unit and FSDP record no events and no peak of memory: FSDPTrace
    (mechanics/fsdp_state.py) watches them from outside."""
    tree = ast.parse(_path("fsdp").read_text())
    classes = [c for c in tree.body if isinstance(c, ast.ClassDef) and c.name in ("Unit", "FSDP")]
    assert len(classes) == 2
    names = {n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute)
             else n.arg if isinstance(n, ast.arg) else n.name
             for c in classes for n in ast.walk(c)
             if isinstance(n, (ast.Name, ast.Attribute, ast.arg, ast.FunctionDef))}
    kept = sorted(n for n in names if "event" in n.lower() or "peak" in n.lower())
    assert not kept, f"fsdp.py's algorithm keeps bookkeeping: {kept}"
