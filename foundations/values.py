"""foundations/values.py: the command line's one parser and the values its flags take, for every entry point
(train.py, the napkin, the bench, the pictures, the schedules).

A refused command line is one line on stderr, "PROG: error: ... (see --help)", exit 2, before
any work: never argparse's usage dump, never a traceback from a value no run can use. The
argparse types below refuse, in the flag's name (argparse prefixes "argument --flag: "), what
parses but means nothing: a count out of range, a float that is not finite or out of range, a
size in bytes that is not a positive, finite number. A value may start with a dash (--lr -inf,
--mem-budget -1GB): it is parsed, then refused for its real reason, not as a missing argument.
Test: python -m pytest tests/test_bad_inputs.py
"""
import argparse
import json
import math
import os
import sys
import time

# The largest count a flag takes: a C int (what torch and the OS take for a count, a size in
# elements, a number of seconds), far above any run's world, batch or steps.
MOST = 2**31 - 1
# The largest size in bytes (a petabyte): above every machine's memory, below a float's range.
MOST_BYTES = 10**15


def reports_errors() -> bool:
    """Whether this process prints the job's one-line errors. torchrun merges its workers'
    output into one stream: every rank still refuses, but only local rank 0 (from the
    environment, before any process group) says why, once per node. Processes started
    otherwise (by hand, or a test) each print their own."""
    return "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("LOCAL_RANK", "0") == "0"


QUIET_WAIT = 10      # seconds a quiet rank leaves local rank 0 to print a refusal both reached


def say_error(line: str, refusal: bool = True):
    """Print one error line to stderr, once per job (reports_errors). torchrun stops the other
    workers when the first fails: a quiet rank that exited at once could stop local rank 0
    before it printed. So a quiet rank's refusal waits QUIET_WAIT s for torchrun to stop it,
    and says its line itself if still running (a refusal local rank 0 did not reach). Not a
    refusal (Ctrl-C, which every rank got): a quiet rank says nothing and leaves at once."""
    if not reports_errors():
        if not refusal:
            return
        time.sleep(QUIET_WAIT)
    print(line, file=sys.stderr, flush=True)
    record_for_torchrun(line)


def record_for_torchrun(line: str):
    """Under torchrun, the line in this worker's error file (TORCHELASTIC_ERROR_FILE, the JSON
    torch.distributed.elastic's ErrorHandler writes): torchrun's failure summary then shows it as
    the root cause, where it would say "To enable traceback see ..."."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as file:
            json.dump({"message": {"message": line, "extraInfo": {
                "py_callstack": line, "timestamp": str(int(time.time()))}}}, file)


class Parser(argparse.ArgumentParser):
    """argparse, a refused command line said in one line ("PROG: error: ... (see --help)", exit 2)
    without the usage dump before it, once under torchrun (say_error); --help, once. A value
    that starts with a dash (--lr -inf) is the flag's value, not a missing one."""

    def error(self, message):
        say_error(f"{self.prog}: error: {message} (see --help)")
        sys.exit(2)

    def print_help(self, file=None):
        if reports_errors():
            super().print_help(file)

    def parse_known_args(self, args=None, namespace=None):
        """argparse takes "-inf" or "-1GB" after a flag for another flag, and says "expected one
        argument": join such a value to its flag (--lr=-inf), which argparse then parses."""
        args = sys.argv[1:] if args is None else list(args)
        joined = []
        for arg in args:
            flag = self._option_string_actions.get(joined[-1]) if joined else None
            if (flag is not None and flag.nargs is None and arg.startswith("-")
                    and not arg.startswith("--") and arg not in self._option_string_actions):
                joined[-1] = f"{joined[-1]}={arg}"
            else:
                joined.append(arg)
        return super().parse_known_args(joined, namespace)


class HelpFormatter(argparse.HelpFormatter):
    """--help shows each option's default once: appended unless the help already says it, and
    left out where there is none (None, a flag's: on when given, off when not)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("(default" in text or action.default in (None, False, argparse.SUPPRESS)
                or action.nargs == 0 or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class Refused(argparse.ArgumentTypeError, ValueError):
    """A value refused: argparse says its message after the flag's name; a caller parsing a value
    itself (a size read from elsewhere) catches it as a ValueError."""


def count(least: int = 1, most: int = MOST):
    """An argparse type: a whole number from least to most (e.g. count(1): ranks, steps)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise Refused(f"{text!r} is not a whole number: give one from {least:,} to {most:,}")
        if not least <= value <= most:
            raise Refused(f"give a whole number from {least:,} to {most:,}, got {value}")
        return value
    return parse


def counts(least: int = 1, most: int = MOST):
    """An argparse type: a comma list of counts from least to most (e.g. world sizes: 1,2,4)."""
    def parse(text: str) -> list[int]:
        one = count(least, most)
        try:
            return [one(part) for part in text.split(",")]
        except Refused:
            raise Refused(f"{text!r} is not a comma list of whole numbers from {least:,} to "
                          f"{most:,}, e.g. 1,2,4")
    return parse


def whole(text: str) -> int:
    """An argparse type: an integer no larger than a C int either way (MOST), its range left to
    the flag's own check (which names the fix: "--steps must be at least 1")."""
    try:
        value = int(text)
    except ValueError:
        raise Refused(f"{text!r} is not a whole number")
    if abs(value) > MOST:
        raise Refused(f"{value} is out of any run's range: give a whole number up to {MOST:,}")
    return value


def real(least: float = -math.inf, most: float = math.inf, above: bool = False):
    """An argparse type: a finite float from least to most (above: greater than least)."""
    if (least, most) == (0, math.inf):
        span = "a positive, finite number" if above else "0 or a positive, finite number"
    else:
        span = (f"a finite number {'above' if above else 'from'} {least:g}"
                + (f" to {most:g}" if most < math.inf else ""))

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise Refused(f"{text!r} is not a number: give {span}")
        if not (least < value if above else least <= value) or not value <= most \
                or not math.isfinite(value):
            raise Refused(f"give {span}, got {text}")
        return value
    return parse


def number(text: str) -> float:
    """An argparse type: any finite float, its range left to the flag's own check."""
    return real()(text)


UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 1e9, "MB": 1e6, "KB": 1e3,
         "G": 1e9, "M": 1e6, "K": 1e3, "B": 1}


def size(text: str) -> int:
    """'24GB' (1e9), '512MiB' (2**20), '80G', '1.5e9' -> bytes, a positive, finite number up to
    MOST_BYTES (also an argparse type)."""
    upper = text.strip().upper()
    unit = next((u for u in UNITS if upper.endswith(u)), "B")
    try:
        value = float(upper[: len(upper) - len(unit)] if upper.endswith(unit) else upper)
    except ValueError:
        value = math.nan
    if not 0 < value * UNITS[unit] <= MOST_BYTES:                    # NaN and inf fail too
        raise Refused(f"memory {text!r} is not a positive size up to a petabyte: write it like "
                      f"24GB, 80GB, 512MiB")
    return int(value * UNITS[unit])


def quantity(text: str) -> float:
    """'7e9', '7B', '7.5e9', '350M', '1.2T' -> a count (B: billion, not bytes), finite (its
    least: the caller's check); also an argparse type."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(text.strip()[-1:].upper(), 1)
    try:
        value = float(text.strip()[:-1] if scale != 1 else text) * scale
    except ValueError:
        value = math.nan
    if not abs(value) < math.inf:                                     # nan, inf
        raise Refused(f"{text!r} is not a parameter count: write it like 7e9, 7B or 350M")
    return value
