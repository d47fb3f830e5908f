"""Run many commands (`python ARGV...`) as many processes, each forked from one python that has
imported torch and the parts of it the repository uses, not each importing them again (two to
four seconds of CPU a process, nearly all of a refusal's).

    python tests/forked.py CASES.json RESULTS.json

CASES.json: [[argv (what follows `python`), directory, address-space limit in bytes or 0, log
prefix], ...]. Each case's process starts in its directory as `python ARGV` starts: sys.argv,
sys.path[0] (the script's folder, or the directory under -m), __main__, the limit (`ulimit -v`);
its stdout and stderr go to LOG.out and LOG.err (outside the directory, which stays as the case
left it); it exits as python exits (atexit, a SystemExit's code or message, an uncaught
exception's traceback and 1). RESULTS.json: [exit status, or None if still running after the
timeout and killed, ...], four cases at a time. Start it with the environment the cases want:
torch reads OMP_NUM_THREADS as it is imported, here, before the first fork.
"""
import atexit
import importlib
import json
import os
import resource
import runpy
import signal
import sys
import time
import traceback

# torch's parts the entry points import (DTensor brings sympy: most of the time), none of ours.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.optim", "torch.distributed.pipelining", "torch._dynamo"]
TIMEOUT = 180                     # seconds: a refusal takes well under one; more is work
AT_ONCE = 4


def _case_main(argv: list, directory: str, limit: int, log: str):
    """In the forked child: become `python ARGV` in directory, run it, exit as python would."""
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
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def main(cases_path: str, results_path: str):
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
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                del running[pid]
        time.sleep(0.01)
    with open(results_path, "w") as f:
        json.dump(codes, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
