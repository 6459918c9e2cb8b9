"""One run per ``output_dir``: its name, its lock, and what earlier runs and
earlier timelines left.

``torchtune_run.json`` names the run the folder holds; ``torchtune_run.lock`` is held
(an exclusive ``flock``, released by the kernel when the process dies) by the
process training it. A new run deletes an earlier run's resumable state, and a resume
that branches from an older step checkpoint deletes the later ones, or, when asked
(``keep_previous_runs``), moves them into ``previous_runs/``; a move records what it
moves first, so that the next start finishes a move a killed process left midway.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtune.training.checkpointing._step_format import (
    CheckpointError,
    delete_paths,
    fsync_dir,
    read_json,
    size_of,
    step_checkpoints_in,
    step_of,
    warn,
)

RUN_FILE, LOCK_FILE = "torchtune_run.json", "torchtune_run.lock"
PREVIOUS_RUNS = "previous_runs"

# What a run leaves that a later run could mistake for its own, and of that, what a
# resume continues from (this build's step checkpoints, 0.6.1's recipe state and DCP).
_RUN_OUTPUTS = re.compile(
    r"step_\d+|\.step_\d+\.partial|(dist_)?epoch_\d+|\.epoch_\d+\.manifest\.json"
    r"|recipe_state|torchtune_run\.json"
)
_RESUMABLE = re.compile(r"step_\d+|\.step_\d+\.partial|dist_epoch_\d+|recipe_state")


def read_run_file(folder: Path) -> str | None:
    return read_json(folder / RUN_FILE).get("run_id")


def write_run_file(folder: Path, run_id: str, **more: Any) -> str:
    """Record the run ``folder`` holds (``more``: e.g. where its final export is)."""
    (folder / f".{RUN_FILE}.tmp").write_text(json.dumps({"run_id": run_id, **more}))
    os.replace(folder / f".{RUN_FILE}.tmp", folder / RUN_FILE)
    return run_id


def set_aside(
    entries: list[Path], label: str, reason: str, copies: Sequence[Path] = ()
) -> None:
    """Move ``entries`` (and copy ``copies``, which stay in use) into
    ``previous_runs/{label}/`` of their folders, never into an earlier move's."""
    for folder in sorted({e.parent for e in [*entries, *copies]}):
        target, suffix = folder / PREVIOUS_RUNS / label, 1
        while target.exists():
            suffix += 1
            target = folder / PREVIOUS_RUNS / f"{label}.{suffix}"
        target.mkdir(parents=True)
        moved = sorted(e.name for e in entries if e.parent == folder)
        copied = sorted(e.name for e in copies if e.parent == folder)
        for name in copied:
            copy = shutil.copytree if (folder / name).is_dir() else shutil.copy2
            copy(folder / name, target / name)
        # What is left to move, for the next start to finish if this process dies.
        journal = _move_journal(target)
        journal.write_text(json.dumps({"target": target.name, "names": moved}))
        for name in moved:
            os.replace(folder / name, target / name)
        fsync_dir(folder)
        journal.unlink()
        also = f", copied {', '.join(copied)} (read by this run)" if copied else ""
        warn(f"{reason}: moved {', '.join(moved)}{also} to {target}; nothing deleted")


def _move_journal(target: Path) -> Path:
    return target.parent / f".{target.name}.moving.json"


def finish_moves(folder: Path) -> None:
    """Finish a move to ``previous_runs/`` that a process stopped midway: the rest
    of what it was moving joins what it moved."""
    journals = sorted((folder / PREVIOUS_RUNS).glob(".*.moving.json"))
    for journal in journals:
        move = read_json(journal)
        target = folder / PREVIOUS_RUNS / str(move.get("target"))
        left = [n for n in move.get("names", []) if (folder / n).exists()]
        for name in left:
            os.replace(folder / name, target / name)
        fsync_dir(folder)
        journal.unlink()
        warn(
            f"Finished moving {', '.join(left) or 'nothing'} to {target}, a move an "
            "earlier process stopped midway"
        )


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


# -- a new run, and a resume that branches ----------------------------------------


def start_run(
    out: Path,
    folders: Iterable[Path],
    *,
    keep_previous_runs: bool,
    read: Sequence[Path],
) -> str:
    """Name a new run in ``out``, after clearing what an earlier run left in
    ``folders`` (the output and export folders): its resumable state is deleted or,
    with ``keep_previous_runs``, all of it is moved into ``previous_runs/``, but for
    what this run ``read``s, which stays in place with a copy set aside."""
    found = []
    for root in set(folders):
        found += [e for e in root.glob("*") if _RUN_OUTPUTS.fullmatch(e.name)]
    if any(e.name != RUN_FILE for e in found):
        if keep_previous_runs:
            _set_earlier_run_aside(out, found, read)
        else:
            _clear_earlier_run(out, found)
    run_id = time.strftime("%Y%m%d-%H%M%S-", time.gmtime()) + os.urandom(4).hex()
    return write_run_file(out, run_id)


def _clear_earlier_run(out: Path, found: list[Path]) -> None:
    """Delete the resumable state of the earlier run that left ``found``, which
    this run must not continue, saying so first; its exports stay until this run's
    epochs replace them, as in 0.6.1."""
    resumable = [e for e in found if _RESUMABLE.fullmatch(e.name)]
    exports = sorted(e.name for e in found if step_of(e, "epoch") is not None)
    message = [f"{out} holds an earlier run's files."]
    if resumable:
        names = ", ".join(sorted(e.name for e in resumable))
        message.append(
            f"Deleting its resumable state ({names}: {size_of(resumable)}), "
            "which this new run must not continue."
        )
    if exports:
        message.append(
            f"Its exports ({', '.join(exports)}) stay until this run's epochs "
            "replace them."
        )
    message.append(
        "To keep an earlier run's files, set keep_previous_runs=True (moved "
        f"to {out / PREVIOUS_RUNS}), or use another output_dir."
    )
    warn(" ".join(message))
    delete_paths(resumable)


def _set_earlier_run_aside(out: Path, found: list[Path], read: Sequence[Path]) -> None:
    """Move everything the earlier run left (``found``) into ``previous_runs/``,
    but for what this run reads, which stays in place with a copy set aside."""
    keep = [k.absolute() for k in read]
    kept = [e for e in found if any(e.absolute() in (k, *k.parents) for k in keep)]
    newest = time.gmtime(max(e.stat().st_mtime for e in found))
    earlier = read_run_file(out) or time.strftime("before-%Y%m%d-%H%M%S", newest)
    reason = (
        f"{out} held an earlier run's checkpoints, which this run must "
        "neither overwrite nor resume (to resume: move them back)"
    )
    moved = [e for e in found if e not in kept]
    set_aside(moved, f"run_{earlier}", reason, copies=kept)


def branch_at(
    folder: Path,
    *,
    run_id: str | None,
    epochs_done: int,
    export_roots: Sequence[Path],
    keep_previous_runs: bool,
) -> None:
    """Resuming from the step checkpoint ``folder`` when later ones exist branches:
    the old timeline's later step checkpoints are deleted (with
    ``keep_previous_runs``, moved aside with the exports of the epochs after
    ``epochs_done``), so that pruning and later resumes see this branch only."""
    out = folder.parent
    later = [p for p in step_checkpoints_in(out) if step_of(p) > step_of(folder)]
    if later and keep_previous_runs:
        for root in export_roots:
            epochs = [(p, step_of(p, "epoch")) for p in root.glob("epoch_*")]
            later += [p for p, e in epochs if e is not None and e >= epochs_done]
        reason = (
            f"Resuming from {folder.name}: the later checkpoints of this run "
            "(damaged, or of the timeline this resume branches from) go aside"
        )
        set_aside(later, f"run_{run_id}-after-{folder.name}", reason)
    elif later:
        warn(
            f"Resuming from {folder.name}: deleting this run's later step checkpoints "
            f"({', '.join(p.name for p in later)}: {size_of(later)}), damaged or of the "
            "timeline this resume branches from, so that later resumes continue "
            "this branch. To keep them, set keep_previous_runs=True (moved to "
            f"{out / PREVIOUS_RUNS})."
        )
        delete_paths(later)


__all__ = [
    "LOCK_FILE",
    "PREVIOUS_RUNS",
    "RUN_FILE",
    "RunLock",
    "branch_at",
    "check_lock",
    "check_outside",
    "check_writable",
    "finish_moves",
    "read_run_file",
    "release_lock",
    "set_aside",
    "start_run",
    "take_lock",
    "write_run_file",
]
