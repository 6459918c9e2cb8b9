"""Saving and resuming recipe checkpoints: the configured checkpointer for synchronous
saves, torch distributed checkpointing (DCP) for asynchronous ones.

The optimizer is just a ``torch.optim.Optimizer``: a plain one or
:class:`torchtune.training.OptimizerInBackward`, whose state dict has the same format,
so neither path needs to know which."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_optimizer_state_dict,
    set_state_dict,
)

from torchtune import config, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.training.checkpointing._checkpointer import DistributedCheckpointer
from torchtune.training.checkpointing._step_checkpointer import StepCheckpointer

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


class CheckpointClient:
    """Saves and loads a recipe's checkpoints.

    Synchronous saves go through the checkpointer configured under ``cfg.checkpointer``
    (full, unsharded weights and optimizer state gathered on rank 0). With
    ``enable_async_checkpointing: True``, intermediate checkpoints are instead written
    asynchronously by torch distributed checkpointing (sharded, one folder per epoch
    under the checkpointer's output directory) and resumed with
    :meth:`load_distributed_checkpoint`; the last checkpoint of a run is always
    synchronous.

    Works in one process and in a ``torch.distributed`` run (NCCL or gloo; on CPU with
    gloo too). The optimizer can be any ``torch.optim.Optimizer``, including
    :class:`torchtune.training.OptimizerInBackward`.

    Args:
        cfg (DictConfig): the recipe config. Reads ``checkpointer``, ``device``,
            ``resume_from_checkpoint`` (default ``False``) and
            ``enable_async_checkpointing`` (default ``False``).

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
        _, self._rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self._rank == 0

    @staticmethod
    def _is_distributed() -> bool:
        return dist.is_available() and dist.is_initialized()

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

    def _save_checkpoint_async(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        training_progress: TrainingProgress,
        epoch: int,
    ) -> None:
        """Start writing an intermediate checkpoint with DCP and return once the state
        has been copied to CPU. Every rank writes its own shards: model weights,
        optimizer state (``optimizer.state_dict()``) and training progress."""
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

    def _save_checkpoint_sync(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        training_progress: TrainingProgress,
        epoch: int,
    ) -> None:
        """Write a checkpoint with the configured checkpointer and wait for it.

        Intermediate checkpoints also hold the optimizer state and training progress.
        Unless the configured checkpointer is itself a :class:`DistributedCheckpointer`
        (which writes shards from every rank), weights and optimizer state are
        gathered in full on CPU on rank 0, which writes them. The optimizer state is
        keyed by parameter name, the format of
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` with
        ``full_state_dict=True``: load it with
        ``training.load_from_full_optimizer_state_dict`` (distributed) or
        ``set_optimizer_state_dict`` (one process).
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
                model, self._is_rank_zero, device=self._device
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
                optimizer_state = get_optimizer_state_dict(
                    model,
                    optimizer,
                    options=StateDictOptions(full_state_dict=True, cpu_offload=True),
                )

        checkpoint: dict[str, Any] = {training.MODEL_KEY: model_state}
        if intermediate:
            checkpoint[training.OPT_KEY] = optimizer_state
            checkpoint.update(training_progress.state_dict())
        if sharded:
            # Every rank writes its own shards.
            checkpointer.save_checkpoint(checkpoint, epoch=epoch)
        elif self._is_rank_zero:
            checkpointer.save_checkpoint(
                checkpoint, epoch=epoch, intermediate_checkpoint=intermediate
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
        if intermediate and self._enable_async_checkpointing:
            self._save_checkpoint_async(model, optimizer, training_progress, epoch)
        else:
            self._save_checkpoint_sync(model, optimizer, training_progress, epoch)

    def load_base_checkpoint(self, resume_from_epoch: bool = True) -> dict[str, Any]:
        """Load the checkpoint the configured checkpointer points at.

        Args:
            resume_from_epoch (bool): when resuming, whether the recipe state comes
                from an epoch checkpoint (``False``: from a step checkpoint, which the
                recipe loads itself; the base weights are then read as for a new
                run). Must be decided before the first call. Default: ``True``

        Returns:
            dict[str, Any]: the checkpointer's output: model weights under
            ``training.MODEL_KEY`` and, when resuming synchronously saved runs,
            optimizer state and training progress.
        """
        self._resume_from_epoch = self._resume_from_checkpoint and resume_from_epoch
        return self._get_checkpointer().load_checkpoint()

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


__all__ = ["CheckpointClient", "TrainingProgress"]
