"""Benchmark: what a run's ``output_dir`` costs on disk, once and after reruns.

Runs ``tune run full_finetune_single_device`` on the tests' tiny config (the 2-layer
Llama2 of ``tests/assets/make_assets.py``, fp32, AdamW, in-backward) for one epoch
in a fresh ``output_dir``, then the same command three more times in the same folder
(a user rerunning a command), and once more with
``checkpointer.keep_last_n_checkpoints=1`` (a user who asks to keep more). After
each run it records the bytes of the folder, by part:

- what torchtune 0.6.1 writes for the same command: the ``epoch_0`` export (written
  by the same checkpointer, so the same bytes), ``logs/`` and the config copy; 0.6.1
  writes no recipe state after the final epoch of a run;
- what this build adds: its small metadata (``torchtune_run.json``, the exports'
  manifests) and, when asked, step checkpoints.

Writes ``folder_size.md`` and ``folder_size.json`` to ``--out-dir``.

Example::

    python benchmarks/folder_size.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AS_IN_0_6_1 = ("epoch_", "logs", "torchtune_config.yaml")


def folder_bytes(root: Path) -> dict[str, int]:
    """Bytes of ``root``'s files, as 0.6.1 would have written them and the rest."""
    parts = {"as in 0.6.1": 0, "metadata": 0, "step checkpoints": 0}
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        top = path.relative_to(root).parts[0]
        if top.startswith("step_"):
            parts["step checkpoints"] += path.stat().st_size
        elif top.startswith(AS_IN_0_6_1):
            parts["as in 0.6.1"] += path.stat().st_size
        else:
            parts["metadata"] += path.stat().st_size
    return parts


def tune_run(out: Path, assets: Path, *more: str) -> None:
    command = [
        sys.executable,
        "-m",
        "torchtune._cli.tune",
        "run",
        "full_finetune_single_device",
        "--config",
        str(REPO / "tests/recipes/configs/tiny_full_single_device.yaml"),
        f"assets_dir={assets}",
        f"output_dir={out}",
        "epochs=1",
        "max_steps_per_epoch=3",
        "optimizer_in_bwd=True",
        *more,
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks/results")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.assets.make_assets import ensure_assets

    assets = ensure_assets(REPO / "tests/assets/generated").root
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        runs = [("first run", ())] + [(f"rerun {i}", ()) for i in (1, 2, 3)]
        runs.append(
            ("rerun, keeping more", ("checkpointer.keep_last_n_checkpoints=1",))
        )
        for name, more in runs:
            tune_run(out, assets, *more)
            parts = folder_bytes(out)
            rows.append({"run": name, **parts, "total": sum(parts.values())})
            print(rows[-1])
    lines = [
        "# What a run's output_dir costs on disk",
        "",
        "`python benchmarks/folder_size.py`: the tests' tiny Llama2 (fp32, AdamW,",
        "in-backward), `full_finetune_single_device`, one epoch of 3 steps, in one",
        'folder. Bytes after each run. "As in 0.6.1" is what torchtune 0.6.1 writes',
        "for the same command (the epoch export by the same checkpointer, the logs,",
        "the config copy); the other columns are what this build adds.",
        "",
        "| after | as in 0.6.1 | metadata | step checkpoints | total | total / 0.6.1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ratio = row["total"] / row["as in 0.6.1"]
        lines.append(
            f"| {row['run']} | {row['as in 0.6.1']:,} | {row['metadata']:,} | "
            f"{row['step checkpoints']:,} | {row['total']:,} | {ratio:.3f} |"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "folder_size.md").write_text("\n".join(lines) + "\n")
    (args.out_dir / "folder_size.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
