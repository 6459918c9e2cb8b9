"""Run a function on several local CPU processes that form a gloo process group, and
collect what each rank reports. A hung run is killed at a deadline instead of hanging
the test session.

How the processes start (``start=``):

- ``"preloaded"``: forked from a server process that imported torch and torchtune
  once, in a fresh interpreter, and nothing since (``multiprocessing``'s
  forkserver). Every launch starts with the imports done, which on a busy 2-core
  machine saves 15 to 40 s per launch, and with none of the test process's state
  (its threads, a torch.compile worker pool, monkeypatched modules): a rank forked
  from a pytest process that had compiled can hang in its own compile.
- ``"fork"``: forked from the test process itself, so it inherits whatever that
  process holds.

Each forked child uses one intra-op thread, which keeps OpenMP safe after ``fork``,
and leads a process group of its own, so that a deadline kills what it started too.

The function receives ``OUT_DIR`` and reports by calling :func:`write_report`.
"""

from __future__ import annotations

import atexit
import importlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

# What the preloaded server imports: torch, and torchtune with what it imports
# (torchao, Hugging Face datasets and hub), ``tune``'s command line and torchrun's
# entry point; most of a rank's start-up time.
_PRELOAD = ["torch", "torchtune", "torchtune.training", "torchtune._cli.tune"]
# Read by Hugging Face libraries when first imported, so the server (which imports
# them) gets them when it starts; its children inherit what it read.
_SERVER_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
_server_lock = threading.Lock()
_server_started = False


def free_port() -> int:
    """A TCP port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_report(out_dir: Path, rank: int, report: dict[str, str]) -> None:
    """Write a rank's report atomically, so a run killed mid-write leaves the last one."""
    path = Path(out_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


@dataclass
class DistributedRun:
    """What a distributed run left behind."""

    reports: list[dict[str, str]]
    """Per rank: name -> ``"ok"`` or the failure's traceback."""
    returncodes: list[int | None]
    """Per rank; ``None`` for a process killed at the deadline."""
    timed_out: bool
    output: str
    """The tail of every rank's stdout and stderr."""

    def outcome(self, name: str) -> str:
        """``"ok"`` if every rank reported ``name`` as passed, else a description of
        what went wrong on each rank, with the run's output."""
        problems = []
        for rank, report in enumerate(self.reports):
            result = report.get(name)
            if result is None:
                why = "hung (killed at the deadline)" if self.timed_out else "not run"
                problems.append(f"rank {rank}: {why}")
            elif result != "ok":
                problems.append(f"rank {rank}:\n{result}")
        if not problems:
            return "ok"
        return "\n".join(problems) + f"\n--- output ---\n{self.output}"


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun gives a rank: its place in the group and where to meet."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # The ranks share the machine's cores: one thread each.
        "OMP_NUM_THREADS": "1",
    }


def preloaded_context() -> Any:
    """The ``multiprocessing`` context whose processes fork from the preloaded server
    (module docstring), which it starts on first use: a fresh interpreter with the
    test process's environment, ``_SERVER_ENV`` and a datasets cache of its own
    (set in this process's environment while it starts: call this first from the
    thread that changes the environment, before others start). The server ends when
    the test process does."""
    global _server_started
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    with _server_lock:
        if not _server_started:
            context.set_forkserver_preload(_PRELOAD)
            cache = tempfile.mkdtemp(prefix="hf_datasets_")
            atexit.register(shutil.rmtree, cache, ignore_errors=True)
            env = {**_SERVER_ENV, "HF_DATASETS_CACHE": cache, "OMP_NUM_THREADS": "1"}
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            try:
                forkserver.ensure_running()
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            _server_started = True
    return context


def start_child(
    context: Any,
    target: Callable[..., None],
    args: tuple,
    env: Mapping[str, str],
    log_path: Path,
    *,
    replace_env: bool = False,
) -> Any:
    """Start ``target(*args)`` in a process of ``context`` (``fork`` or the preloaded
    server), its stdout and stderr in ``log_path``, ``env`` added to its environment
    (or, with ``replace_env``, made its whole environment), one intra-op thread, in a
    process group of its own."""
    process = context.Process(
        target=_child_entry,
        args=(dict(env), replace_env, str(log_path), target, args),
    )
    process.start()
    return process


def _child_entry(
    env: dict[str, str],
    replace_env: bool,
    log_path: str,
    target: Callable[..., None],
    args: tuple,
) -> None:
    # A group of its own: a deadline kills what this process started, too.
    os.setpgid(0, 0)
    # Send this process's output to its log (file descriptors, so C++ output too).
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    if replace_env:
        os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    target(*args)


def kill_child(process: Any) -> None:
    """Kill a process of :func:`start_child` and its process group, and reap it."""
    for kill in (os.killpg, os.kill):
        try:
            kill(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    process.join()


def _call(module: str, function: str, out_dir: str) -> None:
    getattr(importlib.import_module(module), function)(Path(out_dir))


def main_from_argv(fn: Callable[[Path], None]) -> None:
    """Entry point for ``torchrun ... -m MODULE OUT_DIR`` (a run by hand)."""
    fn(Path(sys.argv[1]))


def run_distributed(
    module: str,
    function: str,
    out_dir: Path,
    *,
    world_size: int = 2,
    timeout_s: float = 300.0,
    start: str = "fork",
) -> DistributedRun:
    """Run ``module.function(out_dir)`` on ``world_size`` local processes, with the
    ``torchrun`` environment variables set (the function initializes the group).

    Args:
        module (str): dotted module name, importable from the repo root.
        function (str): name of the function in ``module``.
        out_dir (Path): folder for the reports and logs.
        world_size (int): number of processes. Default: ``2``
        timeout_s (float): deadline for the whole run; processes still running then
            are killed. Default: ``300.0``
        start (str): how the processes start (module docstring): ``"preloaded"``
            or ``"fork"``. Default: ``"fork"``

    Returns:
        DistributedRun: the reports, return codes and output.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_paths = [out_dir / f"rank{rank}.log" for rank in range(world_size)]
    if start not in ("preloaded", "fork"):
        raise ValueError(f"start must be preloaded or fork, got {start!r}")
    if start == "preloaded":
        context = preloaded_context()
    else:
        context = multiprocessing.get_context("fork")
    procs = [
        start_child(
            context,
            _call,
            (module, function, str(out_dir)),
            rank_env(rank, world_size, port),
            log_paths[rank],
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    returncodes: list[int | None] = []
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        returncodes.append(proc.exitcode)
    timed_out = any(code is None for code in returncodes)
    for proc in procs:  # only the processes started above
        if proc.is_alive():
            kill_child(proc)

    output = []
    for rank, path in enumerate(log_paths):
        text = path.read_text(errors="replace") if path.exists() else ""
        output.append(f"[rank {rank}] ...{text[-4000:]}")
    reports = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {})
    return DistributedRun(reports, returncodes, timed_out, "\n".join(output))
