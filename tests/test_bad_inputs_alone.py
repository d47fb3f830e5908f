"""A concept file run alone refuses what its demonstration cannot do in one line on stderr that
names the fix, said once under torchrun, with no traceback: started without torchrun where it
needs ranks, given any argument (none takes one), or on a world size its example cannot split
over; at a world size it accepts, its check against one process holds (ddp.py on 3 ranks). The
commands run concurrently, each as a reader would type it (torchrun: --standalone, a free port),
each a process forked from one that has imported torch (tests/forked.py)."""
import os
import re

import pytest

import forked
from test_alone import COMMANDS, ROOT

SEVERAL = [concept for concept, command in COMMANDS.items() if command.startswith("torchrun")]
BOGUS = "{}.py: error: unrecognized arguments: --bogus (see --help)"
# The world sizes a demonstration cannot split its example over, and the ones its line names.
REFUSED = {("fsdp", 1): "2", ("fsdp", 3): "2", ("moe", 3): "1, 2 or 4",
           ("tensor_parallel", 3): "1, 2, 4 or 8", ("context_parallel", 3): "1, 2, 4, 8 or 16"}
REFUSES_A_WORLD = {concept for concept, _ in REFUSED}
# (concept, ranks: None without torchrun, arguments) -> the one line it should print on stderr.
# Under torchrun each file's line is said once: an argument on 2 ranks, or a world refused.
CASES = {
    **{(c, None, ()): f"{c}.py runs on several processes: torchrun --nproc_per_node 2 {c}.py"
       for c in SEVERAL},
    **{(c, None, ("--bogus",)): BOGUS.format(c) for c in COMMANDS},
    **{(c, 2, ("--bogus",)): BOGUS.format(c) for c in COMMANDS if c not in REFUSES_A_WORLD},
    **{(c, world, ()): f"{c}.py's demonstration runs on {ranks} ranks: torchrun "
                       f"--nproc_per_node 2 {c}.py" for (c, world), ranks in REFUSED.items()},
}
# torchrun's own output: its log lines, and the report that ends it once a worker failed (a
# traceback through torch's launcher alone, then a summary of the workers' exits)
TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ \S+:\d+\] .*\n?", re.M)
TORCHRUN_REPORT = re.compile(r"^Traceback \(most recent call last\):\n"
                             r"(?:  File \"(?:<frozen runpy>|[^\"]*/torchrun|[^\"]*/torch/[^\"]*)\""
                             r".*\n(?:    .*\n)*)+"
                             r"torch\.distributed\.elastic\.multiprocessing\.errors\."
                             r"ChildFailedError:[\s\S]*\Z", re.M)


def alone_argv(concept: str, ranks: int | None, args: tuple) -> list:
    """What follows `python` in `python CONCEPT.py ARGS`, or under torchrun on `ranks` processes."""
    launcher = [] if ranks is None else ["-m", "torch.distributed.run", "--standalone",
                                         "--nproc_per_node", str(ranks)]
    return [*launcher, f"{concept}.py", *args]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Every case's run, and ddp.py's on 3 ranks, 4 at a time, from the repository's root, each
    a process of its own forked by tests/forked.py from one python that has imported torch
    (torchrun's ranks are its own, fresh): {case: (exit status, stdout, stderr less torchrun's
    own output)}. Past forked.TIMEOUT it is stopped, torchrun's ranks with it."""
    cases = [*CASES, ("ddp", 3, ())]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    ran = forked.run([[alone_argv(*case), str(ROOT), 0] for case in cases],
                     {**env, "OMP_NUM_THREADS": "1"}, tmp_path_factory.mktemp("logs"))
    return {case: (status, stdout, TORCHRUN_REPORT.sub("", TORCHRUN_LOG.sub("", stderr)) +
                   ("" if status is not None else f"\n... stopped after {forked.TIMEOUT} s"))
            for case, (status, stdout, stderr) in zip(cases, ran)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1] or 'python'}{''.join(c[2])}")
def test_a_concept_file_refuses_in_one_line_once(ran, case):
    status, _, stderr = ran[case]
    assert status != 0 and stderr.splitlines() == [CASES[case]], (status, stderr)


def test_ddp_on_three_ranks_equals_one_process(ran):
    """8 rows a rank: each rank's mean over equal rows, averaged, is one process's mean (8 rows
    over all ranks cut 3/3/2, and the average of those means is not)."""
    status, stdout, stderr = ran["ddp", 3, ()]
    assert status == 0 and "max |difference| from one process" in stdout, stdout + stderr
