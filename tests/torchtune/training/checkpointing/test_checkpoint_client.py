"""Tests for CheckpointClient with plain and in-backward optimizers.

In one process and on 2 gloo processes with FSDP2 (the latter run by
``tests/torchtune/training/optimizer_in_backward_scenarios.py``). Resumed runs are
compared with uninterrupted ones bitwise (``rtol=0, atol=0``): a checkpoint restores
exactly the tensors that were saved, and training then runs the same kernels.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from tests.torchtune.distributed_launcher import DistributedRun
from tests.torchtune.training.optimizer_in_backward_scenarios import SCENARIOS
from torchtune import training
from torchtune.training import OptimizerInBackward
from torchtune.training.checkpointing._checkpoint_client import (
    CheckpointClient,
    TrainingProgress,
)

BITWISE = {"rtol": 0, "atol": 0}
ADAMW = {"lr": 0.05, "weight_decay": 0.1}


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def make_optimizer(in_backward: bool, model: nn.Module) -> torch.optim.Optimizer:
    if in_backward:
        return OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    return torch.optim.AdamW(model.parameters(), **ADAMW)


def client_config(tmp_path: Path, *, asynchronous: bool, resume: bool) -> DictConfig:
    base = tmp_path / "base"
    base.mkdir(parents=True, exist_ok=True)
    torch.save(make_model().state_dict(), base / "model.pt")
    return OmegaConf.create(
        {
            "device": "cpu",
            "resume_from_checkpoint": resume,
            "enable_async_checkpointing": asynchronous,
            "checkpointer": {
                "_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                "checkpoint_dir": str(base),
                "checkpoint_files": ["model.pt"],
                "output_dir": str(tmp_path / "out"),
                "model_type": "LLAMA2",
            },
        }
    )


PROGRESS = TrainingProgress(seed=7, epochs_run=1, total_epochs=3, max_steps_per_epoch=3)


def reference_after_6_steps() -> nn.Module:
    reference = make_model()
    train(reference, make_optimizer(False, reference), range(6))
    return reference


# DCP notes that it saves and loads in a single process: intended here.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("load_in_backward", [True, False], ids=["in_bwd", "plain"])
def test_async_save_then_load_restores_in_backward_optimizer_state(
    tmp_path: Path, load_in_backward: bool
) -> None:
    model = make_model()
    optimizer = make_optimizer(True, model)
    train(model, optimizer, range(3))
    saved_state = copy.deepcopy(optimizer.state_dict()["state"])
    client = CheckpointClient(client_config(tmp_path, asynchronous=True, resume=False))
    client.save_checkpoint(model, optimizer, PROGRESS, epoch=0)
    client.wait_for_async_save()

    resumed = make_model(seed=1)
    new_optimizer = make_optimizer(load_in_backward, resumed)
    loaded = CheckpointClient(
        client_config(tmp_path, asynchronous=True, resume=True)
    ).load_distributed_checkpoint(resumed, new_optimizer)
    assert loaded[training.EPOCHS_KEY] == 1 and loaded[training.SEED_KEY] == 7
    # 0.6.1 restored no in-backward optimizer state here, and said nothing.
    torch.testing.assert_close(
        new_optimizer.state_dict()["state"], saved_state, **BITWISE
    )
    train(resumed, new_optimizer, range(3, 6))
    torch.testing.assert_close(
        dict(resumed.named_parameters()),
        dict(reference_after_6_steps().named_parameters()),
        **BITWISE,
    )


def test_async_load_without_a_checkpoint_raises(tmp_path: Path) -> None:
    # A resume is refused when the client is built, before anything else is.
    with pytest.raises(ValueError, match="^resume_from_checkpoint=True, but there is"):
        CheckpointClient(client_config(tmp_path, asynchronous=True, resume=True))
    model = make_model()
    client = CheckpointClient(client_config(tmp_path, asynchronous=True, resume=False))
    with pytest.raises(ValueError, match="No intermediate checkpoint"):
        client.load_distributed_checkpoint(model, make_optimizer(True, model))


def test_sync_intermediate_save_holds_full_in_backward_state_and_progress(
    tmp_path: Path,
) -> None:
    model = make_model()
    optimizer = make_optimizer(True, model)
    train(model, optimizer, range(3))
    client = CheckpointClient(client_config(tmp_path, asynchronous=False, resume=False))
    client.save_checkpoint(model, optimizer, PROGRESS, epoch=0)

    (recipe_state,) = (tmp_path / "out").rglob("recipe_state.pt")
    checkpoint = torch.load(recipe_state, weights_only=False)
    assert checkpoint[training.EPOCHS_KEY] == 1
    (weights,) = (tmp_path / "out" / "epoch_0").glob("*.bin")
    resumed = make_model(seed=1)
    resumed.load_state_dict(torch.load(weights, weights_only=True))
    new_optimizer = make_optimizer(True, resumed)
    # In one process, the torch.optim format (keyed by index), as single-device
    # recipes have always saved it.
    assert set(checkpoint[training.OPT_KEY]["state"]) == set(range(4))
    new_optimizer.load_state_dict(checkpoint[training.OPT_KEY])
    train(resumed, new_optimizer, range(3, 6))
    torch.testing.assert_close(
        dict(resumed.named_parameters()),
        dict(reference_after_6_steps().named_parameters()),
        **BITWISE,
    )


def test_final_save_writes_weights_without_optimizer_state(tmp_path: Path) -> None:
    model = make_model()
    optimizer = make_optimizer(True, model)
    train(model, optimizer, range(1))
    client = CheckpointClient(client_config(tmp_path, asynchronous=True, resume=False))
    last = TrainingProgress(seed=7, epochs_run=3, total_epochs=3, max_steps_per_epoch=3)
    client.save_checkpoint(model, optimizer, last, epoch=2)  # last epoch: synchronous
    (weights,) = (tmp_path / "out" / "epoch_2").glob("*.bin")
    torch.testing.assert_close(
        torch.load(weights, weights_only=True), model.state_dict(), **BITWISE
    )
    assert not list((tmp_path / "out").rglob("recipe_state.pt"))


@pytest.mark.parametrize(
    "scenario", [n for n in SCENARIOS if n.startswith("checkpoint_client")]
)
def test_two_gloo_processes_fsdp2(
    optimizer_in_backward_distributed_run: DistributedRun, scenario: str
) -> None:
    """Async DCP save + load and sync full save of an FSDP2 model's in-backward
    optimizer, resumed bitwise; see optimizer_in_backward_scenarios.py."""
    outcome = optimizer_in_backward_distributed_run.outcome(scenario)
    assert outcome == "ok", outcome


def _saved_progress() -> dict:
    return TrainingProgress(
        seed=7, epochs_run=1, total_epochs=2, max_steps_per_epoch=5
    ).state_dict()


def test_progress_from_checkpoint_takes_seed_and_steps_from_it_and_epochs_from_config(
    caplog,
):
    progress = TrainingProgress.from_checkpoint(
        _saved_progress(), seed=0, total_epochs=4, max_steps_per_epoch=None
    )
    assert (progress.epochs_run, progress.seed, progress.max_steps_per_epoch) == (
        1,
        7,
        5,
    )
    assert progress.total_epochs == 4
    # each differing value is named, with both values
    assert "seed=0" in caplog.text and "max_steps_per_epoch=None" in caplog.text
    assert "epochs=4" in caplog.text


def test_progress_from_checkpoint_raises_naming_the_missing_recipe_state():
    saved = _saved_progress()
    del saved[training.SEED_KEY]
    with pytest.raises(KeyError, match=training.SEED_KEY):
        TrainingProgress.from_checkpoint(
            saved, seed=7, total_epochs=2, max_steps_per_epoch=5
        )


# -- the loop's side: track, step_done, epoch_done, resume -----------------------------


def _loop_config(tmp_path: Path, *, resume: bool, **options) -> DictConfig:
    cfg = client_config(tmp_path, asynchronous=False, resume=resume)
    cfg.output_dir = str(tmp_path / "out")
    return OmegaConf.merge(cfg, OmegaConf.create(options))


def _data_loader() -> StatefulDataLoader:
    data = [
        torch.randn(6, generator=torch.Generator().manual_seed(i)) for i in range(8)
    ]
    sampler = StatefulDistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
    return StatefulDataLoader(data, batch_size=2, sampler=sampler)


def _run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    client: CheckpointClient,
    *,
    stop_after: int | None = None,
    resumed=None,
    epochs: int = 2,
) -> int:
    """A recipe's loop: 4 steps an epoch, the client told after each step and epoch.
    Resuming, track() puts the loader back where the saved one was."""
    loader = _data_loader()
    client.track(model, optimizer, loader)
    global_step = 0 if resumed is None else resumed.global_step
    first_epoch = global_step // 4
    for epoch in range(first_epoch, epochs):
        batches = training.epoch_batches(
            loader,
            epoch,
            steps_done=global_step - epoch * 4,
            steps_per_epoch=4,
        )
        for idx, batch in batches:
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            global_step += 1
            progress = TrainingProgress(
                seed=7, epochs_run=epoch, total_epochs=epochs, max_steps_per_epoch=4
            )
            client.step_done(global_step, progress, epoch_end=idx == 3)
            if global_step == stop_after:
                return global_step
        progress = TrainingProgress(
            seed=7, epochs_run=epoch + 1, total_epochs=epochs, max_steps_per_epoch=4
        )
        client.epoch_done(epoch, global_step, progress)
    return global_step


@pytest.mark.parametrize("in_backward", [True, False], ids=["in_bwd", "plain"])
def test_a_run_resumed_mid_epoch_from_a_step_checkpoint_ends_bitwise_uninterrupted(
    tmp_path: Path, in_backward: bool
) -> None:
    reference = make_model()
    _run(
        reference,
        make_optimizer(in_backward, reference),
        CheckpointClient(_loop_config(tmp_path / "ref", resume=False)),
    )

    model = make_model()
    client = CheckpointClient(
        _loop_config(tmp_path / "run", resume=False, save_every_n_steps=3)
    )
    _run(model, make_optimizer(in_backward, model), client, stop_after=7)
    out = tmp_path / "run" / "out"
    # Due at steps 3 and 6; the epoch's end (step 4) saves one too.
    assert sorted(p.name for p in out.glob("step_*")) == ["step_3", "step_4", "step_6"]

    cfg = _loop_config(tmp_path / "run", resume=True, save_every_n_steps=3)
    client = CheckpointClient(cfg)
    resumed_model = make_model(seed=1)
    resumed_model.load_state_dict(client.load_base_checkpoint()[training.MODEL_KEY])
    optimizer = make_optimizer(in_backward, resumed_model)
    resumed = client.resume(resumed_model, optimizer, {})
    assert resumed.global_step == 6 and resumed.dataloader_state is not None
    assert resumed.recipe_state[training.EPOCHS_KEY] == 1
    _run(resumed_model, optimizer, client, resumed=resumed)
    torch.testing.assert_close(
        resumed_model.state_dict(), reference.state_dict(), **BITWISE
    )


def test_a_new_run_resumes_nothing_and_an_epoch_resume_loads_the_optimizer(
    tmp_path: Path,
) -> None:
    model = make_model()
    optimizer = make_optimizer(True, model)
    client = CheckpointClient(_loop_config(tmp_path, resume=False))
    assert client.resume(model, optimizer, client.load_base_checkpoint()) is None
    _run(model, optimizer, client, epochs=2)  # epoch_0 is intermediate

    cfg = _loop_config(tmp_path, resume=True)
    cfg.checkpointer.checkpoint_files = ["epoch_0/model-00001-of-00001.bin"]
    client = CheckpointClient(cfg)
    loaded = client.load_base_checkpoint()
    resumed_model = make_model(seed=1)
    resumed_model.load_state_dict(loaded[training.MODEL_KEY])
    new_optimizer = make_optimizer(False, resumed_model)
    progress = client.resume_progress(
        resumed_model,
        new_optimizer,
        loaded,
        TrainingProgress(seed=7, epochs_run=0, total_epochs=2, max_steps_per_epoch=4),
    )
    # An epoch checkpoint is at its epoch's end: the step count follows from it.
    assert progress.epochs_run == 1 and client.global_step(steps_per_epoch=4) == 4
    torch.testing.assert_close(
        new_optimizer.state_dict()["state"],
        loaded[training.OPT_KEY]["state"],
        **BITWISE,
    )


def test_step_checkpoints_of_a_partly_frozen_model_hold_its_trainable_part(
    tmp_path: Path,
) -> None:
    model = make_model()
    model[0].requires_grad_(False)  # frozen: the base checkpoint's
    optimizer = make_optimizer(True, model)
    client = CheckpointClient(
        _loop_config(tmp_path, resume=False, save_every_n_steps=2)
    )
    _run(model, optimizer, client, stop_after=2)
    saved = torch.load(
        tmp_path / "out" / "step_2" / "model_optimizer.pt", weights_only=False
    )
    assert sorted(saved["model"]) == ["2.bias", "2.weight"]

    client = CheckpointClient(_loop_config(tmp_path, resume=True, save_every_n_steps=2))
    resumed_model = make_model(seed=1)
    resumed_model.load_state_dict(client.load_base_checkpoint()[training.MODEL_KEY])
    resumed_model[0].requires_grad_(False)
    client.resume(resumed_model, make_optimizer(True, resumed_model), {})
    torch.testing.assert_close(
        resumed_model.state_dict(), model.state_dict(), **BITWISE
    )
    # A model whose trainable part the checkpoint lacks is refused, naming entries.
    other = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), nn.Linear(3, 3))
    with pytest.raises(training.CheckpointError, match=r"missing trainable .*3\.bias"):
        client.resume(other, make_optimizer(True, other), {})


def test_step_done_leaves_an_epochs_last_step_to_epoch_done(tmp_path: Path) -> None:
    model = make_model()
    optimizer = make_optimizer(True, model)
    client = CheckpointClient(
        _loop_config(tmp_path, resume=False, save_every_n_steps=2)
    )
    client.track(model, optimizer, _data_loader())
    assert client.global_step(steps_per_epoch=4) == 0  # a new run
    progress = TrainingProgress(
        seed=7, epochs_run=0, total_epochs=2, max_steps_per_epoch=4
    )
    for step in (2, 4, 6):
        client.step_done(step, progress)
    # Step 4 ends epoch 0: epoch_done saves it, with the next epoch's fresh loader.
    assert sorted(p.name for p in (tmp_path / "out").glob("step_*")) == [
        "step_2",
        "step_6",
    ]


# -- runs, refusals and messages -------------------------------------------------------


def _started(cfg: DictConfig) -> CheckpointClient:
    """A client whose run has started (a new run's or a resumed run's)."""
    client = CheckpointClient(cfg)
    client.load_base_checkpoint()
    return client


def test_a_new_run_in_a_used_folder_never_resumes_or_loses_the_earlier_runs_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run" / "out"
    run_a = make_model()
    client_a = _started(
        _loop_config(tmp_path / "run", resume=False, save_every_n_steps=3)
    )
    _run(run_a, make_optimizer(True, run_a), client_a)  # steps 3, 4, 6, 8
    a_files = {
        p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()
    }

    # Run B, in the same folder, is killed after step 5: its newest checkpoint is
    # step_4, older than run A's step_8.
    cfg_b = _loop_config(tmp_path / "run", resume=False, save_every_n_steps=3)
    cfg_b.optimizer = {"_component_": "torch.optim.AdamW"}
    with caplog.at_level("WARNING"):
        client_b = _started(cfg_b)
    aside = out / "previous_runs" / f"run_{client_a.run_id}"
    assert f"moved them to {aside}" in caplog.text
    assert client_b.run_id != client_a.run_id
    model_b = make_model(seed=2)
    _run(model_b, make_optimizer(True, model_b), client_b, stop_after=5)

    cfg = _loop_config(tmp_path / "run", resume=True, save_every_n_steps=3)
    cfg.optimizer = {"_component_": "torch.optim.AdamW"}
    client = _started(cfg)
    assert client.run_id == client_b.run_id
    resumed_model = make_model(seed=2)
    optimizer = make_optimizer(True, resumed_model)
    resumed = client.resume(resumed_model, optimizer, {})
    assert resumed.global_step == 4  # run B's, not run A's step_8
    _run(resumed_model, optimizer, client, resumed=resumed)

    uninterrupted = make_model(seed=2)
    _run(
        uninterrupted,
        make_optimizer(True, uninterrupted),
        _started(_loop_config(tmp_path / "ref", resume=False)),
    )
    torch.testing.assert_close(
        resumed_model.state_dict(), uninterrupted.state_dict(), **BITWISE
    )
    # Every file of run A is still there, byte for byte, set aside.
    for name, data in a_files.items():
        assert (aside / name).read_bytes() == data, name


def test_resuming_another_optimizer_class_is_refused_before_anything_is_built(
    tmp_path: Path,
) -> None:
    model = make_model()
    optimizer = make_optimizer(False, model)
    cfg = _loop_config(tmp_path, resume=False)
    cfg.optimizer = {"_component_": "torch.optim.AdamW"}
    CheckpointClient(cfg).save_checkpoint(model, optimizer, PROGRESS, epoch=0)
    resume = _loop_config(tmp_path, resume=True)
    resume.checkpointer.checkpoint_files = ["epoch_0/model-00001-of-00001.bin"]
    # The same class under another path resumes.
    resume.optimizer = {"_component_": "torch.optim.adamw.AdamW"}
    _started(resume)
    resume.optimizer = {"_component_": "torch.optim.SGD"}
    with pytest.raises(
        ValueError,
        match=r"^optimizer._component_=torch.optim.SGD cannot resume from the epoch "
        r"checkpoint's recipe state: its optimizer state was saved by "
        r"torch.optim.AdamW, and another optimizer class cannot load it. Set "
        r"optimizer._component_=torch.optim.AdamW to resume",
    ):
        _started(resume)


def test_resuming_a_finished_run_says_there_is_nothing_left_to_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = make_model()
    cfg = _loop_config(tmp_path, resume=False, save_every_n_steps=3, epochs=2)
    with caplog.at_level("INFO"):
        _run(model, make_optimizer(True, model), _started(cfg))
    out = tmp_path / "out"
    assert (
        f"Training done (2 epochs). Final weights in {out}/epoch_1; step checkpoints"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level("WARNING"):
        client = _started(
            _loop_config(tmp_path, resume=True, save_every_n_steps=3, epochs=2)
        )
    assert client._step_checkpoint == out / "step_8"
    assert (
        f"resume_from_checkpoint=True: {out / 'step_8'} is at the end of training "
        "(2 epochs done, epochs=2): nothing left to do." in caplog.text
    )


def test_keep_last_n_without_step_checkpoints_warns_that_it_does_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _loop_config(tmp_path, resume=False)
    cfg.checkpointer.keep_last_n_checkpoints = 2
    with caplog.at_level("WARNING"):
        CheckpointClient(cfg)
    assert (
        "checkpointer.keep_last_n_checkpoints=2 has no effect without "
        "save_every_n_steps" in caplog.text
    )


def test_an_output_folder_that_cannot_be_written_is_refused_naming_its_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _loop_config(tmp_path, resume=False)
    cfg.output_dir = str(tmp_path / "new" / "nested")  # made later: fine
    cfg.checkpointer.output_dir = str(tmp_path / "ckpt")
    CheckpointClient(cfg)
    (tmp_path / "a_file").write_text("")
    cfg.checkpointer.output_dir = str(tmp_path / "a_file" / "out")
    with pytest.raises(
        PermissionError,
        match=f"^checkpointer.output_dir={tmp_path}/a_file/out cannot be made: "
        f"{tmp_path}/a_file is a file",
    ):
        CheckpointClient(cfg)
    # As a user without write permission in tmp_path sees it (root may write
    # anywhere, so permissions cannot show it here).
    import os

    real_access = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda path, mode: Path(path) != tmp_path and real_access(path, mode),
    )
    cfg.checkpointer.output_dir = str(tmp_path / "ckpt")
    with pytest.raises(
        PermissionError,
        match=f"^output_dir={tmp_path}/new/nested cannot be written: this process has "
        f"no write permission in {tmp_path}",
    ):
        CheckpointClient(cfg)
