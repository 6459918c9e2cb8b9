#!/usr/bin/env bash
# The main job: installs what it needs, makes the tiny assets, then fine-tunes a tiny
# Llama with optimizer_in_bwd: True through the ordinary `tune run` CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
BIN=.venv/bin
OUT="${OUT:-outputs/demo}"

"$BIN/python" tests/assets/make_assets.py
"$BIN/tune" run full_finetune_single_device \
  --config tests/recipes/configs/tiny_full_single_device.yaml \
  optimizer_in_bwd=True output_dir="$OUT" "$@"
