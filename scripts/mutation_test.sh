#!/usr/bin/env bash
# Mutation testing with cosmic-ray: OptimizerInBackward and its helpers
# (torchtune/training/memory.py), the deprecated 0.6.1 in-backward API
# (optim_in_bwd_deprecated.py), the 0.6.1 checkpoint converter
# (optim_in_bwd_legacy_state_dict.py) and the four checkpointing modules
# (torchtune/training/checkpointing/: the manager, the step format, the run folder,
# the export), against the unit tests (tests/torchtune/..., no recipe runs, no
# multi-process runs). Slow; not part of CI.
# See "Mutation testing" in CONTRIBUTING.md; scores in benchmarks/results/mutation_testing.md.
#
#   bash scripts/mutation_test.sh [optimizer_in_backward] [deprecated] [legacy_state_dict]
#                                 [checkpoint_manager] [step_format] [run_folder]
#                                 [export]                     (default: all seven)
#
# cosmic-ray rewrites the mutated file in place, so this never runs in the checkout it
# is started from: it clones the committed HEAD into $MUT_DIR (default
# /tmp/torchtune-mutation; pulled if it exists), builds a venv there with
# scripts/setup_env.sh plus cosmic-ray, and runs there. A session is resumed where it
# stopped unless FRESH=1. Reports are written to $MUT_DIR/.mutation/*.report.txt.
#
# RERUN_SURVIVORS=1 runs the session's survivors again (after adding tests).
# SAMPLE=0.5 runs a fixed half of the mutants (default 1: all). The tests run with
# pytest -x, each target's own test file last, so the report also tells which
# mutants only that file kills.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
MUT_DIR="${MUT_DIR:-/tmp/torchtune-mutation}"
COSMIC_RAY_VERSION=8.7.0
MEMORY=torchtune/training/memory.py
DEPRECATED=torchtune/training/optim_in_bwd_deprecated.py
LEGACY=torchtune/training/optim_in_bwd_legacy_state_dict.py
CHECKPOINTING=torchtune/training/checkpointing
MANAGER=$CHECKPOINTING/_checkpoint_manager.py
STEP_FORMAT=$CHECKPOINTING/_step_format.py
RUN_FOLDER=$CHECKPOINTING/_run_folder.py
EXPORT=$CHECKPOINTING/_export.py
MUTATED=("$MEMORY" "$DEPRECATED" "$LEGACY" "$MANAGER" "$STEP_FORMAT" "$RUN_FOLDER" "$EXPORT")

if [ "$REPO" != "$(realpath -m "$MUT_DIR")" ]; then
  if [ -d "$MUT_DIR/.git" ]; then
    # A run that was killed mid-mutant leaves that mutant on disk.
    git -C "$MUT_DIR" checkout -q -- "${MUTATED[@]}"
    git -C "$MUT_DIR" pull -q --ff-only
  else
    git clone -q "$REPO" "$MUT_DIR"
  fi
  exec bash "$MUT_DIR/scripts/mutation_test.sh" "$@"
fi

cd "$REPO"
if ! git diff --quiet -- "${MUTATED[@]}"; then
  echo "${MUTATED[*]}: one differs from HEAD (an interrupted run's mutant?):" >&2
  echo "  git -C $REPO checkout -- ${MUTATED[*]}" >&2
  exit 1
fi
bash scripts/setup_env.sh
PY=.venv/bin/python
if ! "$PY" -c "import cosmic_ray" 2>/dev/null; then
  # cosmic-ray does not depend on torch, so this leaves the CPU torch build alone.
  "$PY" -m pip install --disable-pip-version-check --quiet "cosmic-ray==$COSMIC_RAY_VERSION"
fi
"$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')"

export OMP_NUM_THREADS=1 TORCHINDUCTOR_AUTOGRAD_CACHE=0 PYTHONDONTWRITEBYTECODE=1
WORK="$REPO/.mutation"
mkdir -p "$WORK"
SOCK="$WORK/pytest.sock"
# Seconds one mutant's test run may take (a clean run takes ~30 s here); longer counts
# as killed, reported as a timeout.
TEST_TIMEOUT=240

TT=tests/torchtune/training
MEMORY_TESTS=(
  "$TT/test_optim_in_bwd_deprecated.py"
  "$TT/test_lr_scheduler_resume.py"
  "$TT/test_optimizer_in_backward.py"
)
MEMORY_CONTRACT="$TT/test_optimizer_in_backward.py"
MEMORY_TARGETS=(
  DEFAULT_BUCKET_CAP_MB is_valid_bucket_cap _bucket_cap_bytes hyperparameters
  _wrapped_attribute _BucketState _Bucket _local_bytes OptimizerInBackward
)
# The 0.6.1 compatibility modules. Each one's own test file runs last, and the report
# counts what only it kills.
DEPRECATED_TESTS=(
  "$TT/test_optim_in_bwd_legacy_state_dict.py"
  "$TT/test_lr_scheduler_resume.py"
  "$TT/test_optim_in_bwd_deprecated.py"
)
DEPRECATED_TARGETS=(
  _DEPRECATION _STEPPED_BY _warn _in_backward _optim_map
  OptimizerInBackwardWrapper create_optim_in_bwd_wrapper register_optim_in_bwd_hooks
)
LEGACY_TESTS=(
  "$TT/test_optim_in_bwd_deprecated.py"
  "$TT/test_optim_in_bwd_legacy_state_dict.py"
)
LEGACY_TARGETS=(
  is_legacy_in_bwd_state_dict _unwrapped _entries convert_legacy_optim_in_bwd_state_dict
)
# The checkpointing modules, each against the checkpoint manager's unit tests.
CHECKPOINT_TESTS="$TT/checkpointing/test_checkpoint_manager.py"
MANAGER_TARGETS=(
  TrainingProgress _differs _dataset_identity CheckpointOptions CheckpointManager
)
STEP_FORMAT_TARGETS=(
  on_rank_zero load_weights_only read_json file_checksum write_manifest verify step_of step_checkpoints_in
)
RUN_FOLDER_TARGETS=(
  check_writable check_lock take_lock earlier_runs_state publish_step
)
EXPORT_TARGETS=(export_state save_export not_this_runs_export)
# Multi-process (gloo) scenarios take minutes each; the import-order check runs
# fresh interpreters and cannot see a mutant that the other tests miss.
DESELECT="not two_gloo and not without_a_cycle"

existing() {
  for f in "$@"; do if [ -f "$f" ]; then printf '%s ' "$f"; fi; done
}

# Imports torch, torchao, bitsandbytes, ... once; each mutant's pytest run is a fork
# of it that imports torchtune (with the mutant) from disk.
# shellcheck disable=SC2046
"$PY" scripts/mutation_test.py serve "$SOCK" \
  $(existing "${MEMORY_TESTS[@]}" "${DEPRECATED_TESTS[@]}" "$CHECKPOINT_TESTS") \
  >"$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
until grep -q ready "$WORK/server.log" 2>/dev/null; do
  kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
  sleep 1
done

run_session() {
  local name=$1 module=$2 tests=$3 targets=$4 contract=$5
  local cfg="$WORK/$name.toml" session="$WORK/$name.sqlite"
  local pytest_args="-x -q -p no:randomly -p no:cacheprovider $tests -k \"$DESELECT\""
  cat >"$cfg" <<EOF
[cosmic-ray]
module-path = "$module"
timeout = $((TEST_TIMEOUT + 60))
excluded-modules = []
test-command = '$PY scripts/mutation_test.py pytest $SOCK $TEST_TIMEOUT -- $pytest_args'

[cosmic-ray.distributor]
name = "local"
EOF
  echo "== $name: $module against $tests"
  if [ ! -f "$session" ] || [ "${FRESH:-0}" = 1 ]; then
    .venv/bin/cosmic-ray init "$cfg" "$session" --force
    # shellcheck disable=SC2086
    "$PY" scripts/mutation_test.py filter "$session" "$module" $targets \
      --sample "${SAMPLE:-1}"
  fi
  if [ "${RERUN_SURVIVORS:-0}" = 1 ]; then
    "$PY" scripts/mutation_test.py rerun-survivors "$session"
  fi
  # The tests must pass on the unmutated code, or every mutant counts as killed.
  eval "$PY scripts/mutation_test.py pytest $SOCK $TEST_TIMEOUT -- $pytest_args" | tail -n 1
  local start=$SECONDS
  .venv/bin/cosmic-ray exec "$cfg" "$session"
  echo "$name: $((SECONDS - start)) s"
  "$PY" scripts/mutation_test.py report "$session" "$contract" |
    tee "$WORK/$name.report.txt" | grep -v '^[-+@]\|^SURVIVED\|^EQUIVALENT\|^ELSEWHERE'
}

ALL="optimizer_in_backward deprecated legacy_state_dict checkpoint_manager step_format"
ALL="$ALL run_folder export"
for what in "${@:-$ALL}"; do
  for name in $what; do
    case "$name" in
      optimizer_in_backward)
        run_session optimizer_in_backward "$MEMORY" "$(existing "${MEMORY_TESTS[@]}")" \
          "${MEMORY_TARGETS[*]}" "$MEMORY_CONTRACT"
        ;;
      deprecated)
        run_session deprecated "$DEPRECATED" "$(existing "${DEPRECATED_TESTS[@]}")" \
          "${DEPRECATED_TARGETS[*]}" "$TT/test_optim_in_bwd_deprecated.py"
        ;;
      legacy_state_dict)
        run_session legacy_state_dict "$LEGACY" "$(existing "${LEGACY_TESTS[@]}")" \
          "${LEGACY_TARGETS[*]}" "$TT/test_optim_in_bwd_legacy_state_dict.py"
        ;;
      checkpoint_manager)
        run_session checkpoint_manager "$MANAGER" "$CHECKPOINT_TESTS" \
          "${MANAGER_TARGETS[*]}" "$CHECKPOINT_TESTS"
        ;;
      step_format)
        run_session step_format "$STEP_FORMAT" "$CHECKPOINT_TESTS" \
          "${STEP_FORMAT_TARGETS[*]}" "$CHECKPOINT_TESTS"
        ;;
      run_folder)
        run_session run_folder "$RUN_FOLDER" "$CHECKPOINT_TESTS" \
          "${RUN_FOLDER_TARGETS[*]}" "$CHECKPOINT_TESTS"
        ;;
      export)
        run_session export "$EXPORT" "$CHECKPOINT_TESTS" \
          "${EXPORT_TARGETS[*]}" "$CHECKPOINT_TESTS"
        ;;
      *)
        echo "unknown target $name (one of: $ALL)" >&2
        exit 2
        ;;
    esac
  done
done
