"""napkin/experiment.py's runs under torchrun: every rank runs each planned train.py command in turn.

experiment.run_all starts this file on every rank with the plan it wrote (a JSON file: the
train.py commands, and the shape machines.this measures after them); each rank calls train.main
once per rung, so the launch and the imports are paid once. Rank 0 marks where each run's log
starts ("=== run i"), then prints this machine as measured (cached in .cache/). It is the
run's side of the measurement, here so that the napkin math never imports train.py.
Run: napkin/experiment.py runs it (python -m napkin.memory --advise --model tiny --world 2 --measure)
Test: python -m pytest tests/test_advisor.py -k measure
"""
import json
import os
import sys
from dataclasses import asdict

import torch.distributed as dist

import train
from napkin.machines import this
from model import PRESETS
from foundations.world import exit_distributed


def worker(plan_path: str):
    """Under torchrun: every rank runs each planned train.py command in turn; rank 0 marks each
    run's log, then prints this machine as measured (machines.this, cached in .cache/)."""
    with open(plan_path) as f:
        plan = json.load(f)
    for i, argv in enumerate(plan["runs"]):
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"=== run {i}", flush=True)
        train.main(argv)
    machine = this(PRESETS[plan["model"]], plan["rows"], plan["seq_len"], plan["precision"])
    if dist.get_rank() == 0:
        print(f"=== run machine\n{json.dumps(asdict(machine))}", flush=True)
    exit_distributed()


if __name__ == "__main__":
    worker(sys.argv[1])
