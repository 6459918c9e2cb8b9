"""torchtune 0.6.1's optimizer-in-backward checkpoint format, and its conversion to
the standard ``torch.optim`` format.

torchtune 0.6.1 saved the optimizer of an ``optimizer_in_bwd: True`` run as a dict
keyed by parameter name, one per-parameter optimizer state dict each. This module only
reads that format; it depends on nothing else in torchtune, so both
:class:`~torchtune.training.OptimizerInBackward` and the deprecated 0.6.1 API import it.
"""

from collections.abc import Mapping
from typing import Any

# Param group keys that are not hyperparameters.
NON_HYPERPARAMETER_KEYS = frozenset({"params", "param_names"})


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters of a param group: every key but ``params``/``param_names``."""
    return {k: v for k, v in group.items() if k not in NON_HYPERPARAMETER_KEYS}


def is_legacy_in_bwd_state_dict(state_dict: Any) -> bool:
    """Whether ``state_dict`` is in torchtune 0.6.1's in-backward format."""
    if not isinstance(state_dict, Mapping) or not state_dict:
        return False
    if set(state_dict) == {"state", "param_groups"}:
        return False
    return all(
        isinstance(v, Mapping) and "state" in v and "param_groups" in v
        for v in state_dict.values()
    )


def legacy_entries(
    state_dict: Mapping[str, Mapping[str, Any]],
) -> dict[str, tuple[dict[str, Any] | None, dict[str, Any]]]:
    """Split a 0.6.1 in-backward state dict into ``name -> (state, hyperparameters)``.

    ``state`` is ``None`` for a parameter that never stepped (a frozen one, say).

    Raises:
        ValueError: if an entry does not hold exactly one parameter in one group.
    """
    entries = {}
    for name, per_param in state_dict.items():
        groups = per_param["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != 1:
            raise ValueError(
                f"0.6.1 in-backward optimizer state for {name!r} should hold one "
                f"parameter in one group, got {[len(g['params']) for g in groups]}"
            )
        (key,) = groups[0]["params"]
        entries[name] = (per_param["state"].get(key), hyperparameters(groups[0]))
    return entries


def convert_legacy_optim_in_bwd_state_dict(
    state_dict: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """Convert a torchtune 0.6.1 optimizer-in-backward checkpoint to the standard format.

    torchtune 0.6.1 saved in-backward optimizer state as a dict keyed by parameter
    name, one per-parameter optimizer state dict each (keyed by ``0`` from
    single-device recipes, by the parameter name from distributed ones). This returns
    one optimizer state dict keyed by parameter name (fully qualified name), the
    format of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``,
    with one param group. Its hyperparameters are the first entry's: 0.6.1 recipes
    built every per-parameter optimizer from one config and set every learning rate
    from one scheduler, which lived on the first optimizer (only that one holds the
    scheduler's ``initial_lr``).

    Load the result into any optimizer (plain or :class:`OptimizerInBackward`) with
    ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict(model,
    optimizer, converted)`` on one device, or
    ``torchtune.training.load_from_full_optimizer_state_dict(model, optimizer,
    converted, device)`` in a distributed (e.g. FSDP2) run.
    :meth:`OptimizerInBackward.load_state_dict` converts by itself when the optimizer
    knows its parameter names.

    Args:
        state_dict (Mapping[str, Mapping[str, Any]]): the 0.6.1 checkpoint's optimizer
            entry.

    Returns:
        dict[str, Any]: ``{"state": {name: ...}, "param_groups": [{"params": [names], ...}]}``

    Raises:
        ValueError: if ``state_dict`` is not in the 0.6.1 in-backward format.

    Example:
        >>> from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        >>> # what a 0.6.1 in-backward run saved under training.OPT_KEY
        >>> legacy = {
        ...     name: torch.optim.AdamW([p], lr=1e-3).state_dict()
        ...     for name, p in model.named_parameters()
        ... }
        >>> converted = convert_legacy_optim_in_bwd_state_dict(legacy)
        >>> converted["param_groups"][0]["lr"]
        0.001
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> set_optimizer_state_dict(model, optimizer, converted)
        >>> optimizer.param_groups[0]["lr"]
        0.001
    """
    if not is_legacy_in_bwd_state_dict(state_dict):
        raise ValueError(
            "expected a torchtune 0.6.1 in-backward optimizer state dict (parameter "
            f"name -> per-parameter optimizer state dict), got keys {list(state_dict)[:5]}"
        )
    entries = legacy_entries(state_dict)
    first_hyperparameters = next(iter(entries.values()))[1]
    return {
        "state": {name: s for name, (s, _) in entries.items() if s is not None},
        "param_groups": [{**first_hyperparameters, "params": list(entries)}],
    }


__all__ = ["convert_legacy_optim_in_bwd_state_dict"]
