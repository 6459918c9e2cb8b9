"""Recipe config options that several recipes share: how ``compile`` is parsed, and
which options ``optimizer_in_bwd=True`` refuses."""

from typing import Any

from omegaconf import DictConfig

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

    Raises:
        ValueError: if ``clip_grad_norm`` is set (the global gradient norm is only
            known after backward, when the in-backward updates have happened), if
            ``gradient_accumulation_steps != 1`` (each gradient is consumed as soon as
            it is ready), or if ``compile_optimizer_step`` (in-backward updates run one
            parameter at a time inside autograd hooks).

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
            "in-backward updates run one parameter at a time inside autograd hooks, "
            "where a compiled whole-optimizer step cannot run. Set "
            "compile.optimizer_step=False or optimizer_in_bwd=False."
        )
