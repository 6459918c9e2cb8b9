"""The config options every recipe shares, read and checked once:
:class:`RecipeOptions`."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune import utils
from torchtune.config._errors import InstantiationError
from torchtune.config._utils import _get_component_from_path
from torchtune.training.memory import is_valid_bucket_cap
from torchtune.training.precision import get_dtype

log = utils.get_logger("DEBUG")

# What ``compile`` can turn on, each on its own.
COMPILE_TARGETS = ("model", "loss", "optimizer_step")

# The one profiler the recipes can build: they read its settings back from what it
# returns.
_TORCH_PROFILER = "torchtune.training.setup_torch_profiler"

# torchao optimizers (by class name) with state in quantized tensor subclasses.
_TORCHAO_LOW_BIT = "Adam8bit Adam4bit AdamFp8 AdamW8bit AdamW4bit AdamWFp8".split()

# The fields :meth:`RecipeOptions.from_config` reads otherwise than by their name.
_NOT_READ_AS_NAMED = ("device", "dtype", "bucket_cap_mb", "clip_grad_norm", "compile")

# Counts a recipe config may set: each a positive integer (max_steps_per_epoch: or
# null, no limit), checked before anything is built or written.
COUNT_KEYS = (
    "epochs max_steps_per_epoch batch_size num_steps forward_batch_size "
    "ppo_batch_size ppo_epochs"
).split()

# Flags read by the checkpoint manager and the recipes rather than by RecipeOptions: a
# quoted 'False' would read as true.
BOOL_KEYS = (
    "resume_from_checkpoint resume_allow_changes save_adapter_weights_only shuffle"
).split()

# Top-level keys the library reads that shipped configs may leave out, besides the
# options of :class:`RecipeOptions`.
LIBRARY_KEYS = (
    "fake_quant_after_n_steps optimizer_in_bwd_bucket_cap_mb save_every_n_steps "
    "resume_allow_changes cudnn_deterministic_mode collate_fn"
).split()


def _parse_compile(cfg_compile: object) -> dict[str, bool]:
    """``compile``: a bool compiles the model and the loss, as in torchtune 0.6.1; a
    mapping picks each of :data:`COMPILE_TARGETS` (keys it leaves out are off)."""
    if cfg_compile is None:  # compile: null, as off
        cfg_compile = False
    if not isinstance(cfg_compile, DictConfig | dict):
        _check_bool("compile", cfg_compile)
        return {"model": cfg_compile, "loss": cfg_compile, "optimizer_step": False}
    unknown = set(cfg_compile) - set(COMPILE_TARGETS)
    if unknown:
        raise ValueError(
            f"Unknown compile keys {sorted(unknown)}: compile is a bool or a "
            f"mapping with keys {list(COMPILE_TARGETS)}."
        )
    for key, value in cfg_compile.items():
        _check_bool(f"compile.{key}", value)
    return {key: cfg_compile.get(key, False) for key in COMPILE_TARGETS}


def _check_optimizer(
    component: str, *, optimizer_in_bwd: bool, distributed: bool, async_save: bool
) -> None:
    """Refuse an optimizer the recipes' step cannot drive, or, ``distributed``, one
    that cannot train or checkpoint parameters sharded with FSDP2 (DTensors), with or
    without ``optimizer_in_bwd``. It imports the class; it builds nothing.

    The recipes call ``optimizer.step()`` without a closure, after a backward over
    dense parameters, or update inside backward, a bucket of parameters at a time.
    Under FSDP2, ``torch.optim`` optimizers and ``torchao.optim._AdamW`` train and
    checkpoint, bitsandbytes' fail in their first update, and torchao's low-bit ones
    train but their quantized state cannot be copied by an asynchronous save (what
    was measured, on which versions: ``docs/source/optimizer_in_backward.rst``).
    """
    key = f"optimizer._component_={component}"
    try:
        cls = _get_component_from_path(component)
    except InstantiationError as e:
        raise ValueError(
            f"{key} cannot be imported ({str(e).splitlines()[-1]}): check the name "
            "(e.g. torch.optim.AdamW, bitsandbytes.optim.PagedAdamW8bit), or install "
            "the package that provides it."
        ) from e
    module = getattr(cls, "__module__", None) or ""
    is_class = isinstance(cls, type)
    if is_class and issubclass(cls, torch.optim.LBFGS):
        raise ValueError(
            f"{key} cannot be used: its step() needs a closure, and the recipes run "
            "one forward and backward per step. Use an optimizer that steps without "
            "one, e.g. torch.optim.AdamW."
        )
    if is_class and issubclass(cls, torch.optim.SparseAdam):
        raise ValueError(
            f"{key} cannot be used: it needs sparse gradients, and these models' "
            "gradients are dense. Use torch.optim.Adam or torch.optim.AdamW."
        )
    package, name = module.split(".")[0], getattr(cls, "__name__", "")
    if optimizer_in_bwd and package == "torchao" and name == "CPUOffloadOptimizer":
        raise ValueError(
            f"{key} cannot be combined with optimizer_in_bwd=True: it already "
            "updates each parameter in gradient hooks of its own. Set "
            "optimizer_in_bwd=False, or use another optimizer."
        )
    if not distributed:
        return
    if package == "bitsandbytes":
        from bitsandbytes.optim.optimizer import Optimizer8bit

        if is_class and issubclass(cls, Optimizer8bit):
            raise ValueError(
                f"{key} cannot train a model sharded with FSDP2: bitsandbytes' "
                "update kernels take plain tensors, not FSDP2's DTensors. Use "
                "torch.optim.AdamW or torchao.optim._AdamW (low-bit state: "
                "torchao.optim.AdamW8bit), or this optimizer in a single-device recipe."
            )
    if package == "torchao" and async_save and name in _TORCHAO_LOW_BIT:
        raise ValueError(
            f"{key} cannot be combined with enable_async_checkpointing=True under "
            "FSDP2: an asynchronous save cannot copy its quantized state. Set "
            "enable_async_checkpointing=False, or use torch.optim.AdamW."
        )


def _check_bool(key: str, value: object) -> None:
    # YAML's true/false arrive as bool; 'False' (a string) or 2 would turn an option
    # on while the messages call it True.
    if not isinstance(value, bool):
        raise ValueError(
            f"{key}={value!r} is not a bool: set {key}=True or {key}=False."
        )


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_optimizer_arguments(optimizer: Mapping[str, Any]) -> None:
    """Refuse an optimizer argument the class would reject only once the model is
    built: a name it does not take, a number given as text (``optimizer.lr=abc``), or
    something else than numbers where its default is a tuple of them (``betas``)."""
    cls = _get_component_from_path(optimizer["_component_"])
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no signature to read: the class decides
        return
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    for name, value in optimizer.items():
        key = f"optimizer.{name}"
        if name == "_component_" or (name not in parameters and takes_any):
            continue
        if name not in parameters:
            taken = [n for n in parameters if n != "params"]
            raise ValueError(
                f"{key}={value!r}: {cls.__name__} takes no argument {name} (it takes "
                f"{', '.join(taken)}). Fix the name, or remove it."
            )
        default = parameters[name].default
        if (name == "lr" or _is_number(default)) and not _is_number(value):
            example = default if _is_number(default) else 2e-5
            raise ValueError(
                f"{key}={value!r} is not a number: set it to one, e.g. {key}={example}."
            )
        pair = isinstance(default, tuple) and all(map(_is_number, default))
        if pair and not (
            isinstance(value, Sequence | ListConfig)
            and not isinstance(value, str)
            and len(value) == len(default)
            and all(map(_is_number, value))
        ):
            raise ValueError(
                f"{key}={value!r} is not {len(default)} numbers: set it like "
                f"{key}={list(default)}."
            )


def _check_seed(value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(
            f"seed={value!r} is not a whole number: set seed to an integer (the same "
            "seed, the same run), or null for a random one."
        )


def _check_positive_int(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        null = " or null (no limit)" if key == "max_steps_per_epoch" else ""
        raise ValueError(
            f"{key}={value!r} is not a positive integer: set {key} to a whole number "
            f">= 1{null}."
        )


@functools.cache
def _known_keys() -> frozenset[str]:
    """The top-level keys of every shipped config, :data:`LIBRARY_KEYS` and the
    options of :class:`RecipeOptions`."""
    # recipes/ is not a package to import (its __init__ refuses): find it.
    configs = Path(importlib.util.find_spec("recipes").origin).parent / "configs"
    keys = set(LIBRARY_KEYS) | {f.name for f in fields(RecipeOptions)}
    for path in configs.rglob("*.yaml"):
        keys.update(OmegaConf.load(path).keys())
    return frozenset(keys)


def _edit_distance(a: str, b: str) -> int:
    """The number of single-character insertions, deletions and substitutions that
    turn ``a`` into ``b`` (Levenshtein)."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            substitution = previous[j - 1] + (char_a != char_b)
            current.append(min(previous[j] + 1, current[j - 1] + 1, substitution))
        previous = current
    return previous[-1]


# A key this many edits from a known one is taken for a typo of it; further off, it is
# taken for a key of the user's own (a recipe copied with ``tune cp`` may read any key).
TYPO_EDITS = 2


def warn_unknown_keys(cfg: DictConfig) -> None:
    """Ask about each top-level key that is a near miss of a known key (one of a
    shipped config, of :data:`LIBRARY_KEYS` or of :class:`RecipeOptions`): most
    likely a typo, which would otherwise be ignored without a word. Any other unknown
    key may be read by the user's own recipe, so it is not named. A key that the
    config uses in an interpolation (``${key}``) counts as read."""
    text = OmegaConf.to_yaml(cfg, resolve=False)
    for key in map(str, cfg):
        if key in _known_keys() or "${" + key in text:
            continue
        distance, closest = min((_edit_distance(key, k), k) for k in _known_keys())
        if distance <= TYPO_EDITS:
            message = (
                f"{key}={cfg[key]!r}: did you mean {closest}? No shipped recipe or "
                f"config reads {key} (if your own recipe does, ignore this)."
            )
            utils.log_rank_zero(log, message, level=logging.WARNING)


def _clip_grad_norm_value(value: object) -> object:
    # torchtune documents clip_grad_norm='inf' (measure and log the norm, never
    # clip): a string that reads as a number is that number.
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


@dataclass(frozen=True, kw_only=True)
class RecipeOptions:
    """The training options the recipes share, checked together, with one wording
    per refusal.

    A recipe reads them once, first thing in ``__init__``, with :meth:`from_config`,
    so that a refused run fails before anything is built or written. Options a
    recipe's config leaves out take the defaults below, which are torchtune 0.6.1's.
    Each is named as its config key.

    Args:
        device (torch.device): where training runs (``device``).
        dtype (torch.dtype): the training dtype (``dtype``); fp16 is refused, as no
            recipe does loss scaling.
        optimizer_in_bwd (bool): update parameters inside backward. Default: ``False``
        bucket_cap_mb (float | None): MiB of gradients per in-backward optimizer call
            (``optimizer_in_bwd_bucket_cap_mb``); ``None``: the default.
            Default: ``None``
        gradient_accumulation_steps (int): batches per optimizer step. Default: ``1``
        clip_grad_norm (float | None): the largest global gradient norm; ``None``: no
            clipping. Default: ``None``
        compile (dict[str, bool]): what ``torch.compile`` compiles: ``model``,
            ``loss``, ``optimizer_step``. ``compile: True`` in a config compiles the
            model and the loss, as in 0.6.1. Default: nothing.
        enable_activation_checkpointing (bool): of every transformer layer.
            Default: ``False``
        ac_mode (str | None): selective activation checkpointing, when
            ``enable_activation_checkpointing`` is off (distributed recipes).
            Default: ``None``
        ac_option (int | str | None): its option. Default: ``None``
        enable_activation_offloading (bool): needs CUDA and activation checkpointing.
            Default: ``False``
        fsdp_cpu_offload (bool): offload FSDP2's shards to CPU (distributed recipes;
            turned off, with a message, on a CPU device). Default: ``False``
        fsdp_reshard_after_forward (bool): free gathered parameters after forward.
            Default: ``True``
        custom_sharded_layers (list[str] | None): more modules FSDP2 shards on
            their own, e.g. ``["tok_embeddings", "output"]``. Default: ``None``
        enable_async_checkpointing (bool): write intermediate step checkpoints
            asynchronously (distributed recipes). Default: ``False``
        log_every_n_steps (int): Default: ``1``
        log_peak_memory_stats (bool): turned off, with a message, on a CPU device.
            Default: ``False``

    Raises:
        ValueError: if a flag is not a bool, a count not a positive integer,
            ``clip_grad_norm`` not a positive number, ``dtype`` fp16, ``compile`` set
            on an NPU device, or ``optimizer_in_bwd=True`` comes with an option it
            cannot work with: ``gradient_accumulation_steps > 1`` (each gradient is
            consumed as soon as it is ready), ``compile.optimizer_step`` (updates run
            a bucket at a time inside autograd hooks), ``clip_grad_norm`` together
            with activation offloading (clipping runs backward twice over one graph,
            offloading frees its activations after the first), or a bucket cap that
            is not a finite number ``>= 0``.
        RuntimeError: if ``enable_activation_offloading=True`` without CUDA or without
            activation checkpointing.

    Example:
        >>> options = RecipeOptions(
        ...     device=torch.device("cpu"), dtype=torch.float32, optimizer_in_bwd=True
        ... )
        >>> options.gradient_accumulation_steps
        1
        >>> RecipeOptions(device=torch.device("cpu"), dtype=torch.float32,
        ...               optimizer_in_bwd="False")
        Traceback (most recent call last):
        ...
        ValueError: optimizer_in_bwd='False' is not a bool: ...
    """

    device: torch.device
    dtype: torch.dtype
    optimizer_in_bwd: bool = False
    bucket_cap_mb: float | None = None
    gradient_accumulation_steps: int = 1
    clip_grad_norm: float | None = None
    compile: dict[str, bool] = field(default_factory=lambda: _parse_compile(False))
    enable_activation_checkpointing: bool = False
    ac_mode: str | None = None
    ac_option: int | str | None = None
    enable_activation_offloading: bool = False
    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    custom_sharded_layers: list[str] | None = None
    enable_async_checkpointing: bool = False
    log_every_n_steps: int = 1
    log_peak_memory_stats: bool = False

    def __post_init__(self) -> None:
        # Every flag a bool, every count a positive integer.
        for f in fields(self):
            check = {"bool": _check_bool, "int": _check_positive_int}.get(f.type)
            if check is not None:
                check(f.name, getattr(self, f.name))
        clip = self.clip_grad_norm
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, numbers.Real) or not clip > 0
        ):
            raise ValueError(
                f"clip_grad_norm={clip!r} is not a positive number: set it to a "
                "number > 0, inf (measure the norm only) or null (no clipping)."
            )
        if self.optimizer_in_bwd:
            self._check_in_backward()
        elif self.bucket_cap_mb is not None:
            log.warning(
                f"optimizer_in_bwd_bucket_cap_mb={self.bucket_cap_mb} is ignored: "
                "it only applies with optimizer_in_bwd=True."
            )
        if self.dtype == torch.float16:
            raise ValueError(
                "dtype=fp16 is not supported: the recipes do no loss scaling, which "
                "fp16 training needs. Set dtype=bf16 or dtype=fp32."
            )
        if self.device.type == "npu" and any(self.compile.values()):
            raise ValueError(
                "compile is not supported on NPU devices. Set compile=False."
            )
        offloading = self.enable_activation_offloading
        if offloading and self.device.type != "cuda":
            raise RuntimeError(
                "enable_activation_offloading=True needs a CUDA device, got "
                f"device={self.device.type}. Set enable_activation_offloading=False."
            )
        if offloading and not self.enable_activation_checkpointing:
            raise RuntimeError(
                "enable_activation_offloading=True needs "
                "enable_activation_checkpointing=True. Set both, or "
                "enable_activation_offloading=False."
            )

    def _check_in_backward(self) -> None:
        """Refuse what cannot work with ``optimizer_in_bwd=True``."""
        if self.clip_grad_norm is not None and self.enable_activation_offloading:
            raise ValueError(
                f"optimizer_in_bwd=True with clip_grad_norm={self.clip_grad_norm} "
                "cannot be combined with enable_activation_offloading=True: clipping "
                "runs backward twice, and offloading frees activations after the "
                "first. Set enable_activation_offloading=False, clip_grad_norm=null, "
                "or optimizer_in_bwd=False."
            )
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                "optimizer_in_bwd=True cannot be combined with "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}: each "
                "gradient is used as soon as it is ready. Set "
                "gradient_accumulation_steps=1 or optimizer_in_bwd=False."
            )
        if self.compile["optimizer_step"]:
            raise ValueError(
                "optimizer_in_bwd=True cannot be combined with "
                "compile.optimizer_step=True: in-backward updates run inside autograd "
                "hooks, not in one step. Set compile.optimizer_step=False or "
                "optimizer_in_bwd=False."
            )
        if not is_valid_bucket_cap(self.bucket_cap_mb):
            raise ValueError(
                f"optimizer_in_bwd_bucket_cap_mb={self.bucket_cap_mb!r} is not a "
                "finite number >= 0: set it to the MiB of gradients per update (0: "
                "each parameter on its own), or leave it unset for the default."
            )

    @classmethod
    def from_config(
        cls, cfg: DictConfig, *, distributed: bool = False
    ) -> RecipeOptions:
        """Read and check the shared options of a recipe config.

        Besides the options above, it refuses a ``profiler._component_`` other than
        ``setup_torch_profiler`` (a missing or null one means it, as in 0.6.1), an
        inference-only ``collate_fn`` (``left_pad_sequence``), an optimizer class the
        recipes cannot step (``torch.optim.LBFGS``, ``SparseAdam``; torchao's
        ``CPUOffloadOptimizer`` in backward), and, for a ``distributed`` recipe, an
        optimizer that FSDP2 cannot train (bitsandbytes') or, with
        ``enable_async_checkpointing``, checkpoint (torchao's low-bit ones). It
        imports the optimizer class and builds nothing. Options that mean nothing on
        a CPU device (``fsdp_cpu_offload``, ``log_peak_memory_stats``) are turned off
        there, saying so.

        Args:
            cfg (DictConfig): the recipe config.
            distributed (bool): whether the recipe shards the model with FSDP2.
                Default: ``False``

        Returns:
            RecipeOptions: the checked options.

        Raises:
            ValueError: as the class does, or for the options named above.
            RuntimeError: as the class does, for an inference-only ``collate_fn``,
                or for ``dtype=bf16`` on hardware without bf16.
        """
        device = utils.get_device(device=cfg.device)
        warn_unknown_keys(cfg)
        for key in COUNT_KEYS:
            if key in cfg and not (key == "max_steps_per_epoch" and cfg[key] is None):
                _check_positive_int(key, cfg[key])
        for key in BOOL_KEYS:
            if key in cfg:
                _check_bool(key, cfg[key])
        _check_seed(cfg.get("seed", None))
        profiler = (cfg.get("profiler", None) or {}).get("_component_")
        if (profiler or _TORCH_PROFILER) != _TORCH_PROFILER:
            raise ValueError(
                f"profiler._component_={profiler} is not supported: the recipe reads "
                f"its settings back from what {_TORCH_PROFILER} returns. Set "
                f"profiler._component_={_TORCH_PROFILER}, or null for the same."
            )
        collate_fn = cfg.get("collate_fn", None)
        if collate_fn is not None and "left_pad_sequence" in collate_fn:
            raise RuntimeError(
                f"collate_fn={collate_fn} is for inference only. Use "
                "torchtune.data.padded_collate_sft."
            )
        # Every other option is the config key of its name; one the config leaves
        # out keeps the default.
        read = {
            f.name: cfg[f.name]
            for f in fields(cls)
            if f.name in cfg and f.name not in _NOT_READ_AS_NAMED
        }
        optimizer = (cfg.get("optimizer", None) or {}).get("_component_")
        if optimizer:
            _check_optimizer(
                optimizer,
                optimizer_in_bwd=read.get("optimizer_in_bwd") is True,
                distributed=distributed,
                async_save=read.get("enable_async_checkpointing") is True,
            )
            _check_optimizer_arguments(cfg.optimizer)
        for key, reason in (
            ("fsdp_cpu_offload", "has nothing to move"),
            ("log_peak_memory_stats", "has no such stats"),
        ):
            # Left as it is when not a bool, for the class to refuse.
            if device.type == "cpu" and read.get(key) is True:
                utils.log_rank_zero(
                    log, f"{key}=True is ignored on CPU, which {reason}."
                )
                read[key] = False
        if read.get("custom_sharded_layers") is not None:
            read["custom_sharded_layers"] = list(read["custom_sharded_layers"])
        return cls(
            device=device,
            dtype=get_dtype(cfg.dtype, device=device),
            bucket_cap_mb=cfg.get("optimizer_in_bwd_bucket_cap_mb", None),
            clip_grad_norm=_clip_grad_norm_value(cfg.get("clip_grad_norm", None)),
            compile=_parse_compile(cfg.get("compile", False)),
            **read,
        )

    @property
    def process_group_backend(self) -> str:
        """The ``torch.distributed`` backend for this device: gloo on CPU; on an
        accelerator its own (NCCL on CUDA), plus gloo for the CPU-side collectives of
        FSDP's CPU offload and of asynchronous checkpoint saves."""
        if self.device.type == "cpu":
            return "gloo"
        from torchtune.training._distributed import get_distributed_backend

        return get_distributed_backend(
            self.device.type,
            offload_ops_to_cpu=self.fsdp_cpu_offload or self.enable_async_checkpointing,
        )
