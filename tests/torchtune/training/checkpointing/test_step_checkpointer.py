"""Tests for torchtune/training/checkpointing/_step_checkpointer.py: step checkpoints
that resume exactly and that a crash or a damaged file never makes unusable.

Resumed training is compared bitwise: the same kernels run on the same values."""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from torchtune.training import OptimizerInBackward
from torchtune.training.checkpointing._step_checkpointer import (
    MANIFEST,
    MODEL_OPTIMIZER_FILE,
    RUN_FILE,
    CheckpointError,
    StepCheckpointer,
    file_checksum,
    read_run_file,
    restore_rng_state,
    run_id_of,
    set_aside_previous_run,
    verify,
    write_run_file,
)

BITWISE = {"rtol": 0, "atol": 0}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))


def make_optimizer(model: nn.Module, in_backward: bool) -> torch.optim.Optimizer:
    if in_backward:
        return OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=0.01)
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    # Dropout draws from the global RNG, so an exact resume needs the RNG state too.
    for step in steps:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def save_at(checkpointer: StepCheckpointer, step: int, model, optimizer) -> Path:
    return checkpointer.save(
        step, model, optimizer, {"epochs_run": 0}, {"dataloader": {"seen": step}}
    )


@pytest.mark.parametrize(
    ("save_in_backward", "load_in_backward"),
    [(False, False), (True, True), (False, True), (True, False)],
)
def test_resume_from_a_step_checkpoint_continues_bitwise(
    tmp_path: Path, save_in_backward: bool, load_in_backward: bool
) -> None:
    reference = make_model()
    train(reference, make_optimizer(reference, False), range(6))

    model = make_model()
    optimizer = make_optimizer(model, save_in_backward)
    checkpointer = StepCheckpointer(tmp_path, every_n_steps=3)
    train(model, optimizer, range(3))
    path = save_at(checkpointer, 3, model, optimizer)
    torch.manual_seed(1234)  # what a new process would have: another RNG state
    if save_in_backward:
        optimizer.remove_hooks()

    resumed = make_model()
    new_optimizer = make_optimizer(resumed, load_in_backward)
    assert checkpointer.find_latest() == path
    recipe_state, rank_state = checkpointer.load(path, resumed, new_optimizer)
    assert recipe_state["global_step"] == 3 and recipe_state["epochs_run"] == 0
    restore_rng_state(rank_state.pop("rng"))
    assert rank_state == {"dataloader": {"seen": 3}}
    train(resumed, new_optimizer, range(3, 6))
    torch.testing.assert_close(
        dict(resumed.named_parameters()), dict(reference.named_parameters()), **BITWISE
    )


def test_is_due_every_n_steps_and_never_when_null(tmp_path: Path) -> None:
    assert [s for s in range(1, 10) if StepCheckpointer(tmp_path, 3).is_due(s)] == [
        3,
        6,
        9,
    ]
    assert not any(StepCheckpointer(tmp_path, None).is_due(s) for s in range(1, 10))


@pytest.mark.parametrize(
    ("every", "keep", "named"),
    [
        (0, None, "save_every_n_steps=0"),
        (2.5, None, "save_every_n_steps=2.5"),
        (2, 0, "checkpointer.keep_last_n_checkpoints=0"),
    ],
)
def test_invalid_options_are_refused_naming_the_key(
    tmp_path: Path, every, keep, named: str
) -> None:
    with pytest.raises(ValueError, match=f"{named} must be a positive integer or null"):
        StepCheckpointer(tmp_path, every, keep)


def test_keep_last_n_deletes_older_step_checkpoints_once_a_new_one_is_whole(
    tmp_path: Path,
) -> None:
    model = make_model()
    optimizer = make_optimizer(model, True)
    checkpointer = StepCheckpointer(tmp_path, every_n_steps=1, keep_last_n=2)
    (tmp_path / "epoch_0").mkdir()  # epoch checkpoints are not step checkpoints
    for step in range(1, 5):
        train(model, optimizer, range(step - 1, step))
        save_at(checkpointer, step, model, optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0", "step_3", "step_4"]


def test_a_crash_mid_save_leaves_the_previous_checkpoint_the_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model()
    optimizer = make_optimizer(model, False)
    checkpointer = StepCheckpointer(tmp_path, every_n_steps=1)
    first = save_at(checkpointer, 1, model, optimizer)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing")

    # The process dies while the recipe state (written after the model) is written.
    real_save = torch.save

    def save_then_crash_on_recipe_state(obj, f, *args, **kwargs):
        if "global_step" in obj:
            crash()
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_then_crash_on_recipe_state)
    with pytest.raises(KeyboardInterrupt):
        save_at(checkpointer, 2, model, optimizer)
    monkeypatch.undo()
    assert not (tmp_path / "step_2").exists()
    assert checkpointer.find_latest() == first
    # The next save at that step cleans up what the crash left.
    save_at(checkpointer, 2, model, optimizer)
    assert checkpointer.find_latest() == tmp_path / "step_2"
    assert not list(tmp_path.glob(".step_*"))


def test_a_truncated_newest_checkpoint_is_skipped_with_a_warning_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = make_model()
    optimizer = make_optimizer(model, False)
    checkpointer = StepCheckpointer(tmp_path, every_n_steps=1)
    first = save_at(checkpointer, 1, model, optimizer)
    second = save_at(checkpointer, 2, model, optimizer)
    damaged = second / MODEL_OPTIMIZER_FILE
    damaged.write_bytes(damaged.read_bytes()[:100])

    with caplog.at_level(logging.WARNING):
        assert checkpointer.find_latest() == first
    assert str(damaged) in caplog.text
    # Named explicitly, it is an error that names the file.
    with pytest.raises(CheckpointError, match=str(damaged)):
        checkpointer.load(second, make_model(), make_optimizer(make_model(), False))


def test_a_folder_without_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "step_7").mkdir()
    with pytest.raises(CheckpointError, match=MANIFEST):
        verify(tmp_path / "step_7")
    assert StepCheckpointer(tmp_path, 1).find_latest() is None


def test_saving_a_step_again_replaces_it_whole(tmp_path: Path) -> None:
    model = make_model()
    optimizer = make_optimizer(model, False)
    checkpointer = StepCheckpointer(tmp_path, every_n_steps=1)
    save_at(checkpointer, 1, model, optimizer)
    train(model, optimizer, range(1))
    path = save_at(checkpointer, 1, model, optimizer)
    verify(path)
    restored = make_model()
    checkpointer.load(path, restored, make_optimizer(restored, False))
    torch.testing.assert_close(
        dict(restored.named_parameters()), dict(model.named_parameters()), **BITWISE
    )


def epoch_recipe_state(tmp_path: Path, epochs_run: int) -> None:
    (tmp_path / "recipe_state").mkdir(exist_ok=True)
    torch.save(
        {"epochs_run": epochs_run}, tmp_path / "recipe_state" / "recipe_state.pt"
    )


def test_resume_point_prefers_whichever_checkpoint_is_further_along(
    tmp_path: Path,
) -> None:
    model = make_model()
    optimizer = make_optimizer(model, False)
    checkpointer = StepCheckpointer(tmp_path, every_n_steps=1)
    assert checkpointer.resume_point(None) is None  # nothing saved: 0.6.1's path
    step = checkpointer.save(
        5, model, optimizer, {"epochs_run": 1}, {"dataloader": None}
    )
    assert checkpointer.resume_point(None) == step  # no epoch checkpoint
    epoch_recipe_state(tmp_path, epochs_run=1)  # epoch 0 done; step 5 is in epoch 1
    assert checkpointer.resume_point(None) == step
    epoch_recipe_state(tmp_path, epochs_run=2)  # epoch 1 done after step 5
    assert checkpointer.resume_point(None) is None
    # A torn epoch recipe state (a kill while torch.save wrote it in place).
    (tmp_path / "recipe_state" / "recipe_state.pt").write_bytes(b"PK\x03\x04torn")
    assert checkpointer.resume_point(None) == step


def test_resume_point_follows_an_explicitly_named_checkpoint(tmp_path: Path) -> None:
    model = make_model()
    optimizer = make_optimizer(model, False)
    checkpointer = StepCheckpointer(tmp_path, every_n_steps=1)
    first = save_at(checkpointer, 1, model, optimizer)
    save_at(checkpointer, 2, model, optimizer)
    assert checkpointer.resume_point("step_1/recipe_state.pt") == first
    assert checkpointer.resume_point("recipe_state/recipe_state.pt") is None
    (first / "recipe_state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=str(first / "recipe_state.pt")):
        checkpointer.resume_point("step_1/recipe_state.pt")


# -- content checksums ------------------------------------------------------------


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_manifest_records_each_files_size_crc32_and_run_id(tmp_path: Path) -> None:
    model = make_model()
    checkpointer = StepCheckpointer(tmp_path, every_n_steps=1, run_id="run-a")
    path = save_at(checkpointer, 1, model, make_optimizer(model, False))
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["run_id"] == "run-a" and run_id_of(path) == "run-a"
    assert set(manifest["files"]) == {
        MODEL_OPTIMIZER_FILE,
        "rank_0.pt",
        "recipe_state.pt",
    }
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


@pytest.mark.parametrize("where", ["first byte", "middle", "last byte"])
def test_any_changed_byte_is_caught_before_loading_and_resume_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    model = make_model()
    optimizer = make_optimizer(model, False)
    checkpointer = StepCheckpointer(tmp_path, every_n_steps=1, run_id="run-a")
    first = save_at(checkpointer, 1, model, optimizer)
    second = save_at(checkpointer, 2, model, optimizer)
    damaged = second / MODEL_OPTIMIZER_FILE
    size = damaged.stat().st_size
    # The last byte is in the zip's end record, which torch.load reads first.
    flip_byte(
        damaged, {"first byte": 0, "middle": size // 2, "last byte": size - 1}[where]
    )
    assert damaged.stat().st_size == size  # a size check alone misses it

    with caplog.at_level(logging.WARNING):
        assert checkpointer.find_latest() == first
        assert checkpointer.resume_point(None) == first
    assert f"{damaged} is damaged: its content changed" in caplog.text
    # Named explicitly, it is an error that names the file, raised before loading.
    with pytest.raises(CheckpointError, match=str(damaged)):
        checkpointer.resume_point("step_2")
    with pytest.raises(CheckpointError, match=str(damaged)):
        checkpointer.load(second, make_model(), make_optimizer(make_model(), False))


def test_a_checkpoint_verified_once_is_checked_again_after_it_changes(
    tmp_path: Path,
) -> None:
    model = make_model()
    checkpointer = StepCheckpointer(tmp_path, every_n_steps=1)
    path = save_at(checkpointer, 1, model, make_optimizer(model, False))
    assert checkpointer.find_latest() == path
    flip_byte(path / "rank_0.pt", 10)
    assert checkpointer.find_latest() is None


def test_a_manifest_without_checksums_or_run_id_still_resumes_by_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # What this project wrote before checkpoints carried checksums and run ids.
    model = make_model()
    optimizer = make_optimizer(model, False)
    train(model, optimizer, range(2))
    checkpointer = StepCheckpointer(tmp_path, every_n_steps=1, run_id="run-a")
    path = save_at(checkpointer, 3, model, optimizer)
    manifest = json.loads((path / MANIFEST).read_text())
    legacy = {
        "version": 1,
        "global_step": 3,
        "world_size": 1,
        "files": {name: entry["size"] for name, entry in manifest["files"].items()},
    }
    (path / MANIFEST).write_text(json.dumps(legacy))
    assert run_id_of(path) is None
    fresh = StepCheckpointer(tmp_path, every_n_steps=1)
    with caplog.at_level(logging.WARNING):
        # Legacy checkpoints belong to whichever run resumes in their folder.
        assert fresh.resume_point(None, run_id="run-b") == path
    assert "its content cannot be verified" in caplog.text
    restored = make_model()
    fresh.load(path, restored, make_optimizer(restored, False))
    torch.testing.assert_close(
        dict(restored.named_parameters()), dict(model.named_parameters()), **BITWISE
    )


# -- run identity -----------------------------------------------------------------


def test_a_resume_only_picks_the_checkpoints_of_its_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = make_model()
    optimizer = make_optimizer(model, False)
    older = StepCheckpointer(tmp_path, every_n_steps=1, run_id="run-a")
    save_at(older, 6, model, optimizer)
    newer = StepCheckpointer(tmp_path, every_n_steps=1, run_id="run-b")
    mine = save_at(newer, 2, model, optimizer)
    with caplog.at_level(logging.WARNING):
        assert newer.resume_point(None, run_id="run-b") == mine
    assert "belongs to run run-a, not to run run-b" in caplog.text
    assert newer.resume_point(None) == tmp_path / "step_6"  # any run: the newest


def test_keep_last_n_never_deletes_another_runs_checkpoints(tmp_path: Path) -> None:
    model = make_model()
    optimizer = make_optimizer(model, False)
    save_at(StepCheckpointer(tmp_path, 1, run_id="run-a"), 9, model, optimizer)
    checkpointer = StepCheckpointer(tmp_path, 1, keep_last_n=1, run_id="run-b")
    for step in (1, 2):
        save_at(checkpointer, step, model, optimizer)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_9"]


def test_a_new_run_moves_an_earlier_runs_checkpoints_aside_and_deletes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = make_model()
    optimizer = make_optimizer(model, False)
    out, epochs = tmp_path / "out", tmp_path / "epochs"
    write_run_file(out, "run-a")
    save_at(StepCheckpointer(out, 1, run_id="run-a"), 6, model, optimizer)
    for folder in ("epoch_0", "epoch_1", "recipe_state", "dist_epoch_0"):
        (epochs / folder).mkdir(parents=True)
        (epochs / folder / "weights.bin").write_bytes(folder.encode())
    (out / "logs").mkdir()  # not a checkpoint: stays
    before = sorted(
        p.read_bytes() for root in (out, epochs) for p in root.rglob("*") if p.is_file()
    )
    with caplog.at_level(logging.WARNING):
        # The new run starts from the earlier run's epoch_1: it stays in place.
        moved = set_aside_previous_run(
            [out, epochs], keep=[epochs, epochs / "epoch_1" / "weights.bin"]
        )
    assert moved == out / "previous_runs" / "run_run-a"
    assert sorted(p.name for p in moved.iterdir()) == sorted([RUN_FILE, "step_6"])
    aside = epochs / "previous_runs" / "run_run-a"
    assert sorted(p.name for p in aside.iterdir()) == [
        "dist_epoch_0",
        "epoch_0",
        "recipe_state",
    ]
    assert (epochs / "epoch_1").is_dir() and (out / "logs").is_dir()
    assert read_run_file(out) is None
    assert str(aside) in caplog.text and "step_6" in caplog.text
    after = sorted(
        p.read_bytes() for root in (out, epochs) for p in root.rglob("*") if p.is_file()
    )
    assert after == before  # every file is still there, unchanged
    verify(moved / "step_6")
    # Nothing left to move: the next call moves nothing; a second earlier run
    # with the same id goes beside the first, never into it.
    assert set_aside_previous_run([out, epochs], keep=[epochs / "epoch_1"]) is None
    write_run_file(out, "run-a")
    assert set_aside_previous_run([out]) is None  # a run that saved nothing
    (out / "step_1").mkdir()
    assert set_aside_previous_run([out]) == out / "previous_runs" / "run_run-a.2"


def test_a_missing_named_step_checkpoint_is_an_error_listing_those_there(
    tmp_path: Path,
) -> None:
    model = make_model()
    save_at(StepCheckpointer(tmp_path, 1), 2, model, make_optimizer(model, False))
    with pytest.raises(
        CheckpointError,
        match=r"^checkpointer.recipe_checkpoint=step_9/recipe_state.pt names the step "
        r"checkpoint .*step_9, which does not exist. The step checkpoints in .* are "
        r"\['step_2'\]: name one of them",
    ):
        StepCheckpointer(tmp_path, 1).resume_point("step_9/recipe_state.pt")


def test_file_checksum_reads_files_larger_than_one_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchtune.training.checkpointing._step_checkpointer as module

    monkeypatch.setattr(module, "_CHUNK_BYTES", 7)
    data = bytes(range(256)) * 3
    (tmp_path / "f").write_bytes(data)
    assert file_checksum(tmp_path / "f") == f"{zlib.crc32(data):08x}"
    (tmp_path / "empty").write_bytes(b"")  # cannot be memory-mapped
    assert file_checksum(tmp_path / "empty") == "00000000"
