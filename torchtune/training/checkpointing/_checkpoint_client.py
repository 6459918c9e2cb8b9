"""The one object a recipe saves and resumes through: :class:`CheckpointClient`.

It owns every checkpoint a run writes: epoch checkpoints through the configured
checkpointer (or asynchronously through torch distributed checkpointing), and step
checkpoints (``save_every_n_steps``, see
:mod:`~torchtune.training.checkpointing._step_checkpointer`). It picks the point a
resumed run continues from, reads torchtune 0.6.1's in-backward optimizer format,
and carries the dataloader and RNG state of a mid-epoch resume. The loop only tells
it that a step or an epoch ended; whether a save is due is the client's business.

The optimizer is just a ``torch.optim.Optimizer``: a plain one or
:class:`torchtune.training.OptimizerInBackward`, whose state dict has the same format,
so no path needs to know which."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from torchtune import config, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.training.checkpointing._checkpointer import DistributedCheckpointer
from torchtune.training.checkpointing._step_checkpointer import (
    OPTIMIZER_COMPONENT,
    RECIPE_STATE,
    CheckpointError,
    StepCheckpointer,
    new_run_id,
    read_run_file,
    restore_rng_state,
    run_id_of,
    set_aside_previous_run,
    write_run_file,
)
from torchtune.training.optim_in_bwd_legacy_state_dict import (
    convert_legacy_optim_in_bwd_state_dict,
    is_legacy_in_bwd_state_dict,
)

log = utils.get_logger("DEBUG")


@dataclass
class TrainingProgress:
    """Where training stands, saved with intermediate checkpoints so a run can resume.

    Args:
        seed (int): the run's seed.
        epochs_run (int): epochs completed.
        total_epochs (int): epochs the run was configured for.
        max_steps_per_epoch (int): step limit per epoch.
        dataloader_state_dict (dict[str, Any] | None): the dataloader's state, if it
            has one. Default: ``None``
    """

    seed: int
    epochs_run: int
    total_epochs: int
    max_steps_per_epoch: int
    dataloader_state_dict: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, cfg: DictConfig) -> TrainingProgress:
        """A new run's progress: none yet, the config's ``epochs`` and
        ``max_steps_per_epoch``, and its ``seed``, set for this process with
        :func:`~torchtune.training.set_seed` (``cudnn_deterministic_mode`` too); in a
        distributed run every rank agrees on it, a null seed drawing one.

        Args:
            cfg (DictConfig): the recipe config.

        Returns:
            TrainingProgress: the progress at the start of training.
        """
        return cls(
            seed=training.set_seed(
                seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None)
            ),
            epochs_run=0,
            total_epochs=cfg.epochs,
            max_steps_per_epoch=cfg.get("max_steps_per_epoch", None),
        )

    @classmethod
    def from_checkpoint(
        cls,
        ckpt_dict: dict[str, Any],
        *,
        seed: int | None,
        total_epochs: int,
        max_steps_per_epoch: int | None,
    ) -> TrainingProgress:
        """Where a resumed run stands: the checkpoint's progress, reconciled with the
        config's values.

        The seed and the steps per epoch define the data order of the interrupted
        run, so the checkpoint's win, with a warning when the config differs. The
        number of epochs is the config's: a run may be resumed to train longer or
        shorter than first planned.

        Args:
            ckpt_dict (dict[str, Any]): a recipe checkpoint, holding the entries that
                :meth:`state_dict` writes.
            seed (int | None): the config's seed.
            total_epochs (int): the config's number of epochs.
            max_steps_per_epoch (int | None): the config's step limit per epoch.

        Returns:
            TrainingProgress: the progress to resume from.

        Raises:
            KeyError: if ``ckpt_dict`` lacks an entry of the recipe state.

        Example:
            >>> saved = TrainingProgress(
            ...     seed=0, epochs_run=1, total_epochs=2, max_steps_per_epoch=10
            ... ).state_dict()
            >>> progress = TrainingProgress.from_checkpoint(
            ...     saved, seed=0, total_epochs=3, max_steps_per_epoch=10
            ... )
            >>> progress.epochs_run, progress.total_epochs
            (1, 3)
        """
        keys = (
            training.EPOCHS_KEY,
            training.SEED_KEY,
            training.MAX_STEPS_KEY,
            training.TOTAL_EPOCHS_KEY,
        )
        missing = [key for key in keys if key not in ckpt_dict]
        if missing:
            raise KeyError(
                f"The checkpoint lacks the recipe state {missing} needed to resume. Is "
                "checkpointer.recipe_checkpoint the recipe_state.pt of a run of this "
                "recipe?"
            )
        resumed = {}
        for name, key, value in (
            ("seed", training.SEED_KEY, seed),
            ("max_steps_per_epoch", training.MAX_STEPS_KEY, max_steps_per_epoch),
        ):
            resumed[name] = ckpt_dict[key]
            if value != ckpt_dict[key]:
                log.warning(
                    f"{name}={value} in the config differs from the checkpoint's "
                    f"{ckpt_dict[key]}; using the checkpoint's."
                )
        if total_epochs != ckpt_dict[training.TOTAL_EPOCHS_KEY]:
            log.warning(
                f"epochs={total_epochs} in the config differs from the checkpoint's "
                f"{ckpt_dict[training.TOTAL_EPOCHS_KEY]}; using the config's."
            )
        return cls(
            epochs_run=ckpt_dict[training.EPOCHS_KEY],
            total_epochs=total_epochs,
            dataloader_state_dict=ckpt_dict.get(training.DATALOADER_KEY),
            **resumed,
        )

    def state_dict(self) -> dict[str, object]:
        """The progress under torchtune's checkpoint keys.

        Returns:
            dict[str, object]: ``SEED_KEY``, ``EPOCHS_KEY``, ``TOTAL_EPOCHS_KEY``,
            ``MAX_STEPS_KEY`` and ``DATALOADER_KEY`` entries.
        """
        return {
            training.SEED_KEY: self.seed,
            training.EPOCHS_KEY: self.epochs_run,
            training.TOTAL_EPOCHS_KEY: self.total_epochs,
            training.MAX_STEPS_KEY: self.max_steps_per_epoch,
            training.DATALOADER_KEY: self.dataloader_state_dict,
        }


@dataclass
class ResumedState:
    """What a resumed run continues from, as :meth:`CheckpointClient.resume` read it.

    Args:
        recipe_state (dict[str, Any]): the recipe state the run saved (for most
            recipes :meth:`TrainingProgress.state_dict`'s entries).
        global_step (int | None): the optimizer steps taken, when the checkpoint
            knows it (a step checkpoint); ``None`` at an epoch checkpoint, which is
            at an epoch's end.
        dataloader_state (dict[str, Any] | None): the loader's state, to continue
            mid-epoch; ``None`` at an epoch's end.
        rng_state (dict[str, Any] | None): this rank's RNG state, for
            :func:`~torchtune.training.restore_rng_state` when training continues.
    """

    recipe_state: dict[str, Any]
    global_step: int | None = None
    dataloader_state: dict[str, Any] | None = None
    rng_state: dict[str, Any] | None = None


def _trainable_state_dict(model: nn.Module | Mapping[str, nn.Module]) -> Any:
    """The trainable parameters and the buffers of ``model`` (of each model of a
    mapping): frozen parameters are those of the base checkpoint."""
    if isinstance(model, Mapping):
        return {name: _trainable_state_dict(m) for name, m in model.items()}
    return get_model_state_dict(
        model, options=StateDictOptions(ignore_frozen_params=True)
    )


def _load_model_state(
    model: nn.Module | Mapping[str, nn.Module], state_dict: Any, path: Path
) -> None:
    """Load a step checkpoint's model state, which may leave frozen parameters out."""
    if isinstance(model, Mapping):
        for name, m in model.items():
            _load_model_state(m, state_dict[name], path)
        return
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    trainable = set(_trainable_state_dict(model))
    missing = sorted(set(missing) & trainable)
    if missing or unexpected:
        raise CheckpointError(
            f"step checkpoint {path} does not match this model: missing trainable "
            f"entries {missing[:5]}, unexpected entries {sorted(unexpected)[:5]}. "
            "Resume with the model of the run that saved it."
        )


def check_writable(key: str, path: str | Path) -> None:
    """Refuse an output folder this process cannot write: ``path`` itself if it
    exists, else the nearest folder above it that does (where it would be made).

    Args:
        key (str): the config key that set ``path``, for the message.
        path (str | Path): the folder.

    Raises:
        PermissionError: naming ``key``, ``path`` and the folder that cannot be
            written.
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


def _base_paths(cfg_checkpointer: DictConfig) -> list[Path]:
    """What a checkpointer section reads a run's base weights from: its
    ``checkpoint_dir``, and each of its ``checkpoint_files`` and its
    ``adapter_checkpoint`` in it (which may be an earlier run's ``epoch_{N}/...``
    in the run's own output folder)."""
    checkpoint_dir = cfg_checkpointer.get("checkpoint_dir", None)
    if not checkpoint_dir:
        return []
    paths = [Path(checkpoint_dir)]
    files = cfg_checkpointer.get("checkpoint_files", None)
    if isinstance(files, Iterable) and not isinstance(files, str | Mapping):
        paths += [Path(checkpoint_dir) / str(name) for name in files]
    adapter = cfg_checkpointer.get("adapter_checkpoint", None)
    if adapter:
        paths.append(Path(checkpoint_dir) / str(adapter))
    return paths


def _same_component(saved: str, configured: str) -> bool:
    """Whether two ``_component_`` paths name the same class
    (``torch.optim.AdamW`` and ``torch.optim.adamw.AdamW`` do)."""
    if saved == configured:
        return True
    try:
        return _get_component_from_path(saved) is _get_component_from_path(configured)
    except Exception:  # the saved one no longer imports: compare the names
        return False


class CheckpointClient:
    """Saves and resumes a recipe's checkpoints: the one object a recipe asks.

    A recipe builds it in ``__init__`` (bad checkpoint options are refused then,
    before anything is built), reads the weights to start from with
    :meth:`load_base_checkpoint`, builds its model and optimizer, restores the rest of
    a resumed run's state with :meth:`resume`, hands over what it saves with
    :meth:`track`, and from then on only says :meth:`step_done` after every optimizer
    step and :meth:`epoch_done` after every epoch.

    What it writes:

    - at every epoch's end, through the checkpointer configured under
      ``cfg.checkpointer`` (full, unsharded weights; gathered on rank 0 in a
      distributed run): the model weights and, for every epoch but the last, the
      optimizer state and the training progress. With
      ``enable_async_checkpointing: True`` those intermediate checkpoints are
      instead written asynchronously by torch distributed checkpointing (sharded,
      ``dist_epoch_{N}`` under the checkpointer's output directory);
    - with ``save_every_n_steps: N``, a step checkpoint every N optimizer steps and
      at every epoch's end (:class:`StepCheckpointer`: written whole or not at all,
      verified before use), keeping the newest ``checkpointer.keep_last_n_checkpoints``.

    What a resumed run (``resume_from_checkpoint: True``) continues from: the step
    checkpoint named by ``checkpointer.recipe_checkpoint``, or else whichever whole
    checkpoint is furthest along (:meth:`StepCheckpointer.resume_point`); the latest
    asynchronous one with ``enable_async_checkpointing``.

    Works in one process and in a ``torch.distributed`` run (NCCL, or gloo on CPU).
    The optimizer can be any ``torch.optim.Optimizer``, including
    :class:`torchtune.training.OptimizerInBackward`; an optimizer state in torchtune
    0.6.1's in-backward format is converted when it is loaded.

    Args:
        cfg (DictConfig): the recipe config. Reads ``checkpointer`` (and its
            ``keep_last_n_checkpoints`` and ``recipe_checkpoint``), ``device``,
            ``output_dir`` (default: the checkpointer's), ``resume_from_checkpoint``,
            ``enable_async_checkpointing`` and ``save_every_n_steps`` (each default
            ``False`` or ``None``).

    Raises:
        ValueError: if ``save_every_n_steps`` or
            ``checkpointer.keep_last_n_checkpoints`` is not a positive integer or
            null.
        PermissionError: if ``output_dir`` or ``checkpointer.output_dir`` cannot be
            written.

    Example:
        >>> from omegaconf import OmegaConf
        >>> os.makedirs("base", exist_ok=True)
        >>> torch.save(model.state_dict(), "base/model.pt")
        >>> cfg = OmegaConf.create({
        ...     "device": "cpu",
        ...     "checkpointer": {
        ...         "_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
        ...         "checkpoint_dir": "base",
        ...         "checkpoint_files": ["model.pt"],
        ...         "output_dir": "checkpoints",
        ...         "model_type": "LLAMA2",
        ...     },
        ... })
        >>> client = CheckpointClient(cfg)
        >>> model.load_state_dict(client.load_base_checkpoint()[training.MODEL_KEY])
        <All keys matched successfully>
        >>> optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
        >>> progress = TrainingProgress(
        ...     seed=0, epochs_run=1, total_epochs=2, max_steps_per_epoch=10
        ... )
        >>> client.save_checkpoint(model, optimizer, progress, epoch=0)
        >>> sorted(os.listdir("checkpoints/epoch_0"))
        ['model-00001-of-00001.bin']
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._cfg = cfg
        # Built lazily: the configured checkpointer, and DCP for asynchronous saves.
        self._checkpointer = None
        self._dcp_checkpointer: DistributedCheckpointer | None = None
        self._resume_from_checkpoint = cfg.get("resume_from_checkpoint", False)
        # False when the run resumes from a step checkpoint instead of an epoch one.
        self._resume_from_epoch = self._resume_from_checkpoint
        self._enable_async_checkpointing = cfg.get("enable_async_checkpointing", False)
        self._device = utils.get_device(device=cfg.device)
        self._step_checkpointer = StepCheckpointer(
            cfg.get("output_dir", None) or cfg.checkpointer.output_dir,
            every_n_steps=cfg.get("save_every_n_steps", None),
            keep_last_n=cfg.checkpointer.get("keep_last_n_checkpoints", None),
        )
        # Every folder the run writes checkpoints into must be writable: find out
        # now, not after the model is built and an epoch trained.
        output_dir = cfg.get("output_dir", None)
        if output_dir:
            check_writable("output_dir", output_dir)
        checkpointer_output_dir = cfg.checkpointer.get("output_dir", None)
        if checkpointer_output_dir and (
            not output_dir
            or Path(checkpointer_output_dir).absolute() != Path(output_dir).absolute()
        ):
            check_writable("checkpointer.output_dir", checkpointer_output_dir)
        if (
            self._step_checkpointer.keep_last_n is not None
            and self._step_checkpointer.every_n_steps is None
        ):
            utils.log_rank_zero(
                log,
                "checkpointer.keep_last_n_checkpoints="
                f"{self._step_checkpointer.keep_last_n} has no effect without "
                "save_every_n_steps: it keeps the newest step checkpoints, and this "
                "run saves none (epoch checkpoints are always kept). Set "
                "save_every_n_steps to save some, or remove keep_last_n_checkpoints.",
                level=logging.WARNING,
            )
        # Recorded with the optimizer state, so that a resume with another
        # optimizer class is refused before anything is built.
        cfg_optimizer = cfg.get("optimizer", None)
        self._optimizer_component: str | None = (
            cfg_optimizer.get("_component_", None) if cfg_optimizer else None
        )
        # This run's id (see StepCheckpointer): made or read when it starts.
        self.run_id: str | None = None
        if self._resume_from_checkpoint:
            self._refuse_what_cannot_resume()
        # The step checkpoint a resumed run continues from, once chosen, and what
        # resume() read.
        self._step_checkpoint: Path | None = None
        self._resumed: ResumedState | None = None
        # From global_step(): tells the last step of an epoch in step_done().
        self._steps_per_epoch: int | None = None
        # What the run saves, from track().
        self._model: nn.Module | Mapping[str, nn.Module] | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._dataloader: Any = None
        self._adapter_only = False
        self._epoch_model_state: Callable[[dict[str, Any]], dict[str, Any]] | None = (
            None
        )
        self._save_epoch: Callable[[int], None] | None = None

    @staticmethod
    def _is_distributed() -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def _is_rank_zero(self) -> bool:
        # Asked when needed: recipes build the client before the process group, when
        # every process would still call itself rank 0.
        return utils.get_world_size_and_rank()[1] == 0

    @property
    def resuming(self) -> bool:
        """Whether this run resumes from a checkpoint (``resume_from_checkpoint``)."""
        return bool(self._resume_from_checkpoint)

    @property
    def checkpointer(self):
        """The checkpointer configured under ``cfg.checkpointer``, as
        :meth:`load_base_checkpoint` used it: a recipe whose ``save_epoch`` (see
        :meth:`track`) writes its epoch checkpoints itself saves through it."""
        return self._get_checkpointer()

    def _get_checkpointer(self):
        """The checkpointer configured under ``cfg.checkpointer``."""
        if self._checkpointer is None:
            # With asynchronous checkpointing the recipe state comes from the DCP
            # checkpoint, not from the configured checkpointer's files; from a step
            # checkpoint, it comes from there. keep_last_n_checkpoints is the step
            # checkpoints' option, which 0.6.1's checkpointers do not take.
            cfg_checkpointer = StepCheckpointer.checkpointer_config(
                self._cfg.checkpointer
            )
            # DistributedCheckpointer reads no recipe state file, so takes no such
            # option: pass it only to checkpointers that do.
            component = _get_component_from_path(cfg_checkpointer._component_)
            extra = {}
            if "should_load_recipe_state" in inspect.signature(component).parameters:
                extra["should_load_recipe_state"] = (
                    self._resume_from_epoch and not self._enable_async_checkpointing
                )
            self._checkpointer = config.instantiate(cfg_checkpointer, **extra)
        return self._checkpointer

    def _get_dcp_checkpointer(self) -> DistributedCheckpointer:
        """DCP checkpointer for asynchronous saves, in the configured directories.

        In a distributed run it gets its own gloo process group: an asynchronous save
        runs collectives from a background thread, which must not interleave with the
        training loop's collectives on the default group. Building it is collective, so
        this is only called from methods that every rank calls.
        """
        if self._dcp_checkpointer is None:
            checkpointer = self._get_checkpointer()
            process_group = (
                dist.new_group(backend="gloo") if self._is_distributed() else None
            )
            self._dcp_checkpointer = DistributedCheckpointer(
                checkpoint_dir=checkpointer._checkpoint_dir,
                output_dir=checkpointer._output_dir,
                process_group=process_group,
            )
        return self._dcp_checkpointer

    def wait_for_async_save(self) -> None:
        """Block until the last asynchronous save, if any, is written.

        Raises:
            Exception: whatever the save raised, if it failed.
        """
        dcp_checkpointer = self._dcp_checkpointer
        future = (
            None if dcp_checkpointer is None else dcp_checkpointer._checkpoint_future
        )
        if future is not None:
            future.result()

    def _save_checkpoint_sync(
        self,
        epoch: int,
        training_progress: TrainingProgress,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """Write a checkpoint with the configured checkpointer and wait for it.

        Intermediate checkpoints also hold the optimizer state and training progress.
        Unless the configured checkpointer is itself a :class:`DistributedCheckpointer`
        (which writes shards from every rank), weights and optimizer state are
        gathered in full on CPU on rank 0, which writes them. The optimizer state is
        keyed by parameter name in a distributed run (the format of
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` with
        ``full_state_dict=True``) and by index in one process (``optimizer.state_dict()``);
        :meth:`resume` loads either.
        """
        start = time.perf_counter()
        intermediate = epoch + 1 < training_progress.total_epochs
        checkpointer = self._get_checkpointer()
        sharded = isinstance(checkpointer, DistributedCheckpointer)
        distributed = self._is_distributed()
        utils.log_rank_zero(log, "Saving checkpoint. Gathering the model state dict...")

        if sharded:
            model_state = model.state_dict()
        elif distributed:
            model_state = training.gather_cpu_state_dict(
                model,
                self._is_rank_zero,
                device=self._device,
                adapter_weights_only=self._adapter_only,
            )
        else:
            model_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}

        optimizer_state = None
        if intermediate:
            utils.log_rank_zero(log, "Gathering the optimizer state dict...")
            if sharded:
                optimizer_state = optimizer.state_dict()
            elif distributed:
                optimizer_state = training.get_full_optimizer_state_dict(
                    model, optimizer, self._is_rank_zero, device=self._device
                )
            else:
                # The torch.optim format, keyed by parameter index, as single-device
                # runs (0.6.1's included) have always saved it.
                optimizer_state = optimizer.state_dict()

        checkpoint: dict[str, Any] = (
            {training.MODEL_KEY: model_state}
            if self._epoch_model_state is None or not self._is_rank_zero
            else self._epoch_model_state(model_state)
        )
        if intermediate:
            checkpoint[training.OPT_KEY] = optimizer_state
            checkpoint.update(training_progress.state_dict())
            # Which optimizer class the state belongs to: a resume with another one
            # is refused before anything is built.
            checkpoint[OPTIMIZER_COMPONENT] = self._optimizer_component
        if sharded:
            # Every rank writes its own shards.
            checkpointer.save_checkpoint(checkpoint, epoch=epoch)
        elif self._is_rank_zero:
            extra = {"adapter_only": True} if self._adapter_only else {}
            checkpointer.save_checkpoint(
                checkpoint, epoch=epoch, intermediate_checkpoint=intermediate, **extra
            )
        if distributed and not sharded:
            # Other ranks wait for rank 0's write before training goes on.
            dist.barrier()
        utils.log_rank_zero(
            log, f"Saving checkpoint took {time.perf_counter() - start:.2f} s"
        )

    def save_checkpoint(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        training_progress: TrainingProgress,
        epoch: int,
    ) -> None:
        """Save a checkpoint at the end of ``epoch``. Call it on every rank.

        If this is not the last epoch (an intermediate checkpoint), the checkpoint holds
        the model weights, the optimizer state and the training progress, and it is
        written asynchronously by DCP when ``enable_async_checkpointing`` is set.
        Otherwise it holds only the model weights and is written synchronously by the
        configured checkpointer.

        Args:
            model (torch.nn.Module): the model, sharded (FSDP2) or not.
            optimizer (torch.optim.Optimizer): its optimizer, plain or
                :class:`torchtune.training.OptimizerInBackward`.
            training_progress (TrainingProgress): where training stands.
            epoch (int): the epoch just finished, counted from 0.
        """
        intermediate = epoch + 1 < training_progress.total_epochs
        if not (intermediate and self._enable_async_checkpointing):
            self._save_checkpoint_sync(epoch, training_progress, model, optimizer)
            return
        # Asynchronous: returns once the state is copied to CPU; every rank writes
        # its own shards.
        start = time.perf_counter()
        utils.log_rank_zero(log, "Saving checkpoint asynchronously...")
        checkpoint = {
            **training_progress.state_dict(),
            training.MODEL_KEY: model.state_dict(),
            training.OPT_KEY: optimizer.state_dict(),
        }
        self._get_dcp_checkpointer().save_checkpoint(
            checkpoint, epoch=epoch, save_async=True
        )
        utils.log_rank_zero(
            log,
            f"Training was blocked {time.perf_counter() - start:.2f} s by the "
            "asynchronous checkpoint save",
        )

    def load_base_checkpoint(
        self, resume_from_epoch: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint the configured checkpointer points at.

        When resuming, this first chooses what the run resumes from. From an epoch
        checkpoint written synchronously, the result also holds its optimizer state
        and training progress; from a step checkpoint or an asynchronous one, the
        base weights are read as for a new run, and :meth:`resume` loads the rest
        into the built model and optimizer.

        Args:
            resume_from_epoch (bool | None): when resuming, whether the recipe state
                comes from an epoch checkpoint; ``None`` (the default) chooses, as
                the class docstring says.

        Returns:
            dict[str, Any]: the checkpointer's output: model weights under
            ``training.MODEL_KEY`` (and ``training.ADAPTER_KEY`` where the
            checkpointer reads an adapter) and, when resuming from a synchronous
            epoch checkpoint, optimizer state and training progress.

        A new run first moves an earlier run's checkpoints out of its output
        folders (:func:`~torchtune.training.checkpointing._step_checkpointer.set_aside_previous_run`)
        and records its run id; a resumed run continues the run its output folder
        holds, and only considers that run's step checkpoints.

        Raises:
            CheckpointError: if the step checkpoint named by
                ``checkpointer.recipe_checkpoint`` does not exist, is incomplete or
                is damaged, or a resumed run finds nothing to resume from.
            ValueError: if the checkpoint resumed from holds the state of another
                optimizer class than ``optimizer._component_``.
        """
        if resume_from_epoch is None:
            if self._resume_from_checkpoint:
                self._continue_run()
            else:
                self._start_run()
            resume_from_epoch = self._step_checkpoint is None
        self._resume_from_epoch = self._resume_from_checkpoint and resume_from_epoch
        loaded = self._get_checkpointer().load_checkpoint()
        if self._resume_from_epoch and not self._enable_async_checkpointing:
            self._check_resumable(loaded, "the epoch checkpoint's recipe state")
        return loaded

    # -- which run, and which checkpoint of it -----------------------------------------

    def _epoch_output_dir(self) -> Path:
        return Path(
            self._cfg.checkpointer.get("output_dir", None)
            or self._step_checkpointer.output_dir
        )

    def _sync(self) -> None:
        if self._is_distributed():
            dist.barrier()

    def _start_run(self) -> None:
        """A new run: an earlier run's checkpoints are moved aside (never deleted,
        never resumed from by this run), and this run's id is recorded."""
        if self.run_id is not None:  # a recipe loading several base checkpoints
            return
        out = self._step_checkpointer.output_dir
        if self._is_rank_zero:
            # The base checkpoints this run starts from stay where they are, even
            # when they are an earlier run's epoch_{N} in the same folder.
            # Every checkpointer's (PPO has several) output folder is this run's.
            sections = [
                section
                for key, section in self._cfg.items()
                if str(key).endswith("checkpointer") and isinstance(section, DictConfig)
            ]
            keep = [path for section in sections for path in _base_paths(section)]
            folders = [out, self._epoch_output_dir()] + [
                section.output_dir
                for section in sections
                if section.get("output_dir", None)
            ]
            set_aside_previous_run(folders, keep=keep)
            write_run_file(out, new_run_id())
        self._sync()
        self.run_id = read_run_file(out)
        self._step_checkpointer.run_id = self.run_id
        utils.log_rank_zero(log, f"New run {self.run_id}: checkpoints go to {out}.")

    def _continue_run(self) -> None:
        """A resumed run: choose its checkpoint, among those of the run its output
        folder holds, and refuse what cannot be resumed before anything is built."""
        out = self._step_checkpointer.output_dir
        recipe_checkpoint = self._cfg.checkpointer.get("recipe_checkpoint", None)
        recorded = read_run_file(out)
        self._step_checkpoint = self._step_checkpointer.resume_point(
            recipe_checkpoint, recorded
        )
        saved = (
            None if self._step_checkpoint is None else run_id_of(self._step_checkpoint)
        )
        # A checkpoint written before run ids existed continues the recorded run,
        # or a new id (the folder had none).
        run_id = saved or recorded or new_run_id()
        if run_id != recorded:
            if self._is_rank_zero:
                write_run_file(out, run_id)
            self._sync()
            run_id = read_run_file(out)
        self.run_id = run_id
        self._step_checkpointer.run_id = run_id
        if self._step_checkpoint is not None:
            recipe_state = torch.load(
                self._step_checkpoint / RECIPE_STATE, weights_only=False
            )
            self._check_resumable(recipe_state, str(self._step_checkpoint))
            return
        self._epoch_state_or_refuse(recipe_checkpoint)

    def _refuse_what_cannot_resume(self) -> None:
        """What a resume can be told at once, from the names of the files alone (no
        process group yet, nothing built): a named checkpoint that does not exist,
        an output folder with nothing to resume from, and a step checkpoint of
        another optimizer class. :meth:`load_base_checkpoint` verifies the
        checkpoint it then chooses, every byte."""
        out = self._step_checkpointer.output_dir
        recipe_checkpoint = self._cfg.checkpointer.get("recipe_checkpoint", None)
        if recipe_checkpoint:
            named = self._step_checkpointer.named_step_checkpoint(recipe_checkpoint)
            candidates = [] if named is None else [named]
        else:
            candidates = self._step_checkpointer.candidates(read_run_file(out))
        if not candidates:
            self._epoch_state_or_refuse(recipe_checkpoint)
        for candidate in candidates[:1]:
            try:
                recipe_state = torch.load(
                    candidate / RECIPE_STATE, weights_only=False, mmap=True
                )
            except Exception:  # damaged: choosing the checkpoint names the file
                continue
            self._check_resumable(recipe_state, str(candidate), log_finished=False)

    def _epoch_state_or_refuse(self, recipe_checkpoint: str | None) -> None:
        """Refuse a resume without an epoch checkpoint to resume from (no step
        checkpoint was found)."""
        if self._enable_async_checkpointing:
            found = [
                p
                for p in self._epoch_output_dir().glob("dist_epoch_*")
                if (p / ".metadata").is_file()
            ]
            if not found:
                raise self._nothing_to_resume(
                    "no whole asynchronous epoch checkpoint (dist_epoch_N/ with its "
                    f".metadata) in {self._epoch_output_dir()}"
                )
            return
        epoch_state = self._epoch_output_dir() / (
            recipe_checkpoint or Path("recipe_state") / "recipe_state.pt"
        )
        if not epoch_state.is_file():
            if recipe_checkpoint:
                raise CheckpointError(
                    f"checkpointer.recipe_checkpoint={recipe_checkpoint} names "
                    f"{epoch_state}, which does not exist. Name the recipe_state.pt "
                    "of the run to continue (relative to checkpointer.output_dir), "
                    "or leave it unset to resume from the newest checkpoint in "
                    "output_dir."
                )
            raise self._nothing_to_resume(f"no epoch checkpoint state ({epoch_state})")

    def _nothing_to_resume(self, epoch_part: str) -> CheckpointError:
        return CheckpointError(
            f"resume_from_checkpoint=True, but there is nothing to resume from: "
            f"no whole step checkpoint (step_N/, saved with save_every_n_steps) in "
            f"output_dir={self._step_checkpointer.output_dir}, and {epoch_part}. Set "
            "resume_from_checkpoint=False to start a new run, or set output_dir to "
            "the folder of the run to continue."
        )

    def _check_resumable(
        self, recipe_state: Mapping[str, Any], where: str, *, log_finished: bool = True
    ) -> None:
        """Refuse a checkpoint of another optimizer class; say so when the run it
        continues has nothing left to do."""
        saved = recipe_state.get(OPTIMIZER_COMPONENT, None)
        configured = self._optimizer_component
        if saved and configured and not _same_component(saved, configured):
            raise ValueError(
                f"optimizer._component_={configured} cannot resume from {where}: "
                f"its optimizer state was saved by {saved}, and another optimizer "
                "class cannot load it. Set optimizer._component_="
                f"{saved} to resume, or resume_from_checkpoint=False to start a new "
                "run."
            )
        epochs_run = recipe_state.get(training.EPOCHS_KEY, None)
        epochs = self._cfg.get("epochs", None)
        if (
            log_finished
            and isinstance(epochs_run, int)
            and isinstance(epochs, int)
            and epochs_run >= epochs
        ):
            utils.log_rank_zero(
                log,
                f"resume_from_checkpoint=True: {where} is at the end of training "
                f"({epochs_run} epochs done, epochs={epochs}): nothing left to do. "
                "To train further, set epochs to more than "
                f"{epochs_run}.",
                level=logging.WARNING,
            )

    def resume(
        self,
        model: nn.Module | Mapping[str, nn.Module],
        optimizer: torch.optim.Optimizer,
        checkpoint_dict: dict[str, Any],
        *,
        legacy_named_params: Iterable[tuple[str | None, torch.Tensor]] | None = None,
    ) -> ResumedState | None:
        """Restore a resumed run's state into ``model`` and ``optimizer``; call it on
        every rank once both are built (``model`` with the weights
        :meth:`load_base_checkpoint` returned).

        From a synchronous epoch checkpoint it loads the optimizer state
        ``checkpoint_dict`` holds; from a step checkpoint the trained weights and the
        optimizer state (sharded in a distributed run); from an asynchronous one,
        both through DCP. An optimizer state in torchtune 0.6.1's in-backward format
        (a per-parameter optimizer state dict per parameter name) is converted first.

        Args:
            model (nn.Module | Mapping[str, nn.Module]): the model; one process may
                train several (PPO's policy and value model), given by name.
            optimizer (torch.optim.Optimizer): its optimizer, plain or in-backward,
                built over every parameter of ``model`` (frozen ones too) in order.
            checkpoint_dict (dict[str, Any]): what :meth:`load_base_checkpoint`
                returned.
            legacy_named_params (Iterable[tuple[str | None, torch.Tensor]] | None):
                for a 0.6.1 in-backward optimizer state in one process, the
                optimizer's parameters with the names 0.6.1 saved them under (None
                for those it did not save); default: ``model.named_parameters()``.

        Returns:
            ResumedState | None: where the run stands, or ``None`` for a new run.

        Raises:
            CheckpointError: if a step checkpoint is damaged, was written by another
                number of processes, or does not match the model.
            ValueError: if a 0.6.1 optimizer state does not match the parameters.
        """
        if not self._resume_from_checkpoint:
            return None
        if self._step_checkpoint is not None:
            path = self._step_checkpoint
            if utils.get_world_size_and_rank()[0] > 1:
                recipe_state, rank_state = self._step_checkpointer.load(
                    path, model, optimizer
                )
            else:
                recipe_state, rank_state, state = self._step_checkpointer.read(path)
                _load_model_state(model, state["model"], path)
                self._load_optimizer_state(
                    model, optimizer, state["optimizer"], legacy_named_params
                )
            utils.log_rank_zero(log, f"Resumed from step checkpoint {path}.")
            self._resumed = ResumedState(
                recipe_state,
                global_step=recipe_state["global_step"],
                dataloader_state=rank_state[training.DATALOADER_KEY],
                rng_state=rank_state["rng"],
            )
        elif self._enable_async_checkpointing:
            loaded = self.load_distributed_checkpoint(model, optimizer)
            self._resumed = ResumedState(loaded)
        else:
            self._load_optimizer_state(
                model,
                optimizer,
                checkpoint_dict[training.OPT_KEY],
                legacy_named_params,
            )
            self._resumed = ResumedState(checkpoint_dict)
        return self._resumed

    def resume_progress(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        checkpoint_dict: dict[str, Any],
        progress: TrainingProgress,
    ) -> TrainingProgress:
        """:meth:`resume`, with the resumed progress reconciled with the config's
        (see :meth:`TrainingProgress.from_checkpoint`). Where the resumed run stands
        within an epoch, :meth:`global_step`, :meth:`track` and
        :meth:`restore_rng_state` take from what :meth:`resume` read.

        Args:
            model (nn.Module): as for :meth:`resume`.
            optimizer (torch.optim.Optimizer): as for :meth:`resume`.
            checkpoint_dict (dict[str, Any]): as for :meth:`resume`.
            progress (TrainingProgress): the config's progress (a new run's).

        Returns:
            TrainingProgress: the progress to continue from (``progress`` itself for
            a new run).
        """
        resumed = self.resume(model, optimizer, checkpoint_dict)
        if resumed is None:
            return progress
        return TrainingProgress.from_checkpoint(
            resumed.recipe_state,
            seed=progress.seed,
            total_epochs=progress.total_epochs,
            max_steps_per_epoch=progress.max_steps_per_epoch,
        )

    def _load_optimizer_state(
        self,
        model: nn.Module | Mapping[str, nn.Module],
        optimizer: torch.optim.Optimizer,
        state_dict: dict[str, Any],
        legacy_named_params: Iterable[tuple[str | None, torch.Tensor]] | None,
    ) -> None:
        """Load a full optimizer state: keyed by index (``optimizer.state_dict()``),
        by parameter name (a distributed run's), or torchtune 0.6.1's in-backward
        format."""
        distributed = self._is_distributed()
        if is_legacy_in_bwd_state_dict(state_dict):
            if distributed:
                state_dict = convert_legacy_optim_in_bwd_state_dict(state_dict)
            else:
                state_dict = convert_legacy_optim_in_bwd_state_dict(
                    state_dict,
                    legacy_named_params
                    if legacy_named_params is not None
                    else model.named_parameters(),
                )
        if distributed:
            training.load_from_full_optimizer_state_dict(
                model, optimizer, state_dict, self._device
            )
        elif any(isinstance(k, str) for k in state_dict["state"]) or any(
            isinstance(p, str) for g in state_dict["param_groups"] for p in g["params"]
        ):
            set_optimizer_state_dict(
                model,
                optimizer,
                state_dict,
                options=StateDictOptions(full_state_dict=True),
            )
        else:
            optimizer.load_state_dict(state_dict)

    def load_distributed_checkpoint(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> dict[str, Any]:
        """Resume from the latest asynchronous (DCP) checkpoint in the output directory.

        Loads the model weights and the optimizer state into ``model`` and
        ``optimizer`` in place. Call it on every rank.

        Args:
            model (torch.nn.Module): the model, sharded (FSDP2) as when it was saved or
                not.
            optimizer (torch.optim.Optimizer): its optimizer, plain or
                :class:`torchtune.training.OptimizerInBackward`; the two are
                interchangeable here.

        Returns:
            dict[str, Any]: the loaded checkpoint: ``training.MODEL_KEY``,
            ``training.OPT_KEY``, and the training progress (``SEED_KEY``,
            ``EPOCHS_KEY``, ``TOTAL_EPOCHS_KEY``, ``MAX_STEPS_KEY``).

        Raises:
            ValueError: if the output directory holds no complete DCP checkpoint.
        """
        start = time.perf_counter()
        # DCP loads into existing tensors, so the optimizer state must exist first.
        # This takes one zero-gradient step with lr=0, as DCP's own APIs do.
        _init_optim_state(optimizer)
        checkpoint: dict[str, Any] = {
            training.MODEL_KEY: model.state_dict(),
            training.OPT_KEY: optimizer.state_dict(),
            training.SEED_KEY: 0,
            training.EPOCHS_KEY: 0,
            training.TOTAL_EPOCHS_KEY: 0,
            training.MAX_STEPS_KEY: 0,
        }
        checkpoint = self._get_dcp_checkpointer().load_checkpoint(checkpoint)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=checkpoint[training.MODEL_KEY],
            optim_state_dict=checkpoint[training.OPT_KEY],
        )
        utils.log_rank_zero(
            log,
            f"Loaded the distributed checkpoint in {time.perf_counter() - start:.2f} s",
        )
        return checkpoint

    # -- saving from the training loop -----------------------------------------------

    def track(
        self,
        model: nn.Module | Mapping[str, nn.Module],
        optimizer: torch.optim.Optimizer,
        dataloader: Any,
        *,
        adapter_only: bool = False,
        epoch_model_state: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        save_epoch: Callable[[int], None] | None = None,
    ) -> None:
        """Hand over what the run's checkpoints hold; call it once, after setup.

        Args:
            model (nn.Module | Mapping[str, nn.Module]): the model (FSDP2-sharded in
                a distributed run), or several by name in one process. Step
                checkpoints hold its trainable parameters and buffers.
            optimizer (torch.optim.Optimizer): its optimizer, plain or in-backward.
            dataloader (Any): the ``StatefulDataLoader``, whose position a mid-epoch
                step checkpoint holds; resuming mid-epoch, it is put back here.
            adapter_only (bool): epoch checkpoints hold only the trainable (adapter)
                weights: the configured checkpointer is told so, and a distributed
                run gathers only those. Default: ``False``
            epoch_model_state (Callable[[dict[str, Any]], dict[str, Any]] | None):
                turns the model's full CPU state dict into the epoch checkpoint's
                entries (a LoRA recipe's adapter, its config and the merged
                weights), on rank 0; default: ``{training.MODEL_KEY: state}``.
            save_epoch (Callable[[int], None] | None): writes the epoch checkpoint of
                an epoch itself, instead of the client (a recipe with several
                checkpointers). Default: ``None``
        """
        self._model, self._optimizer, self._dataloader = model, optimizer, dataloader
        if self._resumed is not None and self._resumed.dataloader_state:
            # Mid-epoch: the loader continues where the saved one was (the sampler
            # keeps its position across set_epoch, which only sets the order).
            dataloader.load_state_dict(self._resumed.dataloader_state)
        self._adapter_only = adapter_only
        self._epoch_model_state = epoch_model_state
        self._save_epoch = save_epoch

    def global_step(self, steps_per_epoch: int) -> int:
        """The optimizer steps a run has taken when training starts: 0 for a new
        run, a step checkpoint's own count, or the epochs an epoch checkpoint
        completed times ``steps_per_epoch``."""
        self._steps_per_epoch = steps_per_epoch
        if self._resumed is None:
            return 0
        if self._resumed.global_step is not None:
            return self._resumed.global_step
        return self._resumed.recipe_state[training.EPOCHS_KEY] * steps_per_epoch

    def restore_rng_state(self) -> None:
        """Put back the RNG state of a run resumed mid-run (from a step checkpoint),
        so that dropout draws what the uninterrupted run drew; a no-op otherwise.
        Call it right before training starts."""
        if self._resumed is not None and self._resumed.rng_state is not None:
            restore_rng_state(self._resumed.rng_state)

    def _save_step(
        self, global_step: int, recipe_state: Mapping[str, Any], *, mid_epoch: bool
    ) -> None:
        # At an epoch's end the next epoch starts with a fresh loader, as it does in
        # the uninterrupted run.
        loader_state = self._dataloader.state_dict() if mid_epoch else None
        self._step_checkpointer.save(
            global_step,
            self._model,
            self._optimizer,
            recipe_state={
                **recipe_state,
                OPTIMIZER_COMPONENT: self._optimizer_component,
            },
            rank_state={training.DATALOADER_KEY: loader_state},
            model_state_dict=(
                None if self._is_distributed() else _trainable_state_dict(self._model)
            ),
        )

    def step_done(
        self,
        global_step: int,
        recipe_state: TrainingProgress | Mapping[str, Any],
        *,
        epoch_end: bool | None = None,
        due_step: int | None = None,
    ) -> None:
        """Say that optimizer step ``global_step`` is done; saves a step checkpoint
        when one is due. Call it on every rank.

        Args:
            global_step (int): the optimizer steps taken so far.
            recipe_state (TrainingProgress | Mapping[str, Any]): where training
                stands (``epochs_run`` counts the epochs completed).
            epoch_end (bool | None): whether this was the epoch's last step, whose
                checkpoint :meth:`epoch_done` writes. Default: whether
                ``global_step`` is a multiple of the ``steps_per_epoch`` given to
                :meth:`global_step` (``False`` if it was not called).
            due_step (int | None): the count ``save_every_n_steps`` counts, for a
                recipe whose steps are not optimizer steps (a PPO step takes
                several); the checkpoint is still named by ``global_step``.
                Default: ``global_step``
        """
        due_step = global_step if due_step is None else due_step
        if epoch_end is None:
            epoch_end = bool(self._steps_per_epoch) and (
                global_step % self._steps_per_epoch == 0
            )
        if epoch_end or not self._step_checkpointer.is_due(due_step):
            return
        if isinstance(recipe_state, TrainingProgress):
            recipe_state = recipe_state.state_dict()
        self._save_step(global_step, recipe_state, mid_epoch=True)

    def epoch_done(
        self,
        epoch: int,
        global_step: int,
        recipe_state: TrainingProgress | Mapping[str, Any],
    ) -> None:
        """Say that ``epoch`` is done; saves its checkpoints. Call it on every rank.

        With step checkpoints on, the step checkpoint comes first: the epoch
        checkpoint's recipe state is written in place, so a crash while it is
        written leaves the step checkpoint to resume from.

        Args:
            epoch (int): the epoch just finished, counted from 0.
            global_step (int): the optimizer steps taken so far.
            recipe_state (TrainingProgress | Mapping[str, Any]): where training
                stands, ``epochs_run`` counting this epoch.
        """
        step_state = (
            recipe_state.state_dict()
            if isinstance(recipe_state, TrainingProgress)
            else recipe_state
        )
        if self._step_checkpointer.every_n_steps is not None:
            self._save_step(global_step, step_state, mid_epoch=False)
        if self._save_epoch is not None:
            self._save_epoch(epoch)
        else:
            # The loader's state is saved for the record only: training resumes at
            # an epoch boundary, where a fresh loader with the epoch's sampler seed
            # is what the uninterrupted run uses too.
            progress = dataclasses.replace(
                recipe_state, dataloader_state_dict=self._dataloader.state_dict()
            )
            self.save_checkpoint(self._model, self._optimizer, progress, epoch=epoch)
        epochs_run = step_state.get(training.EPOCHS_KEY, None)
        total_epochs = step_state.get(training.TOTAL_EPOCHS_KEY, None)
        if (
            epochs_run is not None
            and total_epochs is not None
            and epochs_run >= total_epochs
        ):
            self._log_where_checkpoints_are(epoch, epochs_run)

    def _log_where_checkpoints_are(self, epoch: int, epochs_run: int) -> None:
        steps = (
            f"; step checkpoints (run {self.run_id}) in "
            f"{self._step_checkpointer.output_dir}/step_N"
            if self._step_checkpointer.every_n_steps is not None
            else ""
        )
        utils.log_rank_zero(
            log,
            f"Training done ({epochs_run} epochs). Final weights in "
            f"{self._epoch_output_dir()}/epoch_{epoch}{steps}. To train this run "
            "further, rerun with the same output_dir, resume_from_checkpoint=True and "
            f"epochs greater than {epochs_run}.",
        )

    def close(self) -> None:
        """Wait for an asynchronous save still in flight (it needs the process group,
        so call this before destroying it)."""
        self.wait_for_async_save()


__all__ = ["CheckpointClient", "ResumedState", "TrainingProgress"]
