"""Every recipe refuses the options they share the same way: with the same message,
in ``__init__``, before anything is built or written.

The options are read and checked once, by ``training.RecipeOptions`` and
``training.CheckpointManager``; this test proves that each of the eight recipes
really goes through them first, for every shared refusal, on its own tiny config.
A refused run must leave ``output_dir`` (and a checkpoint already in it) as it was,
and must not have started a process group.

Resuming is checked there too: a resume with nothing to resume from, naming a step
checkpoint that does not exist, or with another optimizer class than the
checkpoint's, and an output folder that cannot be written.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from tests.helpers import snapshot_files
from tests.recipes.utils import held_by_another_process, load_recipe_class, tiny_config

pytestmark = pytest.mark.integration_test

# recipe file (under recipes/) -> (class, tiny config)
RECIPES = {
    "full_finetune_single_device": (
        "FullFinetuneRecipeSingleDevice",
        "tiny_full_single_device",
    ),
    "full_finetune_distributed": (
        "FullFinetuneRecipeDistributed",
        "tiny_full_distributed",
    ),
    "lora_finetune_single_device": (
        "LoRAFinetuneRecipeSingleDevice",
        "tiny_lora_single_device",
    ),
    "lora_finetune_distributed": (
        "LoRAFinetuneRecipeDistributed",
        "tiny_lora_distributed",
    ),
    "full_dpo_distributed": ("FullDPORecipeDistributed", "tiny_full_dpo_distributed"),
    "ppo_full_finetune_single_device": (
        "PPOFullFinetuneRecipeSingleDevice",
        "tiny_ppo_single_device",
    ),
    "qat_distributed": ("QATRecipeDistributed", "tiny_qat_distributed"),
    "dev/early_exit_finetune_distributed": (
        "EarlyExitFinetuneRecipeDistributed",
        "tiny_early_exit_distributed",
    ),
}
DISTRIBUTED = {name for name in RECIPES if "distributed" in name}

IN_BWD = {"optimizer_in_bwd": True}
# name -> (overrides, exception type, the whole message)
REFUSALS = {
    "optimizer_in_bwd is a string": (
        {"optimizer_in_bwd": "False"},
        ValueError,
        "optimizer_in_bwd='False' is not a bool: set optimizer_in_bwd=True or "
        "optimizer_in_bwd=False.",
    ),
    "optimizer_in_bwd is a number": (
        {"optimizer_in_bwd": 2},
        ValueError,
        "optimizer_in_bwd=2 is not a bool: set optimizer_in_bwd=True or "
        "optimizer_in_bwd=False.",
    ),
    "in-backward clipping with activation offloading": (
        IN_BWD
        | {
            "clip_grad_norm": 1.0,
            "enable_activation_checkpointing": True,
            "enable_activation_offloading": True,
        },
        ValueError,
        "optimizer_in_bwd=True with clip_grad_norm=1.0 cannot be combined with "
        "enable_activation_offloading=True: clipping runs backward twice, and "
        "offloading frees activations after the first. Set "
        "enable_activation_offloading=False, clip_grad_norm=null, or "
        "optimizer_in_bwd=False.",
    ),
    "in-backward with gradient accumulation": (
        IN_BWD | {"gradient_accumulation_steps": 4},
        ValueError,
        "optimizer_in_bwd=True cannot be combined with gradient_accumulation_steps=4: "
        "each gradient is used as soon as it is ready. Set "
        "gradient_accumulation_steps=1 or optimizer_in_bwd=False.",
    ),
    "in-backward with a compiled optimizer step": (
        IN_BWD | {"compile": {"optimizer_step": True}},
        ValueError,
        "optimizer_in_bwd=True cannot be combined with compile.optimizer_step=True: "
        "in-backward updates run inside autograd hooks, not in one step. Set "
        "compile.optimizer_step=False or optimizer_in_bwd=False.",
    ),
    "a negative bucket cap": (
        IN_BWD | {"optimizer_in_bwd_bucket_cap_mb": -1},
        ValueError,
        "optimizer_in_bwd_bucket_cap_mb=-1 is not a finite number >= 0: set it to the "
        "MiB of gradients per update (0: each parameter on its own), or leave it unset "
        "for the default.",
    ),
    "an infinite bucket cap": (
        IN_BWD | {"optimizer_in_bwd_bucket_cap_mb": float("inf")},
        ValueError,
        "optimizer_in_bwd_bucket_cap_mb=inf is not a finite number >= 0: set it to ",
    ),
    "LBFGS, which needs a closure": (
        {"optimizer": {"_component_": "torch.optim.LBFGS"}},
        ValueError,
        "optimizer._component_=torch.optim.LBFGS cannot be used: its step() needs a "
        "closure, and the recipes run one forward and backward per step. Use an "
        "optimizer that steps without one, e.g. torch.optim.AdamW.",
    ),
    "SparseAdam, which needs sparse gradients": (
        {"optimizer": {"_component_": "torch.optim.SparseAdam"}},
        ValueError,
        "optimizer._component_=torch.optim.SparseAdam cannot be used: it needs sparse "
        "gradients, and these models' gradients are dense. Use torch.optim.Adam or "
        "torch.optim.AdamW.",
    ),
    "torchao's CPUOffloadOptimizer in backward": (
        IN_BWD | {"optimizer": {"_component_": "torchao.optim.CPUOffloadOptimizer"}},
        ValueError,
        "optimizer._component_=torchao.optim.CPUOffloadOptimizer cannot be combined "
        "with optimizer_in_bwd=True: it already updates each parameter in gradient "
        "hooks of its own. Set optimizer_in_bwd=False, or use another optimizer.",
    ),
    "a resume with nothing to resume from": (
        {"resume_from_checkpoint": True},
        ValueError,
        "resume_from_checkpoint=True, but there is nothing to resume from: no whole "
        "step checkpoint (step_N/) of this run in output_dir=",
    ),
    "a resume from a step checkpoint that does not exist": (
        {
            "resume_from_checkpoint": True,
            "checkpointer": {"recipe_checkpoint": "step_9/recipe_state.pt"},
        },
        ValueError,
        "checkpointer.recipe_checkpoint=step_9/recipe_state.pt names the step "
        "checkpoint ",
    ),
    "fp16": (
        {"dtype": "fp16"},
        ValueError,
        "dtype=fp16 is not supported: the recipes do no loss scaling, which fp16 "
        "training needs. Set dtype=bf16 or dtype=fp32.",
    ),
    "activation offloading on CPU": (
        {"enable_activation_offloading": True, "enable_activation_checkpointing": True},
        RuntimeError,
        "enable_activation_offloading=True needs a CUDA device, got device=cpu. Set "
        "enable_activation_offloading=False.",
    ),
    "another profiler": (
        {"profiler": {"_component_": "torch.profiler.profile", "enabled": True}},
        ValueError,
        "profiler._component_=torch.profiler.profile is not supported: the recipe "
        "reads its settings back from what torchtune.training.setup_torch_profiler "
        "returns. Set profiler._component_=torchtune.training.setup_torch_profiler, "
        "or null for the same.",
    ),
    "a step checkpoint interval of 0": (
        {"save_every_n_steps": 0},
        ValueError,
        "save_every_n_steps=0 must be a positive integer or null (null: save at "
        "epoch ends only)",
    ),
    "a negative number of step checkpoints to keep": (
        {"save_every_n_steps": 2, "checkpointer": {"keep_last_n_checkpoints": -1}},
        ValueError,
        "checkpointer.keep_last_n_checkpoints=-1 must be a positive integer or null "
        "(null: keep all)",
    ),
    "a count given as a string": (
        {"epochs": "2"},
        ValueError,
        "epochs='2' is not a positive integer: set epochs to a whole number >= 1.",
    ),
    "a batch size of 0": (
        {"batch_size": 0},
        ValueError,
        "batch_size=0 is not a positive integer: set batch_size to a whole number >= 1.",
    ),
    "no step in an epoch": (
        {"max_steps_per_epoch": 0},
        ValueError,
        "max_steps_per_epoch=0 is not a positive integer: set max_steps_per_epoch to "
        "a whole number >= 1 or null (no limit).",
    ),
}
# Refused by the distributed recipes only (FSDP2).
FSDP_REFUSALS = {
    "bitsandbytes under FSDP2": (
        {"optimizer": {"_component_": "bitsandbytes.optim.PagedAdamW8bit"}},
        ValueError,
        "optimizer._component_=bitsandbytes.optim.PagedAdamW8bit cannot train a "
        "model sharded with FSDP2: bitsandbytes' update kernels take plain tensors, "
        "not FSDP2's DTensors. Use torch.optim.AdamW or torchao.optim._AdamW "
        "(low-bit state: torchao.optim.AdamW8bit), or this optimizer in a "
        "single-device recipe.",
    ),
    "torchao's low-bit state saved asynchronously": (
        {
            "optimizer": {"_component_": "torchao.optim.AdamW8bit"},
            "enable_async_checkpointing": True,
        },
        ValueError,
        "optimizer._component_=torchao.optim.AdamW8bit cannot be combined with "
        "enable_async_checkpointing=True under FSDP2: an asynchronous save cannot "
        "copy its quantized state. Set enable_async_checkpointing=False, or use "
        "torch.optim.AdamW.",
    ),
}


def build(recipe: str, cfg: DictConfig) -> object:
    """The installed recipe file's class (recipes are files, not a package), built."""
    return load_recipe_class(recipe, RECIPES[recipe][0])(cfg)


def assert_refused_first(
    recipe: str,
    cfg: DictConfig,
    out: Path,
    error: type[Exception],
    message: str,
    *,
    whole: bool = True,
) -> None:
    """Building ``recipe`` from ``cfg`` raises ``error`` with ``message`` (the whole
    message, or with ``whole=False`` its start), leaving ``out`` as it was and no
    process group started."""
    before = snapshot_files(out)
    with pytest.raises(error, match=f"^{re.escape(message)}{'$' if whole else ''}"):
        build(recipe, cfg)
    assert snapshot_files(out) == before
    assert not torch.distributed.is_initialized()


def _refused(recipe: str, overrides: dict, tmp_path: Path) -> tuple[Path, dict]:
    cfg = OmegaConf.load(tiny_config(RECIPES[recipe][1]))
    cfg.assets_dir = str(tmp_path / "assets")  # never read: nothing is built
    out = tmp_path / "out"
    (out / "epoch_0").mkdir(parents=True)
    (out / "epoch_0" / "model.pt").write_bytes(b"a finished run's checkpoint")
    cfg.output_dir = str(out)
    cfg.device = "cpu"
    cfg.merge_with(OmegaConf.create(overrides))
    return out, cfg


CASES = [
    pytest.param(recipe, *REFUSALS[name], id=f"{recipe}: {name}")
    for recipe in RECIPES
    for name in REFUSALS
] + [
    pytest.param(recipe, *FSDP_REFUSALS[name], id=f"{recipe}: {name}")
    for recipe in sorted(DISTRIBUTED)
    for name in FSDP_REFUSALS
]


@pytest.mark.parametrize(("recipe", "overrides", "error", "message"), CASES)
def test_every_recipe_refuses_a_shared_option_first_with_one_message(
    recipe: str,
    overrides: dict,
    error: type[Exception],
    message: str,
    tmp_path: Path,
) -> None:
    out, cfg = _refused(recipe, overrides, tmp_path)
    assert_refused_first(recipe, cfg, out, error, message, whole=False)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_null_profiler_component_means_the_torch_profiler(
    recipe: str, tmp_path: Path
) -> None:
    # As in 0.6.1: null (or no _component_) is setup_torch_profiler; a refused
    # config proves the check ran and passed the profiler section.
    out, cfg = _refused(
        recipe,
        {"profiler": {"_component_": None, "enabled": True}, "dtype": "fp16"},
        tmp_path,
    )
    with pytest.raises(ValueError, match="^dtype=fp16 is not supported"):
        build(recipe, cfg)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_refuses_to_resume_another_optimizers_state_first(
    recipe: str, tmp_path: Path
) -> None:
    out, cfg = _refused(
        recipe,
        {
            "resume_from_checkpoint": True,
            "optimizer": {"_component_": "torch.optim.AdamW"},
        },
        tmp_path,
    )
    # A step checkpoint of a run that trained with SGD: only its recipe state and
    # manifest are read before refusing.
    step = out / "step_2"
    step.mkdir()
    torch.save(
        {"epochs_run": 0, "optimizer_component": "torch.optim.SGD"},
        step / "recipe_state.pt",
    )
    (step / "manifest.json").write_text(json.dumps({"version": 2, "files": {}}))
    message = (
        f"optimizer._component_=torch.optim.AdamW cannot resume from {step}: its "
        "optimizer state was saved by torch.optim.SGD. Set "
        "optimizer._component_=torch.optim.SGD to resume, or "
        "resume_from_checkpoint=False to start anew."
    )
    assert_refused_first(recipe, cfg, out, ValueError, message)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_refuses_an_output_dir_it_cannot_write_first(
    recipe: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, cfg = _refused(recipe, {}, tmp_path)
    # As a user without write permission sees it (this also runs as root, which
    # may write anywhere; the chmod test below needs a user that may not).
    real_access = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda path, mode, **kw: (
            not (mode & os.W_OK and Path(path) == out) and real_access(path, mode, **kw)
        ),
    )
    message = (
        f"output_dir={out} cannot be written: this process has no write permission "
        f"in {out}, so no checkpoint could be saved. Set output_dir to a folder this "
        f"run can write, or give it write permission (chmod u+w {out})."
    )
    assert_refused_first(recipe, cfg, out, PermissionError, message)


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes into a read-only folder all the same"
)
def test_a_read_only_output_dir_is_refused_before_anything_is_built(
    tmp_path: Path,
) -> None:
    out, cfg = _refused("full_finetune_single_device", {}, tmp_path)
    out.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match=f"^output_dir={re.escape(str(out))}"):
            build("full_finetune_single_device", cfg)
    finally:
        out.chmod(0o700)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("resume", [False, True])
def test_every_recipe_refuses_a_folder_another_live_run_holds_first(
    recipe: str, resume: bool, tmp_path: Path
) -> None:
    out, cfg = _refused(recipe, {"resume_from_checkpoint": resume}, tmp_path)
    # A live process of this host: this test's parent.
    owner = {"pid": os.getppid(), "host": socket.gethostname(), "started": "then"}
    (out / "torchtune_run.lock").write_text(json.dumps(owner))
    message = (
        f"output_dir={out} is in use by another run (process {os.getppid()} on host "
        f"{socket.gethostname()}, started then): two runs would overwrite each other's "
        "checkpoints. Wait for it to finish, stop it, or use another output_dir."
    )
    # Held as a live run holds it: an OS lock on the file.
    with held_by_another_process(out / "torchtune_run.lock"):
        assert_refused_first(recipe, cfg, out, ValueError, message)
