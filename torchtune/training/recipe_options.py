"""The config options every recipe shares, read and checked once: :class:`RecipeOptions`,
and the checks it is made of (how ``compile`` is parsed, which options
``optimizer_in_bwd=True`` refuses, which optimizers FSDP2 refuses, which profiler a
recipe can build)."""

from __future__ import annotations

import difflib
import functools
import importlib.util
import logging
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from torchtune import utils
from torchtune.config._utils import _get_component_from_path
from torchtune.training.memory import is_valid_bucket_cap
from torchtune.training.precision import get_dtype

log = utils.get_logger("DEBUG")

# What ``compile`` can turn on, each on its own.
COMPILE_TARGETS = ("model", "loss", "optimizer_step")


def parse_compile_config(
    cfg_compile: bool | DictConfig | dict[str, Any],
) -> dict[str, bool]:
    """Which parts of training a recipe's ``compile`` option compiles.

    ``compile: True`` compiles the model and the loss, as in torchtune 0.6.1. A mapping
    picks each of ``model``, ``loss`` and ``optimizer_step`` (the plain optimizer's
    ``step``); keys it leaves out are off.

    Args:
        cfg_compile (bool | DictConfig | dict[str, Any]): the ``compile`` option.

    Returns:
        dict[str, bool]: ``model``, ``loss`` and ``optimizer_step``, each on or off.

    Raises:
        ValueError: if the mapping has a key other than those three.

    Example:
        >>> parse_compile_config(True)
        {'model': True, 'loss': True, 'optimizer_step': False}
        >>> parse_compile_config({"optimizer_step": True})
        {'model': False, 'loss': False, 'optimizer_step': True}
    """
    if not isinstance(cfg_compile, DictConfig | dict):
        enabled = bool(cfg_compile)
        return {"model": enabled, "loss": enabled, "optimizer_step": False}
    unknown = set(cfg_compile) - set(COMPILE_TARGETS)
    if unknown:
        raise ValueError(
            f"Unknown compile keys {sorted(unknown)}: compile is a bool or a "
            f"mapping with keys {list(COMPILE_TARGETS)}."
        )
    return {key: bool(cfg_compile.get(key, False)) for key in COMPILE_TARGETS}


def check_optimizer_in_bwd_options(
    *,
    clip_grad_norm: float | None = None,
    gradient_accumulation_steps: int = 1,
    compile_optimizer_step: bool = False,
    bucket_cap_mb: float | None = None,
    enable_activation_offloading: bool = False,
) -> None:
    """Refuse recipe options that cannot work with ``optimizer_in_bwd=True``.

    Recipes call this before they build anything, so a refused run leaves its output
    directory as it was. Each message names the option, its value and the fix.

    Args:
        clip_grad_norm (float | None): the ``clip_grad_norm`` option; ``None`` means no
            clipping. Default: ``None``
        gradient_accumulation_steps (int): the ``gradient_accumulation_steps`` option.
            Default: ``1``
        compile_optimizer_step (bool): whether ``compile.optimizer_step`` is on.
            Default: ``False``
        bucket_cap_mb (float | None): the ``optimizer_in_bwd_bucket_cap_mb`` option;
            ``None`` means the default. Default: ``None``
        enable_activation_offloading (bool): the ``enable_activation_offloading``
            option. Default: ``False``

    Raises:
        ValueError: if ``clip_grad_norm`` is set together with
            ``enable_activation_offloading`` (clipping in backward runs backward
            twice over one graph, and offloading frees its activations after the
            first), if ``gradient_accumulation_steps != 1`` (each gradient is consumed as soon as
            it is ready), if ``compile_optimizer_step`` (in-backward updates run a
            bucket at a time inside autograd hooks), or if ``bucket_cap_mb`` is not
            a finite number ``>= 0``.

    Example:
        >>> check_optimizer_in_bwd_options(clip_grad_norm=1.0)
        >>> check_optimizer_in_bwd_options(gradient_accumulation_steps=4)
        Traceback (most recent call last):
        ...
        ValueError: optimizer_in_bwd=True cannot be combined with gradient_accumulation_steps=4: ...
    """
    if clip_grad_norm is not None and enable_activation_offloading:
        raise ValueError(
            f"optimizer_in_bwd=True with clip_grad_norm={clip_grad_norm} cannot be "
            "combined with enable_activation_offloading=True: clipping inside "
            "backward runs backward twice over the same graph (once to measure the "
            "global norm, once to update), and activation offloading frees each "
            "activation after its first use. Set enable_activation_offloading=False, "
            "clip_grad_norm=null, or optimizer_in_bwd=False."
        )
    if gradient_accumulation_steps != 1:
        raise ValueError(
            "optimizer_in_bwd=True cannot be combined with "
            f"gradient_accumulation_steps={gradient_accumulation_steps}: each parameter "
            "is updated as soon as its gradient is ready, so gradients cannot be "
            "accumulated over several batches. Set gradient_accumulation_steps=1 or "
            "optimizer_in_bwd=False."
        )
    if compile_optimizer_step:
        raise ValueError(
            "optimizer_in_bwd=True cannot be combined with compile.optimizer_step=True: "
            "in-backward updates run a bucket of parameters at a time inside autograd "
            "hooks, where a compiled whole-optimizer step cannot run. Set "
            "compile.optimizer_step=False or optimizer_in_bwd=False."
        )
    if not is_valid_bucket_cap(bucket_cap_mb):
        raise ValueError(
            f"optimizer_in_bwd_bucket_cap_mb={bucket_cap_mb!r} is not a finite number "
            ">= 0. "
            "It is the most MiB of gradients one in-backward optimizer call updates: "
            "0 updates each parameter on its own (lowest memory); leave it unset for "
            "the default."
        )


def check_optimizer_class(optimizer_component: str, *, optimizer_in_bwd: bool) -> None:
    """Refuse an optimizer the recipes' training step cannot drive, before anything
    is built. It imports the class named by ``optimizer._component_``; it builds
    nothing.

    The recipes call ``optimizer.step()`` without a closure, after a backward over
    dense parameters, or update inside backward, one bucket of parameters at a time.

    Args:
        optimizer_component (str): the optimizer's ``_component_``.
        optimizer_in_bwd (bool): the ``optimizer_in_bwd`` option.

    Raises:
        ValueError: for ``torch.optim.LBFGS`` (its ``step`` needs a closure that
            recomputes the loss, in either mode), ``torch.optim.SparseAdam`` (it
            takes sparse gradients only, and these models' are dense), and
            ``torchao.optim.CPUOffloadOptimizer`` with ``optimizer_in_bwd=True`` (it
            updates in gradient hooks of its own).
        InstantiationError: if ``optimizer_component`` cannot be imported.

    Example:
        >>> check_optimizer_class("torch.optim.AdamW", optimizer_in_bwd=True)
        >>> check_optimizer_class("torch.optim.LBFGS", optimizer_in_bwd=False)
        Traceback (most recent call last):
        ...
        ValueError: optimizer._component_=torch.optim.LBFGS cannot be used: ...
    """
    optimizer_cls = _get_component_from_path(optimizer_component)

    def is_a(cls: type | None) -> bool:
        return (
            cls is not None
            and isinstance(optimizer_cls, type)
            and issubclass(optimizer_cls, cls)
        )

    key = f"optimizer._component_={optimizer_component}"
    if is_a(torch.optim.LBFGS):
        raise ValueError(
            f"{key} cannot be used: its step() needs a closure that recomputes the "
            "loss several times per step, and the recipes take one forward and "
            "backward per step (with optimizer_in_bwd=True or False). Use an "
            "optimizer that steps without a closure, e.g. torch.optim.AdamW."
        )
    if is_a(torch.optim.SparseAdam):
        raise ValueError(
            f"{key} cannot be used: it updates from sparse gradients only, and "
            "these models' gradients are dense (it would fail at the first step). "
            "Use torch.optim.Adam or torch.optim.AdamW."
        )
    if optimizer_in_bwd and (
        getattr(optimizer_cls, "__name__", "") == "CPUOffloadOptimizer"
        and (getattr(optimizer_cls, "__module__", None) or "").startswith("torchao")
    ):
        raise ValueError(
            f"{key} cannot be combined with optimizer_in_bwd=True: it already "
            "updates each parameter in gradient hooks of its own, on the CPU, so "
            "an in-backward optimizer over it would update twice or not at all. "
            "Set optimizer_in_bwd=False (CPUOffloadOptimizer then frees gradients "
            "as early itself), or use another optimizer."
        )


# torchao optimizers that keep their state in quantized tensor subclasses.
_TORCHAO_LOW_BIT_OPTIMIZERS = (
    "Adam8bit",
    "Adam4bit",
    "AdamFp8",
    "AdamW8bit",
    "AdamW4bit",
    "AdamWFp8",
)


def check_fsdp_optimizer(optimizer_component: str, *, async_save: bool) -> None:
    """Refuse an optimizer that cannot train, or cannot be checkpointed, on parameters
    sharded with FSDP2 (DTensors), with or without ``optimizer_in_bwd``.

    The distributed recipes call this before they build anything, with the
    optimizer's ``_component_`` from the config. It imports the component, not the
    config's other arguments. ``torch.optim`` optimizers and ``torchao.optim._AdamW``
    train and checkpoint; bitsandbytes' fail in their first update; torchao's low-bit
    ones train, and their quantized state saves in the sharded step checkpoints, but
    not in the copy an asynchronous save makes (what was measured, on which versions:
    ``docs/source/optimizer_in_backward.rst``).

    Args:
        optimizer_component (str): the optimizer's ``_component_``, e.g.
            ``"torch.optim.AdamW"``.
        async_save (bool): the ``enable_async_checkpointing`` option.

    Raises:
        ValueError: if the optimizer is a bitsandbytes one (its update kernels take
            plain tensors only), or a torchao low-bit one with ``async_save``.
        InstantiationError: if ``optimizer_component`` cannot be imported.

    Example:
        >>> check_fsdp_optimizer("torchao.optim.AdamW8bit", async_save=False)
        >>> check_fsdp_optimizer("bitsandbytes.optim.PagedAdamW8bit", async_save=False)
        Traceback (most recent call last):
        ...
        ValueError: optimizer._component_=bitsandbytes.optim.PagedAdamW8bit cannot ...
    """
    optimizer_cls = _get_component_from_path(optimizer_component)
    package = (getattr(optimizer_cls, "__module__", None) or "").split(".")[0]
    if package == "bitsandbytes":
        from bitsandbytes.optim.optimizer import Optimizer8bit

        if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer8bit):
            raise ValueError(
                f"optimizer._component_={optimizer_component} cannot train a model "
                "sharded with FSDP2, with or without optimizer_in_bwd: FSDP2 makes "
                "every parameter a DTensor, and bitsandbytes' update kernels take "
                "plain tensors only (8-bit ones fail with 'got mixed torch.Tensor and "
                "DTensor', 32-bit ones with 'no sharding strategy registered'). Use "
                "torch.optim.AdamW or torchao.optim._AdamW; for low-bit optimizer "
                "state torchao.optim.AdamW8bit or torchao.optim.AdamW4bit; or this "
                "optimizer in a single-device recipe."
            )
    if package == "torchao" and async_save:
        import torchao.optim

        low_bit = [getattr(torchao.optim, n, None) for n in _TORCHAO_LOW_BIT_OPTIMIZERS]
        if optimizer_cls in low_bit:
            raise ValueError(
                f"optimizer._component_={optimizer_component} cannot be combined with "
                "enable_async_checkpointing=True under FSDP2: an asynchronous save "
                "first copies the optimizer state, and this optimizer's quantized "
                "tensors cannot be copied that way. Set "
                "enable_async_checkpointing=False (the sharded synchronous step "
                "checkpoints hold its state), or use torch.optim.AdamW or "
                "torchao.optim._AdamW."
            )


# The one profiler the recipes can build: they read its settings back from what it
# returns.
TORCH_PROFILER = "torchtune.training.setup_torch_profiler"


def check_profiler_component(cfg_profiler: DictConfig | dict[str, Any] | None) -> None:
    """Refuse a ``profiler._component_`` other than ``setup_torch_profiler``.

    A missing section, a missing ``_component_`` and ``_component_: null`` all mean
    ``setup_torch_profiler``, as in torchtune 0.6.1.

    Args:
        cfg_profiler (DictConfig | dict[str, Any] | None): the ``profiler`` option.

    Raises:
        ValueError: if ``_component_`` names another component.

    Example:
        >>> check_profiler_component({"_component_": None, "enabled": False})
        >>> check_profiler_component({"_component_": "my.profiler"})
        Traceback (most recent call last):
        ...
        ValueError: profiler._component_=my.profiler is not supported: ...
    """
    component = (cfg_profiler or {}).get("_component_") or TORCH_PROFILER
    if component != TORCH_PROFILER:
        raise ValueError(
            f"profiler._component_={component} is not supported: the recipe reads "
            f"the profiler's settings back from what {TORCH_PROFILER} returns, so "
            f"only it can build the profiler. Set profiler._component_={TORCH_PROFILER}"
            ", or null for the same."
        )


def _check_bool(key: str, value: object) -> None:
    # YAML's true/false arrive as bool; 'False' (a string) or 2 would turn an option
    # on while the messages call it True.
    if not isinstance(value, bool):
        raise ValueError(
            f"{key}={value!r} is not a bool: set {key}=True or {key}=False."
        )


def _check_positive_int(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        null = " or null (no limit)" if key == "max_steps_per_epoch" else ""
        raise ValueError(
            f"{key}={value!r} is not a positive integer: set {key} to a whole number "
            f">= 1{null}."
        )


# Counts a recipe config may set: each a positive integer (max_steps_per_epoch: or
# null, no limit), checked before anything is built or written.
COUNT_KEYS = (
    "epochs",
    "max_steps_per_epoch",
    "batch_size",
    "num_steps",
    "forward_batch_size",
    "ppo_batch_size",
    "ppo_epochs",
)


# Top-level keys the recipes and the library read that shipped configs may leave out.
LIBRARY_KEYS = (
    "fake_quant_after_n_steps",
    "fsdp_reshard_after_forward",
    "optimizer_in_bwd_bucket_cap_mb",
    "save_every_n_steps",
    "resume_allow_changes",
    "enable_async_checkpointing",
    "fsdp_cpu_offload",
    "log_every_n_steps",
    "log_peak_memory_stats",
    "cudnn_deterministic_mode",
    "collate_fn",
)


@functools.cache
def _known_keys() -> frozenset[str]:
    """The top-level keys of every shipped config, and :data:`LIBRARY_KEYS`."""
    # recipes/ is not a package to import (its __init__ refuses): find it.
    configs = Path(importlib.util.find_spec("recipes").origin).parent / "configs"
    keys = set(LIBRARY_KEYS)
    for path in configs.rglob("*.yaml"):
        keys.update(OmegaConf.load(path).keys())
    return frozenset(keys)


def warn_unknown_keys(cfg: DictConfig) -> None:
    """Warn about each top-level key that no shipped config has and no recipe option
    reads, most likely a typo, naming the closest known key. A key that the config
    uses in an interpolation (``${key}``) counts as read. Keys inside a section with
    a ``_component_`` are checked when it is instantiated."""
    text = OmegaConf.to_yaml(cfg, resolve=False)
    for key in cfg:
        if key in _known_keys() or "${" + str(key) in text:
            continue
        close = difflib.get_close_matches(str(key), _known_keys(), n=1)
        hint = f": did you mean {close[0]}?" if close else "."
        utils.log_rank_zero(
            log,
            f"{key}={cfg[key]!r} is a key no recipe reads, so it has no effect{hint}",
            level=logging.WARNING,
        )


def _clip_grad_norm_value(value: object) -> object:
    # torchtune documents clip_grad_norm='inf' (measure and log the norm, never
    # clip): a string that reads as a number is that number.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _check_clip_grad_norm(value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(
            f"clip_grad_norm={value!r} is not a positive number: it is the largest "
            "global gradient norm a step may use. Set it to a number > 0, inf to "
            "measure the norm and never clip, or null for no clipping."
        )


@dataclass(frozen=True, kw_only=True)
class RecipeOptions:
    """The training options the recipes share, checked together, with one wording
    per refusal.

    A recipe reads them once, first thing in ``__init__``, with :meth:`from_config`,
    so that a refused run fails before anything is built or written. Options a
    recipe's config leaves out take the defaults below, which are torchtune 0.6.1's.

    Args:
        device (torch.device): where training runs (``device``).
        dtype (torch.dtype): the training dtype (``dtype``); fp16 is refused, as no
            recipe does loss scaling.
        optimizer_in_bwd (bool): update parameters inside backward
            (``optimizer_in_bwd``). Default: ``False``
        bucket_cap_mb (float | None): MiB of gradients per in-backward optimizer call
            (``optimizer_in_bwd_bucket_cap_mb``); ``None``: the default.
            Default: ``None``
        gradient_accumulation_steps (int): batches per optimizer step. Default: ``1``
        clip_grad_norm (float | None): the largest global gradient norm; ``None``: no
            clipping. Default: ``None``
        compile (dict[str, bool]): what ``torch.compile`` compiles, as returned by
            :func:`parse_compile_config`. Default: nothing.
        enable_activation_checkpointing (bool): Default: ``False``
        enable_activation_offloading (bool): needs CUDA and activation checkpointing.
            Default: ``False``
        fsdp_cpu_offload (bool): offload FSDP2's shards to CPU (distributed recipes;
            turned off, with a message, on a CPU device). Default: ``False``
        enable_async_checkpointing (bool): write intermediate epoch checkpoints
            asynchronously (distributed recipes). Default: ``False``
        log_every_n_steps (int): Default: ``1``
        log_peak_memory_stats (bool): turned off, with a message, on a CPU device.
            Default: ``False``

    Raises:
        ValueError: if a flag is not a bool, a count not a positive integer,
            ``clip_grad_norm`` not a positive number, ``dtype`` fp16, ``compile`` set
            on an NPU device, or ``optimizer_in_bwd=True`` comes with an option it
            cannot work with (see :func:`check_optimizer_in_bwd_options`).
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
    compile: dict[str, bool] = field(
        default_factory=lambda: parse_compile_config(False)
    )
    enable_activation_checkpointing: bool = False
    enable_activation_offloading: bool = False
    fsdp_cpu_offload: bool = False
    enable_async_checkpointing: bool = False
    log_every_n_steps: int = 1
    log_peak_memory_stats: bool = False

    def __post_init__(self) -> None:
        for key in (
            "optimizer_in_bwd",
            "enable_activation_checkpointing",
            "enable_activation_offloading",
            "fsdp_cpu_offload",
            "enable_async_checkpointing",
            "log_peak_memory_stats",
        ):
            _check_bool(key, getattr(self, key))
        _check_positive_int(
            "gradient_accumulation_steps", self.gradient_accumulation_steps
        )
        _check_positive_int("log_every_n_steps", self.log_every_n_steps)
        _check_clip_grad_norm(self.clip_grad_norm)
        if self.optimizer_in_bwd:
            check_optimizer_in_bwd_options(
                clip_grad_norm=self.clip_grad_norm,
                gradient_accumulation_steps=self.gradient_accumulation_steps,
                compile_optimizer_step=self.compile["optimizer_step"],
                bucket_cap_mb=self.bucket_cap_mb,
                enable_activation_offloading=self.enable_activation_offloading,
            )
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
        if self.enable_activation_offloading and self.device.type != "cuda":
            raise RuntimeError(
                "enable_activation_offloading=True needs a CUDA device, got "
                f"device={self.device.type}. Set enable_activation_offloading=False."
            )
        if (
            self.enable_activation_offloading
            and not self.enable_activation_checkpointing
        ):
            raise RuntimeError(
                "enable_activation_offloading=True needs "
                "enable_activation_checkpointing=True. Set both, or "
                "enable_activation_offloading=False."
            )

    @classmethod
    def from_config(
        cls, cfg: DictConfig, *, distributed: bool = False
    ) -> RecipeOptions:
        """Read and check the shared options of a recipe config.

        Besides the options above, it refuses a ``profiler._component_`` other than
        ``setup_torch_profiler``, an inference-only ``collate_fn``
        (``left_pad_sequence``), an optimizer class the recipes cannot step
        (:func:`check_optimizer_class`), and, for a ``distributed`` recipe, an
        optimizer that FSDP2 cannot train or checkpoint (:func:`check_fsdp_optimizer`). Options that
        mean nothing on a CPU device (``fsdp_cpu_offload``,
        ``log_peak_memory_stats``) are turned off there, saying so.

        Args:
            cfg (DictConfig): the recipe config.
            distributed (bool): whether the recipe shards the model with FSDP2.
                Default: ``False``

        Returns:
            RecipeOptions: the checked options.

        Raises:
            ValueError: as the class does, or for the options named above.
            RuntimeError: as the class does.
        """
        device = utils.get_device(device=cfg.device)
        warn_unknown_keys(cfg)
        for key in COUNT_KEYS:
            if key in cfg and not (key == "max_steps_per_epoch" and cfg[key] is None):
                _check_positive_int(key, cfg[key])
        check_profiler_component(cfg.get("profiler"))
        collate_fn = cfg.get("collate_fn", None)
        if collate_fn is not None and "left_pad_sequence" in collate_fn:
            raise RuntimeError(
                f"collate_fn={collate_fn} is for inference only. Use "
                "torchtune.data.padded_collate_sft."
            )
        cfg_optimizer = cfg.get("optimizer", None)
        if cfg_optimizer is not None and cfg_optimizer.get("_component_", None):
            check_optimizer_class(
                cfg_optimizer._component_,
                optimizer_in_bwd=cfg.get("optimizer_in_bwd", False) is True,
            )
        if distributed:
            check_fsdp_optimizer(
                cfg.optimizer._component_,
                async_save=cfg.get("enable_async_checkpointing", False) is True,
            )
        fsdp_cpu_offload = cfg.get("fsdp_cpu_offload", False)
        log_peak_memory_stats = cfg.get("log_peak_memory_stats", False)
        if device.type == "cpu":
            for key, value, reason in (
                ("fsdp_cpu_offload", fsdp_cpu_offload, "has nothing to move"),
                ("log_peak_memory_stats", log_peak_memory_stats, "has no such stats"),
            ):
                if value is True:
                    utils.log_rank_zero(
                        log, f"{key}=True is ignored on CPU, which {reason}."
                    )
            # Left as they are when not bools, for the class to refuse.
            if fsdp_cpu_offload is True:
                fsdp_cpu_offload = False
            if log_peak_memory_stats is True:
                log_peak_memory_stats = False
        return cls(
            device=device,
            dtype=get_dtype(cfg.dtype, device=device),
            optimizer_in_bwd=cfg.get("optimizer_in_bwd", False),
            bucket_cap_mb=cfg.get("optimizer_in_bwd_bucket_cap_mb", None),
            gradient_accumulation_steps=cfg.get("gradient_accumulation_steps", 1),
            clip_grad_norm=_clip_grad_norm_value(cfg.get("clip_grad_norm", None)),
            compile=parse_compile_config(cfg.get("compile", False)),
            enable_activation_checkpointing=cfg.get(
                "enable_activation_checkpointing", False
            ),
            enable_activation_offloading=cfg.get("enable_activation_offloading", False),
            fsdp_cpu_offload=fsdp_cpu_offload,
            enable_async_checkpointing=cfg.get("enable_async_checkpointing", False),
            log_every_n_steps=cfg.get("log_every_n_steps", 1),
            log_peak_memory_stats=log_peak_memory_stats,
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
