"""``dev/early_exit_finetune_distributed`` on CPU with 2 gloo processes.

The tiny config turns on the early-exit loss (both layers of the 2-layer model) and
layer dropout (the last layer, probability 0.5), so every claim below covers them:

- in-backward vs plain on the same seed and data, at every step;
- in-backward resumed from the epoch-0 step checkpoint (``step_2``, written at
  epoch 0's end) vs uninterrupted;
- a refused config raises before anything and leaves output_dir untouched.

Layer dropout draws from generators seeded by (seed, step, layer): both modes, and a
resumed run, draw the same samples to skip, so the runs compare step by step.

The runs are ``tune run`` on 2 processes forked from a preloaded server
(``run_tune_forked``: real processes, with what torchrun gives each rank, without an
interpreter start and imports per run).

Tolerances, from the arithmetic (observed on x86 CPU in brackets):

- ``BITWISE_TRAINING``: a resumed run reloads exact fp32 weights and optimizer state, recomputes
  the lr from the step count and draws the same layer dropout: the same kernels on
  the same values, so it agrees bitwise [0].
- In-backward against plain: both multiply the same gradients by the same
  ``world_size / tokens`` and clip them by the same norm with the same operations
  (inside backward, or after it), so they agree bitwise too [0]. Every run clips at
  ``CLIP``, which the grad norm crosses (the parity test checks that some steps
  clip and some do not).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from tests.assets.make_assets import TinyAssets
from tests.recipes.utils import (
    BITWISE_TRAINING,
    TuneRun,
    assert_same_training,
    load_recipe_class,
    run_tune_forked,
    series,
    tiny_config,
)

pytestmark = pytest.mark.integration_test

RECIPE = "dev/early_exit_finetune_distributed"
CONFIG = tiny_config("tiny_early_exit_distributed")
EPOCHS, STEPS = 2, 2
ALL_STEPS = range(1, EPOCHS * STEPS + 1)
TIMEOUT_S = 240  # a collective reached by only some ranks hangs: fail instead

SHARD = "model-00001-of-00001.safetensors"
# The grad norm every run clips at: the tiny model's norms cross it.
CLIP = 4.0


def _train(out: Path, assets: TinyAssets, **overrides: Any) -> TuneRun:
    base = {
        "assets_dir": assets.root,
        "epochs": EPOCHS,
        "max_steps_per_epoch": STEPS,
        "clip_grad_norm": CLIP,
    }
    return run_tune_forked(
        RECIPE, CONFIG, base | overrides, nproc=2, output_dir=out, timeout=TIMEOUT_S
    )


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("early_exit_finetune_distributed")


@pytest.fixture(scope="module")
def in_bwd(runs_dir: Path, tiny_assets: TinyAssets) -> TuneRun:
    # Without save_every_n_steps only the newest epoch-end step checkpoint is kept:
    # keep epoch 0's too, to resume from.
    return _train(
        runs_dir / "in_bwd",
        tiny_assets,
        optimizer_in_bwd=True,
        **{"checkpointer.keep_last_n_checkpoints": EPOCHS},
    )


@pytest.fixture(scope="module")
def plain(runs_dir: Path, tiny_assets: TinyAssets) -> TuneRun:
    return _train(runs_dir / "plain", tiny_assets, optimizer_in_bwd=False)


def test_in_backward_matches_plain_with_early_exit_and_layer_dropout(
    in_bwd: TuneRun, plain: TuneRun
) -> None:
    assert in_bwd.losses[-1] < in_bwd.losses[0]  # it learns
    norms = series(plain, "grad_norm", ALL_STEPS)
    assert (norms > CLIP).any() and (norms < CLIP).any(), norms
    assert_same_training(in_bwd, plain, BITWISE_TRAINING, ALL_STEPS)


def test_in_backward_on_one_process(runs_dir: Path, tiny_assets: TinyAssets) -> None:
    # One process leaves the model unsharded (not an FSDPModule): nothing to
    # gather between clipping's two passes.
    run = run_tune_forked(
        RECIPE,
        CONFIG,
        {"assets_dir": tiny_assets.root, "max_steps_per_epoch": STEPS, "epochs": 1}
        | {"clip_grad_norm": CLIP, "optimizer_in_bwd": True},
        nproc=1,
        output_dir=runs_dir / "one_process",
        timeout=TIMEOUT_S,
    )
    assert len(run.losses) == STEPS


def test_in_backward_resume_from_epoch_0_equals_uninterrupted_run(
    in_bwd: TuneRun, runs_dir: Path, tiny_assets: TinyAssets
) -> None:
    # Its optimizer state holds every parameter, the last layer's included: the
    # early-exit loss reads that layer's output, so it trains. Each epoch's end
    # wrote a step checkpoint; the copy leaves out the last epoch's.
    step_dirs = {p.name for p in in_bwd.output_dir.glob("step_*")}
    assert step_dirs == {f"step_{STEPS}", f"step_{EPOCHS * STEPS}"}
    out = runs_dir / "in_bwd_resumed"
    shutil.copytree(
        in_bwd.output_dir,
        out,
        ignore=shutil.ignore_patterns(".hf_datasets_cache", f"step_{EPOCHS * STEPS}"),
    )
    # As torchtune 0.6.1's docs say to: the checkpoint files pointed at epoch_0/.
    docs = {
        "checkpointer.checkpoint_files": ["epoch_0/model-00001-of-00001.safetensors"]
    }
    resumed = _train(
        out, tiny_assets, optimizer_in_bwd=True, resume_from_checkpoint=True, **docs
    )
    assert f"Resumed from step checkpoint {out / f'step_{STEPS}'}." in resumed.output
    assert_same_training(
        resumed,
        in_bwd,
        BITWISE_TRAINING,
        range(STEPS + 1, EPOCHS * STEPS + 1),
        reference_steps=ALL_STEPS,
    )


def test_early_exit_with_a_chunked_loss_is_refused_leaving_output_dir_untouched(
    tmp_path: Path, tiny_assets: TinyAssets
) -> None:
    checkpoint = tmp_path / "epoch_0" / SHARD
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"an earlier run's weights")
    before = checkpoint.stat()
    cfg = OmegaConf.load(CONFIG)
    cfg.assets_dir = str(tiny_assets.root)
    cfg.output_dir = str(tmp_path)
    cfg.loss = {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"}

    with pytest.raises(ValueError, match="early_exit_loss needs a loss with reduction"):
        load_recipe_class(RECIPE, "EarlyExitFinetuneRecipeDistributed")(cfg)
    assert not torch.distributed.is_initialized()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0"]
    after = checkpoint.stat()
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
