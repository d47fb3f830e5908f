"""Alone: how a concept file's demonstration starts, so that a start it cannot run is one line.

A concept file run alone (python lora.py, torchrun --nproc_per_node 2 ddp.py) takes no argument;
one that needs ranks runs under torchrun, on a world size its example splits over. A refusal is
one line on stderr naming the fix, said once under torchrun as train.py says its errors
(running/cli.py's say_error): by local rank 0, while the other ranks wait for torchrun to stop them.
Test: python -m pytest tests/test_bad_inputs_alone.py
"""
import argparse
import os
import sys
import time

import torch

QUIET_WAIT = 10      # seconds a rank other than local rank 0 waits for torchrun to stop it


def start_alone(torchrun: bool = False, worlds: tuple | None = None):
    """Start this file's demonstration: exit with one line unless it was started as it needs (no
    argument, --help aside; if torchrun, under torchrun on one of `worlds` ranks, None: any),
    then compute on one CPU thread (the ranks share the machine's cores)."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.split("\n")[0],
                                     allow_abbrev=False)
    extra, program, refusal = parser.parse_known_args()[1], parser.prog, None
    run = f"torchrun --nproc_per_node 2 {program}"
    if extra:
        refusal = f"{program}: error: unrecognized arguments: {' '.join(extra)} (see --help)"
    elif torchrun and "WORLD_SIZE" not in os.environ:
        refusal = f"{program} runs on several processes: {run}"
    elif torchrun and worlds and int(os.environ["WORLD_SIZE"]) not in worlds:
        ranks = f"{', '.join(map(str, worlds[:-1]))} or {worlds[-1]}" if worlds[1:] else worlds[0]
        refusal = f"{program}'s demonstration runs on {ranks} ranks: {run}"
    if refusal:
        if os.environ.get("LOCAL_RANK", "0") != "0":
            time.sleep(QUIET_WAIT)
        sys.exit(refusal)
    torch.set_num_threads(1)
