"""The ``optimizer_in_bwd_bucket_cap_mb`` config key, end to end in a recipe.

Every other recipe test runs with the default cap, under which the tiny model's
parameters share a few buckets. Here the same run with one parameter per bucket
(``0``) and with a cap between the two must give the same losses, grad norms and
weights bitwise: an optimizer step over a subset of parameters does the same
per-element arithmetic, and ``grad_norm`` combines the per-parameter norms in
parameter order whatever the buckets.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.assets.make_assets import TinyAssets
from tests.helpers import BITWISE
from tests.recipes.utils import TuneRun, run_tune_in_process, tiny_config

pytestmark = pytest.mark.integration_test

RECIPE = "full_finetune_single_device"
CONFIG = tiny_config("tiny_full_single_device")
STEPS = [1, 2, 3]
# Caps in MiB: one parameter per bucket; 0.07 MiB, a few of the tiny model's 16 KiB
# attention and 32 KiB MLP weights per bucket; the default, one bucket for all.
CAPS = {"per_parameter": 0, "small": 0.07, "default": None}


@pytest.fixture(scope="module")
def runs(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, TuneRun]:
    out = {}
    for name, cap in CAPS.items():
        overrides = {
            "assets_dir": tiny_assets.root,
            "epochs": 1,
            "max_steps_per_epoch": len(STEPS),
            "optimizer_in_bwd": True,
            "clip_grad_norm": None,
        }
        if cap is not None:
            overrides["optimizer_in_bwd_bucket_cap_mb"] = cap
        out[name] = run_tune_in_process(
            RECIPE, CONFIG, overrides, tmp_path_factory.mktemp(f"buckets_{name}")
        )
    return out


def _series(run: TuneRun, key: str) -> list[float]:
    assert sorted(run.metrics) == STEPS, f"logged steps {sorted(run.metrics)}"
    return [run.metrics[step][key] for step in STEPS]


def _final_weights(run: TuneRun) -> dict:
    from safetensors.torch import load_file

    (shard,) = sorted((run.output_dir / "epoch_0").glob("*.safetensors"))
    return load_file(shard)


@pytest.mark.parametrize("cap", ["per_parameter", "small"])
def test_any_bucket_cap_trains_bitwise_like_the_default(
    runs: dict[str, TuneRun], cap: str
) -> None:
    import torch

    torch.testing.assert_close(
        _series(runs[cap], "loss"), _series(runs["default"], "loss"), **BITWISE
    )
    torch.testing.assert_close(
        _series(runs[cap], "grad_norm"),
        _series(runs["default"], "grad_norm"),
        **BITWISE,
    )
    weights, default = _final_weights(runs[cap]), _final_weights(runs["default"])
    assert weights.keys() == default.keys() and len(weights) > 0
    torch.testing.assert_close(weights, default, **BITWISE)


@pytest.mark.parametrize("bad", ["-1", "true", "lots"])
def test_a_bad_bucket_cap_is_refused_before_anything_is_written(
    tiny_assets: TinyAssets, tmp_path: Path, bad: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="optimizer_in_bwd_bucket_cap_mb=") as info:
        run_tune_in_process(
            RECIPE,
            CONFIG,
            [
                f"assets_dir={tiny_assets.root}",
                "optimizer_in_bwd=True",
                "clip_grad_norm=null",
                f"optimizer_in_bwd_bucket_cap_mb={bad}",
            ],
            out,
        )
    assert "(0: each parameter on its own)" in str(info.value)
    assert not out.exists()
