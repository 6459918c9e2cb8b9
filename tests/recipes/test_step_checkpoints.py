"""Step checkpoints (``save_every_n_steps``): a run resumes exactly from any step, and
a run killed at any moment, mid-save included, resumes to the end with the losses of
the uninterrupted run.

Every run trains the tiny Llama2 of ``tests/recipes/configs`` for two epochs of three
steps with a step checkpoint every two steps and at each epoch's end (steps 2, 3, 4
and 6; epoch checkpoints at steps 3 and 6), so a resume can land mid-epoch (steps 2
and 4) or at an epoch's end (step 3).

Every resumed run must log exactly the steps after its checkpoint, with the losses
of the uninterrupted run, and end with the same final weights (the epoch-1
checkpoint; for LoRA its adapter): those hold the last step's update, which no
logged loss shows.

Tolerances (``assert_series_close`` and ``assert_weights_close`` print the largest
difference; measured on this project's x86 CPU):

- A resume, in the mode of the uninterrupted run or in the other one: the same
  kernels see the same values (model, optimizer state, data order and RNG state are
  restored, and both modes multiply the gradients by ``1 / tokens`` with the same
  operations), so losses and weights must be bitwise equal: ``rtol=0, atol=0``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from tests.assets.make_assets import TinyAssets
from tests.recipes import crash_run
from tests.recipes.utils import (
    REPO_ROOT,
    TuneRun,
    TuneRunError,
    _override_list,
    _subprocess_env,
    assert_series_close,
    assert_steps,
    assert_weights_close,
    load_weights,
    read_disk_log,
    run_outputs,
    run_tune_forked,
    run_tune_in_process,
    snapshot_files,
    tiny_config,
)
from tests.torchtune.distributed_launcher import (
    kill_child,
    preloaded_context,
    start_child,
)
from torchtune.training.checkpointing._run_folder import (
    read_run_file,
)
from torchtune.training.checkpointing._step_format import (
    CheckpointError,
    export_manifest,
    step_of,
    verify,
)

pytestmark = pytest.mark.integration_test

STEPS_PER_EPOCH = 3
ALL_STEPS = list(range(1, 2 * STEPS_PER_EPOCH + 1))
EXACT = {"rtol": 0.0, "atol": 0.0}
SHARD = "model-00001-of-00001.safetensors"


def overrides(assets: TinyAssets, in_bwd: bool, **more: Any) -> dict[str, Any]:
    """Two epochs of three steps, a step checkpoint every two steps, all of them kept
    once the run is done (tests resume from a finished run's)."""
    return {
        "assets_dir": assets.root,
        "epochs": 2,
        "max_steps_per_epoch": STEPS_PER_EPOCH,
        "save_every_n_steps": 2,
        "checkpointer.keep_last_n_checkpoints": 10,
        "optimizer_in_bwd": in_bwd,
        **more,
    }


def losses(run: TuneRun | dict[int, dict[str, float]]) -> dict[int, float]:
    metrics = run.metrics if isinstance(run, TuneRun) else run
    return {step: values["loss"] for step, values in sorted(metrics.items())}


def assert_resumed_as_uninterrupted(
    resumed: TuneRun,
    uninterrupted: TuneRun,
    after_step: int,
    final_weights: str,
    *,
    loss_tolerance: dict[str, float] = EXACT,
    weights_tolerance: dict[str, float] = EXACT,
) -> None:
    """``resumed`` logged exactly the steps after ``after_step`` with the losses of
    the uninterrupted run, and both wrote the same ``final_weights`` (a path under
    their ``output_dir``) at the end: the weights after every update, the last one
    included, which no logged loss shows."""
    assert_steps(uninterrupted, ALL_STEPS)
    steps = assert_steps(resumed, [s for s in ALL_STEPS if s > after_step])
    assert_series_close(resumed, uninterrupted, "loss", steps, **loss_tolerance)
    assert_weights_close(
        load_weights(resumed.output_dir / final_weights),
        load_weights(uninterrupted.output_dir / final_weights),
        **weights_tolerance,
    )


# -- single device ---------------------------------------------------------------

SINGLE = "full_finetune_single_device"
SINGLE_CONFIG = tiny_config("tiny_full_single_device")


@pytest.fixture(scope="module")
def single_runs(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, TuneRun]:
    """Uninterrupted runs, in each mode."""
    return {
        mode: run_tune_in_process(
            SINGLE,
            SINGLE_CONFIG,
            overrides(tiny_assets, mode == "bwd"),
            tmp_path_factory.mktemp(f"single_{mode}"),
        )
        for mode in ("plain", "bwd")
    }


def resume_from(
    source: TuneRun, step: int, out: Path, assets: TinyAssets, in_bwd: bool
) -> TuneRun:
    """Resume, in a fresh output_dir holding only ``step_{step}``, with no file named:
    the newest whole checkpoint is found."""
    shutil.copytree(source.output_dir / f"step_{step}", out / f"step_{step}")
    return run_tune_in_process(
        SINGLE,
        SINGLE_CONFIG,
        overrides(assets, in_bwd, resume_from_checkpoint=True),
        out,
    )


def test_a_step_checkpoint_holds_everything_to_resume(
    single_runs: dict[str, TuneRun],
) -> None:
    for run in single_runs.values():
        names = sorted(p.name for p in run.output_dir.iterdir())
        assert {"step_2", "step_3", "step_4", "step_6", "epoch_0", "epoch_1"} <= set(
            names
        )
        assert not [n for n in names if n.startswith(".step_")]
        state = torch.load(run.output_dir / "step_4" / "rank_0.pt", weights_only=False)
        # Mid-epoch 1, after one of its three batches.
        assert state["dataloader"]["_sampler_iter_yielded"] == 1, state["dataloader"]


@pytest.mark.parametrize("mode", ["plain", "bwd"])
@pytest.mark.parametrize("step", [2, 3, 4])
def test_resume_mid_epoch_gives_the_uninterrupted_losses_bitwise(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    mode: str,
    step: int,
) -> None:
    resumed = resume_from(single_runs[mode], step, tmp_path, tiny_assets, mode == "bwd")
    assert_resumed_as_uninterrupted(
        resumed, single_runs[mode], step, f"epoch_1/{SHARD}"
    )


@pytest.mark.parametrize(("source", "target"), [("plain", "bwd"), ("bwd", "plain")])
def test_resume_mid_epoch_in_the_other_mode_gives_the_losses_bitwise(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    source: str,
    target: str,
) -> None:
    resumed = resume_from(
        single_runs[source], 4, tmp_path, tiny_assets, target == "bwd"
    )
    assert_resumed_as_uninterrupted(
        resumed,
        single_runs[source],
        4,
        f"epoch_1/{SHARD}",
        loss_tolerance=EXACT,
        weights_tolerance=EXACT,
    )


def test_keep_last_n_checkpoints_keeps_the_newest_step_checkpoints(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    run_tune_in_process(
        SINGLE,
        SINGLE_CONFIG,
        overrides(
            tiny_assets,
            True,
            max_steps_per_epoch=2,
            save_every_n_steps=1,
            **{"checkpointer.keep_last_n_checkpoints": 2},
        ),
        tmp_path,
    )
    steps = sorted(p.name for p in tmp_path.glob("step_*"))
    assert steps == ["step_3", "step_4"]  # of steps 1 to 4, each saved
    assert (tmp_path / "epoch_0").is_dir() and (tmp_path / "epoch_1").is_dir()


def test_invalid_save_every_n_steps_is_refused_before_anything_is_written(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="save_every_n_steps=0 must be a positive"):
        run_tune_in_process(
            SINGLE,
            SINGLE_CONFIG,
            overrides(tiny_assets, True, save_every_n_steps=0),
            tmp_path,
        )
    assert not list(tmp_path.glob("step_*")) and not list(tmp_path.glob("epoch_*"))


# -- two processes (FSDP2 over gloo): sharded step checkpoints --------------------------
# The ranks are forked from a preloaded server (test_harness_smoke.py checks that
# they train as torchrun's do, bitwise).

DISTRIBUTED = "full_finetune_distributed"
DISTRIBUTED_CONFIG = tiny_config("tiny_full_distributed")


@pytest.mark.parametrize("mode", ["plain", "bwd"])
def test_two_processes_resume_mid_epoch_to_the_uninterrupted_losses_bitwise(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    settings = overrides(tiny_assets, mode == "bwd", clip_grad_norm=None)
    uninterrupted = run_tune_forked(
        DISTRIBUTED,
        DISTRIBUTED_CONFIG,
        settings,
        nproc=2,
        output_dir=tmp_path_factory.mktemp(f"fsdp_{mode}"),
    )
    # Each rank wrote its own shards and its own dataloader position.
    step_4 = uninterrupted.output_dir / "step_4"
    assert (step_4 / "model_optimizer" / ".metadata").is_file()
    assert {p.name for p in step_4.glob("rank_*.pt")} == {"rank_0.pt", "rank_1.pt"}

    out = tmp_path_factory.mktemp(f"fsdp_{mode}_resumed")
    shutil.copytree(step_4, out / "step_4")
    resumed = run_tune_forked(
        DISTRIBUTED,
        DISTRIBUTED_CONFIG,
        settings | {"resume_from_checkpoint": True},
        nproc=2,
        output_dir=out,
    )
    # The same process layout and mode: the same kernels on the same values.
    assert_resumed_as_uninterrupted(resumed, uninterrupted, 4, f"epoch_1/{SHARD}")
    if mode == "plain":
        return
    # torchtune 0.6.1's documented resume on every rank: a folder as a run killed in
    # epoch 1 leaves it (epoch 0's export and end, step_3), checkpoint_files pointed
    # at epoch_0/ of output_dir.
    out = tmp_path_factory.mktemp("fsdp_docs_resumed")
    source = uninterrupted.output_dir
    for name in ("epoch_0", "step_3"):
        shutil.copytree(source / name, out / name)
    for name in (".epoch_0.manifest.json", "torchtune_run.json"):
        shutil.copy2(source / name, out / name)
    docs = {
        "resume_from_checkpoint": True,
        "checkpointer.checkpoint_files": [f"epoch_0/{SHARD}"],
    }
    resumed = run_tune_forked(
        DISTRIBUTED, DISTRIBUTED_CONFIG, settings | docs, nproc=2, output_dir=out
    )
    assert_resumed_as_uninterrupted(resumed, uninterrupted, 3, f"epoch_1/{SHARD}")


def test_two_process_lora_resumes_mid_epoch_to_the_uninterrupted_losses_bitwise(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = overrides(tiny_assets, True, clip_grad_norm=None)
    config = tiny_config("tiny_lora_distributed")
    recipe = "lora_finetune_distributed"
    uninterrupted = run_tune_forked(
        recipe, config, settings, nproc=2, output_dir=tmp_path_factory.mktemp("lora2")
    )
    out = tmp_path_factory.mktemp("lora2_resumed")
    shutil.copytree(uninterrupted.output_dir / "step_4", out / "step_4")
    resumed = run_tune_forked(
        recipe,
        config,
        settings | {"resume_from_checkpoint": True},
        nproc=2,
        output_dir=out,
    )
    assert_resumed_as_uninterrupted(
        resumed, uninterrupted, 4, "epoch_1/adapter_model.pt"
    )


# -- LoRA, single device -----------------------------------------------------------

LORA = "lora_finetune_single_device"
LORA_CONFIG = tiny_config("tiny_lora_single_device")


@pytest.mark.parametrize("mode", ["plain", "bwd"])
def test_lora_resume_mid_epoch_gives_the_uninterrupted_losses_bitwise(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    settings = overrides(tiny_assets, mode == "bwd")
    uninterrupted = run_tune_in_process(
        LORA, LORA_CONFIG, settings, tmp_path_factory.mktemp(f"lora_{mode}")
    )
    # A LoRA step checkpoint holds the adapter only: the base weights never change.
    saved = torch.load(
        uninterrupted.output_dir / "step_4" / "model_optimizer.pt", weights_only=False
    )
    assert saved["model"] and all("lora" in name for name in saved["model"])

    out = tmp_path_factory.mktemp(f"lora_{mode}_resumed")
    shutil.copytree(uninterrupted.output_dir / "step_4", out / "step_4")
    resumed = run_tune_in_process(
        LORA, LORA_CONFIG, settings | {"resume_from_checkpoint": True}, out
    )
    assert_resumed_as_uninterrupted(
        resumed, uninterrupted, 4, "epoch_1/adapter_model.pt"
    )


# -- fault injection: SIGKILL at chosen moments, then resume ----------------------------


def killed_run(
    kill_point: str,
    assets: TinyAssets,
    out: Path,
    timeout: float = 300.0,
    log_name: str = "killed.txt",
    recipe: str = SINGLE,
    config: Path = SINGLE_CONFIG,
    **more: Any,
) -> dict[int, dict[str, float]]:
    """Run the in-backward recipe in a process that SIGKILLs itself at
    ``kill_point`` (see ``tests/recipes/crash_run.py``), forked from the preloaded
    server (the imports done, a real process all the same); return what it logged."""
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    tune_args = [
        "run",
        recipe,
        "--config",
        str(config),
        *_override_list(overrides(assets, True, **more)),
        *run_outputs(out, log_dir / log_name),
    ]
    output = log_dir / f"{Path(log_name).stem}.out"
    env = _subprocess_env(out, None)
    process = start_child(
        preloaded_context(),
        _crash_run,
        (kill_point, tune_args, str(REPO_ROOT)),
        env,
        output,
        replace_env=True,
    )
    process.join(timeout)
    if process.is_alive():
        kill_child(process)
    assert process.exitcode == -signal.SIGKILL, (
        f"expected a SIGKILL at {kill_point}, got exit status {process.exitcode}\n"
        + output.read_text(errors="replace")[-6000:]
    )
    return read_disk_log(log_dir / log_name)


def _crash_run(kill_point: str, tune_args: list[str], cwd: str) -> None:
    os.chdir(cwd)
    crash_run.run(kill_point, tune_args)


def newest_whole_step(out: Path) -> int:
    """The step of the newest step checkpoint in ``out`` that verifies and loads."""
    for folder in sorted(out.glob("step_*"), key=step_of, reverse=True):
        try:
            verify(folder)
        except CheckpointError:
            continue
        torch.load(folder / "model_optimizer.pt", weights_only=False)
        return step_of(folder)
    raise AssertionError(f"no whole step checkpoint in {out}")


@pytest.mark.parametrize(
    ("kill_point", "resumes_after"),
    [
        ("after_step:5", 4),  # between saves: back to step_4, mid-epoch
        ("in_step_save:4", 3),  # step_4 half written: back to step_3
        ("before_rename:4", 3),  # step_4 whole but never renamed: back to step_3
        ("in_step_save:3", 2),  # epoch 0's end, half written: back to step_2
        ("in_epoch_save:0", 3),  # epoch 0's weights torn: step_3 is whole
    ],
)
def test_a_run_killed_at_any_moment_resumes_to_the_uninterrupted_losses(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    kill_point: str,
    resumes_after: int,
) -> None:
    before = killed_run(kill_point, tiny_assets, tmp_path)
    assert newest_whole_step(tmp_path) == resumes_after
    if kill_point.startswith("in_epoch_save"):
        # Torn, and known to be: its manifest is written once it is whole.
        assert not export_manifest(tmp_path / "epoch_0").exists()

    # Only the killed run needs a process of its own; this one runs here.
    resumed = run_tune_in_process(
        SINGLE,
        SINGLE_CONFIG,
        overrides(tiny_assets, True, resume_from_checkpoint=True),
        tmp_path,
    )
    # The resumed run logs every step after the checkpoint it resumed from, with
    # the uninterrupted run's losses, and ends with its weights.
    assert_resumed_as_uninterrupted(
        resumed, single_runs["bwd"], resumes_after, f"epoch_1/{SHARD}"
    )
    # The killed run logged the steps up to its kill with the uninterrupted losses
    # too (steps done again after the resume included).
    reference = losses(single_runs["bwd"])
    assert before, "the killed run logged nothing"
    assert list(losses(before)) == list(range(1, max(before) + 1))
    assert max(before) >= resumes_after
    assert_close(
        list(losses(before).values()), [reference[s] for s in losses(before)], **EXACT
    )
    assert not list(tmp_path.glob(".step_*")), "a partial save was left behind"
    # The export of every epoch is whole again, the torn one rewritten.
    for epoch in (0, 1):
        assert_weights_close(
            load_weights(tmp_path / f"epoch_{epoch}" / SHARD),
            load_weights(single_runs["bwd"].output_dir / f"epoch_{epoch}" / SHARD),
            **EXACT,
        )
        verify(
            tmp_path / f"epoch_{epoch}", export_manifest(tmp_path / f"epoch_{epoch}")
        )


# -- runs sharing an output_dir, damaged checkpoints ------------------------------------


def test_a_new_run_killed_in_a_finished_runs_folder_resumes_its_own_checkpoints(
    single_runs: dict[str, TuneRun], tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    # Run A finished here (step_6 is its last step checkpoint). Run B, the same
    # config, starts anew in the same folder and is killed once it logged step 3,
    # before that step's (epoch-end) save: its newest checkpoint is step_2. Its
    # resume must continue B from B's step_2, not take A's step_6 and train
    # nothing. Same config, so B's uninterrupted run is A's.
    run_a = single_runs["bwd"]
    shutil.copytree(run_a.output_dir, tmp_path, dirs_exist_ok=True)
    # Its checkpoints (the logs and the config copy are not checkpoints: they stay,
    # and B's go beside them or replace them, as in torchtune 0.6.1).
    a_files = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in tmp_path.rglob("*")
        if p.is_file()
        and p.parts[len(tmp_path.parts)] not in ("logs", "torchtune_config.yaml")
    }
    a_run_id = read_run_file(tmp_path)
    assert a_run_id is not None

    before = killed_run("after_step:3", tiny_assets, tmp_path, log_name="b.txt")
    assert list(losses(before)) == [1, 2, 3]
    # B's own checkpoints: step_2, and none of A's (deleted, as B said at start).
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2"]
    assert read_run_file(tmp_path) not in (None, a_run_id)

    resumed = run_tune_in_process(
        SINGLE,
        SINGLE_CONFIG,
        overrides(tiny_assets, True, resume_from_checkpoint=True),
        tmp_path,
    )
    assert_resumed_as_uninterrupted(resumed, run_a, 2, f"epoch_1/{SHARD}")
    assert "holds an earlier run's files. Deleting its resumable state" in (
        (tmp_path / "logs" / "b.out").read_text()
    )
    # A's exports were replaced by B's (the same bytes: the same config), and
    # nothing of A's was kept: as in 0.6.1, unless keep_previous_runs asks.
    for name in ("epoch_0", "epoch_1"):
        assert (tmp_path / name / SHARD).read_bytes() == a_files[Path(name) / SHARD]
    assert not (tmp_path / "previous_runs").exists()


@pytest.mark.parametrize("where", ["middle", "last byte"])
def test_a_changed_byte_in_the_newest_checkpoint_resumes_from_the_one_before(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    where: str,
) -> None:
    source = single_runs["bwd"].output_dir
    for step in (3, 4):
        shutil.copytree(source / f"step_{step}", tmp_path / f"step_{step}")
    damaged = tmp_path / "step_4" / "model_optimizer.pt"
    data = bytearray(damaged.read_bytes())
    # The middle is a tensor's bytes; the last byte is the zip's end record (before
    # checksums: "PytorchStreamReader failed reading zip archive", no fallback).
    data[len(data) // 2 if where == "middle" else -1] ^= 0x01
    damaged.write_bytes(bytes(data))

    resumed = run_tune_in_process(
        SINGLE,
        SINGLE_CONFIG,
        overrides(tiny_assets, True, resume_from_checkpoint=True),
        tmp_path,
    )
    assert_resumed_as_uninterrupted(resumed, single_runs["bwd"], 3, f"epoch_1/{SHARD}")


def test_resuming_a_finished_run_trains_nothing_and_says_so(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    shutil.copytree(single_runs["bwd"].output_dir, tmp_path, dirs_exist_ok=True)
    weights = (tmp_path / "epoch_1" / SHARD).read_bytes()
    with caplog.at_level(logging.WARNING):
        # It returns (exit status 0) having logged no step: the helper says so.
        with pytest.raises(TuneRunError, match="logged no metrics"):
            run_tune_in_process(
                SINGLE,
                SINGLE_CONFIG,
                overrides(tiny_assets, True, resume_from_checkpoint=True),
                tmp_path,
            )
    assert (
        f"resume_from_checkpoint=True: {tmp_path / 'step_6'} is at the end of "
        "training (2 epochs done, epochs=2): nothing left to do." in caplog.text
    )
    assert (tmp_path / "epoch_1" / SHARD).read_bytes() == weights


# -- what a resume must never lose or silently change ------------------------------------


def copy_run(source: Path, out: Path) -> None:
    """``source``'s checkpoints, without its logs, into ``out``."""
    shutil.copytree(
        source, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("logs")
    )


def checkpoint_files(out: Path) -> dict[str, tuple[str, int]]:
    """Every file of ``out`` but the logs and the config copy, which every run that
    passes its checks writes."""
    return {
        k: v
        for k, v in snapshot_files(out).items()
        if not k.startswith("logs") and k != "torchtune_config.yaml"
    }


@pytest.mark.parametrize("damage", ["truncated", "disk full while written"])
def test_a_torn_final_export_is_rewritten_from_the_final_checkpoint_on_resume(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    damage: str,
) -> None:
    shard = tmp_path / "epoch_1" / SHARD
    if damage == "truncated":
        copy_run(single_runs["bwd"].output_dir, tmp_path)
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        # The disk fills up while the last epoch's weights are written: the run
        # fails, its step_6 whole, epoch_1 half written.
        from torchtune.training.checkpointing import _checkpointer

        def full_disk(tensors, filename, *args, **kwargs):
            if "epoch_1" in Path(filename).parts:
                Path(filename).write_bytes(b"\0" * 100)
                raise OSError(28, "No space left on device")
            return real_save_file(tensors, filename, *args, **kwargs)

        real_save_file = _checkpointer.save_file
        monkeypatch.setattr(_checkpointer, "save_file", full_disk)
        with pytest.raises(OSError, match="No space left"):
            run_tune_in_process(
                SINGLE, SINGLE_CONFIG, overrides(tiny_assets, True), tmp_path
            )
        monkeypatch.undo()
    assert verify(tmp_path / "step_6")
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(TuneRunError, match="no metrics"),
    ):
        run_tune_in_process(
            SINGLE,
            SINGLE_CONFIG,
            overrides(tiny_assets, True, resume_from_checkpoint=True),
            tmp_path,
        )
    assert (
        f"The export of epoch 1 is not this checkpoint's ({tmp_path / 'epoch_1'}"
        in caplog.text
    )
    assert f"rewriting it from {tmp_path / 'step_6'}" in caplog.text
    assert "nothing left to do" in caplog.text
    assert_weights_close(
        load_weights(shard),
        load_weights(single_runs["bwd"].output_dir / "epoch_1" / SHARD),
        **EXACT,
    )
    verify(tmp_path / "epoch_1", export_manifest(tmp_path / "epoch_1"))


def write_rows(assets: TinyAssets, path: Path, rows: int) -> Path:
    import json

    data = json.loads(assets.train_data.read_text())
    path.write_text(json.dumps(data[:rows]))
    return path


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"batch_size": 4}, "batch_size: 8 then, 4 now"),
        (
            {"gradient_accumulation_steps": 2, "optimizer_in_bwd": False},
            "gradient_accumulation_steps: 1 then, 2 now",
        ),
        ({"max_steps_per_epoch": 4}, "max_steps_per_epoch: 3 then, 4 now"),
        ("20 rows", "dataset_length: "),
    ],
)
def test_a_resume_with_another_trajectory_is_refused_and_changes_nothing(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    change: Any,
    named: str,
) -> None:
    shutil.copytree(single_runs["bwd"].output_dir / "step_4", tmp_path / "step_4")
    if change == "20 rows":
        change = {
            "dataset.data_files": str(
                write_rows(tiny_assets, tmp_path / "small.json", 20)
            )
        }
    # Every file, the logs and the config copy included: a refused run writes none.
    before = snapshot_files(tmp_path)
    settings = overrides(tiny_assets, True, resume_from_checkpoint=True) | change
    with pytest.raises(
        CheckpointError, match="was trained with other settings"
    ) as refused:
        run_tune_in_process(SINGLE, SINGLE_CONFIG, settings, tmp_path)
    assert named in str(refused.value) and "resume_allow_changes=True" in str(
        refused.value
    )
    assert snapshot_files(tmp_path) == before
    # With the run's own settings it continues exactly.
    resumed = run_tune_in_process(
        SINGLE,
        SINGLE_CONFIG,
        overrides(tiny_assets, True, resume_from_checkpoint=True),
        tmp_path,
    )
    assert_resumed_as_uninterrupted(resumed, single_runs["bwd"], 4, f"epoch_1/{SHARD}")


def test_resume_allow_changes_continues_with_the_new_settings_and_says_so(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    shutil.copytree(single_runs["bwd"].output_dir / "step_3", tmp_path / "step_3")
    settings = overrides(
        tiny_assets, True, resume_from_checkpoint=True, resume_allow_changes=True
    )
    with caplog.at_level(logging.WARNING):
        resumed = run_tune_in_process(
            SINGLE, SINGLE_CONFIG, settings | {"max_steps_per_epoch": 2}, tmp_path
        )
    assert "resume_allow_changes=True: resuming" in caplog.text
    assert "max_steps_per_epoch: 3 then, 2 now" in caplog.text
    # Epochs now end every 2 steps: the resumed epoch 1 (steps_done 1) has one left.
    assert_steps(resumed, [4])
    assert verify(tmp_path / "step_3") and verify(tmp_path / "step_4")


def test_a_config_value_the_checkpoint_replaces_is_named(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = overrides(tiny_assets, True, resume_from_checkpoint=True) | {
        "optimizer.lr": 1e-3
    }
    shutil.copytree(single_runs["bwd"].output_dir / "step_4", tmp_path / "step_4")
    with caplog.at_level(logging.WARNING):
        resumed = run_tune_in_process(SINGLE, SINGLE_CONFIG, settings, tmp_path)
    assert (
        "its optimizer state replaces optimizer.lr=0.001 (the checkpoint's: 0.002)"
        in caplog.text
    )
    # As the warning says, the checkpoint's values train on: the uninterrupted run.
    assert_resumed_as_uninterrupted(resumed, single_runs["bwd"], 4, f"epoch_1/{SHARD}")


def test_resuming_an_older_step_branches_and_keep_last_n_keeps_the_branch(
    single_runs: dict[str, TuneRun], tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    source = single_runs["bwd"].output_dir
    copy_run(source, tmp_path)
    old = {
        n: checkpoint_files(tmp_path / n)
        for n in ("step_3", "step_4", "step_6", "epoch_0", "epoch_1")
    }
    branch = {
        "checkpointer.recipe_checkpoint": "step_2/recipe_state.pt",
        "checkpointer.keep_last_n_checkpoints": 1,
        "keep_previous_runs": True,
    }
    # Killed after step 5: of the branch only step_4 is whole (keep_last_n=1).
    before = killed_run(
        "after_step:5", tiny_assets, tmp_path, resume_from_checkpoint=True, **branch
    )
    assert list(losses(before)) == [3, 4, 5]
    keep = {"checkpointer.keep_last_n_checkpoints": 1}
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_4"]
    # The old timeline's later checkpoints and exports, moved aside, whole.
    (aside,) = (tmp_path / "previous_runs").glob("run_*-after-step_2")
    for name, files in old.items():
        assert checkpoint_files(aside / name) == files, name
    resumed = run_tune_in_process(
        SINGLE,
        SINGLE_CONFIG,
        overrides(tiny_assets, True, resume_from_checkpoint=True, **keep),
        tmp_path,
    )
    assert_resumed_as_uninterrupted(resumed, single_runs["bwd"], 4, f"epoch_1/{SHARD}")
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_6"]


def test_a_second_run_is_refused_while_one_trains_in_the_folder(
    tiny_assets: TinyAssets,
    tmp_path: Path,
    single_runs: dict[str, TuneRun],
    caplog: pytest.LogCaptureFixture,
) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.recipes.crash_run",
            "pause_after_step:3",
            "run",
            SINGLE,
            "--config",
            str(SINGLE_CONFIG),
            *_override_list(overrides(tiny_assets, True)),
            *run_outputs(tmp_path, log_dir / "first.txt"),
        ],
        cwd=REPO_ROOT,
        env=_subprocess_env(tmp_path, None),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while 3 not in (
            read_disk_log(log_dir / "first.txt")
            if (log_dir / "first.txt").is_file()
            else {}
        ):
            assert first.poll() is None and time.monotonic() < deadline, (
                "the first run did not reach step 3"
            )
            time.sleep(0.2)
        # Every file but the live run's growing logs: its config copy included.
        before = {
            k: v
            for k, v in snapshot_files(tmp_path).items()
            if not k.startswith("logs")
        }
        for resume in (False, True):
            with pytest.raises(
                CheckpointError,
                match=f"in use by another run \\(process {first.pid} on host ",
            ):
                run_tune_in_process(
                    SINGLE,
                    SINGLE_CONFIG,
                    overrides(tiny_assets, True, resume_from_checkpoint=resume),
                    tmp_path,
                )
        after = snapshot_files(tmp_path)
        assert {k: v for k, v in after.items() if not k.startswith("logs")} == before
    finally:
        first.kill()
        first.wait()
    # The first run was killed: its lock is stale, and its resume takes it over.
    with caplog.at_level(logging.WARNING):
        resumed = run_tune_in_process(
            SINGLE,
            SINGLE_CONFIG,
            overrides(tiny_assets, True, resume_from_checkpoint=True),
            tmp_path,
        )
    assert "left by a run that stopped" in caplog.text
    assert_resumed_as_uninterrupted(resumed, single_runs["bwd"], 2, f"epoch_1/{SHARD}")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch_size": 0}, "batch_size=0 is not a positive integer"),
        ({"epochs": "'2'"}, "epochs='2' is not a positive integer"),
        (
            {"max_steps_per_epoch": "'3'"},
            "max_steps_per_epoch='3' is not a positive integer",
        ),
        ({"epochs": 0}, "epochs=0 is not a positive integer"),
        ({"max_steps_per_epoch": 0}, "max_steps_per_epoch=0 is not a positive integer"),
        ({"optimizer.lr": "abc"}, "optimizer.lr='abc' is not a number"),
        ({"optimizer.betas": "[0.9]"}, "optimizer.betas=[0.9] is not 2 numbers"),
        ({"seed": "abc"}, "seed='abc' is not a whole number"),
        (
            {"optimizer._component_": "torch.optim.AdamWW"},
            "optimizer._component_=torch.optim.AdamWW cannot be imported",
        ),
        ({"resume_from_checkpoint": "'False'"}, "resume_from_checkpoint='False' is"),
        ({"resume_allow_changes": "'False'"}, "resume_allow_changes='False' is not"),
    ],
)
def test_a_refused_new_run_leaves_an_earlier_runs_folder_as_it_was(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    change: dict,
    message: str,
) -> None:
    copy_run(single_runs["bwd"].output_dir, tmp_path)
    before = snapshot_files(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        run_tune_in_process(
            SINGLE, SINGLE_CONFIG, overrides(tiny_assets, True) | change, tmp_path
        )
    assert snapshot_files(tmp_path) == before


def test_nothing_to_resume_points_at_the_earlier_runs_set_aside(
    single_runs: dict[str, TuneRun], tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    (tmp_path / "previous_runs" / "run_x").mkdir(parents=True)
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"Earlier runs' checkpoints are in {tmp_path / 'previous_runs'}"
        ),
    ):
        run_tune_in_process(
            SINGLE,
            SINGLE_CONFIG,
            overrides(tiny_assets, True, resume_from_checkpoint=True),
            tmp_path,
        )


def test_an_epoch_only_run_resumes_with_resume_from_checkpoint_alone(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = overrides(tiny_assets, True, **AS_IN_0_6_1)
    uninterrupted = run_tune_in_process(
        SINGLE, SINGLE_CONFIG, settings, tmp_path_factory.mktemp("epochs")
    )
    # None is kept once the run is done, as in 0.6.1.
    assert not list(uninterrupted.output_dir.glob("step_*"))
    out = tmp_path_factory.mktemp("epochs_killed")
    killed_run("after_step:5", tiny_assets, out, **AS_IN_0_6_1)
    # Only the newest epoch-end checkpoint is kept without save_every_n_steps.
    assert sorted(p.name for p in out.glob("step_*")) == ["step_3"]
    resumed = run_tune_in_process(
        SINGLE, SINGLE_CONFIG, settings | {"resume_from_checkpoint": True}, out
    )
    assert_resumed_as_uninterrupted(resumed, uninterrupted, 3, f"epoch_1/{SHARD}")


# -- torchtune 0.6.1's documented workflows, as its docs write them ----------------------

# 0.6.1's own defaults: no step checkpoints between epoch ends, none kept at the end.
AS_IN_0_6_1 = {"save_every_n_steps": None, "checkpointer.keep_last_n_checkpoints": None}


def test_the_documented_full_finetuning_resume_continues_a_killed_run_bitwise(
    single_runs: dict[str, TuneRun], tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    # deep_dives/checkpointer.rst: "resume_from_checkpoint: True" and checkpoint_files
    # pointed at epoch_{N}/ of output_dir. Killed in epoch 1, epoch_0 saved.
    killed_run("after_step:5", tiny_assets, tmp_path, **AS_IN_0_6_1)
    docs = {
        "resume_from_checkpoint": True,
        "checkpointer.checkpoint_files": [f"epoch_0/{SHARD}"],
    }
    resumed = run_tune_in_process(
        SINGLE,
        SINGLE_CONFIG,
        overrides(tiny_assets, True, **AS_IN_0_6_1) | docs,
        tmp_path,
    )
    assert_resumed_as_uninterrupted(
        resumed, single_runs["bwd"], STEPS_PER_EPOCH, f"epoch_1/{SHARD}"
    )
    # Finished, the folder holds what 0.6.1 leaves, plus under 2 KB of metadata (the
    # run's name and the exports' manifests): not its step checkpoints.
    extra = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file()
        and p.relative_to(tmp_path).parts[0] not in ("epoch_0", "epoch_1", "logs")
        and p.name != "torchtune_config.yaml"
    ]
    assert sorted(p.name for p in extra) == [
        ".epoch_0.manifest.json",
        ".epoch_1.manifest.json",
        "torchtune_run.json",
    ]
    assert sum(p.stat().st_size for p in extra) < 2000


def test_the_documented_lora_resume_continues_a_killed_run_bitwise(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # "adapter_checkpoint: epoch_{N}/adapter_model.pt" and resume_from_checkpoint.
    settings = overrides(tiny_assets, True, **AS_IN_0_6_1)
    uninterrupted = run_tune_in_process(
        LORA, LORA_CONFIG, settings, tmp_path_factory.mktemp("lora_docs_reference")
    )
    out = tmp_path_factory.mktemp("lora_docs")
    killed_run(
        "after_step:5",
        tiny_assets,
        out,
        recipe=LORA,
        config=LORA_CONFIG,
        **AS_IN_0_6_1,
    )
    docs = {
        "resume_from_checkpoint": True,
        "checkpointer.adapter_checkpoint": "epoch_0/adapter_model.pt",
    }
    resumed = run_tune_in_process(LORA, LORA_CONFIG, settings | docs, out)
    assert_resumed_as_uninterrupted(
        resumed, uninterrupted, STEPS_PER_EPOCH, "epoch_1/adapter_model.pt"
    )


def test_the_documented_resume_of_an_epoch_whose_state_is_gone_changes_nothing(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    # Killed in epoch 1 with a step checkpoint every 2 steps and only the newest
    # kept: epoch 0's end (step_3) was pruned, so naming epoch_0 is refused before
    # anything is written, naming what can be resumed.
    kept = {"save_every_n_steps": 2, "checkpointer.keep_last_n_checkpoints": 1}
    killed_run("after_step:5", tiny_assets, tmp_path, **kept)
    before = snapshot_files(tmp_path)
    docs = {
        "resume_from_checkpoint": True,
        "checkpointer.checkpoint_files": [f"epoch_0/{SHARD}"],
    }
    with pytest.raises(
        CheckpointError, match=r"This run's step checkpoints are: step_4 \(mid-epoch\)"
    ):
        run_tune_in_process(
            SINGLE, SINGLE_CONFIG, overrides(tiny_assets, True, **kept) | docs, tmp_path
        )
    assert snapshot_files(tmp_path) == before


@pytest.mark.parametrize("where", ["the base folder", "inside it"])
def test_an_output_dir_in_the_base_checkpoint_folder_is_refused_before_any_write(
    tiny_assets: TinyAssets, tmp_path: Path, where: str
) -> None:
    # 0.6.1's checkpointer refused it only after logs/ and the config copy had been
    # written into the base model's folder.
    base = tmp_path / "base"
    shutil.copytree(tiny_assets.checkpoint_dir, base)
    before = snapshot_files(base)
    out = base if where == "the base folder" else base / "out"
    settings = overrides(tiny_assets, True) | {"checkpointer.checkpoint_dir": base}
    with pytest.raises(ValueError, match=f"output_dir={out} is inside "):
        run_tune_in_process(SINGLE, SINGLE_CONFIG, settings, out)
    assert snapshot_files(base) == before
