"""``full_finetune_distributed`` on CPU with 2 gloo processes.

Every claim is an equivalence between runs on the same seed and data:

- in-backward vs plain, 2 processes vs 1 at the same global batch;
- resumed vs uninterrupted, from the step checkpoint of an epoch's end, across
  modes each way and in each save mode: plain from an in-backward run's
  synchronous checkpoint, in-backward from a plain run's written in the background
  (``enable_async_checkpointing``); within a mode in bf16 and with torchao's
  optimizer (below), on 1 process with a partly frozen model;
- FSDP x tensor parallel on 4 processes, resumed from a torchtune 0.6.1 epoch
  checkpoint (a full one, which any process layout resumes) made of a 2-process
  FSDP run's, vs that run;
- resumed from a torchtune 0.6.1 in-backward checkpoint (made of this tree's step
  checkpoint, its optimizer state rewritten in 0.6.1's format) vs uninterrupted, in
  both modes;
- a partly frozen model: its checkpoint's optimizer state holds the parameters
  0.6.1's did, and resumes (from this tree's step checkpoint and from 0.6.1's
  format) as uninterrupted;
- torchao's 8-bit AdamW in-backward vs plain on 2 processes;
- bf16 on 2 processes: in-backward vs plain, and an in-backward resume vs
  uninterrupted.

Each comparison names the exact steps it compares and checks that each run logged
exactly those; it checks loss and grad_norm at every one of them, lr exactly, and
the final weights each run wrote: those hold the updates of the last steps too, so
a resume from epoch 1 is checked through both of its updates, not only through the
one its second loss shows. Runs are shared through module-scoped fixtures; every
run is configured for the same ``EPOCHS`` x ``STEPS`` (the cosine schedule depends
on the total) and keeps the step checkpoint of every epoch's end, and resumes start
from an epoch-0 or epoch-1 checkpoint.

The multi-process runs are ``tune run`` on processes forked from a preloaded server
(``run_tune_forked``: each rank a real process, with what torchrun gives it, without
an interpreter start and imports per run), the 1-process runs too.

Tolerances, from the arithmetic; each set is about ten times the largest difference
measured on this project's x86 CPU (``assert_series_close`` and
``assert_weights_close`` print it), given in brackets beside it as
[loss, grad_norm relative; weights absolute]:

- ``BITWISE_TRAINING``: the same kernels on the same values in the same process layout. A
  resumed run reloads exact weights and optimizer state (fp32 or bf16) and
  recomputes the lr from the step count, so it agrees bitwise [0].
- ``ACROSS_MODES``: in-backward and plain multiply the same gradients by the same
  ``world_size / tokens`` and clip them by the same norm with the same operations
  (inside backward, or after it), so they agree bitwise [0], in fp32 and in bf16,
  and so do resumes that switch modes.
- ``ACROSS_LAYOUTS``: 2 processes vs 1, or tensor parallel vs FSDP, add the same
  terms in another order (per-rank partial sums, reduce-scatter, row-split matmuls)
  and pad batches to other lengths, so kernels block differently: a few ulps per op.
- Two steps after a resume from epoch 1 the runs have had less time to drift apart,
  so those comparisons get their own, smaller, measured sets. Where a comparison
  across modes or layouts measured bitwise (some losses), it is checked bitwise:
  AdamW's update is a ratio of moments and hardly moves with a gradient's last ulp,
  so the weights under those losses differ by a few ulps that did not reach the
  logged loss. That is a measurement, not an identity of the arithmetic; should a
  change of kernels move such a loss by an ulp, the sibling set measured over more
  steps is the one to take.
- torchao's 8-bit AdamW: as across modes, bitwise: both modes quantize the same
  moments.

Clipping: the runs of ``_train`` and the bf16 runs clip at ``CLIP``, which the tiny
model's grad norm crosses (the parity tests check that some steps clip and some do
not); the torchao runs do not clip.

All of these stay far below what a real error gives. AdamW's update hardly depends
on the gradients' scale, so a wrong token normalization (or a missed world_size for
FSDP's average) shows in grad_norm, off by a factor, more than in the loss: hence
both are compared.
"""

from __future__ import annotations

import os
import shutil
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from tests.assets.make_assets import TinyAssets
from tests.helpers import BITWISE
from tests.recipes.partly_frozen_model import partly_frozen_llama2
from tests.recipes.utils import (
    BITWISE_TRAINING,
    TuneRun,
    as_0_6_1_in_backward,
    assert_same_training,
    assert_series_close,
    assert_steps,
    assert_trains_as_plain,
    assert_weights_close,
    full_optimizer_state,
    load_recipe_class,
    load_weights,
    read_run,
    run_tune_forked,
    series,
    tiny_config,
    tolerances,
)
from tests.torchtune.distributed_launcher import (
    run_distributed,
    write_report,
)

pytestmark = pytest.mark.integration_test

RECIPE = "full_finetune_distributed"
CONFIG = tiny_config("tiny_full_distributed")
EPOCHS, STEPS = 3, 2  # every run is configured for 3 epochs of 2 steps
ALL_STEPS = range(1, EPOCHS * STEPS + 1)
TIMEOUT_S = 240  # a collective reached by only some ranks hangs: fail instead

# Tolerances for the loss, the grad norm and the final weights (module docstring):
# rtol for the loss and the grad norm, atol for the weights (0: bitwise).
# In brackets: the measured [loss, grad_norm relative; weights absolute] difference.
ACROSS_MODES = BITWISE_TRAINING
ACROSS_LAYOUTS = tolerances(1.2e-6, 3.4e-6, 6e-7)  # [1.1e-7, 3.4e-7; 6.0e-8]
# Two steps after a resume from epoch 1.
RESUMED_ACROSS_MODES = BITWISE_TRAINING
# ... on one process, against the 2-process run.
RESUMED_ACROSS_MODES_AND_LAYOUTS = tolerances(1.2e-6, 2.3e-6, 8e-8)
# [1.1e-7, 2.3e-7; 7.5e-9]
# ... FSDP x tensor parallel on 4 processes, against the FSDP run.
RESUMED_ACROSS_LAYOUTS_2D = tolerances(1.2e-6, 1.5e-6, 4e-8)  # [1.1e-7, 1.5e-7; 3.7e-9]
# torchao's AdamW8bit, 4 steps; its weights are compared in norm (module docstring).
# bf16, 4 steps; its weights are compared in norm (module docstring).
# The grad norm the clipping runs clip at: the tiny model's norms cross it.
CLIP = 4.0
SHARD = "model-00001-of-00001.safetensors"
# Every run keeps the step checkpoint of every epoch's end (by default only the
# newest one stays), for the resumes.
KEEP_EPOCH_STEPS = {"checkpointer.keep_last_n_checkpoints": EPOCHS}


def _train(
    out: Path, assets: TinyAssets, *, nproc: int = 2, **overrides: Any
) -> TuneRun:
    base = {
        "assets_dir": assets.root,
        "epochs": EPOCHS,
        "max_steps_per_epoch": STEPS,
        "clip_grad_norm": CLIP,
        **KEEP_EPOCH_STEPS,
    }
    return run_tune_forked(
        RECIPE, CONFIG, base | overrides, nproc=nproc, output_dir=out, timeout=TIMEOUT_S
    )


def _resume(
    source: TuneRun, epoch: int, out: Path, assets: TinyAssets, **overrides: Any
) -> TuneRun:
    """Resume from the step checkpoint of ``source``'s ``epoch`` end, in a copy of
    its output_dir without the later step checkpoints: the newest one there."""
    later = [f"step_{(e + 1) * STEPS}" for e in range(epoch + 1, EPOCHS)]
    shutil.copytree(
        source.output_dir,
        out,
        ignore=shutil.ignore_patterns(".hf_datasets_cache", *later),
    )
    run = _train(out, assets, resume_from_checkpoint=True, **overrides)
    step_dir = out / f"step_{(epoch + 1) * STEPS}"
    assert f"Resumed from step checkpoint {step_dir}." in run.output
    assert list(run.metrics) == list(_steps_after(epoch)), run.metrics
    return run


def _train_one(out: Path, assets: TinyAssets, **overrides: Any) -> TuneRun:
    """``_train`` on one process: 1 process x 8 = 2 processes x 4, the same samples
    per step."""
    return _train(out, assets, nproc=1, batch_size=8, **overrides)


def _steps_after(epoch: int) -> range:
    return range((epoch + 1) * STEPS + 1, EPOCHS * STEPS + 1)


def _base_weights(assets: TinyAssets) -> dict[str, torch.Tensor]:
    """The weights every run starts from."""
    return load_weights(
        *(assets.checkpoint_dir / name for name in assets.checkpoint_files)
    )


def _final_weights(run: TuneRun) -> dict[str, torch.Tensor]:
    """The weights of ``run``'s last checkpoint, written when it finished."""
    return load_weights(run.output_dir / f"epoch_{EPOCHS - 1}" / SHARD)


def _epoch_1_weights(run: TuneRun) -> dict[str, torch.Tensor]:
    """The weights of ``run``'s epoch-1 checkpoint: the last of a 2-epoch run."""
    return load_weights(run.output_dir / "epoch_1" / SHARD)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("full_finetune_distributed")


@pytest.fixture(scope="module")
def in_bwd(runs_dir: Path, tiny_assets: TinyAssets) -> TuneRun:
    """The reference: in-backward, synchronous full checkpoints."""
    return _train(runs_dir / "in_bwd", tiny_assets, optimizer_in_bwd=True)


@pytest.fixture(scope="module")
def plain_async(runs_dir: Path, tiny_assets: TinyAssets) -> TuneRun:
    """Plain optimizer, step checkpoints written in the background."""
    return _train(
        runs_dir / "plain_async",
        tiny_assets,
        optimizer_in_bwd=False,
        enable_async_checkpointing=True,
    )


@pytest.fixture(scope="module")
def in_bwd_async_from_plain(
    plain_async: TuneRun, runs_dir: Path, tiny_assets: TinyAssets
) -> TuneRun:
    """In-backward, resumed from the plain run's epoch-0 step checkpoint; it saves
    its own (in-backward) ones in the background."""
    return _resume(
        plain_async,
        0,
        runs_dir / "in_bwd_async_from_plain",
        tiny_assets,
        optimizer_in_bwd=True,
        enable_async_checkpointing=True,
    )


def test_in_backward_matches_plain_on_two_processes(
    in_bwd: TuneRun, plain_async: TuneRun
) -> None:
    assert in_bwd.losses[-1] < in_bwd.losses[0]  # it learns
    _assert_clips_some_steps_only(plain_async, ALL_STEPS)
    assert_trains_as_plain(
        in_bwd, plain_async, ACROSS_MODES, ALL_STEPS, final_weights=_final_weights
    )


def _assert_clips_some_steps_only(run: TuneRun, steps: Iterable[int]) -> None:
    """The run's grad norm (logged before clipping) crosses CLIP: it clipped some
    steps and not others, so a comparison covers both."""
    norms = series(run, "grad_norm", steps)
    assert (norms > CLIP).any() and (norms < CLIP).any(), norms


def test_two_processes_match_one_process_at_the_same_global_batch(
    in_bwd: TuneRun, runs_dir: Path, tiny_assets: TinyAssets
) -> None:
    # batch_size is per data-parallel rank: 1 x 8 = 2 x 4, the same samples per step.
    one = _train(
        runs_dir / "one_process",
        tiny_assets,
        nproc=1,
        batch_size=8,
        optimizer_in_bwd=True,
    )
    assert_same_training(
        in_bwd,
        one,
        ACROSS_LAYOUTS,
        ALL_STEPS,
        final_weights=_final_weights,
    )


def test_plain_resume_from_in_backward_sync_checkpoint_equals_uninterrupted_run(
    in_bwd: TuneRun, runs_dir: Path, tiny_assets: TinyAssets
) -> None:
    # In-backward state saved synchronously, loaded into the plain optimizer; the
    # other way, from a checkpoint written in the background, is the next test.
    resumed = _resume(
        in_bwd, 1, runs_dir / "plain_from_in_bwd", tiny_assets, optimizer_in_bwd=False
    )
    assert_same_training(
        resumed,
        in_bwd,
        RESUMED_ACROSS_MODES,
        _steps_after(1),
        reference_steps=ALL_STEPS,
        final_weights=_final_weights,
    )


def test_in_backward_resume_from_plain_async_checkpoint_equals_uninterrupted_run(
    plain_async: TuneRun, in_bwd_async_from_plain: TuneRun
) -> None:
    # Every rank wrote its shards (a distributed checkpoint); no 0.6.1 dist_epoch_*.
    step = plain_async.output_dir / f"step_{STEPS}"
    assert (step / ".metadata").is_file()
    assert not list(plain_async.output_dir.glob("dist_epoch_*"))
    assert_same_training(
        in_bwd_async_from_plain,
        plain_async,
        ACROSS_MODES,
        _steps_after(0),
        reference_steps=ALL_STEPS,
        final_weights=_final_weights,
    )


def _write_0_6_1_epoch_checkpoint(source: TuneRun, epoch: int, out: Path) -> None:
    """Write into ``out`` the checkpoint of ``epoch`` torchtune 0.6.1 would have left:
    ``source``'s ``epoch_{epoch}`` and a ``recipe_state/recipe_state.pt`` holding the
    optimizer state of the step checkpoint of that epoch's end, keyed by parameter
    name."""
    from torchtune import training

    shutil.copytree(source.output_dir / f"epoch_{epoch}", out / f"epoch_{epoch}")
    step_dir = source.output_dir / f"step_{(epoch + 1) * STEPS}"
    state = {
        training.OPT_KEY: full_optimizer_state(step_dir),
        training.SEED_KEY: 0,
        training.EPOCHS_KEY: epoch + 1,
        training.TOTAL_EPOCHS_KEY: EPOCHS,
        training.MAX_STEPS_KEY: STEPS,
    }
    (out / "recipe_state").mkdir()
    torch.save(state, out / "recipe_state" / "recipe_state.pt")


def _rewrite_as_0_6_1_in_backward(output_dir: Path, *, checkpoint_wrapped: bool):
    """Rewrite the optimizer state of ``output_dir``'s recipe state as torchtune
    0.6.1's distributed recipe saved it with ``optimizer_in_bwd``
    (``as_0_6_1_in_backward``)."""
    path = output_dir / "recipe_state" / "recipe_state.pt"
    recipe_state = torch.load(path, weights_only=False)
    recipe_state["optimizer"] = as_0_6_1_in_backward(
        recipe_state["optimizer"], checkpoint_wrapped=checkpoint_wrapped
    )
    torch.save(recipe_state, path)


EPOCH_1_WEIGHTS = f"epoch_1/{SHARD}"


@pytest.mark.parametrize("mode", ["bwd", "plain"])
def test_either_mode_resumes_a_0_6_1_in_backward_checkpoint_as_uninterrupted(
    in_bwd: TuneRun, runs_dir: Path, tiny_assets: TinyAssets, mode: str
) -> None:
    bwd = mode == "bwd"
    out = runs_dir / f"{mode}_from_0_6_1"
    _write_0_6_1_epoch_checkpoint(in_bwd, 1, out)
    _rewrite_as_0_6_1_in_backward(out, checkpoint_wrapped=bwd)
    if bwd:
        # 0.6.1's distributed configs turn activation checkpointing on, which puts
        # its wrapper in the saved names; the resumed run has it on too.
        # Recomputing the forward in backward runs the same kernels on the same
        # values, so the run stays bitwise equal to the uninterrupted one.
        train, more, tol = (
            _train,
            {"enable_activation_checkpointing": True},
            BITWISE_TRAINING,
        )
    else:
        # On one process (to keep it cheap) against the 2-process
        # reference: across modes and layouts (module docstring). Moments that
        # failed to load would restart Adam's bias correction and move the loss by
        # far more.
        train, more, tol = _train_one, {}, RESUMED_ACROSS_MODES_AND_LAYOUTS
    resumed = train(
        out,
        tiny_assets,
        resume_from_checkpoint=True,
        optimizer_in_bwd=bwd,
        **more,
        **{"checkpointer.checkpoint_files": [EPOCH_1_WEIGHTS]},
    )
    assert_same_training(
        resumed,
        in_bwd,
        tol,
        _steps_after(1),
        reference_steps=ALL_STEPS,
        final_weights=_final_weights,
    )


# A partly frozen model, as llama3_2_vision/11B_full with decoder_trainable: False
# is: the embedding (in FSDP's root unit, beside trainable weights) and a whole layer
# (an FSDP unit of its own).
FROZEN = ["tok_embeddings", "layers.0"]
PARTLY_FROZEN = {
    "model._component_": "tests.recipes.partly_frozen_model.partly_frozen_llama2",
    "model.frozen": FROZEN,
}


@pytest.fixture(scope="module")
def frozen_in_bwd(runs_dir: Path, tiny_assets: TinyAssets) -> TuneRun:
    """In-backward, one process, the FROZEN modules frozen."""
    return _train_one(
        runs_dir / "frozen_in_bwd", tiny_assets, optimizer_in_bwd=True, **PARTLY_FROZEN
    )


def test_a_partly_frozen_models_optimizer_state_holds_what_0_6_1_saved(
    frozen_in_bwd: TuneRun, tiny_assets: TinyAssets
) -> None:
    model = partly_frozen_llama2(FROZEN, **tiny_assets.model_kwargs)
    names = [name for name, _ in model.named_parameters()]
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert 0 < len(trainable) < len(names)
    # The step checkpoint of the last epoch's end.
    step_dir = frozen_in_bwd.output_dir / f"step_{EPOCHS * STEPS}"
    saved = full_optimizer_state(step_dir)
    # 0.6.1's optimizer held every parameter, in model order, and had state for
    # those that train (plain: one optimizer over model.parameters(); in-backward:
    # one per parameter, the frozen ones never stepped). This tree's holds the same.
    (group,) = saved["param_groups"]
    assert group["params"] == names
    assert sorted(saved["state"]) == sorted(trainable)
    # And the frozen weights are the base checkpoint's, the others trained.
    base = load_file(tiny_assets.checkpoint_dir / tiny_assets.checkpoint_files[0])
    final = load_file(frozen_in_bwd.output_dir / f"epoch_{EPOCHS - 1}" / SHARD)
    for key in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"):
        assert torch.equal(final[key], base[key]), key
    assert not torch.equal(
        final["model.layers.1.mlp.down_proj.weight"],
        base["model.layers.1.mlp.down_proj.weight"],
    )


@pytest.mark.parametrize("checkpoint_format", ["this tree", "0.6.1 in-backward"])
def test_a_partly_frozen_model_resumes_as_uninterrupted(
    checkpoint_format: str,
    frozen_in_bwd: TuneRun,
    runs_dir: Path,
    tiny_assets: TinyAssets,
) -> None:
    out = runs_dir / f"frozen_resumed_from_{checkpoint_format.replace(' ', '_')}"
    if checkpoint_format == "0.6.1 in-backward":
        _write_0_6_1_epoch_checkpoint(frozen_in_bwd, 1, out)
        _rewrite_as_0_6_1_in_backward(out, checkpoint_wrapped=False)
        resume = {"checkpointer.checkpoint_files": [EPOCH_1_WEIGHTS]}
    else:
        # What epoch 1 left: its export, the step checkpoint of its end, the run id.
        source = frozen_in_bwd.output_dir
        for part in ("epoch_1", f"step_{2 * STEPS}"):
            shutil.copytree(source / part, out / part)
        shutil.copy(source / "torchtune_run.json", out / "torchtune_run.json")
        resume = {}
    resumed = _train_one(
        out,
        tiny_assets,
        resume_from_checkpoint=True,
        optimizer_in_bwd=True,
        **resume,
        **PARTLY_FROZEN,
    )
    assert list(resumed.metrics) == list(_steps_after(1)), resumed.metrics
    # The same process layout and mode: the same kernels on the same values.
    assert_same_training(
        resumed,
        frozen_in_bwd,
        BITWISE_TRAINING,
        _steps_after(1),
        reference_steps=ALL_STEPS,
        final_weights=_final_weights,
    )


@pytest.fixture(scope="module")
def in_bwd_2d(in_bwd: TuneRun, runs_dir: Path, tiny_assets: TinyAssets) -> TuneRun:
    """In-backward on 4 processes, FSDP over 2 x tensor parallel over 2, resumed from
    a full checkpoint of the 2-process FSDP run's epoch 1 (a step checkpoint resumes
    on as many processes as saved it only; 0.6.1's full format resumes on any): 2
    replicas of batch 4 read the same 8 samples per step as the 2 FSDP ranks."""
    out = runs_dir / "in_bwd_2d"
    _write_0_6_1_epoch_checkpoint(in_bwd, 1, out)
    run = _train(
        out,
        tiny_assets,
        nproc=4,
        resume_from_checkpoint=True,
        optimizer_in_bwd=True,
        tensor_parallel_dim=2,
        **{
            "checkpointer.checkpoint_files": [EPOCH_1_WEIGHTS],
            "tensor_parallel_plan._component_": "torchtune.models.llama3.base_llama_tp_plan",
        },
    )
    assert list(run.metrics) == list(_steps_after(1)), run.metrics
    return run


def test_fsdp_with_tensor_parallel_resume_from_fsdp_checkpoint_matches_fsdp_run(
    in_bwd: TuneRun, in_bwd_2d: TuneRun
) -> None:
    steps = _steps_after(1)
    assert_steps(in_bwd, ALL_STEPS)
    assert_steps(in_bwd_2d, steps)
    assert_series_close(
        in_bwd_2d, in_bwd, "loss", steps, **RESUMED_ACROSS_LAYOUTS_2D["loss"]
    )
    assert_series_close(in_bwd_2d, in_bwd, "lr", steps, **BITWISE)
    # The full checkpoint gathers the FSDP x TP shards into the same weights.
    assert_weights_close(
        _final_weights(in_bwd_2d),
        _final_weights(in_bwd),
        **RESUMED_ACROSS_LAYOUTS_2D["weights"],
    )


def test_fsdp_with_tensor_parallel_logs_the_global_grad_norm(
    in_bwd: TuneRun, in_bwd_2d: TuneRun
) -> None:
    steps = _steps_after(1)
    assert_steps(in_bwd_2d, steps)
    assert_series_close(
        in_bwd_2d, in_bwd, "grad_norm", steps, **RESUMED_ACROSS_LAYOUTS_2D["grad_norm"]
    )


def _torchao_8bit_in_both_modes(out_dir: Path) -> None:
    """Each forked rank of the torchao test: ``out_dir/config.yaml`` (two epochs of
    torchao.optim.AdamW8bit) plain, then in-backward, then the in-backward run resumed
    from its epoch-0 step checkpoint. Reports ``"ok"`` or the traceback for each run,
    and the kinds of state tensor the optimizer held."""
    recipe_cls = load_recipe_class(RECIPE, "FullFinetuneRecipeDistributed")
    rank, first_port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    report = {}
    for i, name in enumerate(("plain", "in_bwd", "resumed")):
        # Each run starts its own process group (its cleanup destroys it).
        os.environ["MASTER_PORT"] = str(first_port + i)
        cfg = OmegaConf.load(out_dir / "config.yaml")
        cfg.optimizer_in_bwd = name != "plain"
        cfg.output_dir = str(out_dir / name)
        if name == "resumed":
            cfg.resume_from_checkpoint = True
            # A fresh output_dir with epoch 0's step checkpoint, made whole by rank 0
            # (a rename) before any rank looks for it.
            if rank == 0:
                shutil.copytree(
                    out_dir / "in_bwd" / "step_2", out_dir / "tmp" / "step_2"
                )
                os.replace(out_dir / "tmp", out_dir / name)
            while not (out_dir / name).is_dir():
                time.sleep(0.1)
        try:
            # torchao compiles its per-parameter step, one compile per shape: over a
            # minute here. Eager runs the same update; both modes run it.
            with torch.compiler.set_stance("force_eager"):
                recipe = recipe_cls(cfg)
                recipe.setup(cfg)
                recipe.train()
            kinds = {
                type(t.to_local() if isinstance(t, DTensor) else t).__name__
                for state in recipe._optimizer.state.values()
                for t in state.values()
            }
            report[f"{name} state"] = ",".join(sorted(kinds))
            recipe.cleanup()
            report[name] = "ok"
        except Exception:
            report[name] = traceback.format_exc()
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    write_report(out_dir, rank, report)


def test_torchao_8bit_adamw_trains_in_backward_as_plain_on_two_processes(
    runs_dir: Path, tiny_assets: TinyAssets
) -> None:
    # Two epochs of two steps: torchao's quantized state trains under FSDP2, and saves
    # and resumes in the sharded step checkpoint of epoch 0. The ranks are forked
    # from the preloaded server, so no interpreter start or import is paid.
    out = runs_dir / "torchao_8bit"
    out.mkdir()
    cfg = OmegaConf.load(CONFIG)
    cfg.merge_with(
        {
            "assets_dir": str(tiny_assets.root),
            "epochs": 2,
            "max_steps_per_epoch": 2,
            "clip_grad_norm": None,
            "optimizer": {"_component_": "torchao.optim.AdamW8bit"},
            "checkpointer": {"keep_last_n_checkpoints": 2},
            # Every step updates the weights (the tiny config's warmup starts at 0).
            "lr_scheduler": {"num_warmup_steps": 0},
        }
    )
    OmegaConf.save(cfg, out / "config.yaml")
    run = run_distributed(
        __name__,
        "_torchao_8bit_in_both_modes",
        out,
        timeout_s=TIMEOUT_S,
        start="preloaded",
    )
    for name in ("plain", "in_bwd", "resumed"):
        assert run.outcome(name) == "ok", run.outcome(name)
        # The embedding and the projections (>= 4096 weights) hold 8-bit moments.
        assert "OptimState8bit" in run.reports[0][f"{name} state"].split(",")
    in_bwd, plain = (read_run(out / name) for name in ("in_bwd", "plain"))
    # Resumed from the quantized state it saved: the same steps 3 and 4, bitwise.
    assert_same_training(
        read_run(out / "resumed"),
        in_bwd,
        BITWISE_TRAINING,
        [3, 4],
        reference_steps=range(1, 5),
        final_weights=_epoch_1_weights,
    )
    assert in_bwd.losses[-1] < in_bwd.losses[0]  # it learns
    assert_trains_as_plain(
        in_bwd, plain, BITWISE_TRAINING, range(1, 5), final_weights=_epoch_1_weights
    )


BF16_STEPS = 2  # per epoch, 2 epochs
BF16_ALL_STEPS = range(1, 2 * BF16_STEPS + 1)


@pytest.fixture(scope="module")
def bf16_runs(runs_dir: Path, tiny_assets: TinyAssets) -> dict[str, TuneRun]:
    """2 processes in bf16, two epochs of two steps, in each mode; then the
    in-backward run resumed in-backward from the step checkpoint of epoch 0's end."""
    out = runs_dir / "bf16"
    settings = {
        "assets_dir": tiny_assets.root,
        "dtype": "bf16",
        "epochs": 2,
        "max_steps_per_epoch": BF16_STEPS,
        "clip_grad_norm": CLIP,
        # Keep epoch 0's step checkpoint, to resume from.
        "checkpointer.keep_last_n_checkpoints": 2,
    }

    def train(name: str, **overrides: Any) -> TuneRun:
        return run_tune_forked(
            RECIPE,
            CONFIG,
            settings | overrides,
            output_dir=out / name,
            timeout=TIMEOUT_S,
        )

    runs = {
        "plain": train("plain", optimizer_in_bwd=False),
        "in_bwd": train("in_bwd", optimizer_in_bwd=True),
    }
    # What epoch 0 left: its export, the step checkpoint of its end and the run id.
    for part in ("epoch_0", f"step_{BF16_STEPS}"):
        shutil.copytree(out / "in_bwd" / part, out / "resumed" / part)
    shutil.copy(
        out / "in_bwd" / "torchtune_run.json", out / "resumed" / "torchtune_run.json"
    )
    runs["resumed"] = train(
        "resumed", optimizer_in_bwd=True, resume_from_checkpoint=True
    )
    return runs


def test_bf16_in_backward_matches_plain_on_two_processes_bitwise(
    bf16_runs: dict[str, TuneRun], tiny_assets: TinyAssets
) -> None:
    in_bwd, plain = bf16_runs["in_bwd"], bf16_runs["plain"]
    assert in_bwd.losses[-1] < in_bwd.losses[0]  # it learns
    _assert_clips_some_steps_only(plain, BF16_ALL_STEPS)
    assert_trains_as_plain(
        in_bwd, plain, BITWISE_TRAINING, BF16_ALL_STEPS, final_weights=_epoch_1_weights
    )
    assert all(w.dtype == torch.bfloat16 for w in _epoch_1_weights(in_bwd).values())


def test_bf16_in_backward_resume_on_two_processes_equals_uninterrupted_bitwise(
    bf16_runs: dict[str, TuneRun],
) -> None:
    # bf16 weights and optimizer state are saved and loaded as they are, in the same
    # process layout: the same kernels on the same values.
    assert_same_training(
        bf16_runs["resumed"],
        bf16_runs["in_bwd"],
        BITWISE_TRAINING,
        range(BF16_STEPS + 1, 2 * BF16_STEPS + 1),
        reference_steps=BF16_ALL_STEPS,
        final_weights=_epoch_1_weights,
    )


def test_final_checkpoint_is_a_hf_checkpoint_of_the_trained_weights(
    in_bwd: TuneRun, tiny_assets: TinyAssets
) -> None:
    base = {}
    for name in tiny_assets.checkpoint_files:
        base |= load_file(tiny_assets.checkpoint_dir / name)
    final = load_file(
        in_bwd.output_dir / f"epoch_{EPOCHS - 1}" / "model-00001-of-00001.safetensors"
    )
    assert final.keys() == base.keys()
    for key, tensor in final.items():
        assert tensor.shape == base[key].shape and tensor.dtype == base[key].dtype, key
    assert any(not torch.equal(final[k], base[k]) for k in final)
