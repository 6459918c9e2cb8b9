"""torchtune 0.6.1's optimizer-in-backward checkpoint format, and its conversion to
the standard ``torch.optim`` format.

torchtune 0.6.1 saved the optimizer of an ``optimizer_in_bwd: True`` run as a dict
keyed by parameter name, one per-parameter optimizer state dict each (keyed by ``0``
from single-device recipes, by the parameter name from distributed ones). This module
reads that format, and nothing else does:
:func:`convert_legacy_optim_in_bwd_state_dict` turns it into a state dict that any
optimizer loads, plain or :class:`~torchtune.training.OptimizerInBackward`, and
:func:`convert_legacy_param_groups` into one for an optimizer with several param
groups, which the deprecated 0.6.1 wrapper can have.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
)

from torchtune.training.memory import hyperparameters

# A parameter's name (None for one the 0.6.1 format never held) and the parameter.
NamedParam = tuple[str | None, torch.Tensor]


def is_legacy_in_bwd_state_dict(state_dict: Any) -> bool:
    """Whether ``state_dict`` is in torchtune 0.6.1's in-backward format: a non-empty
    mapping of parameter name -> optimizer state dict, rather than one optimizer
    state dict.

    Args:
        state_dict (Any): a loaded optimizer checkpoint entry.

    Returns:
        bool: ``True`` for the 0.6.1 in-backward format.
    """
    if not isinstance(state_dict, Mapping) or not state_dict:
        return False
    if set(state_dict) == {"state", "param_groups"}:
        return False
    return all(
        isinstance(v, Mapping) and "state" in v and "param_groups" in v
        for v in state_dict.values()
    )


def _unwrapped(name: str) -> str:
    # Activation checkpointing wraps each checkpointed module under a prefix of its
    # own, which 0.6.1 saved where it was on; torch's fully qualified names
    # (get_optimizer_state_dict's) never carry it.
    return name.replace(_CHECKPOINT_PREFIX, "")


def _entries(
    state_dict: Mapping[str, Mapping[str, Any]],
) -> dict[str, tuple[dict[str, Any] | None, dict[str, Any]]]:
    """Split a 0.6.1 in-backward state dict into ``unwrapped name -> (state,
    hyperparameters)``, in its order; ``state`` is ``None`` for a parameter that
    never stepped (a frozen one, say)."""
    if not is_legacy_in_bwd_state_dict(state_dict):
        raise ValueError(
            "expected a torchtune 0.6.1 in-backward optimizer state dict (parameter "
            f"name -> per-parameter optimizer state dict), got keys {list(state_dict)[:5]}"
        )
    entries = {}
    for name, per_param in state_dict.items():
        groups = per_param["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != 1:
            raise ValueError(
                f"0.6.1 in-backward optimizer state for {name!r} should hold one "
                f"parameter in one group, got {[len(g['params']) for g in groups]}"
            )
        (key,) = groups[0]["params"]
        entries[_unwrapped(name)] = (
            per_param["state"].get(key),
            hyperparameters(groups[0]),
        )
    return entries


def _checked_pairs(named_params: Iterable[Any]) -> list[NamedParam]:
    pairs = list(named_params)
    for pair in pairs:
        if not (
            isinstance(pair, tuple)
            and len(pair) == 2
            and isinstance(pair[0], str | None)
            and isinstance(pair[1], torch.Tensor)
        ):
            raise TypeError(
                "named_params must hold (name or None, parameter) pairs, such as "
                f"model.named_parameters() gives, but got {pair!r:.80}"
            )
    return pairs


def convert_legacy_param_groups(
    state_dict: Mapping[str, Mapping[str, Any]],
    param_groups: Sequence[Iterable[tuple[str | None, torch.Tensor]]],
) -> dict[str, Any]:
    """Convert a torchtune 0.6.1 in-backward checkpoint into the standard state dict
    of an optimizer with the given param groups.

    :func:`convert_legacy_optim_in_bwd_state_dict` with ``named_params`` is this for
    one param group; this is the form for several (the deprecated 0.6.1 wrapper
    groups parameters by their optimizers' hyperparameters).

    Args:
        state_dict (Mapping[str, Mapping[str, Any]]): the 0.6.1 checkpoint's
            optimizer entry.
        param_groups (Sequence[Iterable[tuple[str | None, torch.Tensor]]]): for
            each param group of the optimizer, in order, its ``(name or None,
            parameter)`` pairs in its order. A parameter named ``None`` gets no
            state.

    Returns:
        dict[str, Any]: ``{"state": {id: ...}, "param_groups": [{"params": [ids],
        ...}]}``, with ids numbered across the groups as ``torch.optim`` numbers
        them. Each group's hyperparameters are those of its first parameter that has
        an entry (none if no parameter has one).

    Raises:
        ValueError: if ``state_dict`` is not in the 0.6.1 format, or a named
            parameter with ``requires_grad=True`` has no entry (missing), or an
            entry matches no named parameter (extra). Names are compared without
            activation checkpointing's wrapper prefix.
        TypeError: if a group holds something other than ``(name, parameter)``
            pairs.
    """
    entries = _entries(state_dict)
    groups = [_checked_pairs(group) for group in param_groups]
    named = {
        _unwrapped(name): param
        for group in groups
        for name, param in group
        if name is not None
    }
    missing = [n for n, p in named.items() if p.requires_grad and n not in entries]
    extra = [n for n in entries if n not in named]
    if missing or extra:
        raise ValueError(
            "0.6.1 in-backward optimizer state dict does not match this "
            f"optimizer's parameters: missing {missing}, extra {extra}"
        )
    state: dict[int, Any] = {}
    converted_groups = []
    index = 0
    for group in groups:
        saved_hyperparameters = None
        ids = []
        for name, _ in group:
            entry = None if name is None else entries.get(_unwrapped(name))
            if entry is not None:
                param_state, entry_hyperparameters = entry
                if param_state is not None:
                    state[index] = param_state
                # The group's hyperparameters are those of its first parameter
                # that was saved (a frozen first parameter may not have been).
                if saved_hyperparameters is None:
                    saved_hyperparameters = entry_hyperparameters
            ids.append(index)
            index += 1
        converted_groups.append({**(saved_hyperparameters or {}), "params": ids})
    return {"state": state, "param_groups": converted_groups}


def convert_legacy_optim_in_bwd_state_dict(
    state_dict: Mapping[str, Mapping[str, Any]],
    named_params: Iterable[tuple[str | None, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Convert a torchtune 0.6.1 optimizer-in-backward checkpoint to the standard format.

    torchtune 0.6.1 saved in-backward optimizer state as a dict keyed by parameter
    name, one per-parameter optimizer state dict each (keyed by ``0`` from
    single-device recipes, by the parameter name from distributed ones). This
    returns one optimizer state dict with one param group, in one of two forms.

    Without ``named_params``: keyed by fully qualified parameter name, the format of
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` with
    ``full_state_dict=True``, with activation checkpointing's wrapper prefix
    (``_checkpoint_wrapped_module.``) taken out of every name, as that format never
    has it. Its hyperparameters are the first entry's: 0.6.1 recipes built every
    per-parameter optimizer from one config and set every learning rate from one
    scheduler, which lived on the first optimizer (only that one holds the
    scheduler's ``initial_lr``). Load it with
    ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict(model,
    optimizer, converted)`` on one device, or
    ``torchtune.training.load_from_full_optimizer_state_dict(model, optimizer,
    converted, device)`` in a distributed (e.g. FSDP2) run.

    With ``named_params``: the ``torch.optim`` state dict of an optimizer built over
    exactly those parameters, in that order, in one param group, keyed by index; load
    it with ``optimizer.load_state_dict`` (plain or
    :class:`~torchtune.training.OptimizerInBackward`). Names are compared without the
    wrapper prefix on either side. A parameter named ``None`` is one the 0.6.1 format
    never held (the policy of 0.6.1's PPO recipe, which saved only the value
    model's optimizers): it gets no state. A frozen parameter may or may not have an
    entry. The group's hyperparameters are those of the first parameter that has an
    entry (the first parameter may be frozen and unsaved).

    Args:
        state_dict (Mapping[str, Mapping[str, Any]]): the 0.6.1 checkpoint's optimizer
            entry.
        named_params (Iterable[tuple[str | None, torch.Tensor]] | None): the
            ``(name or None, parameter)`` pairs of the optimizer to load into, e.g.
            ``model.named_parameters()``. Default: ``None``

    Returns:
        dict[str, Any]: without ``named_params``, ``{"state": {name: ...},
        "param_groups": [{"params": [names], ...}]}``; with them, ``{"state": {index:
        ...}, "param_groups": [{"params": [indices], ...}]}``.

    Raises:
        ValueError: if ``state_dict`` is not in the 0.6.1 in-backward format; with
            ``named_params``, also if a named parameter with ``requires_grad=True``
            has no entry ("missing") or an entry matches no named parameter
            ("extra"), naming them.
        TypeError: if ``named_params`` holds something other than ``(name,
            parameter)`` pairs.

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
        >>> # or, for optimizer.load_state_dict
        >>> optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
        >>> optimizer.load_state_dict(
        ...     convert_legacy_optim_in_bwd_state_dict(legacy, model.named_parameters())
        ... )
        >>> optimizer.param_groups[0]["lr"]
        0.001
    """
    if named_params is not None:
        return convert_legacy_param_groups(state_dict, [named_params])
    entries = _entries(state_dict)
    first_hyperparameters = next(iter(entries.values()))[1]
    return {
        "state": {name: s for name, (s, _) in entries.items() if s is not None},
        "param_groups": [{**first_hyperparameters, "params": list(entries)}],
    }


__all__ = [
    "convert_legacy_optim_in_bwd_state_dict",
    "convert_legacy_param_groups",
    "is_legacy_in_bwd_state_dict",
]
