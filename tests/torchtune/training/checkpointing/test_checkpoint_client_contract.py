"""Contract tests for CheckpointClient and TrainingProgress
(torchtune/training/checkpointing/_checkpoint_client.py): config defaults, which
checkpointer resumes what, waiting for an asynchronous save, and the distributed
code paths, run in a one-process gloo group (collectives are then the identity, so
the distributed save must write exactly what the single-process one writes). Found
by mutation testing (scripts/mutation_test.sh); all run in one process.

Tolerances: saved and loaded tensors are compared bitwise (``rtol=0, atol=0``): a
checkpoint holds exactly the tensors it was given.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from torchtune import training
from torchtune.training import OptimizerInBackward
from torchtune.training.checkpointing._checkpoint_client import (
    CheckpointClient,
    TrainingProgress,
)
from torchtune.training.checkpointing._checkpointer import DistributedCheckpointer

BITWISE = {"rtol": 0, "atol": 0}
PROGRESS = TrainingProgress(seed=7, epochs_run=1, total_epochs=3, max_steps_per_epoch=3)


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=0.05)
    for step in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def client_config(tmp_path: Path, **options) -> DictConfig:
    base = tmp_path / "base"
    if not base.exists():
        base.mkdir(parents=True)
        torch.save(make_model(seed=1).state_dict(), base / "model.pt")
    return OmegaConf.create(
        {
            "device": "cpu",
            **options,
            "checkpointer": {
                "_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                "checkpoint_dir": str(base),
                "checkpoint_files": ["model.pt"],
                "output_dir": str(tmp_path / "out"),
                "model_type": "LLAMA2",
            },
        }
    )


def saved_files(tmp_path: Path) -> dict[str, object]:
    out = tmp_path / "out"
    return {
        str(path.relative_to(out)): torch.load(path, weights_only=False)
        for path in sorted(out.rglob("*"))
        if path.suffix in (".pt", ".bin")
    }


def assert_same(actual: object, expected: object, where: str = "") -> None:
    """Nested dicts and lists equal, their tensors bitwise."""
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, **BITWISE, msg=where)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


@pytest.fixture
def gloo_world_of_one() -> Iterator[None]:
    """A one-process gloo group, torn down after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- TrainingProgress ----------------------------------------------------------------------


def test_progress_round_trips_through_its_state_dict_with_the_dataloader() -> None:
    progress = TrainingProgress(
        seed=3,
        epochs_run=2,
        total_epochs=5,
        max_steps_per_epoch=9,
        dataloader_state_dict={"position": 11},
    )
    assert progress.state_dict() == {
        training.SEED_KEY: 3,
        training.EPOCHS_KEY: 2,
        training.TOTAL_EPOCHS_KEY: 5,
        training.MAX_STEPS_KEY: 9,
        training.DATALOADER_KEY: {"position": 11},
    }
    resumed = TrainingProgress.from_checkpoint(
        progress.state_dict(), seed=3, total_epochs=5, max_steps_per_epoch=9
    )
    assert resumed == progress


def test_progress_from_checkpoint_warns_only_about_values_that_differ(caplog) -> None:
    saved = PROGRESS.state_dict()
    with caplog.at_level(logging.WARNING):
        TrainingProgress.from_checkpoint(
            saved, seed=7, total_epochs=3, max_steps_per_epoch=3
        )
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_progress_from_checkpoint_takes_the_config_values_by_keyword_only() -> None:
    saved = PROGRESS.state_dict()
    progress = TrainingProgress.from_checkpoint(
        ckpt_dict=saved, seed=7, total_epochs=3, max_steps_per_epoch=3
    )
    assert progress == PROGRESS
    with pytest.raises(TypeError):
        TrainingProgress.from_checkpoint(saved, 7, 3, 3)


@pytest.mark.parametrize(
    "key", ["EPOCHS_KEY", "SEED_KEY", "MAX_STEPS_KEY", "TOTAL_EPOCHS_KEY"]
)
def test_progress_from_checkpoint_names_any_missing_key(key: str) -> None:
    saved = PROGRESS.state_dict()
    del saved[getattr(training, key)]
    with pytest.raises(KeyError, match=re.escape(f"['{getattr(training, key)}']")):
        TrainingProgress.from_checkpoint(
            saved, seed=7, total_epochs=3, max_steps_per_epoch=3
        )


# -- config defaults and resuming ----------------------------------------------------------


def test_without_resume_or_async_keys_saves_synchronously_and_loads_base_weights(
    tmp_path: Path,
) -> None:
    model, optimizer = trained()
    client = CheckpointClient(client_config(tmp_path))
    loaded = client.load_base_checkpoint()
    assert set(loaded) == {training.MODEL_KEY}
    torch.testing.assert_close(
        loaded[training.MODEL_KEY], make_model(seed=1).state_dict(), **BITWISE
    )
    client.save_checkpoint(model, optimizer, PROGRESS, epoch=0)
    assert sorted(saved_files(tmp_path)) == [
        "epoch_0/model-00001-of-00001.bin",
        "recipe_state/recipe_state.pt",
    ]


def test_synchronous_resume_loads_weights_optimizer_state_and_progress(
    tmp_path: Path,
) -> None:
    model, optimizer = trained()
    CheckpointClient(client_config(tmp_path)).save_checkpoint(
        model, optimizer, PROGRESS, epoch=0
    )
    resume = client_config(tmp_path, resume_from_checkpoint=True)
    # Resuming reads the weights from the output directory.
    resume.checkpointer.checkpoint_files = ["epoch_0/model-00001-of-00001.bin"]
    loaded = CheckpointClient(resume).load_base_checkpoint()
    torch.testing.assert_close(
        loaded[training.MODEL_KEY], model.state_dict(), **BITWISE
    )
    assert loaded[training.EPOCHS_KEY] == 1 and loaded[training.SEED_KEY] == 7
    # The torch.optim format, keyed by index, as single-device recipes save it.
    assert set(loaded[training.OPT_KEY]["state"]) == set(range(4))
    # From a step checkpoint (or an asynchronous one) the recipe state is not read:
    # the base weights load as for a new run, though recipe_state.pt is there. (An
    # asynchronous resume is refused without a DCP epoch folder: this one only has
    # to be there, as it is never read here.)
    (tmp_path / "out" / "dist_epoch_0").mkdir()
    (tmp_path / "out" / "dist_epoch_0" / ".metadata").write_bytes(b"")
    for options, resume_from_epoch in (
        ({"resume_from_checkpoint": True}, False),
        ({"resume_from_checkpoint": True, "enable_async_checkpointing": True}, True),
    ):
        client = CheckpointClient(client_config(tmp_path, **options))
        loaded = client.load_base_checkpoint(resume_from_epoch=resume_from_epoch)
        assert set(loaded) == {training.MODEL_KEY}, options


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_second_to_last_epoch_is_intermediate_and_the_last_is_final(
    tmp_path: Path, asynchronous: bool
) -> None:
    model, optimizer = trained()
    client = CheckpointClient(
        client_config(tmp_path, enable_async_checkpointing=asynchronous)
    )
    client.save_checkpoint(model, optimizer, PROGRESS, epoch=1)  # of 0, 1, 2
    if asynchronous:
        # Written by DCP in the background: the save returned with it in flight.
        assert client._dcp_checkpointer._checkpoint_future is not None
        client.wait_for_async_save()
        assert (tmp_path / "out" / "dist_epoch_1" / ".metadata").is_file()
        assert saved_files(tmp_path) == {}
    else:
        files = saved_files(tmp_path)
        assert sorted(files) == [
            "epoch_1/model-00001-of-00001.bin",
            "recipe_state/recipe_state.pt",
        ]
        recipe_state = files["recipe_state/recipe_state.pt"]
        assert recipe_state[training.EPOCHS_KEY] == 1
        assert training.OPT_KEY in recipe_state
    client.save_checkpoint(model, optimizer, PROGRESS, epoch=2)
    assert "epoch_2/model-00001-of-00001.bin" in saved_files(tmp_path)
    assert not (tmp_path / "out" / "dist_epoch_2").exists()


def test_wait_for_async_save_waits_for_and_reraises_the_last_save(
    tmp_path: Path,
) -> None:
    client = CheckpointClient(client_config(tmp_path, enable_async_checkpointing=True))
    client.wait_for_async_save()  # nothing saved yet
    dcp = DistributedCheckpointer(
        checkpoint_dir=str(tmp_path), output_dir=str(tmp_path / "out")
    )
    client._dcp_checkpointer = dcp
    client.wait_for_async_save()  # no save started
    failed = concurrent.futures.Future()
    failed.set_exception(OSError("disk full"))
    dcp._checkpoint_future = failed
    with pytest.raises(OSError, match="disk full"):
        client.wait_for_async_save()


# DCP notes that it saves and loads in a single process: intended here.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_save_and_load_log_plausible_durations(tmp_path: Path, caplog) -> None:
    model, optimizer = trained()
    client = CheckpointClient(client_config(tmp_path, enable_async_checkpointing=True))
    with caplog.at_level(logging.INFO):
        client.save_checkpoint(model, optimizer, PROGRESS, epoch=0)  # asynchronous
        client.wait_for_async_save()
        client.save_checkpoint(model, optimizer, PROGRESS, epoch=2)  # last: sync
        client.load_distributed_checkpoint(model, optimizer)
    durations = [
        float(m)
        for m in re.findall(r"(?:took|blocked|checkpoint in) (-?[\d.]+) s", caplog.text)
    ]
    assert len(durations) == 3, caplog.text
    assert all(0 <= d < 300 for d in durations), durations


# -- distributed paths in a one-process group ----------------------------------------------


def test_distributed_sync_save_writes_what_a_single_process_save_writes(
    tmp_path: Path, gloo_world_of_one, monkeypatch
) -> None:
    model, optimizer = trained()
    single, distributed = tmp_path / "single", tmp_path / "distributed"
    barriers = []
    real_barrier = dist.barrier

    def counting_barrier(*args, **kwargs):
        barriers.append(args)
        return real_barrier(*args, **kwargs)

    monkeypatch.setattr(dist, "barrier", counting_barrier)
    monkeypatch.setattr(
        CheckpointClient, "_is_distributed", staticmethod(lambda: False)
    )
    CheckpointClient(client_config(single)).save_checkpoint(
        model, optimizer, PROGRESS, epoch=0
    )
    assert barriers == []
    monkeypatch.undo()
    monkeypatch.setattr(dist, "barrier", counting_barrier)
    client = CheckpointClient(client_config(distributed))
    assert client._is_distributed()
    client.save_checkpoint(model, optimizer, PROGRESS, epoch=0)
    # gather_cpu_state_dict's one per tensor, then the client's own after the write.
    assert len(barriers) == len(model.state_dict()) + 1
    expected, written = saved_files(single), saved_files(distributed)
    # One process saves the optimizer keyed by index (optimizer.state_dict()), a
    # distributed run keyed by parameter name (the full state dict format): the same
    # state under other keys.
    names = [name for name, _ in model.named_parameters()]
    single_opt = expected["recipe_state/recipe_state.pt"][training.OPT_KEY]
    expected["recipe_state/recipe_state.pt"][training.OPT_KEY] = {
        "state": {names[i]: state for i, state in single_opt["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]}
            for group in single_opt["param_groups"]
        ],
    }
    assert_same(written, expected)


def test_distributed_async_save_gets_its_own_gloo_group_and_resumes(
    tmp_path: Path, gloo_world_of_one, monkeypatch
) -> None:
    model, optimizer = trained()
    groups = []
    real_new_group = dist.new_group

    def recording_new_group(*args, **kwargs):
        groups.append(kwargs)
        return real_new_group(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording_new_group)
    config = client_config(tmp_path, enable_async_checkpointing=True)
    client = CheckpointClient(config)
    client.save_checkpoint(model, optimizer, PROGRESS, epoch=0)
    client.wait_for_async_save()
    assert groups == [{"backend": "gloo"}]
    assert client._dcp_checkpointer._process_group is not None

    resumed = make_model(seed=2)
    new_optimizer = OptimizerInBackward(resumed.parameters(), torch.optim.AdamW)
    loaded = CheckpointClient(config).load_distributed_checkpoint(
        resumed, new_optimizer
    )
    progress = {k: v for k, v in PROGRESS.state_dict().items() if v is not None}
    assert {k: loaded[k] for k in progress} == progress
    torch.testing.assert_close(resumed.state_dict(), model.state_dict(), **BITWISE)
    torch.testing.assert_close(
        new_optimizer.state_dict()["state"], optimizer.state_dict()["state"], **BITWISE
    )


# DCP notes that it saves and loads in a single process: intended here.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpointer_writes_every_ranks_shards_itself(
    tmp_path: Path,
) -> None:
    """With a DistributedCheckpointer as the checkpointer, the synchronous save hands
    it the model's and optimizer's own (sharded) state dicts, and resuming reads them
    back."""
    model, optimizer = trained()
    client = CheckpointClient(client_config(tmp_path))
    client._checkpointer = DistributedCheckpointer(
        checkpoint_dir=str(tmp_path / "base"), output_dir=str(tmp_path / "out")
    )
    client.save_checkpoint(model, optimizer, PROGRESS, epoch=0)
    assert (tmp_path / "out" / "dist_epoch_0" / ".metadata").is_file()
    state = {
        training.MODEL_KEY: make_model(seed=2).state_dict(),
        training.OPT_KEY: optimizer.state_dict(),
        **{k: 0 for k in PROGRESS.state_dict() if k != training.DATALOADER_KEY},
    }
    loaded = client._checkpointer.load_checkpoint(state)
    torch.testing.assert_close(
        loaded[training.MODEL_KEY], model.state_dict(), **BITWISE
    )
    assert loaded[training.EPOCHS_KEY] == 1 and loaded[training.SEED_KEY] == 7


def test_a_distributed_checkpointer_can_be_the_configured_checkpointer(
    tmp_path: Path,
) -> None:
    config = client_config(tmp_path)
    config.checkpointer = {
        "_component_": "torchtune.training.DistributedCheckpointer",
        "checkpoint_dir": str(tmp_path / "base"),
        "output_dir": str(tmp_path / "out"),
    }
    checkpointer = CheckpointClient(config)._get_checkpointer()
    assert isinstance(checkpointer, DistributedCheckpointer)
