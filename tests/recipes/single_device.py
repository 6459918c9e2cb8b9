"""The runs the single-device recipe tests share: ``full_finetune_single_device`` and
``lora_finetune_single_device`` trained the same ways (AdamW + cosine warmup over
two epochs, four SGD steps, bf16), in each mode, and resumed from epoch 0.

Every run is ``tune run`` in this process (``run_tune_in_process``): it parses the
same command line and runs the same recipe file as ``tune run`` in a process of its
own, without paying ~15 s of imports a run (``test_harness_smoke.py`` shows the two
train alike, bitwise). :class:`Runs` makes each run on first use and keeps it, so a
test module makes each once.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.assets.make_assets import TinyAssets
from tests.recipes.utils import TuneRun, load_weights, run_tune_in_process, tiny_config

STEPS_PER_EPOCH = 3
ALL_STEPS = range(1, 2 * STEPS_PER_EPOCH + 1)
EPOCH_1 = range(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH + 1)
SGD_STEPS = range(1, 5)
BF16_STEPS_PER_EPOCH = 2
BF16_ALL_STEPS = range(1, 2 * BF16_STEPS_PER_EPOCH + 1)
BF16_EPOCH_1 = range(BF16_STEPS_PER_EPOCH + 1, 2 * BF16_STEPS_PER_EPOCH + 1)
SHARD = "model-00001-of-00001.safetensors"
# The source runs of the resumes keep the step checkpoint of every epoch's end (by
# default only the newest one stays).
KEEP_EPOCH_STEPS = {"checkpointer.keep_last_n_checkpoints": 2}


@dataclass(frozen=True)
class Recipe:
    """A single-device recipe and how its tests train it.

    Attributes:
        name (str): the recipe, as ``tune run`` names it.
        config (Path): its tiny config.
        clip (float): the grad norm its AdamW and SGD runs clip at: the tiny model's
            norms cross it.
        sgd_lr (float): the SGD runs' learning rate.
        trained_file (str): the file of an epoch's export that holds what trains
            (the model, or the adapter).
        bwd_settings (dict[str, Any]): what the in-backward AdamW run sets besides.
        epoch_0_parts (tuple[str, ...]): what a resume copies of epoch 0 (with the
            step checkpoint of its end, ``step``).
    """

    name: str
    config: Path
    clip: float
    sgd_lr: float
    trained_file: str
    bwd_settings: dict[str, Any] = field(default_factory=dict)
    epoch_0_parts: tuple[str, ...] = ("step",)

    def run(self, config: Path, overrides: dict[str, Any], out: Path) -> TuneRun:
        """``tune run`` of this recipe with ``config`` and ``overrides``, here."""
        return run_tune_in_process(self.name, config, overrides, out)

    def trained(self, run: TuneRun, epoch: int = 1) -> dict[str, torch.Tensor]:
        """What ``run`` trained, as its export of ``epoch`` holds it."""
        return load_weights(run.output_dir / f"epoch_{epoch}" / self.trained_file)

    def copy_epoch_0(self, run: TuneRun, out: Path, steps_per_epoch: int) -> None:
        """Copy into a fresh ``out`` what a resume from ``run``'s epoch 0 needs."""
        for part in self.epoch_0_parts:
            name = f"step_{steps_per_epoch}" if part == "step" else part
            source = run.output_dir / name
            if source.is_dir():
                shutil.copytree(source, out / name)
            else:
                shutil.copy(source, out / name)


FULL = Recipe(
    "full_finetune_single_device",
    tiny_config("tiny_full_single_device"),
    clip=4.0,
    sgd_lr=0.2,
    trained_file=SHARD,
)
LORA = Recipe(
    "lora_finetune_single_device",
    tiny_config("tiny_lora_single_device"),
    clip=0.8,
    sgd_lr=0.5,
    trained_file="adapter_model.pt",
    # The plain run saves merged weights too; the in-backward run saves the adapter
    # only, so the in-backward resumes start from adapter-only checkpoints.
    bwd_settings={"save_adapter_weights_only": True},
    # A LoRA step checkpoint holds the adapter: the export and the run's id too.
    epoch_0_parts=("epoch_0", "step", "torchtune_run.json"),
)


def mode_name(optimizer_in_bwd: bool) -> str:
    return "bwd" if optimizer_in_bwd else "plain"


class Runs:
    """A recipe's shared runs, each made on first use (module docstring)."""

    def __init__(
        self,
        recipe: Recipe,
        assets: TinyAssets,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> None:
        self.recipe = recipe
        self._assets = assets
        self._mktemp: Callable[[str], Path] = tmp_path_factory.mktemp
        self._resumed: dict[tuple[str, str], TuneRun] = {}

    def modes(self, optimizer_in_bwd: bool, *, clip: bool = True) -> dict[str, Any]:
        """The mode's settings, clipping at the recipe's ``clip`` or not at all."""
        return {
            "optimizer_in_bwd": optimizer_in_bwd,
            "clip_grad_norm": self.recipe.clip if clip else None,
        }

    def _adamw_settings(self) -> dict[str, Any]:
        return {
            "assets_dir": self._assets.root,
            "epochs": 2,
            "max_steps_per_epoch": STEPS_PER_EPOCH,
        }

    def resume_settings(self, target: str) -> dict[str, Any]:
        """The AdamW runs' settings, resuming, in mode ``target``."""
        return (
            self._adamw_settings()
            | {"resume_from_checkpoint": True}
            | self.modes(target == "bwd")
        )

    @cached_property
    def adamw(self) -> dict[str, TuneRun]:
        """Two epochs of AdamW + cosine warmup (the tiny config's), in each mode,
        keeping epoch 0's step checkpoint, for the resumes."""
        settings = self._adamw_settings() | KEEP_EPOCH_STEPS
        recipe = self.recipe
        return {
            "plain": recipe.run(
                recipe.config,
                settings | self.modes(False),
                self._mktemp("adamw_plain"),
            ),
            "bwd": recipe.run(
                recipe.config,
                settings | self.modes(True) | recipe.bwd_settings,
                self._mktemp("adamw_bwd"),
            ),
        }

    @cached_property
    def sgd(self) -> dict[str, TuneRun]:
        """Four steps of SGD with momentum and no LR scheduler, in each mode.

        SGD's update is proportional to the gradient, so a wrong loss normalization
        shows (AdamW's barely does). The plain run accumulates two batches of 4 per
        step and clips at a norm it never reaches, so it also checks that
        accumulation normalizes over the whole step's tokens: a step sees the same 8
        examples, in the same order, in both runs. The in-backward run asks for peak
        memory stats, which are skipped on CPU without failing.
        """
        from omegaconf import OmegaConf

        # `tune run` cannot remove a component from the command line: write a
        # config without lr_scheduler.
        cfg = OmegaConf.load(self.recipe.config)
        del cfg["lr_scheduler"]
        cfg.optimizer = {
            "_component_": "torch.optim.SGD",
            "lr": self.recipe.sgd_lr,
            "momentum": 0.9,
        }
        config = self._mktemp("sgd_config") / "tiny_sgd.yaml"
        OmegaConf.save(cfg, config)
        common = {
            "assets_dir": self._assets.root,
            "epochs": 1,
            "max_steps_per_epoch": 4,
        }
        plain = {
            "optimizer_in_bwd": False,
            "batch_size": 4,
            "gradient_accumulation_steps": 2,
            "clip_grad_norm": self.recipe.clip,
        }
        bwd = {"batch_size": 8, "log_peak_memory_stats": True, **self.modes(True)}
        return {
            mode: self.recipe.run(
                config, common | settings, self._mktemp(f"sgd_{mode}")
            )
            for mode, settings in (("plain", plain), ("bwd", bwd))
        }

    def resumed(self, source: str, target: str) -> TuneRun:
        """The AdamW run of mode ``source`` resumed from epoch 0 in mode ``target``,
        in a fresh output_dir holding what epoch 0 left."""
        if (source, target) not in self._resumed:
            out = self._mktemp(f"resume_{source}_to_{target}")
            self.recipe.copy_epoch_0(self.adamw[source], out, STEPS_PER_EPOCH)
            self._resumed[source, target] = self.recipe.run(
                self.recipe.config, self.resume_settings(target), out
            )
        return self._resumed[source, target]

    @cached_property
    def bf16(self) -> dict[str, TuneRun]:
        """Two epochs of two AdamW steps in bf16, in each mode, and the in-backward
        run resumed in-backward from the step checkpoint of epoch 0's end."""
        settings = {
            "assets_dir": self._assets.root,
            "dtype": "bf16",
            "epochs": 2,
            "max_steps_per_epoch": BF16_STEPS_PER_EPOCH,
            **KEEP_EPOCH_STEPS,
        }
        recipe = self.recipe
        runs = {
            mode_name(bwd): recipe.run(
                recipe.config,
                settings | self.modes(bwd, clip=False),
                self._mktemp(f"bf16_{mode_name(bwd)}"),
            )
            for bwd in (False, True)
        }
        out = self._mktemp("bf16_resumed")
        recipe.copy_epoch_0(runs["bwd"], out, BF16_STEPS_PER_EPOCH)
        runs["resumed"] = recipe.run(
            recipe.config,
            settings | self.modes(True, clip=False) | {"resume_from_checkpoint": True},
            out,
        )
        return runs
