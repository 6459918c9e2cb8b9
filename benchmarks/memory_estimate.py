"""The memory estimate (``python -m torchtune.training.memory_estimate``) for the
shipped in-backward configs at real size, and its checks against measured runs.

Subcommands (from the repository root; each adds its part to
``benchmarks/results/memory_estimate.json`` and rewrites the ``.md``)::

    python benchmarks/memory_estimate.py table     # estimates, per rank
    python benchmarks/memory_estimate.py check-1b  # shipped 1B on CPU, peak RSS
    python benchmarks/memory_estimate.py check-fsdp  # 2 CPU processes, FSDP2, gloo
    python benchmarks/memory_estimate.py check-recipe --family dpo --model tiny \
        --nproc 2                                  # DPO, QAT, early exit, PPO
    python benchmarks/memory_estimate.py re-estimate [--check NAME ...]  # the
                                                   # checks' estimates again
    python benchmarks/memory_estimate.py trace --check NAME  # a check's step on
                                                   # real tensors, counted 3 ways
    python benchmarks/memory_estimate.py gloo      # gloo's collectives' copies
    python benchmarks/memory_estimate.py report    # the .md from the .json

A measured run is the recipe itself (``tune run``'s recipe file, run with
``runpy``; ``torchrun`` for 2 processes) on randomly initialized weights, the tiny
tokenizer of ``tests/assets`` and full-length samples (``scripts/measure_shipped_in_bwd.py``
makes them). Each process reports its peak resident set size over the training
steps: reset (``/proc/self/clear_refs``) when the first epoch starts and read before
the epoch-end checkpoint is written, so saving is not counted. The estimate is run
with the same config and overrides (``device=cpu``: bitsandbytes' CPU update,
which dequantizes to fp32, is what runs there).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from torchtune.training.memory_estimate import CATEGORIES

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
GB = 10**9
GIB = 2**30

#: Shipped configs with ``optimizer_in_bwd: True`` (``tune ls``) as shipped (Llama
#: 3.x also with 512-token samples), PPO's included; a distributed config of each
#: other recipe that offers it, flipped on, over 8 ranks: (config, ranks,
#: overrides).
TABLE = [
    ("llama3_2/1B_full_single_device", 1, []),
    ("llama3_2/1B_full_single_device", 1, ["tokenizer.max_seq_len=512"]),
    ("llama3_2/3B_full_single_device", 1, []),
    ("llama3_2/3B_full_single_device", 1, ["tokenizer.max_seq_len=512"]),
    ("llama3_1/8B_full_single_device", 1, []),
    ("llama3_1/8B_full_single_device", 1, ["tokenizer.max_seq_len=512"]),
    ("llama3/8B_full_single_device", 1, []),
    ("llama2/7B_full_low_memory", 1, []),
    ("code_llama2/7B_full_low_memory", 1, []),
    ("mistral/7B_full_low_memory", 1, []),
    ("phi3/mini_full_low_memory", 1, []),
    ("phi4/14B_full_low_memory", 1, []),
    ("qwen2/1.5B_full_single_device", 1, []),
    ("qwen2/7B_full_single_device", 1, []),
    ("qwen2_5/1.5B_full_single_device", 1, []),
    ("qwen2_5/3B_full_single_device", 1, []),
    ("qwen2_5/7B_full_single_device", 1, []),
    ("llama3_1/8B_full", 8, ["optimizer_in_bwd=True"]),
    ("llama3_3/70B_full", 8, ["optimizer_in_bwd=True", "fsdp_cpu_offload=False"]),
    ("mistral/7B_full_ppo_low_memory", 1, []),
    ("llama3_1/8B_full_dpo", 8, ["optimizer_in_bwd=True"]),
    ("llama3/8B_qat_full", 8, ["optimizer_in_bwd=True"]),
    ("llama2/7B_full_early_exit", 8, ["optimizer_in_bwd=True"]),
]


#: The model of the 2-process check: a Llama 3.2 of 265M parameters.
FSDP_MODEL = {
    "_component_": "torchtune.models.llama3_2.llama3_2",
    "vocab_size": 32000,
    "num_layers": 16,
    "num_heads": 16,
    "num_kv_heads": 4,
    "embed_dim": 1024,
    "intermediate_dim": 4096,
    "max_seq_len": 2048,
}


#: The other recipe families' measured checks: their tiny test config
#: (``tests/recipes/configs``), and what makes a run comparable with the estimate:
#: fake quantization from the first step (the estimate counts it), no layer dropout
#: (the estimate runs every layer).
FAMILIES = {
    "dpo": ("full_dpo_distributed", "tiny_full_dpo_distributed.yaml", []),
    "qat": (
        "qat_distributed",
        "tiny_qat_distributed.yaml",
        ["fake_quant_after_n_steps=null"],
    ),
    "early-exit": (
        "dev/early_exit_finetune_distributed",
        "tiny_early_exit_distributed.yaml",
        ["layer_dropout=null"],
    ),
    # The adapter over the base model below (lora_llama2 with the config's LoRA
    # settings): rank 4 on q, v, output projections and the MLP.
    "lora": ("lora_finetune_single_device", "tiny_lora_single_device.yaml", []),
    "lora-distributed": ("lora_finetune_distributed", "tiny_lora_distributed.yaml", []),
    # Its four models are the tiny checkpoints of tests/assets/make_ppo_assets.py
    # (tiny only); 16 prompts: 2 steps of the config's 8.
    "ppo": (
        "ppo_full_finetune_single_device",
        "tiny_ppo_single_device.yaml",
        ["num_steps=16", "dataset.split=train"],
    ),
}

#: Their models: the tiny configs' own 2-layer Llama2 (140K parameters), one of
#: 58M, and the same with the tiny tokenizer's 512-token vocabulary (25M: QAT's
#: fake quantization of a 32K-vocabulary output projection keeps its peak in
#: forward, where in-backward has nothing to free).
RECIPE_MODELS = {
    "tiny": {
        "_component_": "torchtune.models.llama2.llama2",
        "vocab_size": 512,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "embed_dim": 64,
        "intermediate_dim": 128,
        "max_seq_len": 256,
        "norm_eps": 1e-5,
    },
    "mid": {
        "_component_": "torchtune.models.llama2.llama2",
        "vocab_size": 32000,
        "num_layers": 8,
        "num_heads": 8,
        "num_kv_heads": 4,
        "embed_dim": 512,
        "intermediate_dim": 1536,
        "max_seq_len": 2048,
        "norm_eps": 1e-5,
    },
}
RECIPE_MODELS["mid-v512"] = {**RECIPE_MODELS["mid"], "vocab_size": 512}


def _shipped_helpers() -> Any:
    """``scripts/measure_shipped_in_bwd.py``: its data, checkpoint and overrides."""
    path = REPO_ROOT / "scripts" / "measure_shipped_in_bwd.py"
    spec = importlib.util.spec_from_file_location("measure_shipped_in_bwd", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO_ROOT))
    spec.loader.exec_module(module)
    return module


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_recipe(recipe: str, out: Path, argv: list[str]) -> None:
    """Run ``recipe`` in this process as ``tune run`` does, recording the peak RSS
    of its training steps to ``out`` (``out.rank{RANK}.json`` per process)."""
    from torchtune import training
    from torchtune._recipe_registry import get_all_recipes

    record: dict[str, Any] = {}
    epoch_batches = training.epoch_batches
    save = training.CheckpointManager.save

    def start_epoch(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        record["rss_at_start"] = _vm("VmRSS")
        record["start"] = time.time()
        return epoch_batches(*args, **kwargs)

    def save_and_record(self: Any, *args: Any, epoch_end: bool = False, **kw: Any):
        record["peak_rss"] = _vm("VmHWM")
        if epoch_end:
            record["train_s"] = time.time() - record["start"]
            rank = os.environ.get("RANK", "0")
            Path(f"{out}.rank{rank}.json").write_text(json.dumps(record))
        return save(self, *args, epoch_end=epoch_end, **kw)

    training.epoch_batches = start_epoch
    training.CheckpointManager.save = save_and_record
    (entry,) = [r for r in get_all_recipes() if r.name == recipe]
    root = Path(training.__file__).parents[2]
    path = root / "recipes" / entry.file_path
    sys.argv = [str(path), *argv]
    runpy.run_path(str(path), run_name="__main__")


def _run(command: list[str], what: str) -> None:
    """Run ``command`` from the repository root with glibc's mmap threshold fixed at
    64 KiB: glibc then maps every allocation of 64 KiB or more on its own and unmaps
    it when freed, so that RSS follows the tensors alive (with the default, growing
    threshold it keeps freed blocks of up to 32 MiB). Raises with its output if it
    fails."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )


def measure(
    recipe: str, config: str, overrides: list[str], nproc: int, work: Path
) -> dict[str, Any]:
    """Peak RSS per process of a measured run, in a fresh process (or torchrun)."""
    from torchtune.training.memory_estimate import _config_path

    out = work / f"rss_{int(time.time() * 1000)}"
    path = _config_path(config)[0]
    args = ["run-recipe", recipe, str(out), "--", "--config", str(path), *overrides]
    script = str(Path(__file__).resolve())
    # A distributed recipe initializes its process group from torchrun's variables,
    # on one process too.
    if nproc > 1 or recipe.endswith("_distributed"):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            script,
            *args,
        ]
    else:
        command = [sys.executable, script, *args]
    start = time.perf_counter()
    _run(command, "measured run")
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]
    return {
        "ranks": ranks,
        "peak_rss": max(r["peak_rss"] for r in ranks),
        "wall_s": time.perf_counter() - start,
    }


def run_estimate(
    config: str, overrides: list[str], nproc: int = 1, recipe: str | None = None
) -> dict[str, Any]:
    """The estimate, in a fresh process, as a user runs it."""
    out = Path(f"/tmp/memory_estimate_{os.getpid()}_{time.time_ns()}.json")
    command = [
        sys.executable,
        "-m",
        "torchtune.training.memory_estimate",
        "--config",
        config,
        "--nproc",
        str(nproc),
        "--json",
        str(out),
        *(["--recipe", recipe] if recipe else []),
        *overrides,
    ]
    start = time.perf_counter()
    with open(f"{out}.log", "w+") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=log)
        _, status, usage = os.wait4(proc.pid, 0)
        log.seek(0)
        output = log.read()
    os.unlink(f"{out}.log")
    if status != 0:
        raise RuntimeError(f"estimate failed:\n{output[-5000:]}")
    est = json.loads(out.read_text())
    out.unlink()
    est["wall_s"] = time.perf_counter() - start
    est["report"] = output[output.find("ESTIMATED") :]
    # The estimate's own peak RSS: it allocates nothing model-sized.
    est["estimator_peak_rss"] = usage.ru_maxrss * 1024
    return est


def _load() -> dict[str, Any]:
    path = RESULTS / "memory_estimate.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _save(results: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory_estimate.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "memory_estimate.md").write_text(markdown(results))


def table(args: argparse.Namespace) -> None:
    import torch

    results = _load()
    rows = results.setdefault("table", {})
    for config, nproc, overrides in TABLE:
        est = run_estimate(config, overrides, nproc)
        est["overrides"] = overrides
        rows[" ".join([config, *overrides])] = est
        print(est["report"], f"\n({est['wall_s']:.0f} s)\n", flush=True)
    results["torch"] = torch.__version__
    _save(results)


def _check(
    name: str,
    recipe: str,
    config: str,
    overrides: list[str],
    nproc: int,
    work: Path,
) -> None:
    results = _load()
    check: dict[str, Any] = {
        "config": config,
        "recipe": recipe,
        "nproc": nproc,
        "overrides": [o for o in overrides if "/tmp" not in o and "/work" not in o],
    }
    for mode, flag in (("plain", False), ("in_backward", True)):
        run = measure(
            recipe, config, [*overrides, f"optimizer_in_bwd={flag}"], nproc, work
        )
        check[f"measured_{mode}"] = run
        print(name, mode, f"peak RSS {run['peak_rss'] / GB:.2f} GB", flush=True)
    est = run_estimate(config, overrides, nproc, recipe)
    check["estimate"] = est
    print(est["report"], flush=True)
    results.setdefault("checks", {})[name] = check
    _save(results)


def re_estimate(args: argparse.Namespace) -> None:
    """The stored checks' estimates again, with the estimate as it is now; their
    measured runs (of the recipes, which the estimate does not change) are kept."""
    results = _load()
    for name, check in results.get("checks", {}).items():
        if args.check and name not in args.check:
            continue
        check["estimate"] = run_estimate(
            check["config"], check["overrides"], check["nproc"], check["recipe"]
        )
        print(name, check["estimate"]["report"], flush=True)
    _save(results)


def _prepare(
    args: argparse.Namespace, name: str, model: str, processes: int
) -> tuple[Any, Path, list[str]]:
    """A measured check's folder, with its data (enough samples for every process's
    steps) and randomly initialized checkpoint of ``model`` (``"1b"``, or
    ``"tiny"`` for :data:`FSDP_MODEL`): the shipped-config helpers, the folder, and
    the overrides that point the config at them and at a ``DiskLogger`` there."""
    helpers = _shipped_helpers()
    from tests.assets.make_assets import DEFAULT_OUT, ensure_assets

    work = Path(args.work_dir) / name
    work.mkdir(parents=True, exist_ok=True)
    assets = ensure_assets(DEFAULT_OUT)
    ns = argparse.Namespace(
        model=model, seq_len=args.seq_len, device="cpu", steps=args.steps
    )
    data = work / "data.json"
    records = processes * args.batch_size * (args.steps + 2)
    helpers.write_data(data, records=records, seq_len=args.seq_len)
    ckpt = work / "checkpoint"
    if not (ckpt / helpers.CHECKPOINT_FILE).exists():
        section = helpers.model_section("1b") if model == "1b" else dict(FSDP_MODEL)
        helpers.write_checkpoint(section, "cpu", ckpt)
    overrides = [
        *helpers.overrides(ns, assets, data, ckpt),
        f"batch_size={args.batch_size}",
        f"output_dir={work / 'out'}",
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.log_dir={work / 'out' / 'logs'}",
    ]
    return helpers, work, overrides


def check_1b(args: argparse.Namespace) -> None:
    helpers, work, overrides = _prepare(args, "check_1b", "1b", processes=1)
    _check(
        "llama3_2/1B_full_single_device",
        "full_finetune_single_device",
        helpers.CONFIG,
        overrides,
        1,
        work,
    )


def check_fsdp(args: argparse.Namespace) -> None:
    _, work, prepared = _prepare(args, "check_fsdp", "tiny", processes=2)
    from tests.recipes.utils import format_override

    # The 265M model instead of the helpers' own.
    overrides = [o for o in prepared if not o.startswith("model.")]
    overrides += [format_override(f"model.{k}", v) for k, v in FSDP_MODEL.items()]
    overrides += [
        "gradient_accumulation_steps=1",
        "optimizer.fused=False",
        f"dtype={args.dtype}",
        f"enable_activation_checkpointing={args.ac}",
        "checkpointer.model_type=LLAMA3_2",
    ]
    ac = "AC" if args.ac else "no AC"
    _check(
        f"265M, 2 processes FSDP2, {args.dtype}, {ac}, {args.batch_size}x{args.seq_len}",
        "full_finetune_distributed",
        "llama3_2/1B_full",
        overrides,
        2,
        work,
    )


def _write_preference_data(instruct: Path, out: Path) -> None:
    """DPO's pairs from the instruct records of ``instruct``: the same prompt, each
    record's answer chosen and the next one's rejected (both full length)."""
    records = json.loads(instruct.read_text())
    pairs = []
    for i, rec in enumerate(records):
        other = records[(i + 1) % len(records)]
        user = {"role": "user", "content": rec["input"]}
        pairs.append(
            {
                "chosen": [user, {"role": "assistant", "content": rec["output"]}],
                "rejected": [user, {"role": "assistant", "content": other["output"]}],
            }
        )
    out.write_text(json.dumps(pairs))


def check_recipe(args: argparse.Namespace) -> None:
    """A measured check of DPO, QAT, early exit or PPO: the recipe's tiny test
    config with full-length samples (PPO: prompts) and a random init of
    ``--model``."""
    recipe, config_file, family_overrides = FAMILIES[args.family]
    helpers = _shipped_helpers()
    from tests.assets.make_assets import DEFAULT_OUT, ensure_assets
    from tests.recipes.utils import format_override

    name = f"{args.family} {args.model}, {args.nproc} process(es)"
    work = Path(args.work_dir) / name.replace(" ", "_").replace(",", "")
    work.mkdir(parents=True, exist_ok=True)
    assets = ensure_assets(DEFAULT_OUT)
    data = work / "data.json"
    records = args.nproc * args.batch_size * (args.steps + 2)
    helpers.write_data(data, records=records, seq_len=args.seq_len)
    if args.family == "ppo":
        return _check_ppo(args, name, work, data)
    if args.family == "dpo":
        _write_preference_data(data, work / "pairs.json")
        data = work / "pairs.json"
    section = RECIPE_MODELS[args.model]
    ckpt = work / "checkpoint"
    if not (ckpt / helpers.CHECKPOINT_FILE).exists():
        helpers.write_checkpoint(section, "cpu", ckpt)
    forced: dict[str, Any] = {
        "assets_dir": Path(assets.tokenizer_path).parent,
        "output_dir": work / "out",
        "dataset.data_files": data,
        "checkpointer.checkpoint_dir": ckpt,
        "tokenizer.max_seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "epochs": 1,
        "max_steps_per_epoch": args.steps,
        "enable_activation_checkpointing": args.ac,
        **{f"model.{k}": v for k, v in section.items()},
    }
    if args.family.startswith("lora"):
        forced["model._component_"] = "torchtune.models.llama2.lora_llama2"
    if args.family == "dpo":
        forced["ref_checkpointer.checkpoint_dir"] = ckpt
    overrides = [format_override(k, v) for k, v in forced.items()]
    _check(
        f"{name}, {args.batch_size}x{args.seq_len}{', AC' if args.ac else ''}",
        recipe,
        str(Path("tests/recipes/configs") / config_file),
        [*overrides, *family_overrides],
        args.nproc,
        work,
    )


def _check_ppo(args: argparse.Namespace, name: str, work: Path, data: Path) -> None:
    """PPO's check: its tiny config with prompts of full length, and its tiny models
    (``tiny``) or random inits of the ``mid`` size (the policy and its reference
    from one Llama2 checkpoint, which Mistral's builder loads as is; the reward
    model and the value model's start a classifier of the same size, made as
    ``tests/assets/make_ppo_assets.py`` makes the tiny one)."""
    from tests.assets.make_ppo_assets import (
        build_reward_model,
        ensure_ppo_assets,
        write_reward_checkpoint,
    )
    from tests.recipes.utils import format_override

    recipe, config_file, family_overrides = FAMILIES["ppo"]
    ppo_assets = ensure_ppo_assets()
    prompts = work / "prompts.json"
    records = json.loads(data.read_text())
    prompts.write_text(json.dumps([{"prompt": r["output"]} for r in records]))
    forced: dict[str, Any] = {
        "assets_dir": Path(ppo_assets.root).parent,
        "output_dir": work / "out",
        "dataset.data_files": prompts,
        "tokenizer.max_seq_len": args.seq_len,
    }
    if args.model != "tiny":
        helpers = _shipped_helpers()
        section = dict(RECIPE_MODELS[args.model])
        section["_component_"] = "torchtune.models.mistral.mistral"
        sizes = {k: v for k, v in section.items() if k != "_component_"}
        policy, reward = work / "checkpoint", work / "reward_checkpoint"
        if not (policy / helpers.CHECKPOINT_FILE).exists():
            helpers.write_checkpoint(section, "cpu", policy)
        if not (reward / helpers.CHECKPOINT_FILE).exists():
            write_reward_checkpoint(build_reward_model(sizes), sizes, reward)
        for key in ("checkpointer", "ref_policy_checkpointer"):
            forced[f"{key}.checkpoint_dir"] = policy
        for key in ("value_checkpointer", "reward_checkpointer"):
            forced[f"{key}.checkpoint_dir"] = reward
        forced |= {f"policy_model.{k}": v for k, v in sizes.items()}
        forced |= {f"reward_and_value_model.{k}": v for k, v in sizes.items()}
    _check(
        f"{name}, prompts of {args.seq_len}",
        recipe,
        str(Path("tests/recipes/configs") / config_file),
        [*(format_override(k, v) for k, v in forced.items()), *family_overrides],
        1,
        work,
    )


# -- tracing a check's step on real tensors ------------------------------------------


class _PhaseProbe:
    """Where a real step is, for :func:`trace_rank`: at each change of phase, the
    peak RSS of the phase that ends (``VmHWM``, then reset to the current RSS), and
    a profiler range named after the phase that starts."""

    def __init__(self) -> None:
        from torch.profiler import record_function

        self._record_function = record_function
        self._phase = ""
        self._range: Any = None
        self.rss: list[tuple[str, int]] = []

    def reset(self) -> None:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start_rss = _vm("VmRSS")

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        if self._phase:
            self.rss.append((self._phase, _vm("VmHWM")))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        if self._range is not None:
            self._range.__exit__(None, None, None)
        self._phase = value
        self._range = self._record_function(f"phase:{value}")
        self._range.__enter__()

    def close(self) -> None:
        self.phase = "between steps"
        self._range.__exit__(None, None, None)
        self._range = None
        self._phase = ""


def _profiled_peak(prof: Any) -> tuple[int, str]:
    """The peak of the bytes torch's allocator reported live during ``prof`` (from
    its start), and the phase range it is in."""
    events = prof.profiler.kineto_results.events()
    memory = sorted(
        (e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    ranges = [
        (e.start_ns(), e.end_ns(), e.name().removeprefix("phase:"))
        for e in events
        if e.name().startswith("phase:")
    ]
    current = peak = 0
    at = 0
    for event in memory:
        current += event.nbytes()
        if current > peak:
            peak, at = current, event.start_ns()
    # The innermost range (the latest to start) holding the peak.
    phase = max(
        (r for r in ranges if r[0] <= at <= r[1]),
        default=(0, 0, "?"),
        key=lambda r: r[0],
    )[2]
    return peak, phase


def trace_rank(recipe: str, config: str, overrides: list[str], nproc: int, out: Path):
    """On this rank (``torchrun``, gloo): each mode's step of the estimate on real,
    randomly initialized tensors, counted three ways (see :func:`trace`)."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import profile

    from torchtune.config._parse import TuneRecipeArgumentParser
    from torchtune.config._utils import _merge_yaml_and_cli_args
    from torchtune.training import memory_estimate as me

    if recipe.endswith("_distributed"):
        dist.init_process_group("gloo")
        init_device_mesh("cpu", (nproc,))
    path = me._config_path(config)[0]
    yaml_args, _ = TuneRecipeArgumentParser(add_help=False).parse_known_args(
        ["--config", str(path)]
    )
    cfg = _merge_yaml_and_cli_args(yaml_args, overrides)
    seq_len = me._seq_len(cfg, None)[0]
    record: dict[str, Any] = {}
    for mode, in_bwd in (("plain", False), ("in_backward", True)):
        mode_cfg = OmegaConf.merge(
            cfg, {"optimizer_in_bwd": in_bwd, "gradient_accumulation_steps": 1}
        )
        estimator = me._Estimator(mode_cfg, recipe, nproc, seq_len)
        # 1. The estimate's counting (its tracker), two steps, the second's peak.
        torch.manual_seed(0)
        setup = estimator._build(None, in_bwd, count=True)
        tracker = setup.tracker
        with me._bnb_patch("cpu"), me._phase_patch(tracker):
            tracker.track_models(setup.models)
            with tracker:
                for _ in range(2):
                    tracker.start_peak()
                    estimator._step(setup, tracker, in_bwd)
                    tracker.finish()
                    tracker.label_state(setup.optimizer)
            peak = estimator._peak(setup, tracker, in_bwd)
        counted = {
            "peak": peak.total,
            "phase": peak.phase,
            "by_category": peak.by_category,
            "largest": peak.largest,
        }
        del setup, tracker, peak
        gc.collect()
        # 2. torch's own accounting (the profiler's allocation events) and 3. RSS,
        # per phase, of the second step of a fresh build.
        torch.manual_seed(0)
        setup = estimator.build_real(in_bwd)
        estimator.step_real(setup, in_bwd)  # the optimizer state
        state = [
            v
            for s in setup.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ]
        alive = {}
        tensors = [t for m in setup.models for t in (*m.parameters(), *m.buffers())]
        for t in [*tensors, *state]:
            for storage in me._storages(t):
                alive[id(storage)] = storage.nbytes()
        probe = _PhaseProbe()
        with me._bnb_patch("cpu"):
            probe.reset()
            estimator._step(setup, probe, in_bwd)
            probe.close()
            rss_phases = [(p, hwm - probe.start_rss) for p, hwm in probe.rss]
            probe = _PhaseProbe()
            with profile(profile_memory=True) as prof:
                estimator._step(setup, probe, in_bwd)
                probe.close()
        profiled, profiled_phase = _profiled_peak(prof)
        record[mode] = {
            "counted": counted,
            "alive_at_start": sum(alive.values()),
            "profiled_peak": sum(alive.values()) + profiled,
            "profiled_phase": profiled_phase,
            "rss_above_start_by_phase": rss_phases,
        }
        del setup, state, alive, prof
        gc.collect()
    rank = os.environ.get("RANK", "0")
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(record))


def trace(args: argparse.Namespace) -> None:
    """A stored check's step, as the estimate takes it, on real randomly initialized
    tensors over the check's processes (gloo), counted three ways: by the estimate's
    own counting (its tracker, on real tensors), by torch's allocator (the
    profiler's allocation events) and by peak RSS per phase of the step above RSS at
    its start. Stored under ``traces``."""
    results = _load()
    (name,) = args.check
    check = results["checks"][name]
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"trace_{int(time.time() * 1000)}"
    script = str(Path(__file__).resolve())
    rest = [
        "trace-rank",
        check["recipe"],
        check["config"],
        str(check["nproc"]),
        str(out),
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(check["nproc"]),
        script,
        *rest,
        "--",
        *check["overrides"],
    ]
    _run(command, "trace")
    ranks = [
        json.loads(Path(f"{out}.rank{r}.json").read_text())
        for r in range(check["nproc"])
    ]
    results.setdefault("traces", {})[name] = ranks
    print(json.dumps(ranks[0], indent=1))
    _save(results)


def gloo_rank(out: Path) -> None:
    """On this rank (``torchrun``, 2 processes, gloo): the bytes torch's allocator
    gives the collectives FSDP2 calls beyond their own output, for a 131 MB
    buffer (the mid model's root unit: embedding and output projection, fp32)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import profile

    dist.init_process_group("gloo")
    full = torch.ones(2 * 16_384_000)
    shard = torch.empty(full.numel() // dist.get_world_size())
    record: dict[str, Any] = {"buffer": full.nbytes}
    calls = {
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, shard),
    }
    for name, call in calls.items():
        with profile(profile_memory=True) as prof:
            call()
        events = sorted(
            (
                e
                for e in prof.profiler.kineto_results.events()
                if e.name() == "[memory]"
            ),
            key=lambda e: e.start_ns(),
        )
        current = peak = 0
        for event in events:
            current += event.nbytes()
            peak = max(peak, current)
        record[name] = peak
    rank = os.environ.get("RANK", "0")
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def gloo(args: argparse.Namespace) -> None:
    """What gloo's reduce-scatter and all-gather allocate beyond their output (the
    peak of torch's allocator during the call), on 2 processes. Stored under
    ``gloo``."""
    results = _load()
    out = Path(args.work_dir) / f"gloo_{int(time.time() * 1000)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    script = str(Path(__file__).resolve())
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        script,
        "gloo-rank",
        str(out),
    ]
    _run(command, "gloo")
    results["gloo"] = json.loads(Path(f"{out}.rank0.json").read_text())
    print(results["gloo"])
    _save(results)


def _error(estimated: float, measured: float, grads: float) -> str:
    """The estimate's error, relative where something was saved (more than 5% of
    the gradients and more than the few MB two runs' RSS differ by anyway)."""
    if abs(measured) < max(0.05 * grads, 5 * 10**6):
        return f"{(estimated - measured) / GB * 1000:+.0f} MB (nothing saved)"
    return f"{(estimated - measured) / measured:+.1%}"


def _fmt(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def _fits_cell(est: dict[str, Any], mode: str) -> str:
    """The GPU sizes a mode fits, and those it fits with the paged state on host."""
    from torchtune.training.memory_estimate import fits

    total, paged = est[mode]["peak"]["total"], est.get("paged_state_bytes", 0)
    cell = ", ".join(map(str, fits(total))) or "none"
    if paged and fits(total, paged) != fits(total):
        cell += f" ({', '.join(map(str, fits(total, paged)))} with it on host)"
    return cell


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Memory estimate: plain vs in-backward, per rank (estimated)",
        "",
        "`python -m torchtune.training.memory_estimate --config <config> [--nproc N] "
        "[overrides]` on this project's CPU machine (no GPU), torch "
        f"{results.get('torch', '?')}. All GPU figures are **estimated**: tensors the "
        "step allocates, counted on fake tensors (`docs/source/memory_estimate.rst`); "
        "not counted: CUDA context, NCCL buffers, kernel workspaces, the caching "
        'allocator\'s fragmentation. "Fits" keeps 2 GiB + 10% of the peak free for '
        "those. Samples are full length (worst case); `max_seq_len: null` in a "
        "tokenizer means 2048 tokens here. GiB = 2^30 bytes, GB = 10^9.",
        "",
        "| config | ranks | batch x tokens | AC | optimizer | peak plain (GiB) | "
        "peak in-backward (GiB) | saved (GiB) | saved / gradients | in-backward bound "
        "(GiB) | what holds in-backward above the bound | fits plain | fits in-backward "
        "| estimate took |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for config, est in results.get("table", {}).items():
        held = est["in_backward"]["peak"]["held_gradients"]
        why = "; ".join(f"{w} {b / GIB:.2f} GiB" for w, b, _ in held) or (
            f"nothing (peak in {est['in_backward']['peak']['phase']})"
        )
        share = est["saving_share_of_gradients"]
        lines.append(
            f"| `{config}` | {est['nproc']} | {est['batch_size']} x {est['seq_len']} "
            f"| {'on' if est['activation_checkpointing'] else 'off'} "
            f"| {est['optimizer'].rsplit('.', 1)[-1]} "
            f"| {_fmt(est['plain']['peak']['total'])} "
            f"| {_fmt(est['in_backward']['peak']['total'])} "
            f"| {_fmt(est['saving'])} | {share:.0%} "
            f"| {_fmt(est['in_backward_bound'])} | {why} "
            f"| {_fits_cell(est, 'plain')} | {_fits_cell(est, 'in_backward')} "
            f"| {est['wall_s']:.0f} s |"
        )
    paged = [
        f"`{config}` {est['paged_state_bytes'] / GIB:.2f} GiB"
        for config, est in results.get("table", {}).items()
        if est.get("paged_state_bytes")
    ]
    if paged:
        lines += [
            "",
            "Paged optimizer state, counted in both peaks above: it lives in CUDA "
            "managed memory, which `torch.cuda.max_memory_allocated` (the recipes' "
            "`peak_memory_alloc`) does not count and the driver can move to host "
            "memory: " + ", ".join(paged) + ". The fits columns say in brackets "
            "which GPUs a run fits with it all on host (slower steps).",
        ]
    lines += [
        "",
        "## Why in-backward saves less than the gradients' bytes",
        "",
        "- **The peak moves.** Plain training peaks at the end of backward or in the "
        "optimizer step, with every gradient alive. In-backward frees those, and its "
        "peak is elsewhere: at the start of backward (the logits' gradients and the "
        "output projection's gradient) or in forward (the activations), where "
        "gradients play no part. Where forward's peak is above backward's (long "
        "samples without activation checkpointing, or the logits of a large "
        "vocabulary), in-backward saves nothing: lower it with activation "
        "checkpointing, a smaller batch or shorter samples.",
        "- **Some gradients are sums that cannot be applied early.** A parameter "
        "used more than once has its gradient summed by autograd over all its uses "
        "before any update: the embedding tied to the output projection, from the "
        "output projection's backward (the first) to the embedding's (the last); "
        "the output projection, over the chunks of the chunked cross-entropy loss. "
        "Under FSDP2 a unit's gradients are whole (unsharded) until its "
        "reduce-scatter, so such a sum is the whole parameter's size on every rank.",
        "- **Buckets and FSDP2 buffers**: gradients waiting in an unfinished bucket "
        "(at most `optimizer_in_bwd_bucket_cap_mb`), FSDP2's reduce-scatter buffers.",
        "- **On CPU only**, bitsandbytes' fallback update dequantizes the state of the "
        "parameter it updates to fp32 (about 5 fp32 copies of it), in either mode; "
        "for the 1B model's 525 MB embedding that is the largest temporary.",
    ]
    lines += ["", "## Breakdown at each peak (GiB per rank, estimated)", ""]
    cats = CATEGORIES
    lines.append("| config | mode | peak in | " + " | ".join(cats) + " |")
    lines.append("|---|---|---|" + "---:|" * len(cats))
    for config, est in results.get("table", {}).items():
        for mode in ("plain", "in_backward"):
            peak = est[mode]["peak"]
            lines.append(
                f"| `{config}` | {mode.replace('_', '-')} | {peak['phase']} | "
                + " | ".join(_fmt(peak["by_category"].get(c, 0)) for c in cats)
                + " |"
            )
    checks = results.get("checks", {})
    if checks:
        lines += [
            "",
            "## Checks against measured runs (CPU, peak RSS per process)",
            "",
            "Each measured run is the recipe itself (`tune run`'s recipe file) on this "
            "machine's CPU: random weights, the test tokenizer, full-length samples, "
            "2 or 3 steps; the peak RSS of the training steps of each process (reset "
            "when the epoch starts, read before the epoch-end save), with glibc's mmap "
            "threshold fixed at 64 KiB (`MALLOC_MMAP_THRESHOLD_=65536`) so that freed "
            "tensors leave RSS. The estimate is run with the same config and overrides "
            "(`device=cpu`: bitsandbytes' CPU update, which dequantizes each "
            "parameter's state to fp32, is what runs there). RSS also holds what the "
            "estimate does not count (the interpreter and torch's libraries, the "
            "tokenizer and data, the allocator's own overhead): the constant below, "
            "measured minus estimated, the same in both modes.",
            "",
            "| check | mode | measured peak RSS (GB) | estimated peak (GB) | "
            "measured - estimated (GB) |",
            "|---|---|---:|---:|---:|",
        ]
        for name, check in checks.items():
            est = check["estimate"]
            for mode in ("plain", "in_backward"):
                meas = check[f"measured_{mode}"]["peak_rss"]
                e = est[mode]["peak"]["total"]
                lines.append(
                    f"| {name} | {mode.replace('_', '-')} | {meas / GB:.2f} "
                    f"| {e / GB:.2f} | {(meas - e) / GB:+.2f} |"
                )
        lines += [
            "",
            "| check | measured saving (GB) | estimated saving (GB) | error | "
            "gradients (GB) | measured / gradients | estimated / gradients |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, check in checks.items():
            est = check["estimate"]
            meas = (
                check["measured_plain"]["peak_rss"]
                - check["measured_in_backward"]["peak_rss"]
            )
            saving, grads = est["saving"], est["gradient_bytes"]
            lines.append(
                f"| {name} | {meas / GB:.3f} | {saving / GB:.3f} "
                f"| {_error(saving, meas, grads)} | {grads / GB:.2f} "
                f"| {meas / grads:.0%} | {saving / grads:.0%} |"
            )
        for name, check in checks.items():
            lines += [
                "",
                f"`{name}`: `{check['recipe']}` `--config {check['config']}` over "
                f"{check['nproc']} process(es), overrides besides the assets: "
                + ", ".join(
                    f"`{o}`"
                    for o in check["overrides"]
                    if not o.startswith(("tokenizer.path", "dataset.", "checkpointer."))
                    and "metric_logger" not in o
                ),
            ]
    lines += _traces_markdown(results)
    return "\n".join(lines) + "\n"


def _traces_markdown(results: dict[str, Any]) -> list[str]:
    """The ``trace`` and ``gloo`` sections of the report."""
    lines: list[str] = []
    traces = results.get("traces", {})
    if traces:
        lines += [
            "",
            "## Checks traced on real tensors (`trace`)",
            "",
            "The check's step as the estimate takes it, on real randomly initialized "
            "tensors over the check's processes (gloo), second step: counted by the "
            "estimate's own counting (its tracker), by torch's allocator (the "
            "profiler's allocation events, from what is alive at the step's start), "
            "and by peak RSS above RSS at the step's start, per phase (the "
            "process's constant is not in it). GB, the largest rank.",
            "",
            "| check | mode | estimated (fake tensors) | counted, real tensors "
            "| torch's allocator | RSS above start, by phase |",
            "|---|---|---|---|---|---|",
        ]
        for name, ranks in traces.items():
            est = results["checks"][name]["estimate"]
            for mode in ("plain", "in_backward"):
                rank = max(ranks, key=lambda r: r[mode]["profiled_peak"])[mode]
                counted = rank["counted"]
                rss = ", ".join(
                    f"{phase} {nbytes / GB:.3f}"
                    for phase, nbytes in rank["rss_above_start_by_phase"]
                )
                lines.append(
                    f"| {name} | {mode.replace('_', '-')} "
                    f"| {est[mode]['peak']['total'] / GB:.3f} "
                    f"({est[mode]['peak']['phase']}) "
                    f"| {counted['peak'] / GB:.3f} ({counted['phase']}) "
                    f"| {rank['profiled_peak'] / GB:.3f} ({rank['profiled_phase']}) "
                    f"| {rss} |"
                )
    gloo = results.get("gloo")
    if gloo:
        lines += [
            "",
            "## gloo's collectives (`gloo`)",
            "",
            f"Bytes torch's allocator gives a gloo collective beyond its output, 2 "
            f"processes, a buffer of {gloo['buffer'] / 10**6:.0f} MB: "
            f"`reduce_scatter_tensor` {gloo['reduce_scatter_tensor'] / 10**6:.0f} MB, "
            f"`all_gather_into_tensor` {gloo['all_gather_into_tensor'] / 10**6:.0f} "
            "MB (peak during the call). NCCL works in the buffers it is given.",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "run-recipe":
        recipe, out, sep, *rest = argv[1:]
        run_recipe(recipe, Path(out), rest)
        return 0
    if argv and argv[0] == "gloo-rank":
        gloo_rank(Path(argv[1]))
        return 0
    if argv and argv[0] == "trace-rank":
        recipe, config, nproc, out, sep, *rest = argv[1:]
        trace_rank(recipe, config, rest, int(nproc), Path(out))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "what",
        choices=(
            "table",
            "check-1b",
            "check-fsdp",
            "check-recipe",
            "re-estimate",
            "trace",
            "gloo",
            "report",
        ),
    )
    parser.add_argument(
        "--check",
        action="append",
        help="trace: the stored check's name; re-estimate: only these (repeatable)",
    )
    parser.add_argument("--family", choices=sorted(FAMILIES), default="dpo")
    parser.add_argument("--model", choices=sorted(RECIPE_MODELS), default="tiny")
    parser.add_argument("--nproc", type=int, default=1, help="processes (torchrun)")
    parser.add_argument("--work-dir", default="/tmp/memory_estimate_checks")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--ac", action="store_true", help="activation checkpointing")
    args = parser.parse_args(argv)
    if args.what == "table":
        table(args)
    elif args.what == "check-1b":
        check_1b(args)
    elif args.what == "check-fsdp":
        check_fsdp(args)
    elif args.what == "check-recipe":
        check_recipe(args)
    elif args.what == "re-estimate":
        re_estimate(args)
    elif args.what == "trace":
        trace(args)
    elif args.what == "gloo":
        gloo(args)
    else:
        _save(_load())
    return 0


if __name__ == "__main__":
    sys.exit(main())
