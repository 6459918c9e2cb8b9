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
- ``manifest.json``, written last: the size and CRC-32 of every file above, and the
  id of the run that wrote it.

Everything is written into ``output_dir/.step_{global_step}.partial/`` and renamed to
``step_{global_step}`` only once whole, so a folder named ``step_*`` is never half
written. The manifest is checked again, every byte of every file, before any of a
checkpoint is loaded, so a checkpoint damaged afterwards (a truncated file, a changed
byte) is skipped, with a warning naming the file, in favour of the previous one.

A run is known by its run id, made when a new run starts and carried over by every
resume; ``torchtune_run.json`` in ``output_dir`` names the run that the folder holds.
A new run first moves the checkpoints of the run before it aside, into
``output_dir/previous_runs/run_{id}/`` (:func:`set_aside_previous_run`), so a resume
never mistakes them for its own.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import time
import uuid
import zlib
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
# 1: file sizes only. 2: sizes and CRC-32s of the files, and the run id.
_MANIFEST_VERSION = 2
# The file naming the run whose checkpoints output_dir holds.
RUN_FILE = "torchtune_run.json"
# Where a new run moves the checkpoints of the run before it.
PREVIOUS_RUNS = "previous_runs"
# Files are read in chunks of this many bytes to compute their checksums.
_CHUNK_BYTES = 16 << 20
# Recipe-state entry: the optimizer's ``_component_``, to refuse resuming it into
# another optimizer class.
OPTIMIZER_COMPONENT = "optimizer_component"
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


def _file_names(root: Path) -> list[str]:
    return [
        str(p.relative_to(root))
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    ]


def file_checksum(path: str | Path) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits.

    CRC-32 detects every change of up to 32 consecutive bits (so any changed byte)
    and a truncation, at about a GB/s or more (``benchmarks/checkpoint_checksum.py``);
    it guards against damage, not against someone forging a checkpoint. The file is
    mapped into memory and read in place, 16 MiB at a time (a copy into a buffer
    halves the speed); where it cannot be mapped (an empty file, a file system
    without ``mmap``), it is read in 1 MiB chunks.
    """
    crc = 0
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            mapped = None
        if mapped is None:
            while chunk := f.read(1 << 20):
                crc = zlib.crc32(chunk, crc)
            return f"{crc:08x}"
        with mapped:
            view = memoryview(mapped)
            try:
                for start in range(0, len(mapped), _CHUNK_BYTES):
                    crc = zlib.crc32(view[start : start + _CHUNK_BYTES], crc)
            finally:
                view.release()
    return f"{crc:08x}"


def _describe(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "size": (root / name).stat().st_size,
            "crc32": file_checksum(root / name),
        }
        for name in names
    }


def _split_across_ranks(names: list[str]) -> list[str]:
    """This rank's share of ``names``, so that the ranks of a distributed run read
    the files of a checkpoint in parallel."""
    rank, world_size = _rank_and_world()
    return names[rank::world_size]


def _gather(value: Any) -> list[Any]:
    """``value`` of every rank (the process group's all-gather of objects)."""
    rank, world_size = _rank_and_world()
    if world_size == 1:
        return [value]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def step_of(path: Path) -> int | None:
    """The global step of a ``step_{N}`` folder, ``None`` for any other name."""
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the step checkpoint ``path``.

    Raises:
        CheckpointError: if it has none (its save did not finish) or it is damaged.
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"step checkpoint {path} does not exist")
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{path} is not a complete step checkpoint: it has no {MANIFEST}, which "
            "is written last, so the save that made it did not finish."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest["files"], dict):
            raise ValueError("its 'files' entry is not a mapping")
        for name, entry in manifest["files"].items():
            # Version 1: the size; version 2: the size and the CRC-32.
            if not (
                isinstance(entry, int)
                or (
                    isinstance(entry, dict)
                    and isinstance(entry.get("size"), int)
                    and isinstance(entry.get("crc32"), str)
                )
            ):
                raise ValueError(f"its entry for {name} is {entry!r}")
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{manifest_path} is damaged: {e}") from e
    return manifest


def run_id_of(path: str | Path) -> str | None:
    """The id of the run that wrote the step checkpoint ``path``; ``None`` for one
    written before checkpoints carried run ids, or without a readable manifest."""
    try:
        return read_manifest(path).get("run_id")
    except CheckpointError:
        return None


def _problems(path: Path, files: dict[str, Any], names: list[str]) -> list[str]:
    """What is wrong with the files ``names`` of the step checkpoint ``path``,
    checking their sizes and, where the manifest has them, their checksums."""
    problems = []
    for name in names:
        expected = files[name]
        file = path / name
        # A manifest of version 1 holds the size alone.
        size, crc = (
            (expected, None)
            if isinstance(expected, int)
            else (expected["size"], expected["crc32"])
        )
        if not file.is_file():
            problems.append(
                f"{file} is missing from step checkpoint {path} (listed in {MANIFEST})"
            )
            continue
        actual = file.stat().st_size
        if actual != size:
            problems.append(
                f"{file} is damaged: {actual} bytes, but it had {size} when the "
                "checkpoint was written (truncated or overwritten?)"
            )
            continue
        actual_crc = None if crc is None else file_checksum(file)
        if actual_crc != crc:
            problems.append(
                f"{file} is damaged: its content changed since the checkpoint was "
                f"written (CRC-32 {actual_crc}, {crc} when written)"
            )
    return problems


def verify(path: str | Path, *, collective: bool = False) -> dict[str, Any]:
    """Check that the step checkpoint ``path`` is whole: its manifest exists and every
    file it lists is there, with the size and the content (CRC-32) it had when the
    checkpoint was written. A checkpoint whose manifest predates checksums (torchtune
    ``0.6.1+oib`` before run ids) is checked by size only, with a warning.

    Args:
        path (str | Path): a ``step_{N}`` folder.
        collective (bool): call it on every rank of a distributed run, which then
            share the reading (each checks a part of the files and all learn the
            result). Default: ``False`` (this process checks every file).

    Returns:
        dict[str, Any]: the manifest.

    Raises:
        CheckpointError: naming the folder or the file that is missing or damaged.
    """
    path = Path(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    names = sorted(files)
    if any(isinstance(v, int) for v in files.values()):
        log.warning(
            f"Step checkpoint {path} records file sizes only (written before "
            "checkpoints carried checksums): its content cannot be verified."
        )
    if collective:
        problems = [
            p
            for ps in _gather(_problems(path, files, _split_across_ranks(names)))
            for p in ps
        ]
    else:
        problems = _problems(path, files, names)
    if problems:
        raise CheckpointError("; ".join(problems))
    return manifest


def new_run_id() -> str:
    """A new run's id: the time it started and a random part, e.g.
    ``20260101-120000-1a2b3c4d``."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def read_run_file(output_dir: str | Path) -> str | None:
    """The id of the run ``output_dir`` holds (``torchtune_run.json``), if any."""
    try:
        return json.loads((Path(output_dir) / RUN_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_run_file(output_dir: str | Path, run_id: str) -> None:
    """Record that ``output_dir`` holds the run ``run_id`` (whole or not at all)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps({"run_id": run_id}))
    os.replace(tmp, output_dir / RUN_FILE)


# What a run leaves in its output folders that another run could mistake for its own
# (step checkpoints, epoch checkpoints, their resumable state, the run file).
_RUN_OUTPUTS = re.compile(
    r"^(step_\d+|\.step_\d+\.(partial|stale)|epoch_\d+|dist_epoch_\d+|recipe_state"
    + "|"
    + re.escape(RUN_FILE)
    + r")$"
)


def set_aside_previous_run(
    folders: list[str | Path], keep: list[str | Path] = ()
) -> Path | None:
    """Move what an earlier run left in ``folders`` (its step checkpoints, epoch
    checkpoints, resumable recipe state and run file) into
    ``{folder}/previous_runs/run_{id}/`` of each folder, so that a new run starting
    there neither overwrites it nor resumes from it later. Nothing is deleted.

    The earlier run's id comes from the run file, or the newest step checkpoint's
    manifest; without either, the time it was last written names it.

    Args:
        folders (list[str | Path]): the run's output folders (``output_dir`` and the
            checkpointer's, which may be the same).
        keep (list[str | Path]): paths that must stay where they are (the base
            checkpoint a new run starts from, which may be an earlier run's
            ``epoch_{N}``): an entry that is or holds one of them is not moved.

    Returns:
        Path | None: the first folder things were moved into, or ``None`` if there
        was nothing to move.
    """
    folders = list(dict.fromkeys(Path(f).resolve() for f in folders))
    keep_resolved = [Path(k).resolve() for k in keep if k]
    found: list[Path] = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            if not _RUN_OUTPUTS.match(entry.name):
                continue
            if any(
                k == entry.resolve() or entry.resolve() in k.parents
                for k in keep_resolved
            ):
                continue
            found.append(entry)
    if all(entry.name == RUN_FILE for entry in found):
        # An earlier run that saved nothing: nothing of it to keep.
        return None
    run_id = None
    for folder in folders:
        run_id = run_id or read_run_file(folder)
    if run_id is None:
        steps = sorted(
            (e for e in found if step_of(e) is not None), key=step_of, reverse=True
        )
        run_id = next((r for r in map(run_id_of, steps) if r), None)
    if run_id is None:
        newest = max(e.stat().st_mtime for e in found)
        run_id = "before-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime(newest))
    first = None
    for folder in folders:
        entries = [e for e in found if e.parent.resolve() == folder]
        if not entries:
            continue
        target = folder / PREVIOUS_RUNS / f"run_{run_id}"
        suffix = 1
        while target.exists():  # never merge into (or overwrite) an earlier move
            suffix += 1
            target = folder / PREVIOUS_RUNS / f"run_{run_id}.{suffix}"
        target.mkdir(parents=True)
        for entry in entries:
            os.replace(entry, target / entry.name)
        _fsync_dir(folder)
        first = first or target
        log.warning(
            f"{folder} held the checkpoints of an earlier run "
            f"({', '.join(sorted(e.name for e in entries))}): moved them to {target}, "
            "so that this new run neither overwrites them nor resumes from them. "
            "Delete that folder if you no longer need it; to continue the earlier "
            "run instead, move them back and set resume_from_checkpoint=True."
        )
    return first


class StepCheckpointer:
    """Saves and finds the step checkpoints of one run, in ``output_dir``.

    Args:
        output_dir (str | Path): the run's output directory.
        every_n_steps (int | None): save every this many optimizer steps; ``None``
            saves none (epoch checkpoints only, as in torchtune 0.6.1).
        keep_last_n (int | None): once a step checkpoint is complete, delete all but
            the newest ``keep_last_n`` step checkpoints of this run; ``None`` keeps
            all. Epoch checkpoints, and other runs' step checkpoints, are never
            deleted.
        run_id (str | None): the id written into each checkpoint's manifest (see
            :func:`new_run_id`); ``None`` writes none. Default: ``None``

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
        run_id: str | None = None,
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
        self.run_id = run_id
        # Checkpoints whose every byte was checked, with the size and modification
        # time of each of their files then: a changed file is checked again.
        self._verified: dict[Path, list[tuple[str, int, int]]] = {}

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
        _barrier()

        # Every file is whole now: each rank computes the checksums of its share.
        names = _file_names(partial) if rank == 0 else None
        if world_size > 1:
            shared = [names]
            dist.broadcast_object_list(shared, src=0)
            names = shared[0]
        files: dict[str, Any] = {}
        for part in _gather(_describe(partial, _split_across_ranks(names))):
            files.update(part)
        if rank == 0:
            manifest = {
                "version": _MANIFEST_VERSION,
                "run_id": self.run_id,
                "global_step": global_step,
                "world_size": world_size,
                "files": dict(sorted(files.items())),
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
        complete = [
            p
            for p in self._step_dirs()
            if (p / MANIFEST).is_file() and run_id_of(p) in (self.run_id, None)
        ]
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

    def find_latest(self, run_id: str | None = None) -> Path | None:
        """The newest whole step checkpoint in ``output_dir``, or ``None``; call it
        on every rank of a distributed run (they share the reading).

        A newer one that is incomplete or damaged is skipped with a warning naming
        the file.

        Args:
            run_id (str | None): only checkpoints of this run, or written before
                checkpoints carried run ids; ``None``: of any run.
        """
        for path in self._step_dirs():
            saved_run = run_id_of(path)
            if run_id is not None and saved_run not in (run_id, None):
                log.warning(
                    f"Skipping step checkpoint {path}: it belongs to run {saved_run}, "
                    f"not to run {run_id}, which {self.output_dir} holds."
                )
                continue
            try:
                self._verify(path)
            except CheckpointError as e:
                log.warning(f"Skipping step checkpoint {path}: {e}")
                continue
            return path
        return None

    def _verify(self, path: Path) -> None:
        """:func:`verify` ``path`` once (every rank of a distributed run calls it)."""
        stamp = [
            (str(p), p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*"))
            if p.is_file()
        ]
        if self._verified.get(path) == stamp:
            return
        verify(path, collective=_rank_and_world()[1] > 1)
        self._verified[path] = stamp

    def read_recipe_state(self, path: str | Path) -> dict[str, Any]:
        """The recipe state of the whole step checkpoint ``path``.

        Raises:
            CheckpointError: if it is incomplete or damaged (naming the file), or was
                written by a different number of processes than this run has.
        """
        path = Path(path)
        self._verify(path)
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

    def resume_point(
        self, recipe_checkpoint: str | None, run_id: str | None = None
    ) -> Path | None:
        """The step checkpoint a run with ``resume_from_checkpoint=True`` resumes
        from, or ``None`` to resume from the epoch checkpoint as torchtune 0.6.1 does.
        Call it on every rank of a distributed run.

        - ``recipe_checkpoint`` naming a file of a ``step_{N}`` folder (or the
          folder): that folder, which must be whole (the error names what is wrong
          with it).
        - ``recipe_checkpoint`` naming any other file: ``None`` (0.6.1's behaviour).
        - ``recipe_checkpoint`` not set: the newest whole step checkpoint of the
          run ``run_id``, unless the epoch checkpoint
          (``recipe_state/recipe_state.pt``) is further along. A damaged one of
          either kind is skipped with a warning.

        Args:
            recipe_checkpoint (str | None): ``checkpointer.recipe_checkpoint``,
                relative to ``output_dir``.
            run_id (str | None): the run to continue (see :meth:`find_latest`).
                Default: ``None``

        Returns:
            Path | None: the step checkpoint folder.

        Raises:
            CheckpointError: if the named step checkpoint does not exist, is
                incomplete or is damaged.
        """
        if recipe_checkpoint:
            folder = self.named_step_checkpoint(recipe_checkpoint)
            if folder is None:
                return None
            try:
                self._verify(folder)
            except CheckpointError as e:
                raise CheckpointError(
                    f"checkpointer.recipe_checkpoint={recipe_checkpoint} names a step "
                    f"checkpoint that cannot be resumed: {e}. Name another one, or "
                    "leave checkpointer.recipe_checkpoint unset to resume from the "
                    "newest whole one."
                ) from e
            return folder
        latest = self.find_latest(run_id)
        if latest is None:
            return None
        step_progress = torch.load(latest / RECIPE_STATE, weights_only=False)
        if self._epochs_at_epoch_checkpoint(latest) > step_progress[EPOCHS_KEY]:
            return None
        return latest

    def named_step_checkpoint(self, recipe_checkpoint: str) -> Path | None:
        """The ``step_{N}`` folder ``checkpointer.recipe_checkpoint`` names (the
        folder or a file in it), or ``None`` if it names no step checkpoint.

        Raises:
            CheckpointError: if it names a step checkpoint that does not exist.
        """
        named = self.output_dir / recipe_checkpoint
        folder = named if step_of(named) is not None else named.parent
        if step_of(folder) is None:
            return None
        if not folder.is_dir():
            found = [p.name for p in self._step_dirs()]
            raise CheckpointError(
                f"checkpointer.recipe_checkpoint={recipe_checkpoint} names the "
                f"step checkpoint {folder}, which does not exist. The step "
                f"checkpoints in {self.output_dir} are {found or 'none'}: name one "
                "of them, or leave checkpointer.recipe_checkpoint unset to resume "
                "from the newest."
            )
        return folder

    def candidates(self, run_id: str | None = None) -> list[Path]:
        """The step checkpoints a resume may choose from, newest first, without
        reading their files: those with a manifest, of the run ``run_id`` (or
        written before run ids; of any run if ``run_id`` is ``None``)."""
        return [
            p
            for p in self._step_dirs()
            if (p / MANIFEST).is_file()
            and (run_id is None or run_id_of(p) in (run_id, None))
        ]

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
    "file_checksum",
    "new_run_id",
    "read_run_file",
    "restore_rng_state",
    "run_id_of",
    "set_aside_previous_run",
    "step_of",
    "verify",
    "write_run_file",
]
