"""Benchmark: what checking step checkpoints' content costs, per GB.

A step checkpoint's manifest records the CRC-32 of every file
(:func:`torchtune.training.checkpointing._checkpoint_manager.file_checksum`): once
when it is saved, over files just written, and once before a resume loads it. This
script writes a ``model_optimizer.pt`` of ``--mib`` MiB of float32 tensors with
``torch.save``, as a step checkpoint does, then times, on the same file:

- ``torch.save`` (fsync included, as the checkpoint manager writes it);
- the CRC-32 right after the save (the file is in the page cache: the save's cost);
- the CRC-32 again, as a resume does before loading (warm cache here too: this
  script never drops the page cache, which would slow every other process on the
  machine; from a cold disk, reading the file costs what the load's own read costs,
  and the checksum runs at the speed of that read);
- ``torch.load`` of the file.

Each is the median of ``--repeats`` runs, reported in seconds per GB (10**9 bytes)
and MB/s, with the checksum's cost as a share of the save and of the load. Writes
``checkpoint_checksum.md`` (the table and the machine) and ``checkpoint_checksum.json``
(the raw numbers) to ``--out-dir``.

Example::

    python benchmarks/checkpoint_checksum.py --mib 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from torchtune.training.checkpointing._step_format import (
    file_checksum,
)


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="checkpoint size, MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: /tmp)")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path(__file__).resolve().parent / "results",
        help="where checkpoint_checksum.md and .json go",
    )
    args = parser.parse_args()

    numel = args.mib * (1 << 20) // 4
    # Tensors of a few sizes, as a model's and an optimizer's state are.
    sizes = [
        numel // 2,
        numel // 4,
        numel // 8,
        numel - numel // 2 - numel // 4 - numel // 8,
    ]
    state = {f"t{i}": torch.randn(n) for i, n in enumerate(sizes)}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "model_optimizer.pt"

        def save() -> None:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        seconds = {"torch.save (with fsync)": _timed(save, args.repeats)}
        gb = path.stat().st_size / 1e9
        seconds["CRC-32 after the save"] = _timed(
            lambda: file_checksum(path), args.repeats
        )
        load_s = _timed(lambda: torch.load(path, weights_only=True), args.repeats)
        seconds["CRC-32 before the load"] = _timed(
            lambda: file_checksum(path), args.repeats
        )
        seconds["torch.load"] = load_s

    save_share = seconds["CRC-32 after the save"] / seconds["torch.save (with fsync)"]
    load_share = seconds["CRC-32 before the load"] / seconds["torch.load"]
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op thread(s), 1-minute load average "
        f"{os.getloadavg()[0]:.1f} at the end, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    lines = [f"file: {gb * 1e3:.0f} MB, median of {args.repeats}"]
    lines.append(f"{'':28s}{'s/GB':>8s}{'MB/s':>9s}")
    for name, s in seconds.items():
        lines.append(f"{name:28s}{s / gb:8.3f}{gb * 1e3 / s:9.0f}")
    lines.append(
        f"checksums add {100 * save_share:.0f}% to a save and "
        f"{100 * load_share:.0f}% to a load"
    )
    print("\n".join(lines))

    args.out_dir.mkdir(parents=True, exist_ok=True)
    command = f"python benchmarks/checkpoint_checksum.py --mib {args.mib} "
    command += f"--repeats {args.repeats}"
    (args.out_dir / "checkpoint_checksum.md").write_text(
        "# What checking step checkpoints' content costs\n\n"
        f"`{command}` on {machine}. The page cache is warm throughout (see the "
        "script's docstring).\n\n```\n" + "\n".join(lines) + "\n```\n"
    )
    results = {
        "args": {"mib": args.mib, "repeats": args.repeats},
        "machine": machine,
        "file_bytes": round(gb * 1e9),
        "seconds": seconds,
        "seconds_per_gb": {name: s / gb for name, s in seconds.items()},
        "checksum_share_of_save": save_share,
        "checksum_share_of_load": load_share,
    }
    text = json.dumps(results, indent=1) + "\n"
    (args.out_dir / "checkpoint_checksum.json").write_text(text)


if __name__ == "__main__":
    main()
