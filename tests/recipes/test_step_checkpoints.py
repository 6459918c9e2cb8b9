"""Step checkpoints (``save_every_n_steps``) in real recipe runs: a run resumes exactly
from any step, and a run killed at any moment, mid-save included, resumes to the end
with the losses of the uninterrupted run.

The checkpoint manager's rules (which checkpoint a resume takes, what it refuses,
pruning, branching, the lock) are unit-tested in
``tests/torchtune/training/checkpointing/test_checkpoint_manager.py``; here is only
what a real run shows: a recipe resuming bitwise, a SIGKILL (``crash_run.py``), two
processes, a refused run writing nothing (its logs and config copy included), and
torchtune 0.6.1's documented resume commands.

Every run trains the tiny Llama2 of ``tests/recipes/configs`` for two epochs of three
steps with a step checkpoint every two steps and at each epoch's end (steps 2, 3, 4
and 6; epoch checkpoints at steps 3 and 6), so a resume can land mid-epoch (steps 2
and 4) or at an epoch's end (step 3).

Every resumed run must log exactly the steps after its checkpoint, with the losses
of the uninterrupted run, and end with the same final weights (the epoch-1
checkpoint; for LoRA its adapter): those hold the last step's update, which no
logged loss shows.

Tolerances (``assert_series_close`` and ``assert_weights_close`` print the largest
difference; measured on this project's x86 CPU): a resume sees the same kernels on
the same values (model, optimizer state, data order and RNG state are restored), so
losses and weights must be bitwise equal: ``rtol=0, atol=0``.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from torch.testing import assert_close

from tests.assets.make_assets import TinyAssets
from tests.helpers import BITWISE, snapshot_files
from tests.recipes import crash_run
from tests.recipes.utils import (
    TuneRun,
    TuneRunError,
    assert_series_close,
    assert_steps,
    assert_weights_close,
    load_weights,
    process_state,
    run_recipe,
    run_tune_in_process,
    step_state,
    tiny_config,
)
from torchtune.training.checkpointing._run_folder import RUN_FILE, read_run_file
from torchtune.training.checkpointing._step_format import (
    CheckpointError,
    export_manifest,
    partial_step,
    step_of,
    verify,
)

pytestmark = pytest.mark.integration_test

STEPS_PER_EPOCH = 3
ALL_STEPS = list(range(1, 2 * STEPS_PER_EPOCH + 1))
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
) -> None:
    """``resumed`` logged exactly the steps after ``after_step`` with the losses of
    the uninterrupted run, and both wrote the same ``final_weights`` (a path under
    their ``output_dir``) at the end: the weights after every update, the last one
    included, which no logged loss shows."""
    assert_steps(uninterrupted, ALL_STEPS)
    steps = assert_steps(resumed, [s for s in ALL_STEPS if s > after_step])
    assert_series_close(resumed, uninterrupted, "loss", steps, **BITWISE)
    assert_weights_close(
        load_weights(resumed.output_dir / final_weights),
        load_weights(uninterrupted.output_dir / final_weights),
        **BITWISE,
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
        loader = process_state(run.output_dir / "step_4", "dataloader")["rank_0"]
        # Mid-epoch 1, after one of its three batches.
        assert loader["_sampler_iter_yielded"] == 1, loader


# A resume at epoch 0's end (step 3), and in the other mode, is in
# test_full_finetune_single_device.py; here the resumes land mid-epoch.
@pytest.mark.parametrize("mode", ["plain", "bwd"])
@pytest.mark.parametrize("step", [2, 4])
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


# -- the other recipes: two processes (FSDP2 over gloo, sharded), LoRA ------------------
# The ranks are forked from a preloaded server (test_harness_smoke.py checks that
# they train as torchrun's do, bitwise).

LORA = "lora_finetune_single_device"
LORA_CONFIG = tiny_config("tiny_lora_single_device")


@pytest.mark.parametrize(
    ("recipe", "config", "mode"),
    [
        ("full_finetune_distributed", "tiny_full_distributed", "plain"),
        ("full_finetune_distributed", "tiny_full_distributed", "bwd"),
        ("lora_finetune_distributed", "tiny_lora_distributed", "bwd"),
        (LORA, "tiny_lora_single_device", "plain"),
        (LORA, "tiny_lora_single_device", "bwd"),
    ],
)
def test_a_resume_mid_epoch_gives_the_uninterrupted_losses_bitwise(
    tiny_assets: TinyAssets,
    tmp_path_factory: pytest.TempPathFactory,
    recipe: str,
    config: str,
    mode: str,
) -> None:
    config = tiny_config(config)
    settings = overrides(tiny_assets, mode == "bwd")
    if "distributed" in recipe:
        settings["clip_grad_norm"] = None
    final = "epoch_1/" + ("adapter_model.pt" if "lora" in recipe else SHARD)
    out = tmp_path_factory.mktemp(f"{recipe}_{mode}")
    uninterrupted = run_recipe(recipe, config, settings, out)
    step_4 = uninterrupted.output_dir / "step_4"
    if "distributed" in recipe:
        # One DCP checkpoint: each rank's shards and its own dataloader position.
        assert (step_4 / ".metadata").is_file()
        assert set(process_state(step_4, "dataloader")) == {"rank_0", "rank_1"}
    else:
        # A LoRA step checkpoint holds the adapter only: the base weights never
        # change.
        saved = step_state(step_4)
        assert saved["model"] and all("lora" in name for name in saved["model"])
    out = tmp_path_factory.mktemp(f"{recipe}_{mode}_resumed")
    shutil.copytree(step_4, out / "step_4")
    resumed = run_recipe(
        recipe, config, settings | {"resume_from_checkpoint": True}, out
    )
    # The same process layout and mode: the same kernels on the same values.
    assert_resumed_as_uninterrupted(resumed, uninterrupted, 4, final)
    if recipe != "full_finetune_distributed" or mode == "plain":
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
    resumed = run_recipe(recipe, config, settings | docs, out)
    assert_resumed_as_uninterrupted(resumed, uninterrupted, 3, final)


# -- fault injection: SIGKILL at chosen moments, then resume ----------------------------
# Every killed run is tests/recipes/crash_run.py's: a process of its own, killed at a
# named point of the run. Only the killed run needs one; each resume runs here.


def killed_run(
    kill_point: str,
    assets: TinyAssets,
    out: Path,
    *,
    log_name: str = "killed.txt",
    recipe: str = SINGLE,
    config: Path = SINGLE_CONFIG,
    **more: Any,
) -> dict[int, dict[str, float]]:
    """The in-backward run of ``overrides(assets, True, **more)``, killed at
    ``kill_point`` (``crash_run.killed_run``); what it logged."""
    return crash_run.killed_run(
        kill_point,
        recipe,
        config,
        overrides(assets, True, **more),
        out,
        log_name=log_name,
    )


def resume_here(assets: TinyAssets, out: Path, **more: Any) -> TuneRun:
    """The in-backward run resumed in ``out``, in this process."""
    return run_tune_in_process(
        SINGLE,
        SINGLE_CONFIG,
        overrides(assets, True, resume_from_checkpoint=True, **more),
        out,
    )


def newest_whole_step(out: Path) -> int:
    """The step of the newest step checkpoint in ``out`` that verifies and loads,
    published or not yet (a whole ``.step_{N}.partial``, which the next start
    publishes)."""
    folders = [*out.glob("step_*"), *out.glob(".step_*.partial")]
    for folder in sorted(
        folders, key=lambda f: partial_step(f) or step_of(f), reverse=True
    ):
        try:
            verify(folder)
        except CheckpointError:
            continue
        step_state(folder)
        return partial_step(folder) or step_of(folder)
    raise AssertionError(f"no whole step checkpoint in {out}")


@pytest.mark.parametrize(
    ("kill_point", "resumes_after"),
    [
        ("after_step:5", 4),  # between saves: back to step_4, mid-epoch
        ("in_step_save:4", 3),  # step_4 half written: back to step_3
        ("before_rename:4", 4),  # step_4 whole but never renamed: published at start
        ("in_step_save:3", 2),  # epoch 0's end, half written: back to step_2
        ("in_epoch_save:0", 3),  # epoch 0's weights torn: step_3 is whole
    ],
)
def test_a_run_killed_at_any_moment_resumes_to_the_uninterrupted_losses(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    kill_point: str,
    resumes_after: int,
) -> None:
    before = killed_run(kill_point, tiny_assets, tmp_path)
    assert newest_whole_step(tmp_path) == resumes_after
    if kill_point.startswith("in_epoch_save"):
        # Torn, and known to be: its manifest is written once it is whole.
        assert not export_manifest(tmp_path / "epoch_0").exists()

    with caplog.at_level(logging.WARNING):
        resumed = resume_here(tiny_assets, tmp_path)
    # The killed run's lock is stale (the kernel dropped its hold): taken over.
    assert "left by a run that stopped" in caplog.text
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
        list(losses(before).values()), [reference[s] for s in losses(before)], **BITWISE
    )
    assert not list(tmp_path.glob(".step_*")), "a partial save was left behind"
    # The export of every epoch is whole again, the torn one rewritten.
    for epoch in (0, 1):
        assert_weights_close(
            load_weights(tmp_path / f"epoch_{epoch}" / SHARD),
            load_weights(single_runs["bwd"].output_dir / f"epoch_{epoch}" / SHARD),
            **BITWISE,
        )
        verify(
            tmp_path / f"epoch_{epoch}", export_manifest(tmp_path / f"epoch_{epoch}")
        )


def test_a_run_killed_writing_its_final_export_finishes_it_on_resume_and_trains_nothing(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Killed (or out of disk space) while the last epoch's weights are written:
    # step_6, the end of training, is whole; epoch_1 half written.
    killed_run("in_epoch_save:1", tiny_assets, tmp_path)
    assert verify(tmp_path / "step_6")
    with (
        caplog.at_level(logging.WARNING),
        # It returns (exit status 0) having logged no step: the helper says so.
        pytest.raises(TuneRunError, match="logged no metrics"),
    ):
        resume_here(tiny_assets, tmp_path)
    assert (
        f"The export of epoch 1 is not this checkpoint's ({tmp_path / 'epoch_1'}"
        in caplog.text
    )
    assert f"rewriting it from {tmp_path / 'step_6'}" in caplog.text
    assert (
        f"resume_from_checkpoint=True: {tmp_path / 'step_6'} is at the end of "
        "training (2 epochs done, epochs=2): nothing left to do." in caplog.text
    )
    assert_weights_close(
        load_weights(tmp_path / "epoch_1" / SHARD),
        load_weights(single_runs["bwd"].output_dir / "epoch_1" / SHARD),
        **BITWISE,
    )
    verify(tmp_path / "epoch_1", export_manifest(tmp_path / "epoch_1"))


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
    a_run_id = read_run_file(tmp_path)
    assert a_run_id is not None

    def resumable() -> dict[str, Any]:
        files = snapshot_files(tmp_path).items()
        return {k: v for k, v in files if k.startswith("step_") or k == RUN_FILE}

    # Killed before its first save: A's resumable state is as it was.
    a_state = resumable()
    killed_run("after_step:1", tiny_assets, tmp_path, log_name="b0.txt")
    assert resumable() == a_state

    before = killed_run("after_step:3", tiny_assets, tmp_path, log_name="b.txt")
    assert list(losses(before)) == [1, 2, 3]
    # B's own checkpoints: step_2, and none of A's (deleted once B's step_2 was
    # whole, as B said at start).
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2"]
    assert read_run_file(tmp_path) not in (None, a_run_id)

    resumed = resume_here(tiny_assets, tmp_path)
    assert_resumed_as_uninterrupted(resumed, run_a, 2, f"epoch_1/{SHARD}")
    said = (tmp_path / "logs" / "b.out").read_text()
    assert "holds an earlier run's resumable state" in said
    assert "an earlier run's resumable state: " in said
    # A's exports were replaced by B's (the same bytes: the same config), and
    # nothing of A's was kept: as in 0.6.1.
    for name in ("epoch_0", "epoch_1"):
        assert (tmp_path / name / SHARD).read_bytes() == (
            run_a.output_dir / name / SHARD
        ).read_bytes()


def test_a_second_run_is_refused_while_one_trains_in_the_folder(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    first = crash_run.start(
        "pause_after_step:3",
        SINGLE,
        SINGLE_CONFIG,
        overrides(tiny_assets, True),
        tmp_path,
        log_name="first.txt",
    )
    try:
        deadline = time.monotonic() + 120
        while 3 not in first.logged():
            assert first.process.is_alive() and time.monotonic() < deadline, (
                "the first run did not reach step 3\n"
                + first.output.read_text(errors="replace")[-6000:]
            )
            time.sleep(0.2)
        # Every file but the live run's growing logs: its config copy included.
        before = {
            k: v
            for k, v in snapshot_files(tmp_path).items()
            if not k.startswith("logs")
        }
        with pytest.raises(
            CheckpointError,
            match=f"in use by another run \\(process {first.process.pid} on host ",
        ):
            run_tune_in_process(
                SINGLE, SINGLE_CONFIG, overrides(tiny_assets, True), tmp_path
            )
        after = snapshot_files(tmp_path)
        assert {k: v for k, v in after.items() if not k.startswith("logs")} == before
    finally:
        first.kill()


# -- what a resume must never silently change ------------------------------------------


def write_rows(assets: TinyAssets, path: Path, rows: int) -> Path:
    import json

    data = json.loads(assets.train_data.read_text())
    path.write_text(json.dumps(data[:rows]))
    return path


def test_a_resume_with_other_settings_is_refused_unless_resume_allow_changes(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    shutil.copytree(single_runs["bwd"].output_dir / "step_3", tmp_path / "step_3")
    # Another dataset (which only the recipe's own data shows), as many steps an epoch.
    change = {
        "dataset.data_files": write_rows(tiny_assets, tmp_path / "small.json", 64)
    }
    # Every file, the logs and the config copy included: a refused run writes none.
    before = snapshot_files(tmp_path)
    with pytest.raises(
        CheckpointError, match="was trained with other settings"
    ) as refused:
        resume_here(tiny_assets, tmp_path, **change)
    for named in ("dataset_length: 512 then, 64 now", "resume_allow_changes=True"):
        assert named in str(refused.value)
    assert snapshot_files(tmp_path) == before
    # Shorter epochs are refused even with resume_allow_changes: the resumed epoch
    # would run past its end.
    with pytest.raises(CheckpointError, match="steps_per_epoch: 3 then, 2 now"):
        resume_here(
            tiny_assets,
            tmp_path,
            resume_allow_changes=True,
            max_steps_per_epoch=2,
            **change,
        )
    assert snapshot_files(tmp_path) == before

    with caplog.at_level(logging.WARNING):
        resumed = resume_here(
            tiny_assets, tmp_path, resume_allow_changes=True, **change
        )
    assert "resume_allow_changes=True: resuming" in caplog.text
    assert "dataset_length: 512 then, 64 now" in caplog.text
    assert_steps(resumed, [4, 5, 6])
    assert verify(tmp_path / "step_6")


def test_an_output_dir_in_the_base_checkpoint_folder_is_refused_before_any_write(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    # 0.6.1's checkpointer refused it only after logs/ and the config copy had been
    # written into the base model's folder.
    base = tmp_path / "base"
    shutil.copytree(tiny_assets.checkpoint_dir, base)
    before = snapshot_files(base)
    settings = overrides(tiny_assets, True) | {"checkpointer.checkpoint_dir": base}
    with pytest.raises(ValueError, match=f"output_dir={base} is inside "):
        run_tune_in_process(SINGLE, SINGLE_CONFIG, settings, base)
    assert snapshot_files(base) == before


# -- torchtune 0.6.1's documented workflows, as its docs write them ----------------------

# 0.6.1's own defaults: no step checkpoints between epoch ends, none kept at the end.
AS_IN_0_6_1 = {"save_every_n_steps": None, "checkpointer.keep_last_n_checkpoints": None}


@pytest.mark.parametrize(
    "named",
    [
        # deep_dives/checkpointer.rst: "resume_from_checkpoint: True" and
        # checkpoint_files pointed at epoch_{N}/ of output_dir.
        {"checkpointer.checkpoint_files": [f"epoch_0/{SHARD}"]},
        {},  # resume_from_checkpoint alone: the newest checkpoint is found
    ],
    ids=["as documented", "resume_from_checkpoint alone"],
)
def test_a_killed_run_with_0_6_1_defaults_resumes_bitwise(
    single_runs: dict[str, TuneRun],
    tiny_assets: TinyAssets,
    tmp_path: Path,
    named: dict[str, Any],
) -> None:
    # Killed in epoch 1, epoch_0 saved.
    killed_run("after_step:5", tiny_assets, tmp_path, **AS_IN_0_6_1)
    # Only the newest epoch-end checkpoint is kept without save_every_n_steps.
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_3"]
    resumed = resume_here(tiny_assets, tmp_path, **AS_IN_0_6_1, **named)
    assert_resumed_as_uninterrupted(
        resumed, single_runs["bwd"], STEPS_PER_EPOCH, f"epoch_1/{SHARD}"
    )
    # Finished, the folder holds what 0.6.1 leaves, plus under 2 KB of metadata (the
    # run's name and the exports' manifests): none of its step checkpoints.
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
