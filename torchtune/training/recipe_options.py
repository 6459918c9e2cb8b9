"""Recipe config options that several recipes share: how ``compile`` is parsed,
which options ``optimizer_in_bwd=True`` refuses, which optimizers FSDP2 refuses, and
which profiler a recipe can build."""

from typing import Any

from omegaconf import DictConfig

from torchtune.config._utils import _get_component_from_path
from torchtune.training.memory import is_valid_bucket_cap

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

    Raises:
        ValueError: if ``clip_grad_norm`` is set (the global gradient norm is only
            known after backward, when the in-backward updates have happened), if
            ``gradient_accumulation_steps != 1`` (each gradient is consumed as soon as
            it is ready), if ``compile_optimizer_step`` (in-backward updates run a
            bucket at a time inside autograd hooks), or if ``bucket_cap_mb`` is not
            a number ``>= 0``.

    Example:
        >>> check_optimizer_in_bwd_options(clip_grad_norm=None)
        >>> check_optimizer_in_bwd_options(clip_grad_norm=1.0)
        Traceback (most recent call last):
        ...
        ValueError: optimizer_in_bwd=True cannot be combined with clip_grad_norm=1.0: ...
    """
    if clip_grad_norm is not None:
        raise ValueError(
            "optimizer_in_bwd=True cannot be combined with "
            f"clip_grad_norm={clip_grad_norm}: the global gradient norm is only known "
            "after backward, when in-backward updates have already happened. Set "
            "clip_grad_norm=null or optimizer_in_bwd=False."
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
            f"optimizer_in_bwd_bucket_cap_mb={bucket_cap_mb!r} is not a number >= 0. "
            "It is the most MiB of gradients one in-backward optimizer call updates: "
            "0 updates each parameter on its own (lowest memory); leave it unset for "
            "the default."
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


def check_fsdp_optimizer(optimizer_component: str, *, epochs: int) -> None:
    """Refuse an optimizer that cannot train, or cannot be checkpointed, on parameters
    sharded with FSDP2 (DTensors), with or without ``optimizer_in_bwd``.

    The distributed recipes call this before they build anything, with the
    optimizer's ``_component_`` from the config. It imports the component, not the
    config's other arguments.

    What works (measured with 2 gloo processes on CPU, torch 2.13, torchao 0.13,
    bitsandbytes 0.50): ``torch.optim`` optimizers and ``torchao.optim._AdamW``
    train and checkpoint. torchao's low-bit optimizers (``AdamW8bit``, ``AdamW4bit``,
    ``AdamWFp8`` and their Adam variants) train, with the plain losses in-backward,
    but saving their state in an epoch checkpoint fails: its quantized tensors
    support neither the all-gather of a full checkpoint nor the copy an asynchronous
    one makes. Step checkpoints (``save_every_n_steps``), which torch distributed
    checkpointing writes shard by shard, do save and resume it. bitsandbytes'
    optimizers fail in their first update, 8-bit and 32-bit, paged or not.

    Args:
        optimizer_component (str): the optimizer's ``_component_``, e.g.
            ``"torch.optim.AdamW"``.
        epochs (int): the ``epochs`` option. Every epoch but the last ends with a
            checkpoint that holds the optimizer state.

    Raises:
        ValueError: if the optimizer is a bitsandbytes one (its update kernels take
            plain tensors only), or a torchao low-bit one with ``epochs > 1``.
        InstantiationError: if ``optimizer_component`` cannot be imported.

    Example:
        >>> check_fsdp_optimizer("torchao.optim.AdamW8bit", epochs=1)
        >>> check_fsdp_optimizer("bitsandbytes.optim.PagedAdamW8bit", epochs=1)
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
                "state torchao.optim.AdamW8bit or torchao.optim.AdamW4bit with "
                "epochs=1; or this optimizer in a single-device recipe."
            )
    if package == "torchao" and epochs > 1:
        import torchao.optim

        low_bit = [getattr(torchao.optim, n, None) for n in _TORCHAO_LOW_BIT_OPTIMIZERS]
        if optimizer_cls in low_bit:
            raise ValueError(
                f"optimizer._component_={optimizer_component} cannot be combined with "
                f"epochs={epochs} under FSDP2: every epoch but the last ends with a "
                "checkpoint of the optimizer state, which cannot hold this optimizer's "
                "quantized state (its tensors support neither the all-gather of a full "
                "checkpoint nor the copy of an asynchronous one). Set epochs=1 (step "
                "checkpoints, save_every_n_steps, are sharded and do hold it), or use "
                "torch.optim.AdamW or torchao.optim._AdamW."
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
