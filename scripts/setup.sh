#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install freeride into it.
# torch is installed first, pinned to 2.13.0: on CPU machines that is a CPU build on local disk,
# and with it in place the package's torch>=2.4 requirement never pulls a multi-GB CUDA build.
# Source this file: it leaves the environment activated.
VENV=${FREERIDE_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
