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
and MB/s, with the checksum's cost as a share of the save and of the load.

Example::

    python benchmarks/checkpoint_checksum.py --mib 512 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from torchtune.training.checkpointing._checkpoint_manager import file_checksum


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

        save_s = _timed(save, args.repeats)
        gb = path.stat().st_size / 1e9
        crc_after_save_s = _timed(lambda: file_checksum(path), args.repeats)
        load_s = _timed(lambda: torch.load(path, weights_only=True), args.repeats)
        crc_before_load_s = _timed(lambda: file_checksum(path), args.repeats)

    print(f"file: {gb * 1e3:.0f} MB, median of {args.repeats}")
    print(f"{'':28s}{'s/GB':>8s}{'MB/s':>9s}")
    for name, seconds in (
        ("torch.save (with fsync)", save_s),
        ("CRC-32 after the save", crc_after_save_s),
        ("CRC-32 before the load", crc_before_load_s),
        ("torch.load", load_s),
    ):
        print(f"{name:28s}{seconds / gb:8.3f}{gb * 1e3 / seconds:9.0f}")
    print(
        f"checksums add {100 * crc_after_save_s / save_s:.0f}% to a save and "
        f"{100 * crc_before_load_s / load_s:.0f}% to a load"
    )


if __name__ == "__main__":
    main()
