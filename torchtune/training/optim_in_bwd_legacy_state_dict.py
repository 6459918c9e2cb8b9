"""torchtune 0.6.1's optimizer-in-backward checkpoint format, and its conversion to
the standard ``torch.optim`` format.

torchtune 0.6.1 saved the optimizer of an ``optimizer_in_bwd: True`` run as a dict
keyed by parameter name, one per-parameter optimizer state dict each (keyed by ``0``
from single-device recipes, by the parameter name from distributed ones). This module
reads that format, and nothing else does. It imports nothing of torchtune, so that
every module may import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper

# Activation checkpointing wraps each checkpointed module under a prefix of its own,
# which 0.6.1 saved where it was on; torch's fully qualified names (those of
# get_optimizer_state_dict) never carry it.
_WRAPPER_PREFIX = checkpoint_wrapper._CHECKPOINT_PREFIX


def is_legacy_in_bwd_state_dict(state_dict: Any) -> bool:
    """Whether ``state_dict`` is in torchtune 0.6.1's in-backward format: a non-empty
    mapping of parameter name -> optimizer state dict, rather than one optimizer
    state dict (whose ``param_groups`` is a list, not a state dict).

    Args:
        state_dict (Any): a loaded optimizer checkpoint entry.

    Returns:
        bool: ``True`` for the 0.6.1 in-backward format.
    """
    if not isinstance(state_dict, Mapping) or not state_dict:
        return False
    return all(
        isinstance(v, Mapping) and "state" in v and "param_groups" in v
        for v in state_dict.values()
    )


def _unwrapped(name: str | None) -> str | None:
    return None if name is None else name.replace(_WRAPPER_PREFIX, "")


def _entries(state_dict: Mapping[str, Any]) -> dict[str, tuple[Any, dict[str, Any]]]:
    """``unwrapped name -> (state, hyperparameters)``, in the checkpoint's order;
    ``state`` is ``None`` for a parameter that never stepped (a frozen one)."""
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
        group = groups[0]
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        entries[_unwrapped(name)] = (per_param["state"].get(group["params"][0]), hyper)
    return entries


def convert_legacy_optim_in_bwd_state_dict(
    state_dict: Mapping[str, Mapping[str, Any]],
    named_params: Iterable[tuple[str | None, Tensor]] | None = None,
) -> dict[str, Any]:
    """Convert a torchtune 0.6.1 optimizer-in-backward checkpoint to one optimizer
    state dict with one param group, in one of two forms.

    Without ``named_params``: keyed by fully qualified parameter name (without
    activation checkpointing's ``_checkpoint_wrapped_module.``), the format of
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` with
    ``full_state_dict=True``. Its hyperparameters are the first entry's: 0.6.1 built
    every per-parameter optimizer from one config and its LR scheduler drove the
    first one (the only one holding ``initial_lr``). Load it with
    ``set_optimizer_state_dict(model, optimizer, converted)`` on one device, or
    ``torchtune.training.load_from_full_optimizer_state_dict(model, optimizer,
    converted, device)`` in a distributed run.

    With ``named_params``: the ``torch.optim`` state dict of an optimizer built over
    exactly those parameters, in that order, keyed by index, for
    ``optimizer.load_state_dict`` (plain or
    :class:`~torchtune.training.OptimizerInBackward`). A parameter named ``None``
    is one the format never held (0.6.1's PPO recipe saved the value model's
    optimizers only): it gets no state. A frozen parameter may or may not have an
    entry. The hyperparameters are those of the first parameter that has one.

    Args:
        state_dict (Mapping[str, Mapping[str, Any]]): the 0.6.1 checkpoint's optimizer
            entry.
        named_params (Iterable[tuple[str | None, Tensor]] | None): the ``(name or
            None, parameter)`` pairs of the optimizer to load into, e.g.
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
    entries = _entries(state_dict)
    if named_params is None:
        states = {name: s for name, (s, _) in entries.items() if s is not None}
        groups = [{**next(iter(entries.values()))[1], "params": [*entries]}]
        return {"state": states, "param_groups": groups}
    pairs = list(named_params)
    for pair in pairs:
        ok = isinstance(pair, tuple) and len(pair) == 2
        if not (ok and isinstance(pair[0], str | None) and isinstance(pair[1], Tensor)):
            raise TypeError(
                "named_params must hold (name or None, parameter) pairs, such as "
                f"model.named_parameters() gives, but got {pair!r:.80}"
            )
    named = {_unwrapped(n): p for n, p in pairs if n is not None}
    missing = [n for n, p in named.items() if p.requires_grad and n not in entries]
    extra = [n for n in entries if n not in named]
    if missing or extra:
        raise ValueError(
            "0.6.1 in-backward optimizer state dict does not match this "
            f"optimizer's parameters: missing {missing}, extra {extra}"
        )
    saved = [entries.get(_unwrapped(name)) for name, _ in pairs]
    state = {i: e[0] for i, e in enumerate(saved) if e is not None and e[0] is not None}
    # The hyperparameters of the first parameter that has an entry (the first may be
    # frozen and unsaved).
    hyperparameters = next((e[1] for e in saved if e is not None), {})
    groups = [{**hyperparameters, "params": list(range(len(pairs)))}]
    return {"state": state, "param_groups": groups}


__all__ = ["convert_legacy_optim_in_bwd_state_dict", "is_legacy_in_bwd_state_dict"]
