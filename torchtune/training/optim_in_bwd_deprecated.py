"""torchtune 0.6.1's optimizer-in-backward API, deprecated.

:class:`OptimizerInBackwardWrapper`, :func:`create_optim_in_bwd_wrapper` and
:func:`register_optim_in_bwd_hooks` keep 0.6.1 recipes (and users' own recipes written
against 0.6.1) working, with a :class:`DeprecationWarning`. Each builds an
:class:`~torchtune.training.OptimizerInBackward` from the per-parameter optimizers
those recipes create, so no parameter is ever updated twice. New code builds
``OptimizerInBackward(params, optimizer_cls, **kwargs)`` instead.

What 0.6.1 had and :class:`~torchtune.training.OptimizerInBackward` does not is
:class:`OptimizerInBackwardWrapper`'s alone: it adopts the given per-parameter
optimizers (their state included) as its buckets, knows every parameter's name,
builds no optimizer of its own, moves state loaded through a per-parameter optimizer
(``optim_map[name].load_state_dict``) into its own, and loads 0.6.1's in-backward
checkpoints with the converter of
:mod:`torchtune.training.optim_in_bwd_legacy_state_dict`.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from torchtune.training.memory import OptimizerInBackward, hyperparameters
from torchtune.training.optim_in_bwd_legacy_state_dict import (
    convert_legacy_param_groups,
    is_legacy_in_bwd_state_dict,
)

_DEPRECATION = (
    "{what} is deprecated and will be removed in a future release. Use "
    "torchtune.training.OptimizerInBackward(params, optimizer_cls, **kwargs): it is a "
    "torch.optim.Optimizer, so LR schedulers, checkpointing and training.get_lr work "
    "on it unchanged."
)

# Every hook dict of torch.optim.Optimizer; an optimizer made from a template starts
# with none of the template's hooks.
_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def _single_param(optimizer: Optimizer) -> torch.Tensor:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != 1:
        raise ValueError(
            "each per-parameter optimizer must hold exactly one parameter, but "
            f"{type(optimizer).__name__} holds {len(params)}"
        )
    return params[0]


def _warn_deprecated(what: str) -> None:
    warnings.warn(_DEPRECATION.format(what=what), DeprecationWarning, stacklevel=3)


def _same_hyperparameters(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    try:
        return all(bool(a[k] == b[k]) for k in a)
    except (RuntimeError, TypeError, ValueError):  # e.g. tensors of several elements
        return False


def _group_by_hyperparameters(
    optimizers: list[Optimizer],
) -> list[dict[str, Any]]:
    """Param groups for the per-parameter ``optimizers``: one group per distinct set
    of hyperparameters, in order of first appearance, each keeping its own."""
    groups: list[dict[str, Any]] = []
    for optimizer in optimizers:
        param = _single_param(optimizer)
        own = hyperparameters(optimizer.param_groups[0])
        for group in groups:
            if _same_hyperparameters(hyperparameters(group), own):
                group["params"].append(param)
                break
        else:
            groups.append({**own, "params": [param]})
    return groups


def _optimizer_like(
    template: Optimizer, param_groups: list[dict[str, Any]]
) -> Optimizer:
    """An optimizer of ``template``'s class and settings over ``param_groups``, with
    empty state and no hooks, so its own ``state_dict``/``load_state_dict`` apply."""
    optimizer = type(template).__new__(type(template))
    # The class's own attributes (bitsandbytes' args and non-castable keys, ...), not
    # the loader that adoption gives a per-parameter optimizer (_load_into_owner).
    optimizer.__dict__.update(template.__dict__)
    optimizer.__dict__.pop("load_state_dict", None)
    for name in _HOOK_DICTS:
        setattr(optimizer, name, OrderedDict())
    optimizer.defaults = dict(template.defaults)
    optimizer.state = defaultdict(dict)
    optimizer.param_groups = []
    for group in param_groups:
        optimizer.add_param_group(group)
    return optimizer


def _load_into_owner(
    optimizer: Optimizer, param: torch.Tensor, owner: OptimizerInBackwardWrapper
) -> None:
    """Make ``optimizer.load_state_dict`` load into ``owner``'s state.

    A per-parameter optimizer's own ``load_state_dict`` (0.6.1 recipes resume through
    ``optim_map[name]``) replaces its ``state``, which ``owner`` made a view of its
    own. Right after the class's loader, whatever hooks it runs (bitsandbytes' runs
    none), the loaded entry is moved into ``owner``'s state and the view put back, so
    the loaded state is what training uses and what ``owner`` saves. Once ``owner``
    no longer updates ``param`` with ``optimizer`` (another instance took it over),
    the load stays ``optimizer``'s own.
    """
    class_load = type(optimizer).load_state_dict
    owner_ref = weakref.ref(owner)

    @functools.wraps(class_load)
    def load_state_dict(state_dict: Any, *args: Any, **kwargs: Any) -> None:
        view = optimizer.state
        class_load(optimizer, state_dict, *args, **kwargs)
        owner = owner_ref()
        if optimizer.state is view or owner is None:
            return
        if owner._optimizer_of(param) is not optimizer:
            return
        loaded, optimizer.state = optimizer.state, view
        entry = loaded.get(param)
        if entry:
            owner.state[param] = entry

    optimizer.load_state_dict = load_state_dict  # type: ignore[method-assign]


class OptimizerInBackwardWrapper(OptimizerInBackward):
    """Deprecated: an :class:`OptimizerInBackward` built from torchtune 0.6.1's
    per-parameter optimizers.

    Takes over the given per-parameter optimizers (their state moves into this
    object) and updates their parameters in backward; any hooks registered for them by
    :func:`register_optim_in_bwd_hooks` are removed, so no parameter is updated twice.
    ``state_dict()`` returns the standard torch format; ``load_state_dict()`` accepts
    that and 0.6.1's format keyed by parameter name. The 0.6.1 helper methods keep
    working.

    Args:
        optim_map (dict[str, Optimizer]): parameter name -> optimizer over that one
            parameter.

    Raises:
        ValueError: if an optimizer in ``optim_map`` does not hold exactly one parameter.

    Example:
        >>> # deprecated
        >>> wrapper = OptimizerInBackwardWrapper(
        ...     {n: torch.optim.AdamW([p]) for n, p in model.named_parameters()}
        ... )
        >>> # instead
        >>> optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    """

    def __init__(self, optim_map: dict[str, Optimizer]) -> None:
        _warn_deprecated("OptimizerInBackwardWrapper")
        self._setup_from_optimizers(optim_map)

    @classmethod
    def _from_optimizers(
        cls, optim_map: dict[str, Optimizer]
    ) -> OptimizerInBackwardWrapper:
        """Build without a second deprecation warning (for the deprecated functions)."""
        wrapper = cls.__new__(cls)
        wrapper._setup_from_optimizers(optim_map)
        return wrapper

    def _setup_from_optimizers(self, optim_map: dict[str, Optimizer]) -> None:
        if not optim_map:
            raise ValueError("OptimizerInBackwardWrapper got an empty optim_map")
        # The per-parameter optimizers not yet adopted as buckets, and every name.
        self._adopted: dict[torch.Tensor, Optimizer] = {}
        self._names: dict[torch.Tensor, str] = {}
        for name, optimizer in optim_map.items():
            param = _single_param(optimizer)
            self._adopted[param] = optimizer
            self._names[param] = name
        # Each parameter keeps the hyperparameters of its own optimizer: parameters
        # whose optimizers agree share a group (usually all of them, one group).
        first = next(iter(optim_map.values()))
        wrapped = _optimizer_like(
            first, _group_by_hyperparameters(list(optim_map.values()))
        )
        # One bucket per parameter: each is its adopted optimizer.
        self._wrap(wrapped, bucket_cap_bytes=0)
        # Frozen parameters' optimizers are adopted too, as 0.6.1 kept them.
        for param in list(self._adopted):
            self._attach([param])
        self.lr_scheduler: LRScheduler | None = None

    def _new_bucket_optimizer(self, params: list[torch.Tensor]) -> Optimizer:
        """The adopted per-parameter optimizer of the bucket's one parameter, with
        the state it holds moved into this object's ``state``.

        Raises:
            RuntimeError: for a parameter that has no per-parameter optimizer left
                to adopt: this class cannot build one.
        """
        optimizer = self._adopted.pop(params[0], None) if len(params) == 1 else None
        if optimizer is None:
            raise RuntimeError(
                "this optimizer was built from 0.6.1-style per-parameter optimizers "
                "and cannot build one for a new parameter; use "
                "OptimizerInBackward(params, optimizer_cls, **kwargs) instead"
            )
        (param,) = params
        if param in optimizer.state and optimizer.state[param]:
            self.state[param] = optimizer.state[param]
        _load_into_owner(optimizer, param, self)
        return optimizer

    def _param_names(self) -> dict[torch.Tensor, str]:
        # The param groups have no param_names (0.6.1's did not either): name
        # parameters in error messages by their optim_map names.
        return dict(self._names)

    @property
    def optim_map(self) -> dict[str, Optimizer]:
        """Parameter name -> its per-parameter optimizer, for every parameter given
        (frozen ones included, as in 0.6.1, whose checkpoints hold them too)."""
        return {
            self._names[param]: optimizer
            for group in self.param_groups
            for param in group["params"]
            if (optimizer := self._optimizer_of(param)) is not None
        }

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: this class has no optimizer class to build optimizers for
        new parameters with.

        Args:
            param_group (dict[str, Any]): ignored.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError(
            "add_param_group is not supported on an optimizer built from 0.6.1-style "
            "per-parameter optimizers; build OptimizerInBackward(params, "
            "optimizer_cls, **kwargs) instead"
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load optimizer state in the standard torch format, as
        :meth:`OptimizerInBackward.load_state_dict` does, or in torchtune 0.6.1's
        in-backward format (keyed by parameter name, the names of ``optim_map``).

        A 0.6.1 state dict gives each param group the hyperparameters of its first
        parameter that has an entry (0.6.1 schedulers set the learning rate of one
        per-parameter optimizer only), and keeps the group's own for any key the
        entry lacks.

        Args:
            state_dict (Mapping[str, Any]): the state to load.

        Raises:
            ValueError: if the state dict's parameters do not match this
                optimizer's; the message names what is missing and what is extra.
        """
        if is_legacy_in_bwd_state_dict(state_dict):
            converted = convert_legacy_param_groups(
                state_dict,
                [
                    [(self._names[p], p) for p in group["params"]]
                    for group in self.param_groups
                ],
            )
            converted["param_groups"] = [
                {**hyperparameters(ours), **saved}
                for ours, saved in zip(
                    self.param_groups, converted["param_groups"], strict=True
                )
            ]
            state_dict = converted
        super().load_state_dict(state_dict)

    def get_optim_key(self, key: str) -> Any:
        """The value of hyperparameter ``key`` (e.g. ``"lr"``) of the first param group.

        Args:
            key (str): hyperparameter name.

        Returns:
            Any: its value.
        """
        return self.param_groups[0][key]

    def set_lr_scheduler(self, lr_scheduler: LRScheduler) -> None:
        """Make ``lr_scheduler`` drive the learning rate of every parameter.

        0.6.1 recipes build the scheduler on one per-parameter optimizer. It is
        pointed at this object instead (whose param groups every update reads), and
        the learning rate it has set already (e.g. 0 at the start of a warmup) applies
        to every parameter from the first update on.

        Args:
            lr_scheduler (LRScheduler): a scheduler built on this object or on one of
                its per-parameter optimizers.

        Raises:
            ValueError: if the scheduler drives some other optimizer.
        """
        target = lr_scheduler.optimizer
        if target is not self:
            if not any(target is inner for inner in self.optim_map.values()):
                raise ValueError(
                    "set_lr_scheduler: the scheduler drives an optimizer that is "
                    "neither this object nor one of its per-parameter optimizers"
                )
            source = target.param_groups[0]
            for group in self.param_groups:
                for key in ("lr", "initial_lr"):
                    if key in source:
                        group[key] = source[key]
            for scheduler in [lr_scheduler, *getattr(lr_scheduler, "_schedulers", [])]:
                scheduler.optimizer = self
            self._mark_step_called_for_schedulers()
        self.lr_scheduler = lr_scheduler

    def _mark_step_called_for_schedulers(self) -> None:
        # torch schedulers warn on their first step unless optimizer.step was wrapped
        # by them and called. In-backward updates happen inside backward, so there is
        # nothing to warn about: mark it as torch's wrapper would.
        if not hasattr(self.step, "_wrapped_by_lr_sched"):
            step = self.step

            @functools.wraps(step)
            def counted_step(*args: Any, **kwargs: Any) -> None:
                self._opt_called = True
                return step(*args, **kwargs)

            counted_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
            self.step = counted_step  # type: ignore[method-assign]
        self._opt_called = True

    def step_lr_scheduler(self, epoch: int | None = None) -> None:
        """Step the scheduler set by :meth:`set_lr_scheduler`.

        Args:
            epoch (int | None): passed to ``lr_scheduler.step`` if given.

        Raises:
            RuntimeError: if no scheduler was set.
        """
        if self.lr_scheduler is None:
            raise RuntimeError(
                "LR scheduler has not been set. Call set_lr_scheduler first."
            )
        if epoch is None:
            self.lr_scheduler.step()
        else:
            self.lr_scheduler.step(epoch)

    def get_last_lr(self) -> float:
        """The scheduler's last learning rate (of the first param group).

        Returns:
            float: the learning rate.

        Raises:
            RuntimeError: if no scheduler was set.
        """
        if self.lr_scheduler is None:
            raise RuntimeError(
                "LR scheduler has not been set. Call set_lr_scheduler first."
            )
        return self.lr_scheduler.get_last_lr()[0]


def _optim_map_for(
    model: nn.Module,
    optim_dict: Mapping[torch.Tensor, Optimizer],
    trainable_only: bool,
) -> dict[str, Optimizer]:
    optim_map = {}
    for name, param in model.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        if param not in optim_dict:
            if param.requires_grad:
                raise ValueError(
                    f"optim_dict has no optimizer for trainable parameter {name!r}"
                )
            continue
        optim_map[name] = optim_dict[param]
    return optim_map


def create_optim_in_bwd_wrapper(
    model: nn.Module, optim_dict: Mapping[torch.Tensor, Optimizer]
) -> OptimizerInBackwardWrapper:
    """Deprecated: build the in-backward optimizer from 0.6.1's per-parameter optimizers.

    Returns an :class:`OptimizerInBackward` (as :class:`OptimizerInBackwardWrapper`)
    that updates the model's parameters in backward with the optimizers in
    ``optim_dict``; it takes over from :func:`register_optim_in_bwd_hooks`, so calling
    both, as 0.6.1 recipes did, updates each parameter once.

    Args:
        model (nn.Module): the model; its ``named_parameters()`` give the names.
        optim_dict (Mapping[torch.Tensor, Optimizer]): parameter -> optimizer over
            that one parameter.

    Returns:
        OptimizerInBackwardWrapper: the optimizer.

    Raises:
        ValueError: if a trainable parameter has no optimizer in ``optim_dict``.
    """
    _warn_deprecated("create_optim_in_bwd_wrapper")
    return OptimizerInBackwardWrapper._from_optimizers(
        _optim_map_for(model, optim_dict, trainable_only=False)
    )


def register_optim_in_bwd_hooks(
    model: nn.Module, optim_dict: Mapping[torch.Tensor, Optimizer]
) -> None:
    """Deprecated: update the model's trainable parameters in backward with the
    per-parameter optimizers in ``optim_dict``.

    Builds an :class:`OptimizerInBackward` over them, kept alive by its hooks. A later
    :func:`create_optim_in_bwd_wrapper` (or any new :class:`OptimizerInBackward`) over
    the same parameters takes them over, so no parameter is updated twice.

    Args:
        model (nn.Module): the model whose trainable parameters get hooks.
        optim_dict (Mapping[torch.Tensor, Optimizer]): parameter -> optimizer over
            that one parameter.

    Raises:
        ValueError: if a trainable parameter has no optimizer in ``optim_dict``.
    """
    _warn_deprecated("register_optim_in_bwd_hooks")
    optim_map = _optim_map_for(model, optim_dict, trainable_only=True)
    if optim_map:
        OptimizerInBackwardWrapper._from_optimizers(optim_map)


__all__ = [
    "OptimizerInBackwardWrapper",
    "create_optim_in_bwd_wrapper",
    "register_optim_in_bwd_hooks",
]
