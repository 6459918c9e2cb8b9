"""``full_finetune_single_device``: its checkpoint format, and a resume of torchtune
0.6.1's in-backward checkpoint. What it shares with ``lora_finetune_single_device``
(in-backward equals plain, resumes from epoch 0, bf16) is in
``test_single_device_recipes.py``, with the runs of ``single_device.py`` used here.

Tolerances: a resume of 0.6.1's in-backward format, in either mode, against the
plain run: bitwise (``rtol=0, atol=0``), as any resume that switches mode
(``test_single_device_recipes.py``): the checkpoint client converts the format, and
the same kernels then see the same values.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.assets.make_assets import TinyAssets
from tests.recipes.single_device import (
    ALL_STEPS,
    EPOCH_1,
    FULL,
    SHARD,
    STEPS_PER_EPOCH,
    Recipe,
    Runs,
)
from tests.recipes.utils import (
    BITWISE_TRAINING,
    TuneRun,
    as_indexed,
    assert_same_training,
    full_optimizer_state,
)

pytestmark = pytest.mark.integration_test


@pytest.fixture(scope="module")
def runs(single_device_runs: Callable[[Recipe], Runs]) -> Runs:
    return single_device_runs(FULL)


@pytest.fixture(scope="module")
def adamw_runs(runs: Runs) -> dict[str, TuneRun]:
    return runs.adamw


def _write_0_6_1_in_backward_checkpoint(
    run: TuneRun, out: Path, assets: TinyAssets
) -> None:
    """``run``'s epoch 0 as torchtune 0.6.1 left it after an in-backward run: its
    weights (no manifest) and its recipe state, the optimizer state in 0.6.1's
    in-backward format (the checkpoint client converts it for either optimizer)."""
    from torchtune import training
    from torchtune.models.llama2 import llama2

    shutil.copytree(run.output_dir / "epoch_0", out / "epoch_0")
    epoch_end = run.output_dir / f"step_{STEPS_PER_EPOCH}"
    state = {
        training.OPT_KEY: as_indexed(full_optimizer_state(epoch_end)),
        training.SEED_KEY: 0,
        training.EPOCHS_KEY: 1,
        training.TOTAL_EPOCHS_KEY: 2,
        training.MAX_STEPS_KEY: STEPS_PER_EPOCH,
    }
    # 0.6.1: {parameter name: that parameter's own optimizer's state_dict()}.
    names = [name for name, _ in llama2(**assets.model_kwargs).named_parameters()]
    optimizer, (group,) = (
        state[training.OPT_KEY],
        state[training.OPT_KEY]["param_groups"],
    )
    state[training.OPT_KEY] = {
        name: {
            "state": {0: optimizer["state"][index]},
            "param_groups": [group | {"params": [0]}],
        }
        for index, name in zip(group["params"], names, strict=True)
    }
    (out / "recipe_state").mkdir()
    torch.save(state, out / "recipe_state" / "recipe_state.pt")


@pytest.mark.parametrize("target", ["bwd", "plain"])
def test_either_mode_resumes_a_0_6_1_in_backward_checkpoint(
    runs: Runs, tiny_assets: TinyAssets, tmp_path: Path, target: str
) -> None:
    plain = runs.adamw["plain"]
    _write_0_6_1_in_backward_checkpoint(plain, tmp_path, tiny_assets)
    resumed = FULL.run(
        FULL.config,
        runs.resume_settings(target)
        | {
            "checkpointer.checkpoint_files": [f"epoch_0/{SHARD}"],
            "checkpointer.recipe_checkpoint": "recipe_state/recipe_state.pt",
        },
        tmp_path,
    )
    assert_same_training(
        resumed,
        plain,
        BITWISE_TRAINING,
        EPOCH_1,
        reference_steps=ALL_STEPS,
        final_weights=FULL.trained,
    )


def test_final_checkpoint_is_in_hf_format_and_loads_back(
    tiny_assets: TinyAssets, adamw_runs: dict[str, TuneRun], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from torchtune import training
    from torchtune.models.llama2 import llama2

    final = adamw_runs["bwd"].output_dir / "epoch_1"
    original = load_file(tiny_assets.checkpoint_dir / tiny_assets.checkpoint_files[0])
    written = load_file(final / SHARD)
    # The HF checkpointer's layout: HF key names, an index, the model's config.
    assert set(written) == set(original)
    assert (final / "model.safetensors.index.json").is_file()
    assert (final / "config.json").is_file()
    assert any(not torch.equal(written[k], original[k]) for k in original), (
        "not trained"
    )

    checkpointer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(final),
        checkpoint_files=[SHARD],
        model_type="LLAMA2",
        output_dir=str(tmp_path),
    )
    state_dict = checkpointer.load_checkpoint()[training.MODEL_KEY]
    model = llama2(**tiny_assets.model_kwargs)
    model.load_state_dict(state_dict)  # strict: every key, every shape
