#!/usr/bin/env bash
# The main job: fine-tune a tiny Llama with optimizer_in_bwd: True through the ordinary
# `tune run` CLI, and watch it learn.
#
#   bash scripts/demo.sh                  # full_finetune_single_device, one process
#   bash scripts/demo.sh --distributed    # full_finetune_distributed, 2 CPU processes
#   bash scripts/demo.sh key=value ...    # config overrides, e.g. optimizer_in_bwd=False
#
# It installs what it needs (scripts/setup_env.sh), makes the demo's dataset, tokenizer
# and initial checkpoint (demo/make_demo_assets.py), trains with demo/single_device.yaml
# or demo/distributed.yaml, then prints the fine-tuned model's answers to held-out
# prompts next to the expected ones and the untrained model's (demo/ask.py).
# Everything it writes goes under outputs/demo/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."

distributed=0
overrides=()
for arg in "$@"; do
  case "$arg" in
    --distributed) distributed=1 ;;
    -h | --help)
      sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *) overrides+=("$arg") ;;
  esac
done

bash scripts/setup_env.sh
BIN=.venv/bin
# A model this small runs fastest on one thread per process: with more, the threads
# mostly wait for each other (torchrun sets the same for each of its processes).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Everything is made locally; never reach for the Hugging Face hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

start=$SECONDS
"$BIN/python" -m demo.make_demo_assets
if [ "$distributed" = 1 ]; then
  config=demo/distributed.yaml
  "$BIN/tune" run --nproc_per_node 2 full_finetune_distributed \
    --config "$config" device=cpu "${overrides[@]}"
else
  config=demo/single_device.yaml
  "$BIN/tune" run full_finetune_single_device --config "$config" "${overrides[@]}"
fi
"$BIN/python" -m demo.ask --config "$config" "${overrides[@]}"
echo "Demo done in $((SECONDS - start)) s (after the install)."
