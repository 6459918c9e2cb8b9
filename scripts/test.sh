#!/usr/bin/env bash
# The whole test suite, as CI runs it: formatter check, linter, docs build, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
BIN=.venv/bin
# The tests train tiny models, which run fastest on one thread per process (more
# threads mostly wait for each other, worse still with 2 processes on 2 cores); one
# thread everywhere also makes 1-process and 2-process runs use the same kernels.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# torch 2.13's on-disk AOT-autograd cache can hand a graph compiled for one torchao
# optimizer to another in a later process (see tests/conftest.py): keep it off.
export TORCHINDUCTOR_AUTOGRAD_CACHE=0

echo "== ruff format --check"
"$BIN/ruff" format --check .
echo "== ruff check"
"$BIN/ruff" check .
if [ -f docs/source/conf.py ]; then
  echo "== sphinx (warnings are errors) and doctests"
  "$BIN/python" -m sphinx -W --keep-going -q -b html docs/source docs/build/html
  "$BIN/python" -m sphinx -W --keep-going -q -b doctest docs/source docs/build/doctest
fi
echo "== pytest"
set +e
"$BIN/python" -m pytest "$@"
rc=$?
set -e
# 5 = no tests collected: not a failure of the suite.
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"
