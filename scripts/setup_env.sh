#!/usr/bin/env bash
# Makes .venv (Python 3.11+) with the CPU build of torch and this repo installed as the
# patched `torchtune` distribution, in development (editable) mode, with the test extras.
# Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check --quiet)
BNB_VERSION=0.50.2

# torch first, pinned, so no resolver ever pulls a multi-GB CUDA build on this machine.
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  "${PIP[@]}" install torch==2.13.0
fi
# The patched torchtune (upstream 0.6.1 wheel + this tree) and the test tools.
"${PIP[@]}" install -e ".[test]"
# bitsandbytes, whose optimizers the shipped in-backward configs use, runs them on the
# CPU too. --no-deps: its torch requirement must never let a resolver touch torch.
if ! "$PY" -c "import bitsandbytes, sys; sys.exit(bitsandbytes.__version__ != '$BNB_VERSION')" 2>/dev/null; then
  "${PIP[@]}" install --no-deps "bitsandbytes==$BNB_VERSION"
fi
