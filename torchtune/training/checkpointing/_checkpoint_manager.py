"""Saving and resuming a run: :class:`CheckpointManager` and :class:`TrainingProgress`.

A run's resumable state is a *step checkpoint*, ``output_dir/step_{N}/``, written into
``.step_{N}.partial/`` and renamed once whole, and verified, every byte, before
anything of it is loaded (its files and their manifest: :mod:`._step_format`). After
each epoch the configured checkpointer exports ``epoch_{N}/``, the weights users take
away, with a manifest beside it, so that a torn export, or one another run wrote, is
found and rewritten (:mod:`._export`). The manager decides what a resume continues
from, refuses one that would not continue the same run (the trajectory), and writes
and prunes step checkpoints; the output folder's own rules (one live run, and what
a save supersedes: an earlier run's state, a branched-from timeline, the pruned) are
:mod:`._run_folder`'s. A finished run leaves what torchtune 0.6.1 left, plus small
metadata, unless ``checkpointer.keep_last_n_checkpoints`` keeps its step checkpoints.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.api import CheckpointException

from torchtune import config, utils
from torchtune.config._utils import _get_component_from_path as _component
from torchtune.training import optim_in_bwd_legacy_state_dict as legacy_format
from torchtune.training._distributed import (
    load_from_full_optimizer_state_dict,
)
from torchtune.training.checkpointing._checkpointer import DistributedCheckpointer
from torchtune.training.checkpointing._export import (
    export_state,
    not_this_runs_export,
    save_export,
)
from torchtune.training.checkpointing._run_folder import (
    RUN_FILE,
    check_lock,
    check_outside,
    check_writable,
    earlier_runs_state,
    new_run_id,
    publish_step,
    read_run_file,
    release_lock,
    run_head,
    take_lock,
    write_run_file,
)
from torchtune.training.checkpointing._step_format import (
    DCP_METADATA,
    MANIFEST,
    RECIPE_STATE,
    CheckpointError,
    barrier,
    delete_paths,
    export_manifest,
    in_process_group,
    load_weights_only,
    on_rank_zero,
    partial_step,
    process_count,
    process_rank,
    read_json,
    save_synced,
    size_of,
    step_checkpoints_in,
    step_of,
    verify,
    warn,
    whole_partial,
    write_manifest,
)
from torchtune.training.checkpointing._utils import (
    ADAPTER_KEY,
    DATALOADER_KEY,
    EPOCHS_KEY,
    MODEL_KEY,
    OPT_KEY,
    TOTAL_EPOCHS_KEY,
)
from torchtune.training.memory import hyperparameters

log = utils.get_logger("DEBUG")

# The config keys known not to change what a resumed run computes: a resume compares
# every other setting with the checkpoint's (patterns over dotted keys; a list of
# sections is indexed, as ``dataset.0.source``).
NOT_COMPARED_ON_RESUME = (
    # Where it reads and writes: a moved file holds the same bytes (the dataset's
    # contents are compared through its fingerprint).
    "*_dir",
    "*.path",
    "*_path",
    "*_file",
    "*_files",
    "*_files.*",
    "*.adapter_checkpoint",
    "*.recipe_checkpoint",
    # How it saves and resumes.
    "resume_from_checkpoint",
    "resume_allow_changes",
    "save_every_n_steps",
    "enable_async_checkpointing",
    "*.keep_last_n_checkpoints",
    "save_adapter_weights_only",
    "*.safe_serialization",
    # What it logs and profiles.
    "metric_logger",
    "metric_logger.*",
    "log_every_n_steps",
    "log_peak_memory_stats",
    "log_level",
    "profiler",
    "profiler.*",
    # How fast and in how much memory: the same numbers (the in-backward and plain
    # optimizer steps too, bitwise).
    "compile",
    "compile.*",
    "optimizer_in_bwd",
    "optimizer_in_bwd_bucket_cap_mb",
    "enable_activation_checkpointing",
    "enable_activation_offloading",
    "fsdp_cpu_offload",
    "fsdp_reshard_after_forward",
    "custom_sharded_layers",
    "num_workers",
    # The checkpoint's optimizer state replaces these (a warning names each one that
    # differs; another optimizer class is refused).
    "optimizer",
    "optimizer.*",
)
# The dataset's fingerprint hashes this many samples, spread evenly over it (all of a
# smaller one): a reordered or edited dataset is caught unless every one of them stays.
FINGERPRINT_SAMPLES = 4096
# What a manager has been asked so far, in the only order that works, and the call
# that takes it from each stage to the next: save() only after load(), load() only
# after load_base_checkpoint(), nothing but close() once the run has ended.
_STAGES = ("built", "base_loaded", "loaded", "ended")
_ADVANCED_BY = ("load_base_checkpoint()", "load(...)", "save(epoch_end=True)")
# The trainable parameters and the buffers: frozen weights are the base checkpoint's.
_TRAINABLE = dsd.StateDictOptions(ignore_frozen_params=True)


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


def _trajectory(cfg: DictConfig) -> dict[str, Any]:
    """Every setting of ``cfg`` but those :data:`NOT_COMPARED_ON_RESUME` matches, by
    dotted key, as plain values."""
    settings: dict[str, Any] = {}

    def add(key: str, value: Any) -> None:
        sections = isinstance(value, list) and any(
            isinstance(v, dict | list) for v in value
        )
        if isinstance(value, dict) and value:
            for name, v in value.items():
                add(f"{key}.{name}" if key else str(name), v)
        elif sections:
            for i, v in enumerate(value):
                add(f"{key}.{i}", v)
        else:
            settings[key] = value

    add("", OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    return {
        key: value
        for key, value in settings.items()
        if not any(fnmatch.fnmatchcase(key, p) for p in NOT_COMPARED_ON_RESUME)
    }


def _named_epoch(checkpointer: Mapping[str, Any]) -> int | None:
    """The epoch that torchtune 0.6.1's resume instructions name: ``N`` of
    ``adapter_checkpoint: epoch_{N}/adapter_model.pt`` (LoRA), else of
    ``checkpoint_files`` under ``epoch_{N}/`` (full fine-tuning), which 0.6.1 reads
    from the output folder when resuming; ``None`` if they name no epoch.

    Raises:
        ValueError: if the files name several epochs, or some files no epoch.
    """
    files = checkpointer.get("checkpoint_files") or []
    if isinstance(files, Mapping):  # {filename_format: ..., max_filename: ...}
        files = [files.get("filename_format", "")]
    elif isinstance(files, str):
        files = [files]
    adapter = checkpointer.get("adapter_checkpoint")
    key, names = (
        ("adapter_checkpoint", [adapter]) if adapter else ("checkpoint_files", files)
    )
    epochs = {step_of(Path(Path(str(n)).parts[0]), "epoch") for n in names if n}
    if len(epochs) > 1:
        raise ValueError(
            f"checkpointer.{key}={list(names)} name several epochs' folders, or some "
            "files in one and some not: to resume from an epoch, name that epoch's "
            "files only (epoch_{N}/...), as torchtune 0.6.1 does."
        )
    return epochs.pop() if epochs else None


def _epoch_ended(folder: Path) -> int | None:
    """The epoch at whose end the step checkpoint ``folder`` was saved; ``None`` if
    it was saved mid-epoch, or its recipe state does not read."""
    try:
        state = torch.load(folder / RECIPE_STATE, weights_only=True, mmap=True)
        return state[EPOCHS_KEY] - 1 if state.get("epoch_end") else None
    except Exception:  # damaged: load() names it, if it comes to it
        return None


def _described(steps: Sequence[Path]) -> str:
    """``steps`` named with where each falls, for a message."""
    named = []
    for step in steps:
        epoch = _epoch_ended(step)
        named.append(
            f"{step.name} ({'mid-epoch' if epoch is None else f'end of epoch {epoch}'})"
        )
    return ", ".join(named) or "none"


def _number(folder: Path) -> int:
    """``N`` of a step checkpoint ``step_{N}`` or of its ``.step_{N}.partial``."""
    step = step_of(folder)
    return partial_step(folder) if step is None else step


# How torch.save reports a write that failed (a full disk among the causes).
_WRITE_FAILED = re.compile(r"unexpected pos|PytorchStreamWriter failed|write failed")


@contextlib.contextmanager
def _writing(what: str, *folders: Path) -> Iterator[None]:
    """Name the ``folders`` being written in an error that writing them raises: a
    full disk shows as an ``OSError`` (``ENOSPC``), or from ``torch.save`` as a
    ``RuntimeError`` ("unexpected pos"), or from DCP as its ``CheckpointException``.

    Raises:
        OSError: naming the folders, the space left on their disk and the way on.
    """
    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as e:
        if isinstance(e, RuntimeError) and not _WRITE_FAILED.search(str(e)):
            raise
        free = shutil.disk_usage(folders[0].parent).free
        message = (
            f"Writing the {what} {', '.join(map(str, folders))} failed ({e}), with "
            f"{free / 1e9:.2f} GB left on its disk (a full disk?). What was saved "
            "before it is whole: make space, then resume (resume_from_checkpoint=True)."
        )
        errno = getattr(e, "errno", None)
        raise (OSError(errno, message) if errno else OSError(message)) from e


def _whole_or_deleted(partial: Path) -> tuple[str, int | None] | None:
    """The run id and the step it continued from of ``partial``, a step checkpoint
    not yet published, if it is whole; else it is deleted, a save that did not
    finish."""
    state = whole_partial(partial)
    if state is None:
        warn(f"Deleting {partial} ({size_of([partial])}): a save that did not finish")
        delete_paths([partial])
        return None
    return state["run_id"], state.get("after")


# -- what a checkpoint holds ---------------------------------------------------------

# The entries of the mapping a recipe hands to load(), and the one the manager adds:
# each process's RNG state.
PROGRESS_KEY, RNG_STATE_KEY = "progress", "rng"
REQUIRED_STATES = (MODEL_KEY, OPT_KEY, DATALOADER_KEY, PROGRESS_KEY)


def _trainable(model: torch.nn.Module) -> dict[str, Any]:
    return dsd.get_model_state_dict(model, options=_TRAINABLE)


class _ModelState:
    """The trainable weights and the buffers of a model, through
    ``torch.distributed.checkpoint.state_dict`` (a sharded model's as shards), the
    way torchtitan's ``ModelWrapper`` saves a model. Frozen weights are the base
    checkpoint's, read again on resume."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return _trainable(self.module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        non_strict = dsd.StateDictOptions(strict=False)  # the frozen ones are not in it
        dsd.set_model_state_dict(self.module, state_dict, options=non_strict)


class _OptimizerState:
    """An optimizer's state keyed by parameter name, through
    ``torch.distributed.checkpoint.state_dict``, as torchtitan's optimizers container
    saves it: plain and in-backward optimizers, sharded or not, load each other's."""

    def __init__(self, module: torch.nn.Module, optimizer: Any) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        return dsd.get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        dsd.set_optimizer_state_dict(self.module, self.optimizer, state_dict)


# State each process has its own of (its data position, its RNG) is saved under the
# process's rank, whole, as torch.save bytes: DCP keeps one copy of an entry that
# every process names alike, and loads only into the structure a new object already
# has (a loader's state grows as it iterates).


def _this_process(value: Any) -> dict[str, bytes]:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return {f"rank_{process_rank()}": buffer.getvalue()}


def _of_this_process(state_dict: Mapping[str, bytes]) -> Any:
    return torch.load(
        io.BytesIO(state_dict[f"rank_{process_rank()}"]), weights_only=True
    )


class _LoaderPosition:
    """A dataloader's position in its epoch, saved mid-epoch only: after an epoch's
    end the next epoch starts its loader afresh (``epoch_end``, set before a save)."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader, self.epoch_end = dataloader, False

    def state_dict(self) -> dict[str, bytes]:
        return _this_process(None if self.epoch_end else self.dataloader.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, bytes]) -> None:
        if (position := _of_this_process(state_dict)) is not None:
            self.dataloader.load_state_dict(position)


class _RngState:
    """The RNG state of this process: torch's, and CUDA's once it is in use."""

    def state_dict(self) -> dict[str, bytes]:
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        return _this_process(rng)

    def load_state_dict(self, state_dict: Mapping[str, bytes]) -> None:
        rng = _of_this_process(state_dict)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


@contextlib.contextmanager
def _one_process_dcp() -> Iterator[None]:
    """DCP in one process without a process group, which it warns about at every
    call ("assuming the intent is to save in a single process"): the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [hyperparameters(group) for group in opt.param_groups]


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except RuntimeError:  # tensors of several elements
        return str(a) != str(b)


def _dataset_identity(dataset: Any) -> dict[str, Any]:
    """A dataset's length and a fingerprint of its contents and order: a hash of
    :data:`FINGERPRINT_SAMPLES` samples spread evenly over it, each with its index."""
    n, digest = len(dataset), hashlib.sha256()

    def jsonable(value: Any) -> Any:
        return value.tolist() if hasattr(value, "tolist") else type(value).__name__

    count = min(n, FINGERPRINT_SAMPLES)
    for i in sorted({k * (n - 1) // max(count - 1, 1) for k in range(count)}):
        sample = json.dumps(dataset[i], sort_keys=True, default=jsonable)
        digest.update(f"{i}:{sample}\n".encode())
    return {"dataset_length": n, "dataset_hash": digest.hexdigest()[:16]}


# -- the manager ---------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointOptions:
    """The checkpointing options of a run, read from its config by
    :meth:`from_config`; :class:`CheckpointManager` is built from them."""

    output_dir: Path
    checkpointer: Any
    device: torch.device
    resume: bool
    recipe_checkpoint: str | None
    every_n_steps: int | None
    keep_last_n: int | None
    named_epoch: int | None
    async_save: bool
    allow_changes: bool
    optimizer_component: str | None
    trajectory: Mapping[str, Any]
    length: tuple[str, Any]
    adapter_only: bool

    @classmethod
    def from_config(cls, cfg: DictConfig) -> CheckpointOptions:
        """Read the options from a recipe config: ``output_dir`` (default: the
        checkpointer's), ``checkpointer`` (and its ``recipe_checkpoint`` and
        ``keep_last_n_checkpoints``), ``device``, ``resume_from_checkpoint``,
        ``resume_allow_changes``, ``save_every_n_steps``,
        ``enable_async_checkpointing``, ``optimizer._component_``, the settings of
        every setting but :data:`NOT_COMPARED_ON_RESUME`, ``epochs`` (PPO: ``num_steps``),
        ``save_adapter_weights_only``, and every checkpointer section's
        ``checkpoint_dir`` (which no output folder may be in)."""
        checkpointer = cfg.checkpointer.copy()
        keep_last_n = checkpointer.pop("keep_last_n_checkpoints", None)
        output_dir = Path(cfg.get("output_dir") or checkpointer.output_dir)
        for key, section in cfg.items():
            if str(key).endswith("checkpointer") and section.get("checkpoint_dir"):
                root = Path(section.checkpoint_dir)
                # Where this checkpointer writes: its own output_dir, or output_dir.
                own = section.get("output_dir")
                out_key = f"{key}.output_dir" if own else "output_dir"
                out = Path(own or output_dir)
                check_outside(root, f"{key}.checkpoint_dir", out, out_key)
        length = "epochs" if "epochs" in cfg else "num_steps"
        resume = cfg.get("resume_from_checkpoint", False)
        return cls(
            output_dir=output_dir,
            checkpointer=checkpointer,
            device=utils.get_device(device=cfg.device),
            resume=resume,
            recipe_checkpoint=checkpointer.get("recipe_checkpoint", None),
            every_n_steps=cfg.get("save_every_n_steps", None),
            keep_last_n=keep_last_n,
            named_epoch=_named_epoch(checkpointer) if resume else None,
            async_save=cfg.get("enable_async_checkpointing", False),
            allow_changes=cfg.get("resume_allow_changes", False),
            optimizer_component=(cfg.get("optimizer") or {}).get("_component_"),
            trajectory=_trajectory(cfg),
            length=(length, cfg.get(length, None)),
            adapter_only=cfg.get("save_adapter_weights_only", False),
        )


class CheckpointManager:
    """Saves a run and resumes it, exactly: the one object a recipe asks.

    A recipe builds it first, from :meth:`CheckpointOptions.from_config` (bad
    options and a resume that cannot work are refused then, before anything is built
    or written); a LoRA recipe also gives the adapter's PEFT config, which every
    export carries and which turns on the merged export. The recipe then reads
    the weights to start from with :meth:`load_base_checkpoint`, builds its model,
    optimizer, data and LR scheduler, and hands them over with :meth:`load`, as one
    mapping of stateful objects (and anything else it must resume with), which puts
    a resumed run back where it was. In the loop, :meth:`save` after every optimizer step and
    ``save(epoch_end=True)`` after every epoch: a step checkpoint when one is due
    (``save_every_n_steps``) and at every epoch's end, then the epoch export through
    the configured checkpointer. ``resume_from_checkpoint: True`` continues from the
    newest whole step checkpoint (or the one ``checkpointer.recipe_checkpoint``
    names, which starts a branch), or from a torchtune 0.6.1 epoch checkpoint.

    Args:
        options (CheckpointOptions): what the config asks (see
            :meth:`CheckpointOptions.from_config`).
        adapter_config (Mapping[str, Any] | None): a LoRA model's PEFT adapter config
            (``r``, ``lora_alpha``, ``target_modules``, ``peft_type``): each export
            then holds the adapter and this config and, unless
            ``save_adapter_weights_only``, the weights with the adapter merged in.
            Default: ``None`` (the model has no adapter).

    .. warning::
        The calls come in this order: :meth:`load_base_checkpoint`, :meth:`load`,
        then :meth:`save` until the last epoch's save; :meth:`close` at any time.
        A call out of order raises a ``RuntimeError`` naming the call to make first.
        Building the manager only reads ``output_dir``: nothing on disk changes
        before :meth:`load`, which takes the folder's lock.

    Example (a recipe's use; ``docs/source/step_checkpoints.rst`` runs one)::

        manager = CheckpointManager(CheckpointOptions.from_config(cfg))  # __init__
        model.load_state_dict(manager.load_base_checkpoint()[MODEL_KEY])
        progress = TrainingProgress(total_epochs=cfg.epochs)
        states = {"model": model, "optimizer": optimizer, "dataloader": dataloader}
        states |= {"progress": progress, "lr_scheduler": lr_scheduler}
        manager.load(states, steps_per_epoch=10)
        for epoch in range(progress.epochs_run, progress.total_epochs):
            for batch in batches:  # forward, backward, optimizer.step()
                progress.global_step += 1
                manager.save()
            progress.epochs_run += 1
            manager.save(epoch_end=True)
    """

    def __init__(
        self,
        options: CheckpointOptions,
        *,
        adapter_config: Mapping[str, Any] | None = None,
    ) -> None:
        for key, value, null in (
            ("save_every_n_steps", options.every_n_steps, "save at epoch ends only"),
            ("checkpointer.keep_last_n_checkpoints", options.keep_last_n, "keep all"),
        ):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(
                    f"{key}={value!r} must be a positive integer or null (null: {null})"
                )
        component = options.checkpointer._component_
        if issubclass(_component(component), DistributedCheckpointer):
            raise ValueError(
                f"checkpointer._component_={component} reads no weights to start from: "
                "use an HF, Meta or torchtune checkpointer."
            )
        self.options, self._out = options, Path(options.output_dir)
        self.adapter_config = None if adapter_config is None else dict(adapter_config)
        self._export_dir = Path(options.checkpointer.get("output_dir") or self._out)
        check_writable("output_dir", self._out)
        check_writable("checkpointer.output_dir", self._export_dir)
        base = Path(options.checkpointer.get("checkpoint_dir") or "")
        if adapter_config is not None and (
            step_of(base, "epoch") is not None
            and base.parent.resolve() == self._export_dir.resolve()
        ):
            raise ValueError(
                f"checkpointer.checkpoint_dir={base} is an export of this run's "
                f"checkpointer.output_dir={self._export_dir}: its epoch exports would "
                "overwrite the base weights it reads (with the adapter merged in), and "
                "a resume would apply the adapter to them a second time. Set output_dir "
                "and checkpointer.output_dir to another folder."
            )
        # Refused now if another run trains there; load() takes the lock. Building
        # the manager only reads: nothing on disk changes before load().
        check_lock(self._out)
        # A resume continues from the first whole one of these step checkpoints, or
        # else from a torchtune 0.6.1 checkpoint: "epoch" (recipe_state/ and the
        # epoch's export) or "dcp" (an asynchronous save's dist_epoch_N/).
        self._steps, self._epoch_checkpoint = self._resume_points()
        self._checkpointer = self._run_id = self._pending = self._async_group = None
        # The step checkpoint this run continues from: its last published, or the
        # one it resumed (None: a new run, or one that resumed another folder's).
        self._after: int | None = None
        self._newest: Path | None = None
        self._release_output_dir: Callable[[], Any] = lambda: None
        # The calls made so far: load_base_checkpoint(), then load(), then save()
        # until the run ends (its last epoch's save, or close()).
        self._stage = "built"

    def _expect(self, call: str, stage: str) -> None:
        """Refuse ``call`` unless the run is at ``stage`` (see :data:`_STAGES`),
        naming the calls to make first."""
        now, needed = _STAGES.index(self._stage), _STAGES.index(stage)
        if now < needed:
            missing = " then ".join(_ADVANCED_BY[now:needed])
            raise RuntimeError(
                f"CheckpointManager.{call} needs {missing} first: call it before."
            )
        if self._stage == "ended":
            raise RuntimeError(
                f"CheckpointManager.{call} after the run ended (its last epoch's "
                "save(epoch_end=True), or close()): build a new CheckpointManager "
                "for another run."
            )
        if now > needed:
            raise RuntimeError(f"CheckpointManager.{call} was called already.")

    # -- choosing what a resume continues from ----------------------------------------

    def _resume_points(self) -> tuple[list[Path], str | None]:
        """The step checkpoints a resume may continue from, newest first (of the run
        ``output_dir`` holds, or the one ``recipe_checkpoint`` names, or the end of
        the epoch whose export the checkpointer's files name), or else a 0.6.1 epoch
        checkpoint. Read now, before anything is built, are only names, recipe
        states and the newest one's optimizer class; :meth:`load` verifies every byte."""
        requested = self.options.recipe_checkpoint
        out, export = self._out, self._export_dir
        if not self.options.resume:
            return [], None
        folder = out / (requested or "")
        folder = folder if step_of(folder) is not None else folder.parent
        if requested and step_of(folder) is None:  # torchtune 0.6.1's recipe_state.pt
            if not (export / requested).is_file():
                raise CheckpointError(
                    f"checkpointer.recipe_checkpoint={requested}: {export / requested} "
                    "does not exist. Name the run's recipe_state.pt, or leave it unset."
                )
            self._check_optimizer(export / requested)
            return [], "epoch"
        if requested and not folder.is_dir():
            raise CheckpointError(
                f"checkpointer.recipe_checkpoint={requested} names the step checkpoint "
                f"{folder}, which does not exist. The step checkpoints in {out} are "
                f"{[p.name for p in step_checkpoints_in(out)] or 'none'}: name one of them."
            )
        steps = [folder] if requested else self._timeline()
        epoch_state = export / "recipe_state" / RECIPE_STATE
        if not requested and self.options.named_epoch is not None:
            steps = self._epoch_end(steps, has_epoch_recipe_state=epoch_state.is_file())
        if steps or (epoch_state.is_file() and not self.options.async_save):
            self._check_optimizer(steps[0] if steps else epoch_state)
            return steps, None if steps else "epoch"
        if self.options.async_save and any(export.glob("dist_epoch_*/.metadata")):
            return [], "dcp"
        hint = ""
        if final := read_json(out / RUN_FILE).get("final_export"):
            hint = self._way_on(Path(final))
        raise CheckpointError(
            "resume_from_checkpoint=True, but there is nothing to resume from: no "
            f"whole step checkpoint (step_N/) of this run in output_dir={out}, nor a "
            f"0.6.1 epoch checkpoint.{hint} Set resume_from_checkpoint=False to start."
        )

    def _way_on(self, final: Path) -> str:
        """What a finished run whose step checkpoints were deleted can do: start a
        new run from its final export, if that is whole, in another output folder,
        so that the new run's exports never overwrite the weights it reads."""
        gone = (
            "its step checkpoints were deleted, as checkpointer.keep_last_n_checkpoints "
            "was not set"
        )
        try:
            files = verify(final, export_manifest(final))["files"]
        except CheckpointError as e:
            return (
                f" The run there finished, {gone}, and its final export is damaged "
                f"({e}): no whole weights of it are left to train further from."
            )
        weights = [
            name
            for name in sorted(files)
            if name.endswith((".safetensors", ".bin", ".pt", ".pth"))
            and not name.startswith("adapter")
        ]
        new = f"{self._out}_from_{final.name}"
        return (
            f" The run there finished (final weights in {final}) and {gone}. To train "
            f"further from its final weights, start a new run with "
            f"checkpointer.checkpoint_dir={final} "
            f"checkpointer.checkpoint_files=[{','.join(weights)}] output_dir={new} "
            f"checkpointer.output_dir={new}: its exports then never overwrite them."
        )

    def _timeline(self) -> list[Path]:
        """The step checkpoints a resume of the run ``output_dir`` holds may continue
        from, newest first, as they are once :meth:`load` has published every whole
        ``.step_{N}.partial`` (which then is its run's newest; until then it is
        named so): those of the run, up to its newest (later ones are of a timeline
        it branched from)."""
        out = self._out
        run_id, head = read_run_file(out), run_head(out)
        partials = {p: whole_partial(p) for p in out.glob(".step_*.partial")}
        partials = {p: state for p, state in partials.items() if state is not None}
        for partial, state in sorted(partials.items(), key=lambda p: _number(p[0])):
            run_id, head = state["run_id"], partial_step(partial)
        steps = [p for p, state in partials.items() if state["run_id"] == run_id]
        steps += [
            p
            for p in step_checkpoints_in(out, run_id)
            if head is None or step_of(p) <= head
        ]
        return sorted(steps, key=_number, reverse=True)  # a partial before its step

    def _epoch_end(
        self, steps: list[Path], *, has_epoch_recipe_state: bool
    ) -> list[Path]:
        """The step checkpoint saved at the end of the epoch whose export the
        checkpointer's files name (torchtune 0.6.1's way to resume), or none where
        the folder is one 0.6.1 wrote (``has_epoch_recipe_state``: its recipe state goes
        with them).

        Raises:
            CheckpointError: if that checkpoint is gone, naming those that remain.
        """
        epoch = self.options.named_epoch
        ended = [step for step in steps if _epoch_ended(step) == epoch]
        if ended or (has_epoch_recipe_state and not steps):
            return ended
        if self.options.checkpointer.get("adapter_checkpoint"):
            key, newest = "adapter_checkpoint", "unset it"
        else:
            key, newest = "checkpoint_files", "set it back to the base model's files"
        raise CheckpointError(
            f"checkpointer.{key} names epoch_{epoch}/, but the step checkpoint saved at "
            f"the end of epoch {epoch}, which a resume from that epoch continues, is not "
            f"in {self._out} (pruned, or never saved). This run's step checkpoints are: "
            f"{_described(steps)}. Name one of them with "
            f"checkpointer.recipe_checkpoint=step_N, or {newest} to resume from the "
            "newest."
        )

    def _check_optimizer(self, where: Path) -> None:
        """Refuse a checkpoint (a step checkpoint or 0.6.1's recipe state file) whose
        optimizer state is another optimizer class's."""
        saved, same, configured = None, False, self.options.optimizer_component
        try:
            path = where / RECIPE_STATE if where.is_dir() else where
            state = torch.load(path, weights_only=True, mmap=True)
            saved = state.get("optimizer_component")
            same = _component(saved) is _component(configured)
        except Exception:  # damaged (load() names it), or a class no longer imported
            pass
        if saved and configured and saved != configured and not same:
            raise ValueError(
                f"optimizer._component_={configured} cannot resume from {where}: its "
                f"optimizer state was saved by {saved}. Set optimizer._component_="
                f"{saved} to resume, or resume_from_checkpoint=False to start anew."
            )

    # -- setup -------------------------------------------------------------------------

    def load_base_checkpoint(self) -> dict[str, Any]:
        """The weights to build the model from, read by the configured checkpointer:
        the base checkpoint (a step checkpoint's trained weights are loaded by
        :meth:`load`), or, resuming a torchtune 0.6.1 epoch checkpoint, the weights
        ``checkpoint_files`` names there and the adapter.

        Returns:
            dict[str, Any]: ``MODEL_KEY`` (and ``ADAPTER_KEY`` when the
            checkpointer reads an adapter).
        """
        self._expect("load_base_checkpoint()", "built")
        self._stage = "base_loaded"
        epoch, cfg = self._epoch_checkpoint == "epoch", self.options.checkpointer
        if self._steps and self.options.named_epoch is not None:
            # The files named under epoch_{N}/ are read from the output folder, as
            # in 0.6.1, which then also reads a recipe state: the step checkpoint's,
            # whose weights load() puts in place.
            recipe_state = str((self._steps[0] / RECIPE_STATE).absolute())
            self._checkpointer = config.instantiate(
                cfg, should_load_recipe_state=True, recipe_checkpoint=recipe_state
            )
            state = self._checkpointer.load_checkpoint()
            weights = (MODEL_KEY, ADAPTER_KEY)
            return {key: state[key] for key in weights if key in state}
        self._checkpointer = config.instantiate(cfg, should_load_recipe_state=epoch)
        state = self._checkpointer.load_checkpoint()
        if not epoch:
            return state
        weights = (MODEL_KEY, ADAPTER_KEY)
        self._epoch_recipe_state = {
            k: state.pop(k) for k in list(state) if k not in weights
        }
        if self.adapter_config and ADAPTER_KEY not in state:
            raise ValueError(
                "resume_from_checkpoint=True, but no adapter weights were found. Set "
                "checkpointer.adapter_checkpoint, or resume from an output_dir whose "
                "latest epoch_* folder holds adapter_model.pt."
            )
        return state

    def load(
        self,
        states: Mapping[str, Any],
        *,
        steps_per_epoch: int,
        exporters: Mapping[str, tuple[Any, Path | str]] | None = None,
    ) -> None:
        """Hand over what the run saves, one mapping of stateful objects, and,
        resuming, put each back where it was.

        A resume first verifies the checkpoint and checks that the run continues its
        trajectory (every setting but :data:`NOT_COMPARED_ON_RESUME`, the dataset's
        length and fingerprint, the number of processes and the optimizer steps of
        an epoch); then the lock is taken (one run per ``output_dir``) and a whole
        step checkpoint a stopped run had not published is published (a torn one
        deleted); an earlier run's state stays until this run's first save is whole.
        A resume of an epoch-end checkpoint rewrites that
        epoch's export if it is not whole (a crash or a full disk while it was
        written). Call it on every rank, after :meth:`load_base_checkpoint`.

        Every entry is saved with each step checkpoint, in one
        ``torch.distributed.checkpoint`` (DCP) checkpoint with the others, and
        restored together: the model and the optimizer through
        ``torch.distributed.checkpoint.state_dict`` (a sharded model's as shards),
        the dataloader's position per process, each process's RNG state (added by
        the manager), and every other entry as its ``state_dict()`` holds it:
        tensors (sharded ``DTensor`` s too) and plain values, which DCP saves once
        for all processes. An entry whose state differs between processes must key
        it by rank itself.

        Args:
            states (Mapping[str, Any]): by name: ``"model"``, the model
                (FSDP2-sharded in a distributed run), or several by name in one
                process; ``"optimizer"``, the optimizer of all of them, plain or
                :class:`~torchtune.training.OptimizerInBackward`; ``"dataloader"``,
                the ``StatefulDataLoader`` (its position is saved mid-epoch);
                ``"progress"``, where training stands (a :class:`TrainingProgress`);
                and anything else the run must resume with, each with
                ``state_dict()`` and ``load_state_dict()``: the LR scheduler, an EMA
                of the weights, a sampler of one's own. A ``None`` entry (no LR
                scheduler) is left out.
            steps_per_epoch (int): the optimizer steps of an epoch.
            exporters (Mapping[str, tuple[Any, Path | str]] | None): for a model of
                a mapping that its own checkpointer exports (not the configured
                one): that checkpointer and the folder it writes to, its
                ``output_dir``. Default: ``None``

        Raises:
            CheckpointError: if no checkpoint to resume is whole, it does not match
                the model or holds no state for an entry, was trained with other
                settings (unless ``resume_allow_changes``), or another run holds
                ``output_dir``.
            ValueError: if ``states`` lacks one of ``"model"``, ``"optimizer"``,
                ``"dataloader"`` and ``"progress"``, or an epoch would have no
                optimizer step.
        """
        self._expect("load()", "base_loaded")
        states = {name: s for name, s in states.items() if s is not None}
        if missing := [key for key in REQUIRED_STATES if key not in states]:
            raise ValueError(
                f"load() needs the run's {missing} among its states (it has "
                f"{sorted(states)}): pass them by these names."
            )
        if RNG_STATE_KEY in states:
            raise ValueError(
                f"load() saves each process's RNG state as {RNG_STATE_KEY!r} itself: "
                "give yours another name."
            )
        model, by_name = states[MODEL_KEY], isinstance(states[MODEL_KEY], Mapping)
        self._models = dict(model) if by_name else {MODEL_KEY: model}
        # Several models are saved as one, each under its name.
        module = torch.nn.ModuleDict(model) if by_name else model
        self._optimizer, self._dataloader = states[OPT_KEY], states[DATALOADER_KEY]
        self._progress, self._steps_per_epoch = states[PROGRESS_KEY], steps_per_epoch
        self._states = {
            **states,
            MODEL_KEY: _ModelState(module),
            OPT_KEY: _OptimizerState(module, self._optimizer),
            DATALOADER_KEY: _LoaderPosition(self._dataloader),
            RNG_STATE_KEY: _RngState(),
        }
        configured = (self._checkpointer, self._export_dir)
        exporters = {name: configured for name in self._models} | dict(exporters or {})
        self._exporters = {name: exporter for name, (exporter, _) in exporters.items()}
        self._export_roots = sorted({Path(folder) for _, folder in exporters.values()})
        dataset = self._dataloader.dataset
        if steps_per_epoch < 1:
            raise ValueError(
                f"An epoch has no optimizer step: {len(dataset)} samples make "
                f"{len(self._dataloader)} batches per process ({dict(self.options.trajectory)})"
                ": use more data, or a smaller batch_size or gradient_accumulation_steps."
            )
        self._trajectory = {**self.options.trajectory, "world_size": process_count()}
        self._trajectory["steps_per_epoch"] = steps_per_epoch
        self._trajectory |= _dataset_identity(dataset)
        folder, recipe_state = self._verified() if self._steps else (None, {})

        def lock_output_dir() -> None:
            self._lock = take_lock(self._out)
            self._release_output_dir = weakref.finalize(self, release_lock, self._lock)

        on_rank_zero(lock_output_dir)
        self._stage = "loaded"
        self._publish_partials()
        if folder is not None and (step := partial_step(folder)) is not None:
            folder = folder.with_name(f"step_{step}")  # published now
        if self.options.async_save and in_process_group():
            # Its collectives run from a thread.
            self._async_group = dist.new_group(backend="gloo")
        if folder is None and self._epoch_checkpoint is None:
            self._run_id = on_rank_zero(new_run_id)
            utils.log_rank_zero(log, f"New run {self._run_id} in {self._out}.")
            if earlier := earlier_runs_state(self._out, self._run_id):
                warn(
                    f"{self._out} holds an earlier run's resumable state "
                    f"({', '.join(p.name for p in earlier)}: {size_of(earlier)}). It stays "
                    "until this run's first step checkpoint is whole, and is deleted "
                    "then. To continue that run instead, stop this one and resume it "
                    "(resume_from_checkpoint=True); to keep it, use another output_dir."
                )
            return
        self._restore(folder, recipe_state)
        self._after_resume(folder, epoch_end=bool(recipe_state.get("epoch_end")))

    def _publish_partials(self) -> None:
        """Publish every whole ``.step_{N}.partial`` that a stopped run left (an
        asynchronous save its run did not live to complete, a save killed before its
        rename), after verifying it, and delete the others: saves that did not
        finish. Call it on every rank, holding the lock."""
        out = self._out
        found = on_rank_zero(lambda: sorted(out.glob(".step_*.partial"), key=_number))
        for folder in found:
            step = partial_step(folder)
            if (written := on_rank_zero(lambda f=folder: _whole_or_deleted(f))) is None:
                continue
            run_id, after = written
            if not (folder / MANIFEST).is_file():
                write_manifest(folder, folder / MANIFEST, run_id=run_id, step=step)
            verify(folder)
            publish = dict(step=step, run_id=run_id, after=after, keep=None)
            on_rank_zero(lambda f=folder, kw=publish: publish_step(f, **kw))
            warn(
                f"Published {out / f'step_{step}'}: a whole step checkpoint that the "
                "run which saved it had not published yet"
            )

    def _after_resume(self, folder: Path | None, *, epoch_end: bool) -> None:
        """Once a resume is restored: rewrite the resumed epoch's export if it is not
        this checkpoint's (torn, or another run's), and at the end of training say
        there is nothing left to do (and finish a run stopped before it had)."""
        progress = self._progress
        epoch = progress.epochs_run - 1
        done = progress.epochs_run >= progress.total_epochs
        problems = []
        for root in self._export_roots if epoch_end else []:
            problem = not_this_runs_export(
                root / f"epoch_{epoch}", run_id=self._run_id, step=progress.global_step
            )
            if problem is not None:
                problems.append(problem)
        if problems:
            warn(
                f"The export of epoch {epoch} is not this checkpoint's "
                f"({'; '.join(problems)}): rewriting it from {folder}."
            )
            self._export(epoch, final=done)
        if done:
            key, value = self.options.length
            warn(
                f"resume_from_checkpoint=True: {folder or self._export_dir} is at the "
                f"end of training ({progress.epochs_run} epochs done, {key}={value}): "
                f"nothing left to do. To train further, set {key} to more than {value}."
            )
            # A run stopped before it finished (its final export torn, say) finishes
            # now; a finished one is left as it is.
            finished = read_json(self._out / RUN_FILE).get("final_export")
            own = folder is not None and folder.parent.resolve() == self._out.resolve()
            if own and not finished:
                on_rank_zero(lambda: self._finish_run(epoch))
            self._end()

    def _required_files(self) -> list[str]:
        """What every step checkpoint lists: it is whole when its DCP metadata is,
        and a file its manifest does not list is never loaded."""
        return [RECIPE_STATE, DCP_METADATA]

    def _verified(self) -> tuple[Path, dict[str, Any]]:
        """The newest resume point whose every byte verifies (a damaged one gives way
        to the one before, with a warning) and its recipe state; refused if it was
        trained with other settings."""
        for folder in self._steps:
            try:
                # A whole save not yet published has its manifest written by load().
                if partial_step(folder) is None or (folder / MANIFEST).is_file():
                    verify(folder, required=self._required_files())
                break
            except CheckpointError as e:
                if named := self.options.recipe_checkpoint:
                    raise CheckpointError(
                        f"checkpointer.recipe_checkpoint={named} cannot be resumed: "
                        f"{e}. Name another one, or leave it unset."
                    ) from e
                warn(f"Skipping step checkpoint {folder}: {e}")
        else:
            raise CheckpointError(
                f"resume_from_checkpoint=True, but no step checkpoint in {self._out} is "
                "whole (see the warnings). Set resume_from_checkpoint=False to start anew."
            )
        self._check_optimizer(folder)  # from_config checked the newest
        recipe_state = load_weights_only(folder / RECIPE_STATE)
        old, new = recipe_state["trajectory"], self._trajectory
        pairs = {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys())}
        diff = {k: pair for k, pair in pairs.items() if _differs(*pair)}
        length = self.options.length[0]
        if recipe_state.get("epoch_end") and length in diff:
            # Training a finished (or epoch-end) run further, or less: nothing to
            # match.
            before, after = diff.pop(length)
            if after <= recipe_state[EPOCHS_KEY]:
                then = "no epoch is left to train"
            else:
                then = "training goes on" if after > before else "training stops sooner"
                then += (
                    f", to the new {length}, and a learning rate schedule is rebuilt "
                    "over it, from this step on"
                )
            warn(
                f"Resuming {folder} with {length}={after} (it was trained with "
                f"{before}): {then}."
            )
        listed = ", ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in diff.items())
        # Where the run stands in its data (per process, and by optimizer steps into
        # the epoch) cannot be carried over to another count of either.
        fixed = [k for k in ("world_size", "steps_per_epoch") if k in diff]
        if fixed or (diff and not self.options.allow_changes):
            raise CheckpointError(
                f"{folder} was trained with other settings ({listed}): set them back, "
                "or resume_allow_changes=True to go on with them (not world_size or "
                "steps_per_epoch, which the dataset's length, batch_size, "
                "gradient_accumulation_steps and max_steps_per_epoch set: a resume "
                "finds its place in the data by them), or resume_from_checkpoint=False."
            )
        if diff:
            warn(
                f"resume_allow_changes=True: resuming {folder} with other settings "
                f"({listed}); this run differs from an uninterrupted one."
            )
        return folder, recipe_state

    def _restore(self, folder: Path | None, recipe_state: dict[str, Any]) -> None:
        """Put the run back where ``folder``, a step checkpoint, left it, or else
        where the torchtune 0.6.1 epoch checkpoint did; name the config's optimizer
        settings that the checkpoint's replaced."""
        optimizer, before = self._optimizer, _hyperparameters(self._optimizer)
        if folder is None:
            self._progress.load_state_dict(self._restore_legacy())
        else:
            self._check_holds(folder)
            with _one_process_dcp():
                states = dict(self._states)
                dcp.load(states, checkpoint_id=folder, no_dist=not in_process_group())
            # DCP fills only the hyperparameters a new optimizer's groups have.
            saved = recipe_state["optimizer_param_group_hyperparameters"]
            for group, values in zip(optimizer.param_groups, saved, strict=True):
                group.update(values)
        replaced = set()
        for configured, saved in zip(before, _hyperparameters(optimizer), strict=False):
            # The LR a scheduler starts from is the saved initial_lr.
            saved["lr"] = saved.pop("initial_lr", saved.get("lr"))
            for key, value in configured.items():
                if key in saved and _differs(value, now := saved[key]):
                    replaced.add(f"optimizer.{key}={value} (the checkpoint's: {now})")
        if replaced:
            warn(
                f"Resuming from {folder or 'the epoch checkpoint'}: its optimizer state "
                f"replaces {', '.join(sorted(replaced))}. To train with the config's "
                "values, start a new run (resume_from_checkpoint=False)."
            )
        if folder is None:
            return
        if folder.parent.resolve() == self._out.resolve():
            self._run_id = read_json(folder / MANIFEST).get("run_id")
            self._run_id = self._run_id or read_run_file(self._out)
            self._after = step_of(folder)
        else:  # another folder's: read only, this run's saves go to output_dir
            self._run_id = on_rank_zero(new_run_id)
        self._newest = folder
        utils.log_rank_zero(log, f"Resumed from step checkpoint {folder}.")
        if self._after is None:
            return
        steps = reversed(step_checkpoints_in(self._out, self._run_id))
        if later := [p.name for p in steps if step_of(p) > self._after]:
            warn(
                f"Resuming from {folder.name} starts a branch: the later step "
                f"checkpoints ({', '.join(later)}) stay until this run's save of their "
                "step, or of a later one, is whole."
            )

    def _check_holds(self, folder: Path) -> None:
        """Refuse a step checkpoint that lacks an entry of the run's states, or whose
        model is not this one, naming what differs (before DCP would fail on the
        first missing key)."""
        saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        names = {key.split(".")[0] for key in saved}
        if missing := sorted(set(self._states) - names):
            raise CheckpointError(
                f"{folder} holds no state for {missing} (it holds {sorted(names)}): it "
                "was saved by a run that did not pass them to load(). Resume with the "
                "recipe that saved it, or resume_from_checkpoint=False."
            )
        prefix = f"{MODEL_KEY}."
        held = {k.removeprefix(prefix) for k in saved if k.startswith(prefix)}
        expected = set(self._states[MODEL_KEY].state_dict())
        missing, unexpected = sorted(expected - held), sorted(held - expected)
        if missing or unexpected:
            raise CheckpointError(
                f"{folder} does not match this model: missing trainable entries "
                f"{missing[:5]}, unexpected entries {unexpected[:5]}. Resume with the "
                "model that saved it."
            )

    def _restore_legacy(self) -> dict[str, Any]:
        """Load a torchtune 0.6.1 epoch checkpoint: its recipe state, read by the
        checkpointer, or the newest ``dist_epoch_{N}`` of DCP; return its progress.
        It holds no LR scheduler state: a scheduler among the run's states is put
        where 0.6.1 built it on resume, at the checkpoint's step."""

        # The run the folder names, or a new name for a 0.6.1 run it never had.
        self._run_id = on_rank_zero(
            lambda: read_run_file(self._out) or f"0.6.1-{os.urandom(4).hex()}"
        )
        models, optimizer = list(self._models.values()), self._optimizer
        if self._epoch_checkpoint == "dcp":
            (model,) = models
            dsd._init_optim_state(optimizer)  # DCP loads into existing tensors
            state = {MODEL_KEY: model.state_dict(), EPOCHS_KEY: 0}
            state[OPT_KEY] = optimizer.state_dict()
            export, group = self._export_dir, self._async_group
            reader = DistributedCheckpointer(export, export, process_group=group)
            state = reader.load_checkpoint(state)
            weights, optim = state[MODEL_KEY], state[OPT_KEY]
            dsd.set_state_dict(
                model, optimizer, model_state_dict=weights, optim_state_dict=optim
            )
        else:
            state, optim = self._epoch_recipe_state, self._epoch_recipe_state[OPT_KEY]
            if legacy_format.is_legacy_in_bwd_state_dict(optim):
                # Several models (PPO): 0.6.1 saved the last one's parameters only.
                pairs = [(m, n, p) for m in models for n, p in m.named_parameters()]
                names = [(n if m is models[-1] else None, p) for m, n, p in pairs]
                convert = legacy_format.convert_legacy_optim_in_bwd_state_dict
                optim = convert(optim, None if in_process_group() else names)
            if in_process_group():
                load_from_full_optimizer_state_dict(
                    models[0], optimizer, optim, self.options.device
                )
            elif any(isinstance(k, str) for k in optim["state"]):  # keyed by name
                dsd.set_optimizer_state_dict(models[0], optimizer, optim)
            else:
                optimizer.load_state_dict(optim)
        steps = state[EPOCHS_KEY] * self._steps_per_epoch
        for scheduler in self._states.values():
            if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
                # As if built with last_epoch=steps - 1, from the loaded initial_lr.
                groups = zip(optimizer.param_groups, scheduler.base_lrs, strict=True)
                scheduler.base_lrs = [g.setdefault("initial_lr", b) for g, b in groups]
                scheduler.last_epoch = steps - 1
                with warnings.catch_warnings():  # "step() before optimizer.step()"
                    warnings.simplefilter("ignore", UserWarning)
                    scheduler.step()
        return {**state, "global_step": steps}

    @property
    def newest_checkpoint(self) -> Path | None:
        """The newest whole step checkpoint of this run (the one it resumed from, or
        its newest save), or ``None`` before there is one: what a run that must stop
        can resume from (:func:`~torchtune.training.stop_if_not_finite` names it)."""
        return self._newest

    # -- saving --------------------------------------------------------------------------

    def save(self, *, epoch_end: bool = False) -> None:
        """Save after an optimizer step: a step checkpoint if one is due
        (``save_every_n_steps``); with ``epoch_end``, always, and the epoch export.
        An epoch's last step is saved by its ``epoch_end`` call. Call it on every rank.

        Args:
            epoch_end (bool): the epoch just ended (``progress.epochs_run`` counts it).
                Default: ``False``
        """
        self._expect("save()", "loaded")
        step, n = self._progress.global_step, self.options.every_n_steps
        partial = self._out / f".step_{step}.partial"
        if not epoch_end:
            if n is not None and step % n == 0 and step % self._steps_per_epoch != 0:
                with _writing("step checkpoint", partial):
                    self._write_step(mid_epoch=True)
            return
        done = self._progress.epochs_run >= self._progress.total_epochs
        with _writing("step checkpoint", partial):
            self._write_step(mid_epoch=False, wait=done)
        epoch = self._progress.epochs_run - 1
        with _writing(
            "epoch export", *(r / f"epoch_{epoch}" for r in self._export_roots)
        ):
            self._export(epoch, final=done)
        if done:
            on_rank_zero(lambda: self._finish_run(epoch))
            self._end()

    def _finish_run(self, epoch: int) -> None:
        """Once the final export is whole, delete the run's step checkpoints, as
        torchtune 0.6.1 leaves no resumable state after the final epoch, unless
        ``keep_last_n_checkpoints`` asks to keep them (to train further later)."""
        final, n = self._export_dir / f"epoch_{epoch}", self.options.keep_last_n
        step, (key, value) = self._progress.global_step, self.options.length
        own = step_checkpoints_in(self._out, self._run_id)
        # Superseded by the final export: a timeline this run branched from.
        delete_paths([p for p in own if step_of(p) > step])
        steps = [p for p in own if step_of(p) <= step]
        if n is not None:
            kept = (
                f"Its resumable state is kept (checkpointer.keep_last_n_checkpoints={n}:"
                f" {', '.join(p.name for p in steps)}, {size_of(steps)}); to train "
                f"further: resume_from_checkpoint=True, {key} > {value}."
            )
        else:
            kept = (
                f"Its step checkpoints ({size_of(steps)}) are deleted: to keep them, for "
                "training further later, set checkpointer.keep_last_n_checkpoints."
            )
            delete_paths(steps)
        write_run_file(self._out, self._run_id, head=step, final_export=str(final))
        log.info(
            f"Training done (run {self._run_id}, {self._progress.epochs_run} epochs). "
            f"Final weights in {final} (every file checksummed). {kept}"
        )

    def _write_step(self, *, mid_epoch: bool, wait: bool = False) -> None:
        """Write ``.step_{N}.partial/``; :meth:`_finish_pending` publishes it, now or
        (an asynchronous save) at the next save or :meth:`close`."""
        self._finish_pending()
        step = self._progress.global_step
        partial = self._out / f".step_{step}.partial"
        if process_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
        barrier()
        self._states[DATALOADER_KEY].epoch_end = not mid_epoch
        states, future = dict(self._states), None
        if self.options.async_save and in_process_group() and not wait:
            group = self._async_group
            future = dcp.async_save(states, checkpoint_id=partial, process_group=group)
        else:
            with _one_process_dcp():
                dcp.save(states, checkpoint_id=partial, no_dist=not in_process_group())
        if process_rank() == 0:
            recipe_state = {**self._progress.state_dict(), "epoch_end": not mid_epoch}
            recipe_state |= {"run_id": self._run_id, "after": self._after}
            recipe_state["optimizer_component"] = self.options.optimizer_component
            recipe_state["trajectory"] = self._trajectory
            # Each group's hyperparameters: DCP loads only what a new optimizer has.
            hyperparameters = _hyperparameters(self._optimizer)
            recipe_state["optimizer_param_group_hyperparameters"] = hyperparameters
            save_synced(recipe_state, partial / RECIPE_STATE)
        self._pending = (future, partial, step)
        if future is None:
            self._finish_pending()

    def _finish_pending(self) -> None:
        """Complete the last step checkpoint: checksums, manifest, rename, prune."""
        if self._pending is None:
            return
        (future, partial, step), self._pending = self._pending, None
        if future is not None:
            with _writing("step checkpoint", partial):
                future.result()
        barrier()
        write_manifest(partial, partial / MANIFEST, run_id=self._run_id, step=step)
        keep = self.options.keep_last_n or (None if self.options.every_n_steps else 1)

        def publish() -> None:
            pruned = publish_step(
                partial, step=step, run_id=self._run_id, after=self._after, keep=keep
            )
            if self.options.keep_last_n is not None:
                for old in pruned:
                    log.info(f"Deleted {old} (keep_last_n_checkpoints={keep})")
            log.info(f"Step checkpoint saved to {self._out / f'step_{step}'}")

        on_rank_zero(publish)
        self._after = step
        self._newest = self._out / f"step_{step}"

    def _export(self, epoch: int, *, final: bool) -> None:
        """Write ``epoch_{epoch}`` through each model's checkpointer, then its
        manifest (see :mod:`._export`)."""
        adapter_only = self.options.adapter_only and self.adapter_config is not None
        for name, model in self._models.items():
            state = export_state(
                model,
                device=self.options.device,
                adapter_config=self.adapter_config,
                adapter_only=adapter_only,
            )
            if state is not None:  # rank 0
                save_export(
                    self._exporters[name],
                    state,
                    epoch=epoch,
                    adapter_only=adapter_only,
                    final=final,
                )
        barrier()
        for root in self._export_roots:
            folder = root / f"epoch_{epoch}"
            write_manifest(
                folder,
                export_manifest(folder),
                run_id=self._run_id,
                step=self._progress.global_step,
            )
            if not final:  # the checkpointer speaks of its final save only
                message = f"Epoch {epoch}'s weights exported to {folder} ({size_of([folder])})"
                utils.log_rank_zero(log, message)

    def _end(self) -> None:
        """The run ended: release ``output_dir``; only :meth:`close` may follow."""
        self._release_output_dir()
        self._stage = "ended"

    def close(self) -> None:
        """Complete a step checkpoint still being written in the background and
        release ``output_dir``; call it on every rank before the process group ends."""
        self._finish_pending()
        self._end()
        barrier()  # a next run in these processes finds the lock released


__all__ = [
    "NOT_COMPARED_ON_RESUME",
    "CheckpointManager",
    "CheckpointOptions",
    "TrainingProgress",
]
