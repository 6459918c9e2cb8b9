"""Benchmark: optimizer in backward vs a plain optimizer step, on llama2 models.

Three modes, each run in a fresh process so that peak memory is its own:

- ``plain``: the optimizer stepped after ``backward()``.
- ``in_bwd``: :class:`torchtune.training.OptimizerInBackward` over the same optimizer.
- ``hooks_0_6_1``: torchtune 0.6.1's approach: one optimizer per parameter, stepped
  and cleared by a post-accumulate-grad hook.

Each mode runs with every optimizer of ``--optimizers``:

- ``adamw``: ``torch.optim.AdamW(foreach=True)``.
- ``adamw8bit``: ``bitsandbytes.optim.AdamW8bit`` (non-paged), whose two Adam states
  take 1 byte per parameter each. torchtune's Llama 3.x single-device full configs
  with ``optimizer_in_bwd: True`` use ``PagedAdamW8bit``, the same optimizer with paged
  state on CUDA; on CPU it falls back to this one. Like them, ``in_bwd`` and ``hooks_0_6_1`` build one bitsandbytes
  optimizer per parameter.

For every model size and optimizer it reports the median step time (forward,
backward, optimizer; the first step, which allocates the optimizer state, is a
warm-up and not timed), the bytes of optimizer state, and the peak memory of the
training steps: peak resident set size on CPU (Linux ``VmHWM``, reset after the model
and data are built), ``torch.cuda.max_memory_allocated`` on CUDA. The memory a mode
saves is the plain run's peak (same optimizer) minus its own, also given as a fraction
of the gradients' bytes: an optimizer in backward can save at most about all of them.

Writes ``optimizer_in_backward.md`` (table), ``optimizer_in_backward.png`` (plot) and
``optimizer_in_backward.json`` (raw numbers) to ``--out-dir``.

Examples::

    # the 70M model, torch AdamW only, a few steps per mode (2 minutes on 2 CPU cores)
    python benchmarks/optimizer_in_backward.py --sizes 70m --optimizers adamw --steps 4
    # the default sweep: both optimizers; 10m, 70m, 200m on CPU; 200m, 1b, 3b on CUDA
    python benchmarks/optimizer_in_backward.py
    python benchmarks/optimizer_in_backward.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

MODES = ("plain", "in_bwd", "hooks_0_6_1")
MODE_LABELS = {
    "plain": "plain step",
    "in_bwd": "OptimizerInBackward",
    "hooks_0_6_1": "0.6.1 per-parameter hooks",
}
OPTIMIZERS = ("adamw", "adamw8bit")
OPTIMIZER_LABELS = {
    "adamw": "torch AdamW (foreach)",
    "adamw8bit": "bitsandbytes AdamW8bit",
}
# llama2 shapes; parameter counts with these vocabularies in the comments.
SIZES: dict[str, dict[str, int]] = {
    # 9.2M
    "10m": dict(vocab_size=8000, num_layers=6, embed_dim=256, num_heads=4),
    # 68.9M: 8 layers, dim 768 (263 MiB = 276 MB of fp32 gradients)
    "70m": dict(vocab_size=8000, num_layers=8, embed_dim=768, num_heads=12),
    # 196M
    "200m": dict(vocab_size=8000, num_layers=14, embed_dim=1024, num_heads=16),
    # 953M
    "1b": dict(vocab_size=32000, num_layers=16, embed_dim=2048, num_heads=16),
    # 3.1B
    "3b": dict(vocab_size=32000, num_layers=26, embed_dim=3072, num_heads=24),
}
DEFAULT_SIZES = {"cpu": "10m,70m,200m", "cuda": "200m,1b,3b"}
MIB = 1024**2

# -- one measurement, in a fresh process ---------------------------------------------


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status (Linux only)")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _StepsInBackward:
    """The training loop's optimizer for the 0.6.1 mode: its hooks already did it all."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def optimizer_builder(name: str) -> Callable[..., Any]:
    """``name``'s optimizer class with the benchmark's hyperparameters bound: call it
    with a list of parameters."""
    hyperparameters = dict(lr=2e-5, weight_decay=0.01)
    if name == "adamw":
        import torch

        return functools.partial(torch.optim.AdamW, foreach=True, **hyperparameters)
    import bitsandbytes

    # Tensors under bitsandbytes' min_8bit_size (4096 elements: the norm weights)
    # keep 32-bit state, as in training.
    return functools.partial(bitsandbytes.optim.AdamW8bit, **hyperparameters)


def _state_bytes(optimizers: Iterable[Any]) -> int:
    import torch

    return sum(
        value.numel() * value.element_size()
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model and the optimizer of ``args.optimizer`` in ``args.mode``, train,
    report time and memory."""
    import torch
    from torch import nn

    from torchtune.models.llama2 import llama2
    from torchtune.training import OptimizerInBackward

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = SIZES[args.size]
    torch.manual_seed(0)
    with torch.device(device):
        model = llama2(
            num_kv_heads=shape["num_heads"], max_seq_len=args.seq_len, **shape
        ).to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    make_optimizer = optimizer_builder(args.optimizer)
    if args.mode == "plain":
        optimizer = make_optimizer(params)
        state_holders = [optimizer]
    elif args.mode == "in_bwd":
        optimizer = OptimizerInBackward(params, make_optimizer)
        # Its per-parameter optimizers work on views of this one's state.
        state_holders = [optimizer]
    else:
        # What torchtune 0.6.1's recipes build: one optimizer per parameter (works
        # for bitsandbytes as for torch), stepped and cleared by
        # register_optim_in_bwd_hooks' hook.
        per_param = {p: make_optimizer([p]) for p in params}

        def step_and_free(param: torch.Tensor) -> None:
            per_param[param].step()
            per_param[param].zero_grad(set_to_none=True)

        for p in params:
            p.register_post_accumulate_grad_hook(step_and_free)
        optimizer = _StepsInBackward()
        state_holders = list(per_param.values())

    tokens = torch.randint(
        0,
        shape["vocab_size"],
        (args.batch_size, args.seq_len + 1),
        generator=torch.Generator().manual_seed(0),
    ).to(device)
    loss_fn = nn.CrossEntropyLoss()
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    # Peak memory of the training steps only: model and data are built by now.
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        _reset_peak_rss()
        baseline = _peak_rss_bytes()

    step_times, cpu_times = [], []
    for step in range(args.warmup + args.steps):
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        logits = model(tokens[:, :-1])
        loss = loss_fn(
            logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if step >= args.warmup:
            step_times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        del logits, loss
    peak = torch.cuda.max_memory_allocated(device) if cuda else _peak_rss_bytes()
    return {
        "size": args.size,
        "optimizer": args.optimizer,
        "mode": args.mode,
        "params": sum(p.numel() for p in params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
        "state_bytes": _state_bytes(state_holders),
        "step_times_s": step_times,
        "cpu_times_s": cpu_times,
        "peak_bytes": peak,
        "baseline_bytes": baseline,
        # How busy the machine was: this process counts for about its thread count.
        "load_average_1min": os.getloadavg()[0],
    }


# -- the sweep -----------------------------------------------------------------------


def run_fresh_process(
    args: argparse.Namespace, size: str, optimizer: str, mode: str
) -> dict[str, Any]:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--measure",
        "--size", size,
        "--optimizer", optimizer,
        "--mode", mode,
        "--device", args.device,
        "--dtype", args.dtype,
        "--batch-size", str(args.batch_size),
        "--seq-len", str(args.seq_len),
        "--steps", str(args.steps),
        "--warmup", str(args.warmup),
        "--threads", str(args.threads),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{size}/{optimizer}/{mode} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (size, optimizer, mode): median step time over all timed steps of
    all repeats, median peak over repeats, and both relative to the plain step with
    the same optimizer."""
    rows = []
    for size, optimizer in dict.fromkeys((r["size"], r["optimizer"]) for r in runs):
        by_mode = {}
        for mode in MODES:
            mine = [
                r
                for r in runs
                if (r["size"], r["optimizer"], r["mode"]) == (size, optimizer, mode)
            ]
            if mine:
                by_mode[mode] = {
                    "size": size,
                    "optimizer": optimizer,
                    "mode": mode,
                    "params": mine[0]["params"],
                    "grad_bytes": mine[0]["grad_bytes"],
                    "state_bytes": mine[0]["state_bytes"],
                    "step_s": statistics.median(
                        t for r in mine for t in r["step_times_s"]
                    ),
                    "cpu_step_s": statistics.median(
                        t for r in mine for t in r["cpu_times_s"]
                    ),
                    "peak_bytes": statistics.median(r["peak_bytes"] for r in mine),
                }
        plain = by_mode.get("plain")
        for row in by_mode.values():
            if plain is not None:
                row["time_vs_plain"] = row["step_s"] / plain["step_s"]
                row["cpu_time_vs_plain"] = row["cpu_step_s"] / plain["cpu_step_s"]
                row["saved_bytes"] = plain["peak_bytes"] - row["peak_bytes"]
                row["saved_of_grads"] = row["saved_bytes"] / row["grad_bytes"]
            rows.append(row)
    return rows


def markdown(
    rows: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    args: argparse.Namespace,
    env: str,
) -> str:
    cpu = args.device == "cpu"
    memory = "peak RSS" if cpu else "max allocated"
    optimizers = ", ".join(OPTIMIZER_LABELS[o] for o in args.optimizers.split(","))
    lines = [
        "# Optimizer in backward: step time and peak memory",
        "",
        env,
        "",
        f"llama2, {args.dtype}, batch {args.batch_size} x {args.seq_len} tokens, "
        f"optimizers: {optimizers}; median of {args.steps} timed steps per run after "
        f"{args.warmup} warm-up step(s), {args.repeats} fresh process(es) per mode. "
        f"Peak memory: {memory} during the training steps. Each mode is compared with "
        "the plain step of the same optimizer. Targets for OptimizerInBackward: peak "
        "memory below plain by >= 90% of the gradient bytes; step time <= 1.05x plain.",
    ]
    if cpu:
        lines += [
            "",
            "Step time is given as wall-clock time and as the process's CPU time "
            "(`time.process_time`). On a machine whose cores other work shares, CPU "
            "time is the steadier measure of the work a mode does.",
        ]
        loads = [r["load_average_1min"] for r in runs]
        lines += [
            "",
            f"1-minute load average at the end of each run: {min(loads):.1f} to "
            f"{max(loads):.1f} (the benchmark's own process counts for about its "
            "thread count).",
        ]
    if args.note:
        lines += ["", f"Note: {args.note}"]
    header = (
        "| model | params | gradients (MiB) | optimizer | optimizer state (MiB) "
        "| mode | step (s) | vs plain |"
    )
    rule = "|---|---:|---:|---|---:|---|---:|---:|"
    if cpu:
        header += " CPU time / step (s) | vs plain |"
        rule += "---:|---:|"
    header += f" {memory} (MiB) | saved (MiB) | saved / gradients |"
    rule += "---:|---:|---:|"
    lines += ["", header, rule]
    nan = float("nan")
    for r in rows:
        line = (
            f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['grad_bytes'] / MIB:.0f} | "
            f"{OPTIMIZER_LABELS[r['optimizer']]} | {r['state_bytes'] / MIB:.0f} | "
            f"{MODE_LABELS[r['mode']]} | {r['step_s']:.3f} | "
            f"{r.get('time_vs_plain', nan):.3f}x |"
        )
        if cpu:
            line += f" {r['cpu_step_s']:.3f} | {r.get('cpu_time_vs_plain', nan):.3f}x |"
        line += (
            f" {r['peak_bytes'] / MIB:.0f} | {r.get('saved_bytes', 0) / MIB:.0f} | "
            f"{r.get('saved_of_grads', 0):.0%} |"
        )
        lines.append(line)
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, cpu: bool) -> None:
    """One row of panels per optimizer: peak memory, memory saved, step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    optimizers = list(dict.fromkeys(r["optimizer"] for r in rows))
    fig, axes = plt.subplots(
        len(optimizers),
        3,
        figsize=(15, 4.2 * len(optimizers)),
        sharey="col",
        squeeze=False,
    )
    memory = "peak RSS" if cpu else "max allocated"
    for optimizer, (ax_mem, ax_saved, ax_time) in zip(optimizers, axes, strict=True):
        for index, mode in enumerate(MODES):
            mine = [r for r in rows if (r["optimizer"], r["mode"]) == (optimizer, mode)]
            if not mine:
                continue
            color = f"C{index}"
            x = [r["params"] / 1e6 for r in mine]
            label = MODE_LABELS[mode]
            ax_mem.plot(
                x, [r["peak_bytes"] / MIB for r in mine], "o-", c=color, label=label
            )
            if mode == "plain" or not all("saved_of_grads" in r for r in mine):
                continue
            ax_saved.plot(
                x, [100 * r["saved_of_grads"] for r in mine], "o-", c=color, label=label
            )
            ax_time.plot(
                x,
                [r["time_vs_plain"] for r in mine],
                "o-",
                c=color,
                label=f"{label}, wall",
            )
            if cpu:
                ax_time.plot(
                    x,
                    [r["cpu_time_vs_plain"] for r in mine],
                    "s--",
                    c=color,
                    label=f"{label}, CPU time",
                )
        ax_saved.axhline(90, color="gray", ls=":", lw=1, label="target >= 90%")
        ax_time.axhline(1.05, color="gray", ls=":", lw=1, label="target <= 1.05x")
        ax_time.axhline(1.0, color="black", lw=0.5)
        name = OPTIMIZER_LABELS[optimizer]
        for ax, title, ylabel in (
            (ax_mem, "Peak memory", f"{memory} (MiB)"),
            (ax_saved, "Memory saved vs plain", "% of gradient bytes"),
            (ax_time, "Step time vs plain", "x plain"),
        ):
            ax.set_xscale("log")
            ax.set_xlabel("parameters (M)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}: {name}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(args: argparse.Namespace) -> str:
    import torch

    if args.device == "cuda":
        where = torch.cuda.get_device_name()
    else:
        where = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    threads = args.threads or torch.get_num_threads()
    versions = f"torch {torch.__version__}"
    if "adamw8bit" in args.optimizers.split(","):
        import bitsandbytes

        versions += f", bitsandbytes {bitsandbytes.__version__}"
    return (
        f"Device: {args.device} ({where}); {versions}; "
        f"{threads} intra-op thread(s); {time.strftime('%Y-%m-%d %H:%M')}."
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument(
        "--sizes",
        default=None,
        help=f"comma-separated, from {','.join(SIZES)} (default: {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--optimizers",
        default=",".join(OPTIMIZERS),
        help=f"comma-separated, from {','.join(OPTIMIZERS)} (default: all)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    parser.add_argument("--repeats", type=int, default=1, help="fresh runs per mode")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path(__file__).resolve().parent / "results",
    )
    parser.add_argument("--note", default="", help="added to the markdown report")
    # Internal: measure one (size, optimizer, mode) in this process, print it as JSON.
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args)))
        return
    sizes = (args.sizes or DEFAULT_SIZES[args.device]).split(",")
    optimizers = args.optimizers.split(",")
    modes = args.modes.split(",")
    for kind, asked, known in (
        ("sizes", sizes, SIZES),
        ("optimizers", optimizers, OPTIMIZERS),
        ("modes", modes, MODES),
    ):
        unknown = [name for name in asked if name not in known]
        if unknown:
            raise ValueError(f"unknown {kind} {unknown}; choose from {list(known)}")
    runs = []
    for size in sizes:
        for repeat in range(args.repeats):
            for optimizer in optimizers:
                # Modes alternate, so slow drift in machine load affects them alike.
                for mode in modes:
                    run = run_fresh_process(args, size, optimizer, mode)
                    runs.append(run)
                    print(
                        f"{size} {optimizer} {mode} (run {repeat + 1}): median step "
                        f"{statistics.median(run['step_times_s']):.3f} s (CPU time "
                        f"{statistics.median(run['cpu_times_s']):.3f} s), peak "
                        f"{run['peak_bytes'] / MIB:.0f} MiB",
                        flush=True,
                    )
    rows = summarize(runs)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = markdown(rows, runs, args, environment(args))
    stem = args.out_dir / "optimizer_in_backward"
    stem.with_suffix(".md").write_text(report)
    stem.with_suffix(".json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "runs": runs,
                "rows": rows,
            },
            indent=1,
        )
    )
    plot(rows, stem.with_suffix(".png"), cpu=args.device == "cpu")
    print(report)
    print(f"wrote {stem}.md, .png and .json")


if __name__ == "__main__":
    main()
