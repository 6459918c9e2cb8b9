"""Resumable checkpoints every N optimizer steps, written so that a crash at any
moment leaves the previous complete one usable.

A step checkpoint is the folder ``output_dir/step_{global_step}/`` holding everything
a run needs to continue exactly where it was, mid-epoch included:

- the model and optimizer state: ``model_optimizer.pt`` (``torch.save``) on one
  process, or a sharded ``torch.distributed.checkpoint`` folder ``model_optimizer/``
  written by every rank in a distributed run (trainable parameters only: frozen ones
  are those of the base checkpoint, which a resumed run loads first);
- ``recipe_state.pt``: what the recipe hands over (seed, epochs, global step, ...);
- ``rank_{r}.pt`` for each rank: that rank's dataloader state and RNG state;
- ``manifest.json``, written last: the size of every file above.

Everything is written into ``output_dir/.step_{global_step}.partial/`` and renamed to
``step_{global_step}`` only once whole, so a folder named ``step_*`` is never half
written. The manifest is checked again when resuming, so a checkpoint damaged
afterwards (a truncated file) is skipped, with a warning naming it, in favour of the
previous one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtune import utils
from torchtune.training.checkpointing._utils import EPOCHS_KEY

log = utils.get_logger("DEBUG")

STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
RECIPE_STATE = "recipe_state.pt"
MODEL_OPTIMIZER_FILE = "model_optimizer.pt"
MODEL_OPTIMIZER_DCP = "model_optimizer"
_MANIFEST_VERSION = 1
# Recipe-state entry: each optimizer param group's hyperparameters, for sharded runs.
_HYPERPARAMETERS = "optimizer_param_group_hyperparameters"
# A sharded step checkpoint holds the trainable parameters (and buffers): frozen ones
# (a LoRA base, a frozen encoder, NF4 weights) are the base checkpoint's, which every
# resume loads first.
_TRAINABLE = StateDictOptions(ignore_frozen_params=True)


class CheckpointError(ValueError):
    """A step checkpoint that cannot be resumed: missing, incomplete or damaged."""


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX); a no-op elsewhere."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _save_file(obj: Any, path: Path) -> None:
    """``torch.save`` that leaves either the whole file at ``path`` or none: it writes
    a temporary file in the same folder, flushes it to disk, then renames it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _files_under(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def step_of(path: Path) -> int | None:
    """The global step of a ``step_{N}`` folder, ``None`` for any other name."""
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def verify(path: Path) -> None:
    """Check that the step checkpoint ``path`` is whole: its manifest exists and every
    file it lists is there with the size it had when the checkpoint was written.

    Raises:
        CheckpointError: naming the folder or the file that is missing or damaged.
    """
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{path} is not a complete step checkpoint: it has no {MANIFEST}, which "
            "is written last, so the save that made it did not finish."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{manifest_path} is damaged: {e}") from e
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(
                f"{file} is missing from step checkpoint {path} (listed in {MANIFEST})"
            )
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"{file} is damaged: {actual} bytes, but it had {size} when the "
                "checkpoint was written (truncated or overwritten?)"
            )


class StepCheckpointer:
    """Saves and finds the step checkpoints of one run, in ``output_dir``.

    Args:
        output_dir (str | Path): the run's output directory.
        every_n_steps (int | None): save every this many optimizer steps; ``None``
            saves none (epoch checkpoints only, as in torchtune 0.6.1).
        keep_last_n (int | None): once a step checkpoint is complete, delete all but
            the newest ``keep_last_n`` step checkpoints; ``None`` keeps all.
            Epoch checkpoints are never deleted.

    Raises:
        ValueError: if ``every_n_steps`` or ``keep_last_n`` is not a positive integer
            or ``None``.

    Example:
        >>> checkpointer = StepCheckpointer("step_run", every_n_steps=2, keep_last_n=1)
        >>> optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
        >>> for global_step in (1, 2):
        ...     if checkpointer.is_due(global_step):
        ...         path = checkpointer.save(
        ...             global_step, model, optimizer, {"epochs_run": 0}, {}
        ...         )
        >>> checkpointer.find_latest().name
        'step_2'
        >>> recipe_state, rank_state = checkpointer.load(path, model, optimizer)
        >>> recipe_state["global_step"]
        2
    """

    def __init__(
        self,
        output_dir: str | Path,
        every_n_steps: int | None,
        keep_last_n: int | None = None,
    ) -> None:
        for key, value in (
            ("save_every_n_steps", every_n_steps),
            ("checkpointer.keep_last_n_checkpoints", keep_last_n),
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
        self.output_dir = Path(output_dir)
        self.every_n_steps = every_n_steps
        self.keep_last_n = keep_last_n

    @staticmethod
    def checkpointer_config(cfg_checkpointer: Any) -> Any:
        """``cfg_checkpointer`` without ``keep_last_n_checkpoints``, which is this
        class's option, not the model checkpointer's (0.6.1's checkpointers do not
        take it)."""
        cfg_checkpointer = cfg_checkpointer.copy()
        cfg_checkpointer.pop("keep_last_n_checkpoints", None)
        return cfg_checkpointer

    def is_due(self, global_step: int) -> bool:
        """Whether a step checkpoint is due after optimizer step ``global_step``."""
        return self.every_n_steps is not None and global_step % self.every_n_steps == 0

    # -- saving ----------------------------------------------------------------------

    def save(
        self,
        global_step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        recipe_state: dict[str, Any],
        rank_state: dict[str, Any],
        *,
        model_state_dict: dict[str, Any] | None = None,
    ) -> Path:
        """Write the step checkpoint of ``global_step``; call it on every rank.

        Args:
            global_step (int): the optimizer steps taken so far.
            model (nn.Module): the model (FSDP2-sharded in a distributed run).
            optimizer (torch.optim.Optimizer): its optimizer, plain or in-backward.
            recipe_state (dict[str, Any]): what the recipe needs to continue, the
                same on every rank (rank 0's is saved).
            rank_state (dict[str, Any]): what differs per rank, e.g. the dataloader's
                state; this rank's RNG state is added to it.
            model_state_dict (dict[str, Any] | None): on one process, the part of the
                model's state to save, when not all of it (a LoRA recipe saves the
                adapter: the base weights are the checkpoint it started from).
                Default: ``model.state_dict()``.

        Returns:
            Path: the complete checkpoint folder ``output_dir/step_{global_step}``.
        """
        rank, world_size = _rank_and_world()
        final = self.output_dir / f"step_{global_step}"
        partial = self.output_dir / f".step_{global_step}.partial"
        if rank == 0:
            # A crashed save left it, or nothing did: either way it is not a checkpoint.
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()

        if world_size > 1:
            dcp.save(
                {
                    "model": get_model_state_dict(model, options=_TRAINABLE),
                    "optimizer": get_optimizer_state_dict(model, optimizer),
                },
                checkpoint_id=partial / MODEL_OPTIMIZER_DCP,
            )
        else:
            if model_state_dict is None:
                model_state_dict = model.state_dict()
            _save_file(
                {"model": model_state_dict, "optimizer": optimizer.state_dict()},
                partial / MODEL_OPTIMIZER_FILE,
            )
        _save_file({**rank_state, "rng": _rng_state()}, partial / f"rank_{rank}.pt")
        _barrier()

        if rank == 0:
            _save_file(
                {
                    **recipe_state,
                    "global_step": global_step,
                    "world_size": world_size,
                    _HYPERPARAMETERS: [
                        {
                            k: v
                            for k, v in g.items()
                            if k not in ("params", "param_names")
                        }
                        for g in optimizer.param_groups
                    ],
                },
                partial / RECIPE_STATE,
            )
            manifest = {
                "version": _MANIFEST_VERSION,
                "global_step": global_step,
                "world_size": world_size,
                "files": _files_under(partial),
            }
            (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
            _fsync_dir(partial)
            if final.exists():  # a resumed run saving the same step again
                stale = self.output_dir / f".step_{global_step}.stale"
                shutil.rmtree(stale, ignore_errors=True)
                os.replace(final, stale)
                os.replace(partial, final)
                shutil.rmtree(stale, ignore_errors=True)
            else:
                os.replace(partial, final)
            _fsync_dir(self.output_dir)
            self._prune()
            log.info(f"Step checkpoint saved to {final}")
        _barrier()
        return final

    def _prune(self) -> None:
        if self.keep_last_n is None:
            return
        complete = [p for p in self._step_dirs() if (p / MANIFEST).is_file()]
        for old in complete[self.keep_last_n :]:
            shutil.rmtree(old, ignore_errors=True)
            log.info(f"Deleted step checkpoint {old} (keep_last_n_checkpoints)")

    # -- finding and loading ---------------------------------------------------------

    def _step_dirs(self) -> list[Path]:
        """The ``step_{N}`` folders of ``output_dir``, newest first."""
        if not self.output_dir.is_dir():
            return []
        found = [
            p
            for p in self.output_dir.iterdir()
            if p.is_dir() and step_of(p) is not None
        ]
        return sorted(found, key=step_of, reverse=True)

    def find_latest(self) -> Path | None:
        """The newest whole step checkpoint in ``output_dir``, or ``None``.

        A newer one that is incomplete or damaged is skipped with a warning naming it.
        """
        for path in self._step_dirs():
            try:
                verify(path)
            except CheckpointError as e:
                log.warning(f"Skipping step checkpoint {path}: {e}")
                continue
            return path
        return None

    def read_recipe_state(self, path: str | Path) -> dict[str, Any]:
        """The recipe state of the whole step checkpoint ``path``.

        Raises:
            CheckpointError: if it is incomplete or damaged (naming the file), or was
                written by a different number of processes than this run has.
        """
        path = Path(path)
        verify(path)
        recipe_state = torch.load(path / RECIPE_STATE, weights_only=False)
        saved_world_size = recipe_state.get("world_size", 1)
        world_size = _rank_and_world()[1]
        if saved_world_size != world_size:
            raise CheckpointError(
                f"step checkpoint {path} was written by {saved_world_size} processes, "
                f"this run has {world_size}: its dataloader positions are per process. "
                f"Resume with {saved_world_size} processes, or from an epoch checkpoint."
            )
        return recipe_state

    def _rank_state(self, path: Path) -> dict[str, Any]:
        rank = _rank_and_world()[0]
        return torch.load(path / f"rank_{rank}.pt", weights_only=False)

    def read(
        self, path: str | Path
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Read the single-process step checkpoint ``path`` without loading it anywhere.

        Returns:
            tuple: the recipe state, this rank's state (RNG under ``"rng"``), and
            ``{"model": model state dict, "optimizer": optimizer state dict}``.

        Raises:
            CheckpointError: as :meth:`read_recipe_state`.
        """
        path = Path(path)
        recipe_state = self.read_recipe_state(path)
        state = torch.load(path / MODEL_OPTIMIZER_FILE, weights_only=False)
        return recipe_state, self._rank_state(path), state

    def resume_point(self, recipe_checkpoint: str | None) -> Path | None:
        """The step checkpoint a run with ``resume_from_checkpoint=True`` resumes
        from, or ``None`` to resume from the epoch checkpoint as torchtune 0.6.1 does.

        - ``recipe_checkpoint`` naming a file of a ``step_{N}`` folder: that folder,
          which must be whole (the error names what is wrong with it).
        - ``recipe_checkpoint`` naming any other file: ``None`` (0.6.1's behaviour).
        - ``recipe_checkpoint`` not set: the newest whole step checkpoint, unless the
          epoch checkpoint (``recipe_state/recipe_state.pt``) is further along. A
          damaged one of either kind is skipped with a warning.

        Args:
            recipe_checkpoint (str | None): ``checkpointer.recipe_checkpoint``,
                relative to ``output_dir``.

        Returns:
            Path | None: the step checkpoint folder.

        Raises:
            CheckpointError: if the named step checkpoint is incomplete or damaged.
        """
        if recipe_checkpoint:
            named = self.output_dir / recipe_checkpoint
            folder = named if step_of(named) is not None else named.parent
            if step_of(folder) is None:
                return None
            verify(folder)
            return folder
        latest = self.find_latest()
        if latest is None:
            return None
        step_progress = torch.load(latest / RECIPE_STATE, weights_only=False)
        if self._epochs_at_epoch_checkpoint(latest) > step_progress[EPOCHS_KEY]:
            return None
        return latest

    def _epochs_at_epoch_checkpoint(self, latest: Path) -> int:
        """Epochs done at the newest epoch checkpoint that can be resumed: the
        synchronous one's ``recipe_state/recipe_state.pt`` or an asynchronous (DCP)
        ``dist_epoch_{N}`` folder. A torn recipe state (a kill while the checkpointer wrote
        it in place) counts as none, with a warning."""
        epochs = 0
        epoch_state = self.output_dir / "recipe_state" / "recipe_state.pt"
        if epoch_state.is_file():
            try:
                epochs = torch.load(epoch_state, weights_only=False)[EPOCHS_KEY]
            except Exception as e:  # torn, or not a recipe state at all
                log.warning(f"Cannot read {epoch_state} ({e}); resuming from {latest}")
        # torch distributed checkpointing's epoch folders, whole once .metadata is in.
        for folder in self.output_dir.glob("dist_epoch_*"):
            match = re.fullmatch(r"dist_epoch_(\d+)", folder.name)
            if match and (folder / ".metadata").is_file():
                epochs = max(epochs, int(match.group(1)) + 1)
        return epochs

    def load(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load the step checkpoint ``path`` into ``model`` and ``optimizer``; call it
        on every rank. This is how a distributed recipe loads its sharded state.

        Args:
            path (str | Path): a ``step_{N}`` folder.
            model (nn.Module): the model, built as in the run that saved it.
            optimizer (torch.optim.Optimizer): its optimizer, plain or in-backward
                (either loads what either saved).

        Returns:
            tuple[dict[str, Any], dict[str, Any]]: the recipe state and this rank's
            state, as given to :meth:`save` (with its RNG state under ``"rng"``:
            pass that to :func:`restore_rng_state` when training continues).

        Raises:
            CheckpointError: if the checkpoint is incomplete or damaged (naming the
                file), or was written by a different number of processes.
        """
        path = Path(path)
        recipe_state = self.read_recipe_state(path)
        if _rank_and_world()[1] > 1:
            state = {
                "model": get_model_state_dict(model, options=_TRAINABLE),
                "optimizer": get_optimizer_state_dict(model, optimizer),
            }
            # Every entry of ``state`` must be in the checkpoint: nothing is skipped.
            dcp.load(state, checkpoint_id=path / MODEL_OPTIMIZER_DCP)
            set_model_state_dict(
                model, state["model"], options=StateDictOptions(strict=False)
            )
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
            # DCP loads only the entries its target has, and a new optimizer lacks
            # those a scheduler adds (initial_lr): the saved groups bring them all.
            saved_groups = recipe_state[_HYPERPARAMETERS]
            if len(saved_groups) != len(optimizer.param_groups):
                raise CheckpointError(
                    f"step checkpoint {path} holds {len(saved_groups)} optimizer param "
                    f"groups, this optimizer has {len(optimizer.param_groups)}"
                )
            for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
                group.update(saved)
        else:
            state = torch.load(path / MODEL_OPTIMIZER_FILE, weights_only=False)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        return recipe_state, self._rank_state(path)


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back the RNG state a step checkpoint saved for this rank (under ``"rng"``
    of its rank state), so that dropout draws what the uninterrupted run drew."""
    _set_rng_state(state)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


__all__ = [
    "CheckpointError",
    "StepCheckpointer",
    "restore_rng_state",
    "step_of",
    "verify",
]
