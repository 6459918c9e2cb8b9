"""The files of a step checkpoint and of an epoch export, and their verification.

A step checkpoint is the folder ``step_{N}/``: a ``torch.distributed.checkpoint``
(DCP) checkpoint of every stateful object of the run, one format for one process and
for many (its ``.metadata``, written last, and its data files), ``recipe_state.pt``
(what a resume checks before anything is built) and ``manifest.json``, written after
them: the size and CRC-32 of every file, the run id and step, and a CRC-32 of these
entries themselves. An epoch export's manifest is ``.epoch_{N}.manifest.json``,
beside the folder. The processes of a distributed run share the reading.

It also holds what the other checkpointing modules share: which process this is and
how the processes wait for each other (:func:`process_rank`, :func:`on_rank_zero`,
...), and how files are written, read and deleted.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import pickle
import re
import shutil
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchtune import utils

log = utils.get_logger("DEBUG")

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2
RECIPE_STATE = "recipe_state.pt"
# A DCP checkpoint is whole once its metadata is written.
DCP_METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed, or an output folder that cannot be used."""


def in_process_group() -> bool:
    """A ``torch.distributed`` run, whose models are sharded (FSDP2), one process too."""
    return dist.is_available() and dist.is_initialized()


def process_rank() -> int:
    return dist.get_rank() if in_process_group() else 0


def process_count() -> int:
    return dist.get_world_size() if in_process_group() else 1


def barrier() -> None:
    if process_count() > 1:
        dist.barrier()


def _all_ranks(items: list[Any]) -> list[Any]:
    """Every rank's ``items``, concatenated in rank order (call it on every rank)."""
    if process_count() == 1:
        return items
    parts: list[Any] = [None] * process_count()
    dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]


def on_rank_zero(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, the others waiting; every rank gets its result, or raises
    what it raised."""
    outcome: list[Any] = [None, None]
    try:
        outcome[0] = fn() if process_rank() == 0 else None
    except Exception as e:  # re-raised on every rank below
        outcome[1] = e
    if process_count() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def warn(message: str) -> None:
    utils.log_rank_zero(log, message, level=logging.WARNING)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_synced(obj: Any, path: Path) -> None:
    """Save ``obj`` to ``path``, which exists only once it is whole."""
    written = path.with_name(f"{path.name}.tmp")
    with open(written, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(written, path)


def load_weights_only(path: Path) -> Any:
    """A step checkpoint file, which holds tensors and plain values only: anything
    else is refused rather than unpickled, which could run code."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise CheckpointError(
            f"{path} holds a pickled {found[1] if found else 'object'}, which loading "
            "could run: refused (a step checkpoint holds tensors and plain values "
            "only). Resume another one (checkpointer.recipe_checkpoint=step_N), or "
            "resume_from_checkpoint=False."
        ) from e


def size_of(paths: Sequence[Path]) -> str:
    """The bytes of the files in ``paths`` (files or folders), for a message."""
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*"))]
    total = sum(f.stat().st_size for f in files if f.is_file())
    return f"{total / 1e9:.2f} GB" if total >= 1e8 else f"{total / 1e6:.2f} MB"


def delete_paths(paths: Sequence[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` if it is missing or unreadable."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def file_checksum(path: str | Path) -> str:
    """The CRC-32 of a file, as 8 hex digits: it catches any changed byte and any
    truncation (damage, not forgery). The file is read in place through ``mmap``."""
    crc = 0
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:  # an empty file cannot be mapped
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                crc = zlib.crc32(mapped)
    return f"{crc:08x}"


def export_manifest(folder: str | Path) -> Path:
    """Where the manifest of the epoch export ``folder`` is: beside it, not in it, so
    that uploading the folder (e.g. ``huggingface_hub.upload_folder``) or copying it
    for inference takes the weights only."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}.manifest.json"


def _manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """The CRC-32 of a manifest's own entries (all but ``manifest_crc32``): a changed
    run id, step, version or file entry shows as damage."""
    entries = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return f"{zlib.crc32(json.dumps(entries, sort_keys=True).encode()):08x}"


def intact(manifest: Mapping[str, Any]) -> bool:
    """Whether a manifest's entries are as written."""
    return manifest.get("manifest_crc32") == _manifest_checksum(manifest)


def write_manifest(root: Path, path: Path, *, run_id: str | None, step: int) -> None:
    """Write the manifest ``path`` of the folder ``root``, saved by run ``run_id`` at
    ``step``: the size and CRC-32 of each of its files (the ranks of a distributed run
    share the reading), and a CRC-32 of these entries. Call it on every rank."""
    files = on_rank_zero(lambda: sorted(p for p in root.rglob("*") if p.is_file()))
    files = [p for p in files if p != path][process_rank() :: process_count()]
    mine = [(p, {"size": p.stat().st_size, "crc32": file_checksum(p)}) for p in files]
    files = {str(p.relative_to(root)): e for p, e in sorted(_all_ranks(mine))}
    manifest = {"version": MANIFEST_VERSION, "run_id": run_id, "step": step}
    manifest["files"] = files
    manifest["manifest_crc32"] = _manifest_checksum(manifest)
    text = json.dumps(manifest, indent=1)
    on_rank_zero(lambda: path.write_text(text))


def verify(
    folder: str | Path,
    manifest: str | Path | None = None,
    required: Sequence[str] = (),
) -> dict[str, Any]:
    """Check that every file of ``folder`` that its manifest lists (``manifest``,
    default: ``folder/manifest.json``) is there with the size and CRC-32 it had when
    written, the manifest itself too, and that it lists the ``required`` files;
    call it on every rank of a distributed run, which share the reading.

    Returns:
        dict[str, Any]: the manifest.

    Raises:
        CheckpointError: if the manifest is missing (the save did not finish),
            damaged (its own checksum, version or entries), or a file is missing or
            damaged.
    """
    path = Path(manifest) if manifest else Path(folder) / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{folder} is not whole: it has no {path.name}, written last"
        )
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not intact(manifest):
            raise ValueError("its entries changed since it was written")
        if manifest["version"] != MANIFEST_VERSION:
            raise ValueError(
                f"version {manifest['version']!r} is not {MANIFEST_VERSION}"
            )
        entries = files.values()
        if any((type(e["size"]), type(e["crc32"])) != (int, str) for e in entries):
            raise TypeError("its file list is not a manifest's")
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is damaged ({e})") from e
    problems = [f"{path} lists no {n}" for n in required if n not in files]
    for n in sorted(files)[process_rank() :: process_count()]:
        path, size = Path(folder) / n, files[n]["size"]
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif (actual := path.stat().st_size) != size:
            problems.append(f"{path} is damaged: {actual} bytes, {size} when written")
        elif file_checksum(path) != files[n]["crc32"]:
            problems.append(f"{path} is damaged: its bytes changed since it was saved")
    if problems := _all_ranks(problems):
        raise CheckpointError("; ".join(problems))
    return manifest


def whole_partial(partial: Path) -> dict[str, Any] | None:
    """The recipe state of ``partial`` (a ``.step_{N}.partial`` folder, a step
    checkpoint not yet published) if every file of it is written, else ``None``.
    The recipe state exists only once whole (it is renamed into place); the
    ``torch.distributed.checkpoint`` state of every process is whole once its
    ``.metadata``, which DCP writes last, exists."""
    try:
        state = torch.load(partial / RECIPE_STATE, weights_only=True, mmap=True)
    except Exception:  # not written: not whole
        return None
    if not state.get("run_id"):  # not written by this build
        return None
    return state if (partial / DCP_METADATA).is_file() else None


def partial_step(path: Path) -> int | None:
    """``N`` of a folder named ``.step_{N}.partial``, else ``None``."""
    match = re.fullmatch(r"\.step_(\d+)\.partial", path.name)
    return int(match.group(1)) if match else None


def step_of(path: Path, kind: str = "step") -> int | None:
    """``N`` of a folder named ``{kind}_{N}``, else ``None``."""
    match = re.fullmatch(rf"{kind}_(\d+)", path.name)
    return int(match.group(1)) if match else None


def step_checkpoints_in(folder: Path, run_id: str | None = None) -> list[Path]:
    """The ``step_{N}`` folders of ``folder``, newest first; with ``run_id``, only
    those of that run (or of no recorded run)."""
    steps = [p for p in folder.glob("step_*") if p.is_dir() and step_of(p) is not None]
    manifests = {p: read_json(p / MANIFEST) for p in steps}
    # A damaged manifest's run id cannot be trusted: verify() reports it.
    own = [
        p
        for p, manifest in manifests.items()
        if manifest.get("run_id") in (run_id, None) or not intact(manifest)
    ]
    return sorted(own if run_id else steps, key=step_of, reverse=True)


__all__ = [
    "DCP_METADATA",
    "MANIFEST",
    "MANIFEST_VERSION",
    "RECIPE_STATE",
    "CheckpointError",
    "barrier",
    "delete_paths",
    "export_manifest",
    "file_checksum",
    "fsync_dir",
    "in_process_group",
    "intact",
    "load_weights_only",
    "on_rank_zero",
    "partial_step",
    "process_count",
    "process_rank",
    "read_json",
    "save_synced",
    "size_of",
    "step_checkpoints_in",
    "step_of",
    "verify",
    "warn",
    "whole_partial",
    "write_manifest",
]
