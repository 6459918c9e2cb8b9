"""``full_finetune_single_device``: in-backward equals plain, resume equals uninterrupted.

Every run here is a ``tune run`` of the tiny Llama2 on CPU (see
``tests/recipes/configs/tiny_full_single_device.yaml``); runs are module-scoped and
shared between tests. Each calls the ``tune`` entry point in this process
(``run_tune_in_process``), which parses the same command line and runs the same
recipe file as ``tune run`` in a process of its own, without paying ~15 s of imports
each (``tests/recipes/test_harness_smoke.py`` shows the two train alike, bitwise).

Every comparison names the exact steps it compares and checks that both runs
logged those steps; the final weights are compared too (they hold the last step's
update, which no logged loss shows). ``assert_series_close`` and
``assert_weights_close`` print the largest difference they see (``pytest -s``); the
values below were measured that way on this project's x86 CPU.

Tolerances:

- Same mode, same computation (a resume against the uninterrupted run of the same
  mode, fp32 or bf16): the same CPU kernels see the same values, so losses, grad
  norms and final weights must be bitwise equal: ``rtol=0, atol=0``.
- In-backward against plain, fp32 and bf16, and a resume that switches mode: both
  backpropagate ``mean * tokens``, multiply the gradients by ``1 / tokens``, measure
  them and clip them with the same operations (in-backward inside backward, per
  bucket), so losses, grad norms and weights are bitwise equal too. The AdamW runs
  clip at ``CLIP``, which their grad norm crosses (some steps clip, some do not);
  the bf16 runs do not clip.
- SGD with gradient accumulation (plain: two half batches of 4 per step) against
  in-backward (one batch of 8): the same examples, but the half batches are padded
  to other lengths and their token sums are added before the division, so the
  gradients differ by float rounding, about an ulp per entry. Losses: measured
  1.0e-7 relative over four steps, ``rtol=1e-6``; ``grad_norm`` 2.5e-7,
  ``rtol=2e-6``; weights 1.2e-7 absolute (one ulp of a weight near 1), ``atol=1e-6``.
  A real error is far larger: backpropagating ``mean * tokens`` with no division, as
  0.6.1's in-backward path did (an SGD step ~24x too large here), moves the second
  SGD loss by 47% (checked by putting that bug back).
- Learning rates come from the same scheduler arithmetic in both modes: equal
  exactly.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.assets.make_assets import TinyAssets
from tests.recipes.utils import (
    BITWISE_TRAINING,
    TuneRun,
    assert_same_training,
    assert_trains_as_plain,
    load_weights,
    run_tune_in_process,
    series,
    tiny_config,
)

pytestmark = pytest.mark.integration_test

RECIPE = "full_finetune_single_device"
CONFIG = tiny_config("tiny_full_single_device")
STEPS_PER_EPOCH = 3
ALL_STEPS = range(1, 2 * STEPS_PER_EPOCH + 1)
EPOCH_1 = range(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH + 1)
SGD_STEPS = range(1, 5)
# In-backward vs plain (module docstring): bitwise, but for SGD's accumulation.
ACROSS_MODES = {
    "adamw_cosine_warmup": BITWISE_TRAINING,
    "sgd_momentum": {
        "loss": {"rtol": 1e-6, "atol": 0.0},  # 1.0e-7
        "grad_norm": {"rtol": 2e-6, "atol": 0.0},  # 2.5e-7
        "weights": {"rtol": 0.0, "atol": 1e-6},  # 1.2e-7
    },
}
# The grad norm the AdamW and SGD runs clip at: the tiny model's norms cross it.
CLIP = 4.0
SHARD = "model-00001-of-00001.safetensors"


def _mode_overrides(
    optimizer_in_bwd: bool, clip_grad_norm: float | None = CLIP
) -> dict[str, object]:
    return {"optimizer_in_bwd": optimizer_in_bwd, "clip_grad_norm": clip_grad_norm}


def _name(optimizer_in_bwd: bool) -> str:
    return "bwd" if optimizer_in_bwd else "plain"


def tune_run_here(
    config: Path, overrides: Mapping[str, object] | list[str], output_dir: Path
) -> TuneRun:
    """``tune run RECIPE --config config overrides`` in this process."""
    return run_tune_in_process(RECIPE, config, overrides, output_dir)


@pytest.fixture(scope="module")
def adamw_runs(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, TuneRun]:
    """Two epochs of AdamW + cosine warmup (the tiny config's), in each mode."""
    overrides = {
        "assets_dir": tiny_assets.root,
        "epochs": 2,
        "max_steps_per_epoch": STEPS_PER_EPOCH,
        # Keep epoch 0's step checkpoint too (only the newest by default).
        "checkpointer.keep_last_n_checkpoints": 2,
    }
    return {
        "plain": tune_run_here(
            CONFIG,
            overrides | _mode_overrides(False),
            tmp_path_factory.mktemp("adamw_plain"),
        ),
        "bwd": tune_run_here(
            CONFIG,
            overrides | _mode_overrides(True),
            tmp_path_factory.mktemp("adamw_bwd"),
        ),
    }


@pytest.fixture(scope="module")
def sgd_runs(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, TuneRun]:
    """Four steps of SGD with momentum and no LR scheduler, in each mode.

    The plain run accumulates two batches of 4 per step and clips at a norm it never
    reaches, so it also checks that accumulation normalizes over the whole step's
    tokens: a step sees the same 8 examples, in the same order, in both runs.
    """
    from omegaconf import OmegaConf

    # `tune run` cannot remove a component from the command line: write a config
    # without lr_scheduler.
    cfg = OmegaConf.load(CONFIG)
    del cfg["lr_scheduler"]
    cfg.optimizer = {"_component_": "torch.optim.SGD", "lr": 0.2, "momentum": 0.9}
    config = tmp_path_factory.mktemp("sgd_config") / "tiny_sgd.yaml"
    OmegaConf.save(cfg, config)

    common = {"assets_dir": tiny_assets.root, "epochs": 1, "max_steps_per_epoch": 4}
    plain = {
        "optimizer_in_bwd": False,
        "batch_size": 4,
        "gradient_accumulation_steps": 2,
        "clip_grad_norm": CLIP,
    }
    # Peak memory is asked for but skipped on CPU, without failing.
    bwd = {"batch_size": 8, "log_peak_memory_stats": True, **_mode_overrides(True)}
    return {
        name: tune_run_here(
            config, common | mode, tmp_path_factory.mktemp(f"sgd_{name}")
        )
        for name, mode in (("plain", plain), ("bwd", bwd))
    }


def _write_0_6_1_in_backward_checkpoint(
    run: TuneRun, out: Path, assets: TinyAssets
) -> None:
    """``run``'s epoch 0 as torchtune 0.6.1 left it after an in-backward run: its
    weights (no manifest) and its recipe state, the optimizer state in 0.6.1's
    in-backward format (the checkpoint client converts it for either optimizer)."""
    from torchtune import training
    from torchtune.models.llama2 import llama2

    shutil.copytree(run.output_dir / "epoch_0", out / "epoch_0")
    epoch_end = run.output_dir / f"step_{STEPS_PER_EPOCH}" / "model_optimizer.pt"
    state = {
        training.OPT_KEY: torch.load(epoch_end, weights_only=False)["optimizer"],
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


@pytest.fixture(scope="module")
def resumed_runs(
    tiny_assets: TinyAssets,
    adamw_runs: dict[str, TuneRun],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, str], TuneRun]:
    """Each 2-epoch AdamW run resumed from its epoch-0 checkpoint, in each mode; and,
    keyed ``("0.6.1", target)``, the plain run's epoch 0 as 0.6.1 saved an
    in-backward run (:func:`_write_0_6_1_in_backward_checkpoint`)."""
    common = {
        "assets_dir": tiny_assets.root,
        "epochs": 2,
        "max_steps_per_epoch": STEPS_PER_EPOCH,
        "resume_from_checkpoint": True,
    }
    runs = {}
    for source in ("plain", "bwd"):
        for target in (False, True):
            # A fresh output_dir holding only epoch 0's step checkpoint.
            out = tmp_path_factory.mktemp(f"resume_{source}_to_{_name(target)}")
            epoch_end = f"step_{STEPS_PER_EPOCH}"
            shutil.copytree(adamw_runs[source].output_dir / epoch_end, out / epoch_end)
            runs[source, _name(target)] = tune_run_here(
                CONFIG, common | _mode_overrides(target), out
            )
    for target in (False, True):
        out = tmp_path_factory.mktemp(f"resume_0_6_1_to_{_name(target)}")
        _write_0_6_1_in_backward_checkpoint(adamw_runs["plain"], out, tiny_assets)
        runs["0.6.1", _name(target)] = tune_run_here(
            CONFIG,
            common
            | _mode_overrides(target)
            | {
                "checkpointer.checkpoint_files": [f"epoch_0/{SHARD}"],
                "checkpointer.recipe_checkpoint": "recipe_state/recipe_state.pt",
            },
            out,
        )
    return runs


def _final_weights(run: TuneRun, epoch: int = 1) -> dict[str, torch.Tensor]:
    """The model weights of ``run``'s checkpoint of ``epoch`` (its last one)."""
    return load_weights(run.output_dir / f"epoch_{epoch}" / SHARD)


@pytest.mark.parametrize("optimizer", ["adamw_cosine_warmup", "sgd_momentum"])
def test_in_backward_gives_the_plain_loss_at_every_step(
    optimizer: str, request: pytest.FixtureRequest
) -> None:
    adamw = optimizer == "adamw_cosine_warmup"
    runs = request.getfixturevalue("adamw_runs" if adamw else "sgd_runs")
    plain, bwd = runs["plain"], runs["bwd"]
    assert_trains_as_plain(
        bwd,
        plain,
        ACROSS_MODES[optimizer],
        ALL_STEPS if adamw else SGD_STEPS,
        # The weights each mode ends with (after every step's update, the last one
        # included, which no logged loss shows).
        final_weights=partial(_final_weights, epoch=1 if adamw else 0),
    )
    if adamw:
        norms = series(plain, "grad_norm", ALL_STEPS)
        assert (norms > CLIP).any() and (norms < CLIP).any(), norms
    for run in (plain, bwd):
        for values in run.metrics.values():
            assert {"loss", "lr", "tokens_per_second_per_gpu", "grad_norm"} <= set(
                values
            )
            # CPU: no peak memory stats, even though nothing failed.
            assert not any(name.startswith("peak_memory") for name in values)


@pytest.mark.parametrize(
    "source,target",
    [
        ("plain", "plain"),
        ("bwd", "bwd"),
        ("plain", "bwd"),
        ("bwd", "plain"),
        # The plain run's epoch 0 as torchtune 0.6.1 saved an in-backward run.
        ("0.6.1", "bwd"),
        ("0.6.1", "plain"),
    ],
    ids=lambda mode: mode,
)
def test_resume_from_epoch_0_gives_the_uninterrupted_losses(
    source: str,
    target: str,
    adamw_runs: dict[str, TuneRun],
    resumed_runs: dict[tuple[str, str], TuneRun],
) -> None:
    # The resumed run starts at the step after epoch 0, on the scheduler's position,
    # and ends with the uninterrupted run's weights, after all three updates:
    # bitwise in either mode (module docstring).
    assert_same_training(
        resumed_runs[source, target],
        adamw_runs["plain" if source == "0.6.1" else source],
        BITWISE_TRAINING,
        EPOCH_1,
        reference_steps=ALL_STEPS,
        final_weights=_final_weights,
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


BF16_STEPS_PER_EPOCH = 2
BF16_ALL_STEPS = range(1, 2 * BF16_STEPS_PER_EPOCH + 1)
BF16_EPOCH_1 = range(BF16_STEPS_PER_EPOCH + 1, 2 * BF16_STEPS_PER_EPOCH + 1)


@pytest.fixture(scope="module")
def bf16_runs(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, TuneRun]:
    """Two epochs of two AdamW steps in bf16, in each mode, and the in-backward run
    resumed in-backward from its epoch-0 checkpoint."""
    overrides = {
        "assets_dir": tiny_assets.root,
        "dtype": "bf16",
        "epochs": 2,
        "max_steps_per_epoch": BF16_STEPS_PER_EPOCH,
        "checkpointer.keep_last_n_checkpoints": 2,
    }
    runs = {
        _name(bwd): tune_run_here(
            CONFIG,
            overrides | _mode_overrides(bwd, clip_grad_norm=None),
            tmp_path_factory.mktemp(f"bf16_{_name(bwd)}"),
        )
        for bwd in (False, True)
    }
    out = tmp_path_factory.mktemp("bf16_resumed")
    epoch_end = f"step_{BF16_STEPS_PER_EPOCH}"
    shutil.copytree(runs["bwd"].output_dir / epoch_end, out / epoch_end)
    runs["resumed"] = tune_run_here(
        CONFIG,
        overrides
        | _mode_overrides(True, clip_grad_norm=None)
        | {"resume_from_checkpoint": True},
        out,
    )
    return runs


def test_bf16_in_backward_trains_as_plain_and_resumes_bitwise(
    bf16_runs: dict[str, TuneRun],
) -> None:
    plain, bwd = bf16_runs["plain"], bf16_runs["bwd"]
    assert_trains_as_plain(
        bwd, plain, BITWISE_TRAINING, BF16_ALL_STEPS, final_weights=_final_weights
    )
    assert all(w.dtype == torch.bfloat16 for w in _final_weights(bwd).values())
    # bf16 weights and optimizer state are saved and loaded as they are: the same
    # kernels on the same values.
    assert_same_training(
        bf16_runs["resumed"],
        bwd,
        BITWISE_TRAINING,
        BF16_EPOCH_1,
        reference_steps=BF16_ALL_STEPS,
        final_weights=_final_weights,
    )
