"""Run a function on several local CPU processes that form a gloo process group, and
collect what each rank reports. A hung run is killed at a deadline instead of hanging
the test session.

Processes are forked from the test process where the platform allows it: they start
with torch and torchtune already imported, which on a busy 2-core machine saves about
40 s per launch compared with starting fresh interpreters. Each child uses one
intra-op thread, which keeps OpenMP safe after ``fork``. Elsewhere they are started as
``python -m MODULE OUT_DIR`` (see :func:`main_from_argv`).

The function receives ``OUT_DIR`` and reports by calling :func:`write_report`.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


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


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
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


def _forked_entry(
    env: dict[str, str], log_path: str, module: str, function: str, out_dir: str
) -> None:
    # Send this process's output to its log (file descriptors, so C++ output too).
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    getattr(importlib.import_module(module), function)(Path(out_dir))


def main_from_argv(fn: Callable[[Path], None]) -> None:
    """Entry point for ``python -m MODULE OUT_DIR`` (the non-fork start)."""
    fn(Path(sys.argv[1]))


def run_distributed(
    module: str,
    function: str,
    out_dir: Path,
    *,
    world_size: int = 2,
    timeout_s: float = 300.0,
    fork: bool = True,
) -> DistributedRun:
    """Run ``module.function(out_dir)`` on ``world_size`` local processes, with the
    ``torchrun`` environment variables set (the function initializes the group).

    Args:
        module (str): dotted module name, importable from the repo root.
        function (str): name of the function in ``module``; when processes cannot be
            forked, ``python -m module out_dir`` must call it.
        out_dir (Path): folder for the reports and logs.
        world_size (int): number of processes. Default: ``2``
        timeout_s (float): deadline for the whole run; processes still running then
            are killed. Default: ``300.0``
        fork (bool): fork this process (no interpreter start or import to pay) where
            the platform can; ``False`` starts fresh interpreters, which inherit
            nothing of what this process ran before (a compile worker pool, say).
            Default: ``True``

    Returns:
        DistributedRun: the reports, return codes and output.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_paths = [out_dir / f"rank{rank}.log" for rank in range(world_size)]
    can_fork = fork and "fork" in multiprocessing.get_all_start_methods()
    procs: list = []
    for rank in range(world_size):
        env = _rank_env(rank, world_size, port)
        if can_fork:
            proc = multiprocessing.get_context("fork").Process(
                target=_forked_entry,
                args=(env, str(log_paths[rank]), module, function, str(out_dir)),
            )
            proc.start()
        else:
            env["PYTHONPATH"] = os.pathsep.join(
                [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            )
            with open(log_paths[rank], "w") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", module, str(out_dir)],
                    cwd=REPO_ROOT,
                    env={**os.environ, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        procs.append(proc)

    deadline = time.monotonic() + timeout_s
    returncodes: list[int | None] = []
    for proc in procs:
        remaining = max(0.0, deadline - time.monotonic())
        if can_fork:
            proc.join(remaining)
            returncodes.append(proc.exitcode)
        else:
            try:
                returncodes.append(proc.wait(timeout=remaining))
            except subprocess.TimeoutExpired:
                returncodes.append(None)
    timed_out = any(code is None for code in returncodes)
    for proc in procs:  # only the processes started above
        if can_fork and proc.is_alive():
            proc.kill()
            proc.join()
        elif not can_fork and proc.poll() is None:
            proc.kill()
            proc.wait()

    output = []
    for rank, path in enumerate(log_paths):
        text = path.read_text(errors="replace") if path.exists() else ""
        output.append(f"[rank {rank}] ...{text[-4000:]}")
    reports = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {})
    return DistributedRun(reports, returncodes, timed_out, "\n".join(output))
