"""Smoke tests of the recipe-test harness (``tests/recipes/utils.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.assets.make_assets import TinyAssets
from tests.helpers import BITWISE
from tests.recipes.utils import (
    TuneRunError,
    assert_series_close,
    assert_steps,
    assert_weights_close,
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


@pytest.mark.integration_test
def test_a_run_in_process_trains_as_tune_run_in_a_process_of_its_own_bitwise(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    """Most single-device recipe runs are ``run_tune_in_process``: the same command
    line through ``tune run`` in a subprocess trains the same, bitwise."""
    recipe, config = (
        "full_finetune_single_device",
        tiny_config("tiny_full_single_device"),
    )
    overrides = {
        "assets_dir": tiny_assets.root,
        "max_steps_per_epoch": 3,
        "optimizer_in_bwd": False,
    }
    run = run_tune(recipe, config, overrides, output_dir=tmp_path / "subprocess")
    steps = assert_steps(run, [1, 2, 3])
    assert all(math.isfinite(loss) for loss in run.losses)
    # Near the uniform loss of the untrained model, ln(vocab_size).
    assert abs(run.losses[0] - math.log(tiny_assets.vocab_size)) < 0.2
    assert (run.output_dir / "epoch_0" / "model.safetensors.index.json").is_file()
    here = run_tune_in_process(recipe, config, overrides, tmp_path / "in_process")
    assert_steps(here, steps)
    for name in ("loss", "grad_norm", "lr"):
        assert_series_close(here, run, name, steps, **BITWISE)
    shard = "epoch_0/model-00001-of-00001.safetensors"
    assert_weights_close(
        load_weights(here.output_dir / shard),
        load_weights(run.output_dir / shard),
        **BITWISE,
    )


@pytest.mark.integration_test
def test_run_tune_raises_with_the_output_tail_when_the_recipe_fails(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    with pytest.raises(TuneRunError, match="exited with status") as error:
        run_tune(
            "full_finetune_single_device",
            tiny_config("tiny_full_single_device"),
            {"assets_dir": tiny_assets.root, "dtype": "fp16"},
            output_dir=tmp_path,
            timeout=180,
        )
    assert "fp16" in str(error.value)


@pytest.mark.integration_test
def test_forked_ranks_train_as_torchrun_ranks_bitwise(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    """The recipe tests run most multi-process runs with ``run_tune_forked``: the same
    run through ``tune run --nproc_per_node 2`` (torchrun) trains the same, bitwise.
    A rank that trained alone (a 1-rank group of batch 4 instead of 2 x 4) would log
    other losses."""
    recipe, config = "full_finetune_distributed", tiny_config("tiny_full_distributed")
    overrides = {"assets_dir": tiny_assets.root, "epochs": 1, "max_steps_per_epoch": 2}
    torchrun = run_tune(
        recipe, config, overrides, nproc=2, output_dir=tmp_path / "torchrun"
    )
    forked = run_tune_forked(
        recipe, config, overrides, nproc=2, output_dir=tmp_path / "forked"
    )
    steps = assert_steps(torchrun, [1, 2])
    assert_steps(forked, steps)
    for name in ("loss", "grad_norm", "lr"):
        assert_series_close(forked, torchrun, name, steps, **BITWISE)
    shard = "epoch_0/model-00001-of-00001.safetensors"
    assert_weights_close(
        load_weights(forked.output_dir / shard),
        load_weights(torchrun.output_dir / shard),
        **BITWISE,
    )


@pytest.mark.integration_test
def test_run_tune_forked_raises_with_the_output_when_the_recipe_fails(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    with pytest.raises(TuneRunError, match=r"exited with statuses \[1, 1\]") as error:
        run_tune_forked(
            "full_finetune_distributed",
            tiny_config("tiny_full_distributed"),
            {"assets_dir": tiny_assets.root, "dtype": "fp16"},
            output_dir=tmp_path,
            timeout=180,
        )
    assert "fp16" in str(error.value)
