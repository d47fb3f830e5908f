"""running/errors.py: how a run stops on a bad input, in one line with the fix, without a traceback.

RunError is that stop. refused() tells this project's refusal of its input (a ValueError it
raised itself) from a bug on the way (a ValueError Python or torch raised), whose traceback stays.
Used by: train.py, running/snapshot.py, running/run_log.py. Test: python -m pytest tests/test_train.py -k refusal
"""
import os
import traceback


class RunError(Exception):
    """A run that cannot go on, with the reason and the fix: printed without a traceback."""


# The project's root: its files, and its packages' (running/, composition/ ...), one folder down.
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def refused(error: ValueError) -> bool:
    """Whether `error` is this project's refusal of its input: a `raise` statement in one of its
    files, which checked the input and names the fix. A ValueError that Python or torch raised
    on the way (an unpacking that failed, a bad argument to a torch call) is a bug, whose
    traceback must stay."""
    where = traceback.extract_tb(error.__traceback__)[-1]          # the frame it left from
    folder = os.path.dirname(os.path.abspath(where.filename))
    package = os.path.exists(os.path.join(folder, "__init__.py"))
    ours = folder == PROJECT or os.path.dirname(folder) == PROJECT and package
    return ours and where.line.startswith("raise ")
