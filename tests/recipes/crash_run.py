"""Run ``tune run ...`` and kill the process with SIGKILL at a chosen moment.

Used by the fault-injection tests as ``python -m tests.recipes.crash_run KILL_POINT
run <recipe> --config ...``, or through :func:`run` in a process forked from the
preloaded server of ``tests/torchtune/distributed_launcher.py``. The kill is triggered by an event of the run itself, never
by a timer, so it lands at the same place every time:

- ``after_step:N``: right after the metrics of step N are logged and flushed.
- ``in_step_save:N``: while the model and optimizer file of step checkpoint N is
  being written (half of its bytes are on disk).
- ``before_rename:N``: once step checkpoint N is complete under its temporary
  name, just before it is renamed to ``step_N``.
- ``in_epoch_save:E``: while the checkpointer writes the weights of epoch E
  (``epoch_E/*.safetensors``, in place, as torchtune's checkpointers do), half of
  their bytes on disk.
- ``pause_after_step:N``: right after the metrics of step N are logged, sleep for a
  minute (holding ``output_dir``, for a second run to try it) and then die.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _write_half_and_die(obj: Any, f: Any) -> None:
    buffer = io.BytesIO()
    _real_save(obj, buffer)
    data = buffer.getvalue()[: len(buffer.getvalue()) // 2]
    if isinstance(f, str | os.PathLike):
        with open(f, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    else:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    _die()


_real_save = torch.save


def install(kill_point: str) -> None:
    """Arrange for this process to SIGKILL itself at ``kill_point``."""
    what, _, number = kill_point.partition(":")
    n = int(number)

    if what in ("after_step", "pause_after_step"):
        import time

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

        def save(obj, f, *args, **kwargs):
            hit = (
                isinstance(f, io.IOBase)
                and f".step_{n}.partial" in str(getattr(f, "name", ""))
                and isinstance(obj, dict)
                and "optimizer" in obj
            )
            if hit:
                _write_half_and_die(obj, f)
            return _real_save(obj, f, *args, **kwargs)

        torch.save = save

    elif what == "before_rename":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if Path(src).name == f".step_{n}.partial":
                _die()
            return real_replace(src, dst, *args, **kwargs)

        os.replace = replace

    else:
        raise ValueError(f"unknown kill point {kill_point!r}")


def run(kill_point: str, tune_args: list[str]) -> None:
    """``tune *tune_args`` in this process, which dies at ``kill_point``."""
    install(kill_point)
    from torchtune._cli.tune import main as tune_main

    sys.argv = ["tune", *tune_args]
    tune_main()


def main() -> None:
    kill_point, *tune_args = sys.argv[1:]
    run(kill_point, tune_args)


if __name__ == "__main__":
    main()
