"""Silence torch's warning that numpy is missing, for the programs a user runs (train.py,
memory.py, bench.py): each imports this first, before torch, which warns as it is imported.

torch's numpy bridge warns "Failed to initialize NumPy" when numpy is absent; nothing in this
project uses numpy (a process group's Python objects travel as bytes: process_groups.py), and
requirements.txt does not install it. Only that warning is filtered: every other one still shows.
"""
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
