"""Tests for torchtune/training/checkpointing/_step_checkpointer.py: step checkpoints
that resume exactly and that a crash or a damaged file never makes unusable.

Resumed training is compared bitwise: the same kernels run on the same values."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from torchtune.training import OptimizerInBackward
from torchtune.training.checkpointing._step_checkpointer import (
    MANIFEST,
    MODEL_OPTIMIZER_FILE,
    CheckpointError,
    StepCheckpointer,
    restore_rng_state,
    verify,
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
