"""``ppo_full_finetune_single_device``: in-backward equals plain, resume equals
uninterrupted, and the optimizer state of the policy and the value model is saved and
resumed in both modes.

Every run is a ``tune run`` of ``tests/recipes/configs/tiny_ppo_single_device.yaml``
on CPU: the tiny policy, its reference, and the tiny reward and value models of
``tests/assets/make_ppo_assets.py``; 2 epochs of 2 PPO steps, each step 2 PPO epochs
over 8 trajectories in minibatches of 4, so 4 optimizer steps per PPO step and 16 in
all. Metrics are logged at optimizer steps 4, 8, 12 and 16. Runs are module-scoped,
shared between tests, and call ``tune``'s entry point in this process (the same
command line a ``tune run`` process parses). Every run saves a step checkpoint at
each epoch's end, named by the PPO step (``step_2``, ``step_4``); the uninterrupted
in-backward run also after every PPO step (``save_every_n_steps=1``: ``step_1`` ...
``step_4``), and the plain one keeps both of its own
(``checkpointer.keep_last_n_checkpoints=2``). Saving changes none of the metrics
(measured: bitwise the same as without).

Resumes from epoch 0 continue from the epoch-end step checkpoint ``step_2``, or from
the torchtune 0.6.1 epoch checkpoint made of it (the ``epoch_0`` exports and
``recipe_state/recipe_state.pt``: 0.6.1's PPO recipe state and the optimizer state).

Tolerances:

- Same mode, same computation (a resume against the uninterrupted run of that mode):
  the same CPU kernels see the same values, so every metric must be bitwise equal.
- In-backward against plain, both without accumulation, and resumes that switch
  mode: the recipe backpropagates the same loss in both modes (PPO's loss is a mean
  over each backward pass, in both modes), both measure the gradients with the same
  kernel, combine the norms in parameter order and clip by the same coefficient, and
  AdamW updates each parameter with the same single-tensor kernel. So every metric,
  ``grad_norm`` included, and the saved optimizer state are bitwise equal. Every run
  clips at ``CLIP``, between the smallest and the largest logged grad norm (each a
  mean over a PPO step's optimizer steps), so some optimizer steps clip and some
  do not.
- Plain with 2 backward passes per minibatch against in-backward with 1: each pass
  backpropagates half its mean loss; while every response runs to full length (the
  test checks that no stop token was generated), the two halves count the same
  tokens, so their sum is the minibatch mean up to float rounding (about 1e-7
  relative per gradient), which then compounds over 16 AdamW steps and the
  trajectories sampled from the updated policy: measured 1.8e-6 relative at most.
  ``ACCUMULATION_TOLERANCE`` allows ``rtol=1e-5``, for ``grad_norm`` too.
- A resume without the policy's optimizer state (what 0.6.1 did after an in-backward
  run) must move the resumed losses by far more than rounding: more than 1e-4
  relative (measured, clipping on: 8.0e-4 and 1.4e-1), against differences of 0
  between correct resumes.
- A resume from the mid-epoch step checkpoint ``step_1`` (after PPO step 1 of 4) in
  the same mode: bitwise, every metric at steps 8, 12 and 16, ``grad_norm`` and
  ``lr`` included; measured: equal.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch.testing import assert_close

from tests.assets.make_assets import TinyAssets
from tests.assets.make_ppo_assets import PPOAssets, ensure_ppo_assets
from tests.helpers import BITWISE, snapshot_files
from tests.recipes.utils import (
    TuneRun,
    TuneRunError,
    as_indexed,
    assert_metrics_close,
    assert_series_close,
    full_optimizer_state,
    run_tune_in_process,
    series,
    step_state,
    tiny_config,
)
from torchtune import training
from torchtune.training.checkpointing._step_format import (
    export_manifest,
)

pytestmark = pytest.mark.integration_test

RECIPE = "ppo_full_finetune_single_device"
CONFIG = tiny_config("tiny_ppo_single_device")
SHARD = "model-00001-of-00001.safetensors"
OPTIMIZER_STEPS_PER_PPO_STEP = 4
# The step checkpoint of epoch 0's end: PPO step 2.
EPOCH_0_END = "step_2"
EPOCH_0 = [4, 8]
EPOCH_1 = [12, 16]
# What every run logs at each of its steps.
LOGGED = {
    "loss",
    "policy_loss",
    "value_loss",
    "scores",
    "rlhf_reward",
    "kl",
    "kl_reward",
    "ratios",
    "clipfrac",
    "approx_policy_kl",
    "response_lengths",
    "num_stop_tokens",
    "grad_norm",
    "lr",
    "tokens_per_second_per_gpu_trajectory",
    "tokens_per_second_per_gpu_ppo",
}
# Metrics that follow from the weights and the sampled trajectories alone.
COMPARED = sorted(
    LOGGED - {"grad_norm", "lr"} - {m for m in LOGGED if "per_second" in m}
)
# Plain with 2 backward passes per minibatch vs in-backward with 1 (docstring).
ACCUMULATION_TOLERANCE = {"rtol": 1e-5, "atol": 0.0}
# The grad norm every run clips at (module docstring).
CLIP = 20.0


@pytest.fixture(scope="module")
def ppo_assets(tiny_assets: TinyAssets) -> PPOAssets:
    return ensure_ppo_assets(tiny_assets)


def _mode(name: str) -> dict[str, Any]:
    return {"optimizer_in_bwd": name == "bwd"}


def _overrides(ppo_assets: PPOAssets, **settings: Any) -> list[str]:
    settings = {"assets_dir": ppo_assets.tiny.root, "clip_grad_norm": CLIP, **settings}
    return [f"{key}={value}" for key, value in settings.items()]


def _resume_overrides(out: Path) -> dict[str, Any]:
    """Resume from the 0.6.1 epoch-0 checkpoint in ``out``: the policy and the recipe
    state through ``checkpointer``, the value model through its own."""
    return {
        "resume_from_checkpoint": True,
        "checkpointer.checkpoint_files": f"[epoch_0/{SHARD}]",
        "checkpointer.recipe_checkpoint": "recipe_state/recipe_state.pt",
        "value_checkpointer.checkpoint_dir": out / "value" / "epoch_0",
        "value_checkpointer.checkpoint_files": f"[{SHARD}]",
    }


def _copy_epoch_0(source: TuneRun, out: Path, *, manifests: bool = True) -> None:
    """The policy's and the value model's epoch-0 exports (without their manifests:
    0.6.1 wrote none)."""
    for part in ("epoch_0", "value/epoch_0"):
        shutil.copytree(source.output_dir / part, out / part)
        manifest = export_manifest(Path(part))
        if manifests:
            shutil.copy2(source.output_dir / manifest, out / manifest)


def _write_0_6_1_recipe_state(source: TuneRun, out: Path) -> Path:
    """``recipe_state/recipe_state.pt`` as torchtune 0.6.1's PPO recipe saved it after
    epoch 0: its recipe state and the optimizer state, taken from ``step_2``."""
    step = source.output_dir / EPOCH_0_END
    recipe_state = torch.load(step / "recipe_state.pt", weights_only=False)
    keys = (
        training.SEED_KEY,
        training.EPOCHS_KEY,
        training.TOTAL_EPOCHS_KEY,
        training.MAX_STEPS_KEY,
        training.STEPS_KEY,
        training.RNG_KEY,
    )
    state = {key: recipe_state[key] for key in keys}
    state[training.OPT_KEY] = as_indexed(full_optimizer_state(step))
    path = out / "recipe_state" / "recipe_state.pt"
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def runs(
    ppo_assets: PPOAssets, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, TuneRun]:
    """Uninterrupted runs: plain, in-backward, and plain with 2 backward passes per
    minibatch, clipping at ``CLIP``; and plain and in-backward without clipping."""
    settings = {
        # Both epoch-end step checkpoints, for the resume tests.
        "plain": {"checkpointer.keep_last_n_checkpoints": 2, **_mode("plain")},
        # Step checkpoints for the step-checkpoint resume test.
        "bwd": {
            "save_every_n_steps": 1,
            "checkpointer.keep_last_n_checkpoints": 10,
            **_mode("bwd"),
        },
        "plain_accumulated": {"gradient_accumulation_steps": 2, **_mode("plain")},
        # Clipping off (null): the single-pass in-backward path.
        "plain_no_clip": {"clip_grad_norm": "null", **_mode("plain")},
        "bwd_no_clip": {"clip_grad_norm": "null", **_mode("bwd")},
    }
    return {
        name: run_tune_in_process(
            RECIPE, CONFIG, _overrides(ppo_assets, **s), tmp_path_factory.mktemp(name)
        )
        for name, s in settings.items()
    }


@pytest.fixture(scope="module")
def resume(
    ppo_assets: PPOAssets,
    runs: dict[str, TuneRun],
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., TuneRun]:
    """``resume(source, target)``: ``runs[source]`` resumed in mode ``target`` from
    its epoch-0 step checkpoint, alone with the epoch-0 exports in a fresh
    output_dir, as torchtune 0.6.1's docs say to (``resume_from_checkpoint=True``,
    the policy's checkpoint files pointed at ``epoch_0/``); made on first request
    and shared after."""
    made: dict[str, TuneRun] = {}

    def resume(source: str, target: str) -> TuneRun:
        key = f"{source}_to_{target}"
        if key not in made:
            out = tmp_path_factory.mktemp(key)
            shutil.copytree(runs[source].output_dir / EPOCH_0_END, out / EPOCH_0_END)
            _copy_epoch_0(runs[source], out)
            made[key] = run_tune_in_process(
                RECIPE,
                CONFIG,
                _overrides(
                    ppo_assets,
                    resume_from_checkpoint=True,
                    **{"checkpointer.checkpoint_files": f"[epoch_0/{SHARD}]"},
                    **_mode(target),
                ),
                out,
            )
        return made[key]

    return resume


@pytest.fixture(scope="module")
def resume_0_6_1(
    ppo_assets: PPOAssets,
    runs: dict[str, TuneRun],
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., TuneRun]:
    """``resume_0_6_1(source, target, edit=None)``: ``runs[source]`` resumed in mode
    ``target`` from the torchtune 0.6.1 epoch-0 checkpoint made of it, made on first
    request and shared after. ``edit`` (with a name of its own) rewrites the saved
    recipe state first."""
    made: dict[str, TuneRun] = {}

    def resume(
        source: str,
        target: str,
        edit: tuple[str, Callable[[dict[str, Any]], None]] | None = None,
    ) -> TuneRun:
        key = f"0_6_1_{source}_to_{target}" + (f"_{edit[0]}" if edit else "")
        if key not in made:
            out = tmp_path_factory.mktemp(key)
            _copy_epoch_0(runs[source], out, manifests=False)
            path = _write_0_6_1_recipe_state(runs[source], out)
            if edit is not None:
                state = torch.load(path, weights_only=False)
                edit[1](state)
                torch.save(state, path)
            made[key] = run_tune_in_process(
                RECIPE,
                CONFIG,
                _overrides(ppo_assets, **_mode(target), **_resume_overrides(out)),
                out,
            )
        return made[key]

    return resume


def _param_names(ppo_assets: PPOAssets) -> tuple[list[str], list[str]]:
    """The policy's and the value model's parameter names, in optimizer order."""
    from torchtune.models.mistral import mistral, mistral_classifier

    policy = mistral(**ppo_assets.model_kwargs)
    value = mistral_classifier(num_classes=1, **ppo_assets.model_kwargs)
    return [n for n, _ in policy.named_parameters()], [
        n for n, _ in value.named_parameters()
    ]


def _drop_policy_state(ppo_assets: PPOAssets) -> Callable[[dict[str, Any]], None]:
    """Remove the policy's entries from the saved optimizer state."""
    num_policy = len(_param_names(ppo_assets)[0])

    def edit(state: dict[str, Any]) -> None:
        optimizer = state["optimizer"]
        optimizer["state"] = {
            i: s for i, s in optimizer["state"].items() if i >= num_policy
        }

    return edit


def _as_0_6_1_in_bwd(ppo_assets: PPOAssets) -> Callable[[dict[str, Any]], None]:
    """Rewrite the saved optimizer state as torchtune 0.6.1's in-backward PPO run
    saved it: ``{value model parameter name: its own optimizer's state_dict()}``,
    nothing of the policy."""
    policy_names, value_names = _param_names(ppo_assets)

    def edit(state: dict[str, Any]) -> None:
        optimizer = state["optimizer"]
        (group,) = optimizer["param_groups"]
        hyperparameters = {k: v for k, v in group.items() if k != "params"}
        state["optimizer"] = {
            name: {
                "state": {0: optimizer["state"][len(policy_names) + i]},
                "param_groups": [{**hyperparameters, "params": [0]}],
            }
            for i, name in enumerate(value_names)
        }

    return edit


def test_every_step_logs_the_ppo_metrics(runs: dict[str, TuneRun]) -> None:
    for run in runs.values():
        assert sorted(run.metrics) == EPOCH_0 + EPOCH_1
        for values in run.metrics.values():
            assert set(values) == LOGGED
            # No stop token was sampled: the accumulation test relies on it.
            assert values["num_stop_tokens"] == 0
    # Training moved the policy: the KL from the reference grew from ~0.
    kl = series(runs["bwd"], "kl", EPOCH_0 + EPOCH_1).abs()
    assert kl[0] < 1e-5 and kl[1:].max() > 1e-2, kl


@pytest.mark.parametrize("plain", ["plain", "plain_accumulated"])
def test_in_backward_gives_the_plain_metrics_at_every_step(
    plain: str, runs: dict[str, TuneRun]
) -> None:
    steps = EPOCH_0 + EPOCH_1
    tolerance = BITWISE if plain == "plain" else ACCUMULATION_TOLERANCE
    assert_metrics_close(
        runs["bwd"], runs[plain], (*COMPARED, "grad_norm"), steps, **tolerance
    )
    norms = series(runs[plain], "grad_norm", steps)
    assert norms.min() < CLIP < norms.max(), norms
    assert_series_close(runs["bwd"], runs[plain], "lr", steps, **BITWISE)


def test_in_backward_without_clipping_gives_the_plain_metrics_bitwise(
    runs: dict[str, TuneRun],
) -> None:
    steps = EPOCH_0 + EPOCH_1
    bwd, plain = runs["bwd_no_clip"], runs["plain_no_clip"]
    assert_metrics_close(bwd, plain, (*COMPARED, "grad_norm"), steps, **BITWISE)
    # Clipping changed the clipped runs: the comparison above is of another path.
    assert not torch.equal(
        series(bwd, "loss", steps), series(runs["bwd"], "loss", steps)
    )


def test_saved_checkpoint_holds_the_optimizer_state_of_both_models_in_both_modes(
    ppo_assets: PPOAssets, runs: dict[str, TuneRun]
) -> None:
    from torchtune.models.mistral import mistral, mistral_classifier

    shapes = [p.shape for p in mistral(**ppo_assets.model_kwargs).parameters()] + [
        p.shape
        for p in mistral_classifier(
            num_classes=1, **ppo_assets.model_kwargs
        ).parameters()
    ]
    saved = {}
    for mode in ("plain", "bwd"):
        state = step_state(runs[mode].output_dir / EPOCH_0_END)
        assert {name.split(".")[0] for name in state["model"]} == {"policy", "value"}
        optimizer = as_indexed(state["optimizer"])
        # The standard torch.optim format: one group, the policy's parameters and
        # then the value model's, and AdamW state for every one of them.
        (group,) = optimizer["param_groups"]
        assert group["params"] == list(range(len(shapes)))
        assert sorted(optimizer["state"]) == group["params"]
        for index, shape in enumerate(shapes):
            entry = optimizer["state"][index]
            # Epoch 0: 2 PPO steps of 4 optimizer steps each.
            assert entry["step"].item() == 2 * OPTIMIZER_STEPS_PER_PPO_STEP
            assert entry["exp_avg"].shape == shape
            assert entry["exp_avg_sq"].abs().sum() > 0
        saved[mode] = optimizer
    # Same arithmetic in both modes (module docstring).
    assert_close(saved["bwd"]["state"], saved["plain"]["state"], **BITWISE)


@pytest.mark.parametrize(
    "source,target",
    [("plain", "plain"), ("bwd", "bwd"), ("plain", "bwd"), ("bwd", "plain")],
    ids=lambda mode: mode,
)
def test_resume_from_epoch_0_gives_the_uninterrupted_metrics(
    source: str,
    target: str,
    runs: dict[str, TuneRun],
    resume: Callable[..., TuneRun],
) -> None:
    resumed = resume(source, target)
    assert sorted(resumed.metrics) == EPOCH_1
    assert_metrics_close(resumed, runs[source], COMPARED, EPOCH_1, **BITWISE)


@pytest.mark.parametrize(
    "source,target", [("plain", "bwd"), ("bwd", "plain")], ids=lambda mode: mode
)
def test_resume_from_a_0_6_1_epoch_checkpoint_gives_the_uninterrupted_metrics(
    source: str,
    target: str,
    runs: dict[str, TuneRun],
    resume_0_6_1: Callable[..., TuneRun],
) -> None:
    """0.6.1's recipe state (PPO steps under ``steps_run``, no ``global_step``) and
    optimizer state resume the run where it was, the value model read back from its
    epoch-0 export by ``value_checkpointer``."""
    resumed = resume_0_6_1(source, target)
    assert sorted(resumed.metrics) == EPOCH_1
    assert_metrics_close(resumed, runs[source], (*COMPARED, "lr"), EPOCH_1, **BITWISE)


def test_resume_without_the_policy_optimizer_state_differs(
    ppo_assets: PPOAssets,
    runs: dict[str, TuneRun],
    resume_0_6_1: Callable[..., TuneRun],
) -> None:
    """What the resume tests above would see had the policy's state not been saved:
    they can fail."""
    resumed = resume_0_6_1(
        "bwd", "bwd", ("no_policy_state", _drop_policy_state(ppo_assets))
    )
    assert sorted(resumed.metrics) == EPOCH_1
    losses = series(resumed, "loss", EPOCH_1)
    uninterrupted = series(runs["bwd"], "loss", EPOCH_1)
    relative = ((losses - uninterrupted) / uninterrupted).abs()
    assert relative.min() > 1e-4, (losses, uninterrupted)


def test_resume_from_a_0_6_1_in_backward_checkpoint_loads_the_value_model_state(
    ppo_assets: PPOAssets, resume_0_6_1: Callable[..., TuneRun]
) -> None:
    """0.6.1 saved the value model's optimizer state only: it loads, and the policy's
    starts afresh. (The state is converted to the standard format before either mode
    loads it, so one mode shows it.)"""
    expected = resume_0_6_1(
        "bwd", "bwd", ("no_policy_state", _drop_policy_state(ppo_assets))
    )
    resumed = resume_0_6_1("bwd", "bwd", ("in_bwd", _as_0_6_1_in_bwd(ppo_assets)))
    assert sorted(resumed.metrics) == EPOCH_1
    assert_metrics_close(resumed, expected, COMPARED, EPOCH_1, **BITWISE)


def test_resume_from_a_mid_epoch_step_checkpoint_gives_the_uninterrupted_metrics(
    ppo_assets: PPOAssets, runs: dict[str, TuneRun], tmp_path: Path
) -> None:
    """The step checkpoint of PPO step 1 (logged at optimizer step 4), alone in a
    fresh output_dir, found by ``resume_from_checkpoint=True`` without naming a file:
    the run continues mid-epoch 0 (the loader at its second batch), crosses into
    epoch 1, and logs what the uninterrupted run logged. The value model comes from
    the step checkpoint: ``value_checkpointer`` still reads the weights it started
    from."""
    step_1 = runs["bwd"].output_dir / "step_1"
    recipe_state = torch.load(step_1 / "recipe_state.pt", weights_only=False)
    assert (recipe_state["global_step"], recipe_state["steps_run"]) == (1, 1)
    saved = step_state(step_1)
    assert {name.split(".")[0] for name in saved["model"]} == {"policy", "value"}

    out = tmp_path / "out"
    shutil.copytree(step_1, out / "step_1")
    resumed = run_tune_in_process(
        RECIPE,
        CONFIG,
        _overrides(
            ppo_assets,
            save_every_n_steps=1,
            resume_from_checkpoint=True,
            **_mode("bwd"),
        ),
        out,
    )
    steps = EPOCH_0[1:] + EPOCH_1
    assert sorted(resumed.metrics) == steps
    assert_metrics_close(
        resumed, runs["bwd"], (*COMPARED, "grad_norm", "lr"), steps, **BITWISE
    )


def test_save_every_n_steps_counts_ppo_steps(
    ppo_assets: PPOAssets, runs: dict[str, TuneRun], tmp_path: Path
) -> None:
    """``save_every_n_steps=3``: after PPO step 3 (mid-epoch 1), not every 3 optimizer
    steps (there are 4 per PPO step), and at the epochs' ends (PPO steps 2 and 4).
    Folders are named by the PPO step. Without ``save_every_n_steps`` only the
    epoch-end ones are saved and, unless ``keep_last_n_checkpoints`` says more, only
    the newest is kept, and none once the run is done."""
    assert {p.name for p in runs["bwd"].output_dir.glob("step_*")} == {
        f"step_{n}" for n in (1, 2, 3, 4)
    }
    assert {p.name for p in runs["plain"].output_dir.glob("step_*")} == {
        "step_2",
        "step_4",
    }
    for name in ("plain_accumulated", "plain_no_clip", "bwd_no_clip"):
        assert not list(runs[name].output_dir.glob("step_*"))
    run = run_tune_in_process(
        RECIPE,
        CONFIG,
        _overrides(
            ppo_assets,
            save_every_n_steps=3,
            **{"checkpointer.keep_last_n_checkpoints": 10},
            **_mode("plain"),
        ),
        tmp_path,
    )
    assert {p.name for p in run.output_dir.glob("step_*")} == {
        "step_2",
        "step_3",
        "step_4",
    }
    saved = torch.load(
        run.output_dir / "step_3" / "recipe_state.pt", weights_only=False
    )
    assert (saved["global_step"], saved["steps_run"]) == (3, 3)
    assert not saved["epoch_end"]


def test_final_checkpoints_load_back_into_the_models(
    ppo_assets: PPOAssets, runs: dict[str, TuneRun], tmp_path: Path
) -> None:
    from torchtune.models.mistral import mistral, mistral_classifier

    out = runs["bwd"].output_dir
    for subdir, model_type, model in (
        ("", "MISTRAL", mistral(**ppo_assets.model_kwargs)),
        (
            "value",
            "REWARD",
            mistral_classifier(num_classes=1, **ppo_assets.model_kwargs),
        ),
    ):
        checkpointer = training.FullModelHFCheckpointer(
            checkpoint_dir=str(out / subdir / "epoch_1"),
            checkpoint_files=[SHARD],
            model_type=model_type,
            output_dir=str(tmp_path / model_type),
        )
        # Strict: every key, every shape.
        model.load_state_dict(checkpointer.load_checkpoint()[training.MODEL_KEY])


REFUSALS = {
    "ppo_batch_size": (
        {"ppo_batch_size": 3},
        "batch_size=8 is not a multiple of ppo_batch_size=3: every step splits its "
        "batch_size prompts into batches of ppo_batch_size. Choose sizes that divide "
        "each other.",
    ),
    "num_steps": (
        {"num_steps": 4},
        "num_steps=4 is smaller than batch_size=8: num_steps counts prompts, so this "
        "run would have no step. Set num_steps to at least batch_size.",
    ),
}


@pytest.mark.parametrize("key", REFUSALS)
def test_refused_config_fails_with_its_message_and_leaves_output_dir_untouched(
    key: str, ppo_assets: PPOAssets, runs: dict[str, TuneRun], tmp_path: Path
) -> None:
    # An output_dir that holds a finished run's checkpoints.
    out = tmp_path / "out"
    shutil.copytree(runs["bwd"].output_dir, out)
    before = snapshot_files(out)
    settings, message = REFUSALS[key]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        run_tune_in_process(RECIPE, CONFIG, _overrides(ppo_assets, **settings), out)
    assert snapshot_files(out) == before


def test_fresh_run_refuses_a_reference_policy_other_than_the_policy(
    ppo_assets: PPOAssets, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    other = ppo_assets.reward_checkpoint_dir
    with pytest.raises(ValueError, match="^ref_policy_checkpointer must read the same"):
        run_tune_in_process(
            RECIPE,
            CONFIG,
            _overrides(ppo_assets, **{"ref_policy_checkpointer.checkpoint_dir": other}),
            out,
        )
    assert list(out.iterdir()) == []


def test_messages_name_num_steps_which_ppo_counts(
    ppo_assets: PPOAssets,
    runs: dict[str, TuneRun],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    shutil.copytree(runs["plain"].output_dir, tmp_path, dirs_exist_ok=True)
    settings = {"resume_from_checkpoint": True, **_mode("plain")}
    with caplog.at_level(logging.WARNING), pytest.raises(TuneRunError, match="no met"):
        run_tune_in_process(
            RECIPE, CONFIG, _overrides(ppo_assets, **settings), tmp_path
        )
    num_steps = OmegaConf.load(CONFIG).num_steps
    assert (
        f"nothing left to do. To train further, set num_steps to more than {num_steps}."
        in caplog.text
    )
    assert "epochs to more than" not in caplog.text
