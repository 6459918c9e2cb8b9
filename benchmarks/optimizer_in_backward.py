"""Benchmark: optimizer in backward vs a plain optimizer step, on llama2 models.

Modes (``--modes``):

- ``plain``: the optimizer stepped after ``backward()``, with the gradient norm taken
  by ``nn.utils.get_total_norm`` as the recipes log it.
- ``hooks_0_6_1``: torchtune 0.6.1's approach: one optimizer per parameter, stepped
  and cleared by a bare post-accumulate-grad hook (no gradient norm, no LR scheduler
  reach, no plain-format checkpoints).
- ``in_bwd_per_param``: :class:`torchtune.training.OptimizerInBackward` with
  ``bucket_cap_mb=0``: one optimizer call per parameter, the lowest memory.
- ``in_bwd_bucketed``: ``OptimizerInBackward`` with its default bucket cap
  (:data:`torchtune.training.memory.DEFAULT_BUCKET_CAP_MB`).
- ``in_bwd_cap<N>``: ``OptimizerInBackward`` with ``bucket_cap_mb=N``, to compare caps.
- ``plain_clip``: the plain step with global-norm gradient clipping on:
  ``training.scale_and_clip_grads_(params, max_norm=MAX_NORM)`` (which also gives the
  norm) between ``backward()`` and ``step()``.
- ``in_bwd_clip``: ``OptimizerInBackward`` with its default bucket cap and
  ``max_norm=MAX_NORM``, i.e. exact clipping inside ``optimizer.backward(loss)``: a
  measuring backward pass, then an updating one over the same graph.

The two clipping modes are not in the default set (``--modes``; see the last example).
``MAX_NORM`` is small enough that every step clips, so the clipping code runs. The
in-backward modes train with ``optimizer.backward(loss)`` (one backward pass when
they do not clip, the same as ``loss.backward()``). Each step's time is also split
into phases (forward; backward, with the in-backward updates; the rest: norm, clipping,
``step()``), and for ``in_bwd_clip`` its backward into the measuring and the updating
pass, timed at ``backward``'s ``before_update_pass`` callback.

Optimizers (``--optimizers``): ``adamw`` (``torch.optim.AdamW(foreach=True)``) and
``adamw8bit`` (bitsandbytes' ``AdamW8bit``, non-paged: torchtune's Llama 3.x
single-device full configs use ``PagedAdamW8bit``, the same optimizer with paged
state on CUDA, which falls back to it on CPU).

Step time (forward, backward, optimizer; the first steps, which allocate the
optimizer state, are warm-up and not timed) is measured with all modes of a size in
one process, their steps alternating in a rotating order, so that drift in machine
load affects them alike; each step's time is compared with the plain step of the
same round, and the report gives the median of those paired ratios and their
spread. Sizes whose models do not fit together in memory are timed in repeated
fresh processes instead (``--timing fresh``), compared repeat by repeat. Peak memory
is always measured with each mode in a fresh process of its own: peak resident set
size on CPU (Linux ``VmHWM``, reset after the model and data are built),
``torch.cuda.max_memory_allocated`` on CUDA. The memory a mode saves is the plain
run's peak (same optimizer) minus its own, also given as a fraction of the
gradients' bytes; the memory a bucketed mode costs is its peak minus the
per-parameter mode's.

Writes ``<name>.md`` (table), ``<name>.png`` (plot) and ``<name>.json`` (raw numbers)
to ``--out-dir``, ``<name>`` being ``--out-name`` (default ``optimizer_in_backward``).

Examples::

    # the 10M model, torch AdamW only (about a minute on 2 CPU cores)
    python benchmarks/optimizer_in_backward.py --sizes 10m --optimizers adamw
    # the default sweep; 10m, 70m, 200m on CPU; 200m, 1b, 3b on CUDA
    python benchmarks/optimizer_in_backward.py --threads 2
    # which bucket cap: add caps of 4 and 64 MiB to the modes
    python benchmarks/optimizer_in_backward.py --sizes 10m,70m --extra-caps 4,64
    python benchmarks/optimizer_in_backward.py --device cuda --dtype bfloat16
    # what clipping costs, plain and in backward (results/optimizer_in_backward_clipping)
    python benchmarks/optimizer_in_backward.py --threads 1 --optimizers adamw \
        --modes plain,plain_clip,in_bwd_bucketed,in_bwd_clip --steps 30 \
        --size-steps 70m=24,200m=16 --interleave-gib 14 --out-name optimizer_in_backward_clipping
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

# The default modes; ALL_MODES adds the clipping ones.
MODES = ("plain", "hooks_0_6_1", "in_bwd_per_param", "in_bwd_bucketed")
ALL_MODES = (*MODES, "plain_clip", "in_bwd_clip")
MODE_LABELS = {
    "plain": "plain step",
    "hooks_0_6_1": "0.6.1 bare hooks",
    "in_bwd_per_param": "OptimizerInBackward, per parameter",
    "in_bwd_bucketed": "OptimizerInBackward, bucketed (default)",
    "plain_clip": "plain step, clipping",
    "in_bwd_clip": "OptimizerInBackward, bucketed, clipping",
}
# The ratios' references: every mode's step time is compared with theirs, when run.
REFERENCES = {
    "plain": "plain",
    "hooks_0_6_1": "0.6.1 hooks",
    "in_bwd_bucketed": "in bwd, no clip",
}
# Each clipping mode's counterpart without clipping.
UNCLIPPED = {"plain_clip": "plain", "in_bwd_clip": "in_bwd_bucketed"}
# The clipping modes' max_norm: far below the gradient norm of these models, so that
# every step clips (a max_norm above the norm would only measure).
MAX_NORM = 1e-3
OPTIMIZERS = ("adamw", "adamw8bit")
OPTIMIZER_LABELS = {
    "adamw": "torch AdamW (foreach)",
    "adamw8bit": "bitsandbytes AdamW8bit",
}
# llama2 shapes (parameter counts with these vocabularies), and the batch each is
# timed with by default: batch x sequence length.
SIZES: dict[str, dict[str, int]] = {
    # 9.2M; 6 layers of 0.79M parameters (3.2 MB of fp32 gradients each)
    "10m": dict(vocab_size=8000, num_layers=6, embed_dim=256, num_heads=4),
    # 68.9M; 8 layers of 7.1M (28 MB each); 263 MiB of fp32 gradients
    "70m": dict(vocab_size=8000, num_layers=8, embed_dim=768, num_heads=12),
    # 196M; 14 layers of 12.6M (50 MB each)
    "200m": dict(vocab_size=8000, num_layers=14, embed_dim=1024, num_heads=16),
    # 953M
    "1b": dict(vocab_size=32000, num_layers=16, embed_dim=2048, num_heads=16),
    # 3.1B
    "3b": dict(vocab_size=32000, num_layers=26, embed_dim=3072, num_heads=24),
}
BATCHES: dict[str, tuple[int, int]] = {
    "10m": (2, 64),
    "70m": (1, 32),
    "200m": (1, 32),
    "1b": (2, 512),
    "3b": (2, 512),
}
DEFAULT_SIZES = {"cpu": "10m,70m,200m", "cuda": "200m,1b,3b"}
MIB = 1024**2
# A step's phases, each timed from the end of the one before: the forward pass and
# loss; for in_bwd_clip, the measuring backward pass; backward (for in_bwd_clip its
# updating pass), with the parameter updates of the in-backward modes; the rest
# (gradient norm, clipping, ``step()``, ``zero_grad()``).
_PHASES = ("forward", "measure_pass", "backward", "rest")


def _steps_for(args: argparse.Namespace, size: str) -> int:
    """Timed steps at ``size``: ``--size-steps`` where it names the size, else
    ``--steps``."""
    for item in filter(None, args.size_steps.split(",")):
        name, _, count = item.partition("=")
        if name.strip() == size:
            return int(count)
    return args.steps


def mode_label(mode: str) -> str:
    if mode.startswith("in_bwd_cap"):
        return f"OptimizerInBackward, {mode[len('in_bwd_cap') :]} MiB buckets"
    return MODE_LABELS[mode]


def bucket_cap_mb(mode: str) -> float | None:
    """The ``bucket_cap_mb`` an in-backward mode passes (``None``: the default)."""
    if mode == "in_bwd_per_param":
        return 0.0
    if mode in ("in_bwd_bucketed", "in_bwd_clip"):
        return None
    return float(mode[len("in_bwd_cap") :])


# -- measurements, in a fresh process -----------------------------------------------


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


def _build_mode(
    mode: str,
    model: Any,
    make_optimizer: Callable[..., Any],
) -> tuple:
    """The training loop's optimizer for ``mode`` over ``model``, and the objects that
    hold its state."""
    from torchtune.training import OptimizerInBackward

    params = [p for p in model.parameters() if p.requires_grad]
    if mode in ("plain", "plain_clip"):
        optimizer = make_optimizer(params)
        return optimizer, [optimizer]
    if mode == "hooks_0_6_1":
        # What torchtune 0.6.1's recipes build: one optimizer per parameter (for
        # bitsandbytes as for torch), stepped and cleared by a bare hook.
        per_param = {p: make_optimizer([p]) for p in params}

        def step_and_free(param: Any) -> None:
            per_param[param].step()
            per_param[param].zero_grad(set_to_none=True)

        for p in params:
            p.register_post_accumulate_grad_hook(step_and_free)
        return _StepsInBackward(), list(per_param.values())
    optimizer = OptimizerInBackward(
        params,
        make_optimizer,
        bucket_cap_mb=bucket_cap_mb(mode),
        max_norm=MAX_NORM if mode == "in_bwd_clip" else None,
    )
    # Its bucket optimizers work on views of this one's state.
    return optimizer, [optimizer]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build one model per mode of ``args.modes`` (same seed), then train them in
    rounds: each round runs one step of every mode, in an order that rotates from
    round to round. Reports each mode's step times and the process's peak memory
    (meaningful when there is one mode)."""
    import torch
    from torch import nn

    from torchtune import training
    from torchtune.models.llama2 import llama2
    from torchtune.training.gradients import clip_coefficient

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = SIZES[args.size]
    batch_size, seq_len = BATCHES[args.size]
    batch_size, seq_len = args.batch_size or batch_size, args.seq_len or seq_len
    steps = _steps_for(args, args.size)
    modes = args.modes.split(",")
    make_optimizer = optimizer_builder(args.optimizer)
    runs: dict[str, dict[str, Any]] = {}
    for mode in modes:
        torch.manual_seed(0)
        with torch.device(device):
            model = llama2(
                num_kv_heads=shape["num_heads"], max_seq_len=seq_len, **shape
            ).to(dtype)
        optimizer, state_holders = _build_mode(mode, model, make_optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
        if hasattr(optimizer, "_buckets"):
            buckets = [bucket.params for bucket in optimizer._buckets]
        else:
            buckets = [[p] for p in params]
        runs[mode] = {
            "model": model,
            "optimizer": optimizer,
            "state_holders": state_holders,
            "params": sum(p.numel() for p in params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in params),
            "buckets": len(buckets),
            "max_bucket_bytes": max(
                sum(p.numel() * p.element_size() for p in bucket) for bucket in buckets
            ),
            "step_times_s": [],
            "cpu_times_s": [],
            # Per step, CPU seconds of each phase (see _PHASES).
            "phase_cpu_s": {phase: [] for phase in _PHASES},
            "clip_coefs": [],
        }
    tokens = torch.randint(
        0,
        shape["vocab_size"],
        (batch_size, seq_len + 1),
        generator=torch.Generator().manual_seed(0),
    ).to(device)
    loss_fn = nn.CrossEntropyLoss()
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def train_step(mode: str) -> dict[str, float]:
        """One step; returns the process CPU time at the end of each phase."""
        model, optimizer = runs[mode]["model"], runs[mode]["optimizer"]
        marks: dict[str, float] = {}

        def mark(phase: str) -> None:
            sync()
            marks[phase] = time.process_time()

        logits = model(tokens[:, :-1])
        loss = loss_fn(
            logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1)
        )
        mark("forward")
        if mode in ("plain", "plain_clip", "hooks_0_6_1"):
            loss.backward()
        elif mode == "in_bwd_clip":
            # Called between the measuring and the updating pass.
            optimizer.backward(loss, before_update_pass=lambda: mark("measure_pass"))
        else:
            optimizer.backward(loss)
        mark("backward")
        # The gradient norm the recipes log, in the way each mode can give it (the
        # 0.6.1 hooks cannot).
        if mode == "plain_clip":
            params = [p for p in model.parameters() if p.requires_grad]
            norm = training.scale_and_clip_grads_(params, max_norm=MAX_NORM)
            runs[mode]["clip_coefs"].append(clip_coefficient(MAX_NORM, norm).item())
        elif mode == "plain":
            nn.utils.get_total_norm([p.grad for p in model.parameters()])
        elif mode == "in_bwd_clip":
            norm = optimizer.grad_norm
            runs[mode]["clip_coefs"].append(clip_coefficient(MAX_NORM, norm).item())
        elif mode != "hooks_0_6_1":
            _ = optimizer.grad_norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark("rest")
        return marks

    # Peak memory of the training steps only: models and data are built by now.
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        _reset_peak_rss()
        baseline = _peak_rss_bytes()
    for round_index in range(args.warmup + steps):
        shift = round_index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            marks = train_step(mode)
            sync()
            if round_index >= args.warmup:
                runs[mode]["step_times_s"].append(time.perf_counter() - start)
                runs[mode]["cpu_times_s"].append(time.process_time() - cpu_start)
                previous = cpu_start
                for phase in _PHASES:
                    if phase in marks:
                        runs[mode]["phase_cpu_s"][phase].append(marks[phase] - previous)
                        previous = marks[phase]
    peak = torch.cuda.max_memory_allocated(device) if cuda else _peak_rss_bytes()
    return {
        "size": args.size,
        "optimizer": args.optimizer,
        "modes": modes,
        "steps": steps,
        "batch": [batch_size, seq_len],
        "peak_bytes": peak,
        "baseline_bytes": baseline,
        # How busy the machine was: this process counts for about its thread count.
        "load_average_1min": os.getloadavg()[0],
        "by_mode": {
            mode: {
                k: v
                for k, v in run.items()
                if k not in ("model", "optimizer", "state_holders")
            }
            | {"state_bytes": _state_bytes(run["state_holders"])}
            for mode, run in runs.items()
        },
    }


# -- the sweep -----------------------------------------------------------------------


def run_fresh_process(
    args: argparse.Namespace,
    size: str,
    optimizer: str,
    modes: list[str],
    steps: int,
) -> dict[str, Any]:
    options = {
        "--size": size,
        "--optimizer": optimizer,
        "--modes": ",".join(modes),
        "--device": args.device,
        "--dtype": args.dtype,
        "--batch-size": str(args.batch_size),
        "--seq-len": str(args.seq_len),
        "--steps": str(steps),
        "--size-steps": "",
        "--warmup": str(args.warmup),
        "--threads": str(args.threads),
    }
    command = [sys.executable, os.path.abspath(__file__), "--measure"]
    for option, value in options.items():
        command += [option, value]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{size}/{optimizer}/{modes} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def _paired_ratios(
    timing: list[dict[str, Any]], mode: str, reference: str, key: str
) -> list[float]:
    """Step time of ``mode`` over that of ``reference``, pairing the steps of the
    same round of one process (interleaved), or the medians of the same repeat
    (fresh processes)."""
    ratios = []
    for run in timing:
        by_mode = run["by_mode"]
        if mode not in by_mode or reference not in by_mode:
            continue
        ours, theirs = by_mode[mode][key], by_mode[reference][key]
        if len(run["modes"]) > 1:
            ratios += [a / b for a, b in zip(ours, theirs, strict=True)]
    if ratios:
        return ratios
    ours = [r["by_mode"][mode][key] for r in timing if mode in r["by_mode"]]
    theirs = [r["by_mode"][reference][key] for r in timing if reference in r["by_mode"]]
    return [
        statistics.median(a) / statistics.median(b)
        for a, b in zip(ours, theirs, strict=False)
    ]


def summarize(
    timing: list[dict[str, Any]], memory: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per (size, optimizer, mode)."""
    rows = []
    keys = dict.fromkeys((r["size"], r["optimizer"]) for r in timing + memory)
    for size, optimizer in keys:
        mine_t = [r for r in timing if (r["size"], r["optimizer"]) == (size, optimizer)]
        mine_m = [r for r in memory if (r["size"], r["optimizer"]) == (size, optimizer)]
        modes = list(dict.fromkeys(m for r in mine_t + mine_m for m in r["modes"]))
        peaks = {
            mode: statistics.median(
                r["peak_bytes"] for r in mine_m if r["modes"] == [mode]
            )
            for mode in modes
            if any(r["modes"] == [mode] for r in mine_m)
        }
        for mode in modes:
            info = next(
                r["by_mode"][mode] for r in mine_t + mine_m if mode in r["by_mode"]
            )
            row: dict[str, Any] = {
                "size": size,
                "optimizer": optimizer,
                "mode": mode,
                "batch": (mine_t + mine_m)[0]["batch"],
                **{
                    k: info[k]
                    for k in (
                        "params",
                        "grad_bytes",
                        "state_bytes",
                        "buckets",
                        "max_bucket_bytes",
                    )
                },
            }
            times = [
                t
                for r in mine_t
                if mode in r["by_mode"]
                for t in r["by_mode"][mode]["step_times_s"]
            ]
            cpu = [
                t
                for r in mine_t
                if mode in r["by_mode"]
                for t in r["by_mode"][mode]["cpu_times_s"]
            ]
            if times:
                row["step_s"] = _spread(times)
                row["cpu_step_s"] = _spread(cpu)
                phases = {
                    phase: [
                        t
                        for r in mine_t
                        if mode in r["by_mode"]
                        for t in r["by_mode"][mode]
                        .get("phase_cpu_s", {})
                        .get(phase, [])
                    ]
                    for phase in _PHASES
                }
                row["phase_cpu_s"] = {
                    phase: statistics.median(ts) for phase, ts in phases.items() if ts
                }
                coefs = [
                    c
                    for r in mine_t
                    if mode in r["by_mode"]
                    for c in r["by_mode"][mode].get("clip_coefs", [])
                ]
                if coefs:
                    row["clip_coef_max"] = max(coefs)
                for reference in REFERENCES:
                    for key, name in (("step_times_s", "wall"), ("cpu_times_s", "cpu")):
                        ratios = _paired_ratios(mine_t, mode, reference, key)
                        if ratios:
                            row[f"{name}_vs_{reference}"] = _spread(ratios)
            if mode in peaks:
                row["peak_bytes"] = peaks[mode]
                if "plain" in peaks:
                    row["saved_bytes"] = peaks["plain"] - peaks[mode]
                    row["saved_of_grads"] = row["saved_bytes"] / row["grad_bytes"]
                if "in_bwd_per_param" in peaks and mode.startswith("in_bwd"):
                    row["extra_vs_per_param_bytes"] = (
                        peaks[mode] - peaks["in_bwd_per_param"]
                    )
                unclipped = UNCLIPPED.get(mode)
                if unclipped in peaks:
                    row["clip_extra_bytes"] = peaks[mode] - peaks[unclipped]
            rows.append(row)
    return rows


def _ratio(row: dict[str, Any], key: str) -> str:
    spread = row.get(key)
    if spread is None:
        return ""
    return f"{spread['median']:.2f}x [{spread['min']:.2f}-{spread['max']:.2f}]"


def markdown(
    rows: list[dict[str, Any]],
    timing: list[dict[str, Any]],
    args: argparse.Namespace,
    env: str,
) -> str:
    cpu = args.device == "cpu"
    memory = "peak RSS" if cpu else "max allocated"
    clock = "CPU time" if cpu else "wall"
    key = "cpu" if cpu else "wall"
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    references = [ref for ref in REFERENCES if ref in modes]
    clipping = any(mode in UNCLIPPED for mode in modes)
    per_param = "in_bwd_per_param" in modes
    steps = {}
    for run in timing:
        steps.setdefault(run["size"], run.get("steps", args.steps))
    if len(set(steps.values())) == 1:
        steps_text = f"{next(iter(steps.values()))} timed steps per mode"
    else:
        steps_text = "timed steps per mode: " + ", ".join(
            f"{size} {n}" for size, n in steps.items()
        )
    lines = [
        "# Optimizer in backward: step time and peak memory",
        "",
        env,
        "",
        f"llama2, {args.dtype}; {steps_text}, after {args.warmup} "
        f"warm-up step(s). Step time: {clock} per step, median, with every mode of a "
        "size in one process taking steps in turn (rotating order); the ratios are "
        "medians of per-round paired ratios, [min-max] over the rounds. Sizes timed "
        "in fresh processes instead are marked. Peak memory: "
        f"{memory}, each mode in a fresh process; `saved` is the plain step's peak "
        "minus the mode's"
        + (
            ", `extra` the mode's peak minus the per-parameter mode's"
            if per_param
            else ""
        )
        + ". Every step takes the gradient norm the recipes log (plain: "
        "`get_total_norm`; in backward: `grad_norm`); the 0.6.1 hooks cannot give "
        "one and skip it.",
    ]
    if cpu:
        loads = [r["load_average_1min"] for r in timing]
        lines += [
            "",
            "On CPU the process's CPU time is the steadier measure when other work "
            "shares the cores; wall-clock ratios are in the JSON. 1-minute load "
            f"average at the end of each timing run: {min(loads):.1f} to "
            f"{max(loads):.1f} (the benchmark counts for about its thread count).",
        ]
    if clipping:
        lines += [
            "",
            f"Clipping modes: global-norm clipping to max_norm={MAX_NORM:g}, below "
            "every step's gradient norm, so every step clips (the largest clip "
            "coefficient seen is in the JSON, `clip_coef_max`). `vs in bwd, no clip` "
            "compares with the bucketed in-backward mode without clipping; `clip "
            "extra` is a clipping mode's peak minus that of the same mode without "
            "clipping.",
        ]
    if args.note:
        lines += ["", f"Note: {args.note}"]
    lines += [
        "",
        f"| model | batch | optimizer | mode | buckets (largest) | {clock} / step (ms) "
        + "".join(f"| vs {REFERENCES[ref]} " for ref in references)
        + f"| {memory} (MiB) | saved (MiB) | saved / gradients "
        + ("| clip extra (MiB) " if clipping else "")
        + ("| extra vs per parameter (MiB) " if per_param else "")
        + "|",
        "|---|---|---|---|---:|---:|"
        + "---:|" * (len(references) + 3 + clipping + per_param),
    ]
    fresh = {(r["size"], r["optimizer"]) for r in timing if len(r["modes"]) == 1}
    for r in rows:
        step = r.get("cpu_step_s" if cpu else "step_s")
        size = f"{r['size']} ({r['params'] / 1e6:.1f}M)"
        if (r["size"], r["optimizer"]) in fresh:
            size += ", fresh processes"
        lines.append(
            "| "
            + " | ".join(
                [
                    size,
                    f"{r['batch'][0]}x{r['batch'][1]}",
                    OPTIMIZER_LABELS[r["optimizer"]],
                    mode_label(r["mode"]),
                    f"{r['buckets']} ({r['max_bucket_bytes'] / MIB:.1f} MiB)"
                    if r["mode"] not in ("plain", "plain_clip")
                    else "",
                    f"{1000 * step['median']:.0f}" if step else "",
                    *(_ratio(r, f"{key}_vs_{ref}") for ref in references),
                    f"{r['peak_bytes'] / MIB:.0f}" if "peak_bytes" in r else "",
                    f"{r['saved_bytes'] / MIB:.0f}" if "saved_bytes" in r else "",
                    f"{r['saved_of_grads']:.0%}" if "saved_of_grads" in r else "",
                    *(
                        [
                            f"{r['clip_extra_bytes'] / MIB:+.0f}"
                            if "clip_extra_bytes" in r
                            else ""
                        ]
                        if clipping
                        else []
                    ),
                    *(
                        [
                            f"{r['extra_vs_per_param_bytes'] / MIB:+.0f}"
                            if "extra_vs_per_param_bytes" in r
                            else ""
                        ]
                        if per_param
                        else []
                    ),
                ]
            )
            + " |"
        )
    lines += [
        "",
        "Where the time goes: median CPU time per phase (ms), with the interleaved or "
        "fresh-process timing runs above. `forward`: forward and loss; `measuring "
        "pass`: `in_bwd_clip`'s first backward pass (gradients measured and freed); "
        "`backward`: the (for `in_bwd_clip`: second, updating) backward pass, with the "
        "in-backward updates; `rest`: norm, clipping, `step()`, `zero_grad()`.",
        "",
        "| model | mode | forward | measuring pass | backward | rest | measuring pass "
        "/ step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        phases = r.get("phase_cpu_s")
        if not phases:
            continue
        total = sum(phases.values())
        cells = [
            f"{1000 * phases[phase]:.0f}" if phase in phases else ""
            for phase in _PHASES
        ]
        share = (
            f"{phases['measure_pass'] / total:.0%}" if "measure_pass" in phases else ""
        )
        lines.append(
            f"| {r['size']} | {mode_label(r['mode'])} | "
            + " | ".join(cells)
            + f" | {share} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, cpu: bool) -> None:
    """One row of panels per optimizer: step time vs each reference mode that was
    run (plain, the 0.6.1 hooks, in backward without clipping), and memory saved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "cpu" if cpu else "wall"
    optimizers = list(dict.fromkeys(r["optimizer"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    references = [ref for ref in REFERENCES if ref in modes]
    fig, axes = plt.subplots(
        len(optimizers),
        len(references) + 1,
        figsize=(5.4 * (len(references) + 1), 4.4 * len(optimizers)),
        squeeze=False,
    )
    clock = "CPU time" if cpu else "wall time"
    for optimizer, panels in zip(optimizers, axes, strict=True):
        for index, mode in enumerate(modes):
            mine = [r for r in rows if (r["optimizer"], r["mode"]) == (optimizer, mode)]
            x = [r["params"] / 1e6 for r in mine]
            for ax, reference in zip(panels, references, strict=False):
                field = f"{key}_vs_{reference}"
                points = [
                    (xi, r[field]) for xi, r in zip(x, mine, strict=False) if field in r
                ]
                if not points or mode == reference:
                    continue
                xs, spreads = zip(*points, strict=False)
                medians = [s["median"] for s in spreads]
                ax.errorbar(
                    xs,
                    medians,
                    yerr=[
                        [m - s["min"] for m, s in zip(medians, spreads, strict=False)],
                        [s["max"] - m for m, s in zip(medians, spreads, strict=False)],
                    ],
                    fmt="o-",
                    capsize=3,
                    color=f"C{index}",
                    label=mode_label(mode),
                )
            saved = [
                (xi, 100 * r["saved_of_grads"])
                for xi, r in zip(x, mine, strict=False)
                if "saved_of_grads" in r
            ]
            if saved and mode != "plain":
                panels[-1].plot(
                    *zip(*saved, strict=False),
                    "o-",
                    color=f"C{index}",
                    label=mode_label(mode),
                )
        name = OPTIMIZER_LABELS[optimizer]
        titles = [
            (
                ax,
                f"Step {clock} vs {REFERENCES[ref]}: {name}",
                f"x {REFERENCES[ref]} (median, min-max)",
            )
            for ax, ref in zip(panels, references, strict=False)
        ]
        titles.append(
            (panels[-1], f"Memory saved vs plain: {name}", "% of gradient bytes")
        )
        for ax, title, ylabel in titles:
            if ax is not panels[-1]:
                ax.axhline(1.0, color="black", lw=0.6)
            else:
                ax.axhline(0.0, color="black", lw=0.6)
            ax.set_xscale("log")
            ax.set_xlabel("parameters (M)")
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
    from torchtune.training.memory import DEFAULT_BUCKET_CAP_MB

    return (
        f"Device: {args.device} ({where}); {versions}; {threads} intra-op thread(s); "
        f"default bucket cap {DEFAULT_BUCKET_CAP_MB:g} MiB; "
        f"{time.strftime('%Y-%m-%d %H:%M')}."
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
        default="adamw",
        help=f"comma-separated, from {','.join(OPTIMIZERS)} (default: adamw)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    parser.add_argument(
        "--extra-caps",
        default="",
        help="comma-separated bucket caps in MiB, each added as a mode in_bwd_cap<N>",
    )
    parser.add_argument("--steps", type=int, default=12, help="timed steps per mode")
    parser.add_argument(
        "--size-steps",
        default="",
        help="per-size overrides of --steps, e.g. 200m=8,1b=6",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument(
        "--memory-steps", type=int, default=3, help="timed steps of a memory run"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="fresh processes per mode (timing)"
    )
    parser.add_argument(
        "--timing",
        choices=("auto", "interleaved", "fresh"),
        default="auto",
        help="auto: interleaved when all modes' models fit in --interleave-gib",
    )
    parser.add_argument("--interleave-gib", type=float, default=8.0)
    parser.add_argument("--batch-size", type=int, default=0, help="0: per size")
    parser.add_argument("--seq-len", type=int, default=0, help="0: per size")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path(__file__).resolve().parent / "results",
    )
    parser.add_argument(
        "--out-name",
        default="optimizer_in_backward",
        help="file name (no suffix) of the .md, .json and .png in --out-dir",
    )
    parser.add_argument("--note", default="", help="added to the markdown report")
    # Internal: measure one (size, optimizer, modes) in this process, print JSON.
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _model_bytes(size: str, n_modes: int) -> float:
    """Rough bytes of ``n_modes`` fp32 models with AdamW state and gradients."""
    shape = SIZES[size]
    per_layer = 4 * shape["embed_dim"] ** 2 + 3 * shape["embed_dim"] * int(
        8 / 3 * shape["embed_dim"]
    )
    params = (
        shape["num_layers"] * per_layer + 2 * shape["vocab_size"] * shape["embed_dim"]
    )
    return n_modes * params * 4 * 4


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args)))
        return
    sizes = (args.sizes or DEFAULT_SIZES[args.device]).split(",")
    optimizers = args.optimizers.split(",")
    modes = args.modes.split(",")
    modes += [
        f"in_bwd_cap{c:g}" for c in map(float, filter(None, args.extra_caps.split(",")))
    ]
    for kind, asked, known in (
        ("sizes", sizes, SIZES),
        ("optimizers", optimizers, OPTIMIZERS),
        ("modes", [m for m in modes if not m.startswith("in_bwd_cap")], ALL_MODES),
    ):
        unknown = [name for name in asked if name not in known]
        if unknown:
            raise ValueError(f"unknown {kind} {unknown}; choose from {list(known)}")
    timing, memory = [], []
    for size in sizes:
        interleave = args.timing == "interleaved" or (
            args.timing == "auto"
            and _model_bytes(size, len(modes)) < args.interleave_gib * 1024**3
        )
        for optimizer in optimizers:
            if interleave:
                run = run_fresh_process(
                    args, size, optimizer, modes, _steps_for(args, size)
                )
                timing.append(run)
                for mode in modes:
                    print(
                        f"{size} {optimizer} {mode} (interleaved): median CPU time "
                        f"{statistics.median(run['by_mode'][mode]['cpu_times_s']):.3f} s",
                        flush=True,
                    )
            # Memory, and for fresh-process timing the time too: each mode alone,
            # modes alternating within each repeat.
            for repeat in range(1 if interleave else args.repeats):
                for mode in modes:
                    steps = args.memory_steps if interleave else _steps_for(args, size)
                    run = run_fresh_process(args, size, optimizer, [mode], steps)
                    memory.append(run)
                    if not interleave:
                        timing.append(run)
                    print(
                        f"{size} {optimizer} {mode} (fresh, run {repeat + 1}): peak "
                        f"{run['peak_bytes'] / MIB:.0f} MiB, median CPU time "
                        f"{statistics.median(run['by_mode'][mode]['cpu_times_s']):.3f} s",
                        flush=True,
                    )
    rows = summarize(timing, memory)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = markdown(rows, timing, args, environment(args))
    stem = args.out_dir / args.out_name
    stem.with_suffix(".md").write_text(report)
    stem.with_suffix(".json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "timing": timing,
                "memory": memory,
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
