"""The import graph points one way (foundations, concepts, extensions, composition, the run,
train.py; the napkin math reads the concepts, never the run): no project module imports one that
imports it back, however far round, and none hides an import inside a function (where a cycle
goes unseen until the function runs)."""
import ast
import functools
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOT_THE_PROJECT = {"tests", "docs", "examples", "__pycache__", "runs", "bench-results"}


def _project_files() -> dict:
    """{dotted module name: path} of every .py of the project (its packages' too), none of the
    tests, docs, examples or hidden directories (.venv, .git)."""
    modules = {}
    for directory, subdirectories, files in os.walk(ROOT):
        subdirectories[:] = [d for d in subdirectories if d not in NOT_THE_PROJECT and not d.startswith(".")]
        for name in files:
            if name.endswith(".py"):
                path = pathlib.Path(directory, name)
                parts = path.relative_to(ROOT).with_suffix("").parts
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(node, module: str, path: pathlib.Path, modules: dict) -> set:
    """The project modules an import statement names: `import a.b` a.b (or a), `from a import b`
    a.b where b is a module of a's, else a; a relative import from this file's package."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


@functools.cache
def _graph() -> tuple[dict, list]:
    """({module: the project modules it imports, anywhere in it}, ["path:line imports x", ...]
    for each project import inside a function)."""
    modules = _project_files()
    edges, in_functions = {}, set()
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        edges[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges[module] |= _imported(node, module, path, modules)
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        for name in sorted(_imported(node, module, path, modules)):
                            in_functions.add((str(path.relative_to(ROOT)), node.lineno, name))
    return edges, [f"{file}:{line} imports {name}" for file, line, name in sorted(in_functions)]


def find_cycle(edges: dict) -> list:
    """One cycle of the graph as the path round it, [a, b, ..., a]; [] if there is none (a depth-first
    search: an edge back to a module still on the search's path closes a cycle)."""
    on_path, done = [], set()

    def visit(module):
        on_path.append(module)
        for target in sorted(edges.get(module, ())):
            if target in on_path:
                return on_path[on_path.index(target):] + [target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        done.add(on_path.pop())
        return []

    for module in sorted(edges):
        cycle = [] if module in done else visit(module)
        if cycle:
            return cycle
    return []


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []        # a diamond, no cycle


def test_no_project_import_inside_a_function():
    _, in_functions = _graph()
    assert not in_functions, ("a project import inside a function hides the dependency (and any "
                              "cycle it closes): move it to the top of the file, or move the function "
                              "to the module it belongs to\n" + "\n".join(in_functions))


def test_the_import_graph_has_no_cycle():
    edges, _ = _graph()
    assert len(edges) > 40                        # the whole project was read, not an empty folder
    cycle = find_cycle(edges)
    assert not cycle, (f"import cycle: {' -> '.join(cycle)}: move what the lower module needs out "
                       f"of the higher one, so that imports point one way")


# What a package never imports: the run (running/) and train.py sit above the composition and the
# napkin math, which the run reads; the foundations sit under everything but the first rungs.
NEVER = {"composition": {"running", "train", "bench", "pictures"},
         "napkin": {"running", "train", "bench", "pictures"},
         "foundations": {"running", "train", "composition", "napkin", "extensions", "bench", "pictures"},
         # a concept's mechanics are what its file leaves out; an extension builds on both
         "mechanics": {"running", "train", "composition", "napkin", "extensions", "bench", "pictures"},
         "extensions": {"running", "train", "composition", "napkin", "bench", "pictures"},
         # the exercises read the concept files (the solutions) and nothing of the run
         "exercises": {"running", "train", "composition", "napkin", "bench", "pictures"}}


def test_nothing_imports_the_exercises():
    """The exercises sit above everything: a student's blank is never what the project runs."""
    edges, _ = _graph()
    wrong = [f"{module} imports {target}" for module, targets in sorted(edges.items())
             for target in targets if target.split(".")[0] == "exercises"
             and module.split(".")[0] != "exercises"]
    assert not wrong, "\n".join(wrong)


def test_no_engine_package_imports_up_the_order():
    edges, _ = _graph()
    wrong = [f"{module} imports {target}" for module, targets in sorted(edges.items())
             for target in sorted(targets) for package, never in NEVER.items()
             if module.split(".")[0] == package
             and any(target == n or target.startswith(n + ".") for n in never)]
    assert not wrong, "an arrow up the import order:\n" + "\n".join(wrong)
