#!/bin/sh
# Set-up for the README's two commands, safe to run again: a virtual environment in .venv holding
# the torch this project is tested with (2.13.0), numpy (torch warns without it) and pytest.
# Without an NVIDIA GPU it takes torch's CPU build (a 190 MB wheel) from PyTorch's CPU index:
# PyPI's default torch for Linux brings CUDA's libraries too (about 2.7 GB). On macOS PyPI's
# build is the CPU one. A machine with a GPU gets PyPI's CUDA build.
set -e
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
if command -v nvidia-smi >/dev/null 2>&1 || [ "$(uname)" = Darwin ]; then
    .venv/bin/python -m pip install -q torch==2.13.0
else
    .venv/bin/python -m pip install -q torch==2.13.0 --no-deps --index-url https://download.pytorch.org/whl/cpu
fi
# torch's own dependencies (sympy, jinja2, ...) come with the rest, from PyPI.
.venv/bin/python -m pip install -q -r requirements.txt
