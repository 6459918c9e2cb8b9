"""torchtune 0.6.1's optimizer-in-backward API, deprecated.

0.6.1 recipes built one optimizer per parameter, had it stepped from a hook
(:func:`register_optim_in_bwd_hooks`) and saved, loaded and scheduled it through a
wrapper (:func:`create_optim_in_bwd_wrapper`). Here those per-parameter optimizers are
the buckets, one parameter each, of an
:class:`~torchtune.training.OptimizerInBackward`: each parameter is updated once, by its
own optimizer, which holds its state and saves and loads it as in 0.6.1, with the
hyperparameters of the one param group that an LR scheduler drives. New code builds
``OptimizerInBackward(params, optimizer_cls, **kwargs)`` instead.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from torchtune.training.memory import (
    OptimizerInBackward,
    hyperparameters,
)

_DEPRECATION = (
    "{what} is deprecated and will be removed in a future release. Use "
    "torchtune.training.OptimizerInBackward(params, optimizer_cls, **kwargs): it is a "
    "torch.optim.Optimizer, so LR schedulers, checkpointing and training.get_lr work "
    "on it unchanged."
)

# Per-parameter optimizer -> a weak reference to the OptimizerInBackward that steps
# it, so that the wrapper built after register_optim_in_bwd_hooks takes that one over
# instead of adding a second.
_STEPPED_BY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _warn(what: str) -> None:
    warnings.warn(_DEPRECATION.format(what=what), DeprecationWarning, stacklevel=3)


def _in_backward(
    optimizers: list[Optimizer], model: nn.Module | None = None
) -> OptimizerInBackward:
    """The :class:`OptimizerInBackward` whose buckets are ``optimizers`` (each over one
    parameter): the one built for them before, else a new one."""
    by_param = {}
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if len(params) != 1:
            raise ValueError(
                "each per-parameter optimizer must hold exactly one parameter, but "
                f"{type(optimizer).__name__} holds {len(params)}"
            )
        by_param[params[0]] = optimizer
    owners = {_STEPPED_BY.get(o, lambda: None)() for o in optimizers}
    if owners != {None}:
        owner = owners.pop()
        # One earlier instance (not None: that set had one element), for exactly
        # these parameters.
        if owners or len(owner.param_groups[0]["params"]) != len(by_param):
            raise ValueError(
                "some of these per-parameter optimizers are already stepped in backward "
                "for other parameters (by an earlier register_optim_in_bwd_hooks): give "
                "this call the same parameters"
            )
        return owner
    first = optimizers[0]
    shared = hyperparameters(first.param_groups[0])
    for optimizer in optimizers:
        differ = {
            key: (value, optimizer.param_groups[0].get(key))
            for key, value in shared.items()
            if optimizer.param_groups[0].get(key) != value
        }
        if differ:
            raise ValueError(
                "per-parameter optimizers with different hyperparameters are not "
                f"supported (first vs another, by key: {differ}): every update takes "
                "those of one param group, which the LR scheduler drives. Give each "
                "setting a param group of one OptimizerInBackward instead, e.g. "
                "OptimizerInBackward([{'params': decayed, 'weight_decay': 0.01}, "
                "{'params': norms_and_biases, 'weight_decay': 0.0}], "
                "torch.optim.AdamW, lr=2e-5), and drop register_optim_in_bwd_hooks "
                "and create_optim_in_bwd_wrapper: it is the optimizer, for LR "
                "schedulers and checkpoints too."
            )

    def build(params: list[Any]) -> Optimizer:
        # First the param group's optimizer, which only holds the group (it never
        # steps), then one per bucket of one parameter: that parameter's own.
        if isinstance(params[0], dict):
            return Optimizer(params, first.defaults)
        (param,) = params
        return by_param[param]

    held = {p: o.state[p] for p, o in by_param.items() if o.state.get(p)}
    owner = OptimizerInBackward(
        [{**shared, "params": list(by_param)}], build, bucket_cap_mb=0
    )
    owner.state.update(held)  # what the optimizers stepped before, now the buckets'
    for optimizer in optimizers:
        _STEPPED_BY[optimizer] = weakref.ref(owner)
    if model is not None:
        # 0.6.1 loops never call its zero_grad(), which restarts the gradient norm it
        # keeps a record for: once per forward pass, or the record would grow.
        model.register_forward_pre_hook(lambda *_: owner.zero_grad())
    return owner


def _optim_map(
    model: nn.Module, optim_dict: Mapping[torch.Tensor, Optimizer]
) -> dict[str, Optimizer]:
    # 0.6.1 stepped the trainable parameters; a frozen one's optimizer may be absent.
    return {
        name: optim_dict[p]
        for name, p in model.named_parameters()
        if p.requires_grad or p in optim_dict
    }


class OptimizerInBackwardWrapper:
    """Deprecated: torchtune 0.6.1's wrapper to save, load and schedule the
    per-parameter optimizers that update parameters in backward.

    They are the buckets of an :class:`OptimizerInBackward` (the one
    :func:`register_optim_in_bwd_hooks` built for them, else a new one), so each
    parameter is updated in backward, once. ``state_dict()`` and ``load_state_dict()``
    use 0.6.1's format (parameter name -> that parameter's optimizer's state dict;
    :func:`~torchtune.training.optim_in_bwd_legacy_state_dict.convert_legacy_optim_in_bwd_state_dict` converts it for
    any other optimizer). Every update takes the hyperparameters of the one param group
    that :meth:`set_lr_scheduler`'s scheduler drives: the optimizers' own, which must
    all be the same.

    Args:
        optim_map (dict[str, Optimizer]): parameter name -> optimizer over that one
            parameter.

    Raises:
        ValueError: if an optimizer holds other than one parameter, or they have
            different hyperparameters.
    """

    def __init__(self, optim_map: dict[str, Optimizer]) -> None:
        _warn("OptimizerInBackwardWrapper")
        self.optim_map = optim_map
        self.lr_scheduler: LRScheduler | None = None
        self._optimizer = _in_backward(list(optim_map.values()))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The one param group whose hyperparameters every update takes."""
        return self._optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        """Parameter name -> its optimizer's state dict, as in 0.6.1.

        Returns:
            dict[str, Any]: the state dict.
        """
        for opt in self.optim_map.values():  # the next update's, as 0.6.1 saved
            opt.param_groups[0].update(hyperparameters(self.param_groups[0]))
        return {name: opt.state_dict() for name, opt in self.optim_map.items()}

    def load_state_dict(self, optim_ckpt_map: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict`'s format into the per-parameter optimizers.

        Args:
            optim_ckpt_map (Mapping[str, Any]): parameter name -> state dict.

        Raises:
            RuntimeError: if some names have no entry or some entries no name, before
                anything is loaded.
        """
        missing = sorted(set(self.optim_map) - set(optim_ckpt_map))
        extra = sorted(set(optim_ckpt_map) - set(self.optim_map))
        if missing or extra:
            raise RuntimeError(
                f"optimizer state dict does not match: missing {missing}, extra {extra}"
            )
        for name, state_dict in optim_ckpt_map.items():
            self.optim_map[name].load_state_dict(state_dict)
        # The saved hyperparameters, as a plain load restores them: the first
        # optimizer's, which 0.6.1's scheduler drove.
        first = next(iter(self.optim_map.values()))
        self.param_groups[0].update(hyperparameters(first.param_groups[0]))

    def get_optim_key(self, key: str) -> Any:
        """The hyperparameter ``key`` that updates use now.

        Args:
            key (str): e.g. ``"lr"``.

        Returns:
            Any: its value.
        """
        return self.param_groups[0][key]

    def set_lr_scheduler(self, lr_scheduler: LRScheduler) -> None:
        """Make ``lr_scheduler``, built on one of the per-parameter optimizers as 0.6.1
        recipes did, drive every update's hyperparameters from the values it set.

        Args:
            lr_scheduler (LRScheduler): the scheduler.
        """
        # It is pointed at the param group every update reads, with what it set there.
        self.param_groups[0].update(
            hyperparameters(lr_scheduler.optimizer.param_groups[0])
        )
        for scheduler in (lr_scheduler, *getattr(lr_scheduler, "_schedulers", ())):
            scheduler.optimizer = self._optimizer
        # torch schedulers warn at their first step unless their optimizer's step()
        # was wrapped by a scheduler and called; here the updates run in backward.
        if not hasattr(self._optimizer.step, "_wrapped_by_lr_sched"):
            self._optimizer.step = functools.partial(self._optimizer.step)
            self._optimizer.step._wrapped_by_lr_sched = True
        self._optimizer._opt_called = True
        self.lr_scheduler = lr_scheduler

    def step_lr_scheduler(self, epoch: int | None = None) -> None:
        """Step the scheduler of :meth:`set_lr_scheduler`.

        Args:
            epoch (int | None): passed to its ``step`` if given. Default: ``None``

        Raises:
            RuntimeError: if none was set.
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
        """The scheduler's last learning rate.

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


def create_optim_in_bwd_wrapper(
    model: nn.Module, optim_dict: Mapping[torch.Tensor, Optimizer]
) -> OptimizerInBackwardWrapper:
    """Deprecated: the :class:`OptimizerInBackwardWrapper` of ``model``'s per-parameter
    optimizers, named by ``model.named_parameters()``. After
    :func:`register_optim_in_bwd_hooks` over the same ones it takes over the optimizer
    in backward built there, so each parameter is still updated once.

    Args:
        model (nn.Module): the model.
        optim_dict (Mapping[torch.Tensor, Optimizer]): parameter -> optimizer over that
            one parameter, for every trainable parameter.

    Returns:
        OptimizerInBackwardWrapper: the wrapper.
    """
    _warn("create_optim_in_bwd_wrapper")
    optim_map = _optim_map(model, optim_dict)
    _in_backward(list(optim_map.values()), model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # warned once, above
        return OptimizerInBackwardWrapper(optim_map)


def register_optim_in_bwd_hooks(
    model: nn.Module, optim_dict: Mapping[torch.Tensor, Optimizer]
) -> None:
    """Deprecated: update each of ``model``'s trainable parameters in backward with its
    optimizer in ``optim_dict``, through an :class:`OptimizerInBackward` that
    :func:`create_optim_in_bwd_wrapper` takes over.

    Args:
        model (nn.Module): the model.
        optim_dict (Mapping[torch.Tensor, Optimizer]): parameter -> optimizer over that
            one parameter, for every trainable parameter.
    """
    _warn("register_optim_in_bwd_hooks")
    _in_backward(list(_optim_map(model, optim_dict).values()), model)


__all__ = [
    "OptimizerInBackwardWrapper",
    "create_optim_in_bwd_wrapper",
    "register_optim_in_bwd_hooks",
]
