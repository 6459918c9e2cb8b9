"""Saving and resuming a run: :class:`CheckpointManager` and :class:`TrainingProgress`.

A run's resumable state is a *step checkpoint*, the folder ``output_dir/step_{N}/``:

- ``model_optimizer.pt`` (one process) or the sharded ``model_optimizer/`` folder of
  ``torch.distributed.checkpoint`` (several): the trainable weights, buffers and the
  optimizer state (frozen weights are the base checkpoint's, read first);
- ``recipe_state.pt``: the progress, the optimizer class, and what shaped the run's
  trajectory (the settings a resume must match);
- ``rank_{r}.pt``: each process's dataloader position and RNG state;
- ``manifest.json``, written last: the size and CRC-32 of every file, and the run id.

It is written into ``.step_{N}.partial/`` and renamed once whole, and verified, every
byte, before anything of it is loaded. The epoch exports (``epoch_{N}/``, the weights
users take away, written by the configured checkpointer) get a manifest of their own,
``.torchtune_manifest.json``, so a torn or damaged export is found and rewritten.

``torchtune_run.json`` names the run ``output_dir`` holds, and ``torchtune_run.lock``
the process training it. Nothing is deleted but the step checkpoints that
``keep_last_n_checkpoints`` prunes: an earlier run's files, and the later checkpoints
of a timeline a resume branches from, are moved into ``previous_runs/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import socket
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
from omegaconf import DictConfig
from torch import nn

from torchtune import config, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.modules import peft
from torchtune.training.checkpointing._checkpointer import DistributedCheckpointer
from torchtune.training.optim_in_bwd_legacy_state_dict import (
    convert_legacy_optim_in_bwd_state_dict,
    is_legacy_in_bwd_state_dict,
)

log = utils.get_logger("DEBUG")

MANIFEST, EXPORT_MANIFEST, MANIFEST_VERSION = (
    "manifest.json",
    ".torchtune_manifest.json",
    2,
)
RECIPE_STATE, RUN_FILE, LOCK_FILE = (
    "recipe_state.pt",
    "torchtune_run.json",
    "torchtune_run.lock",
)
MODEL_OPTIMIZER_FILE, MODEL_OPTIMIZER_DCP = "model_optimizer.pt", "model_optimizer"
PREVIOUS_RUNS, OPTIMIZER_COMPONENT, TRAJECTORY = (
    "previous_runs",
    "optimizer_component",
    "trajectory",
)
# Each param group's hyperparameters: DCP loads only the entries a new optimizer has.
HYPERPARAMETERS = "optimizer_param_group_hyperparameters"
# The config values that set a run's step count and data order.
TRAJECTORY_KEYS = (
    "seed",
    "batch_size",
    "gradient_accumulation_steps",
    "max_steps_per_epoch",
    "ppo_batch_size",
    "ppo_epochs",
)
# A lock held from another host is stale once its heartbeat (mtime) is this old.
LOCK_STALE_AFTER_S, _HEARTBEAT_S = 300.0, 30.0
_STEP_DIR = re.compile(r"^step_(\d+)$")
# What a run leaves that a later run could mistake for its own.
_RUN_OUTPUTS = re.compile(
    rf"^(step_\d+|\.step_\d+\.partial|epoch_\d+|dist_epoch_\d+|recipe_state|{re.escape(RUN_FILE)})$"
)
_TRAINABLE = dsd.StateDictOptions(ignore_frozen_params=True)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed, or an output folder that cannot be used."""


@dataclass
class TrainingProgress:
    """Where a run stands: the epochs and optimizer steps done, of ``total_epochs``.

    :class:`CheckpointManager` saves it with every checkpoint and loads it back on
    resume; ``total_epochs`` stays the config's, so a resumed run may train longer.
    """

    total_epochs: int
    epochs_run: int = 0
    global_step: int = 0

    def state_dict(self) -> dict[str, int]:
        return {
            training.EPOCHS_KEY: self.epochs_run,
            training.TOTAL_EPOCHS_KEY: self.total_epochs,
            "global_step": self.global_step,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.epochs_run = state_dict[training.EPOCHS_KEY]
        self.global_step = state_dict["global_step"]


# -- files ---------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _sharded() -> bool:
    """A ``torch.distributed`` run, whose models are sharded (FSDP2), one process too."""
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _world_size() > 1:
        dist.barrier()


def _gather(value: Any) -> list[Any]:
    if _world_size() == 1:
        return [value]
    values: list[Any] = [None] * _world_size()
    dist.all_gather_object(values, value)
    return values


def _on_rank_zero(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0; every rank gets its result, or raises what it raised."""
    outcome: list[Any] = [None, None]
    if _rank() == 0:
        try:
            outcome[0] = fn()
        except Exception as e:  # re-raised on every rank below
            outcome[1] = e
    if _world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def file_checksum(path: str | Path) -> str:
    """The CRC-32 of a file, as 8 hex digits: it catches any changed byte and any
    truncation (damage, not forgery). The file is read in place through ``mmap``."""
    crc = 0
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return f"{crc:08x}"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            for start in range(0, len(mapped), 16 << 20):
                crc = zlib.crc32(view[start : start + (16 << 20)], crc)
            view.release()
    return f"{crc:08x}"


def _describe(folder: Path, skip: str) -> dict[str, dict[str, Any]]:
    """Size and CRC-32 of every file of ``folder`` but ``skip``; the ranks of a
    distributed run share the reading (call it on every rank)."""
    names = _on_rank_zero(
        lambda: sorted(
            str(p.relative_to(folder))
            for p in folder.rglob("*")
            if p.is_file() and p.name != skip
        )
    )
    mine = {
        n: {"size": (folder / n).stat().st_size, "crc32": file_checksum(folder / n)}
        for n in names[_rank() :: _world_size()]
    }
    return dict(sorted((k, v) for part in _gather(mine) for k, v in part.items()))


def read_manifest(folder: Path, name: str = MANIFEST) -> dict[str, Any]:
    """The manifest ``name`` of ``folder``.

    Raises:
        CheckpointError: if it is missing (the save did not finish), damaged, or of
            another version.
    """
    path = folder / name
    if not path.is_file():
        raise CheckpointError(
            f"{folder} is not whole: it has no {name}, which is written last, so the "
            "save that made it did not finish"
        )
    try:
        manifest = json.loads(path.read_text())
        version = manifest.get("version", 1)
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is damaged ({e!r})") from e
    if version != MANIFEST_VERSION:
        raise CheckpointError(
            f"{path} is of manifest version {version}, written by an earlier build of "
            "this patch set, without checksums this one can verify. Resume it with "
            "the torchtune build that wrote it, or start a new run "
            "(resume_from_checkpoint=False)."
        )
    try:
        ok = all(
            isinstance(e["size"], int) and isinstance(e["crc32"], str)
            for e in manifest["files"].values()
        )
    except (KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path} is damaged: its file list is not a manifest's")
    return manifest


def verify(folder: str | Path, name: str = MANIFEST) -> dict[str, Any]:
    """Check that every file the manifest ``name`` of ``folder`` lists is there with
    the size and CRC-32 it had when written; call it on every rank of a distributed
    run, which share the reading.

    Raises:
        CheckpointError: naming what is missing or damaged.
    """
    folder = Path(folder)
    manifest = read_manifest(folder, name)
    problems = []
    for n in sorted(manifest["files"])[_rank() :: _world_size()]:
        path, entry = folder / n, manifest["files"][n]
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != entry["size"]:
            size = path.stat().st_size
            problems.append(
                f"{path} is damaged: {size} bytes, {entry['size']} when written"
            )
        elif file_checksum(path) != entry["crc32"]:
            problems.append(
                f"{path} is damaged: its content changed since it was written"
            )
    problems = [p for part in _gather(problems) for p in part]
    if problems:
        raise CheckpointError("; ".join(problems))
    return manifest


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def _step_dirs(folder: Path, run_id: str | None = None) -> list[Path]:
    """The ``step_{N}`` folders of ``folder``, newest first; with ``run_id``, only
    those of that run (or of no recorded run)."""
    found = folder.iterdir() if folder.is_dir() else []
    steps = [p for p in found if p.is_dir() and step_of(p) is not None]
    steps = [p for p in steps if run_id is None or _run_id_of(p) in (run_id, None)]
    return sorted(steps, key=step_of, reverse=True)


def _run_id_of(step_dir: Path) -> str | None:
    try:
        return json.loads((step_dir / MANIFEST).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def read_run_file(folder: Path) -> str | None:
    try:
        return json.loads((folder / RUN_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_run_file(folder: Path, run_id: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f".{RUN_FILE}.tmp").write_text(json.dumps({"run_id": run_id}))
    os.replace(folder / f".{RUN_FILE}.tmp", folder / RUN_FILE)


def _set_aside(
    entries: list[Path], label: str, reason: str, copies: list[Path] = ()
) -> None:
    """Move ``entries`` (and copy ``copies``, which stay in use) into
    ``previous_runs/{label}/`` of their folders."""
    for folder in sorted({e.parent for e in [*entries, *copies]}):
        target, suffix = folder / PREVIOUS_RUNS / label, 1
        while target.exists():  # never merge into an earlier move
            suffix += 1
            target = folder / PREVIOUS_RUNS / f"{label}.{suffix}"
        target.mkdir(parents=True)
        moved = sorted(e.name for e in entries if e.parent == folder)
        for name in moved:
            os.replace(folder / name, target / name)
        copied = sorted(e.name for e in copies if e.parent == folder)
        for name in copied:
            copy = shutil.copytree if (folder / name).is_dir() else shutil.copy2
            copy(folder / name, target / name)
        _fsync_dir(folder)
        also = f", copied {', '.join(copied)} (read by this run)" if copied else ""
        log.warning(
            f"{reason}: moved {', '.join(moved)}{also} to {target} (nothing deleted)."
        )


def check_writable(key: str, path: str | Path) -> None:
    """Refuse a folder this process cannot write: ``path``, or the nearest existing
    folder above it, where it would be made.

    Raises:
        PermissionError: naming ``key`` and ``path``.
    """
    path = existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise PermissionError(
            f"{key}={path} cannot be made: {existing} is a file, not a folder. Set "
            f"{key} to a folder this run can write."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(
            f"{key}={path} cannot be written: this process has no write permission "
            f"in {existing}, so no checkpoint could be saved. Set {key} to a folder "
            f"this run can write, or give it write permission (chmod u+w {existing})."
        )


# -- the one-run lock ----------------------------------------------------------------


def _check_lock(folder: Path) -> None:
    """Refuse ``folder`` if a live run holds its lock; a stale lock (its process is
    gone or, on another host, its heartbeat stopped) is no obstacle."""
    path = folder / LOCK_FILE
    try:
        owner, age = json.loads(path.read_text()), time.time() - path.stat().st_mtime
        pid, host = owner["pid"], owner["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if host == socket.gethostname():
        if pid == os.getpid():  # a process runs one recipe at a time
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:  # alive, another user's
            pass
    elif age > LOCK_STALE_AFTER_S:
        return
    raise CheckpointError(
        f"output_dir={folder} is in use by another run (process {pid} on host {host}, "
        f"started {owner.get('started')}): two runs in one folder would overwrite each "
        "other's checkpoints. Wait for it to finish, stop it, or set output_dir to "
        "another folder."
    )


def _take_lock(folder: Path) -> None:
    path = folder / LOCK_FILE
    _check_lock(folder)
    if path.exists():
        log.warning(
            f"Taking over {path}, left by a run that stopped: {path.read_text()}"
        )
        path.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # another run took it since the check
        _check_lock(folder)
        raise
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with os.fdopen(fd, "w") as f:
        json.dump(
            {"pid": os.getpid(), "host": socket.gethostname(), "started": started}, f
        )


def _heartbeat(path: Path, stop: threading.Event) -> None:
    while not stop.wait(_HEARTBEAT_S):
        try:
            os.utime(path)
        except OSError:
            return


def _release_lock(path: Path, stop: threading.Event) -> None:
    stop.set()
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


# -- what a checkpoint holds ---------------------------------------------------------


def _load_trainable(model: nn.Module, state_dict: dict[str, Any], where: Path) -> None:
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = sorted(
        set(missing) & set(dsd.get_model_state_dict(model, options=_TRAINABLE))
    )
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not match this model: missing trainable entries "
            f"{missing[:5]}, unexpected entries {sorted(unexpected)[:5]}. Resume with "
            "the model of the run that saved it."
        )


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in g.items() if k not in ("params", "param_names")}
        for g in optimizer.param_groups
    ]


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements
        return str(a) != str(b)


def _fingerprint(dataset: Any) -> str:
    """A cheap fingerprint of a dataset's contents: its first, middle and last sample."""
    n, digest = len(dataset), hashlib.sha256()
    for i in sorted({0, n // 2, n - 1}) if n else []:
        jsonable = lambda v: v.tolist() if hasattr(v, "tolist") else type(v).__name__  # noqa: E731
        digest.update(json.dumps(dataset[i], sort_keys=True, default=jsonable).encode())
    return digest.hexdigest()[:16]


def _lora_export(
    state_dict: dict[str, Any], adapter: dict[str, Any], adapter_only: bool
) -> dict[str, Any]:
    """A LoRA model's export: its adapter, the PEFT adapter config and, unless
    ``adapter_only``, the weights with the adapter merged in. Each merged base weight
    is copied first: a CPU state dict may hold the live model's own tensors."""
    export = {
        training.ADAPTER_KEY: peft.get_adapter_state_dict(state_dict),
        # A copy: checkpointers rewrite the config they save in place.
        training.ADAPTER_CONFIG: {
            **adapter,
            "target_modules": [*adapter["target_modules"]],
        },
    }
    if not adapter_only:
        for name in [n for n in state_dict if n.endswith("lora_a.weight")]:
            base = name.removesuffix("lora_a.weight") + "weight"
            state_dict[base] = state_dict[base].clone()
        export[training.MODEL_KEY] = peft.get_merged_lora_ckpt(
            state_dict, rank=adapter["r"], alpha=adapter["lora_alpha"]
        )
    return export


def _base_paths(cfg: Mapping[str, Any]) -> list[Path]:
    """What every checkpointer section of ``cfg`` reads: a new run never moves them,
    even when they are an earlier run's ``epoch_{N}``."""
    paths = []
    for key, section in cfg.items():
        if str(key).endswith("checkpointer") and section.get("checkpoint_dir", None):
            root = Path(section.checkpoint_dir)
            files = section.get("checkpoint_files", None) or []
            names = [] if isinstance(files, str | Mapping) else list(files)
            names += (
                [section.adapter_checkpoint]
                if section.get("adapter_checkpoint")
                else []
            )
            paths += [root] + [root / str(n) for n in names]
    return paths


# -- the manager ---------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointOptions:
    """What :class:`CheckpointManager` is told by the config (see
    :meth:`CheckpointManager.from_config` for the keys)."""

    output_dir: Path
    checkpointer: Any
    device: torch.device = torch.device("cpu")
    resume: bool = False
    recipe_checkpoint: str | None = None
    every_n_steps: int | None = None
    keep_last_n: int | None = None
    async_save: bool = False
    allow_changes: bool = False
    optimizer_component: str | None = None
    trajectory: Mapping[str, Any] = field(default_factory=dict)
    length: tuple[str, Any] = ("epochs", None)
    adapter_config: dict[str, Any] | None = None
    adapter_only: bool = False
    keep: tuple[Path, ...] = ()


class CheckpointManager:
    """Saves a run and resumes it, exactly: the one object a recipe asks.

    A recipe builds it first, with :meth:`from_config` (bad options and a resume
    that cannot work are refused then, before anything is built or written), reads
    the weights to start from with :meth:`load_base_checkpoint`, builds its model,
    optimizer and data, and hands them over with :meth:`load`, which puts a resumed
    run back where it was. In the loop, :meth:`save` after every optimizer step and
    ``save(epoch_end=True)`` after every epoch: a step checkpoint when one is due
    (``save_every_n_steps``) and at every epoch's end, then the epoch export through
    the configured checkpointer. ``resume_from_checkpoint: True`` continues from the
    newest whole step checkpoint (or the one ``checkpointer.recipe_checkpoint``
    names, which starts a branch), or from a torchtune 0.6.1 epoch checkpoint.

    Example (a recipe's use; ``docs/source/step_checkpoints.rst`` runs one)::

        manager = CheckpointManager.from_config(cfg)  # in __init__
        model.load_state_dict(manager.load_base_checkpoint()[training.MODEL_KEY])
        progress = TrainingProgress(total_epochs=cfg.epochs)
        manager.load(model, optimizer, dataloader, progress, steps_per_epoch=10)
        for epoch in range(progress.epochs_run, progress.total_epochs):
            for batch in batches:  # forward, backward, optimizer.step()
                progress.global_step += 1
                manager.save()
            progress.epochs_run += 1
            manager.save(epoch_end=True)
    """

    def __init__(self, options: CheckpointOptions) -> None:
        for key, value, null in (
            ("save_every_n_steps", options.every_n_steps, "save at epoch ends only"),
            ("checkpointer.keep_last_n_checkpoints", options.keep_last_n, "keep all"),
        ):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(
                    f"{key}={value!r} must be a positive integer or null (null: {null})"
                )
        component = options.checkpointer._component_
        if issubclass(_get_component_from_path(component), DistributedCheckpointer):
            raise ValueError(
                f"checkpointer._component_={component} reads no weights to start from: "
                "use an HF, Meta or torchtune checkpointer (step checkpoints are "
                "sharded already)."
            )
        self.options = o = options
        self._out = Path(o.output_dir)
        self._export_dir = Path(o.checkpointer.get("output_dir") or self._out)
        check_writable("output_dir", self._out)
        if self._export_dir.absolute() != self._out.absolute():
            check_writable("checkpointer.output_dir", self._export_dir)
        if int(os.environ.get("RANK", 0)) == 0:  # rank 0 judges the lock for all
            _check_lock(self._out)
        # A new run: None; else the step checkpoints to try, newest first, or
        # torchtune 0.6.1's "epoch" or "dcp" (async) epoch checkpoint.
        self._resume_from = self._resume_points() if o.resume else None
        self._run_id: str | None = None
        self._legacy_state: dict[str, Any] = {}
        self._checkpointer: Any = None
        self._pending: tuple[Any, Path, Path] | None = None
        self._async_group: Any = None
        self._lock: Callable[[], None] = lambda: None

    @classmethod
    def from_config(cls, cfg: DictConfig) -> CheckpointManager:
        """Read the options from a recipe config: ``output_dir`` (default: the
        checkpointer's), ``checkpointer`` (and its ``recipe_checkpoint`` and
        ``keep_last_n_checkpoints``), ``device``, ``resume_from_checkpoint``,
        ``resume_allow_changes``, ``save_every_n_steps``,
        ``enable_async_checkpointing``, ``optimizer._component_``, the settings of
        :data:`TRAJECTORY_KEYS`, ``epochs`` (PPO: ``num_steps``) and, for a LoRA
        model, its adapter and ``save_adapter_weights_only``."""
        cfg_checkpointer = cfg.checkpointer.copy()
        keep_last_n = cfg_checkpointer.pop("keep_last_n_checkpoints", None)
        model, adapter = cfg.get("model", None) or {}, None
        if "lora_rank" in model:
            modules = peft.get_lora_module_names(
                list(model.lora_attn_modules),
                model.get("apply_lora_to_mlp", False),
                model.get("apply_lora_to_output", False),
            )
            adapter = {"r": model.lora_rank, "lora_alpha": model.lora_alpha}
            adapter |= {"target_modules": modules, "peft_type": "LORA"}
        length_key = "epochs" if "epochs" in cfg else "num_steps"
        return cls(
            CheckpointOptions(
                output_dir=Path(cfg.get("output_dir") or cfg_checkpointer.output_dir),
                checkpointer=cfg_checkpointer,
                device=utils.get_device(device=cfg.device),
                resume=cfg.get("resume_from_checkpoint", False),
                recipe_checkpoint=cfg_checkpointer.get("recipe_checkpoint", None),
                every_n_steps=cfg.get("save_every_n_steps", None),
                keep_last_n=keep_last_n,
                async_save=cfg.get("enable_async_checkpointing", False),
                allow_changes=cfg.get("resume_allow_changes", False),
                optimizer_component=(cfg.get("optimizer") or {}).get("_component_"),
                trajectory={k: cfg.get(k) for k in TRAJECTORY_KEYS if k in cfg},
                length=(length_key, cfg.get(length_key, None)),
                adapter_config=adapter,
                adapter_only=cfg.get("save_adapter_weights_only", False),
                keep=tuple(_base_paths(cfg)),
            )
        )

    # -- choosing what a resume continues from ----------------------------------------

    def _resume_points(self) -> list[Path] | str:
        """The step checkpoints a resume may continue from, newest first (of the run
        ``output_dir`` holds, or the one ``recipe_checkpoint`` names), or a 0.6.1
        epoch checkpoint. Read now, before anything is built, are only names,
        manifests and the optimizer class; :meth:`load` verifies every byte."""
        named = self.options.recipe_checkpoint
        folder = self._out / named if named else None
        if folder is not None and step_of(folder) is None:
            folder = folder.parent
        if named and step_of(folder) is None:  # 0.6.1's recipe_state.pt
            if not (self._export_dir / named).is_file():
                raise CheckpointError(
                    f"checkpointer.recipe_checkpoint={named} names "
                    f"{self._export_dir / named}, which does not exist. Name the "
                    "recipe_state.pt of the run to continue (relative to "
                    "checkpointer.output_dir), or leave it unset to resume from the "
                    "newest checkpoint in output_dir."
                )
            return self._check_optimizer(self._export_dir / named, "epoch")
        if named and not folder.is_dir():
            raise CheckpointError(
                f"checkpointer.recipe_checkpoint={named} names the step checkpoint "
                f"{folder}, which does not exist. The step checkpoints in {self._out} "
                f"are {[p.name for p in _step_dirs(self._out)] or 'none'}: name one of "
                "them, or leave checkpointer.recipe_checkpoint unset to resume from "
                "the newest."
            )
        points = []
        for candidate in (
            [folder] if named else _step_dirs(self._out, read_run_file(self._out))
        ):
            try:
                read_manifest(candidate)
                points.append(candidate)
            except CheckpointError as e:
                if named:
                    raise self._unusable(e) from e
                log.warning(f"Skipping step checkpoint {candidate}: {e}")
        legacy = self._export_dir / "recipe_state" / RECIPE_STATE
        if points:
            return self._check_optimizer(points[0] / RECIPE_STATE, points)
        if legacy.is_file() and not self.options.async_save:
            return self._check_optimizer(legacy, "epoch")
        if self.options.async_save and any(
            self._export_dir.glob("dist_epoch_*/.metadata")
        ):
            return "dcp"
        moved = self._out / PREVIOUS_RUNS
        raise CheckpointError(
            "resume_from_checkpoint=True, but there is nothing to resume from: no "
            f"whole step checkpoint (step_N/) of this run in output_dir={self._out}, "
            "and no torchtune 0.6.1 epoch checkpoint."
            + (
                f" Earlier runs' checkpoints are in {moved}: move one back into "
                "output_dir to resume it."
                if moved.is_dir()
                else ""
            )
            + " Set resume_from_checkpoint=False to start a new run, or set "
            "output_dir to the folder of the run to continue."
        )

    def _unusable(self, error: Exception) -> CheckpointError:
        return CheckpointError(
            f"checkpointer.recipe_checkpoint={self.options.recipe_checkpoint} names a "
            f"step checkpoint that cannot be resumed: {error}. Name another one, or "
            "leave checkpointer.recipe_checkpoint unset to resume from the newest "
            "whole one."
        )

    def _check_optimizer(self, recipe_state: Path, points: Any) -> Any:
        """``points``, unless its optimizer state is another optimizer class's."""
        try:
            state = torch.load(recipe_state, weights_only=False, mmap=True)
        except Exception:  # damaged: load() names the file
            return points
        saved, configured = (
            state.get(OPTIMIZER_COMPONENT),
            self.options.optimizer_component,
        )
        if saved and configured and saved != configured:
            try:
                same = _get_component_from_path(saved) is _get_component_from_path(
                    configured
                )
            except Exception:  # the saved one no longer imports
                same = False
            if not same:
                where = recipe_state if points == "epoch" else recipe_state.parent
                raise ValueError(
                    f"optimizer._component_={configured} cannot resume from {where}: "
                    f"its optimizer state was saved by {saved}, and another optimizer "
                    f"class cannot load it. Set optimizer._component_={saved} to "
                    "resume, or resume_from_checkpoint=False to start a new run."
                )
        return points

    # -- setup -------------------------------------------------------------------------

    def load_base_checkpoint(self) -> dict[str, Any]:
        """The weights to build the model from, read by the configured checkpointer:
        the base checkpoint (a step checkpoint's trained weights are loaded by
        :meth:`load`), or, resuming a torchtune 0.6.1 epoch checkpoint, the weights
        ``checkpoint_files`` names there and the adapter.

        Returns:
            dict[str, Any]: ``training.MODEL_KEY`` (and ``ADAPTER_KEY`` when the
            checkpointer reads an adapter).
        """
        legacy = self._resume_from == "epoch"
        self._checkpointer = config.instantiate(
            self.options.checkpointer, should_load_recipe_state=legacy
        )
        state = self._checkpointer.load_checkpoint()
        weights = (training.MODEL_KEY, training.ADAPTER_KEY)
        if legacy:
            self._legacy_state = {
                k: state.pop(k) for k in list(state) if k not in weights
            }
        if legacy and self.options.adapter_config and training.ADAPTER_KEY not in state:
            raise ValueError(
                "resume_from_checkpoint=True, but no adapter weights were found. Set "
                "checkpointer.adapter_checkpoint, or resume from an output_dir whose "
                "latest epoch_* folder holds adapter_model.pt."
            )
        return state

    def load(
        self,
        model: nn.Module | Mapping[str, nn.Module],
        optimizer: torch.optim.Optimizer,
        dataloader: Any,
        progress: Any,
        *,
        steps_per_epoch: int,
        exporters: Mapping[str, Any] | None = None,
    ) -> None:
        """Hand over what the run saves and, resuming, put it back where it was.

        A resume first verifies the checkpoint and checks that the run continues its
        trajectory (the settings of :data:`TRAJECTORY_KEYS`, the dataset's length and
        contents, the number of processes); then the lock is taken (one run per
        ``output_dir``); a new run moves an earlier run's checkpoints aside. Call it
        on every rank, after :meth:`load_base_checkpoint`.

        Args:
            model (nn.Module | Mapping[str, nn.Module]): the model (FSDP2-sharded in
                a distributed run), or several by name in one process.
            optimizer (torch.optim.Optimizer): the optimizer of all of them, plain or
                :class:`~torchtune.training.OptimizerInBackward`.
            dataloader (Any): the ``StatefulDataLoader``; mid-epoch, its position.
            progress (Any): where training stands, with ``state_dict`` and
                ``load_state_dict`` and the attributes ``epochs_run``,
                ``total_epochs`` and ``global_step`` (a :class:`TrainingProgress`).
            steps_per_epoch (int): the optimizer steps of an epoch.
            exporters (Mapping[str, Any] | None): the checkpointer that exports each
                model of a mapping, where not the configured one. Default: ``None``

        Raises:
            CheckpointError: if no checkpoint to resume is whole, it does not match
                the model, was trained with other settings (unless
                ``resume_allow_changes``), or another run holds ``output_dir``.
            ValueError: if an epoch would have no optimizer step.
        """
        self._named = isinstance(model, Mapping)
        self._models = dict(model) if self._named else {training.MODEL_KEY: model}
        self._optimizer, self._dataloader, self._progress = (
            optimizer,
            dataloader,
            progress,
        )
        self._steps_per_epoch = steps_per_epoch
        self._exporters = {
            n: (exporters or {}).get(n, self._checkpointer) for n in self._models
        }
        dataset = dataloader.dataset
        if steps_per_epoch < 1:
            raise ValueError(
                f"An epoch has no optimizer step: {len(dataset)} samples make "
                f"{len(dataloader)} batches per process, with "
                f"{dict(self.options.trajectory)}. Use more data, or a smaller "
                "batch_size or gradient_accumulation_steps."
            )
        self._trajectory = {
            **self.options.trajectory,
            "world_size": _world_size(),
            "dataset_length": len(dataset),
            "dataset_fingerprint": _fingerprint(dataset),
        }
        recipe_state = (
            self._verified_recipe_state()
            if isinstance(self._resume_from, list)
            else None
        )
        _on_rank_zero(lambda: _take_lock(self._out))
        lock, stop = self._out / LOCK_FILE, threading.Event()
        if _rank() == 0:
            threading.Thread(target=_heartbeat, args=(lock, stop), daemon=True).start()
        self._lock = weakref.finalize(self, _release_lock, lock, stop)
        if self._resume_from is None:
            self._run_id = _on_rank_zero(self._start_run)
            utils.log_rank_zero(
                log, f"New run {self._run_id}: checkpoints go to {self._out}."
            )
            return
        if recipe_state is None:
            self._restore_legacy()
        else:
            self._restore(recipe_state)
        if recipe_state is not None and recipe_state.get("epoch_end", False):
            self._repair_export(progress.epochs_run - 1)
        if progress.epochs_run >= progress.total_epochs:
            key, value = self.options.length
            utils.log_rank_zero(
                log,
                f"resume_from_checkpoint=True: {self._resume_from} is at the end of "
                "training "
                f"({progress.epochs_run} epochs done, {key}={value}): nothing left "
                f"to do. To train further, set {key} to more than {value}.",
                level=logging.WARNING,
            )
            self._lock()

    def _start_run(self) -> str:
        folders = {self._out, self._export_dir}
        folders |= {Path(e._output_dir) for e in self._exporters.values()}
        keep = [k.absolute() for k in self.options.keep]
        outputs = [
            e
            for folder in folders
            if folder.is_dir()
            for e in folder.iterdir()
            if _RUN_OUTPUTS.match(e.name)
        ]
        # The base this run reads stays in place; a copy is kept, as this run's
        # epoch exports may overwrite it.
        read = [
            e
            for e in outputs
            if any(k == e.absolute() or e.absolute() in k.parents for k in keep)
        ]
        found = [e for e in outputs if e not in read]
        if any(e.name != RUN_FILE for e in found + read):
            newest = time.gmtime(max(e.stat().st_mtime for e in found + read))
            earlier = read_run_file(self._out) or time.strftime(
                "before-%Y%m%d-%H%M%S", newest
            )
            _set_aside(
                found,
                f"run_{earlier}",
                f"{self._out} held the checkpoints of an earlier run, which this new "
                "run must neither overwrite nor resume from (to continue that run "
                "instead, move them back and set resume_from_checkpoint=True)",
                copies=read,
            )
        run_id = time.strftime("%Y%m%d-%H%M%S-", time.gmtime()) + uuid.uuid4().hex[:8]
        _write_run_file(self._out, run_id)
        return run_id

    def _verified_recipe_state(self) -> dict[str, Any]:
        """The recipe state of the newest resume point whose every byte is verified
        (a damaged one gives way to the one before, with a warning), refusing one
        trained with other settings."""
        for folder in self._resume_from:
            try:
                verify(folder)
                break
            except CheckpointError as e:
                if self.options.recipe_checkpoint:
                    raise self._unusable(e) from e
                utils.log_rank_zero(
                    log,
                    f"Skipping step checkpoint {folder}: {e}",
                    level=logging.WARNING,
                )
        else:
            raise CheckpointError(
                f"resume_from_checkpoint=True, but no step checkpoint in {self._out} "
                "is whole (see the warnings above). Set resume_from_checkpoint=False "
                "to start a new run."
            )
        self._resume_from = folder
        recipe_state = torch.load(folder / RECIPE_STATE, weights_only=False)
        # A checkpoint of an earlier build recorded its world size alone.
        saved = recipe_state.get(TRAJECTORY)
        keys = ["world_size"] if saved is None else {*saved, *self._trajectory}
        saved = saved or {"world_size": recipe_state.get("world_size", 1)}
        changes = {
            k: (saved.get(k), self._trajectory.get(k))
            for k in keys
            if _differs(saved.get(k), self._trajectory.get(k))
        }
        listed = ", ".join(
            f"{k}: {old!r} then, {new!r} now" for k, (old, new) in changes.items()
        )
        if "world_size" in changes or (changes and not self.options.allow_changes):
            raise CheckpointError(
                f"{folder} was trained with other settings than this resume has "
                f"({listed}), so the resumed run would not continue the same training. "
                "Set them back to the checkpoint's (the dataset: the data it trained "
                "on; world_size: as many processes), or set resume_allow_changes=True "
                "to continue with the new ones anyway (not world_size: data positions "
                "are per process), or resume_from_checkpoint=False to start a new run."
            )
        if changes:
            utils.log_rank_zero(
                log,
                f"resume_allow_changes=True: resuming {folder} with other settings "
                f"({listed}); this run differs from an uninterrupted one.",
                level=logging.WARNING,
            )
        return recipe_state

    def _restore(self, recipe_state: dict[str, Any]) -> None:
        folder = self._resume_from
        self._run_id = _run_id_of(folder) or read_run_file(self._out)
        before = _hyperparameters(self._optimizer)
        if _sharded():
            (model,) = self._models.values()
            state = self._sharded_state(model)
            dcp.load(state, checkpoint_id=folder / MODEL_OPTIMIZER_DCP)
            non_strict = dsd.StateDictOptions(strict=False)
            dsd.set_model_state_dict(model, state["model"], options=non_strict)
            dsd.set_optimizer_state_dict(model, self._optimizer, state["optimizer"])
            for group, saved in zip(
                self._optimizer.param_groups, recipe_state[HYPERPARAMETERS], strict=True
            ):
                group.update(saved)
        else:
            state = torch.load(folder / MODEL_OPTIMIZER_FILE, weights_only=False)
            for name, model in self._models.items():
                _load_trainable(
                    model,
                    state["model"][name] if self._named else state["model"],
                    folder,
                )
            self._optimizer.load_state_dict(state["optimizer"])
        self._warn_replaced(before, folder)
        self._progress.load_state_dict(recipe_state)
        rank_state = torch.load(folder / f"rank_{_rank()}.pt", weights_only=False)
        if rank_state[training.DATALOADER_KEY]:
            self._dataloader.load_state_dict(rank_state[training.DATALOADER_KEY])
        torch.set_rng_state(rank_state["rng"]["torch"])
        if "cuda" in rank_state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(rank_state["rng"]["cuda"])
        _on_rank_zero(lambda: self._branch(folder))
        utils.log_rank_zero(log, f"Resumed from step checkpoint {folder}.")

    def _branch(self, folder: Path) -> None:
        """Resuming before the newest checkpoints branches: the old timeline's later
        checkpoints and exports are moved aside, so that pruning and later resumes
        see this branch only."""
        later = [p for p in _step_dirs(self._out) if step_of(p) > step_of(folder)]
        for exports in {Path(e._output_dir) for e in self._exporters.values()}:
            epochs = [(p, p.name[6:]) for p in exports.glob("epoch_*")]
            later += [
                p
                for p, e in epochs
                if e.isdigit() and int(e) >= self._progress.epochs_run
            ]
        if later:
            reason = (
                f"Resuming from {folder.name}: the later checkpoints of this run "
                "(damaged, or of the timeline this resume branches from) go aside"
            )
            _set_aside(later, f"run_{self._run_id}-after-{folder.name}", reason)

    def _restore_legacy(self) -> None:
        """Resume a torchtune 0.6.1 epoch checkpoint: its recipe state, read by the
        checkpointer, or the newest ``dist_epoch_{N}`` of DCP."""

        def run_id() -> str:
            if read_run_file(self._out) is None:
                _write_run_file(self._out, f"0.6.1-{uuid.uuid4().hex[:8]}")
            return read_run_file(self._out)

        self._run_id = _on_rank_zero(run_id)
        before = _hyperparameters(self._optimizer)
        if self._resume_from == "dcp":
            (model,) = self._models.values()
            dsd._init_optim_state(self._optimizer)  # DCP loads into existing tensors
            state = {training.MODEL_KEY: model.state_dict(), training.EPOCHS_KEY: 0}
            state[training.OPT_KEY] = self._optimizer.state_dict()
            reader = DistributedCheckpointer(
                self._export_dir, self._export_dir, process_group=self._group()
            )
            state = reader.load_checkpoint(state)
            dsd.set_state_dict(
                model,
                self._optimizer,
                model_state_dict=state[training.MODEL_KEY],
                optim_state_dict=state[training.OPT_KEY],
            )
        else:
            state = self._legacy_state
            self._load_full_optimizer_state(state[training.OPT_KEY])
        self._warn_replaced(before, "the epoch checkpoint")
        steps = state[training.EPOCHS_KEY] * self._steps_per_epoch
        self._progress.load_state_dict({**state, "global_step": steps})

    def _load_full_optimizer_state(self, state_dict: dict[str, Any]) -> None:
        """A full optimizer state: keyed by index, by parameter name (a distributed
        run's), or in torchtune 0.6.1's in-backward format."""
        models = list(self._models.values())
        if is_legacy_in_bwd_state_dict(state_dict):
            # Several models (PPO): 0.6.1 saved the last one's parameters only.
            named = [
                (n if m is models[-1] else None, p)
                for m in models
                for n, p in m.named_parameters()
            ]
            state_dict = convert_legacy_optim_in_bwd_state_dict(
                state_dict, None if _sharded() else named
            )
        if _sharded():
            training.load_from_full_optimizer_state_dict(
                models[0], self._optimizer, state_dict, self.options.device
            )
        elif any(isinstance(k, str) for k in state_dict["state"]):
            full = dsd.StateDictOptions(full_state_dict=True)
            dsd.set_optimizer_state_dict(
                models[0], self._optimizer, state_dict, options=full
            )
        else:
            self._optimizer.load_state_dict(state_dict)

    def _warn_replaced(self, before: list[dict[str, Any]], where: Any) -> None:
        """Name the config's optimizer settings that the checkpoint's replaced (the LR
        a scheduler starts from is the saved ``initial_lr``)."""
        replaced = set()
        for configured, saved in zip(
            before, _hyperparameters(self._optimizer), strict=False
        ):
            for key, value in configured.items():
                now = (
                    saved.get("initial_lr", saved["lr"])
                    if key == "lr"
                    else saved.get(key)
                )
                if key != "initial_lr" and key in saved and _differs(value, now):
                    replaced.add(f"optimizer.{key}={value} (the checkpoint's: {now})")
        if replaced:
            utils.log_rank_zero(
                log,
                f"Resuming from {where}: its optimizer state replaces "
                f"{', '.join(sorted(replaced))}. To train with the config's values, "
                "start a new run (resume_from_checkpoint=False).",
                level=logging.WARNING,
            )

    # -- saving --------------------------------------------------------------------------

    def save(self, *, epoch_end: bool = False) -> None:
        """Save after an optimizer step: a step checkpoint if one is due
        (``save_every_n_steps``); with ``epoch_end``, always, and the epoch export.
        An epoch's last step is saved by its ``epoch_end`` call. Call it on every rank.

        Args:
            epoch_end (bool): the epoch just ended (``progress.epochs_run`` counts it).
                Default: ``False``
        """
        step, n = self._progress.global_step, self.options.every_n_steps
        if not epoch_end:
            if n is not None and step % n == 0 and step % self._steps_per_epoch != 0:
                self._write_step(mid_epoch=True)
            return
        done = self._progress.epochs_run >= self._progress.total_epochs
        self._write_step(mid_epoch=False, wait=done)
        self._export(epoch := self._progress.epochs_run - 1)
        if done:
            key, value = self.options.length
            utils.log_rank_zero(
                log,
                f"Training done (epochs done: {self._progress.epochs_run}). Final "
                f"weights in {self._export_dir}/epoch_{epoch} (every file "
                "checksummed); resumable state in "
                f"{self._out}/step_{step} (run {self._run_id}). To train this run "
                "further, rerun with the same output_dir, resume_from_checkpoint=True "
                f"and {key} greater than {value}.",
            )
            self._lock()

    def _group(self) -> Any:
        if self._async_group is None and _sharded():
            # An asynchronous save runs collectives from a thread of its own.
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _sharded_state(self, model: nn.Module) -> dict[str, Any]:
        return {
            "model": dsd.get_model_state_dict(model, options=_TRAINABLE),
            "optimizer": dsd.get_optimizer_state_dict(model, self._optimizer),
        }

    def _write_step(self, *, mid_epoch: bool, wait: bool = False) -> None:
        self._finish_pending()
        step = self._progress.global_step
        final, partial = self._out / f"step_{step}", self._out / f".step_{step}.partial"
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()
        future = None
        if _sharded():
            state, where = (
                self._sharded_state(*self._models.values()),
                partial / MODEL_OPTIMIZER_DCP,
            )
            if self.options.async_save and not wait:
                future = dcp.async_save(
                    state, checkpoint_id=where, process_group=self._group()
                )
            else:
                dcp.save(state, checkpoint_id=where)
        else:
            states = {
                n: dsd.get_model_state_dict(m, options=_TRAINABLE)
                for n, m in self._models.items()
            }
            state = {"model": states if self._named else states[training.MODEL_KEY]}
            _save_file(
                {**state, "optimizer": self._optimizer.state_dict()},
                partial / MODEL_OPTIMIZER_FILE,
            )
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        loader = self._dataloader.state_dict() if mid_epoch else None
        _save_file(
            {training.DATALOADER_KEY: loader, "rng": rng},
            partial / f"rank_{_rank()}.pt",
        )
        recipe_state = {
            **self._progress.state_dict(),
            "global_step": step,
            "world_size": _world_size(),
            "epoch_end": not mid_epoch,
            OPTIMIZER_COMPONENT: self.options.optimizer_component,
            TRAJECTORY: self._trajectory,
            HYPERPARAMETERS: _hyperparameters(self._optimizer),
        }
        if _rank() == 0:
            _save_file(recipe_state, partial / RECIPE_STATE)
        self._pending = (future, partial, final)
        if future is None:
            self._finish_pending()

    def _finish_pending(self) -> None:
        """Complete the last step checkpoint: checksums, manifest, rename, prune."""
        if self._pending is None:
            return
        (future, partial, final), self._pending = self._pending, None
        if future is not None:
            future.result()
        _barrier()
        manifest = {"version": MANIFEST_VERSION, "run_id": self._run_id}
        manifest |= {"global_step": step_of(final), "world_size": _world_size()}
        manifest["files"] = _describe(partial, MANIFEST)
        keep = self.options.keep_last_n or (None if self.options.every_n_steps else 1)

        def publish() -> None:
            (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
            _fsync_dir(partial)
            if final.exists():  # never rewrite a checkpoint: keep the one replaced
                _set_aside(
                    [final], f"run_{self._run_id}-replaced", "Saving a step again"
                )
            os.replace(partial, final)
            _fsync_dir(self._out)
            for old in _step_dirs(self._out, self._run_id)[keep:] if keep else []:
                shutil.rmtree(old)
                log.info(
                    f"Deleted step checkpoint {old} (keep_last_n_checkpoints={keep})"
                )
            log.info(f"Step checkpoint saved to {final}")

        _on_rank_zero(publish)

    def _export_folders(self, epoch: int) -> list[Path]:
        return sorted(
            {Path(e._output_dir) / f"epoch_{epoch}" for e in self._exporters.values()}
        )

    def _export(self, epoch: int) -> None:
        """Write ``epoch_{epoch}`` through each model's checkpointer, then its manifest."""
        if _rank() == 0:
            for folder in self._export_folders(epoch):  # not whole until rewritten
                (folder / EXPORT_MANIFEST).unlink(missing_ok=True)
        adapter, adapter_only = self.options.adapter_config, self.options.adapter_only
        adapter_only = adapter_only and adapter is not None
        for name, model in self._models.items():
            if _sharded():
                state = training.gather_cpu_state_dict(
                    model,
                    _rank() == 0,
                    device=self.options.device,
                    adapter_weights_only=adapter_only,
                )
            else:
                state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            if _rank() == 0:
                export = (
                    {training.MODEL_KEY: state}
                    if adapter is None
                    else _lora_export(state, adapter, adapter_only)
                )
                extra = {"adapter_only": True} if adapter_only else {}
                self._exporters[name].save_checkpoint(
                    export, epoch=epoch, intermediate_checkpoint=False, **extra
                )
        _barrier()
        for folder in self._export_folders(epoch):
            manifest = {"version": MANIFEST_VERSION, "run_id": self._run_id}
            manifest["files"] = _describe(folder, EXPORT_MANIFEST)
            text = json.dumps(manifest, indent=1)
            _on_rank_zero(lambda f=folder, t=text: (f / EXPORT_MANIFEST).write_text(t))

    def _repair_export(self, epoch: int) -> None:
        """Rewrite the export of the epoch a resumed epoch-end checkpoint ended, if it
        is missing or damaged (a crash or a full disk while it was written): the
        model now holds exactly the weights it should hold."""
        problems = []
        for folder in self._export_folders(epoch):
            try:
                verify(folder, EXPORT_MANIFEST)
            except CheckpointError as e:
                problems.append(str(e))
        if problems:
            utils.log_rank_zero(
                log,
                f"The export of epoch {epoch} is not whole ({'; '.join(problems)}): "
                f"rewriting it from {self._resume_from}.",
                level=logging.WARNING,
            )
            self._export(epoch)

    def close(self) -> None:
        """Complete a step checkpoint still being written in the background and
        release ``output_dir``; call it on every rank before the process group ends."""
        self._finish_pending()
        self._lock()
        _barrier()  # a next run in these processes finds the lock released


__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointOptions",
    "TrainingProgress",
]
