"""Fault injection for the recipe tests: run ``tune run`` in a process of its own that
SIGKILLs itself at a named kill point. The one mechanism every recipe-level fault
test uses.

:func:`killed_run` runs a recipe to its kill point and returns what it logged;
:func:`start` starts one and returns at once (for a test that acts while it runs).
The process is forked from the preloaded server of
``tests/torchtune/distributed_launcher.py`` (torch and torchtune already imported, a
real process all the same, with a pid, its own lock on ``output_dir`` and nothing
of the test process's state); :func:`install`, in that process, wraps the function
the kill point names, so the kill is triggered by an event of the run itself, never
by a timer, and lands at the same place every time:

- ``after_step:N``: right after the metrics of step N are logged and flushed.
- ``in_step_save:N``: while the data file of step checkpoint N (this process's
  ``torch.distributed.checkpoint`` shard) is being written (half of its bytes are
  on disk).
- ``before_rename:N``: once step checkpoint N is complete under its temporary
  name, just before it is renamed to ``step_N``.
- ``in_epoch_save:E``: while the checkpointer writes the weights of epoch E
  (``epoch_E/*.safetensors``, in place, as torchtune's checkpointers do), half of
  their bytes on disk.
- ``pause_after_step:N``: right after the metrics of step N are logged, sleep for a
  minute (holding ``output_dir``, for a second run to try it) and then die.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.recipes.utils import (
    _subprocess_env,
    forked_tune_main,
    read_disk_log,
    tune_argv,
)
from tests.torchtune.distributed_launcher import (
    kill_child,
    preloaded_context,
    start_child,
)


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(kill_point: str) -> None:
    """Arrange for this process to SIGKILL itself at ``kill_point``."""
    what, _, number = kill_point.partition(":")
    n = int(number)

    if what in ("after_step", "pause_after_step"):
        from torchtune.training.metric_logging import DiskLogger

        log_dict = DiskLogger.log_dict

        def log_then_die(self, payload, step):
            log_dict(self, payload, step)
            if step == n:
                self._file.flush()
                os.fsync(self._file.fileno())
                if what == "pause_after_step":
                    time.sleep(60)
                _die()

        DiskLogger.log_dict = log_then_die

    elif what == "in_epoch_save":
        import safetensors.torch

        from torchtune.training.checkpointing import _checkpointer

        def save_file(tensors, filename, *args, **kwargs):
            if f"epoch_{n}" in Path(filename).parts:
                data = safetensors.torch.save(tensors, *args, **kwargs)
                with open(filename, "wb") as out:
                    out.write(data[: len(data) // 2])
                    out.flush()
                    os.fsync(out.fileno())
                _die()
            return safetensors.torch.save_file(tensors, filename, *args, **kwargs)

        _checkpointer.save_file = save_file

    elif what == "in_step_save":
        from torch.distributed.checkpoint import filesystem

        real_create_stream = filesystem.FileSystem.create_stream

        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with real_create_stream(self, path, mode) as stream:
                yield stream
            path = Path(path)
            if path.parent.name == f".step_{n}.partial" and path.suffix == ".distcp":
                os.truncate(path, path.stat().st_size // 2)
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                _die()

        filesystem.FileSystem.create_stream = create_stream

    elif what == "before_rename":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if Path(src).name == f".step_{n}.partial":
                _die()
            return real_replace(src, dst, *args, **kwargs)

        os.replace = replace

    else:
        raise ValueError(f"unknown kill point {kill_point!r}")


def _run(kill_point: str, argv: list[str]) -> None:
    """In the forked process: ``tune`` on ``argv``, dying at ``kill_point``."""
    install(kill_point)
    forked_tune_main(argv)


@dataclass
class Started:
    """A run started by :func:`start`, on its way to its kill point."""

    process: Any
    """The ``multiprocessing`` process (``pid``, ``exitcode``)."""
    log_file: Path
    """Its ``DiskLogger`` file."""
    output: Path
    """Its stdout and stderr."""

    def logged(self) -> dict[int, dict[str, float]]:
        """What it logged so far (``read_disk_log``)."""
        return read_disk_log(self.log_file) if self.log_file.is_file() else {}

    def kill(self) -> None:
        kill_child(self.process)


def start(
    kill_point: str,
    recipe: str,
    config: Path | str,
    overrides: Mapping[str, Any],
    output_dir: Path,
    *,
    log_name: str = "killed.txt",
) -> Started:
    """Start ``tune run RECIPE --config CONFIG overrides`` in a process that dies at
    ``kill_point``, its metrics in ``output_dir/logs/LOG_NAME`` and its output beside
    them (``.out``)."""
    log_dir = output_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / log_name
    argv = tune_argv(recipe, config, overrides, output_dir, log_file)
    output = log_dir / f"{log_file.stem}.out"
    process = start_child(
        preloaded_context(),
        _run,
        (kill_point, argv),
        _subprocess_env(output_dir, None),
        output,
        replace_env=True,
    )
    return Started(process, log_file, output)


def killed_run(
    kill_point: str,
    recipe: str,
    config: Path | str,
    overrides: Mapping[str, Any],
    output_dir: Path,
    *,
    log_name: str = "killed.txt",
    timeout: float = 300.0,
) -> dict[int, dict[str, float]]:
    """Run a recipe to ``kill_point`` (:func:`start`) and return what it logged.

    Raises:
        AssertionError: if the process ended otherwise than by its SIGKILL.
    """
    run = start(kill_point, recipe, config, overrides, output_dir, log_name=log_name)
    run.process.join(timeout)
    if run.process.is_alive():
        run.kill()
    assert run.process.exitcode == -signal.SIGKILL, (
        f"expected a SIGKILL at {kill_point}, got exit status "
        f"{run.process.exitcode}\n" + run.output.read_text(errors="replace")[-6000:]
    )
    return run.logged()
