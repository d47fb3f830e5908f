"""python -m exercises list | check NAME [--file PATH]: the exercises and their checker.

check runs exercises/NAME.py (or PATH) against one process step by step, on the ranks its
checker names: it starts them itself (each a fresh python), or runs on torchrun's.
"""
import argparse
import ast
import os
import sys
import textwrap

import torch
import torch.distributed as dist

from exercises import EXERCISES
from exercises.grading import checker, combine, grade, grade_on_rank, launch, report, shown

HERE = os.path.dirname(os.path.abspath(__file__))


def left_to_write(path: str, asked: list) -> list:
    """The parts (qualified names) of asked that path's functions still leave as a TODO: their
    body raises NotImplementedError."""
    left = []

    def visit(node, prefix):
        for child in node.body:
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef) and f"{prefix}{child.name}" in asked:
                if any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n)
                       for n in ast.walk(child)):
                    left.append(f"{prefix}{child.name}")
    visit(ast.parse(open(path).read()), "")
    return left


def list_exercises():
    print(f"{'exercise':17} {'ranks':>5} {'left':>5}  what to write (exercises/NAME.py)")
    for name in EXERCISES:
        asked = checker(name).PARTS
        left = left_to_write(os.path.join(HERE, f"{name}.py"), asked)
        status = f"{len(left)}/{len(asked)}" if left else "done?"
        lines = textwrap.wrap(", ".join(asked), 100 - 31)
        print(f"{name:17} {checker(name).WORLD:>5} {status:>5}  {lines[0]}")
        for line in lines[1:]:
            print(f"{'':31}{line}")
    print("left: parts still raising NotImplementedError, of all; done?: none left, "
          "now check it:\n    python -m exercises check NAME")


def check(name: str, path: str):
    world = checker(name).WORLD
    ranks = f"on {world} ranks " if world > 1 else ""
    header = f"checking {shown(path)} {ranks}against one process, step by step:"
    if "WORLD_SIZE" in os.environ:                     # under torchrun: its ranks
        if int(os.environ["WORLD_SIZE"]) != world:
            sys.exit(f"exercises check {name} runs on {world} ranks: "
                     f"torchrun --nproc_per_node {world} -m exercises check {name}")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            print(header, flush=True)
        verdicts = [None] * world
        dist.all_gather_object(verdicts, grade_on_rank(name, path, live=True))
        if dist.get_rank() == 0:
            print(report(name, combine(verdicts)))
        dist.destroy_process_group()
        return
    if world == 1:
        print(header, flush=True)
        print(report(name, grade(name, path, live=True)))
        return
    print(f"{header} (starting {world} ranks: each imports torch first)", flush=True)
    print(report(name, launch(name, path, world)))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m exercises",
                                     description=__doc__.split("\n")[0], allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every exercise, its ranks, what is left to write")
    one = commands.add_parser("check", help="check one exercise against one process")
    one.add_argument("name", help=f"one of: {', '.join(EXERCISES)}")
    one.add_argument("--file", help="the file to check (default exercises/NAME.py)")
    args = parser.parse_args(argv)
    if args.command == "list":
        return list_exercises()
    if args.name not in EXERCISES:
        parser.error(f"argument name: no exercise {args.name!r}: choose one of "
                     f"{', '.join(EXERCISES)}")
    path = args.file or os.path.join(HERE, f"{args.name}.py")
    if not os.path.isfile(path):
        parser.error(f"argument --file: {path} is not a file: give the exercise's path")
    check(args.name, path)


if __name__ == "__main__":
    main()
