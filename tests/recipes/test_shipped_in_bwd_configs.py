"""Recipe tests that run torchtune's shipped ``optimizer_in_bwd: True`` configs.

The configs are read from the installed package: every config registered for a
recipe of this tree (``recipes/*.py``) whose YAML sets ``optimizer_in_bwd: True``.
Each runs as shipped (its bitsandbytes optimizer, bf16, chunked cross-entropy,
activation checkpointing) with only what this machine forces changed:
``shipped_config_overrides`` swaps in the tiny model, tokenizer, checkpoint and data
of ``tests/assets`` and runs on the CPU (``ppo_shipped_config_overrides`` does the
same for PPO configs, which name a policy, a reward-and-value model and four
checkpointers instead of one model). Every run is two epochs of
``STEPS_PER_EPOCH`` steps, so its epoch-0 checkpoint can be resumed and compared
with the second epoch.

For each optimizer class the configs use, one config (the one with the largest
learning rate, whose resumed epoch moves the weights most) is also resumed from
epoch 0, in the same mode as shipped (bf16) and switching between plain and
in-backward (fp32), and resumed mid-epoch from a step checkpoint
(``save_every_n_steps``) as shipped. Runs go through ``tune``'s entry point in this process and are
shared between tests.

Tolerances:

- In-backward resumed in-backward, against the uninterrupted in-backward run: the
  same CPU kernels see the same values, so the losses must be bitwise equal:
  ``rtol=0, atol=0``.
- A resume that switches between plain and in-backward, against the uninterrupted
  run of the mode it was saved from, in fp32: both modes backpropagate the summed
  loss and multiply the gradients by ``1 / tokens`` with the same operations (plain
  after backward, in-backward inside it), so the losses are bitwise equal too. A
  resume that gets the optimizer state wrong is far off: starting the resumed epoch
  with fresh AdamW state moves its second and third losses by 7e-5 and 1.2e-4
  relative (measured on both subset configs).
"""

from __future__ import annotations

import inspect
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from tests.assets.make_assets import TinyAssets
from tests.helpers import BITWISE
from tests.recipes.utils import (
    REPO_ROOT,
    TuneRun,
    as_indexed,
    full_optimizer_state,
    is_ppo_config,
    ppo_shipped_config_overrides,
    run_tune_forked,
    run_tune_in_process,
    shipped_config_overrides,
)

pytestmark = pytest.mark.integration_test

# The recipes this tree rewrites; a config of any other recipe is not ours to test.
TREE_RECIPES = {path.name for path in (REPO_ROOT / "recipes").glob("*.py")}
STEPS_PER_EPOCH = 3
EPOCH_1 = range(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH + 1)
# Plain vs in-backward in fp32: float rounding only (see the module docstring).
FP32_MODE_SWITCH = BITWISE


@dataclass(frozen=True)
class ShippedConfig:
    """A shipped config that sets ``optimizer_in_bwd: True``.

    Attributes:
        recipe (str): the recipe it is registered for.
        recipe_file (str): that recipe's file name (``full_finetune_single_device.py``).
        name (str): the config's name for ``tune run`` (``llama3_2/1B_full_single_device``).
        path (Path): its YAML file inside the installed package.
        optimizer (dict[str, Any]): its ``optimizer`` section.
        dtype (torch.dtype): its training dtype.
    """

    recipe: str
    recipe_file: str
    name: str
    path: Path
    optimizer: dict[str, Any]
    dtype: torch.dtype

    def __str__(self) -> str:
        return self.name


def shipped_in_bwd_configs() -> list[ShippedConfig]:
    """Every config registered for a recipe of this tree whose YAML sets
    ``optimizer_in_bwd: True``, in registry order."""
    from omegaconf import OmegaConf

    import torchtune
    from torchtune import training
    from torchtune._recipe_registry import get_all_recipes

    configs_dir = Path(torchtune.__file__).parent.parent / "recipes" / "configs"
    found = []
    for recipe in get_all_recipes():
        if recipe.file_path not in TREE_RECIPES:
            continue
        for config in recipe.configs:
            path = configs_dir / config.file_path
            cfg = OmegaConf.load(path)
            if cfg.get("optimizer_in_bwd") is True:
                found.append(
                    ShippedConfig(
                        recipe=recipe.name,
                        recipe_file=recipe.file_path,
                        name=config.name,
                        path=path,
                        optimizer=OmegaConf.to_container(cfg.optimizer),
                        dtype=training.get_dtype(cfg.get("dtype"), torch.device("cpu")),
                    )
                )
    return found


SHIPPED = shipped_in_bwd_configs()


def resume_subset(configs: list[ShippedConfig]) -> list[ShippedConfig]:
    """One config per optimizer class: the one with the largest learning rate (the
    first in registry order on a tie). In bf16 a small update rounds away; the
    largest step changes the most weights, so a resume that got the optimizer state
    wrong shows in the losses."""
    chosen: dict[str, ShippedConfig] = {}
    for config in configs:
        component = config.optimizer["_component_"]
        best = chosen.get(component)
        if best is None or config.optimizer["lr"] > best.optimizer["lr"]:
            chosen[component] = config
    return list(chosen.values())


RESUME_SUBSET = resume_subset(SHIPPED)


def _run(config: ShippedConfig, overrides: list[str], output_dir: Path) -> TuneRun:
    """``tune run`` the config's recipe: in this process when it is single-device."""
    if "distributed" in config.recipe:
        return run_tune_forked(
            config.recipe, config.path, overrides, nproc=1, output_dir=output_dir
        )
    return run_tune_in_process(config.recipe, config.path, overrides, output_dir)


def _overrides(assets: TinyAssets, config: ShippedConfig, **settings: Any) -> list[str]:
    overrides = (
        ppo_shipped_config_overrides
        if is_ppo_config(config.path)
        else shipped_config_overrides
    )
    return overrides(
        assets,
        config.path,
        {
            # Shipped configs leave the seed to chance; comparing two runs needs one.
            "seed": 0,
            # Shipped configs train for an epoch of a real dataset; two short epochs
            # give an epoch-0 checkpoint and a second epoch to compare a resume with.
            "epochs": 2,
            "max_steps_per_epoch": STEPS_PER_EPOCH,
            # The tests read every step's loss.
            "log_every_n_steps": 1,
            # Keep epoch 0's step checkpoint (not only the newest) to resume from.
            "checkpointer.keep_last_n_checkpoints": 2,
            **settings,
        },
    )


@pytest.fixture(scope="module")
def run_once(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., TuneRun]:
    """``run_once(config, key, resume_from=None, **settings)``: the run of ``config``
    with ``settings``, made on first request and shared by every test after.

    ``resume_from`` names an earlier run whose epoch-0 step checkpoint this run
    resumes, in a fresh output_dir, with ``resume_from_checkpoint=True`` alone.
    """
    runs: dict[tuple[str, str], TuneRun] = {}

    def run_once(
        config: ShippedConfig, key: str, resume_from: str | None = None, **settings
    ) -> TuneRun:
        if (config.name, key) not in runs:
            out = tmp_path_factory.mktemp(f"{config.name.replace('/', '_')}_{key}")
            if resume_from is not None:
                source = runs[config.name, resume_from]
                epoch_end = f"step_{STEPS_PER_EPOCH}"
                shutil.copytree(source.output_dir / epoch_end, out / epoch_end)
                settings = {"resume_from_checkpoint": True} | settings
            runs[config.name, key] = _run(
                config, _overrides(tiny_assets, config, **settings), out
            )
        return runs[config.name, key]

    return run_once


def _shipped_run(run_once: Callable[..., TuneRun], config: ShippedConfig) -> TuneRun:
    """The config as shipped: in-backward, in its own dtype."""
    return run_once(config, "shipped")


def _fp32_runs(
    run_once: Callable[..., TuneRun], config: ShippedConfig
) -> dict[str, TuneRun]:
    """Uninterrupted fp32 runs in each mode, then each resumed in the other mode."""
    fp32 = {"dtype": "fp32"}
    runs = {
        "plain": run_once(config, "fp32_plain", optimizer_in_bwd=False, **fp32),
        "bwd": run_once(config, "fp32_bwd", **fp32),
    }
    runs["plain_to_bwd"] = run_once(
        config, "fp32_plain_to_bwd", resume_from="fp32_plain", **fp32
    )
    runs["bwd_to_plain"] = run_once(
        config,
        "fp32_bwd_to_plain",
        resume_from="fp32_bwd",
        optimizer_in_bwd=False,
        **fp32,
    )
    return runs


def _makes_8bit_state(config: ShippedConfig, numel: int) -> bool:
    """Whether the config's optimizer keeps 8-bit state for a parameter of ``numel``
    elements: one step on such a parameter, asked of the optimizer itself."""
    from omegaconf import OmegaConf

    from torchtune import config as tune_config

    param = torch.nn.Parameter(torch.zeros(numel, dtype=config.dtype))
    param.grad = torch.ones_like(param)
    opt = tune_config.instantiate(OmegaConf.create(config.optimizer), [param])
    opt.step()
    return opt.state[param]["state1"].dtype == torch.uint8


def _tiny_param_numels(
    assets: TinyAssets, config: ShippedConfig | None = None
) -> dict[str, int]:
    """The tiny model's parameter sizes, in the order ``config``'s optimizer holds
    them."""
    from torchtune.models.llama2 import llama2

    model = llama2(**assets.model_kwargs)
    numels = {name: p.numel() for name, p in model.named_parameters()}
    if config is not None and is_ppo_config(config.path):
        # PPO's one optimizer holds the policy's parameters (the tiny model), then
        # the value model's (the same sizes with a one-output head).
        from torchtune.models.mistral import mistral_classifier

        kwargs = {k: v for k, v in assets.model_kwargs.items() if k != "rope_base"}
        value = mistral_classifier(num_classes=1, **kwargs)
        numels |= {f"value.{n}": p.numel() for n, p in value.named_parameters()}
    return numels


def _find(state: dict[str, Any], key: str) -> Any:
    """``state[key]``, or found in a dict nested in ``state``: bitsandbytes' own
    ``state_dict()`` nests its quantization state one level down."""
    if key in state:
        return state[key]
    for value in state.values():
        if isinstance(value, dict):
            try:
                return _find(value, key)
            except KeyError:
                pass
    raise KeyError(key)


def _losses(run: TuneRun, steps: range) -> list[float]:
    return [run.metrics[step]["loss"] for step in steps]


def test_shipped_in_backward_configs_are_found_for_recipes_of_this_tree() -> None:
    assert SHIPPED, "no shipped config of this tree's recipes sets optimizer_in_bwd"
    for config in SHIPPED:
        assert (REPO_ROOT / "recipes" / config.recipe_file).is_file(), config
        assert config.path.is_file(), config
    assert RESUME_SUBSET


def test_tiny_model_has_parameters_large_enough_for_8bit_optimizer_state(
    tiny_assets: TinyAssets,
) -> None:
    import bitsandbytes as bnb

    min_8bit_size = (
        inspect.signature(bnb.optim.AdamW8bit).parameters["min_8bit_size"].default
    )
    assert max(_tiny_param_numels(tiny_assets).values()) >= min_8bit_size


@pytest.mark.parametrize("config", SHIPPED, ids=str)
def test_shipped_config_trains_in_backward_on_cpu(
    config: ShippedConfig, run_once: Callable[..., TuneRun], tiny_assets: TinyAssets
) -> None:
    from safetensors.torch import load_file

    run = _shipped_run(run_once, config)
    assert sorted(run.metrics) == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    for values in run.metrics.values():
        assert {"loss", "lr", "grad_norm"} <= set(values)
        assert math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])

    # The weights trained, in the config's dtype.
    (shard,) = (run.output_dir / "epoch_1").glob("*.safetensors")
    trained = load_file(shard)
    original = load_file(tiny_assets.checkpoint_dir / tiny_assets.checkpoint_files[0])
    assert {t.dtype for t in trained.values()} == {config.dtype}
    assert any(
        not torch.equal(trained[k], original[k].to(config.dtype)) for k in original
    ), "no weight changed"

    # The saved optimizer state is the config's own: 8-bit for each parameter the
    # optimizer keeps in 8 bits, so an 8-bit config really ran its 8-bit path.
    numels = _tiny_param_numels(tiny_assets, config)
    final = run.output_dir / f"step_{2 * STEPS_PER_EPOCH}"
    saved = as_indexed(full_optimizer_state(final))
    (group,) = saved["param_groups"]
    # Saved in the model's parameter order (names may carry activation checkpointing's
    # wrapper prefix).
    names = dict(zip(group["params"], numels, strict=True))
    state1_dtypes = {
        names[index]: _find(state, "state1").dtype
        for index, state in saved["state"].items()
    }
    assert set(state1_dtypes) == set(numels)
    expected = {
        name: torch.uint8 if _makes_8bit_state(config, n) else torch.float32
        for name, n in numels.items()
    }
    assert state1_dtypes == expected


@pytest.mark.parametrize("config", RESUME_SUBSET, ids=str)
def test_in_backward_resume_as_shipped_gives_the_uninterrupted_losses_bitwise(
    config: ShippedConfig, run_once: Callable[..., TuneRun]
) -> None:
    uninterrupted = _shipped_run(run_once, config)
    resumed = run_once(config, "shipped_resumed", resume_from="shipped")
    assert sorted(resumed.metrics) == list(EPOCH_1)
    # Same mode, same dtype, same kernels: bitwise (module docstring).
    assert_close(_losses(resumed, EPOCH_1), _losses(uninterrupted, EPOCH_1), **BITWISE)


@pytest.mark.parametrize("config", RESUME_SUBSET, ids=str)
@pytest.mark.parametrize("source,target", [("plain", "bwd"), ("bwd", "plain")])
def test_resume_switching_mode_in_fp32_gives_the_uninterrupted_losses(
    config: ShippedConfig,
    source: str,
    target: str,
    run_once: Callable[..., TuneRun],
) -> None:
    runs = _fp32_runs(run_once, config)
    uninterrupted, resumed = runs[source], runs[f"{source}_to_{target}"]
    assert sorted(resumed.metrics) == list(EPOCH_1)
    # Plain vs in-backward rounding only (module docstring).
    assert_close(
        _losses(resumed, EPOCH_1), _losses(uninterrupted, EPOCH_1), **FP32_MODE_SWITCH
    )


@pytest.mark.parametrize("config", RESUME_SUBSET, ids=str)
def test_step_checkpoint_resume_mid_epoch_as_shipped_gives_the_losses_bitwise(
    config: ShippedConfig,
    run_once: Callable[..., TuneRun],
    tmp_path: Path,
    tiny_assets: TinyAssets,
) -> None:
    # What an interrupted one-epoch run of the shipped config needs: step checkpoints.
    saving = run_once(config, "shipped_steps", save_every_n_steps=2)
    # Saving changes nothing in training.
    all_steps = range(1, 2 * STEPS_PER_EPOCH + 1)
    assert_close(
        _losses(saving, all_steps),
        _losses(_shipped_run(run_once, config), all_steps),
        **BITWISE,
    )
    # Step 4 is mid-epoch 1; the resumed run finds it with no file named.
    shutil.copytree(saving.output_dir / "step_4", tmp_path / "step_4")
    resumed = _run(
        config,
        _overrides(
            tiny_assets, config, save_every_n_steps=2, resume_from_checkpoint=True
        ),
        tmp_path,
    )
    after = range(5, 2 * STEPS_PER_EPOCH + 1)
    assert sorted(resumed.metrics) == list(after)
    # Same mode, same dtype, same kernels (bitsandbytes' state restored as saved).
    assert_close(_losses(resumed, after), _losses(saving, after), **BITWISE)
