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
import inspect
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
from omegaconf import DictConfig
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from torchtune import config, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.modules.peft import (
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
)
from torchtune.training._distributed import (
    gather_cpu_state_dict,
    load_from_full_optimizer_state_dict,
)
from torchtune.training.checkpointing._checkpointer import DistributedCheckpointer
from torchtune.training.checkpointing._utils import (
    ADAPTER_CONFIG,
    ADAPTER_KEY,
    DATALOADER_KEY,
    EPOCHS_KEY,
    MODEL_KEY,
    OPT_KEY,
    TOTAL_EPOCHS_KEY,
)
from torchtune.training.optim_in_bwd_legacy_state_dict import (
    convert_legacy_optim_in_bwd_state_dict,
    is_legacy_in_bwd_state_dict,
)

log = utils.get_logger("DEBUG")

MANIFEST = "manifest.json"
EXPORT_MANIFEST = ".torchtune_manifest.json"
MANIFEST_VERSION = 2
RECIPE_STATE = "recipe_state.pt"
MODEL_OPTIMIZER_FILE = "model_optimizer.pt"
MODEL_OPTIMIZER_DCP = "model_optimizer"
RUN_FILE = "torchtune_run.json"
LOCK_FILE = "torchtune_run.lock"
PREVIOUS_RUNS = "previous_runs"
OPTIMIZER_COMPONENT = "optimizer_component"
TRAJECTORY = "trajectory"
# Each param group's hyperparameters: DCP loads only the entries a new optimizer has.
HYPERPARAMETERS = "optimizer_param_group_hyperparameters"
# The config values that set a run's step count and data order.
TRAJECTORY_KEYS = (
    "batch_size",
    "gradient_accumulation_steps",
    "max_steps_per_epoch",
    "ppo_batch_size",
    "ppo_epochs",
)
# A lock whose owner runs on another host is stale once its heartbeat is this old.
LOCK_STALE_AFTER_S = 300.0
_HEARTBEAT_S = 30.0
_STEP_DIR = re.compile(r"^step_(\d+)$")
# What a run leaves that a later run could mistake for its own.
_RUN_OUTPUTS = re.compile(
    r"^(step_\d+|\.step_\d+\.partial|epoch_\d+|dist_epoch_\d+|recipe_state"
    rf"|{re.escape(RUN_FILE)})$"
)
_TRAINABLE = StateDictOptions(ignore_frozen_params=True)


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
            EPOCHS_KEY: self.epochs_run,
            TOTAL_EPOCHS_KEY: self.total_epochs,
            "global_step": self.global_step,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.epochs_run = state_dict[EPOCHS_KEY]
        self.global_step = state_dict["global_step"]


# -- files ---------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world_size() > 1:
        dist.barrier()


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


def _files(folder: Path, skip: str) -> list[str]:
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and p.name != skip
    )


def _describe(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "size": (folder / name).stat().st_size,
            "crc32": file_checksum(folder / name),
        }
        for name in names
    }


def _describe_shared(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """:func:`_describe`, the files split across the ranks (call it on every rank)."""
    mine = _describe(folder, names[_rank() :: _world_size()])
    if _world_size() == 1:
        return mine
    parts: list[Any] = [None] * _world_size()
    dist.all_gather_object(parts, mine)
    return {name: entry for part in parts for name, entry in part.items()}


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
        files = manifest["files"]
        ok = all(
            isinstance(e, dict)
            and isinstance(e.get("size"), int)
            and isinstance(e.get("crc32"), str)
            for e in files.values()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is damaged ({e})") from e
    if version != MANIFEST_VERSION or not ok:
        raise CheckpointError(
            f"{path} is of manifest version {version}, written by an earlier build "
            "of this patch set, whose files carry no checksums this one can verify. "
            "Resume it with the torchtune build that wrote it, or start a new run "
            "(resume_from_checkpoint=False)."
        )
    return manifest


def _problems(folder: Path, files: Mapping[str, Any], names: list[str]) -> list[str]:
    problems = []
    for name in names:
        path, entry = folder / name, files[name]
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(
                f"{path} is damaged: {path.stat().st_size} bytes, {entry['size']} "
                "when written"
            )
        elif file_checksum(path) != entry["crc32"]:
            problems.append(
                f"{path} is damaged: its content changed since it was written"
            )
    return problems


def verify(folder: str | Path, name: str = MANIFEST) -> dict[str, Any]:
    """Check that every file the manifest ``name`` of ``folder`` lists is there with
    the size and CRC-32 it had when written; call it on every rank of a distributed
    run, which share the reading.

    Returns:
        dict[str, Any]: the manifest.

    Raises:
        CheckpointError: naming what is missing or damaged.
    """
    folder = Path(folder)
    manifest = read_manifest(folder, name)
    names = sorted(manifest["files"])
    problems = _problems(folder, manifest["files"], names[_rank() :: _world_size()])
    if _world_size() > 1:
        parts: list[Any] = [None] * _world_size()
        dist.all_gather_object(parts, problems)
        problems = [p for part in parts for p in part]
    if problems:
        raise CheckpointError("; ".join(problems))
    return manifest


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def _step_dirs(folder: Path) -> list[Path]:
    """The ``step_{N}`` folders of ``folder``, newest first."""
    if not folder.is_dir():
        return []
    return sorted(
        (p for p in folder.iterdir() if p.is_dir() and step_of(p) is not None),
        key=step_of,
        reverse=True,
    )


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


def _set_aside(entries: list[Path], label: str, reason: str) -> None:
    """Move ``entries`` into ``previous_runs/{label}/`` of their folders."""
    for folder in sorted({e.parent for e in entries}):
        target = folder / PREVIOUS_RUNS / label
        suffix = 1
        while target.exists():  # never merge into an earlier move
            suffix += 1
            target = folder / PREVIOUS_RUNS / f"{label}.{suffix}"
        target.mkdir(parents=True)
        moved = sorted(e.name for e in entries if e.parent == folder)
        for name in moved:
            os.replace(folder / name, target / name)
        _fsync_dir(folder)
        log.warning(
            f"{reason}: moved {', '.join(moved)} to {target} (nothing deleted)."
        )


def check_writable(key: str, path: str | Path) -> None:
    """Refuse a folder this process cannot write: ``path``, or the nearest existing
    folder above it, where it would be made.

    Raises:
        PermissionError: naming ``key`` and ``path``.
    """
    path = Path(path).absolute()
    existing = path
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


def _lock_holder(folder: Path) -> str | None:
    """Who holds ``folder``'s lock, if a live run does; ``None`` if free or stale (a
    killed run's: its process is gone, or its heartbeat stopped)."""
    path = folder / LOCK_FILE
    try:
        owner = json.loads(path.read_text())
        age = time.time() - path.stat().st_mtime
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict):
        return None
    if owner.get("host") == socket.gethostname():
        pid = owner.get("pid")
        if pid == os.getpid() or not isinstance(pid, int):
            return None  # this process runs one recipe at a time
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
    elif age > LOCK_STALE_AFTER_S:
        return None
    return (
        f"process {owner.get('pid')} on host {owner.get('host')}, started "
        f"{owner.get('started')}"
    )


def _refuse_if_locked(folder: Path) -> None:
    holder = _lock_holder(folder)
    if holder is not None:
        raise CheckpointError(
            f"output_dir={folder} is in use by another run ({holder}): two runs in "
            "one folder would overwrite each other's checkpoints. Wait for it to "
            "finish, stop it, or set output_dir to another folder."
        )


def _take_lock(folder: Path) -> None:
    path = folder / LOCK_FILE
    folder.mkdir(parents=True, exist_ok=True)
    if path.exists():
        _refuse_if_locked(folder)
        log.warning(
            f"Taking over {path}, left by a run that stopped: {path.read_text()}"
        )
        path.unlink()
    owner = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # another run took it between the check and now
        _refuse_if_locked(folder)
        raise
    with os.fdopen(fd, "w") as f:
        json.dump(owner, f)


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


def _models(model: nn.Module | Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    return dict(model) if isinstance(model, Mapping) else {MODEL_KEY: model}


def _trainable_state_dict(model: nn.Module) -> dict[str, Any]:
    return get_model_state_dict(model, options=_TRAINABLE)


def _load_trainable(model: nn.Module, state_dict: dict[str, Any], where: Path) -> None:
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = sorted(set(missing) & set(_trainable_state_dict(model)))
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not match this model: missing trainable entries "
            f"{missing[:5]}, unexpected entries {sorted(unexpected)[:5]}. Resume "
            "with the model of the run that saved it."
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


def _jsonable(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else type(value).__name__


def _fingerprint(dataset: Any) -> str:
    """A cheap fingerprint of a dataset's contents: its first, middle and last sample."""
    n = len(dataset)
    digest = hashlib.sha256()
    for i in sorted({0, n // 2, n - 1}) if n else []:
        digest.update(
            json.dumps(dataset[i], sort_keys=True, default=_jsonable).encode()
        )
    return digest.hexdigest()[:16]


def _lora_export(
    state_dict: dict[str, Any], adapter_config: dict[str, Any], adapter_only: bool
) -> dict[str, Any]:
    """A LoRA model's export: its adapter, the PEFT adapter config and, unless
    ``adapter_only``, the weights with the adapter merged in. Each merged base weight
    is copied first: a CPU state dict may hold the live model's own tensors."""
    export = {
        ADAPTER_KEY: get_adapter_state_dict(state_dict),
        ADAPTER_CONFIG: adapter_config,
    }
    if not adapter_only:
        for name in list(state_dict):
            if name.endswith("lora_a.weight"):
                base = name.removesuffix("lora_a.weight") + "weight"
                state_dict[base] = state_dict[base].clone()
        export[MODEL_KEY] = get_merged_lora_ckpt(
            state_dict, rank=adapter_config["r"], alpha=adapter_config["lora_alpha"]
        )
    return export


def _same_component(saved: str, configured: str) -> bool:
    if saved == configured:
        return True
    try:
        return _get_component_from_path(saved) is _get_component_from_path(configured)
    except Exception:  # the saved one no longer imports
        return False


def _base_paths(cfg: Mapping[str, Any]) -> list[Path]:
    """The base checkpoints every checkpointer section of ``cfg`` reads: a new run
    never moves them, even when they are an earlier run's ``epoch_{N}``."""
    paths = []
    for key, section in cfg.items():
        if not str(key).endswith("checkpointer") or not isinstance(section, Mapping):
            continue
        root = section.get("checkpoint_dir", None)
        if root:
            files = section.get("checkpoint_files", None) or []
            names = [] if isinstance(files, str | Mapping) else list(files)
            names += (
                [section.adapter_checkpoint]
                if section.get("adapter_checkpoint")
                else []
            )
            paths += [Path(root)] + [Path(root) / str(n) for n in names]
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

    Example:
        >>> manager = CheckpointManager.from_config(cfg)
        >>> model.load_state_dict(manager.load_base_checkpoint()[training.MODEL_KEY])
        >>> manager.load(model, optimizer, dataloader, progress, steps_per_epoch=10)
        >>> for step in batches:  # train, then progress.global_step += 1
        ...     manager.save()
        >>> progress.epochs_run += 1
        >>> manager.save(epoch_end=True)
    """

    def __init__(self, options: CheckpointOptions) -> None:
        for key, value in (
            ("save_every_n_steps", options.every_n_steps),
            ("checkpointer.keep_last_n_checkpoints", options.keep_last_n),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(
                    f"{key}={value!r} must be a positive integer or null (null: "
                    + (
                        "save at the end of each epoch only)"
                        if key == "save_every_n_steps"
                        else "keep every step checkpoint)"
                    )
                )
        component = _get_component_from_path(options.checkpointer._component_)
        if issubclass(component, DistributedCheckpointer):
            raise ValueError(
                f"checkpointer._component_={options.checkpointer._component_} cannot "
                "be the model checkpointer: it reads no model weights to start from. "
                "Use an HF, Meta or torchtune checkpointer; sharded DCP checkpoints "
                "come with save_every_n_steps (enable_async_checkpointing writes "
                "them in the background)."
            )
        self.options = options
        self._out = Path(options.output_dir)
        self._export_dir = Path(options.checkpointer.get("output_dir") or self._out)
        check_writable("output_dir", self._out)
        if self._export_dir.absolute() != self._out.absolute():
            check_writable("checkpointer.output_dir", self._export_dir)
        _refuse_if_locked(self._out)
        # None: a new run; a step_N folder; or torchtune 0.6.1's "epoch" or "dcp".
        self._resume_from: Path | str | None = None
        self._run_id: str | None = None
        if options.resume:
            self._resume_from = self._choose_resume_point()
        self._legacy_state: dict[str, Any] = {}
        self._checkpointer: Any = None
        self._pending: tuple[Any, Path, Path] | None = None
        self._async_group: Any = None
        self._lock: Callable[[], None] | None = None

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
        cfg_model = cfg.get("model", None) or {}
        adapter_config = None
        if "lora_rank" in cfg_model:
            adapter_config = {
                "r": cfg_model.lora_rank,
                "lora_alpha": cfg_model.lora_alpha,
                "target_modules": get_lora_module_names(
                    list(cfg_model.lora_attn_modules),
                    cfg_model.get("apply_lora_to_mlp", False),
                    cfg_model.get("apply_lora_to_output", False),
                ),
                "peft_type": "LORA",
            }
        length_key = "epochs" if "epochs" in cfg else "num_steps"
        return cls(
            CheckpointOptions(
                output_dir=Path(
                    cfg.get("output_dir", None) or cfg_checkpointer.output_dir
                ),
                checkpointer=cfg_checkpointer,
                device=utils.get_device(device=cfg.device),
                resume=cfg.get("resume_from_checkpoint", False),
                recipe_checkpoint=cfg_checkpointer.get("recipe_checkpoint", None),
                every_n_steps=cfg.get("save_every_n_steps", None),
                keep_last_n=keep_last_n,
                async_save=cfg.get("enable_async_checkpointing", False),
                allow_changes=cfg.get("resume_allow_changes", False),
                optimizer_component=(cfg.get("optimizer", None) or {}).get(
                    "_component_"
                ),
                trajectory={k: cfg.get(k, None) for k in TRAJECTORY_KEYS if k in cfg},
                length=(length_key, cfg.get(length_key, None)),
                adapter_config=adapter_config,
                adapter_only=cfg.get("save_adapter_weights_only", False),
                keep=tuple(_base_paths(cfg)),
            )
        )

    # -- choosing what a resume continues from ----------------------------------------

    def _choose_resume_point(self) -> Path | str:
        """The newest step checkpoint of the run ``output_dir`` holds, the one
        ``recipe_checkpoint`` names, or a 0.6.1 epoch checkpoint; read here, before
        anything is built, are only names, manifests and the recipe state (its
        optimizer class). :meth:`load` verifies every byte."""
        named = self.options.recipe_checkpoint
        if named:
            path = self._out / named
            folder = path if step_of(path) is not None else path.parent
            if step_of(folder) is None:
                if not (self._export_dir / named).is_file():
                    raise CheckpointError(
                        f"checkpointer.recipe_checkpoint={named} names "
                        f"{self._export_dir / named}, which does not exist. Name the "
                        "recipe_state.pt of the run to continue (relative to "
                        "checkpointer.output_dir), or leave it unset to resume from "
                        "the newest checkpoint in output_dir."
                    )
                self._check_optimizer(self._export_dir / named, legacy=True)
                return "epoch"
            if not folder.is_dir():
                found = [p.name for p in _step_dirs(self._out)]
                raise CheckpointError(
                    f"checkpointer.recipe_checkpoint={named} names the step "
                    f"checkpoint {folder}, which does not exist. The step checkpoints "
                    f"in {self._out} are {found or 'none'}: name one of them, or leave "
                    "checkpointer.recipe_checkpoint unset to resume from the newest."
                )
            try:
                read_manifest(folder)
            except CheckpointError as e:
                raise self._unusable_named(e) from e
            self._check_optimizer(folder / RECIPE_STATE)
            return folder
        run_id = read_run_file(self._out)
        for folder in _step_dirs(self._out):
            if run_id is not None and _run_id_of(folder) not in (run_id, None):
                continue
            try:
                read_manifest(folder)
            except CheckpointError as e:
                log.warning(f"Skipping step checkpoint {folder}: {e}")
                continue
            self._check_optimizer(folder / RECIPE_STATE)
            return folder
        legacy_state = self._export_dir / "recipe_state" / RECIPE_STATE
        if legacy_state.is_file() and not self.options.async_save:
            self._check_optimizer(legacy_state, legacy=True)
            return "epoch"
        if self.options.async_save and any(
            (p / ".metadata").is_file() for p in self._export_dir.glob("dist_epoch_*")
        ):
            return "dcp"
        moved = (
            f" An earlier run's checkpoints were moved to {self._out / PREVIOUS_RUNS}: "
            "move one back into output_dir to resume it."
            if (self._out / PREVIOUS_RUNS).is_dir()
            else ""
        )
        raise CheckpointError(
            "resume_from_checkpoint=True, but there is nothing to resume from: no "
            f"whole step checkpoint (step_N/) of this run in output_dir={self._out}, "
            "and no torchtune 0.6.1 epoch checkpoint." + moved + " Set "
            "resume_from_checkpoint=False to start a new run, or set output_dir to the "
            "folder of the run to continue."
        )

    def _unusable_named(self, error: CheckpointError) -> CheckpointError:
        return CheckpointError(
            f"checkpointer.recipe_checkpoint={self.options.recipe_checkpoint} names a "
            f"step checkpoint that cannot be resumed: {error}. Name another one, or "
            "leave checkpointer.recipe_checkpoint unset to resume from the newest "
            "whole one."
        )

    def _check_optimizer(self, recipe_state: Path, legacy: bool = False) -> None:
        try:
            state = torch.load(recipe_state, weights_only=False, mmap=True)
        except Exception:  # damaged: load() names the file
            return
        saved = state.get(OPTIMIZER_COMPONENT)
        configured = self.options.optimizer_component
        where = recipe_state if legacy else recipe_state.parent
        if saved and configured and not _same_component(saved, configured):
            raise ValueError(
                f"optimizer._component_={configured} cannot resume from {where}: its "
                f"optimizer state was saved by {saved}, and another optimizer class "
                f"cannot load it. Set optimizer._component_={saved} to resume, or "
                "resume_from_checkpoint=False to start a new run."
            )

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
        component = _get_component_from_path(self.options.checkpointer._component_)
        extra = {}
        if "should_load_recipe_state" in inspect.signature(component).parameters:
            extra["should_load_recipe_state"] = self._resume_from == "epoch"
        self._checkpointer = config.instantiate(self.options.checkpointer, **extra)
        state = self._checkpointer.load_checkpoint()
        if self._resume_from == "epoch":
            self._legacy_state = {
                k: state.pop(k)
                for k in list(state)
                if k not in (MODEL_KEY, ADAPTER_KEY)
            }
            if self.options.adapter_config is not None and ADAPTER_KEY not in state:
                raise ValueError(
                    "resume_from_checkpoint=True, but no adapter weights were found. "
                    "Set checkpointer.adapter_checkpoint, or resume from an output_dir "
                    "whose latest epoch_* folder holds adapter_model.pt."
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

        A resume first checks that the run continues the same trajectory (the
        settings of :data:`TRAJECTORY_KEYS`, the dataset's length and contents, the
        number of processes) and verifies the checkpoint; then the lock is taken (one
        run per ``output_dir``); a new run moves an earlier run's checkpoints aside.
        Call it on every rank, after :meth:`load_base_checkpoint`.

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
            CheckpointError: if the resumed checkpoint is damaged, does not match the
                model, or was trained with other settings (unless
                ``resume_allow_changes``), or another run holds ``output_dir``.
            ValueError: if an epoch would have no optimizer step.
        """
        self._models, self._optimizer = _models(model), optimizer
        self._named = isinstance(model, Mapping)
        self._dataloader, self._progress = dataloader, progress
        self._steps_per_epoch = steps_per_epoch
        self._exporters = {
            name: (exporters or {}).get(name, self._checkpointer)
            for name in self._models
        }
        dataset = dataloader.dataset
        if steps_per_epoch < 1:
            raise ValueError(
                f"An epoch has no optimizer step: the dataset has {len(dataset)} "
                f"samples, {len(dataloader)} batches per process, "
                f"trajectory settings {dict(self.options.trajectory)}. Use more data "
                "or a smaller batch_size or gradient_accumulation_steps."
            )
        self._trajectory = {
            **self.options.trajectory,
            "world_size": _world_size(),
            "dataset_length": len(dataset),
            "dataset_fingerprint": _fingerprint(dataset),
        }
        recipe_state = None
        if isinstance(self._resume_from, Path):
            recipe_state = self._verified_recipe_state()
        _on_rank_zero(lambda: _take_lock(self._out))
        lock = self._out / LOCK_FILE
        stop = threading.Event()
        if _rank() == 0:
            threading.Thread(target=_heartbeat, args=(lock, stop), daemon=True).start()
        self._lock = weakref.finalize(self, _release_lock, lock, stop)
        if self._resume_from is None:
            _on_rank_zero(self._start_run)
            self._run_id = read_run_file(self._out)
            utils.log_rank_zero(
                log, f"New run {self._run_id}: checkpoints go to {self._out}."
            )
        elif recipe_state is not None:
            self._restore(recipe_state)
        else:
            self._restore_legacy()
        if recipe_state is not None and recipe_state.get("epoch_end", False):
            self._repair_export(progress.epochs_run - 1)
        if progress.epochs_run >= progress.total_epochs:
            key, value = self.options.length
            utils.log_rank_zero(
                log,
                f"resume_from_checkpoint=True: {self._resume_from} is at the end of "
                f"training ({progress.epochs_run} epochs done, {key}={value}): nothing "
                f"left to do. To train further, set {key} to more than {value}.",
                level=logging.WARNING,
            )
            self._lock()

    def _start_run(self) -> None:
        folders = {self._out, self._export_dir} | {
            Path(e._output_dir) for e in self._exporters.values()
        }
        keep = [k.absolute() for k in self.options.keep]
        found = [
            entry
            for folder in folders
            if folder.is_dir()
            for entry in folder.iterdir()
            if _RUN_OUTPUTS.match(entry.name)
            and not any(
                k == entry.absolute() or entry.absolute() in k.parents for k in keep
            )
        ]
        if any(e.name != RUN_FILE for e in found):
            earlier = read_run_file(self._out) or "before-" + time.strftime(
                "%Y%m%d-%H%M%S", time.gmtime(max(e.stat().st_mtime for e in found))
            )
            _set_aside(
                found,
                f"run_{earlier}",
                f"{self._out} held the checkpoints of an earlier run, which this new "
                "run must neither overwrite nor resume from (to continue that run "
                "instead, move them back and set resume_from_checkpoint=True)",
            )
        _write_run_file(
            self._out,
            f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}",
        )

    def _verified_recipe_state(self) -> dict[str, Any]:
        """The recipe state of the step checkpoint to resume, once every byte of it is
        verified: a damaged newest one gives way to the one before, with a warning;
        a named one is refused. Trajectory differences are refused here."""
        while True:
            folder = self._resume_from
            try:
                verify(folder)
                break
            except CheckpointError as e:
                if self.options.recipe_checkpoint:
                    raise self._unusable_named(e) from e
                utils.log_rank_zero(
                    log,
                    f"Skipping step checkpoint {folder}: {e}",
                    level=logging.WARNING,
                )
                older = [
                    p
                    for p in _step_dirs(self._out)
                    if step_of(p) < step_of(folder)
                    and _run_id_of(p) in (read_run_file(self._out), None)
                ]
                if not older:
                    raise CheckpointError(
                        f"resume_from_checkpoint=True, but no step checkpoint in "
                        f"{self._out} is whole: {e}. Set resume_from_checkpoint=False "
                        "to start a new run."
                    ) from e
                self._resume_from = older[0]
        recipe_state = torch.load(folder / RECIPE_STATE, weights_only=False)
        saved = recipe_state.get(
            TRAJECTORY, {"world_size": recipe_state.get("world_size", 1)}
        )
        changes = {
            k: (saved[k], self._trajectory.get(k))
            for k in saved
            if _differs(saved[k], self._trajectory.get(k))
        }
        if "world_size" in changes:
            raise CheckpointError(
                f"{folder} was written by {saved['world_size']} processes, this run "
                f"has {_world_size()}: its data positions are per process. Resume "
                f"with {saved['world_size']} processes."
            )
        if changes:
            listed = ", ".join(
                f"{k}: {old!r} then, {new!r} now" for k, (old, new) in changes.items()
            )
            if not self.options.allow_changes:
                raise CheckpointError(
                    f"{folder} was trained with other settings than this resume has "
                    f"({listed}): the resumed run would not continue the same "
                    "training. Set them back to the checkpoint's (the dataset it "
                    "trained on), or set resume_allow_changes=True to continue with "
                    "the new ones anyway, or resume_from_checkpoint=False to start a "
                    "new run."
                )
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
        if _world_size() > 1:
            (model,) = self._models.values()
            state = {
                "model": get_model_state_dict(model, options=_TRAINABLE),
                "optimizer": get_optimizer_state_dict(model, self._optimizer),
            }
            dcp.load(state, checkpoint_id=folder / MODEL_OPTIMIZER_DCP)
            set_model_state_dict(
                model, state["model"], options=StateDictOptions(strict=False)
            )
            set_optimizer_state_dict(model, self._optimizer, state["optimizer"])
            saved_groups = recipe_state[HYPERPARAMETERS]
            for group, saved in zip(
                self._optimizer.param_groups, saved_groups, strict=True
            ):
                group.update(saved)
        else:
            state = torch.load(folder / MODEL_OPTIMIZER_FILE, weights_only=False)
            for name, model in self._models.items():
                saved = state["model"][name] if self._named else state["model"]
                _load_trainable(model, saved, folder)
            self._optimizer.load_state_dict(state["optimizer"])
        self._warn_replaced(before, folder)
        self._progress.load_state_dict(recipe_state)
        rank_state = torch.load(folder / f"rank_{_rank()}.pt", weights_only=False)
        if rank_state[DATALOADER_KEY]:
            self._dataloader.load_state_dict(rank_state[DATALOADER_KEY])
        torch.set_rng_state(rank_state["rng"]["torch"])
        if "cuda" in rank_state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(rank_state["rng"]["cuda"])
        _on_rank_zero(lambda: self._branch(step_of(folder), recipe_state[EPOCHS_KEY]))
        utils.log_rank_zero(log, f"Resumed from step checkpoint {folder}.")

    def _branch(self, step: int, epochs_run: int) -> None:
        """A resume from an older checkpoint than the newest: the later checkpoints
        and exports of the old timeline are moved aside, so that pruning and later
        resumes only see this branch."""
        later = [p for p in _step_dirs(self._out) if step_of(p) > step]
        later += [
            p
            for d in {Path(e._output_dir) for e in self._exporters.values()}
            for p in d.glob("epoch_*")
            if p.name[6:].isdigit() and int(p.name[6:]) >= epochs_run
        ]
        if later:
            _set_aside(
                later,
                f"run_{self._run_id}-after-step_{step}",
                f"Resuming from step_{step}, before the newest checkpoints of this run: "
                "this branch replaces their timeline",
            )

    def _restore_legacy(self) -> None:
        """Resume a torchtune 0.6.1 epoch checkpoint (recipe state from the
        checkpointer, or DCP's ``dist_epoch_{N}``)."""
        self._run_id = read_run_file(self._out)
        if self._run_id is None:
            _on_rank_zero(
                lambda: _write_run_file(self._out, f"0.6.1-{uuid.uuid4().hex[:8]}")
            )
            self._run_id = read_run_file(self._out)
        before = _hyperparameters(self._optimizer)
        if self._resume_from == "dcp":
            (model,) = self._models.values()
            _init_optim_state(self._optimizer)
            state = DistributedCheckpointer(
                checkpoint_dir=self._export_dir,
                output_dir=self._export_dir,
                process_group=self._group(),
            ).load_checkpoint(
                {
                    MODEL_KEY: model.state_dict(),
                    OPT_KEY: self._optimizer.state_dict(),
                    EPOCHS_KEY: 0,
                }
            )
            set_state_dict(
                model,
                self._optimizer,
                model_state_dict=state[MODEL_KEY],
                optim_state_dict=state[OPT_KEY],
            )
        else:
            state = self._legacy_state
            self._load_full_optimizer_state(state[OPT_KEY])
        self._warn_replaced(before, "the epoch checkpoint")
        self._progress.load_state_dict(
            {**state, "global_step": state[EPOCHS_KEY] * self._steps_per_epoch}
        )

    def _load_full_optimizer_state(self, state_dict: dict[str, Any]) -> None:
        """A full optimizer state, keyed by index, by parameter name (a distributed
        run's), or in torchtune 0.6.1's in-backward format."""
        models = list(self._models.values())
        if is_legacy_in_bwd_state_dict(state_dict):
            # Several models (PPO): 0.6.1 saved the last model's parameters only.
            named = [
                (n if m is models[-1] else None, p)
                for m in models
                for n, p in m.named_parameters()
            ]
            state_dict = convert_legacy_optim_in_bwd_state_dict(
                state_dict, None if _world_size() > 1 else named
            )
        if _world_size() > 1:
            load_from_full_optimizer_state_dict(
                models[0], self._optimizer, state_dict, self.options.device
            )
        elif any(isinstance(k, str) for k in state_dict["state"]):
            set_optimizer_state_dict(
                models[0],
                self._optimizer,
                state_dict,
                options=StateDictOptions(full_state_dict=True),
            )
        else:
            self._optimizer.load_state_dict(state_dict)

    def _warn_replaced(self, before: list[dict[str, Any]], where: Any) -> None:
        """Name the config's optimizer settings that the checkpoint's replaced (the LR
        a scheduler starts from is the saved ``initial_lr``)."""
        replaced = []
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
                    replaced.append(
                        f"optimizer.{key}={value} (the checkpoint's: {now})"
                    )
        if replaced:
            utils.log_rank_zero(
                log,
                f"Resuming from {where}: its optimizer state replaces "
                f"{', '.join(sorted(set(replaced)))}. To train with the config's "
                "values, start a new run (resume_from_checkpoint=False).",
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
        epoch = self._progress.epochs_run - 1
        self._export(epoch)
        if done:
            key, value = self.options.length
            utils.log_rank_zero(
                log,
                f"Training done ({self._progress.epochs_run} epochs). Final weights in "
                f"{self._export_dir}/epoch_{epoch} (verified); resumable state in "
                f"{self._out}/step_{step} (run {self._run_id}). To train this run "
                "further, rerun with the same output_dir, resume_from_checkpoint=True "
                f"and {key} greater than {value}.",
            )
            self._lock()

    def _group(self) -> Any:
        if self._async_group is None and _world_size() > 1:
            # An asynchronous save runs collectives from a thread of its own.
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _write_step(self, *, mid_epoch: bool, wait: bool = False) -> None:
        self._finish_pending()
        step = self._progress.global_step
        final = self._out / f"step_{step}"
        partial = self._out / f".step_{step}.partial"
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()
        pending = None
        if _world_size() > 1:
            (model,) = self._models.values()
            state = {
                "model": get_model_state_dict(model, options=_TRAINABLE),
                "optimizer": get_optimizer_state_dict(model, self._optimizer),
            }
            if self.options.async_save and not wait:
                pending = dcp.async_save(
                    state,
                    checkpoint_id=partial / MODEL_OPTIMIZER_DCP,
                    process_group=self._group(),
                )
            else:
                dcp.save(state, checkpoint_id=partial / MODEL_OPTIMIZER_DCP)
        else:
            states = {n: _trainable_state_dict(m) for n, m in self._models.items()}
            model_state = states if self._named else states[MODEL_KEY]
            _save_file(
                {"model": model_state, "optimizer": self._optimizer.state_dict()},
                partial / MODEL_OPTIMIZER_FILE,
            )
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        loader_state = self._dataloader.state_dict() if mid_epoch else None
        _save_file(
            {DATALOADER_KEY: loader_state, "rng": rng}, partial / f"rank_{_rank()}.pt"
        )
        if _rank() == 0:
            recipe_state = {
                **self._progress.state_dict(),
                "global_step": step,
                "world_size": _world_size(),
                DATALOADER_KEY: loader_state,
                "epoch_end": not mid_epoch,
                OPTIMIZER_COMPONENT: self.options.optimizer_component,
                TRAJECTORY: self._trajectory,
                HYPERPARAMETERS: _hyperparameters(self._optimizer),
            }
            _save_file(recipe_state, partial / RECIPE_STATE)
        self._pending = (pending, partial, final)
        if pending is None:
            self._finish_pending()

    def _finish_pending(self) -> None:
        """Complete the last step checkpoint: checksums, manifest, rename, prune."""
        if self._pending is None:
            return
        future, partial, final = self._pending
        self._pending = None
        if future is not None:
            future.result()
        _barrier()
        names = _on_rank_zero(lambda: _files(partial, MANIFEST))
        files = _describe_shared(partial, names)

        def publish() -> None:
            manifest = {
                "version": MANIFEST_VERSION,
                "run_id": self._run_id,
                "global_step": step_of(final),
                "world_size": _world_size(),
                "files": files,
            }
            (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
            _fsync_dir(partial)
            if final.exists():  # never rewrite a checkpoint: keep the one it replaces
                _set_aside(
                    [final], f"run_{self._run_id}-replaced", "Saving a step again"
                )
            os.replace(partial, final)
            _fsync_dir(self._out)
            keep = self.options.keep_last_n or (
                1 if self.options.every_n_steps is None else None
            )
            if keep is not None:
                own = [
                    p for p in _step_dirs(self._out) if _run_id_of(p) == self._run_id
                ]
                for old in own[keep:]:
                    shutil.rmtree(old)
                    log.info(
                        f"Deleted step checkpoint {old} (keep_last_n_checkpoints={keep})"
                    )
            log.info(f"Step checkpoint saved to {final}")

        _on_rank_zero(publish)

    def _export(self, epoch: int) -> None:
        """Write ``epoch_{epoch}`` through each model's checkpointer, then its manifest."""
        folders = sorted(
            {Path(e._output_dir) / f"epoch_{epoch}" for e in self._exporters.values()}
        )
        for folder in folders:
            if _rank() == 0 and (folder / EXPORT_MANIFEST).exists():
                (
                    folder / EXPORT_MANIFEST
                ).unlink()  # being rewritten: not whole until done
        adapter_only = (
            self.options.adapter_only and self.options.adapter_config is not None
        )
        for name, model in self._models.items():
            if _world_size() > 1:
                state = gather_cpu_state_dict(
                    model,
                    _rank() == 0,
                    device=self.options.device,
                    adapter_weights_only=adapter_only,
                )
            else:
                state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            if _rank() == 0:
                export = (
                    {MODEL_KEY: state}
                    if self.options.adapter_config is None
                    else _lora_export(state, self.options.adapter_config, adapter_only)
                )
                extra = {"adapter_only": True} if adapter_only else {}
                self._exporters[name].save_checkpoint(
                    export, epoch=epoch, intermediate_checkpoint=False, **extra
                )
        _barrier()

        def record() -> None:
            for folder in folders:
                manifest = {
                    "version": MANIFEST_VERSION,
                    "run_id": self._run_id,
                    "files": _describe(folder, _files(folder, EXPORT_MANIFEST)),
                }
                (folder / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=1))

        _on_rank_zero(record)

    def _repair_export(self, epoch: int) -> None:
        """Rewrite the export of the epoch a resumed epoch-end checkpoint ended, if it
        is missing or damaged (a crash or a full disk while it was written): the
        model now holds exactly the weights it should hold."""
        problems = []
        for checkpointer in {id(e): e for e in self._exporters.values()}.values():
            try:
                verify(
                    Path(checkpointer._output_dir) / f"epoch_{epoch}", EXPORT_MANIFEST
                )
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
        if self._lock is not None:
            self._lock()


__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointOptions",
    "TrainingProgress",
    "file_checksum",
    "verify",
]
