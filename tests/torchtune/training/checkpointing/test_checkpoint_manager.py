"""Tests for torchtune/training/checkpointing/ (_checkpoint_manager.py, _run_folder.py,
_step_format.py): saving a run and resuming it exactly, that no crash, damaged file or
second run makes a checkpoint unusable or lost, and the refusals that keep a resume on
the run's trajectory.

Each test drives :class:`CheckpointManager` the way a recipe does (built from the
config's options, ``load_base_checkpoint``, ``load``, ``save`` after every optimizer step and
``save(epoch_end=True)`` after every epoch) over a tiny model, a map-style dataset of
8 samples and a ``StatefulDataLoader`` (batch size 2: 4 optimizer steps an epoch, 2
epochs), with a ``FullModelTorchTuneCheckpointer`` reading a base checkpoint saved
with ``torch.save``. The 2-process FSDP2 runs are scenarios of
``tests/torchtune/training/optimizer_in_backward_scenarios.py``.

Tolerances: resumed runs are compared with uninterrupted ones bitwise (``rtol=0,
atol=0``). A checkpoint holds exactly the tensors it was given, with the data
position and the RNG state, and the resumed run then applies the same CPU kernels to
the same values in the same order, so any difference at all is a resume that
restored something wrongly, not rounding.
"""

from __future__ import annotations

import fcntl
import fnmatch
import gc
import io
import json
import logging
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset, default_collate
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.helpers import (
    BITWISE,
    WeightAverage,
    make_model,
    one_process_group,
    snapshot_files,
)
from tests.recipes.utils import held_by_another_process, step_state
from tests.torchtune.distributed_launcher import (
    DistributedRun,
    run_distributed,
    write_report,
)
from tests.torchtune.training.optimizer_in_backward_scenarios import SCENARIOS
from torchtune import training
from torchtune.config._utils import _get_component_from_path
from torchtune.modules import peft
from torchtune.training import OptimizerInBackward
from torchtune.training.checkpointing import _run_folder as run_folder
from torchtune.training.checkpointing._checkpoint_manager import (
    FINGERPRINT_SAMPLES,
    NOT_COMPARED_ON_RESUME,
    CheckpointManager,
    CheckpointOptions,
    TrainingProgress,
    _dataset_identity,
    _named_epoch,
)
from torchtune.training.checkpointing._checkpointer import DistributedCheckpointer
from torchtune.training.checkpointing._run_folder import (
    LOCK_FILE,
    RUN_FILE,
    check_writable,
    read_run_file,
    release_lock,
    take_lock,
)
from torchtune.training.checkpointing._step_format import (
    DCP_METADATA,
    MANIFEST,
    RECIPE_STATE,
    CheckpointError,
    _manifest_checksum,
    export_manifest,
    file_checksum,
    on_rank_zero,
    step_of,
    verify,
)

EXPORT_FILE = "model-00001-of-00001.bin"
# The data file of a one-process DCP checkpoint (beside its .metadata).
DCP_DATA = "__0_0.distcp"
STEPS_PER_EPOCH = 4  # 8 samples, batch_size 2


# -- a recipe in miniature -------------------------------------------------------------


class Samples(Dataset):
    """``n`` map-style samples; ``offset`` changes their contents."""

    def __init__(self, n: int = 8, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(6, generator=torch.Generator().manual_seed(self.offset + i))


def two_layer_model(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    """The model of these tests: Linear(6, 8), a dropout (training draws from the
    global RNG when it is not 0, so that an exact resume needs the RNG state too),
    tanh, Linear(8, 3)."""
    return make_model(seed, sizes=(6, 8, 3), dropout=dropout)


class TinyLoRA(nn.Module):
    """One LoRA (or DoRA) projection, as ``lora_attn_modules: [q_proj]`` adapts."""

    def __init__(self, dora: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        linear = peft.DoRALinear if dora else peft.LoRALinear
        self.q_proj = linear(6, 6, rank=2, alpha=4.0)
        self.output = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(torch.tanh(self.q_proj(x)))


def make_config(
    tmp_path: Path,
    *,
    checkpointer: dict[str, Any] | None = None,
    base: dict[str, torch.Tensor] | None = None,
    **options: Any,
) -> DictConfig:
    """A recipe config: the base checkpoint in ``tmp_path/base``, step checkpoints and
    exports in ``tmp_path/out``, a step checkpoint every 3 steps, all of them kept,
    also once the run is done (``keep_last_n_checkpoints: 10``: many tests resume or
    inspect a finished run's); ``options`` and ``checkpointer`` override."""
    folder = tmp_path / "base"
    if not folder.exists():
        folder.mkdir(parents=True)
        weights = two_layer_model(seed=1).state_dict() if base is None else base
        torch.save(weights, folder / "model.pt")
    cfg = OmegaConf.create(
        {
            "device": "cpu",
            "output_dir": str(tmp_path / "out"),
            "epochs": 2,
            "batch_size": 2,
            "gradient_accumulation_steps": 1,
            "max_steps_per_epoch": None,
            "save_every_n_steps": 3,
            "optimizer": {
                "_component_": "torch.optim.AdamW",
                "lr": 0.05,
                "weight_decay": 0.1,
            },
            "checkpointer": {
                "_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                "checkpoint_dir": str(folder),
                "checkpoint_files": ["model.pt"],
                "output_dir": str(tmp_path / "out"),
                "model_type": "LLAMA2",
                "keep_last_n_checkpoints": 10,
            },
        }
    )
    return OmegaConf.merge(cfg, {"checkpointer": checkpointer or {}}, options)


def base_model(state: dict[str, Any], dropout: float = 0.0) -> nn.Module:
    # Other weights than the base's, which replace them.
    model = two_layer_model(seed=2, dropout=dropout)
    model.load_state_dict(state[training.MODEL_KEY])
    return model


def dropout_model(state: dict[str, Any]) -> nn.Module:
    return base_model(state, dropout=0.5)


def frozen_model(state: dict[str, Any]) -> nn.Module:
    model = base_model(state)
    model[0].requires_grad_(False)  # frozen: always the base checkpoint's
    return model


def make_optimizer(
    model: nn.Module, cfg: DictConfig, in_backward: bool
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    cls = _get_component_from_path(cfg.optimizer._component_)
    kwargs = {k: v for k, v in cfg.optimizer.items() if k != "_component_"}
    if in_backward:
        return OptimizerInBackward(params, cls, **kwargs)
    return cls(params, **kwargs)


def make_loader(dataset: Dataset, batch_size: int) -> StatefulDataLoader:
    return training.stateful_dataloader(
        dataset, batch_size=batch_size, shuffle=True, collate_fn=default_collate
    )


@dataclass
class Run:
    manager: CheckpointManager
    model: nn.Module
    optimizer: torch.optim.Optimizer
    progress: TrainingProgress
    resumed_at: int
    """``progress.global_step`` right after ``load``: where the run started."""
    average: WeightAverage | None = None


def build_manager(
    cfg: DictConfig, adapter_config: dict[str, Any] | None = None
) -> CheckpointManager:
    """What a recipe's ``__init__`` does: the options from its config and, for a
    LoRA model, the adapter's PEFT config."""
    options = CheckpointOptions.from_config(cfg)
    return CheckpointManager(options, adapter_config=adapter_config)


def train(
    cfg: DictConfig,
    *,
    in_backward: bool = False,
    stop_after: int | None = None,
    dataset: Dataset | None = None,
    build: Callable[[dict[str, Any]], nn.Module] = base_model,
    lr_lambda: Callable[[int], float] | None = None,
    average: bool = False,
    adapter_config: dict[str, Any] | None = None,
    kill: bool = True,
) -> Run:
    """A recipe's setup and loop (one batch per optimizer step), handing the manager
    its stateful objects as a recipe does. ``stop_after``: the
    process is killed right after that step's ``save()`` (before the epoch-end save
    of an epoch's last step): its lock is released as the kernel releases a killed
    process's, unless ``kill`` is ``False`` (the run only paused). ``lr_lambda``: a ``LambdaLR`` schedule, built before
    ``load``, which saves and restores it, as the recipes build theirs."""
    manager = build_manager(cfg, adapter_config)
    model = build(manager.load_base_checkpoint())
    optimizer = make_optimizer(model, cfg, in_backward)
    loader = make_loader(dataset or Samples(), cfg.batch_size)
    # Full optimizer steps per epoch, at most max_steps_per_epoch, as recipes count.
    steps_per_epoch = len(loader) // cfg.get("gradient_accumulation_steps", 1)
    steps_per_epoch = min(steps_per_epoch, cfg.get("max_steps_per_epoch") or 10**9)
    progress = TrainingProgress(total_epochs=cfg.epochs)
    scheduler = None
    if lr_lambda is not None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    states = {"model": model, "optimizer": optimizer, "dataloader": loader}
    states |= {"progress": progress, "lr_scheduler": scheduler}
    if average:
        states["average"] = WeightAverage(model)
    manager.load(states, steps_per_epoch=steps_per_epoch)
    run = Run(manager, model, optimizer, progress, progress.global_step)
    run.average = states.get("average")
    for epoch in range(progress.epochs_run, progress.total_epochs):
        loader.sampler.set_epoch(epoch)
        for _, batch in training.epoch_batches(
            loader,
            steps_done=progress.global_step - epoch * steps_per_epoch,
            steps_per_epoch=steps_per_epoch,
        ):
            model(batch).square().mean().backward()
            optimizer.step()
            if run.average is not None:
                run.average.update()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
            progress.global_step += 1
            manager.save()
            if progress.global_step == stop_after:
                if kill:
                    killed(manager)
                return run
        progress.epochs_run += 1
        manager.save(epoch_end=True)
    return run


def killed(manager: CheckpointManager) -> None:
    """What the kernel does to the lock of a process killed while ``manager``
    trains: releases it, leaving the file (the manager's own release, a no-op then,
    would delete it)."""
    lock = getattr(manager, "_lock", None)  # none before load()
    if lock is not None and lock.held:
        os.close(lock.fd)
        lock.held = False


def resume(cfg: DictConfig, **kwargs: Any) -> Run:
    """The same run restarted in a new process: another RNG state."""
    torch.manual_seed(1234)
    return train(OmegaConf.merge(cfg, {"resume_from_checkpoint": True}), **kwargs)


def uninterrupted(tmp_path: Path, **kwargs: Any) -> nn.Module:
    """The model of the same run trained start to end, in a folder of its own."""
    return train(make_config(tmp_path / "uninterrupted"), **kwargs).model


def assert_same_weights(actual: nn.Module, expected: nn.Module) -> None:
    torch.testing.assert_close(actual.state_dict(), expected.state_dict(), **BITWISE)


def step_names(out: Path) -> list[str]:
    return sorted(
        (p.name for p in out.iterdir() if step_of(p) is not None),
        key=lambda n: int(n[5:]),
    )


def rewrite(step_dir: Path, name: str, obj: Any) -> None:
    """Replace a file of a step checkpoint and its manifest entry: a checkpoint that
    verifies, holding ``obj``."""
    torch.save(obj, step_dir / name)
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"][name] = {
        "size": (step_dir / name).stat().st_size,
        "crc32": file_checksum(step_dir / name),
    }
    manifest["manifest_crc32"] = _manifest_checksum(manifest)
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def resumable_state(out: Path) -> dict[str, tuple[str, int] | None]:
    """Every file of ``out`` but the lock a stopped run leaves: what a resume reads."""
    return {k: v for k, v in snapshot_files(out).items() if k != LOCK_FILE}


def warnings_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
    )


# -- resuming exactly ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("save_in_backward", "load_in_backward"),
    [(False, False), (True, True), (False, True), (True, False)],
    ids=["plain_to_plain", "in_bwd_to_in_bwd", "plain_to_in_bwd", "in_bwd_to_plain"],
)
def test_a_mid_epoch_resume_continues_bitwise_with_either_optimizer(
    tmp_path: Path, save_in_backward: bool, load_in_backward: bool
) -> None:
    cfg = make_config(tmp_path)
    # Killed after step 7: step_6 (mid-epoch 1, its data position) is the newest.
    train(cfg, in_backward=save_in_backward, stop_after=7)
    run = resume(cfg, in_backward=load_in_backward)
    assert run.resumed_at == 6 and run.progress.epochs_run == 2
    assert_same_weights(run.model, uninterrupted(tmp_path))


# Killed after step 5 (the newest checkpoint is epoch 0's end) or 7 (mid-epoch 1).
@pytest.mark.parametrize(
    ("stop_after", "resumed_at"), [(5, 4), (7, 6)], ids=["epoch_end", "mid_epoch"]
)
def test_a_resume_restores_the_rng_state_a_model_with_dropout_draws_from(
    tmp_path: Path, stop_after: int, resumed_at: int
) -> None:
    # Dropout draws from the global RNG; resume() starts from another RNG state.
    cfg = make_config(tmp_path)
    train(cfg, stop_after=stop_after, build=dropout_model)
    run = resume(cfg, build=dropout_model)
    assert run.resumed_at == resumed_at
    expected = uninterrupted(tmp_path, build=dropout_model)
    assert_same_weights(run.model, expected)


def test_a_partly_frozen_models_step_checkpoint_holds_its_trainable_part(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=7, build=frozen_model)
    saved = step_state(tmp_path / "out" / "step_6")
    assert sorted(saved["model"]) == ["3.bias", "3.weight"]
    run = resume(cfg, build=frozen_model)
    assert run.resumed_at == 6
    assert_same_weights(run.model, uninterrupted(tmp_path, build=frozen_model))

    # A model whose trainable part the checkpoint lacks is refused, naming entries.
    def larger(state: dict[str, Any]) -> nn.Module:
        return nn.Sequential(*frozen_model(state), nn.Linear(3, 3))

    with pytest.raises(
        CheckpointError, match=r"missing trainable entries \['4\.bias', '4\.weight'\]"
    ):
        resume(cfg, build=larger)


def test_a_resume_loads_the_base_weights_through_the_checkpointer(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path)
    manager = build_manager(cfg)
    loaded = manager.load_base_checkpoint()
    assert set(loaded) == {training.MODEL_KEY}
    torch.testing.assert_close(
        loaded[training.MODEL_KEY],
        two_layer_model(seed=1).state_dict(),
        **BITWISE,
    )
    train(cfg, stop_after=5)
    # Resuming a step checkpoint, the checkpointer reads the base again (its trained
    # weights come from the step checkpoint, in load()).
    manager = build_manager(OmegaConf.merge(cfg, {"resume_from_checkpoint": True}))
    loaded = manager.load_base_checkpoint()
    assert set(loaded) == {training.MODEL_KEY}
    torch.testing.assert_close(
        loaded[training.MODEL_KEY],
        two_layer_model(seed=1).state_dict(),
        **BITWISE,
    )


def test_training_progress_round_trips_but_keeps_the_configs_total_epochs() -> None:
    progress = TrainingProgress(total_epochs=3, epochs_run=2, global_step=9)
    assert progress.state_dict() == {
        training.EPOCHS_KEY: 2,
        training.TOTAL_EPOCHS_KEY: 3,
        "global_step": 9,
    }
    resumed = TrainingProgress(total_epochs=5)  # a resumed run may train longer
    resumed.load_state_dict(progress.state_dict())
    assert resumed == TrainingProgress(total_epochs=5, epochs_run=2, global_step=9)


@pytest.mark.parametrize("torn_export", [False, True], ids=["whole", "torn_export"])
def test_resuming_a_finished_run_says_there_is_nothing_left_to_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, torn_export: bool
) -> None:
    cfg = make_config(tmp_path)
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO):
        train(cfg)
    assert (
        f"2 epochs). Final weights in {out}/epoch_1 (every file checksummed). Its "
        "resumable state is kept (checkpointer.keep_last_n_checkpoints=10: step_8, "
        "step_6, step_4, step_3," in caplog.text
    )
    export = out / "epoch_1" / EXPORT_FILE
    exported = export.read_bytes()
    if torn_export:  # killed, or the disk filled, while the final export was written
        export.write_bytes(exported[: len(exported) // 2])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run = resume(cfg)
    assert run.resumed_at == 8
    warnings = warnings_text(caplog)
    assert (
        f"resume_from_checkpoint=True: {out / 'step_8'} is at the end of training (2 "
        "epochs done, epochs=2): nothing left to do." in warnings
    )
    rewritten = (
        f"The export of epoch 1 is not this checkpoint's ({out / 'epoch_1'}" in warnings
        and f"rewriting it from {out / 'step_8'}" in warnings
    )
    assert rewritten == torn_export
    # Whole again, with the bytes the run wrote (the same weights, saved alike).
    assert export.read_bytes() == exported
    verify(out / "epoch_1", export_manifest(out / "epoch_1"))
    assert not (out / LOCK_FILE).exists()


def test_resuming_a_finished_run_with_nothing_left_to_do_deletes_nothing(
    tmp_path: Path,
) -> None:
    # Trained keeping its step checkpoints (to train further later), resumed
    # without keep_last_n_checkpoints: the ones kept are what "set epochs to more
    # than 2" needs, so they stay.
    train(make_config(tmp_path))
    out = tmp_path / "out"
    before = resumable_state(out)
    resume(make_config(tmp_path, checkpointer={"keep_last_n_checkpoints": None}))
    assert resumable_state(out) == before
    run = resume(make_config(tmp_path, epochs=3))
    assert run.resumed_at == 8 and run.progress.global_step == 12


def test_the_newest_checkpoint_is_the_newest_save_or_the_one_resumed(
    tmp_path: Path,
) -> None:
    # What a run that must stop names (training.stop_if_not_finite).
    out = tmp_path / "out"
    assert train(make_config(tmp_path), stop_after=2).manager.newest_checkpoint is None
    run = train(make_config(tmp_path), stop_after=5)  # step_3 and step_4 saved
    assert run.manager.newest_checkpoint == out / "step_4"
    run = resume(make_config(tmp_path), stop_after=5)  # resumed at step_4: no save
    assert run.manager.newest_checkpoint == out / "step_4"


@pytest.fixture
def gloo_world_of_one() -> Iterator[None]:
    """A one-process gloo group, torn down after the test."""
    with one_process_group():
        yield


def sharded_model(state: dict[str, Any]) -> nn.Module:
    """The model FSDP2-sharded over the one process, as a distributed recipe run on
    one device shards it."""
    model = two_layer_model(seed=2)
    mesh = init_device_mesh("cpu", (1,))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    training.load_from_full_model_state_dict(
        model, state[training.MODEL_KEY], torch.device("cpu"), strict=True
    )
    return model


def sharded_frozen_model(state: dict[str, Any]) -> nn.Module:
    model = sharded_model(state)
    model[0].requires_grad_(False)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v
        for k, v in model.state_dict().items()
    }


# DCP notes that it saves and loads in a single process: intended here.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_one_process_distributed_run_resumes_mid_epoch_bitwise(
    tmp_path: Path,
    gloo_world_of_one: None,
    asynchronous: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process group of one takes the distributed paths: sharded step checkpoints
    written by DCP (in the background, with ``enable_async_checkpointing``) and
    exports gathered from the shards."""
    in_background = []
    real_async_save = dcp.async_save

    def async_save(*args: Any, **kwargs: Any) -> Any:
        in_background.append(kwargs["checkpoint_id"].name)
        return real_async_save(*args, **kwargs)

    monkeypatch.setattr(dcp, "async_save", async_save)
    cfg = make_config(tmp_path, enable_async_checkpointing=asynchronous)
    stopped = train(cfg, in_backward=True, stop_after=7, build=sharded_model)
    stopped.manager.close()  # a save still in flight completes
    expected_background = [".step_3.partial", ".step_4.partial", ".step_6.partial"]
    assert in_background == (expected_background if asynchronous else [])
    out = tmp_path / "out"
    assert (out / "step_6" / DCP_METADATA).is_file()
    run = resume(cfg, build=sharded_model)
    run.manager.close()
    assert run.resumed_at == 6
    expected = full_state(uninterrupted(tmp_path, build=sharded_model))
    torch.testing.assert_close(full_state(run.model), expected, **BITWISE)
    torch.testing.assert_close(
        torch.load(out / "epoch_1" / EXPORT_FILE, weights_only=True),
        expected,
        **BITWISE,
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_async_save_whose_run_died_is_published_at_the_next_start(
    tmp_path: Path, gloo_world_of_one: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The run dies after step 7 with step 6's background save written (its DCP
    metadata and every process's files) but not completed: the next start
    publishes it, so the resume loses step 7 only, not steps 5 to 7."""
    cfg = make_config(tmp_path, enable_async_checkpointing=True)
    stopped = train(cfg, in_backward=True, stop_after=7, build=sharded_model)
    stopped.manager._pending[0].result()  # written; then killed: never completed
    out = tmp_path / "out"
    assert (out / ".step_6.partial" / DCP_METADATA).is_file()
    assert not (out / ".step_6.partial" / MANIFEST).exists()
    with caplog.at_level(logging.WARNING):
        run = resume(cfg, build=sharded_model)
    run.manager.close()
    assert run.resumed_at == 6
    assert f"Published {out / 'step_6'}" in warnings_text(caplog)
    expected = full_state(uninterrupted(tmp_path, build=sharded_model))
    torch.testing.assert_close(full_state(run.model), expected, **BITWISE)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_one_process_distributed_resume_restores_the_lr_schedules_initial_lr(
    tmp_path: Path, gloo_world_of_one: None
) -> None:
    """DCP loads only the entries that a new optimizer has, and ``initial_lr`` (an LR
    scheduler's) is not one of them; a scheduler built on resume needs it."""
    cfg = make_config(tmp_path)
    schedule = {"build": sharded_model, "lr_lambda": lambda step: 1 / (1 + step)}
    train(cfg, stop_after=7, **schedule).manager.close()
    run = resume(cfg, **schedule)
    run.manager.close()
    assert run.resumed_at == 6
    assert run.optimizer.param_groups[0]["initial_lr"] == 0.05
    expected = full_state(uninterrupted(tmp_path, **schedule))
    torch.testing.assert_close(full_state(run.model), expected, **BITWISE)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_one_process_distributed_run_of_a_partly_frozen_model_resumes(
    tmp_path: Path, gloo_world_of_one: None
) -> None:
    """Its sharded checkpoint holds the trainable part: the frozen weights are the
    base checkpoint's."""
    cfg = make_config(tmp_path)
    train(cfg, stop_after=7, build=sharded_frozen_model).manager.close()
    run = resume(cfg, build=sharded_frozen_model)
    run.manager.close()
    assert run.resumed_at == 6
    expected = full_state(uninterrupted(tmp_path, build=sharded_frozen_model))
    torch.testing.assert_close(full_state(run.model), expected, **BITWISE)


# -- what a save writes, and when ------------------------------------------------------


@pytest.mark.parametrize(
    ("every", "expected"), [(2, [2, 4, 6, 8]), (3, [3, 4, 6, 8])], ids=["2", "3"]
)
def test_save_writes_every_n_steps_and_an_epochs_last_step_only_at_its_end(
    tmp_path: Path, every: int, expected: list[int]
) -> None:
    train(make_config(tmp_path, save_every_n_steps=every))
    out = tmp_path / "out"
    assert step_names(out) == [f"step_{n}" for n in expected]
    # Steps 4 and 8 end epochs: save() left them to save(epoch_end=True), which saved
    # each once without a data position (the next epoch starts its loader afresh).
    for n in expected:
        recipe_state = torch.load(out / f"step_{n}" / RECIPE_STATE, weights_only=False)
        loader = step_state(out / f"step_{n}")[training.DATALOADER_KEY]["rank_0"]
        assert recipe_state["epoch_end"] == (n % STEPS_PER_EPOCH == 0), n
        assert (torch.load(io.BytesIO(loader)) is None) == (n % STEPS_PER_EPOCH == 0), n
        assert recipe_state["global_step"] == n
    assert sorted(p.name for p in out.glob("epoch_*")) == ["epoch_0", "epoch_1"]


def test_without_save_every_n_steps_only_the_newest_epoch_end_checkpoint_is_kept(
    tmp_path: Path,
) -> None:
    unset = {"keep_last_n_checkpoints": None}
    cfg = make_config(tmp_path, epochs=3, save_every_n_steps=None, checkpointer=unset)
    out = tmp_path / "out"
    train(cfg, stop_after=9)  # after the ends of epochs 0 (step 4) and 1 (step 8)
    assert step_names(out) == ["step_8"]
    # Once the final export is whole, the run leaves what torchtune 0.6.1 leaves.
    train(make_config(tmp_path / "full", save_every_n_steps=None, checkpointer=unset))
    out = tmp_path / "full" / "out"
    assert step_names(out) == []
    assert sorted(p.name for p in out.glob("epoch_*")) == ["epoch_0", "epoch_1"]


def test_keep_last_n_keeps_the_newest(tmp_path: Path) -> None:
    cfg = make_config(
        tmp_path, save_every_n_steps=1, checkpointer={"keep_last_n_checkpoints": 2}
    )
    train(cfg)
    assert step_names(tmp_path / "out") == ["step_7", "step_8"]
    # Exports are not step checkpoints: every epoch's stays.
    exports = sorted(p.name for p in (tmp_path / "out").glob("epoch_*"))
    assert exports == ["epoch_0", "epoch_1"]


def test_saving_a_step_again_replaces_it_once_the_new_save_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = train(make_config(tmp_path), stop_after=3)
    out = tmp_path / "out"
    first = snapshot_files(out / "step_3")
    with torch.no_grad():
        run.model[0].weight.add_(1.0)

    # Killed while the second save is written: the first stays, untouched.
    def killed_writing_the_model(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(dcp, "save", killed_writing_the_model)
        with pytest.raises(KeyboardInterrupt):
            run.manager.save()  # global_step is still 3: due again
    assert snapshot_files(out / "step_3") == first
    run.manager.save()
    verify(out / "step_3")
    saved = step_state(out / "step_3")
    torch.testing.assert_close(saved["model"], run.model.state_dict(), **BITWISE)
    assert not list(out.glob(".step_*"))


def test_the_manifest_records_each_files_size_crc32_and_the_run_id(
    tmp_path: Path,
) -> None:
    run = train(make_config(tmp_path), stop_after=5)
    out = tmp_path / "out"
    manifest = json.loads((out / "step_3" / MANIFEST).read_text())
    assert sorted(manifest) == [
        "files",
        "manifest_crc32",
        "run_id",
        "step",
        "version",
    ]
    assert manifest["version"] == 2
    # The run id: the UTC time the run started and 8 random hex digits.
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{8}", read_run_file(out))
    assert manifest["run_id"] == read_run_file(out)
    assert sorted(manifest["files"]) == [DCP_METADATA, DCP_DATA, RECIPE_STATE]
    for name, entry in manifest["files"].items():
        data = (out / "step_3" / name).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
    assert verify(out / "step_3") == manifest
    # The epoch export: the weights alone (no optimizer state), with a manifest.
    export = json.loads(export_manifest(out / "epoch_0").read_text())
    data = (out / "epoch_0" / EXPORT_FILE).read_bytes()
    assert export["run_id"] == manifest["run_id"]
    assert export["files"] == {
        EXPORT_FILE: {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    }
    verify(out / "epoch_0", export_manifest(out / "epoch_0"))
    assert not (out / "recipe_state").exists()  # 0.6.1's epoch recipe state
    # epoch_0 holds the model after step 4; the run trained on to step 5 since.
    after_4 = step_state(out / "step_4")
    weights = torch.load(out / "epoch_0" / EXPORT_FILE, weights_only=True)
    torch.testing.assert_close(weights, after_4["model"], **BITWISE)
    assert set(weights) == set(run.model.state_dict())


def test_file_checksum_is_the_crc32_of_a_large_and_of_an_empty_file(
    tmp_path: Path,
) -> None:
    data = os.urandom((16 << 20) + 4099)
    (tmp_path / "large").write_bytes(data)
    assert file_checksum(tmp_path / "large") == f"{zlib.crc32(data):08x}"
    (tmp_path / "empty").write_bytes(b"")  # cannot be memory-mapped
    assert file_checksum(tmp_path / "empty") == "00000000"


# -- crashes and damage ----------------------------------------------------------------


def test_on_rank_zero_returns_the_result_or_raises_what_the_function_raised() -> None:
    assert on_rank_zero(lambda: "rank 0's") == "rank 0's"

    def refuse() -> None:
        raise CheckpointError("refused on rank 0")

    with pytest.raises(CheckpointError, match="^refused on rank 0$"):
        on_rank_zero(refuse)


def test_a_crash_mid_save_leaves_the_previous_checkpoint_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(tmp_path)
    real_save = torch.save

    def killed_while_saving_step_6(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        # The recipe state is written after the weights and the rank's state.
        if isinstance(obj, dict) and obj.get("global_step") == 6:
            raise KeyboardInterrupt("killed while writing step_6")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", killed_while_saving_step_6)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.undo()
    gc.collect()  # the killed run's manager lets its lock go, as a dead process's
    out = tmp_path / "out"
    assert step_names(out) == ["step_3", "step_4"]
    assert (out / ".step_6.partial").is_dir()
    run = resume(cfg)
    assert run.resumed_at == 4
    assert_same_weights(run.model, uninterrupted(tmp_path))
    assert not list(out.glob(".step_*"))  # the next start deleted the partial


@pytest.mark.parametrize(
    "damage", ["truncated", "first byte", "middle byte", "last byte"]
)
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    out = tmp_path / "out"
    damaged = out / "step_4" / DCP_DATA
    size = damaged.stat().st_size
    if damage == "truncated":
        damaged.write_bytes(damaged.read_bytes()[:100])
    else:
        where = {"first byte": 0, "middle byte": size // 2, "last byte": size - 1}
        flip_byte(damaged, where[damage])
        assert damaged.stat().st_size == size  # a size check alone misses it

    # Named, it is an error that names the file, raised before anything is loaded.
    named = OmegaConf.merge(cfg, {"checkpointer": {"recipe_checkpoint": "step_4"}})
    with pytest.raises(CheckpointError, match=re.escape(f"{damaged} is damaged")):
        resume(named)
    with caplog.at_level(logging.WARNING):
        run = resume(cfg)
    assert f"Skipping step checkpoint {out / 'step_4'}: {damaged} is damaged" in (
        warnings_text(caplog)
    )
    assert run.resumed_at == 3
    assert_same_weights(run.model, uninterrupted(tmp_path))
    # The damaged one stays until the branch's own step_4 replaces it, whole.
    assert "Resuming from step_3 starts a branch" in warnings_text(caplog)
    verify(out / "step_4")


def test_a_folder_without_manifest_is_not_a_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    out = tmp_path / "out"
    (out / "step_4" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=f"has no {MANIFEST}"):
        verify(out / "step_4")
    with caplog.at_level(logging.WARNING):
        run = resume(cfg)
    assert f"Skipping step checkpoint {out / 'step_4'}" in warnings_text(caplog)
    assert run.resumed_at == 3


@pytest.mark.parametrize("damage", ["torn", "read error"])
def test_a_manifest_that_cannot_be_read_is_damaged_and_the_resume_falls_back(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    damage: str,
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    manifest = tmp_path / "out" / "step_4" / MANIFEST
    if damage == "torn":
        manifest.write_text(manifest.read_text()[:40])  # not JSON
    else:  # the disk fails to read it
        read_text = Path.read_text

        def failing_read(path: Path, *args: Any, **kwargs: Any) -> str:
            if path == manifest:
                raise OSError(5, "Input/output error")
            return read_text(path, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", failing_read)
    with pytest.raises(
        CheckpointError, match=f"^{re.escape(str(manifest))} is damaged"
    ):
        verify(manifest.parent)
    with caplog.at_level(logging.WARNING):
        run = resume(cfg)
    assert f"{manifest} is damaged" in warnings_text(caplog)
    assert run.resumed_at == 3


@pytest.mark.parametrize("damage", ["truncated", "manifest missing"])
def test_a_damaged_epoch_export_is_rewritten_on_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    out = tmp_path / "out"
    export = out / "epoch_0" / EXPORT_FILE
    original_bytes = export.read_bytes()
    original = torch.load(export, weights_only=True)
    if damage == "truncated":  # a crash or a full disk while it was written
        export.write_bytes(original_bytes[: len(original_bytes) // 2])
    else:
        export_manifest(out / "epoch_0").unlink()
    with caplog.at_level(logging.WARNING):
        run = resume(cfg, stop_after=5)
    assert run.resumed_at == 4  # the epoch-end checkpoint of epoch 0
    assert "The export of epoch 0 is not this checkpoint's" in warnings_text(caplog)
    verify(out / "epoch_0", export_manifest(out / "epoch_0"))
    torch.testing.assert_close(
        torch.load(export, weights_only=True), original, **BITWISE
    )
    assert export.read_bytes() == original_bytes


# -- runs and their folders ------------------------------------------------------------


def test_a_new_run_makes_its_output_dir_and_the_folders_above_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "runs" / "tiny" / "out"  # the exports go to tmp_path / "out"
    train(make_config(tmp_path, output_dir=str(out)), stop_after=3)
    assert (out / "step_3").is_dir()


def test_a_rerun_without_resume_keeps_the_earlier_runs_state_until_its_first_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    cfg = make_config(tmp_path)
    train(cfg, stop_after=7)  # run A: step_3, step_4, step_6
    earlier = resumable_state(out)
    # Run B, the same command without resume_from_checkpoint, stopped before its
    # first save: the folder resumes run A exactly as before.
    with caplog.at_level(logging.WARNING):
        train(cfg, stop_after=2)
    assert re.search(
        r"holds an earlier run's resumable state \(step_3, step_4, step_6: [0-9.]+ MB\)"
        r". It stays until this run's first step checkpoint is whole",
        warnings_text(caplog),
    )
    assert "resume_from_checkpoint=True" in warnings_text(caplog)
    assert resumable_state(out) == earlier
    run = resume(cfg)
    assert run.resumed_at == 6
    assert_same_weights(run.model, uninterrupted(tmp_path))
    # Once run C's first step checkpoint is whole, run A's state goes, saying so.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train(cfg, stop_after=3)
    assert re.search(
        r"Deleting step_3, step_4, step_6, step_8 \([0-9.]+ MB\), an earlier run's resumable "
        rf"state: {re.escape(str(out / 'step_3'))} supersedes it",
        warnings_text(caplog),
    )
    assert step_names(out) == ["step_3"]


def test_a_new_run_keeps_0_6_1s_resumable_state_until_its_first_save(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    for folder in ("recipe_state", "dist_epoch_0"):
        (out / folder).mkdir(parents=True)
        (out / folder / "state.pt").write_bytes(b"0.6.1's")
    before = resumable_state(out)
    train(make_config(tmp_path), stop_after=2)  # its first save: step 3
    assert resumable_state(out) == before
    train(make_config(tmp_path), stop_after=3)
    assert not (out / "recipe_state").exists() and not (out / "dist_epoch_0").exists()


def test_a_new_run_starting_from_an_earlier_runs_export_replaces_it_as_0_6_1_did(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    train(make_config(tmp_path))
    earlier_export = (out / "epoch_1" / EXPORT_FILE).read_bytes()
    named = {"checkpoint_dir": str(out / "epoch_1"), "checkpoint_files": [EXPORT_FILE]}
    cfg = make_config(tmp_path, checkpointer=named)
    run = train(cfg, stop_after=3)
    assert run.resumed_at == 0
    assert (out / "epoch_1" / EXPORT_FILE).read_bytes() == earlier_export
    train(cfg)
    assert not [p for p in out.rglob(EXPORT_FILE) if p.read_bytes() == earlier_export]


@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_whole_step_checkpoint_not_yet_published_is_published_at_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, save: str
) -> None:
    """A run that died after a save's files were all written but before it
    published them: killed before the rename (its manifest written), or an
    asynchronous save that was never completed (no manifest)."""
    cfg = make_config(tmp_path)
    out = tmp_path / "out"
    train(cfg, stop_after=7)
    os.replace(out / "step_6", out / ".step_6.partial")
    if save == "async":
        (out / ".step_6.partial" / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING):
        run = resume(cfg)
    assert run.resumed_at == 6
    assert f"Published {out / 'step_6'}" in warnings_text(caplog)
    assert_same_weights(run.model, uninterrupted(tmp_path))


def test_a_killed_saves_leftovers_go_at_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(tmp_path)
    out = tmp_path / "out"
    train(cfg, stop_after=7)
    # Killed writing step 7's save (every step, then): its model file torn, never
    # renamed into place; resumed saving every 3 steps, which never saves step 7.
    (out / ".step_7.partial").mkdir()
    (out / ".step_7.partial" / DCP_DATA).write_bytes(b"torn")
    with caplog.at_level(logging.WARNING):
        run = resume(cfg, stop_after=7)
    assert run.resumed_at == 6
    assert f"Deleting {out / '.step_7.partial'}" in warnings_text(caplog)
    assert not list(out.glob(".step_*"))


def test_a_resume_picks_only_its_own_runs_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "out"
    train(make_config(tmp_path / "a", save_every_n_steps=1))  # run A: step_1 ... 8
    train(make_config(tmp_path), stop_after=5)  # run B: step_3, step_4
    # Someone copies two of run A's checkpoints in.
    for name in ("step_1", "step_7"):
        shutil.copytree(tmp_path / "a" / "out" / name, out / name)
    run = resume(make_config(tmp_path, checkpointer={"keep_last_n_checkpoints": 1}))
    assert run.resumed_at == 4  # run B's newest, not run A's step_7
    assert_same_weights(run.model, uninterrupted(tmp_path))
    # Run A's, an earlier run's, went once run B's next save was whole.
    assert step_names(out) == ["step_8"]


def test_a_branch_keeps_the_later_checkpoints_until_its_saves_supersede_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    train(make_config(tmp_path))  # step_3, step_4, step_6, step_8, epoch_0, epoch_1
    before = resumable_state(out)
    keep_2 = {"keep_last_n_checkpoints": 2}
    branch = make_config(
        tmp_path, checkpointer={"recipe_checkpoint": "step_3", **keep_2}
    )
    # Stopped before its first save: the folder resumes as before, from step_8.
    with caplog.at_level(logging.WARNING):
        assert resume(branch, stop_after=4).resumed_at == 3
    assert "step_4, step_6, step_8) stay until this run's save" in warnings_text(caplog)
    assert resumable_state(out) == before
    assert resume(make_config(tmp_path), stop_after=8).resumed_at == 8
    # Stopped after its save of step_4: that one replaced; step_6, step_8 stay.
    resume(branch, stop_after=5)
    after_step_4 = resumable_state(out)
    for name, entry in before.items():
        if name.split("/")[0] in ("step_6", "step_8"):
            assert after_step_4[name] == entry, name
    assert after_step_4["step_4/manifest.json"] != before["step_4/manifest.json"]
    # The same branch command again (a requeued job), stopped before its first
    # save, deletes nothing of the branch's own.
    resume(branch, stop_after=4)
    assert resumable_state(out) == after_step_4
    # The branch is the run now: resumed, it continues from its newest, step_4, and
    # its saves of steps 6 and 8 replace the old timeline's.
    run = resume(make_config(tmp_path, checkpointer=keep_2))
    assert run.resumed_at == 4
    assert step_names(out) == ["step_6", "step_8"]
    assert_same_weights(run.model, uninterrupted(tmp_path))


def test_naming_another_folders_step_checkpoint_changes_nothing_there(
    tmp_path: Path,
) -> None:
    other = tmp_path / "other" / "out"
    train(make_config(tmp_path / "other"))  # step_3, step_4, step_6, step_8 there
    there = snapshot_files(other)
    named = {"recipe_checkpoint": str(other / "step_3")}
    run = resume(make_config(tmp_path, checkpointer=named))
    assert run.resumed_at == 3
    assert_same_weights(run.model, uninterrupted(tmp_path))
    assert snapshot_files(other) == there
    assert step_names(tmp_path / "out") == ["step_4", "step_6", "step_8"]


def test_a_named_step_checkpoint_that_does_not_exist_lists_those_there(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    named = OmegaConf.merge(
        cfg,
        {
            "resume_from_checkpoint": True,
            "checkpointer": {"recipe_checkpoint": "step_9"},
        },
    )
    with pytest.raises(
        CheckpointError,
        match=r"^checkpointer.recipe_checkpoint=step_9 names the step checkpoint "
        r".*step_9, which does not exist. The step checkpoints in .* are "
        r"\['step_4', 'step_3'\]: name one of them",
    ):
        build_manager(named)


def test_resuming_with_nothing_to_resume_is_refused(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, resume_from_checkpoint=True)
    out = tmp_path / "out"
    refusal = (
        "resume_from_checkpoint=True, but there is nothing to resume from: no whole "
        f"step checkpoint (step_N/) of this run in output_dir={out}, nor a 0.6.1 "
        "epoch checkpoint.{} Set resume_from_checkpoint=False to start."
    )
    with pytest.raises(CheckpointError) as refused:
        build_manager(cfg)
    assert str(refused.value) == refusal.format("")
    # 0.6.1's asynchronous checkpoint is resumed with enable_async_checkpointing only.
    (out / "dist_epoch_0").mkdir(parents=True)
    (out / "dist_epoch_0" / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError) as refused:
        build_manager(cfg)
    assert str(refused.value) == refusal.format("")


def test_a_named_0_6_1_recipe_state_that_does_not_exist_is_refused(
    tmp_path: Path,
) -> None:
    named = "recipe_state/recipe_state.pt"
    cfg = make_config(
        tmp_path, resume_from_checkpoint=True, checkpointer={"recipe_checkpoint": named}
    )
    with pytest.raises(CheckpointError) as refused:
        build_manager(cfg)
    assert str(refused.value) == (
        f"checkpointer.recipe_checkpoint={named}: {tmp_path / 'out' / named} does "
        "not exist. Name the run's recipe_state.pt, or leave it unset."
    )


def test_a_file_named_like_a_step_checkpoint_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    stray = tmp_path / "out" / "step_9"
    stray.write_text("a user's notes")
    with caplog.at_level(logging.WARNING):
        run = resume(cfg)
    assert run.resumed_at == 4
    assert "step_9" not in warnings_text(caplog)
    assert stray.read_text() == "a user's notes"


class RunsCode:
    """Unpickled, it makes a file: a stand-in for the code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_a_recipe_state_holding_pickled_code_is_refused_not_run(
    tmp_path: Path,
) -> None:
    """The recipe state, read before anything is built, is read with
    ``weights_only=True``: tensors and plain values only."""
    name = RECIPE_STATE
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    step_4, ran = tmp_path / "out" / "step_4", tmp_path / "code ran"
    state = torch.load(step_4 / name, weights_only=True)
    rewrite(step_4, name, {**state, "extra": RunsCode(ran)})
    named = OmegaConf.merge(cfg, {"checkpointer": {"recipe_checkpoint": "step_4"}})
    with pytest.raises(CheckpointError) as refused:
        resume(named)
    assert not ran.exists()
    assert str(refused.value) == (
        f"{step_4 / name} holds a pickled getattr, which loading could run: refused "
        "(a step checkpoint holds tensors and plain values only). Resume another one "
        "(checkpointer.recipe_checkpoint=step_N), or resume_from_checkpoint=False."
    )


# -- refusals --------------------------------------------------------------------------


def test_a_step_checkpoint_of_another_model_is_refused_naming_five_entries_each(
    tmp_path: Path,
) -> None:
    def model() -> nn.Module:  # 6 entries
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3)
        )

    def build(state: dict[str, Any]) -> nn.Module:
        built = model()
        built.load_state_dict(state[training.MODEL_KEY])
        return built

    cfg = make_config(tmp_path, base=model().state_dict())
    train(cfg, stop_after=5, build=build)

    def renamed(state: dict[str, Any]) -> nn.Module:
        return nn.Sequential(OrderedDict(inner=build(state)))

    with pytest.raises(CheckpointError) as refused:
        resume(cfg, build=renamed)
    assert str(refused.value) == (
        f"{tmp_path / 'out' / 'step_4'} does not match this model: missing trainable "
        "entries ['inner.0.bias', 'inner.0.weight', 'inner.2.bias', 'inner.2.weight', "
        "'inner.3.bias'], unexpected entries ['0.bias', '0.weight', '2.bias', "
        "'2.weight', '3.bias']. Resume with the model that saved it."
    )


def test_another_optimizer_class_is_refused_when_the_manager_is_built(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    resuming = OmegaConf.merge(cfg, {"resume_from_checkpoint": True})
    # The same class under another path resumes.
    resuming.optimizer._component_ = "torch.optim.adamw.AdamW"
    build_manager(resuming)
    resuming.optimizer._component_ = "torch.optim.SGD"
    with pytest.raises(
        ValueError,
        match=r"^optimizer._component_=torch.optim.SGD cannot resume from "
        rf"{re.escape(str(tmp_path / 'out' / 'step_4'))}: its optimizer state was "
        r"saved by torch.optim.AdamW\. Set optimizer._component_=torch.optim.AdamW "
        r"to resume, or resume_from_checkpoint=False to start anew\.$",
    ):
        build_manager(resuming)


def test_a_checkpoint_of_an_optimizer_class_that_no_longer_imports_is_refused(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    step_4 = tmp_path / "out" / "step_4"
    recipe_state = torch.load(step_4 / RECIPE_STATE, weights_only=True)
    gone = "torch.optim.RemovedOptimizer"
    rewrite(step_4, RECIPE_STATE, {**recipe_state, "optimizer_component": gone})
    with pytest.raises(ValueError, match=f"its optimizer state was saved by {gone}"):
        build_manager(OmegaConf.merge(cfg, {"resume_from_checkpoint": True}))


def test_another_optimizer_class_is_refused_in_the_checkpoint_a_resume_falls_back_to(
    tmp_path: Path,
) -> None:
    """The start checks the newest step checkpoint's optimizer class; when it is
    damaged and the resume falls back to an older one, ``load`` checks that one's,
    before anything is loaded or written."""
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    out = tmp_path / "out"
    flip_byte(out / "step_4" / DCP_DATA, 0)
    recipe_state = torch.load(out / "step_3" / RECIPE_STATE, weights_only=False)
    recipe_state["optimizer_component"] = "torch.optim.SGD"
    rewrite(out / "step_3", RECIPE_STATE, recipe_state)
    before = snapshot_files(tmp_path)
    with pytest.raises(
        ValueError,
        match=rf"^optimizer._component_=torch.optim.AdamW cannot resume from "
        rf"{re.escape(str(out / 'step_3'))}: its optimizer state was saved by "
        r"torch.optim.SGD",
    ):
        resume(cfg)
    assert snapshot_files(tmp_path) == before


@pytest.mark.parametrize(
    ("key", "change", "message"),
    [
        ("dataset_length", {"dataset": Samples(10)}, "8 then, 10 now"),
        (
            "dataset_hash",
            {"dataset": Samples(offset=100)},
            "'[0-9a-f]{16}' then, '[0-9a-f]{16}' now",
        ),
        ("shuffle", {"shuffle": False}, "None then, False now"),
        ("seed", {"seed": 7}, "None then, 7 now"),
        ("dtype", {"dtype": "bf16"}, "None then, 'bf16' now"),
        ("clip_grad_norm", {"clip_grad_norm": 1.0}, "None then, 1.0 now"),
        (
            "lr_scheduler._component_",
            {"lr_scheduler": {"_component_": "x.cosine", "num_warmup_steps": 5}},
            "None then, 'x.cosine' now",
        ),
        # Mid-epoch, the epochs left decide a schedule's length from here on.
        ("epochs", {"epochs": 3}, "2 then, 3 now"),
        ("batch_size", {"batch_size": 4}, "2 then, 4 now"),
        (
            "gradient_accumulation_steps",
            {"gradient_accumulation_steps": 2},
            "1 then, 2 now",
        ),
        ("max_steps_per_epoch", {"max_steps_per_epoch": 3}, "None then, 3 now"),
    ],
)
def test_a_resume_with_another_trajectory_is_refused_before_any_file_changes(
    tmp_path: Path, key: str, change: dict[str, Any], message: str
) -> None:
    assert not any(fnmatch.fnmatchcase(key, p) for p in NOT_COMPARED_ON_RESUME)
    cfg = make_config(tmp_path)
    train(cfg, stop_after=7)
    change = dict(change)
    dataset = change.pop("dataset", None)
    resuming = OmegaConf.merge(cfg, change)
    before = snapshot_files(tmp_path)
    with pytest.raises(CheckpointError, match=f"{key}: {message}"):
        resume(resuming, dataset=dataset)
    assert snapshot_files(tmp_path) == before


def test_resume_allow_changes_continues_with_another_trajectory_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=7)
    with caplog.at_level(logging.WARNING):
        run = resume(
            OmegaConf.merge(cfg, {"resume_allow_changes": True}),
            dataset=Samples(offset=100),
        )
    assert run.resumed_at == 6 and run.progress.global_step == 8
    assert re.search(
        r"resume_allow_changes=True: resuming .*step_6 with other settings "
        r"\(dataset_hash: '[0-9a-f]{16}' then, '[0-9a-f]{16}' now\)",
        warnings_text(caplog),
    )


def test_the_dataset_fingerprint_covers_every_sample_and_their_order() -> None:
    samples = [{"tokens": [i, 1], "labels": [i, 2]} for i in range(9)]
    identity = _dataset_identity(samples)
    assert identity["dataset_length"] == 9
    for i in range(9):
        changed = [
            {"tokens": [-1], "labels": []} if j == i else s
            for j, s in enumerate(samples)
        ]
        assert _dataset_identity(changed) != identity, f"sample {i}"
    # Two samples swapped: the same samples in another order.
    swapped = [samples[0], samples[2], samples[1], *samples[3:]]
    assert _dataset_identity(swapped) != identity
    # Contents, not the order of a sample's keys.
    reordered = [{"labels": s["labels"], "tokens": s["tokens"]} for s in samples]
    assert _dataset_identity(reordered) == identity


def test_a_large_datasets_fingerprint_reads_a_spread_of_samples_only() -> None:
    """Beyond FINGERPRINT_SAMPLES, a sample between those read goes unseen: the
    trade-off that keeps the fingerprint's cost bounded (it tokenizes what it reads)."""
    read: set[int] = set()

    class Counted(list):
        def __getitem__(self, i: int) -> Any:
            read.add(i)
            return super().__getitem__(i)

    n = 3 * FINGERPRINT_SAMPLES
    _dataset_identity(Counted([{"tokens": [i]} for i in range(n)]))
    assert len(read) == FINGERPRINT_SAMPLES and {0, n - 1} <= read


def test_a_setting_that_keeps_every_shape_is_compared_too(tmp_path: Path) -> None:
    # A LoRA scaling: the same tensors, other numbers from the next step on.
    cfg = make_config(tmp_path, model={"_component_": "x.lora", "lora_alpha": 8})
    train(cfg, stop_after=7)
    changed = OmegaConf.merge(cfg, {"model": {"lora_alpha": 16}})
    with pytest.raises(CheckpointError, match=r"model.lora_alpha: 8 then, 16 now"):
        resume(changed)
    allowed = OmegaConf.merge(changed, {"resume_allow_changes": True})
    assert resume(allowed).resumed_at == 6


def test_settings_that_cannot_change_the_numbers_are_not_compared(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path, log_every_n_steps=1, compile=False)
    train(cfg, stop_after=7)
    elsewhere = {
        "log_every_n_steps": 5,
        "compile": True,
        "metric_logger": {"_component_": "x.DiskLogger", "log_dir": "logs"},
        "optimizer_in_bwd": True,
        "save_every_n_steps": 2,
        "checkpointer": {"keep_last_n_checkpoints": 1, "checkpoint_dir": "moved"},
    }
    changed = OmegaConf.merge(cfg, elsewhere)
    files = {"filename_format": "model-{}-of-{}.pt", "max_filename": "00002"}
    changed.checkpointer.checkpoint_files = files
    keys = CheckpointOptions.from_config(make_config(tmp_path)).trajectory.keys()
    assert not [k for k in keys if "checkpoint_dir" in k or "keep_last" in k]
    assert CheckpointOptions.from_config(changed).trajectory == (
        CheckpointOptions.from_config(cfg).trajectory
    )


@pytest.mark.parametrize(
    "change",
    [
        {"max_steps_per_epoch": 3},
        {"gradient_accumulation_steps": 2},
        {"dataset": Samples(12)},
    ],
    ids=["max_steps_per_epoch", "gradient_accumulation_steps", "dataset_length"],
)
@pytest.mark.parametrize("stop_after", [6, 8], ids=["mid_epoch", "epoch_end"])
def test_another_step_count_per_epoch_is_refused_even_with_resume_allow_changes(
    tmp_path: Path, change: dict[str, Any], stop_after: int
) -> None:
    """A resume finds its place in the epoch by optimizer steps: with another count
    per epoch it would train past an epoch's end, or not reach it."""
    cfg = make_config(tmp_path, epochs=3)
    train(cfg, stop_after=stop_after)
    change = dict(change)
    dataset = change.pop("dataset", None)
    allowed = OmegaConf.merge(cfg, change, {"resume_allow_changes": True})
    with pytest.raises(CheckpointError, match=r"steps_per_epoch: 4 then, [0-9]+ now"):
        resume(allowed, dataset=dataset)


def test_fewer_epochs_never_say_that_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(tmp_path, epochs=3)
    train(cfg, stop_after=STEPS_PER_EPOCH + 1)  # step_4 ends epoch 0
    named = {"checkpointer": {"recipe_checkpoint": "step_4"}}
    for epochs, said in ((2, "training stops sooner"), (1, "no epoch is left")):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            resume(OmegaConf.merge(cfg, named, {"epochs": epochs}), stop_after=5)
        assert f"with epochs={epochs} (it was trained with 3): {said}" in (
            warnings_text(caplog)
        )
        assert "goes on" not in warnings_text(caplog)


def test_more_epochs_at_an_epoch_end_extend_the_run_and_say_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(tmp_path)
    train(cfg)  # 2 epochs, its step checkpoints kept
    with caplog.at_level(logging.WARNING):
        run = resume(OmegaConf.merge(cfg, {"epochs": 3}))
    assert run.resumed_at == 2 * STEPS_PER_EPOCH
    assert run.progress.global_step == 3 * STEPS_PER_EPOCH
    assert "with epochs=3 (it was trained with 2): training goes on, to the new " in (
        warnings_text(caplog)
    )


def test_a_trajectory_setting_added_on_resume_is_refused(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    del cfg["max_steps_per_epoch"]
    train(cfg, stop_after=5)
    with pytest.raises(CheckpointError, match="max_steps_per_epoch"):
        resume(OmegaConf.merge(cfg, {"max_steps_per_epoch": 3}))


def test_another_world_size_is_refused_even_with_resume_allow_changes(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    step_4 = tmp_path / "out" / "step_4"
    recipe_state = torch.load(step_4 / RECIPE_STATE, weights_only=False)
    recipe_state["trajectory"]["world_size"] = 2  # as a 2-process run saves it
    rewrite(step_4, RECIPE_STATE, recipe_state)
    with pytest.raises(CheckpointError, match=r"\(world_size: 2 then, 1 now\)"):
        resume(OmegaConf.merge(cfg, {"resume_allow_changes": True}))


def test_a_changed_optimizer_setting_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(tmp_path)
    train(cfg, stop_after=7)
    with caplog.at_level(logging.WARNING):
        run = resume(OmegaConf.merge(cfg, {"optimizer": {"lr": 0.01}}))
    assert (
        "its optimizer state replaces optimizer.lr=0.01 (the checkpoint's: 0.05)"
        in warnings_text(caplog)
    )
    # It trained on with the checkpoint's lr.
    assert_same_weights(run.model, uninterrupted(tmp_path))


def test_an_epoch_of_one_optimizer_step_trains_and_resumes(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, batch_size=8)  # 8 samples: one step an epoch
    train(cfg, stop_after=2)  # before the save at the end of epoch 1
    run = resume(cfg)
    assert run.resumed_at == 1 and run.progress.global_step == 2
    expected = train(make_config(tmp_path / "uninterrupted", batch_size=8)).model
    assert_same_weights(run.model, expected)


def test_an_epoch_without_an_optimizer_step_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path)
    manager = build_manager(cfg)
    model = base_model(manager.load_base_checkpoint())
    loader = make_loader(Samples(1), batch_size=2)  # no full batch
    before = snapshot_files(tmp_path)
    with pytest.raises(
        ValueError, match="^An epoch has no optimizer step: 1 samples make 0 batches"
    ):
        optimizer = make_optimizer(model, cfg, False)
        states = {"model": model, "optimizer": optimizer, "dataloader": loader}
        manager.load(
            states | {"progress": TrainingProgress(total_epochs=2)}, steps_per_epoch=0
        )
    assert snapshot_files(tmp_path) == before


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"save_every_n_steps": 0}, "save_every_n_steps=0"),
        ({"save_every_n_steps": 2.5}, "save_every_n_steps=2.5"),
        (
            {"checkpointer": {"keep_last_n_checkpoints": 0}},
            "checkpointer.keep_last_n_checkpoints=0",
        ),
    ],
)
def test_invalid_options_are_refused_naming_the_key(
    tmp_path: Path, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(
        ValueError, match=f"^{re.escape(named)} must be a positive integer or null"
    ):
        build_manager(make_config(tmp_path, **options))


def test_a_distributed_checkpointer_is_refused_as_the_configured_checkpointer(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path)
    cfg.checkpointer = {
        "_component_": "torchtune.training.DistributedCheckpointer",
        "checkpoint_dir": str(tmp_path / "base"),
        "output_dir": str(tmp_path / "out"),
    }
    with pytest.raises(ValueError, match="reads no weights to start from"):
        build_manager(cfg)


def test_an_output_folder_that_cannot_be_written_is_refused_naming_its_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(tmp_path)
    cfg.output_dir = str(tmp_path / "new" / "nested")  # made later: fine
    cfg.checkpointer.output_dir = str(tmp_path / "ckpt")
    build_manager(cfg)
    (tmp_path / "a_file").write_text("")
    cfg.checkpointer.output_dir = str(tmp_path / "a_file" / "out")
    with pytest.raises(
        PermissionError,
        match=f"^checkpointer.output_dir={tmp_path}/a_file/out cannot be made: "
        f"{tmp_path}/a_file is a file",
    ):
        build_manager(cfg)
    # As a user sees a folder that may be written but not entered (no x bit; root
    # may enter any folder, so permissions cannot show it here).
    real_access = os.access
    closed = tmp_path / "closed"
    closed.mkdir()
    with monkeypatch.context() as patch:
        patch.setattr(
            os,
            "access",
            lambda path, mode: (
                not (Path(path) == closed and mode & os.X_OK)
                and real_access(path, mode)
            ),
        )
        cfg.checkpointer.output_dir = str(closed / "out")
        with pytest.raises(
            PermissionError,
            match=f"^checkpointer.output_dir={closed}/out cannot be written: ",
        ):
            build_manager(cfg)
    # As a user without write permission in tmp_path sees it (root may write
    # anywhere, so permissions cannot show it here).
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
        build_manager(cfg)


# -- the one-run lock ------------------------------------------------------------------


def write_lock(out: Path, pid: int, host: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lock = out / LOCK_FILE
    lock.write_text(
        json.dumps({"pid": pid, "host": host, "started": "2026-01-02 03:04:05 UTC"})
    )
    return lock


def assert_held_by_this_process(lock: Path) -> None:
    owner = json.loads(lock.read_text())
    assert (owner["pid"], owner["host"]) == (os.getpid(), socket.gethostname())


@pytest.mark.parametrize(
    "content", ["its owner", "another host's owner", "unreadable bytes"]
)
def test_a_live_runs_lock_refuses_the_run_whatever_its_file_says(
    tmp_path: Path, content: str
) -> None:
    # Only the lock the live process holds counts (the kernel drops it when the
    # process dies), not what its file says: a stopped heartbeat, a file damaged
    # or naming another host never makes a live run's lock look stale.
    cfg = make_config(tmp_path)
    lock = write_lock(tmp_path / "out", 0, "another-host")
    with held_by_another_process(lock) as pid:
        if content == "its owner":
            write_lock(tmp_path / "out", pid, socket.gethostname())
            named = f"process {pid} on host {socket.gethostname()}"
        elif content == "another host's owner":
            named = "process 0 on host another-host"
        else:
            lock.write_bytes(b"\x00\xff not json")
            named = "a run whose lock file does not say which"
        for attempt in (build_manager, train):
            with pytest.raises(CheckpointError, match=re.escape(named)):
                attempt(cfg)
        assert sorted(p.name for p in lock.parent.iterdir()) == [LOCK_FILE]
    # Its process is gone: the lock is free, whatever the file says.
    run = train(cfg, stop_after=1, kill=False)
    assert_held_by_this_process(lock)
    assert run.progress.global_step == 1


def _contend_for_the_lock(folder: Path, barrier: Any, outcomes: Any) -> None:
    """One of two runs starting together (a forked process)."""
    barrier.wait()
    try:
        lock = take_lock(folder)
    except CheckpointError:
        lock = None
    outcomes.put(lock is not None)
    barrier.wait()  # both have tried before the winner lets go
    if lock is not None:
        release_lock(lock)


@pytest.mark.parametrize("before", ["no lock file", "a dead run's lock file"])
def test_of_two_runs_starting_together_exactly_one_takes_the_lock(
    tmp_path: Path, before: str
) -> None:
    # Checking, deleting a stale lock and creating one had a window in which both
    # runs passed (5 to 14 in 100 trials); an OS lock has none.
    context = multiprocessing.get_context("fork")
    for trial in range(50):
        folder = tmp_path / str(trial)
        if before == "a dead run's lock file":
            write_lock(folder, 1, socket.gethostname())
        barrier, outcomes = context.Barrier(2), context.Queue()
        runs = [
            context.Process(
                target=_contend_for_the_lock, args=(folder, barrier, outcomes)
            )
            for _ in range(2)
        ]
        for run in runs:
            run.start()
        won = sorted(outcomes.get(timeout=60) for _ in runs)
        for run in runs:
            run.join(timeout=60)
        assert won == [False, True], f"trial {trial}: {won}"
        assert not (folder / LOCK_FILE).exists()  # released by the winner


def judge_lock_on_two_hosts(out_dir: Path) -> None:
    """Run by each of 2 processes, rank 1 as if on another host: a 2-node job whose
    output_dir is on a shared file system. Each builds the manager from the config
    in ``out_dir`` (before the process group, as the distributed recipes do) and
    reports whether it was refused."""
    rank = int(os.environ["RANK"])
    if rank == 1:
        socket.gethostname = lambda: "node-1"  # this child process only
    try:
        build_manager(OmegaConf.load(out_dir / "config.yaml"))
        outcome = "accepted"
    except CheckpointError as e:
        outcome = f"refused: {e}"
    write_report(out_dir, rank, {"outcome": outcome})


def test_a_stopped_runs_lock_is_taken_over_saying_so_and_a_new_one_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    crashed = subprocess.Popen(["true"])
    crashed.wait()
    stale = write_lock(tmp_path / "stale", crashed.pid, socket.gethostname())
    with caplog.at_level(logging.WARNING):
        locks = [take_lock(tmp_path / "new"), take_lock(tmp_path / "stale")]
    try:
        assert warnings_text(caplog) == (
            f"Taking over {stale}, left by a run that stopped: process {crashed.pid} "
            f"on host {socket.gethostname()}, started 2026-01-02 03:04:05 UTC"
        )
        assert_held_by_this_process(stale)
        assert_held_by_this_process(tmp_path / "new" / LOCK_FILE)
    finally:
        for lock in locks:
            release_lock(lock)


def test_a_lock_file_deleted_by_its_releasing_owner_is_locked_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run before deletes the file as it releases its lock, after this run
    # opened it: a lock on the deleted file would lock nothing.
    folder = tmp_path / "out"
    write_lock(folder, 0, "another-host")
    flock, locked = fcntl.flock, []

    def released_meanwhile(fd: int, operation: int) -> None:
        if not locked:
            (folder / LOCK_FILE).unlink()
        locked.append(fd)
        flock(fd, operation)

    monkeypatch.setattr(run_folder.fcntl, "flock", released_meanwhile)
    lock = take_lock(folder)
    try:
        assert len(locked) == 2  # the deleted file's, then the new file's
        assert os.fstat(lock.fd).st_ino == os.stat(folder / LOCK_FILE).st_ino
        assert_held_by_this_process(folder / LOCK_FILE)
    finally:
        release_lock(lock)


def test_every_rank_of_a_two_node_run_judges_a_stale_lock_alike(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path)
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    crashed = subprocess.Popen(["true"])
    crashed.wait()
    write_lock(tmp_path / "out", crashed.pid, socket.gethostname())
    run = run_distributed(
        __name__, "judge_lock_on_two_hosts", tmp_path, world_size=2, timeout_s=120
    )
    outcomes = [report.get("outcome") for report in run.reports]
    assert None not in outcomes, run.output
    assert outcomes[0] == outcomes[1], outcomes


def test_the_lock_is_held_while_training_and_released_after_the_last_save(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path)
    lock = tmp_path / "out" / LOCK_FILE
    manager = build_manager(cfg)
    manager.load_base_checkpoint()
    assert not lock.exists()  # building it and the base checkpoint take nothing
    run = train(cfg, stop_after=8, kill=False)  # before its epoch-end save
    assert_held_by_this_process(lock)
    with pytest.raises(CheckpointError, match="in use by another run"):
        build_manager(cfg)  # a second run, even in this process
    run.progress.epochs_run += 1
    run.manager.save(epoch_end=True)
    assert not lock.exists()


# -- LoRA exports ----------------------------------------------------------------------


def lora_config(tmp_path: Path, dora: bool, adapter_only: bool) -> DictConfig:
    base = {k: v for k, v in TinyLoRA(dora).state_dict().items() if "lora" not in k}
    base = {k: v for k, v in base.items() if "magnitude" not in k}
    return make_config(
        tmp_path,
        base=base,
        epochs=1,
        save_adapter_weights_only=adapter_only,
    )


# What the LoRA recipes give the manager for TinyLoRA: q_proj adapted, rank 2.
LORA_ADAPTER = {
    "r": 2,
    "lora_alpha": 4.0,
    "target_modules": ["q_proj"],
    "peft_type": "LORA",
}


def lora_model(dora: bool) -> Callable[[dict[str, Any]], nn.Module]:
    def build(state: dict[str, Any]) -> nn.Module:
        model = TinyLoRA(dora)
        model.load_state_dict(state[training.MODEL_KEY], strict=False)
        if dora:
            model.q_proj.initialize_dora_magnitude()
        peft.set_trainable_params(model, peft.get_adapter_params(model))
        return model

    return build


@pytest.mark.parametrize(
    ("dora", "adapter_only"),
    [(False, False), (True, False), (False, True)],
    ids=["lora", "dora", "adapter_only"],
)
def test_a_lora_export_merges_into_copies_and_leaves_the_live_weights(
    tmp_path: Path, dora: bool, adapter_only: bool
) -> None:
    cfg = lora_config(tmp_path, dora, adapter_only)
    # Killed before the epoch's end.
    run = train(cfg, stop_after=4, build=lora_model(dora), adapter_config=LORA_ADAPTER)
    live = {k: v.clone() for k, v in run.model.state_dict().items()}
    lora_a, lora_b = live["q_proj.lora_a.weight"], live["q_proj.lora_b.weight"]
    assert lora_b.abs().sum() > 0  # trained: merging changes the weight
    run.progress.epochs_run += 1
    run.manager.save(epoch_end=True)

    torch.testing.assert_close(run.model.state_dict(), live, **BITWISE)
    epoch_0 = tmp_path / "out" / "epoch_0"
    adapter_names = sorted(k for k in live if "lora" in k or "magnitude" in k)
    adapter = torch.load(epoch_0 / "adapter_model.pt", weights_only=True)
    torch.testing.assert_close(adapter, {k: live[k] for k in adapter_names}, **BITWISE)
    # The step checkpoint holds the trainable part, the adapter, alone.
    saved = step_state(tmp_path / "out" / "step_4")
    assert sorted(saved["model"]) == adapter_names
    if adapter_only:
        assert not (epoch_0 / EXPORT_FILE).exists()
        return
    merged = torch.load(epoch_0 / EXPORT_FILE, weights_only=True)
    assert sorted(merged) == ["output.bias", "output.weight", "q_proj.weight"]
    weight = live["q_proj.weight"] + (4.0 / 2) * lora_b @ lora_a
    if dora:
        norm = torch.linalg.norm(weight, dim=1)
        weight = weight * (live["q_proj.magnitude"] / norm).view(-1, 1)
    # The same operations on the same values as the merge: bitwise.
    torch.testing.assert_close(merged["q_proj.weight"], weight, **BITWISE)
    torch.testing.assert_close(
        merged["output.weight"], live["output.weight"], **BITWISE
    )


def test_a_lora_resume_of_a_0_6_1_epoch_checkpoint_without_adapter_is_refused(
    tmp_path: Path,
) -> None:
    cfg = lora_config(tmp_path, dora=False, adapter_only=False)
    out = tmp_path / "out"
    # 0.6.1's layout: the weights of epoch_0, the recipe state, and no adapter.
    (out / "epoch_0").mkdir(parents=True)
    torch.save(
        torch.load(tmp_path / "base" / "model.pt"), out / "epoch_0" / EXPORT_FILE
    )
    (out / "recipe_state").mkdir()
    torch.save({training.EPOCHS_KEY: 1}, out / "recipe_state" / "recipe_state.pt")
    manager = build_manager(
        OmegaConf.merge(
            cfg,
            {
                "resume_from_checkpoint": True,
                "checkpointer": {"checkpoint_files": [f"epoch_0/{EXPORT_FILE}"]},
            },
        ),
        LORA_ADAPTER,
    )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "resume_from_checkpoint=True, but no adapter weights were found. Set "
            "checkpointer.adapter_checkpoint, or resume from an output_dir whose "
            "latest epoch_* folder holds adapter_model.pt."
        ),
    ):
        manager.load_base_checkpoint()


# -- torchtune 0.6.1 epoch checkpoints -------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def as_0_6_1_in_backward(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """torchtune 0.6.1's in-backward optimizer state: parameter name -> the state
    dict of that parameter's own optimizer (keyed by 0)."""
    saved = optimizer.state_dict()
    (group,) = saved["param_groups"]
    hyper = {k: v for k, v in group.items() if k != "params"}
    return {
        name: {
            "state": {0: saved["state"][i]},
            "param_groups": [{**hyper, "params": [0]}],
        }
        for i, (name, _) in enumerate(model.named_parameters())
    }


@pytest.mark.parametrize(
    "layout", ["epoch", "epoch_named", "epoch_by_name", "epoch_in_bwd", "dcp"]
)
def test_a_0_6_1_epoch_checkpoint_resumes_at_its_epochs_end(
    tmp_path: Path, layout: str
) -> None:
    """0.6.1 saved the weights in ``epoch_{N}/`` and the progress and optimizer state
    in ``recipe_state/recipe_state.pt`` (which ``checkpointer.recipe_checkpoint`` may
    name) or, asynchronously, all of it in DCP's ``dist_epoch_{N}/``; no data
    position or RNG state, which an epoch's end of a model without dropout does not
    need. The optimizer state: keyed by index, by parameter name (its distributed
    recipes'), or in its in-backward format."""
    after_epoch_0 = train(make_config(tmp_path / "first"), stop_after=4)
    model, optimizer = after_epoch_0.model, after_epoch_0.optimizer
    optimizer_state = {
        "epoch_by_name": lambda: dsd.get_optimizer_state_dict(
            model, optimizer, options=dsd.StateDictOptions(full_state_dict=True)
        ),
        "epoch_in_bwd": lambda: as_0_6_1_in_backward(model, optimizer),
    }.get(layout, optimizer.state_dict)()
    out = tmp_path / "out"
    recipe_state = {
        training.SEED_KEY: 0,
        training.EPOCHS_KEY: 1,
        training.TOTAL_EPOCHS_KEY: 2,
        training.MAX_STEPS_KEY: None,
        training.OPT_KEY: optimizer_state,
    }
    options: dict[str, Any] = {"resume_from_checkpoint": True}
    if layout.startswith("epoch"):
        (out / "epoch_0").mkdir(parents=True)
        (out / "recipe_state").mkdir()
        torch.save(model.state_dict(), out / "epoch_0" / EXPORT_FILE)
        torch.save(recipe_state, out / "recipe_state" / "recipe_state.pt")
        options["checkpointer"] = {"checkpoint_files": [f"epoch_0/{EXPORT_FILE}"]}
        if layout == "epoch_named":
            named = "recipe_state/recipe_state.pt"
            options["checkpointer"]["recipe_checkpoint"] = named
    else:
        recipe_state[training.MODEL_KEY] = model.state_dict()
        DistributedCheckpointer(
            checkpoint_dir=str(tmp_path / "base"), output_dir=str(out)
        ).save_checkpoint(recipe_state, epoch=0)
        options["enable_async_checkpointing"] = True
    cfg = make_config(tmp_path, **options)
    run = train(cfg, in_backward=layout == "dcp")
    assert run.resumed_at == STEPS_PER_EPOCH
    assert_same_weights(run.model, uninterrupted(tmp_path))
    # A run resumed from 0.6.1 is named so, with 8 random hex digits.
    assert re.fullmatch(r"0\.6\.1-[0-9a-f]{8}", read_run_file(out))


def test_a_0_6_1_in_backward_checkpoint_of_two_models_restores_the_last_ones_state(
    tmp_path: Path,
) -> None:
    """0.6.1's PPO recipe saved the in-backward optimizer state of its last model
    (the value model) alone; the other's parameters start without state."""
    value_run = train(make_config(tmp_path / "value"), in_backward=True, stop_after=4)
    out = tmp_path / "out"
    (out / "epoch_0").mkdir(parents=True)
    (out / "recipe_state").mkdir()
    torch.save(
        two_layer_model(seed=5).state_dict(),
        out / "epoch_0" / EXPORT_FILE,
    )
    torch.save(
        {
            training.SEED_KEY: 0,
            training.EPOCHS_KEY: 1,
            training.TOTAL_EPOCHS_KEY: 2,
            training.MAX_STEPS_KEY: None,
            training.OPT_KEY: as_0_6_1_in_backward(
                value_run.model, value_run.optimizer
            ),
        },
        out / "recipe_state" / "recipe_state.pt",
    )
    cfg = make_config(
        tmp_path,
        resume_from_checkpoint=True,
        checkpointer={"checkpoint_files": [f"epoch_0/{EXPORT_FILE}"]},
    )
    manager = build_manager(cfg)
    policy, value = (
        base_model(manager.load_base_checkpoint()),
        two_layer_model(seed=6),
    )
    optimizer = make_optimizer(nn.ModuleList([policy, value]), cfg, in_backward=True)
    progress = TrainingProgress(total_epochs=2)
    models = {"policy": policy, "value": value}
    states = {"model": models, "optimizer": optimizer, "progress": progress}
    manager.load(states | {"dataloader": make_loader(Samples(), 2)}, steps_per_epoch=4)
    manager.close()
    assert progress.global_step == STEPS_PER_EPOCH
    saved = value_run.optimizer.state_dict()["state"]
    first = len(list(policy.parameters()))  # the value model's first index
    restored = optimizer.state_dict()["state"]
    assert sorted(restored) == [first + i for i in sorted(saved)]
    for i, state in saved.items():
        torch.testing.assert_close(restored[first + i], state, **BITWISE)


# -- two processes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "scenario", [n for n in SCENARIOS if n.startswith("checkpoint_manager")]
)
def test_two_gloo_processes_fsdp2(
    optimizer_in_backward_distributed_run: DistributedRun, scenario: str
) -> None:
    """FSDP2 runs on 2 gloo processes stopped mid-epoch and resumed, synchronously
    and asynchronously, into either optimizer, bitwise; see
    optimizer_in_backward_scenarios.py."""
    outcome = optimizer_in_backward_distributed_run.outcome(scenario)
    assert outcome == "ok", outcome


# -- torchtune 0.6.1's resume instructions, and what a folder costs ----------------------


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_checkpoint_files_naming_an_epoch_resume_from_that_epochs_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 0.6.1's instructions: resume_from_checkpoint=True and checkpoint_files pointed
    # at epoch_{N}/ of output_dir. Killed mid-epoch 1 (step_3, step_4 = end of epoch
    # 0, step_6), naming epoch_0 continues from step_4, as 0.6.1 would (it resumes
    # from epoch ends only); the later step_6 stays until the resume's own is whole.
    cfg = make_config(tmp_path)
    train(cfg, stop_after=6)
    out = tmp_path / "out"
    docs = {"checkpoint_files": [f"epoch_0/{EXPORT_FILE}"]}
    with caplog.at_level(logging.WARNING):
        run = resume(make_config(tmp_path, checkpointer=docs))
    assert run.resumed_at == STEPS_PER_EPOCH
    assert (
        "Resuming from step_4 starts a branch: the later step checkpoints (step_6)"
        in (warnings_text(caplog))
    )
    assert_same_weights(run.model, uninterrupted(tmp_path))
    assert step_names(out) == ["step_3", "step_4", "step_6", "step_8"]


def test_checkpoint_files_naming_an_epoch_whose_state_is_gone_are_refused_first(
    tmp_path: Path,
) -> None:
    # Pruned to the newest (step_6, mid-epoch 1): epoch 0's end is gone. The refusal
    # comes when the manager is built, before anything is built or written, naming what can
    # be resumed.
    train(
        make_config(tmp_path, checkpointer={"keep_last_n_checkpoints": 1}), stop_after=7
    )
    out = tmp_path / "out"
    before = snapshot_files(out)
    docs = {"checkpoint_files": [f"epoch_0/{EXPORT_FILE}"]}
    cfg = make_config(tmp_path, checkpointer=docs, resume_from_checkpoint=True)
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            "checkpointer.checkpoint_files names epoch_0/, but the step checkpoint saved "
            "at the end of epoch 0, which a resume from that epoch continues, is not in "
            f"{out} (pruned, or never saved). This run's step checkpoints are: step_6 "
            "(mid-epoch). Name one of them with checkpointer.recipe_checkpoint=step_N, "
            "or set it back to the base model's files to resume from the newest."
        ),
    ):
        build_manager(cfg)
    assert snapshot_files(out) == before


def test_files_naming_several_epochs_are_refused() -> None:
    cfg = OmegaConf.create(
        {"checkpoint_files": ["epoch_0/a.safetensors", "epoch_1/b.safetensors"]}
    )
    with pytest.raises(ValueError, match="name several epochs' folders"):
        _named_epoch(cfg)
    # The adapter decides for LoRA (0.6.1 reads its base from checkpoint_dir), and a
    # filename format is read like a file name.
    lora = {"checkpoint_files": ["model.pt"], "adapter_checkpoint": "epoch_3/a.pt"}
    assert _named_epoch(OmegaConf.create(lora)) == 3
    formatted = {"filename_format": "epoch_2/model-{}-of-{}.safetensors"}
    assert _named_epoch(OmegaConf.create({"checkpoint_files": formatted})) == 2
    assert _named_epoch(OmegaConf.create({"checkpoint_files": ["model.pt"]})) is None


def test_a_finished_run_leaves_its_exports_only_unless_asked_and_says_the_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(tmp_path, checkpointer={"keep_last_n_checkpoints": None})
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO):
        train(cfg)
    assert step_names(out) == []
    assert re.search(
        r"Its step checkpoints \([0-9.]+ MB\) are deleted: to keep them, for training "
        r"further later, set checkpointer.keep_last_n_checkpoints.",
        caplog.text,
    )
    # Nothing but the exports, their manifests and the run's name is left.
    assert sorted(p.name for p in out.iterdir()) == [
        ".epoch_0.manifest.json",
        ".epoch_1.manifest.json",
        "epoch_0",
        "epoch_1",
        RUN_FILE,
    ]
    # A resume of it says what happened and where its weights are.
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"The run there finished (final weights in {out / 'epoch_1'}) and its "
            "step checkpoints were deleted"
        ),
    ):
        resume(cfg)


def test_rerunning_a_command_in_its_folder_does_not_grow_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(tmp_path, checkpointer={"keep_last_n_checkpoints": None})
    out = tmp_path / "out"
    train(cfg)
    sizes = [folder_bytes(out)]
    train(cfg, stop_after=5)  # a rerun killed mid-epoch: its step_3, step_4
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            train(cfg)
            sizes.append(folder_bytes(out))
    # The killed rerun's resumable state was deleted once the next run's first
    # save was whole, saying what and how much.
    assert re.search(
        r"Deleting step_3, step_4 \([0-9.]+ MB\), an earlier run's resumable state: "
        rf"{re.escape(str(out / 'step_3'))} supersedes it",
        warnings_text(caplog),
    )
    # The same files each time; the bytes may differ by a digit of a run id.
    assert max(sizes) - min(sizes) < 100, sizes


def test_a_damaged_final_export_is_named_damaged_not_offered(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, checkpointer={"keep_last_n_checkpoints": None})
    out = tmp_path / "out"
    train(cfg)
    export = out / "epoch_1" / EXPORT_FILE
    export.write_bytes(export.read_bytes()[:100])
    with pytest.raises(CheckpointError) as refused:
        resume(cfg)
    message = str(refused.value)
    assert f"{export} is damaged" in message
    assert "checkpoint_dir=" not in message  # the damaged weights are not offered
    assert "resume_from_checkpoint=False" in message


def test_a_finished_lora_runs_way_on_never_reads_its_own_future_exports(
    tmp_path: Path,
) -> None:
    cfg = lora_config(tmp_path, dora=False, adapter_only=False)
    cfg = OmegaConf.merge(cfg, {"checkpointer": {"keep_last_n_checkpoints": None}})
    lora = {"build": lora_model(False), "adapter_config": LORA_ADAPTER}
    out = tmp_path / "out"
    train(cfg, **lora)
    with pytest.raises(CheckpointError) as refused:
        resume(cfg, **lora)
    # The way on, followed as written: the final weights as the base, in another
    # output_dir (the run's exports there never overwrite the base it reads).
    advice = re.search(r"start a new run with (.*?): ", str(refused.value))
    assert advice, str(refused.value)
    overrides = dict(arg.split("=", 1) for arg in advice[1].split())
    assert overrides["checkpointer.checkpoint_dir"] == str(out / "epoch_0")
    assert Path(overrides["output_dir"]) != out
    way_on = OmegaConf.merge(
        cfg,
        OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]),
        {"checkpointer": {"keep_last_n_checkpoints": 10}},
    )
    train(way_on, stop_after=3, **lora)
    resumed = resume(way_on, **lora)
    assert resumed.resumed_at == 3
    elsewhere = OmegaConf.merge(way_on, {"output_dir": str(tmp_path / "reference")})
    elsewhere.checkpointer.output_dir = str(tmp_path / "reference")
    assert_same_weights(resumed.model, train(elsewhere, **lora).model)
    # The same in output_dir itself would read its own next export: refused.
    in_place = OmegaConf.merge(way_on, {"output_dir": str(out)})
    in_place.checkpointer.output_dir = str(out)
    with pytest.raises(ValueError, match="output_dir") as refused:
        train(in_place, **lora)
    assert f"checkpointer.checkpoint_dir={out / 'epoch_0'}" in str(refused.value)


@pytest.mark.parametrize(
    "failure",
    [
        OSError(28, "No space left on device"),
        RuntimeError(
            "[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0"
        ),
    ],
    ids=["ENOSPC", "unexpected pos"],
)
@pytest.mark.parametrize("writing", ["step", "export"])
def test_a_full_disk_names_the_checkpoint_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception, writing: str
) -> None:
    run = train(make_config(tmp_path), stop_after=2)
    out = tmp_path / "out"
    real_save = torch.save

    def full_disk(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        # A file, bytes in memory (a process's own state), or a path.
        name = str(getattr(f, "name", "") if hasattr(f, "write") else f)
        if (".step_3.partial" if writing == "step" else "epoch_0") in name:
            raise failure
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    if writing == "step":
        run.progress.global_step += 1  # step 3: a step checkpoint is due
        with pytest.raises(OSError) as stopped:
            run.manager.save()
        where = out / ".step_3.partial"
    else:
        run.progress.global_step += 2  # step 4 ends the epoch
        run.progress.epochs_run += 1
        with pytest.raises(OSError) as stopped:
            run.manager.save(epoch_end=True)
        where = out / "epoch_0"
    assert str(where) in str(stopped.value)
    assert "disk" in str(stopped.value)


def test_upstreams_final_epoch_notes_are_logged_at_the_final_epoch_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(tmp_path, epochs=3)
    with caplog.at_level(logging.INFO):
        train(cfg)
    assert caplog.text.count("Saving final epoch checkpoint.") == 1
    # The others are named by the manager, with their size.
    for epoch in (0, 1):
        assert f"Epoch {epoch}'s weights exported to {tmp_path / 'out'}" in caplog.text
    # Pruning is named only when keep_last_n_checkpoints asks for it.
    assert "Deleted " not in caplog.text
    caplog.clear()
    pruned = make_config(
        tmp_path / "pruned", checkpointer={"keep_last_n_checkpoints": 1}
    )
    with caplog.at_level(logging.INFO):
        train(pruned)
    assert "(keep_last_n_checkpoints=1)" in caplog.text


def test_an_epoch_end_resume_rewrites_an_export_another_run_wrote(
    tmp_path: Path,
) -> None:
    # Run A (another learning rate) finished here; run B, a rerun, saved step_4 at
    # epoch 0's end and died before its export: epoch_0 still holds A's weights,
    # whole by their manifest. B's resume must replace them with its own.
    out = tmp_path / "out"
    train(make_config(tmp_path, optimizer={"lr": 0.01}))
    a_export = (out / "epoch_0" / EXPORT_FILE).read_bytes()
    a_manifest = export_manifest(out / "epoch_0").read_bytes()
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    (out / "epoch_0" / EXPORT_FILE).write_bytes(a_export)
    export_manifest(out / "epoch_0").write_bytes(a_manifest)
    assert step_names(out) == ["step_3", "step_4"]
    resume(cfg, stop_after=5)
    expected = tmp_path / "uninterrupted" / "out" / "epoch_0" / EXPORT_FILE
    uninterrupted(tmp_path)
    assert (out / "epoch_0" / EXPORT_FILE).read_bytes() == expected.read_bytes()


@pytest.mark.parametrize("where", ["equal", "inside"])
def test_an_output_dir_in_a_base_checkpoint_folder_is_refused_first(
    tmp_path: Path, where: str
) -> None:
    base = tmp_path / "base"
    out = base if where == "equal" else base / "runs" / "a"
    cfg = make_config(tmp_path, output_dir=str(out), checkpointer={"output_dir": None})
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"output_dir={out} is inside checkpointer.checkpoint_dir={base}: the run "
            "would write its checkpoints and exports among the base model's files"
        ),
    ):
        build_manager(cfg)
    assert sorted(p.name for p in base.iterdir()) == ["model.pt"]


def test_a_folder_name_longer_than_the_file_system_allows_is_refused(
    tmp_path: Path,
) -> None:
    out = tmp_path / ("x" * 300) / "run"
    with pytest.raises(
        ValueError,
        match=r"output_dir=.* cannot be made: its folder name x{40}\.\.\. is 300 bytes, "
        r"more than the 255 this file system allows",
    ):
        build_manager(make_config(tmp_path, output_dir=str(out)))
    # A name of exactly the limit can be made.
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    check_writable("output_dir", tmp_path / ("x" * name_max) / "run")


@pytest.mark.parametrize(
    ("edit", "reported"),
    [
        ("a character of the run id lost", "its entries changed since it was written"),
        ("the version damaged", "its entries changed since it was written"),
        ("the DCP metadata dropped, checksum redone", "lists no .metadata"),
    ],
)
def test_a_damaged_or_edited_manifest_is_skipped_as_damaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, edit: str, reported: str
) -> None:
    # Its checkpoint is not taken for another run's, its version not named as one,
    # and a file it does not list is never loaded: it gives way to the one before.
    cfg = make_config(tmp_path)
    train(cfg, stop_after=5)
    step = tmp_path / "out" / "step_4"
    manifest = json.loads((step / MANIFEST).read_text())
    if edit == "a character of the run id lost":
        manifest["run_id"] = manifest["run_id"][:-1]
    elif edit == "the version damaged":
        manifest["version"] = "2x"
    else:
        del manifest["files"][DCP_METADATA]
        (step / DCP_METADATA).unlink()
        manifest["manifest_crc32"] = _manifest_checksum(manifest)
    (step / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        run = resume(cfg)
    assert f"Skipping step checkpoint {step}: " in warnings_text(caplog)
    assert reported in warnings_text(caplog)
    assert run.resumed_at == 3
    assert_same_weights(run.model, uninterrupted(tmp_path))


def test_a_recipes_own_state_is_saved_and_restored_through_a_kill(
    tmp_path: Path,
) -> None:
    # A weight average the library knows nothing of, handed to load() with the rest:
    # killed after step 7 (newest checkpoint: step_6), the resumed run ends with
    # the uninterrupted run's average, bitwise.
    cfg = make_config(tmp_path)
    train(cfg, stop_after=7, average=True)
    run = resume(cfg, average=True)
    assert run.resumed_at == 6
    expected = train(make_config(tmp_path / "uninterrupted"), average=True)
    torch.testing.assert_close(run.average.average, expected.average.average, **BITWISE)
    assert_same_weights(run.model, expected.model)
    # A checkpoint saved without it cannot restore it: refused, naming it.
    plain = make_config(tmp_path / "plain")
    train(plain, stop_after=7)
    with pytest.raises(CheckpointError, match=r"holds no state for \['average'\]"):
        resume(plain, average=True)


# -- the order of calls ----------------------------------------------------------------


@pytest.mark.parametrize("resume_it", [False, True], ids=["new_run", "resume"])
def test_building_the_manager_changes_nothing_on_disk(
    tmp_path: Path, resume_it: bool
) -> None:
    # A folder holding what every policy acts on: a run's step checkpoints and
    # exports, and a killed save's leftovers.
    out = tmp_path / "out"
    train(make_config(tmp_path), stop_after=7)
    leftover = out / ".step_7.partial"
    leftover.mkdir()
    (leftover / RECIPE_STATE).write_bytes(b"torn")
    before = snapshot_files(out)
    cfg = make_config(tmp_path, resume_from_checkpoint=resume_it)
    manager = build_manager(cfg)
    manager.load_base_checkpoint()
    assert snapshot_files(out) == before
    # What the folder needs done is done by load(), under the lock.
    killed(manager)
    train(cfg, stop_after=7 if resume_it else 1)
    assert not leftover.exists()


def manager_loaded(tmp_path: Path) -> tuple[CheckpointManager, Callable[[], None]]:
    """A manager and the load(...) call a recipe makes, over a fresh model."""
    cfg = make_config(tmp_path)
    manager = build_manager(cfg)
    model = two_layer_model()
    optimizer = make_optimizer(model, cfg, in_backward=False)
    loader = make_loader(Samples(), cfg.batch_size)
    progress = TrainingProgress(total_epochs=cfg.epochs)

    def load() -> None:
        states = {"model": model, "optimizer": optimizer, "dataloader": loader}
        manager.load(states | {"progress": progress}, steps_per_epoch=STEPS_PER_EPOCH)

    return manager, load


def test_each_call_out_of_order_raises_naming_the_call_to_make_first(
    tmp_path: Path,
) -> None:
    manager, load = manager_loaded(tmp_path)
    with pytest.raises(RuntimeError, match=r"save\(\) needs load_base_checkpoint\(\) "):
        manager.save()
    with pytest.raises(RuntimeError, match=r"load\(\) needs load_base_checkpoint\(\)"):
        load()
    manager.load_base_checkpoint()
    with pytest.raises(RuntimeError, match=r"load_base_checkpoint\(\) was called"):
        manager.load_base_checkpoint()
    with pytest.raises(RuntimeError, match=r"save\(\) needs load\(\.\.\.\) first"):
        manager.save(epoch_end=True)
    load()
    manager.save()
    manager.close()
    for call in (manager.save, load):
        with pytest.raises(RuntimeError, match="after the run ended"):
            call()
    manager.close()  # closing again does nothing
