"""Helpers for recipe tests: run ``tune run``, read its metrics back, compare runs.

A typical recipe test::

    run = run_recipe(
        "full_finetune_single_device",
        tiny_config("tiny_full_single_device"),
        {"assets_dir": tiny_assets.root, "max_steps_per_epoch": 3},
        tmp_path,
    )
    assert_steps(run, [1, 2, 3])

Every runner runs the same command line (:func:`tune_argv`) and sends the metrics
to a ``DiskLogger`` file of the run's own under ``output_dir/logs``, which it parses
back, so a test sees exactly the steps its run logged, even when a second run (a
resume) writes into the same ``output_dir``:

- :func:`run_tune_in_process`: in the test process (no interpreter start or imports
  per run); the single-device recipes' runs.
- :func:`run_tune_forked`: on processes forked from a preloaded server; the
  distributed recipes' runs, one process or several.
- :func:`run_tune`: ``tune run`` in a process of its own (torchrun for several):
  the reference ``test_harness_smoke.py`` compares the other two with, bitwise.

:func:`run_recipe` picks the first or the second. A run killed at a chosen moment is
``crash_run.py``'s; what several test files need besides runs is in
``tests/helpers.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tests.assets.make_assets import TinyAssets

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = Path(__file__).resolve().parent / "configs"

DISK_LOGGER = "torchtune.training.metric_logging.DiskLogger"
# Keys that run_tune sets itself; pass ``output_dir=`` to run_tune instead.
_RESERVED_KEYS = ("output_dir", "metric_logger")
_OUTPUT_TAIL_CHARS = 6000

_STEP_LINE = re.compile(r"^Step (\d+) \| (.*)$")
# A metric name at the start of the payload or after whitespace, followed by ':'.
_METRIC_NAME = re.compile(r"(?:^|\s)([A-Za-z_][\w./-]*):")
_NUMBER = re.compile(r"[-+]?(?:nan|inf|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")


class TuneRunError(RuntimeError):
    """A ``tune run`` subprocess failed or ran past its timeout.

    Attributes:
        command (list[str]): the command that was run.
        returncode (int | None): its exit status, None if it was killed on timeout.
        output (str): everything it wrote to stdout and stderr.
    """

    def __init__(
        self, message: str, command: list[str], returncode: int | None, output: str
    ):
        tail = output[-_OUTPUT_TAIL_CHARS:]
        super().__init__(
            f"{message}\ncommand: {' '.join(command)}\n"
            f"--- last {len(tail)} characters of stdout+stderr ---\n{tail}"
        )
        self.command = command
        self.returncode = returncode
        self.output = output


@dataclass
class TuneRun:
    """What one ``tune run`` left behind.

    Attributes:
        losses (list[float]): the ``loss`` logged at each step, in step order.
        metrics (dict[int, dict[str, float]]): every metric logged, by step
            (``loss``, ``lr``, ``tokens_per_second_per_gpu``, ``grad_norm``, ...).
        output_dir (Path): the run's ``output_dir`` (checkpoints, ``logs/``).
        log_file (Path): the ``DiskLogger`` file the metrics were read from.
        command (list[str]): the command that was run.
        output (str): everything the run wrote to stdout and stderr.
        wall_s (float): wall-clock seconds the subprocess took.
    """

    losses: list[float]
    metrics: dict[int, dict[str, float]]
    output_dir: Path
    log_file: Path
    command: list[str] = field(repr=False)
    output: str = field(repr=False)
    wall_s: float


def tiny_config(name: str) -> Path:
    """Path of a tiny config shipped in ``tests/recipes/configs``.

    Args:
        name (str): the file name, with or without ``.yaml``
            (e.g. ``"tiny_full_single_device"``).

    Returns:
        Path: the absolute path of the YAML file.

    Raises:
        FileNotFoundError: if there is no such config.
    """
    path = CONFIGS_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.is_file():
        available = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"No tiny config {name!r}; available: {available}")
    return path


def tiny_overrides(
    assets: TinyAssets,
    *,
    lora: bool = False,
    seed: int = 0,
    max_steps_per_epoch: int = 3,
) -> dict[str, Any]:
    """Overrides that turn any llama2 fine-tuning config into a tiny CPU run.

    The tiny configs in ``tests/recipes/configs`` already hold all of this and only
    need ``assets_dir``; these overrides make an upstream config (for example
    ``llama2/7B_full``) use the tiny model, tokenizer, data and checkpoint too. The
    optimizer and LR scheduler are left as the config has them.

    Args:
        assets (TinyAssets): the generated assets (the ``tiny_assets`` fixture).
        lora (bool): build ``lora_llama2`` instead of ``llama2``. Default: False.
        seed (int): the recipe seed. Default: 0.
        max_steps_per_epoch (int): steps per epoch (one epoch is run). Default: 3.

    Returns:
        dict[str, Any]: ``key -> value`` overrides for ``run_tune``.
    """
    model_kwargs = {k: v for k, v in assets.model_kwargs.items() if k != "rope_base"}
    overrides: dict[str, Any] = {
        "assets_dir": assets.root,
        "tokenizer._component_": "torchtune.models.llama2.llama2_tokenizer",
        "tokenizer.path": assets.tokenizer_path,
        "tokenizer.max_seq_len": 128,
        "tokenizer.prompt_template": None,
        "dataset._component_": "torchtune.datasets.instruct_dataset",
        "dataset.source": "json",
        "dataset.data_files": assets.train_data,
        "dataset.packed": False,
        "model._component_": (
            "torchtune.models.llama2.lora_llama2"
            if lora
            else "torchtune.models.llama2.llama2"
        ),
        **{f"model.{k}": v for k, v in model_kwargs.items()},
        "checkpointer._component_": "torchtune.training.FullModelHFCheckpointer",
        "checkpointer.checkpoint_dir": assets.checkpoint_dir,
        "checkpointer.checkpoint_files": list(assets.checkpoint_files),
        "checkpointer.model_type": "LLAMA2",
        "checkpointer.recipe_checkpoint": None,
        "device": "cpu",
        "dtype": "fp32",
        "seed": seed,
        "epochs": 1,
        "max_steps_per_epoch": max_steps_per_epoch,
        "compile": False,
        "enable_activation_checkpointing": False,
        "enable_activation_offloading": False,
        "log_every_n_steps": 1,
        "log_peak_memory_stats": False,
    }
    if lora:
        overrides.update(
            {
                "model.lora_attn_modules": ["q_proj", "v_proj", "output_proj"],
                "model.apply_lora_to_mlp": True,
                "model.apply_lora_to_output": False,
                "model.lora_rank": 4,
                "model.lora_alpha": 8,
                "model.lora_dropout": 0.0,
            }
        )
    return overrides


# The components a shipped config names that describe assets this machine lacks
# (weights, tokenizer files, a downloaded dataset); ``shipped_config_overrides``
# swaps each for its tiny counterpart.
_SWAPPED_COMPONENTS = ("model", "tokenizer", "dataset", "checkpointer")


def shipped_config_overrides(
    assets: TinyAssets,
    config: Path | str,
    settings: Mapping[str, Any] | None = None,
) -> list[str]:
    """Overrides that run a config shipped with torchtune on this CPU machine, as shipped.

    Unlike ``tiny_overrides``, only what the machine forces is changed: the model,
    tokenizer, checkpoint and dataset (the real ones are not here), the device and
    the CUDA-only options. The optimizer, its LR scheduler, ``dtype``, the loss,
    activation checkpointing, ``compile``, batch size and every other key stay as the
    config has them. The run length and seed are the caller's (``settings``).

    Args:
        assets (TinyAssets): the generated assets (the ``tiny_assets`` fixture).
        config (Path | str): the shipped YAML file.
        settings (Mapping[str, Any] | None): further ``key -> value`` overrides the
            caller chooses (run length, seed, a resume, a test's own change); they
            win over the forced ones. Default: None.

    Returns:
        list[str]: ``"key=value"`` and ``"~key"`` overrides for ``run_tune`` or
        ``run_tune_in_process``.
    """
    import inspect

    from omegaconf import OmegaConf

    from torchtune.config._utils import _get_component_from_path

    shipped = OmegaConf.to_container(OmegaConf.load(config), resolve=False)
    model_kwargs = {k: v for k, v in assets.model_kwargs.items() if k != "rope_base"}
    forced: dict[str, Any] = {
        # The tiny Llama2 of tests/assets instead of the config's model.
        "model._component_": "torchtune.models.llama2.llama2",
        **{f"model.{k}": v for k, v in model_kwargs.items()},
        # Its sentencepiece tokenizer (the config's tokenizer files are not here).
        # Truncating at 128 tokens keeps every sample within the tiny model's 256
        # positions (shipped configs do not truncate).
        "tokenizer._component_": "torchtune.models.llama2.llama2_tokenizer",
        "tokenizer.path": assets.tokenizer_path,
        "tokenizer.max_seq_len": 128,
        # The local instruct data instead of a dataset on the Hugging Face hub.
        "dataset._component_": "torchtune.datasets.instruct_dataset",
        "dataset.source": "json",
        "dataset.data_files": assets.train_data,
        # The tiny checkpoint is in Hugging Face format with Llama2 key names.
        "checkpointer._component_": "torchtune.training.FullModelHFCheckpointer",
        "checkpointer.checkpoint_dir": assets.checkpoint_dir,
        "checkpointer.checkpoint_files": list(assets.checkpoint_files),
        "checkpointer.model_type": "LLAMA2",
        # No GPU here; activation offloading needs CUDA streams.
        "device": "cpu",
        "enable_activation_offloading": False,
    }
    forced.update(settings or {})
    # Drop the keys of a swapped component that its tiny replacement does not take
    # (``merges_file`` of a BPE tokenizer, ``vocab_path``, a model's own sizes, ...).
    removed = []
    for node in _SWAPPED_COMPONENTS:
        component = _get_component_from_path(forced[f"{node}._component_"])
        accepted = inspect.signature(component).parameters
        for key in shipped.get(node) or {}:
            if key != "_component_" and key not in accepted:
                removed.append(f"~{node}.{key}")
    return removed + [format_override(k, v) for k, v in forced.items()]


# The four checkpointers of a PPO config, and which model each one reads.
_PPO_CHECKPOINTERS = {
    "checkpointer": "policy",
    "ref_policy_checkpointer": "policy",
    "value_checkpointer": "reward",
    "reward_checkpointer": "reward",
}


def is_ppo_config(config: Path | str) -> bool:
    """Whether a config is shaped for ``ppo_full_finetune_single_device``: it names
    ``policy_model`` and ``reward_and_value_model`` instead of one ``model``."""
    from omegaconf import OmegaConf

    shipped = OmegaConf.load(config)
    return "policy_model" in shipped and "reward_and_value_model" in shipped


def ppo_shipped_config_overrides(
    assets: TinyAssets,
    config: Path | str,
    settings: Mapping[str, Any] | None = None,
) -> list[str]:
    """``shipped_config_overrides`` for a PPO config (see :func:`is_ppo_config`).

    A PPO config has no ``model`` or single ``checkpointer`` to swap: it names a
    policy, a reward-and-value classifier, four checkpointers and a prompt dataset,
    and its run length is ``num_steps`` prompts rather than epochs. As in
    ``shipped_config_overrides``, only what this machine forces changes:

    - ``policy_model``: Mistral's builder with the sizes of the tiny model of
      ``tests/assets``, whose Llama2 checkpoint it loads as is (same modules and key
      names); ``reward_and_value_model``: the config's classifier builder with those
      sizes (``tests/assets/make_ppo_assets.py`` makes its checkpoint).
    - The tokenizer file (Mistral's tokenizer over the tiny sentencepiece model), the
      dataset's data (the tiny prompts, read from JSON by the config's own dataset
      builder and column), and each checkpointer's ``checkpoint_dir`` and
      ``checkpoint_files`` (the model types stay the config's).
    - ``device=cpu``, and ``compile=False``: the config compiles the layers of all
      four models, which on this 2-core CPU costs more than the whole run (measured
      with dynamo's ``aot_eager`` backend, no code generation at all: 60 s for the
      first step, 160 s for the run instead of 45 s, with the same losses).

    The optimizer, ``dtype``, batch sizes, activation checkpointing, the KV cache,
    generation and PPO settings and every other key stay as the config has them.

    Args:
        assets (TinyAssets): the generated assets (the ``tiny_assets`` fixture).
        config (Path | str): the shipped YAML file.
        settings (Mapping[str, Any] | None): the caller's overrides, as for
            ``shipped_config_overrides``. ``epochs`` and ``max_steps_per_epoch``, if
            given, are turned into PPO's terms: the dataset is cut to
            ``max_steps_per_epoch`` batches of ``batch_size`` prompts, and
            ``num_steps`` covers ``epochs`` passes over it. Every other setting is
            passed on and wins over the forced ones. Default: None.

    Returns:
        list[str]: ``"key=value"`` and ``"~key"`` overrides for ``run_tune`` or
        ``run_tune_in_process``.
    """
    import inspect

    from omegaconf import OmegaConf

    from tests.assets.make_ppo_assets import ensure_ppo_assets
    from torchtune.config._utils import _get_component_from_path

    ppo = ensure_ppo_assets(assets)
    shipped = OmegaConf.to_container(OmegaConf.load(config), resolve=False)
    settings = dict(settings or {})
    epochs = settings.pop("epochs", 1)
    steps_per_epoch = settings.pop("max_steps_per_epoch", None)
    batch_size = settings.get("batch_size", shipped["batch_size"])
    if steps_per_epoch is None:
        steps_per_epoch = ppo.num_prompts // batch_size
    if steps_per_epoch * batch_size > ppo.num_prompts:
        raise ValueError(
            f"{steps_per_epoch} steps of batch_size={batch_size} need "
            f"{steps_per_epoch * batch_size} prompts; the tiny prompt dataset has "
            f"{ppo.num_prompts}."
        )
    checkpoints = {
        "policy": (assets.checkpoint_dir, assets.checkpoint_files),
        "reward": (ppo.reward_checkpoint_dir, ppo.reward_checkpoint_files),
    }
    forced: dict[str, Any] = {
        "policy_model._component_": "torchtune.models.mistral.mistral",
        **{f"policy_model.{k}": v for k, v in ppo.model_kwargs.items()},
        "reward_and_value_model.num_classes": 1,
        **{f"reward_and_value_model.{k}": v for k, v in ppo.model_kwargs.items()},
        "tokenizer._component_": "torchtune.models.mistral.mistral_tokenizer",
        "tokenizer.path": assets.tokenizer_path,
        "dataset.source": "json",
        "dataset.data_files": ppo.prompts,
        # Exactly steps_per_epoch batches per epoch (the loader drops the rest).
        "dataset.split": f"train[:{steps_per_epoch * batch_size}]",
        "num_steps": epochs * steps_per_epoch * batch_size,
        "device": "cpu",
        "compile": False,
    }
    for node, model in _PPO_CHECKPOINTERS.items():
        checkpoint_dir, checkpoint_files = checkpoints[model]
        forced[f"{node}.checkpoint_dir"] = checkpoint_dir
        forced[f"{node}.checkpoint_files"] = list(checkpoint_files)
    forced.update(settings)
    # Drop the keys of a swapped component that its replacement does not take (the
    # 7B builder takes none of the sizes, so the config gives none).
    removed = []
    for node in ("policy_model", "reward_and_value_model", "tokenizer"):
        component = forced.get(f"{node}._component_", shipped[node]["_component_"])
        accepted = inspect.signature(_get_component_from_path(component)).parameters
        for key in shipped.get(node) or {}:
            if key != "_component_" and key not in accepted:
                removed.append(f"~{node}.{key}")
    return removed + [format_override(k, v) for k, v in forced.items()]


def format_override(key: str, value: Any) -> str:
    """Write one ``key=value`` command-line override as ``tune run`` parses it.

    Args:
        key (str): a dotted config key.
        value (Any): None, a bool, a number, a string, a path, or a list of those.

    Returns:
        str: the override, e.g. ``"optimizer_in_bwd=True"`` or ``"seed=null"``.

    Raises:
        ValueError: if the value contains ``=``, which ``tune run`` cannot parse.
    """

    def fmt(v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(fmt(item) for item in v) + "]"
        return str(v)

    text = fmt(value)
    if "=" in text:
        raise ValueError(
            f"Override {key}={text!r} contains '=', which tune run cannot parse "
            "(it splits each override on '='). Use a value without '='."
        )
    return f"{key}={text}"


def _override_list(overrides: Mapping[str, Any] | Sequence[str] | None) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        items = [format_override(k, v) for k, v in overrides.items()]
    else:
        items = [str(item) for item in overrides]
    for item in items:
        key = item.lstrip("~").split("=", 1)[0]
        if key.split(".", 1)[0] in _RESERVED_KEYS:
            raise ValueError(
                f"Override {item!r} sets {key}, which run_tune sets itself so it can "
                "read the metrics back; pass output_dir= to run_tune instead."
            )
    return items


def read_disk_log(path: Path | str) -> dict[int, dict[str, float]]:
    """Parse a ``DiskLogger`` file into metrics by step.

    ``DiskLogger`` writes ``Step <n> | name:value name:value ...`` lines (one per
    ``log_dict`` call) and ``Step <n> | name:value`` lines (one per ``log`` call).
    Lines for the same step are merged; a later value of a metric wins. A value that
    prints as a tensor (``tensor(0.25)``) is read as its first number.

    Args:
        path (Path | str): the log file.

    Returns:
        dict[int, dict[str, float]]: ``{step: {metric: value}}``, steps in file order.

    Raises:
        ValueError: if a line starting with ``Step`` has a value with no number in it.
    """
    metrics: dict[int, dict[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        match = _STEP_LINE.match(line.strip())
        if match is None:
            continue
        step, payload = int(match.group(1)), match.group(2)
        names = list(_METRIC_NAME.finditer(payload))
        for i, name in enumerate(names):
            end = names[i + 1].start() if i + 1 < len(names) else len(payload)
            raw = payload[name.end() : end].strip()
            number = _NUMBER.search(raw)
            if number is None:
                raise ValueError(
                    f"{path}: step {step} metric {name.group(1)!r} has no number in "
                    f"{raw!r}"
                )
            metrics.setdefault(step, {})[name.group(1)] = float(number.group())
    return metrics


def _new_log_file(output_dir: Path, *, reserve: bool = True) -> Path:
    """The first ``output_dir/logs/metrics_<k>.txt`` not yet there: a run's own
    ``DiskLogger`` file. ``reserve`` creates it (and ``logs/``) now, so that two runs
    started back to back never share one; a run in this process needs no
    reservation, and a refused one must leave no ``logs/`` behind."""
    log_dir = output_dir / "logs"
    k = 0
    while (log_dir / f"metrics_{k}.txt").exists():
        k += 1
    if reserve:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"metrics_{k}.txt").touch()
    return log_dir / f"metrics_{k}.txt"


def _subprocess_env(
    output_dir: Path, extra: Mapping[str, str] | None
) -> dict[str, str]:
    env = dict(os.environ)
    # Never reach the Hugging Face hub; keep the datasets cache out of $HOME.
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    env["HF_DATASETS_CACHE"] = str(output_dir / ".hf_datasets_cache")
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def run_outputs(output_dir: Path, log_file: Path) -> list[str]:
    """The overrides every runner adds (the reserved keys): the run's ``output_dir``
    and a ``DiskLogger`` writing to ``log_file``."""
    return [
        f"output_dir={output_dir}",
        f"metric_logger._component_={DISK_LOGGER}",
        f"metric_logger.log_dir={log_file.parent}",
        f"metric_logger.filename={log_file.name}",
    ]


def _logged_run(
    output_dir: Path, log_file: Path, command: list[str], output: str, wall_s: float
) -> TuneRun:
    """The run as its ``DiskLogger`` file ``log_file`` tells it.

    Raises:
        TuneRunError: if it logged no metrics (or no file), so that two runs that
            logged nothing can never compare equal.
    """
    metrics = read_disk_log(log_file) if log_file.is_file() else {}
    if not metrics:
        raise TuneRunError(
            f"the run ended without an error but logged no metrics to {log_file}",
            command,
            0,
            output,
        )
    return TuneRun(
        losses=[v["loss"] for _, v in sorted(metrics.items()) if "loss" in v],
        metrics=dict(sorted(metrics.items())),
        output_dir=output_dir,
        log_file=log_file,
        command=command,
        output=output,
        wall_s=wall_s,
    )


def run_tune(
    recipe: str,
    config: Path | str,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
    *,
    nproc: int = 1,
    distributed: bool | None = None,
    output_dir: Path | str,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> TuneRun:
    """Run ``tune run [--nproc_per_node N] <recipe> --config <config> k=v ...``.

    The subprocess runs from the repository root with the current interpreter, so it
    imports the same (installed) ``torchtune``. Its metrics go to a new
    ``DiskLogger`` file under ``output_dir/logs``, which is parsed back.

    Args:
        recipe (str): a recipe name known to ``tune ls`` (e.g.
            ``"full_finetune_single_device"``) or a custom recipe as ``tune run`` takes it.
        config (Path | str): a config name known to ``tune ls`` or a YAML path.
        overrides (Mapping[str, Any] | Sequence[str] | None): config overrides, as a
            mapping (values formatted by ``format_override``) or as ready
            ``"key=value"`` / ``"~key"`` strings. Must not set ``output_dir`` or
            ``metric_logger``.
        nproc (int): number of processes. Default: 1.
        distributed (bool | None): launch through torchrun (``--nproc_per_node``).
            Default None: when ``nproc > 1`` or the recipe name contains
            ``"distributed"`` (a distributed recipe needs torchrun even on 1 process).
        output_dir (Path | str): the run's ``output_dir``; created if missing.
        timeout (float): seconds before the whole process group is killed.
            Default: 300.
        env (Mapping[str, str] | None): extra environment variables.

    Returns:
        TuneRun: losses and metrics by step, paths, output and wall time.

    Raises:
        ValueError: if ``nproc < 1`` or an override sets a reserved key.
        TuneRunError: if the run exits non-zero, times out, or logs no metrics. The
            message holds the tail of the run's stdout and stderr.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if distributed is None:
        distributed = nproc > 1 or "distributed" in recipe
    output_dir = Path(output_dir).resolve()
    log_file = _new_log_file(output_dir)

    command = [sys.executable, "-m", "torchtune._cli.tune", "run"]
    if distributed:
        command += ["--nproc_per_node", str(nproc)]
    elif nproc > 1:
        raise ValueError(f"nproc={nproc} needs distributed=True (torchrun)")
    command += [recipe, "--config", str(config)]
    command += _override_list(overrides)
    command += run_outputs(output_dir, log_file)

    start = time.perf_counter()
    # A new session lets a timeout kill torchrun and all its workers together.
    proc = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=_subprocess_env(output_dir, env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun's workers may sit in sessions of their own: kill every
        # descendant, or one left holding stdout would block communicate().
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        output, _ = proc.communicate()
        raise TuneRunError(
            f"tune run {recipe} ran past its {timeout:.0f} s timeout and was killed",
            command,
            None,
            output,
        ) from None
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise TuneRunError(
            f"tune run {recipe} exited with status {proc.returncode}",
            command,
            proc.returncode,
            output,
        )
    return _logged_run(output_dir, log_file, command, output, wall_s)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from ``/proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def run_tune_forked(
    recipe: str,
    config: Path | str,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
    *,
    nproc: int = 2,
    output_dir: Path | str,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> TuneRun:
    """``tune run RECIPE --config CONFIG overrides`` on ``nproc`` processes that form
    a gloo group, as ``tune run --nproc_per_node NPROC`` does, without paying for
    interpreters and imports.

    Each rank is a process forked from a server that imported torch and torchtune
    once, in a fresh interpreter, and nothing since
    (``tests.torchtune.distributed_launcher``, ``start="preloaded"``); it gets the
    environment ``run_tune`` gives its subprocess plus what torchrun gives a rank
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), one intra-op thread (as torchrun
    gives each of several processes), and runs ``tune``'s entry point on the command
    line of :func:`run_tune` without ``--nproc_per_node``: the same parsing, the same
    recipe file, the same ``recipe_main``, each rank a real process of its own. The
    run's metrics and output are read back as :func:`run_tune` reads them;
    ``output`` is every rank's, rank 0's first. The Hugging Face datasets cache is
    the server's (one per test process), not one per ``output_dir``.

    Args and Returns: as :func:`run_tune` (``nproc`` defaults to 2).

    Raises:
        ValueError: if ``nproc < 1`` or an override sets a reserved key.
        TuneRunError: if a rank exits non-zero, the run times out (every rank is
            killed, with what it started), or it logs no metrics.
    """
    from tests.torchtune.distributed_launcher import (
        free_port,
        kill_child,
        preloaded_context,
        rank_env,
        start_child,
    )

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    output_dir = Path(output_dir).resolve()
    log_file = _new_log_file(output_dir)
    argv = tune_argv(recipe, config, overrides, output_dir, log_file)
    context = preloaded_context()
    base_env = _subprocess_env(output_dir, env)
    port = free_port()
    rank_logs = [
        log_file.with_name(f"{log_file.stem}_rank{r}.out") for r in range(nproc)
    ]
    start = time.perf_counter()
    ranks = []
    try:
        for rank in range(nproc):
            ranks.append(
                start_child(
                    context,
                    forked_tune_main,
                    (argv,),
                    base_env | rank_env(rank, nproc, port),
                    rank_logs[rank],
                    replace_env=True,
                )
            )
        deadline = start + timeout
        for process in ranks:
            process.join(max(0.0, deadline - time.perf_counter()))
    finally:
        timed_out = [p for p in ranks if p.is_alive()]
        for process in timed_out:  # only the ranks started above
            kill_child(process)
    wall_s = time.perf_counter() - start
    output = "".join(
        path.read_text(errors="replace") if path.is_file() else "" for path in rank_logs
    )
    command = [*argv[:2], f"(forked, {nproc} processes)", *argv[2:]]
    if timed_out:
        raise TuneRunError(
            f"tune run {recipe} on {nproc} forked processes ran past its "
            f"{timeout:.0f} s timeout and was killed",
            command,
            None,
            output,
        )
    codes = [p.exitcode for p in ranks]
    if any(codes):
        raise TuneRunError(
            f"tune run {recipe} on {nproc} forked processes exited with statuses "
            f"{codes}",
            command,
            next(c for c in codes if c),
            output,
        )
    return _logged_run(output_dir, log_file, command, output, wall_s)


def tune_argv(
    recipe: str,
    config: Path | str,
    overrides: Mapping[str, Any] | Sequence[str] | None,
    output_dir: Path,
    log_file: Path,
) -> list[str]:
    """``tune run RECIPE --config CONFIG overrides`` with the overrides every runner
    adds (:func:`run_outputs`), as ``sys.argv`` (starting with ``tune``)."""
    argv = ["tune", "run", recipe, "--config", str(config), *_override_list(overrides)]
    return argv + run_outputs(output_dir, log_file)


def tune_main(argv: list[str]) -> None:
    """``tune``'s entry point on ``argv`` in this process (the test process itself,
    or a process forked for a run: :func:`forked_tune_main`)."""
    from torchtune._cli.tune import main

    saved, sys.argv = sys.argv, list(argv)
    try:
        main()
    except SystemExit as e:  # a recipe file ends with sys.exit(recipe_main())
        if e.code not in (None, 0):
            raise
    finally:
        sys.argv = saved


def forked_tune_main(argv: list[str]) -> None:
    """:func:`tune_main` in a forked process, from the repository root, as
    ``run_tune`` runs its subprocess."""
    os.chdir(REPO_ROOT)
    tune_main(argv)


def run_tune_in_process(
    recipe: str,
    config: Path | str,
    overrides: Mapping[str, Any] | Sequence[str] | None,
    output_dir: Path,
) -> TuneRun:
    """``tune run RECIPE --config CONFIG overrides`` in this process.

    The same command line as :func:`run_tune` (metrics to a ``DiskLogger`` file of the
    run's own), the same parsing (``torchtune._cli.tune.main``) and the same recipe
    file, without a new interpreter importing torch and torchtune again (about 10 s a
    run here). Single-process recipes only. Exceptions the recipe raises propagate.

    Raises:
        ValueError: if an override sets a reserved key.
        TuneRunError: if the run logs no metrics (as :func:`run_tune`), so that two
            runs that logged nothing can never compare equal.
    """
    output_dir = Path(output_dir)
    log_file = _new_log_file(output_dir, reserve=False)
    argv = tune_argv(recipe, config, overrides, output_dir, log_file)
    start = time.perf_counter()
    tune_main(argv)
    return _logged_run(output_dir, log_file, argv, "", time.perf_counter() - start)


def run_recipe(
    recipe: str,
    config: Path | str,
    overrides: Mapping[str, Any] | Sequence[str] | None,
    output_dir: Path,
    *,
    nproc: int = 2,
) -> TuneRun:
    """A recipe run the cheapest way: a single-device recipe in this process
    (:func:`run_tune_in_process`), a distributed one on ``nproc`` forked processes
    (:func:`run_tune_forked`)."""
    if "distributed" in recipe:
        return run_tune_forked(
            recipe, config, overrides, nproc=nproc, output_dir=output_dir
        )
    return run_tune_in_process(recipe, config, overrides, output_dir)


def read_run(output_dir: Path | str, log_file: Path | str | None = None) -> TuneRun:
    """What a run made without :func:`run_tune` (a recipe built and trained in a
    forked rank) logged and wrote: its ``DiskLogger`` file (by default the tiny
    configs' ``output_dir/logs/metrics.txt``) and its ``output_dir``.

    Raises:
        TuneRunError: if the file logs no metrics, so that two runs that logged
            nothing can never compare equal.
    """
    output_dir = Path(output_dir)
    log_file = Path(log_file) if log_file else output_dir / "logs" / "metrics.txt"
    return _logged_run(output_dir, log_file, [], "", 0.0)


def load_recipe_class(recipe: str, class_name: str) -> type:
    """The class ``class_name`` of the installed recipe file ``recipes/RECIPE.py``
    (``recipe`` as ``tune run`` names it, e.g. ``"dev/early_exit_finetune_distributed"``;
    recipes are files, never an importable package), from a fresh module."""
    import torchtune

    path = Path(torchtune.__file__).parent.parent / "recipes" / f"{recipe}.py"
    spec = importlib.util.spec_from_file_location("_" + recipe.replace("/", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, class_name)


def step_state(step_dir: Path) -> dict[str, Any]:
    """Everything the step checkpoint ``step_dir`` holds, as one full state dict:
    its ``torch.distributed.checkpoint`` files read back whole (the model's and the
    optimizer's entries keyed by parameter name, as torch's full-state API gives
    them; the dataloader's and the RNG's per process, as ``torch.save`` bytes)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as folder:
        dcp_to_torch_save(step_dir, Path(folder) / "state.pt")
        return torch.load(Path(folder) / "state.pt", weights_only=False)


def full_optimizer_state(step_dir: Path) -> dict[str, Any]:
    """The optimizer state of the step checkpoint ``step_dir`` as one full state
    dict keyed by parameter name (what torch's full-state API gives)."""
    return step_state(step_dir)["optimizer"]


def as_indexed(optimizer_state: Mapping[str, Any]) -> dict[str, Any]:
    """A full optimizer state dict keyed by parameter name in ``torch.optim``'s own
    format, as a single-device optimizer's ``state_dict()`` gives it: parameters
    numbered in the order of the groups' ``params``."""
    groups = optimizer_state["param_groups"]
    index = {name: i for i, name in enumerate(n for g in groups for n in g["params"])}
    return {
        "state": {index[n]: state for n, state in optimizer_state["state"].items()},
        "param_groups": [
            g | {"params": [index[n] for n in g["params"]]} for g in groups
        ],
    }


def process_state(step_dir: Path, key: str) -> dict[str, Any]:
    """What each process saved of ``key`` (``"dataloader"``, ``"rng"``) in the step
    checkpoint ``step_dir``, by rank name (``"rank_0"``, ...)."""
    saved = step_state(step_dir)[key]
    return {rank: torch.load(io.BytesIO(data)) for rank, data in saved.items()}


def as_0_6_1_in_backward(
    saved: Mapping[str, Any], *, checkpoint_wrapped: bool
) -> dict[str, Any]:
    """A full optimizer state dict keyed by parameter name (``saved``), as torchtune
    0.6.1's distributed recipes saved it with ``optimizer_in_bwd``: one optimizer per
    parameter, keyed by ``model.named_parameters()`` names (which include activation
    checkpointing's wrapper where it was on), each saved as its own full state dict
    (``get_optimizer_state_dict``: keyed by the clean name). Only the first one holds
    the scheduler's ``initial_lr``: 0.6.1 built the scheduler on that one alone."""
    (group,) = saved["param_groups"]
    legacy = {}
    for i, fqn in enumerate(group["params"]):
        name = fqn
        if checkpoint_wrapped:
            name = re.sub(r"^(layers\.\d+)\.", r"\1._checkpoint_wrapped_module.", fqn)
        hyperparameters = {k: v for k, v in group.items() if k != "params"}
        if i > 0:
            del hyperparameters["initial_lr"]
        legacy[name] = {
            "state": {fqn: saved["state"][fqn]} if fqn in saved["state"] else {},
            "param_groups": [hyperparameters | {"params": [fqn]}],
        }
    assert any("_checkpoint_wrapped_module" in n for n in legacy) == checkpoint_wrapped
    return legacy


# -- comparing runs -----------------------------------------------------------------
#
# A comparison of two runs proves something only if it compares the steps it means
# to: two runs that logged nothing, or a resumed run that logged the wrong steps,
# must fail rather than compare equal. So every helper below takes the exact steps
# it compares, checks that each run logged them, refuses an empty list, and prints
# the largest difference it saw (``pytest -s`` shows it) so a tolerance can be set
# from a measurement.


def assert_steps(run: TuneRun, expected_steps: Iterable[int]) -> list[int]:
    """Assert that ``run`` logged exactly ``expected_steps``, in order.

    Args:
        run (TuneRun): the run.
        expected_steps (Iterable[int]): the step numbers it must have logged, all of
            them and no others.

    Returns:
        list[int]: the steps.

    Raises:
        ValueError: if ``expected_steps`` is empty.
        AssertionError: if the run logged other steps.
    """
    expected = list(expected_steps)
    if not expected:
        raise ValueError(
            "expected_steps is empty: a run that logs nothing proves nothing"
        )
    logged = list(run.metrics)
    assert logged == expected, (
        f"{run.log_file} logged steps {logged}, expected exactly {expected}"
    )
    return expected


def assert_same_steps(
    run: TuneRun, reference: TuneRun, expected_steps: Iterable[int]
) -> list[int]:
    """Assert that both runs logged exactly ``expected_steps`` (see
    :func:`assert_steps`), so a comparison of the two covers every one of them.

    Returns:
        list[int]: the steps.
    """
    assert_steps(reference, expected_steps)
    return assert_steps(run, expected_steps)


def series(run: TuneRun, metric: str, steps: Iterable[int]) -> torch.Tensor:
    """``metric`` at each of ``steps``, as a float64 tensor.

    Raises:
        ValueError: if ``steps`` is empty.
        AssertionError: if a step, or ``metric`` at a step, was not logged.
    """
    steps = list(steps)
    if not steps:
        raise ValueError(f"refusing to compare an empty series of {metric!r}")
    missing = [s for s in steps if metric not in run.metrics.get(s, {})]
    assert not missing, f"{run.log_file} has no {metric!r} at steps {missing}"
    return torch.tensor([run.metrics[s][metric] for s in steps], dtype=torch.float64)


def _max_differences(
    actual: torch.Tensor, expected: torch.Tensor
) -> tuple[float, float]:
    """The largest absolute and relative difference between two tensors, in float64."""
    actual, expected = actual.double(), expected.double()
    diff = (actual - expected).abs()
    if diff.numel() == 0:
        return 0.0, 0.0
    relative = diff / expected.abs().clamp_min(torch.finfo(torch.float64).tiny)
    relative = torch.where(diff == 0, torch.zeros_like(relative), relative)
    return diff.max().item(), relative.max().item()


def assert_series_close(
    run: TuneRun,
    reference: TuneRun,
    metric: str,
    steps: Iterable[int],
    *,
    rtol: float,
    atol: float,
) -> None:
    """``metric`` of ``run`` equals that of ``reference`` at each of ``steps``, within
    ``rtol``/``atol`` (``torch.testing.assert_close``). Prints the largest difference.

    Raises:
        ValueError: if ``steps`` is empty.
        AssertionError: if a run did not log a step, or the values differ.
    """
    steps = list(steps)
    actual, expected = series(run, metric, steps), series(reference, metric, steps)
    abs_diff, rel_diff = _max_differences(actual, expected)
    print(
        f"{metric} over steps {steps[0]}..{steps[-1]} ({len(steps)}): "
        f"max abs diff {abs_diff:.3g}, max rel diff {rel_diff:.3g}"
    )
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def assert_metrics_close(
    run: TuneRun,
    reference: TuneRun,
    metrics: Iterable[str],
    steps: Iterable[int],
    *,
    rtol: float,
    atol: float,
) -> None:
    """:func:`assert_series_close` for each of ``metrics``."""
    steps = list(steps)
    for metric in metrics:
        assert_series_close(run, reference, metric, steps, rtol=rtol, atol=atol)


Tolerances = Mapping[str, Mapping[str, float]]
"""Per compared quantity (``"loss"``, ``"grad_norm"``, ``"weights"``), the ``rtol``
and ``atol`` of ``torch.testing.assert_close``."""


def tolerances(
    loss: float, grad_norm: float, weights: float | None = None
) -> dict[str, dict[str, float]]:
    """:data:`Tolerances`: ``rtol`` for the loss and the grad norm, ``atol`` for the
    final weights (0: bitwise), nothing else."""
    tol = {
        "loss": {"rtol": loss, "atol": 0.0},
        "grad_norm": {"rtol": grad_norm, "atol": 0.0},
    }
    if weights is not None:
        tol["weights"] = {"rtol": 0.0, "atol": weights}
    return tol


BITWISE_TRAINING = tolerances(0.0, 0.0, 0.0)
""":data:`Tolerances` of two runs that must train bitwise alike."""


def assert_same_training(
    run: TuneRun,
    reference: TuneRun,
    tol: Tolerances,
    steps: Iterable[int],
    *,
    run_steps: Iterable[int] | None = None,
    reference_steps: Iterable[int] | None = None,
    final_weights: Callable[[TuneRun], Mapping[str, torch.Tensor]] | None = None,
    weights_match: Callable[..., None] | None = None,
) -> None:
    """Two runs trained alike over ``steps``.

    ``run`` logged exactly ``run_steps`` and ``reference`` exactly
    ``reference_steps`` (each defaults to ``steps``; :func:`assert_steps`). At each of
    ``steps`` they have the same loss and grad norm, within ``tol["loss"]`` and
    ``tol["grad_norm"]``, and the same lr exactly (the schedule depends on nothing
    but the step count). With ``final_weights`` (what a run ended with), both end
    with the same weights: those also hold the update of the last step, which no
    logged loss shows. ``weights_match(actual, expected)`` compares them (for
    example :func:`assert_same_update`); by default :func:`assert_weights_close`
    within ``tol["weights"]``. Prints each largest difference.

    Raises:
        ValueError: if ``steps`` is empty.
        AssertionError: if a run logged other steps, or the runs differ.
    """
    steps = list(steps)
    assert_steps(reference, steps if reference_steps is None else reference_steps)
    assert_steps(run, steps if run_steps is None else run_steps)
    for name in ("loss", "grad_norm"):
        assert_series_close(run, reference, name, steps, **tol[name])
    assert_series_close(run, reference, "lr", steps, rtol=0.0, atol=0.0)
    if final_weights is not None:
        if weights_match is None:
            weights_match = partial(assert_weights_close, **tol["weights"])
        weights_match(final_weights(run), final_weights(reference))


def assert_trains_as_plain(
    bwd: TuneRun,
    plain: TuneRun,
    tol: Tolerances,
    steps: Iterable[int],
    *,
    final_weights: Callable[[TuneRun], Mapping[str, torch.Tensor]],
) -> None:
    """The in-backward run ``bwd`` trained as the ``plain`` one over ``steps``
    (:func:`assert_same_training`, both logging exactly ``steps``), and the
    comparison can fail: the loss moves, and ``bwd``'s grad norm is positive at every
    step (the one the optimizer recorded during backward, read before ``step()``: 0
    had no update run inside backward)."""
    steps = list(steps)
    assert abs(plain.losses[-1] - plain.losses[0]) > 1e-2, plain.losses
    assert (series(bwd, "grad_norm", steps) > 0).all()
    assert_same_training(bwd, plain, tol, steps, final_weights=final_weights)


def load_weights(*paths: Path | str) -> dict[str, torch.Tensor]:
    """The tensors saved in ``paths`` (safetensors or ``torch.save`` files), merged.

    Raises:
        AssertionError: if the files hold no tensor.
    """
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in paths:
        path = Path(path)
        if path.suffix == ".safetensors":
            weights |= load_file(path)
        else:
            weights |= torch.load(path, weights_only=True, map_location="cpu")
    assert weights, f"no tensors in {[str(p) for p in paths]}"
    return weights


def assert_weights_close(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    rtol: float,
    atol: float,
) -> None:
    """The same non-empty set of names, and every tensor within ``rtol``/``atol``
    (``torch.testing.assert_close``, dtypes included). Prints the largest difference.

    Raises:
        AssertionError: if the names differ, there are none, or a tensor differs.
    """
    assert expected, "refusing to compare empty sets of weights"
    assert set(actual) == set(expected), (
        f"names differ: only in actual {sorted(set(actual) - set(expected))}, "
        f"only in expected {sorted(set(expected) - set(actual))}"
    )
    differences = [_max_differences(actual[k], expected[k]) for k in expected]
    changed = sum(not torch.equal(actual[k], expected[k]) for k in expected)
    print(
        f"weights: {changed} of {len(expected)} tensors differ; max abs diff "
        f"{max(d[0] for d in differences):.3g}, max rel diff "
        f"{max(d[1] for d in differences):.3g}"
    )
    torch.testing.assert_close(dict(actual), dict(expected), rtol=rtol, atol=atol)


def assert_same_update(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    rtol: float,
    initial: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Two runs moved their weights from ``initial`` by the same update, within
    ``rtol`` of the update's size, in norm over all tensors together (float64):
    ``||actual - expected|| <= rtol * ||expected - initial||``. Prints the ratio.

    For low-precision runs, where rounding moves single entries by a whole update
    (in bf16, an AdamW update of a gradient entry near zero takes its sign from
    rounding), so an elementwise tolerance would have to be as large as the update
    itself, while the updates as a whole still agree closely.

    Args:
        actual (Mapping[str, torch.Tensor]): one run's final weights.
        expected (Mapping[str, torch.Tensor]): the other run's.
        rtol (float): the largest allowed ratio.
        initial (Mapping[str, torch.Tensor] | None): the weights both started from
            (cast to each tensor's dtype); None compares with ``expected``'s own
            norm. Default: None.

    Raises:
        AssertionError: if the names differ, there are none, or the ratio is larger.
    """
    assert expected, "refusing to compare empty sets of weights"
    assert set(actual) == set(expected), (
        f"names differ: {sorted(set(actual) ^ set(expected))}"
    )
    difference = update = 0.0
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        start = 0.0 if initial is None else initial[name].to(tensor.dtype).double()
        difference += (actual[name].double() - tensor.double()).square().sum().item()
        update += (tensor.double() - start).square().sum().item()
    assert update > 0, "the weights did not move"
    ratio = (difference / update) ** 0.5
    print(f"weights: ||actual - expected|| / ||update|| = {ratio:.3g}")
    assert ratio <= rtol, (
        f"the updates differ by {ratio:.3g} of their size, more than {rtol}"
    )


# A process that holds a flock on the file it is given, as a live run holds
# output_dir's torchtune_run.lock, until it is killed.
HOLD_LOCK = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "time.sleep(120)\n"
)


@contextlib.contextmanager
def held_by_another_process(lock: Path) -> Iterator[int]:
    """``lock`` held, as a live run holds it, by another process (its pid)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()
