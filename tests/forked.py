"""Run many commands (`python ARGV...`) as many processes, each forked from one python that has
imported torch and the parts of it the repository uses, not each importing them again (two to
four seconds of CPU a process, nearly all of a refusal's).

run(cases, env, logs) starts `python tests/forked.py` in env, which forks each case: [argv (what
follows `python`), directory, address-space limit in bytes or 0]. A case's process starts in its
directory as `python ARGV` starts: sys.argv, sys.path[0] (the script's folder, or the directory
under -m), __main__, the limit (`ulimit -v`), a session of its own. Its stdout and stderr go to
files under logs (outside the directory, which stays as the case left it). It exits as python
exits: atexit, a SystemExit's code or message, an uncaught exception through sys.excepthook and
1. Four run at a time; one still running after TIMEOUT is stopped, its session with it (SIGTERM,
which torchrun passes on to its ranks, then SIGKILL). torch reads OMP_NUM_THREADS as it is
imported: once, in the parent, from env.
"""
import atexit
import importlib
import json
import os
import pathlib
import resource
import runpy
import signal
import subprocess
import sys
import time

TIMEOUT = 180                     # seconds: a refusal takes well under one; more is work
AT_ONCE = 4
# torch's parts the entry points import (DTensor brings sympy: most of the time), none of ours.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.optim", "torch.distributed.pipelining", "torch._dynamo"]


def run(cases: list, env: dict, logs: pathlib.Path) -> list:
    """[(exit status, or None if stopped at TIMEOUT; stdout; stderr)] of each case."""
    (logs / "cases.json").write_text(json.dumps([[*case, str(logs / str(i))]
                                                 for i, case in enumerate(cases)]))
    subprocess.run([sys.executable, __file__, str(logs / "cases.json"), str(logs / "codes.json")],
                   env=env, check=True, timeout=TIMEOUT * len(cases))
    codes = json.loads((logs / "codes.json").read_text())
    return [(code, (logs / f"{i}.out").read_text(), (logs / f"{i}.err").read_text())
            for i, code in enumerate(codes)]


def _case_main(argv: list, directory: str, limit: int, log: str):
    """In the forked child: become `python ARGV` in directory, run it, exit as python would."""
    os.setsid()
    os.chdir(directory)
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for fd, suffix in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(log + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = ["-m", *argv[2:]], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) or stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException as error:               # the traceback python prints: from runpy on
        error = error.with_traceback(error.__traceback__.tb_next)      # not _case_main's frame
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _stop(pid: int):
    """SIGTERM to the case's session (torchrun passes it on to its ranks), SIGKILL after 15 s."""
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while not os.waitpid(pid, os.WNOHANG)[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)          # whatever is left of the session
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):         # gone, and reaped above
        pass


def main(cases_path: str, codes_path: str):
    for name in PRELOAD:
        importlib.import_module(name)
    with open(cases_path) as f:
        cases = json.load(f)
    codes, running, waiting = [None] * len(cases), {}, list(range(len(cases)))
    while waiting or running:
        while waiting and len(running) < AT_ONCE:
            i = waiting.pop(0)
            pid = os.fork()
            if pid == 0:
                _case_main(*cases[i])
            running[pid] = i, time.monotonic()
        for pid, (i, began) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[i] = os.waitstatus_to_exitcode(status)
                del running[pid]
            elif time.monotonic() - began > TIMEOUT:       # it went to work: nonsense accepted
                _stop(pid)
                del running[pid]
        time.sleep(0.01)
    with open(codes_path, "w") as f:
        json.dump(codes, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
