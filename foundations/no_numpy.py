"""Silence torch's warning that numpy is missing, for the programs a user runs (train.py,
memory.py, bench.py, mixed_precision.py, dtypes.py, examples/loop.py): each imports this first,
before torch, which warns as it is imported.

torch's numpy bridge warns "Failed to initialize NumPy" when numpy is absent; nothing in this
project uses numpy (a process group's Python objects travel as bytes: process_groups.py), and
requirements.txt does not install it. Only that warning is filtered: every other one still shows.
A filter works only in a process that installs it before its first `import torch`: pytest's
own process imports torch before any of this (pytest.ini filters it there), and torchrun's
launcher process imports torch before it starts train.py, so its one warning is torch's and
not ours to filter (the README's note on torchrun's output).
"""
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
