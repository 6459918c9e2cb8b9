"""Parsing of recipe config options that several recipes share."""

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
