"""Smoke tests of the recipe-test harness (``tests/recipes/utils.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.assets.make_assets import TinyAssets
from tests.recipes.utils import (
    BITWISE_TRAINING,
    TuneRun,
    TuneRunError,
    assert_same_training,
    format_override,
    load_weights,
    read_disk_log,
    run_tune,
    run_tune_forked,
    run_tune_in_process,
    tiny_config,
    tiny_overrides,
)
from torchtune import config as tt_config


def test_read_disk_log_merges_lines_by_step_and_reads_tensor_values(
    tmp_path: Path,
) -> None:
    log = tmp_path / "log.txt"
    log.write_text(
        "Step 1 | loss:6.25 lr:0.001 tokens_per_second_per_gpu:46.5 \n"
        "Step 1 | grad_norm:tensor(0.5)\n"
        "some other line\n"
        "Step 2 | loss:nan lr:1e-05 \n"
    )
    metrics = read_disk_log(log)
    assert list(metrics) == [1, 2]
    assert metrics[1] == {
        "loss": 6.25,
        "lr": 0.001,
        "tokens_per_second_per_gpu": 46.5,
        "grad_norm": 0.5,
    }
    assert math.isnan(metrics[2]["loss"]) and metrics[2]["lr"] == 1e-5


def test_format_override_writes_what_tune_run_parses() -> None:
    assert format_override("seed", None) == "seed=null"
    assert format_override("optimizer_in_bwd", True) == "optimizer_in_bwd=True"
    assert format_override("files", ["a.safetensors", "b"]) == "files=[a.safetensors,b]"
    with pytest.raises(ValueError, match="contains '='"):
        format_override("x", "a=b")


def test_run_tune_refuses_overrides_of_the_keys_it_sets(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="output_dir"):
        run_tune(
            "full_finetune_single_device",
            tiny_config("tiny_full_single_device"),
            {"metric_logger.log_dir": tmp_path},
            output_dir=tmp_path,
        )


@pytest.mark.parametrize(
    "name",
    ["tiny_full_single_device", "tiny_full_distributed", "tiny_lora_single_device"],
)
def test_tiny_config_is_well_formed_and_matches_the_tiny_assets(
    name: str, tiny_assets: TinyAssets
) -> None:
    cfg = OmegaConf.load(tiny_config(name))
    cfg.assets_dir = str(tiny_assets.root)
    tt_config.validate(cfg)
    overrides = tiny_overrides(tiny_assets, lora="lora" in name)
    assert cfg.model._component_ == overrides["model._component_"]
    for key, value in tiny_assets.model_kwargs.items():
        if key != "rope_base":
            assert cfg.model[key] == value == overrides[f"model.{key}"]
    assert Path(cfg.tokenizer.path) == tiny_assets.tokenizer_path
    assert Path(cfg.dataset.data_files) == tiny_assets.train_data
    assert Path(cfg.checkpointer.checkpoint_dir) == tiny_assets.checkpoint_dir
    assert list(cfg.checkpointer.checkpoint_files) == list(tiny_assets.checkpoint_files)


SINGLE = ("full_finetune_single_device", tiny_config("tiny_full_single_device"))
DISTRIBUTED = ("full_finetune_distributed", tiny_config("tiny_full_distributed"))


@pytest.mark.integration_test
@pytest.mark.parametrize(
    "nproc", [1, 2], ids=["in this process as in a subprocess", "forked as torchrun"]
)
def test_the_fast_runners_train_as_tune_run_bitwise(
    tiny_assets: TinyAssets, tmp_path: Path, nproc: int
) -> None:
    """The recipe tests run most single-device runs with ``run_tune_in_process`` and
    most multi-process runs with ``run_tune_forked``: the same run through ``tune
    run`` in a process of its own (``--nproc_per_node 2``: torchrun) trains the
    same, bitwise. A rank that trained alone (a 1-rank group of batch 4 instead of
    2 x 4) would log other losses."""
    overrides = {
        "assets_dir": tiny_assets.root,
        "epochs": 1,
        "max_steps_per_epoch": 3,
        "optimizer_in_bwd": False,
    }
    if nproc == 1:
        reference = run_tune(*SINGLE, overrides, output_dir=tmp_path / "tune_run")
        run = run_tune_in_process(*SINGLE, overrides, tmp_path / "fast")
    else:
        reference = run_tune(
            *DISTRIBUTED, overrides, nproc=2, output_dir=tmp_path / "tune_run"
        )
        run = run_tune_forked(*DISTRIBUTED, overrides, output_dir=tmp_path / "fast")
    assert all(math.isfinite(loss) for loss in reference.losses)
    # Near the uniform loss of the untrained model, ln(vocab_size).
    assert abs(reference.losses[0] - math.log(tiny_assets.vocab_size)) < 0.2
    shard = "epoch_0/model-00001-of-00001.safetensors"
    assert (reference.output_dir / "epoch_0" / "model.safetensors.index.json").is_file()
    assert_same_training(
        run,
        reference,
        BITWISE_TRAINING,
        [1, 2, 3],
        final_weights=lambda r: load_weights(r.output_dir / shard),
    )


@pytest.mark.integration_test
@pytest.mark.parametrize(
    ("run", "status"),
    [
        (lambda *args, **kw: run_tune(*SINGLE, *args, **kw), "1"),
        (lambda *args, **kw: run_tune_forked(*DISTRIBUTED, *args, **kw), r"\[1, 1\]"),
    ],
    ids=["run_tune", "run_tune_forked"],
)
def test_a_runner_raises_with_the_output_when_the_recipe_fails(
    tiny_assets: TinyAssets, tmp_path: Path, run: Callable[..., TuneRun], status: str
) -> None:
    with pytest.raises(TuneRunError, match=f"exited with status(es)? {status}") as e:
        run({"assets_dir": tiny_assets.root, "dtype": "fp16"}, output_dir=tmp_path)
    assert "fp16" in str(e.value)
