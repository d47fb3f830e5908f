"""Grading: run a student's exercise step by step against one process; say where it first differs.

A checker (exercises/checkers/NAME.py) is a list of steps in the lecture's order. Each step runs a
part of the student's file on inputs every rank can rebuild, and compares what it returns with a
reference the checker writes out plainly (one process: a sum, a loop over tokens, torch's own
layer), within a bound named by its cause. The first step that differs ends the check with one
line: the step, the tensor, by how much, against which bound, and a hint naming the lecture's
step it concerns. A part still raising NotImplementedError (its TODO) is "not implemented yet".

Ranks agree after every step (an all-reduce of "did this rank fail", on a group of its own), so a
rank that fails does not leave the others waiting in the next step's collective; a rank stuck in
a message that never comes gives up after TIMEOUT seconds, and the rank that failed first is the
one reported.
"""
import contextlib
import datetime
import importlib
import importlib.util
import multiprocessing
import os
import queue
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

TIMEOUT = 20      # seconds a rank waits for a message in a check before it gives up
LAUNCH_TIMEOUT = 300      # seconds for a whole check on ranks it started
LOAD = "load the file"    # the first step of every check


class Ended(Exception):
    """A check's end other than passing: status "todo", "differs" or "waited"."""

    def __init__(self, status: str, line: str):
        super().__init__(line)
        self.status, self.line = status, line


class Grader:
    """What a checker's steps call: step() around each, close() and same() to compare."""

    def __init__(self, path: str, group=None, agree_group=None, live: bool = False):
        self.path, self.group, self.agree_group, self.live = path, group, agree_group, live
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1
        self.passed, self.step_name, self.hint = [], None, None

    @contextlib.contextmanager
    def step(self, name: str, hint: str):
        """One step of the check: its name as the lecture says it, and where to look if it
        differs. Every rank leaves it together, passed or failed."""
        self.step_name, self.hint = name, hint
        failure = None
        try:
            yield
        except Ended as ended:
            failure = ended
        except NotImplementedError:
            failure = Ended("todo", f"not implemented yet: {self._where()} still has its TODO")
        except Exception as error:              # gloo gave up waiting, or the student's code raised
            if isinstance(error, RuntimeError) and "timeout" in str(error).lower().replace(" ", ""):
                failure = Ended("waited", f"{name}: {self._who()}waited more than {TIMEOUT} s for "
                                f"a message that never came: the ranks' sends and receives do "
                                f"not pair up")
            else:
                failure = Ended("differs", f"{name}: {self._who()}{self._raised(error)}")
        if self._any_failed(failure is not None):
            raise failure or Ended("waited", f"{name}: another rank failed this step")
        self.passed.append(name)
        if self.live and self.rank == 0 and name != LOAD:   # each step said as it passes
            print(f"  ok      {name}", flush=True)

    def close(self, what: str, got: torch.Tensor, expected: torch.Tensor, atol: float,
              why: str, rtol: float = 0.0):
        """got within atol + rtol |expected| of expected, element by element (why: the bound's
        cause, said with it)."""
        if not isinstance(got, torch.Tensor):
            self.fail(f"{what} is a {type(got).__name__}, one process's is a tensor "
                      f"{tuple(expected.shape)}")
        if got.shape != expected.shape:
            self.fail(f"{what} has shape {tuple(got.shape)}, one process's "
                      f"{tuple(expected.shape)}")
        got, expected = got.detach().double(), expected.detach().double()
        excess = (got - expected).abs() - (atol + rtol * expected.abs())
        excess = torch.where(torch.isnan(excess), torch.inf, excess)
        if excess.numel() and excess.max() > 0:
            at = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
            index = f"[{', '.join(map(str, at))}]" if at else ""
            bound = atol + rtol * abs(float(expected[at]))
            self.fail(f"{what}{index} is {float(got[at]):.6g}, one process's "
                      f"{float(expected[at]):.6g}: off by {abs(float(got[at] - expected[at])):.3g}"
                      f" (bound {bound:.3g}: {why})")

    def same(self, what: str, got, expected):
        """got == expected exactly (lists, numbers, schedules)."""
        if got != expected:
            self.fail(f"{what} is {got!r}, expected {expected!r}")

    def fail(self, detail: str):
        where = f"on rank {self.rank}, " if self.world > 1 else ""
        raise Ended("differs", f"{self.step_name}: {where}{detail}")

    def _who(self) -> str:
        return f"rank {self.rank} " if self.world > 1 else "your code "

    def _any_failed(self, failed: bool) -> bool:
        if self.agree_group is None:
            return failed
        flag = torch.tensor([float(failed)])
        dist.all_reduce(flag, group=self.agree_group)
        return bool(flag.item())

    def _frame_in_exercise(self, tb):
        frames = [f for f in traceback.extract_tb(tb)
                  if os.path.abspath(f.filename) == os.path.abspath(self.path)]
        return frames[-1] if frames else None

    def _where(self) -> str:
        frame = self._frame_in_exercise(sys.exc_info()[2])
        return f"{frame.name} ({shown(self.path)}, line {frame.lineno})" if frame \
            else shown(self.path)

    def _raised(self, error: Exception) -> str:
        frame = self._frame_in_exercise(error.__traceback__)
        at = f" at {shown(self.path)} line {frame.lineno}, in {frame.name}" if frame else ""
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"raised {type(error).__name__}{': ' + first[:200] if first else ''}{at}"


def shown(path: str) -> str:
    """path as the student would type it: relative to here when it is under here."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def load_exercise(name: str, path: str):
    """The student's file at path as a module (its own name, so the concept file is not it)."""
    spec = importlib.util.spec_from_file_location(f"exercise_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checker(name: str):
    return importlib.import_module(f"exercises.checkers.{name}")


def grade(name: str, path: str, group=None, agree_group=None, live: bool = False) -> dict:
    """Run checker NAME on the exercise at path, on this rank: {"status": "passed", "todo",
    "differs" or "waited"; "passed": the steps passed; "step", "line", "hint": the first that
    did not}. live: rank 0 prints each step as it passes."""
    grader = Grader(path, group, agree_group, live)
    try:
        with grader.step(LOAD, "it must import as it came, with your code added"):
            exercise = load_exercise(name, path)
        checker(name).check(exercise, grader)
    except Ended as ended:
        return dict(status=ended.status, passed=grader.passed, step=grader.step_name,
                    line=ended.line, hint=grader.hint)
    return dict(status="passed", passed=grader.passed, step=None, line=None, hint=None)


def grade_on_rank(name: str, path: str, live: bool = False) -> dict:
    """grade() on this rank of the default group, with two groups of the check's own: one whose
    messages give up after TIMEOUT seconds, and one for the ranks' agreement after each step."""
    timeout = datetime.timedelta(seconds=TIMEOUT)
    group = dist.new_group(timeout=timeout)
    agree_group = dist.new_group(timeout=datetime.timedelta(seconds=3 * TIMEOUT))
    try:
        return grade(name, path, group, agree_group, live)
    finally:
        dist.destroy_process_group(agree_group)
        dist.destroy_process_group(group)


def _rank_main(name, path, rank, world, store_path, results):
    """One rank the check started: join the others through a file, grade, send the verdict."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        results.put((rank, grade_on_rank(name, path, live=True)))
    finally:
        dist.destroy_process_group()


def launch(name: str, path: str, world: int) -> dict:
    """Start world ranks (spawned: a fresh python each), grade on each, combine their verdicts."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        results = context.Queue()
        procs = [context.Process(target=_rank_main,
                                 args=(name, path, rank, world, os.path.join(tmp, "store"),
                                       results)) for rank in range(world)]
        for p in procs:
            p.start()
        verdicts, start = {}, time.monotonic()
        try:
            while len(verdicts) < world:
                try:
                    rank, verdict = results.get(timeout=1)
                    verdicts[rank] = verdict
                except queue.Empty:
                    stopped = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if stopped or time.monotonic() - start > LAUNCH_TIMEOUT:
                        sys.exit(f"exercises check {name}: rank {(stopped or [0])[0]} stopped "
                                 f"without a verdict (its traceback is above)")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return combine([verdicts[r] for r in range(world)])


def combine(verdicts: list) -> dict:
    """One verdict from every rank's: the first rank's that failed, rather than one that only
    waited for it."""
    for status in ("differs", "todo", "waited"):
        for verdict in verdicts:
            if verdict["status"] == status:
                return verdict
    return verdicts[0]


def report(name: str, verdict: dict) -> str:
    """The verdict's lines, after the steps said as they passed."""
    if verdict["status"] == "passed":
        return f"passed: every step of {name} equals one process"
    if verdict["status"] == "todo":
        return f"  {verdict['line']}"
    return f"  FAILED  {verdict['line']}\n  hint: {verdict['hint']}"
