"""No non-finite number reaches the weights or a checkpoint unannounced.

- A batch without any target token (with ``train_on_input: False``, prompts that fill
  ``max_seq_len``) adds zero to the step's loss and gradients, in both modes and on
  one and two processes: the run trains on, with the same numbers in both modes, and
  its weights stay finite. (Before: its loss was 0/0 = NaN and a step of such batches
  scaled its gradients by 1/0, so every weight became NaN and the run still reported
  success.)
- A step whose loss or gradient norm is not finite stops the run before the
  optimizer steps and before anything is saved, naming the step and the newest
  step checkpoint, which holds finite weights.

Tolerances: in-backward and plain runs of one recipe apply the same kernels to the
same values (the gradients are scaled with the same operations), so their losses and
weights must be bitwise equal: ``rtol=0, atol=0``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.assets.make_assets import TinyAssets
from tests.helpers import BITWISE
from tests.recipes.utils import (
    TuneRun,
    assert_series_close,
    assert_weights_close,
    load_weights,
    run_recipe,
    run_tune_in_process,
    step_state,
    tiny_config,
)

pytestmark = pytest.mark.integration_test

SHARD = "model-00001-of-00001.safetensors"
STEPS = 3
# Rows 0 to 7 have prompts longer than the tokenizer's max_seq_len (128): their
# answers are cut off, so they have no target token. With shuffle off they make step
# 1's batch (8 rows on one process; 4 a rank on two, which take every other row).
EMPTY_ROWS = 8


def data_with_empty_batch(assets: TinyAssets, path: Path) -> Path:
    rows = json.loads(assets.train_data.read_text())
    long_prompt = "Please read this carefully. " * 60
    empty = [{"input": long_prompt, "output": "7"} for _ in range(EMPTY_ROWS)]
    path.write_text(json.dumps(empty + rows))
    return path


def settings(assets: TinyAssets, data: Path, in_bwd: bool, **more: Any) -> dict:
    return {
        "assets_dir": assets.root,
        "dataset.data_files": str(data),
        "shuffle": False,
        "epochs": 1,
        "max_steps_per_epoch": STEPS,
        "optimizer_in_bwd": in_bwd,
        **more,
    }


def assert_trained_through_the_empty_batch(runs: dict[str, TuneRun]) -> None:
    for mode, run in runs.items():
        assert list(run.metrics) == list(range(1, STEPS + 1)), mode
        # Step 1 trained on no token: a loss of zero, nothing per second.
        assert run.metrics[1]["tokens_per_second_per_gpu"] == 0, mode
        assert run.metrics[1]["loss"] == 0.0, mode
        assert all(torch.isfinite(torch.tensor(run.losses))), (mode, run.losses)
        weights = load_weights(run.output_dir / "epoch_0" / SHARD)
        assert all(torch.isfinite(w).all() for w in weights.values()), mode
    assert_series_close(
        runs["bwd"], runs["plain"], "loss", range(2, STEPS + 1), **BITWISE
    )
    assert_weights_close(
        load_weights(runs["bwd"].output_dir / "epoch_0" / SHARD),
        load_weights(runs["plain"].output_dir / "epoch_0" / SHARD),
        **BITWISE,
    )


@pytest.mark.parametrize(
    ("recipe", "config", "more"),
    [
        ("full_finetune_single_device", "tiny_full_single_device", {}),
        # Two processes.
        ("full_finetune_distributed", "tiny_full_distributed", {"clip_grad_norm": 1.0}),
    ],
)
def test_a_batch_without_targets_trains_on_with_finite_weights(
    tiny_assets: TinyAssets, tmp_path: Path, recipe: str, config: str, more: dict
) -> None:
    data = data_with_empty_batch(tiny_assets, tmp_path / "data.json")
    runs = {
        mode: run_recipe(
            recipe,
            tiny_config(config),
            settings(tiny_assets, data, mode == "bwd", **more),
            tmp_path / mode,
        )
        for mode in ("plain", "bwd")
    }
    assert_trained_through_the_empty_batch(runs)


@pytest.mark.parametrize("mode", ["plain", "bwd"])
def test_a_non_finite_step_stops_the_run_before_it_is_applied_or_saved(
    tiny_assets: TinyAssets, tmp_path: Path, mode: str
) -> None:
    # A learning rate of 1e30: AdamW's first step moves every weight by about 1e30,
    # and step 2's forward overflows.
    overrides = settings(
        tiny_assets,
        tiny_assets.train_data,
        mode == "bwd",
        save_every_n_steps=1,
        **{"optimizer.lr": 1e30},
    )
    with pytest.raises(FloatingPointError) as stopped:
        run_tune_in_process(
            "full_finetune_single_device",
            tiny_config("tiny_full_single_device"),
            overrides,
            tmp_path,
        )
    message = str(stopped.value)
    step = int(message.split()[1])
    assert step > 1 and message.startswith(
        f"Step {step} (epoch 0, up to batch {step - 1} of the epoch) has a non-finite "
    )
    newest = tmp_path / f"step_{step - 1}"
    # Its weights may be diverging already and its optimizer state brings the
    # learning rate back: no checkpoint is offered as good, a new run is.
    assert f"{newest.name})" in message and "resume_from_checkpoint=False" in message
    assert "resume_from_checkpoint=True" not in message
    # Nothing of the non-finite step was saved, and what was saved is finite.
    assert max(int(p.name[5:]) for p in tmp_path.glob("step_*")) == step - 1
    saved = step_state(newest)
    assert all(torch.isfinite(w).all() for w in saved["model"].values())
