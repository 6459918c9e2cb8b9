"""``lora_finetune_distributed`` on CPU with gloo.

Every claim is an equivalence between runs of the tiny LoRA Llama2 on the same seed
and data (``tests/recipes/configs/tiny_lora_distributed.yaml``, 2 epochs of
``STEPS`` steps):

- 2 processes, in-backward vs plain: the same losses and grad norms at every step;
- 1 process vs 2 at the same global batch (8 samples a step; the 1-process run gets
  them as 2 accumulated batches of 4, and clips at a norm it never reaches);
- resumed from the step checkpoint of epoch 0's end vs uninterrupted, switching
  mode both ways (plain -> in-backward, in-backward -> plain), and from one written
  in the background (``enable_async_checkpointing``);
- with 1 process, where the gathered "full" weights are the live shards, saving a
  checkpoint leaves the model as it was (0.6.1 merged the adapter into it).

The 2-process runs are ``tune run`` on processes forked from a preloaded server
(``run_tune_forked``: real processes, with what torchrun gives each rank, without an
interpreter start and imports per run); the 1-process run builds the recipe in this
process (a 1-rank gloo group), which lets the test look at the model after a save.
Runs are module-scoped and shared between tests.

Each comparison names the exact steps it compares and checks that each run logged
exactly those; besides loss, grad norm and lr at every one of them it compares the
final adapters the runs wrote, which hold the last step's update too.

Tolerances, from the arithmetic; each is about ten times the largest difference
measured on this project's x86 CPU (``assert_series_close`` and
``assert_weights_close`` print it), given in brackets beside it as
[loss, grad_norm relative; adapter absolute]:

- ``BITWISE``: the same kernels on the same values in the same process layout. The
  first step of a resumed run computes the loss of the weights the uninterrupted
  run had at that step (exact fp32 adapter, unchanged base weights), so it must
  agree bitwise; learning rates come from the same scheduler arithmetic.
- ``ACROSS_MODES``: in-backward and plain multiply the same gradients by the same
  ``world_size / tokens`` and clip them by the same norm with the same operations
  (inside backward, or after it), so they agree bitwise, and so do resumes that
  switch modes. Every run clips at ``CLIP``, which the adapters' grad norm crosses
  (the parity test checks that some steps clip and some do not).
- ``ACROSS_LAYOUTS``: 1 process pads each batch of 4 to its own longest sample and
  accumulates two of them, 2 processes reduce-scatter partial sums: matmuls block
  differently and reductions add in another order, a few ulps per op, amplified a
  little by each update.

What the tolerances must catch is far larger: 0.6.1's epoch-end merge into the
live weights moves the 1-process loss of the next step by 1.2e-2 relative, and a
normalization off by the token count or the world size moves ``grad_norm`` by that
factor (AdamW hides it in the losses, not in the norm).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from tests.assets.make_assets import TinyAssets
from tests.helpers import BITWISE
from tests.recipes.utils import (
    BITWISE_TRAINING,
    DISK_LOGGER,
    TuneRun,
    assert_same_training,
    assert_series_close,
    assert_steps,
    assert_trains_as_plain,
    format_override,
    load_recipe_class,
    load_weights,
    read_run,
    run_tune_forked,
    series,
    tiny_config,
    tolerances,
)
from tests.torchtune.distributed_launcher import free_port

pytestmark = pytest.mark.integration_test

RECIPE = "lora_finetune_distributed"
RECIPE_CLASS = "LoRAFinetuneRecipeDistributed"
CONFIG = tiny_config("tiny_lora_distributed")
EPOCHS, STEPS = 2, 3
ALL_STEPS = range(1, EPOCHS * STEPS + 1)
EPOCH_1 = range(STEPS + 1, EPOCHS * STEPS + 1)
TIMEOUT_S = 240  # a collective reached by only some ranks hangs: fail instead

# The grad norm every run clips at: the tiny adapters' norms cross it.
CLIP = 1.0
# Tolerances for the loss, the grad norm and the final adapter (module docstring):
# rtol for the loss and the grad norm, atol for the adapter (0: bitwise).
# In brackets: the measured [loss, grad_norm relative; adapter absolute] difference.
ACROSS_MODES = BITWISE_TRAINING
# 1 process (plain, 2 x 4 accumulated) against 2 processes, plain and in-backward.
ACROSS_LAYOUTS = tolerances(1e-6, 1.2e-6, 7e-7)  # [1.0e-7, 1.2e-7; 7.1e-8]
ACROSS_MODES_AND_LAYOUTS = ACROSS_LAYOUTS
# The three steps after a resume from epoch 0 in the other mode.
RESUMED_ACROSS_MODES = BITWISE_TRAINING


def _overrides(assets: TinyAssets, optimizer_in_bwd: bool, **extra: Any) -> dict:
    return {
        "assets_dir": assets.root,
        "epochs": EPOCHS,
        "max_steps_per_epoch": STEPS,
        "optimizer_in_bwd": optimizer_in_bwd,
        "clip_grad_norm": CLIP,
        **extra,
    }


def _train(out: Path, assets: TinyAssets, optimizer_in_bwd: bool, **extra) -> TuneRun:
    return run_tune_forked(
        RECIPE,
        CONFIG,
        _overrides(assets, optimizer_in_bwd, **extra),
        nproc=2,
        output_dir=out,
        timeout=TIMEOUT_S,
    )


# The source runs of the resumes keep the step checkpoint of every epoch's end (by
# default only the newest one stays).
KEEP_EPOCH_STEPS = {"checkpointer.keep_last_n_checkpoints": EPOCHS}


def _copy_epoch_0(source: TuneRun, out: Path) -> None:
    """Copy into ``out`` what ``source``'s epoch 0 left: its export and manifest, the
    step checkpoint of its end (which holds the adapter) and the run's id."""
    for part in ("epoch_0", f"step_{STEPS}"):
        shutil.copytree(source.output_dir / part, out / part)
    for name in ("torchtune_run.json", ".epoch_0.manifest.json"):
        shutil.copy(source.output_dir / name, out / name)


def _resume(source: TuneRun, out: Path, assets: TinyAssets, optimizer_in_bwd: bool):
    """Resume ``source`` from the step checkpoint of epoch 0's end, in a fresh
    output_dir that holds only what epoch 0 left, as torchtune 0.6.1's docs say to:
    the adapter checkpoint pointed at epoch_0/."""
    _copy_epoch_0(source, out)
    docs = {"checkpointer.adapter_checkpoint": "epoch_0/adapter_model.pt"}
    run = _train(out, assets, optimizer_in_bwd, resume_from_checkpoint=True, **docs)
    assert_steps(run, EPOCH_1)
    return run


def _final_adapter(run: TuneRun) -> dict[str, torch.Tensor]:
    """The adapter of ``run``'s last checkpoint, written when it finished."""
    return load_weights(run.output_dir / f"epoch_{EPOCHS - 1}" / "adapter_model.pt")


def _local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's local shard (the whole tensor on 1 rank)."""
    return {
        name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp(RECIPE)


@pytest.fixture(scope="module")
def in_bwd(runs_dir: Path, tiny_assets: TinyAssets) -> TuneRun:
    """2 processes, in-backward; saves the adapter only (so the resume from it
    starts from an adapter-only checkpoint)."""
    return _train(
        runs_dir / "in_bwd",
        tiny_assets,
        True,
        save_adapter_weights_only=True,
        **KEEP_EPOCH_STEPS,
    )


@pytest.fixture(scope="module")
def plain(runs_dir: Path, tiny_assets: TinyAssets) -> TuneRun:
    """2 processes, plain optimizer; saves merged weights too."""
    return _train(runs_dir / "plain", tiny_assets, False, **KEEP_EPOCH_STEPS)


@pytest.fixture(scope="module")
def one_process(runs_dir: Path, tiny_assets: TinyAssets) -> dict[str, Any]:
    """1 process in this process: plain, 2 accumulated batches of 4 per step (the 8
    samples the 2 ranks read together), clipping as they do. After
    training, one more checkpoint save (the last epoch's, again), with the model
    compared before and after."""
    out = runs_dir / "one_process"
    overrides = _overrides(
        tiny_assets,
        False,
        gradient_accumulation_steps=2,
        output_dir=out,
        **{
            "metric_logger._component_": DISK_LOGGER,
            "metric_logger.log_dir": out / "logs",
            "metric_logger.filename": "metrics.txt",
        },
    )
    cfg = OmegaConf.merge(
        OmegaConf.load(CONFIG),
        OmegaConf.from_dotlist([format_override(k, v) for k, v in overrides.items()]),
    )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    # One thread, as torchrun gives each of its processes: on a busy machine, two
    # threads spinning on two cores run this tiny model several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        try:
            recipe = load_recipe_class(RECIPE, RECIPE_CLASS)(cfg)
            recipe.setup(cfg)
            # Around the last save: the step checkpoint and the gathered export.
            manager, seen = recipe._checkpoint, {}
            save = manager.save

            def last_save_seen(*, epoch_end: bool = False) -> None:
                done = recipe.progress.epochs_run == recipe.progress.total_epochs
                if done:
                    seen["before"] = _local_params(recipe._model)
                save(epoch_end=epoch_end)
                if done:
                    seen["after"] = _local_params(recipe._model)

            mp.setattr(manager, "save", last_save_seen)
            recipe.train()
            before, after = seen["before"], seen["after"]
            recipe.cleanup()
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            torch.set_num_threads(threads)
    return {"run": read_run(out), "before": before, "after": after}


def test_in_backward_matches_plain_on_two_processes(
    in_bwd: TuneRun, plain: TuneRun
) -> None:
    norms = series(plain, "grad_norm", ALL_STEPS)
    assert (norms > CLIP).any() and (norms < CLIP).any(), norms
    assert_trains_as_plain(
        in_bwd, plain, ACROSS_MODES, ALL_STEPS, final_weights=_final_adapter
    )
    for run in (in_bwd, plain):
        for values in run.metrics.values():
            assert {"loss", "lr", "tokens_per_second_per_gpu", "grad_norm"} <= set(
                values
            )
    # Adapter-only checkpoints hold no merged weights; the others do.
    assert not list((in_bwd.output_dir / "epoch_1").glob("model-*.safetensors"))
    assert list((plain.output_dir / "epoch_1").glob("model-*.safetensors"))


def test_one_process_matches_two_at_the_same_global_batch(
    one_process: dict[str, Any], plain: TuneRun, in_bwd: TuneRun
) -> None:
    # Epoch 1 also follows an epoch-0 save, which 0.6.1 corrupted on 1 process only.
    assert_same_training(
        one_process["run"],
        plain,
        ACROSS_LAYOUTS,
        ALL_STEPS,
        final_weights=_final_adapter,
    )
    assert_same_training(
        one_process["run"],
        in_bwd,
        ACROSS_MODES_AND_LAYOUTS,
        ALL_STEPS,
        final_weights=_final_adapter,
    )


def test_saving_a_checkpoint_on_one_process_leaves_the_model_unchanged(
    one_process: dict[str, Any], tiny_assets: TinyAssets
) -> None:
    before, after = one_process["before"], one_process["after"]
    # A trained adapter: merging a fresh one (lora_b = 0) would add nothing.
    lora_b = [v for k, v in before.items() if "lora_b" in k]
    # q, v and output projections and the MLP's w1, w2, w3, in each layer.
    assert len(lora_b) == 6 * tiny_assets.model_kwargs["num_layers"]
    assert all(v.abs().max() > 0 for v in lora_b)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"saving changed {changed}"
    out = one_process["run"].output_dir
    assert (out / "epoch_0" / "adapter_model.pt").is_file()
    assert (out / f"epoch_{EPOCHS - 1}" / "adapter_model.pt").is_file()


@pytest.mark.parametrize(
    "target_in_bwd", [True, False], ids=["plain_to_bwd", "bwd_to_plain"]
)
def test_resume_switching_mode_equals_uninterrupted_run(
    target_in_bwd: bool,
    in_bwd: TuneRun,
    plain: TuneRun,
    runs_dir: Path,
    tiny_assets: TinyAssets,
) -> None:
    # Resume each run in the other mode.
    source = plain if target_in_bwd else in_bwd
    resumed = _resume(
        source, runs_dir / f"resumed_{target_in_bwd}", tiny_assets, target_in_bwd
    )
    # The first step's forward runs on the weights the uninterrupted run had.
    assert_series_close(resumed, source, "loss", EPOCH_1[:1], **BITWISE)
    assert_same_training(
        resumed,
        source,
        RESUMED_ACROSS_MODES,
        EPOCH_1,
        reference_steps=ALL_STEPS,
        final_weights=_final_adapter,
    )


def test_asynchronous_epoch_checkpoint_resumes_to_the_uninterrupted_run(
    in_bwd: TuneRun, runs_dir: Path, tiny_assets: TinyAssets
) -> None:
    # Epoch 0's step checkpoint is written in the background, every rank its shards
    # (a distributed checkpoint); the exports are as without it.
    run = _train(
        runs_dir / "async",
        tiny_assets,
        True,
        enable_async_checkpointing=True,
        **KEEP_EPOCH_STEPS,
    )
    assert (run.output_dir / f"step_{STEPS}" / ".metadata").is_file()
    assert not list(run.output_dir.glob("dist_epoch_*"))
    assert (run.output_dir / "epoch_0" / "adapter_model.pt").is_file()
    assert list((run.output_dir / "epoch_1").glob("model-*.safetensors"))
    # Saving in the background leaves training as it was.
    assert_same_training(
        run,
        in_bwd,
        BITWISE_TRAINING,
        ALL_STEPS,
        final_weights=_final_adapter,
    )

    out = runs_dir / "async_resumed"
    _copy_epoch_0(run, out)
    resumed = _train(
        out,
        tiny_assets,
        True,
        enable_async_checkpointing=True,
        resume_from_checkpoint=True,
    )
    assert_same_training(
        resumed,
        run,
        BITWISE_TRAINING,
        EPOCH_1,
        reference_steps=ALL_STEPS,
        final_weights=_final_adapter,
    )
