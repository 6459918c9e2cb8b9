#!/usr/bin/env bash
# The whole test suite, as CI runs it: formatter check, linter, docs build, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
BIN=.venv/bin

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
