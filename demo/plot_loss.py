"""Plot the demo's loss with ``optimizer_in_bwd`` on and off: the curves coincide.

Runs ``tune run full_finetune_single_device --config demo/single_device.yaml``
twice, with ``optimizer_in_bwd=True`` and ``optimizer_in_bwd=False`` and the same
seed, reads the loss of every step back from each run's ``DiskLogger`` file, prints
the largest difference between the two curves, and draws both on one PNG
(``docs/source/_static/demo_loss.png`` by default). The two modes compute the same
numbers (both divide the gradients by the step's token count with the same
operation: after backward, or inside it just before each update), so the curves
are bitwise equal.

Usage, from the repository root, after ``python -m demo.make_demo_assets``::

    python -m demo.plot_loss [--config CFG] [--out PNG] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# A Figure made directly (not through pyplot) draws with Agg: no display needed.
from matplotlib.figure import Figure

from tests.recipes.utils import run_tune

DEFAULT_CONFIG = Path("demo/single_device.yaml")
DEFAULT_OUT = Path("docs/source/_static/demo_loss.png")
RUNS_DIR = Path("outputs/demo/plot_loss")


def plot(losses: dict[bool, list[float]], out: Path, title: str) -> None:
    """Draw both loss curves, and their absolute difference below them.

    Args:
        losses (dict[bool, list[float]]): per-step losses by ``optimizer_in_bwd``.
        out (Path): the PNG to write.
        title (str): the figure title.
    """
    steps = range(1, len(losses[True]) + 1)
    diff = [abs(a - b) for a, b in zip(losses[True], losses[False], strict=True)]
    fig = Figure(figsize=(6.4, 4.8), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot(steps, losses[False], color="tab:blue", lw=3.5, alpha=0.45)
    top.plot(steps, losses[True], color="tab:orange", lw=1.2)
    top.legend(
        ["optimizer_in_bwd=False (plain AdamW)", "optimizer_in_bwd=True"],
        frameon=False,
    )
    top.set_yscale("log")
    top.set_ylabel("training loss")
    top.set_title(title, fontsize=10)
    top.grid(alpha=0.3, which="both")
    bottom.plot(steps, diff, color="black", lw=0.8)
    bottom.set_ylabel("|difference|")
    bottom.set_xlabel("step")
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    bottom.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="(default: %(default)s)"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="(default: %(default)s)"
    )
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds per run (default: 900)"
    )
    args, overrides = parser.parse_known_args(argv)

    losses: dict[bool, list[float]] = {}
    for in_bwd in (True, False):
        run = run_tune(
            "full_finetune_single_device",
            args.config.resolve(),
            [*overrides, f"optimizer_in_bwd={in_bwd}"],
            output_dir=RUNS_DIR / f"optimizer_in_bwd_{in_bwd}",
            timeout=args.timeout,
            # One thread per process is fastest for a model this small.
            env={"OMP_NUM_THREADS": "1"},
        )
        losses[in_bwd] = run.losses
        print(
            f"optimizer_in_bwd={in_bwd}: {len(run.losses)} steps in {run.wall_s:.0f} s, "
            f"loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f}"
        )

    diff = [abs(a - b) for a, b in zip(losses[True], losses[False], strict=True)]
    worst = max(range(len(diff)), key=diff.__getitem__)
    print(
        f"max |loss(in-bwd) - loss(plain)| = {diff[worst]:.3g} at step {worst + 1} "
        f"(loss {losses[False][worst]:.4f})"
    )
    (RUNS_DIR / "losses.json").write_text(
        json.dumps({"optimizer_in_bwd": losses[True], "plain": losses[False]}) + "\n"
    )
    plot(
        losses,
        args.out,
        f"Demo ({args.config.name}): 2-layer Llama, 4-digit reversal, AdamW, seed 0",
    )
    print(f"Wrote {args.out} ({args.out.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
