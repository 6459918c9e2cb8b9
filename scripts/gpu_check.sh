#!/usr/bin/env bash
# The GPU check: brings this project up on a GPU machine whose python3 already has a
# CUDA torch (and no internet), runs the CUDA tests and a short measurement, and writes
# the results under $OUT (default: ./gpu_results). It never replaces that torch.
#
# Prepare, here, once (needs PyPI; about 53 MB of wheels into the git-ignored .whl/):
#
#   bash scripts/fetch_gpu_wheels.sh
#
# Then run it on the device machine with the `run` tool, in one call (about 6 of the 8
# minutes it is given; each phase is cut to fit what is left of the budget):
#
#   command:   bash scripts/gpu_check.sh
#   carry:     [".whl"]
#   timeout_s: 480
#
# A dry run on a CPU machine, with this repo's .venv (Python 3.11, CPU torch): the same
# install from .whl/ into a scratch target, the CUDA tests collected and skipped, the
# shipped config on a tiny model for 2 steps per mode, and the benchmark on its
# smallest size:
#
#   bash scripts/gpu_check.sh --dry-run
#
# Phases, in order of importance (a phase that does not fit in what is left of the
# budget, GPU_CHECK_BUDGET_S, is skipped and says so):
#
# 1. install: the carried wheels into $WORK/site (pip --target, no index, no
#    dependencies), and this tree laid over torchtune 0.6.1's upstream wheel by the
#    repo's own build backend (_build_backend/torchtune_overlay.py, given the carried
#    wheel, so it downloads nothing); PYTHONPATH=$WORK/site. Checks that torchtune
#    0.6.1+oib and every carried package import from there, that torch is still the
#    machine's own, and that each carried package's requirements are met;
# 2. tests/torchtune/training/test_memory_cuda.py (OptimizerInBackward on CUDA);
# 3. tests/recipes/test_cuda_recipes.py (FSDP2 on one GPU with NCCL, with and without
#    CPU offload; activation offloading);
# 4. scripts/measure_shipped_in_bwd.py: llama3_2/1B_full_single_device as shipped on
#    a randomly initialised llama3_2_1b, 20 steps plain and 20 in-backward;
# 5. benchmarks/optimizer_in_backward.py --device cuda at its 1b size.
#
# Results in $OUT (at most 8 files, as the device tool returns): summary.md (every
# phase's status, the environment, the test outcomes and both measurements),
# gpu_check.log (everything printed), measure_shipped.json, and
# benchmark/optimizer_in_backward.{md,json,png}.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
  esac
done

if [ "$DRY_RUN" = 1 ]; then
  PY="${PYTHON:-$REPO/.venv/bin/python}"
  WORK="${GPU_CHECK_WORK:-/tmp/gpu_check_dry}"
  BUDGET_S="${GPU_CHECK_BUDGET_S:-1500}"
else
  PY="${PYTHON:-python3}"
  WORK="${GPU_CHECK_WORK:-/tmp/gpu_check}"
  BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"
fi
OUT="${OUT:-$REPO/gpu_results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
# Results of an earlier run must not pass for this one's.
rm -rf "$OUT/summary.md" "$OUT/measure_shipped.json" "$OUT/benchmark"
SITE="$WORK/site"
UPSTREAM_WHEEL="$REPO/.whl/upstream/torchtune-0.6.1-py3-none-any.whl"
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/summary.md"
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1

export PYTHONUNBUFFERED=1
# As in scripts/test.sh and tests/conftest.py: no AOT-autograd cache across processes.
export TORCHINDUCTOR_AUTOGRAD_CACHE=0
# Deterministic cuBLAS for the bitwise comparisons of test_memory_cuda.py, from the
# first CUDA call of every process on.
export CUBLAS_WORKSPACE_CONFIG=:4096:8
# Nothing to reach on the device machine; never try.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

PHASES=()
phase() {
  # phase NAME MIN_S MAX_S COMMAND...: runs COMMAND with a time limit of MAX_S or what
  # is left of the budget, whichever is less; skips it when less than MIN_S is left.
  local name="$1" min_s="$2" max_s="$3"
  shift 3
  local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt "$min_s" ]; then
    echo "== $name: skipped, ${left} s left of the ${BUDGET_S} s budget"
    PHASES+=("| $name | skipped (${left} s left) | 0 s |")
    return 1
  fi
  local limit=$((left < max_s ? left : max_s))
  echo "== $name (limit ${limit} s, $(date -u +%H:%M:%S))"
  local t0 rc status
  t0=$(date +%s)
  if declare -F "$1" >/dev/null; then
    "$@" # a function of this script: short and bounded, no time limit of its own
  else
    timeout --kill-after=10 "$limit" "$@"
  fi
  rc=$?
  case "$rc" in
    0) status="ok" ;;
    124 | 137) status="TIMED OUT after ${limit} s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  echo "== $name: $status"
  PHASES+=("| $name | $status | $(($(date +%s) - t0)) s |")
  return "$rc"
}

environment() {
  echo "dry run: $DRY_RUN; python: $PY; work: $WORK; out: $OUT"
  uname -srm
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  "$PY" - <<'EOF'
import platform
import torch
print(f"Python {platform.python_version()}; torch {torch.__version__} at {torch.__file__}")
print(f"CUDA available: {torch.cuda.is_available()}; CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
EOF
  echo "-- the image's versions of packages the patched torchtune uses:"
  "$PY" -m pip list --disable-pip-version-check --format=freeze 2>/dev/null |
    grep -iE '^(torch|numpy|pandas|pyarrow|xxhash|fsspec|huggingface.hub|safetensors|sentencepiece|tiktoken|tokenizers|pyyaml|requests|urllib3|filelock|tqdm|psutil|pillow|packaging|protobuf|pytest|matplotlib|torchao|bitsandbytes|omegaconf|datasets|torchdata)=='
  return 0
}

install_packages() {
  rm -rf "$SITE" "$WORK/dist"
  mkdir -p "$SITE" "$WORK/dist"
  if [ ! -f "$UPSTREAM_WHEEL" ]; then
    echo "missing $UPSTREAM_WHEEL: run 'bash scripts/fetch_gpu_wheels.sh' first, and carry .whl"
    return 1
  fi
  # This tree laid over the upstream wheel: the build backend's own build_wheel hook,
  # given the wheel, so nothing is downloaded (PEP 517 hooks run with the project
  # root as working directory).
  "$PY" - "$WORK/dist" "$UPSTREAM_WHEEL" <<'EOF' || return 1
import sys

sys.path.insert(0, "_build_backend")
import torchtune_overlay

print("built", torchtune_overlay.build_wheel(sys.argv[1], {"upstream-wheel": sys.argv[2]}))
EOF
  # The carried wheels this interpreter can install: all of them on the GPU machine
  # (Python 3.12); on a dry run with another Python, those made for 3.12 only are
  # left to the environment.
  local wheels=()
  mapfile -t wheels < <("$PY" - "$DRY_RUN" "$REPO"/.whl/*.whl <<'EOF'
import sys
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

dry_run, paths = sys.argv[1] == "1", sys.argv[2:]
supported = set(sys_tags())
for path in paths:
    if parse_wheel_filename(Path(path).name)[3] & supported:
        print(path)
    else:
        print(f"not for this interpreter: {Path(path).name}", file=sys.stderr)
        if not dry_run:
            sys.exit(1)
EOF
  ) || { echo "a carried wheel does not fit this interpreter"; return 1; }
  "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${wheels[@]}" "$WORK"/dist/*.whl || return 1
  echo "installed into $SITE: ${#wheels[@]} carried wheels and $(basename "$WORK"/dist/*.whl)"
}

check_install() {
  # Run with PYTHONPATH=$SITE.
  "$PY" - "$SITE" "$TORCH_BEFORE" <<'EOF'
import importlib
import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

site, torch_before = Path(sys.argv[1]), sys.argv[2]
problems = []

import torch

if torch.__version__ != torch_before or site in Path(torch.__file__).parents:
    problems.append(f"torch changed: {torch.__version__} at {torch.__file__}")
print(f"torch {torch.__version__} (the machine's own: {torch.__file__})")
# (module, distribution, whether the runs need it). `tune run` imports the CLI,
# which imports kagglehub and huggingface_hub; blobfile is only for remote files.
for module, dist, needed in [
    ("torchtune", "torchtune", True),
    ("torchao", "torchao", True),
    ("bitsandbytes", "bitsandbytes", True),
    ("omegaconf", "omegaconf", True),
    ("torchdata", "torchdata", True),
    ("datasets", "datasets", True),
    ("kagglehub", "kagglehub", True),
    ("blobfile", "blobfile", False),
]:
    try:
        path = Path(importlib.import_module(module).__file__)
    except Exception as e:  # report every one, not only the first
        message = f"import {module} failed: {type(e).__name__}: {e}"
        if needed:
            problems.append(message)
        else:
            print(f"WARNING: {message}")
        continue
    where = "carried" if site in path.parents else "the environment's"
    print(f"{module} {md.version(dist)}: {where} ({path})")
    if where != "carried":
        problems.append(f"{module} was not imported from {site}")
if md.version("torchtune") != "0.6.1+oib":
    problems.append(f"torchtune is {md.version('torchtune')}, not 0.6.1+oib")
try:
    import torchtune._cli.tune  # noqa: F401  (what `tune run` imports first)
    from torchtune.training import OptimizerInBackward  # noqa: F401
except Exception as e:
    problems.append(f"importing torchtune's CLI failed: {type(e).__name__}: {e}")

try:
    from bitsandbytes.cextension import lib

    print(f"bitsandbytes native library: {getattr(lib, '_name', lib)}")
except Exception as e:
    print(f"bitsandbytes native library: not loaded ({type(e).__name__}: {e})")

# Every requirement of the carried distributions, against the versions Python finds:
# a mismatch is reported, not fatal (the imports above are what the runs need).
for dist in md.distributions(path=[str(site)]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = dist.metadata["Name"]
        try:
            found = md.version(req.name)
        except md.PackageNotFoundError:
            print(f"WARNING: {name} needs {req}: not installed")
            continue
        if not req.specifier.contains(Version(found), prereleases=True):
            print(f"WARNING: {name} needs {req}, found {found}")
for problem in problems:
    print(f"PROBLEM: {problem}")
sys.exit(1 if problems else 0)
EOF
}

summary() {
  {
    echo "# GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - START)) s)"
    echo
    [ "$DRY_RUN" = 1 ] && echo "**Dry run** (no GPU): the CUDA tests skip; the measurement runs a tiny model on the CPU." && echo
    echo "| phase | status | time |"
    echo "|---|---|---:|"
    printf '%s\n' "${PHASES[@]}"
    echo
    echo "## Environment"
    echo
    echo '```'
    cat "$WORK/environment.txt" 2>/dev/null
    echo '```'
    for part in unit recipes; do
      if [ -f "$WORK/pytest_$part.txt" ]; then
        echo
        echo "## pytest: $part"
        echo
        echo '```'
        # The short summary (one line per test) and the final count.
        sed -n '/short test summary info/,$p' "$WORK/pytest_$part.txt"
        echo '```'
      fi
    done
    echo
    echo "## Measurement"
    echo
    cat "$WORK/measure_shipped.md" 2>/dev/null || echo "(not run)"
    echo
    echo "## benchmarks/optimizer_in_backward.py"
    echo
    cat "$OUT/benchmark/optimizer_in_backward.md" 2>/dev/null || echo "(not run)"
  } >"$SUMMARY"
}
trap summary EXIT

rm -rf "$WORK"
mkdir -p "$WORK"
environment | tee "$WORK/environment.txt"
TORCH_BEFORE="$("$PY" -c 'import torch; print(torch.__version__)')"

if ! phase "install" 20 120 install_packages; then
  echo "install failed: nothing else can run"
  exit 1
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
verify_install() {
  check_install 2>&1 | tee -a "$WORK/environment.txt"
}
if ! phase "install check" 10 60 verify_install; then
  echo "the installed packages are not what they should be: nothing else can run"
  exit 1
fi

FAILED=0
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rA)
# pytest's output also goes to a file of its own, for the summary.
TEE=(bash -c 'set -o pipefail; "${@:2}" 2>&1 | tee "$1"' tee_to)
phase "CUDA unit tests" 30 150 "${TEE[@]}" "$WORK/pytest_unit.txt" \
  "${PYTEST[@]}" tests/torchtune/training/test_memory_cuda.py || FAILED=1
phase "CUDA recipe tests" 60 240 "${TEE[@]}" "$WORK/pytest_recipes.txt" \
  "${PYTEST[@]}" tests/recipes/test_cuda_recipes.py || FAILED=1

if [ "$DRY_RUN" = 1 ]; then
  MEASURE=(--device cpu --model tiny --steps 2 --warmup 0 --seq-len 128 --timeout 300)
  BENCH=(--device cpu --sizes 10m --modes plain,in_bwd_bucketed --steps 1 --warmup 1
    --memory-steps 1 --threads 1)
else
  MEASURE=(--device cuda --model 1b --steps 20 --warmup 2 --seq-len 1024 --timeout 200)
  BENCH=(--device cuda --sizes 1b --optimizers adamw --dtype bfloat16
    --timing interleaved --steps 6 --warmup 2 --memory-steps 2)
fi
phase "shipped config measurement" 90 300 \
  "$PY" scripts/measure_shipped_in_bwd.py "${MEASURE[@]}" --work-dir "$WORK/measure" \
  --out-json "$OUT/measure_shipped.json" --out-md "$WORK/measure_shipped.md" ||
  FAILED=1
phase "benchmark" 60 200 \
  "$PY" benchmarks/optimizer_in_backward.py "${BENCH[@]}" --out-dir "$OUT/benchmark" \
  --note "Run by scripts/gpu_check.sh." || FAILED=1

echo "== done in $(($(date +%s) - START)) s; results in $OUT"
exit "$FAILED"
