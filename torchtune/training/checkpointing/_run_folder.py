"""One run per ``output_dir``: its name, its lock, and the one rule by which
anything in it is deleted.

``torchtune_run.json`` names the run the folder holds and its newest step
checkpoint; ``torchtune_run.lock`` is held (an exclusive ``flock``, released by the
kernel when the process dies) by the process training it. A step checkpoint is
published by :func:`publish_step`, and only then, in ``output_dir`` only, goes what it
supersedes: an earlier run's resumable state, a later step checkpoint of the
timeline a resume branched from (once the branch's save of that step, or a later
one, is whole), and this run's beyond the newest it keeps. Until a new run's or a
branch's first save is whole, the folder resumes as it did before it started.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtune.training.checkpointing._step_format import (
    MANIFEST,
    CheckpointError,
    delete_paths,
    fsync_dir,
    intact,
    read_json,
    size_of,
    step_checkpoints_in,
    step_of,
    warn,
)

RUN_FILE, LOCK_FILE = "torchtune_run.json", "torchtune_run.lock"


def read_run_file(folder: Path) -> str | None:
    return read_json(folder / RUN_FILE).get("run_id")


def new_run_id() -> str:
    """A new run's name: its start time (UTC) and 8 random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S-", time.gmtime()) + os.urandom(4).hex()


def write_run_file(folder: Path, run_id: str, **more: Any) -> str:
    """Record the run ``folder`` holds (``more``: e.g. where its final export is)."""
    (folder / f".{RUN_FILE}.tmp").write_text(json.dumps({"run_id": run_id, **more}))
    os.replace(folder / f".{RUN_FILE}.tmp", folder / RUN_FILE)
    return run_id


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # e.g. a name longer than the file system allows
        return False


def check_writable(key: str, path: str | Path) -> None:
    """Refuse a folder this process cannot write: ``path``, or the nearest existing
    folder above it, where it would be made.

    Raises:
        PermissionError: naming ``key`` and ``path``.
        ValueError: if a folder name is longer than the file system allows.
    """
    path = existing = Path(path).absolute()
    while not _exists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise PermissionError(
            f"{key}={path} cannot be made: {existing} is a file, not a folder. Set "
            f"{key} to a folder this run can write."
        )
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for part in path.relative_to(existing).parts:  # the folders it would make
        if len(os.fsencode(part)) > name_max:
            raise ValueError(
                f"{key}={path} cannot be made: its folder name {part[:40]}... is "
                f"{len(os.fsencode(part))} bytes, more than the {name_max} this file "
                f"system allows. Set {key} to a folder with shorter names."
            )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(
            f"{key}={path} cannot be written: this process has no write permission "
            f"in {existing}, so no checkpoint could be saved. Set {key} to a folder "
            f"this run can write, or give it write permission (chmod u+w {existing})."
        )


def check_outside(base: Path, base_key: str, out: Path, out_key: str) -> None:
    """Refuse an output folder equal to or inside the folder of a base checkpoint."""
    base_path, out_path = base.resolve(), out.resolve()
    if out_path == base_path or base_path in out_path.parents:
        raise ValueError(
            f"{out_key}={out} is inside {base_key}={base}: the run would write its "
            "checkpoints and exports among the base model's files (and every epoch "
            f"export copies that folder's files). Set {out_key} to a folder outside it."
        )


@dataclass(eq=False)
class RunLock:
    """An exclusive ``flock`` on ``path``, held through ``fd``: the kernel releases it
    when the process ends, however it ends, so it is never stale."""

    path: Path
    fd: int
    held: bool = True


def _owner_of(path: Path) -> str:
    owner = read_json(path)
    if not owner:
        return "a run whose lock file does not say which"
    return (
        f"process {owner.get('pid')} on host {owner.get('host')}, started "
        f"{owner.get('started')}"
    )


def _in_use(folder: Path) -> CheckpointError:
    return CheckpointError(
        f"output_dir={folder} is in use by another run ({_owner_of(folder / LOCK_FILE)})"
        ": two runs would overwrite each other's checkpoints. Wait for it to finish, "
        "stop it, or use another output_dir."
    )


def check_lock(folder: Path) -> None:
    """Refuse ``folder`` early if a live run holds its lock (:func:`take_lock` decides,
    atomically, later)."""
    path = (folder / LOCK_FILE).absolute()
    if not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(folder) from None
    finally:
        os.close(fd)  # which releases the shared lock


def take_lock(folder: Path) -> RunLock:
    """Hold ``folder``'s lock: of runs starting together, exactly one gets it, and a
    live owner's lock is never taken over, whatever its file holds."""
    path = (folder / LOCK_FILE).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(folder) from None
        # The owner before us deletes the file as it releases it: a lock on a
        # deleted file locks nothing, so try again on the one now there.
        if path.is_file() and os.stat(path).st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)
    lock = RunLock(path, fd)
    if path.stat().st_size:  # a run that held it ended without deleting it
        warn(f"Taking over {path}, left by a run that stopped: {_owner_of(path)}")
    owner = {"pid": os.getpid(), "host": socket.gethostname()}
    owner["started"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    os.ftruncate(lock.fd, 0)
    os.pwrite(lock.fd, json.dumps(owner).encode(), 0)
    return lock


def release_lock(lock: RunLock) -> None:
    """Delete the lock file and release the lock (once: a second call does nothing)."""
    if not lock.held:
        return
    lock.held = False
    lock.path.unlink(missing_ok=True)  # while still held: see take_lock
    os.close(lock.fd)


def run_head(folder: Path) -> int | None:
    """The step of the newest step checkpoint of the run ``folder`` holds: its
    step checkpoints after it are of a timeline a resume branched from."""
    return read_json(folder / RUN_FILE).get("head")


def earlier_runs_state(out: Path, run_id: str | None) -> list[Path]:
    """What runs other than ``run_id`` left in ``out`` to resume from: the step
    checkpoints whose manifest names another run, and torchtune 0.6.1's recipe state
    and asynchronous epoch checkpoints."""
    found = [
        p
        for p in step_checkpoints_in(out)
        if intact(manifest := read_json(p / MANIFEST))
        and manifest.get("run_id") not in (run_id, None)
    ]
    found += [
        p for p in [out / "recipe_state", *out.glob("dist_epoch_*")] if p.is_dir()
    ]
    return sorted(found)


def publish_step(
    partial: Path, *, step: int, run_id: str, after: int | None, keep: int | None
) -> list[Path]:
    """Make the whole ``partial`` the step checkpoint ``step_{step}`` of run
    ``run_id``, which continued from its step checkpoint ``after`` (``None``: from
    the start), and the folder's newest; then delete, in its folder only, what it
    supersedes: the run's step checkpoints after ``after`` up to ``step`` (of a
    timeline this one branched from; those after ``step`` stay until a save of their
    step or a later one is whole), an earlier run's resumable state, and, with
    ``keep``, the run's step checkpoints but the newest ``keep``.

    Every step is safe to repeat: a process killed midway leaves a whole
    ``partial``, which the next start publishes again.

    Returns:
        list[Path]: the step checkpoints deleted to keep the newest ``keep``.
    """
    out = partial.parent
    final = out / f"step_{step}"
    fsync_dir(partial)
    write_run_file(out, run_id, head=step)
    first = -1 if after is None else after
    branched = [
        p for p in step_checkpoints_in(out, run_id) if first < step_of(p) <= step
    ]
    earlier = earlier_runs_state(out, run_id)
    for what, paths in (
        ("of the timeline this run branched from", [p for p in branched if p != final]),
        ("an earlier run's resumable state", earlier),
    ):
        if paths:
            names = ", ".join(p.name for p in paths)
            warn(f"Deleting {names} ({size_of(paths)}), {what}: {final} supersedes it")
    delete_paths([*branched, *earlier, *([final] if final.exists() else [])])
    os.replace(partial, final)
    fsync_dir(out)
    timeline = [p for p in step_checkpoints_in(out, run_id) if step_of(p) <= step]
    pruned = timeline[keep:] if keep else []
    delete_paths(pruned)
    return pruned


__all__ = [
    "LOCK_FILE",
    "RUN_FILE",
    "RunLock",
    "check_lock",
    "check_outside",
    "check_writable",
    "earlier_runs_state",
    "new_run_id",
    "publish_step",
    "read_run_file",
    "release_lock",
    "run_head",
    "take_lock",
    "write_run_file",
]
