"""Memory utilities: activation checkpointing, memory statistics, and the
optimizer that runs inside ``backward()`` (:class:`OptimizerInBackward`)."""

from __future__ import annotations

import functools
import gc
import logging
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, Replicate
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from torchtune.utils import get_device_support, get_logger

_log: logging.Logger = get_logger()

ACWrapPolicyType: TypeAlias = (
    set[type[nn.Module]] | Callable[[nn.Module, bool, int], bool]
)

# ---------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------


def set_activation_checkpointing(
    model: nn.Module, auto_wrap_policy: ACWrapPolicyType, **kwargs: Any
) -> None:
    """Wrap submodules of ``model`` with activation checkpointing, in place.

    Args:
        model (nn.Module): the model whose submodules get wrapped.
        auto_wrap_policy (ACWrapPolicyType): which submodules to wrap. Either a set of
            ``nn.Module`` classes (every instance of them is wrapped on its own) or a
            callable with the signature ``(module, recurse, nonwrapped_numel) -> bool``
            as used by ``torch.distributed`` auto-wrapping.
        **kwargs: passed on to
            ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing``.

    Example:
        >>> from torchtune.modules import TransformerSelfAttentionLayer
        >>> set_activation_checkpointing(model, {TransformerSelfAttentionLayer})
    """
    if isinstance(auto_wrap_policy, set):
        auto_wrap_policy = ModuleWrapPolicy(auto_wrap_policy)
    apply_activation_checkpointing(model, auto_wrap_policy=auto_wrap_policy, **kwargs)


# ---------------------------------------------------------------------------
# Memory statistics
# ---------------------------------------------------------------------------

_GIB = 1024**3


def _accelerator_namespace(device_type: str) -> Any | None:
    """The ``torch.<device_type>`` module if it has a caching allocator to query."""
    if device_type == "cpu":
        return None
    namespace = getattr(torch, device_type, None)
    if namespace is None or not hasattr(namespace, "max_memory_allocated"):
        return None
    return namespace


def _cpu_peak_rss_bytes() -> int:
    """Peak resident set size of this process, in bytes.

    Reads ``VmHWM`` from ``/proc/self/status`` (Linux), which
    :func:`_reset_cpu_peak_rss` can reset. Elsewhere falls back to
    ``getrusage(RUSAGE_SELF).ru_maxrss``, the peak since the process started.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # Unix only, hence imported here

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in bytes on macOS and in KiB on Linux.
    return peak if sys.platform == "darwin" else peak * 1024


def _reset_cpu_peak_rss() -> bool:
    """Reset the process's peak RSS to its current RSS. Returns whether it worked.

    Linux (4.0+) resets ``VmHWM`` when ``5`` is written to ``/proc/self/clear_refs``.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cleanup_before_training() -> None:
    """Free what can be freed before the training loop starts.

    Runs Python's garbage collector. On an accelerator (CUDA, XPU, NPU, ...) it also
    releases the caching allocator's unused blocks and resets its peak-memory
    statistics. On CPU there is no caching allocator: it resets the process's peak
    resident set size instead (Linux only; a no-op elsewhere), so that the peak that
    :func:`get_memory_stats` reports afterwards covers training only.
    """
    gc.collect()
    namespace = _accelerator_namespace(get_device_support().device_type)
    if namespace is None:
        _reset_cpu_peak_rss()
        return
    namespace.empty_cache()
    namespace.reset_peak_memory_stats()


def get_memory_stats(
    device: torch.device, reset_stats: bool = True
) -> dict[str, float]:
    """Peak memory used on ``device`` since the last reset, in GiB.

    On an accelerator this is read from its caching allocator. On CPU, where there is
    none, all three entries hold the same number: the process's peak resident set size
    (RSS), which counts every allocation of the process, not only tensors.

    Args:
        device (torch.device): the device to report on (``cpu``, ``cuda``, ``xpu``, ...).
        reset_stats (bool): reset the peak statistics after reading them, so the next
            call measures from now. On CPU this resets the peak RSS (Linux); where that
            is not possible the peak keeps counting from process start. Default: ``True``

    Returns:
        dict[str, float]: ``peak_memory_active``, ``peak_memory_alloc`` and
        ``peak_memory_reserved`` in GiB, the keys :func:`log_memory_stats` expects.

    Example:
        >>> stats = get_memory_stats(torch.device("cpu"))
        >>> log_memory_stats(stats, "Memory stats after model init:")
    """
    device = torch.device(device)
    namespace = _accelerator_namespace(device.type)
    if namespace is None:
        peak_rss = _cpu_peak_rss_bytes() / _GIB
        if reset_stats:
            _reset_cpu_peak_rss()
        return {
            "peak_memory_active": peak_rss,
            "peak_memory_alloc": peak_rss,
            "peak_memory_reserved": peak_rss,
        }
    stats = {
        "peak_memory_active": namespace.memory_stats(device).get(
            "active_bytes.all.peak", 0
        )
        / _GIB,
        "peak_memory_alloc": namespace.max_memory_allocated(device) / _GIB,
        "peak_memory_reserved": namespace.max_memory_reserved(device) / _GIB,
    }
    if reset_stats:
        namespace.reset_peak_memory_stats(device)
    return stats


DEFAULT_LOG_MESSAGE = "Memory stats after model init:"


def log_memory_stats(
    stats: dict[str, float], message: str = DEFAULT_LOG_MESSAGE
) -> None:
    """Log the output of :func:`get_memory_stats` through torchtune's logger.

    Args:
        stats (dict[str, float]): must hold ``peak_memory_active``,
            ``peak_memory_alloc`` and ``peak_memory_reserved`` (GiB).
        message (str): the first line of the log entry.
            Default: ``"Memory stats after model init:"``
    """
    name = get_device_support().device_name
    _log.info(
        f"{message}"
        f"\n\t{name} peak memory allocation: {stats['peak_memory_alloc']:.2f} GiB"
        f"\n\t{name} peak memory reserved: {stats['peak_memory_reserved']:.2f} GiB"
        f"\n\t{name} peak memory active: {stats['peak_memory_active']:.2f} GiB"
    )


# ---------------------------------------------------------------------------
# Optimizer in backward
# ---------------------------------------------------------------------------

# Which OptimizerInBackward updates each parameter. Keys are held weakly (a parameter
# that is garbage collected drops out), values are weak references so that this map
# never keeps an optimizer, or through it the parameter itself, alive.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()

# Per-parameter optimizers that already carry the load_state_dict post-hook below.
_HOOKED_INNER: weakref.WeakSet[Optimizer] = weakref.WeakSet()

# Group keys that are not hyperparameters.
_NON_HYPERPARAMETER_KEYS = frozenset({"params", "param_names"})


def _owner_of(param: torch.Tensor) -> OptimizerInBackward | None:
    ref = _OWNERS.get(param)
    return None if ref is None else ref()


class _OneParamState(MutableMapping):
    """What a per-parameter optimizer sees as its ``state``: the one entry of the
    outer optimizer's ``state`` that belongs to its parameter.

    The entry is looked up in ``owner.state`` on every access, so the moments live in
    one place and stay linked after ``owner.load_state_dict`` replaces ``owner.state``.
    Like a ``defaultdict(dict)``, reading a missing entry creates it.
    """

    __slots__ = ("_owner", "_param")

    def __init__(self, owner: OptimizerInBackward, param: torch.Tensor) -> None:
        self._owner = owner
        self._param = param

    def _check(self, key: Any) -> None:
        if key is not self._param:
            raise KeyError(
                "this per-parameter optimizer only holds state for its own parameter"
            )

    def __getitem__(self, key: Any) -> Any:
        self._check(key)
        return self._owner.state[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._check(key)
        self._owner.state[key] = value

    def __delitem__(self, key: Any) -> None:
        self._check(key)
        del self._owner.state[key]

    def __contains__(self, key: object) -> bool:
        return key is self._param and self._param in self._owner.state

    def get(self, key: Any, default: Any = None) -> Any:
        # Unlike __getitem__, never creates an entry (as for a defaultdict).
        return self._owner.state[key] if key in self else default

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([self._param] if self._param in self._owner.state else [])

    def __len__(self) -> int:
        return int(self._param in self._owner.state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"


def _single_param(optimizer: Optimizer) -> torch.Tensor:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != 1:
        raise ValueError(
            "each per-parameter optimizer must hold exactly one parameter, but "
            f"{type(optimizer).__name__} holds {len(params)}"
        )
    return params[0]


def _reclaim_inner_state(inner: Optimizer) -> None:
    """load_state_dict post-hook of a per-parameter optimizer.

    ``Optimizer.load_state_dict`` replaces ``inner.state`` with a new dict. This moves
    the loaded entry into the owning :class:`OptimizerInBackward` and puts the shared
    view back, so state loaded through a 0.6.1-style per-parameter optimizer (e.g.
    ``OptimizerInBackwardWrapper.optim_map[name]``) is the state that training uses.
    """
    if isinstance(inner.state, _OneParamState):
        return
    param = _single_param(inner)
    owner = _owner_of(param)
    if owner is None or owner._inner.get(param) is not inner:
        return
    loaded = inner.state.get(param)
    inner.state = _OneParamState(owner, param)
    if loaded:
        owner.state[param] = loaded


def _is_legacy_in_bwd_state_dict(state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` is in torchtune 0.6.1's in-backward format."""
    if not isinstance(state_dict, Mapping) or not state_dict:
        return False
    if set(state_dict) == {"state", "param_groups"}:
        return False
    return all(
        isinstance(v, Mapping) and "state" in v and "param_groups" in v
        for v in state_dict.values()
    )


def _legacy_entries(
    state_dict: Mapping[str, Mapping[str, Any]],
) -> dict[str, tuple[dict[str, Any] | None, dict[str, Any]]]:
    """Split a 0.6.1 in-backward state dict into ``name -> (state, hyperparameters)``."""
    entries = {}
    for name, per_param in state_dict.items():
        groups = per_param["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != 1:
            raise ValueError(
                f"0.6.1 in-backward optimizer state for {name!r} should hold one "
                f"parameter in one group, got {[len(g['params']) for g in groups]}"
            )
        (key,) = groups[0]["params"]
        hyperparameters = {
            k: v for k, v in groups[0].items() if k not in _NON_HYPERPARAMETER_KEYS
        }
        entries[name] = (per_param["state"].get(key), hyperparameters)
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
    with one param group that takes its hyperparameters from the first entry.

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
    if not _is_legacy_in_bwd_state_dict(state_dict):
        raise ValueError(
            "expected a torchtune 0.6.1 in-backward optimizer state dict (parameter "
            f"name -> per-parameter optimizer state dict), got keys {list(state_dict)[:5]}"
        )
    entries = _legacy_entries(state_dict)
    first_hyperparameters = next(iter(entries.values()))[1]
    return {
        "state": {name: s for name, (s, _) in entries.items() if s is not None},
        "param_groups": [{**first_hyperparameters, "params": list(entries)}],
    }


def _describe(param: torch.Tensor, name: str | None, index: int) -> str:
    if name is not None:
        return repr(name)
    return f"#{index} (shape {tuple(param.shape)})"


class OptimizerInBackward(Optimizer):
    r"""An optimizer that updates each parameter inside ``backward()``, as soon as its
    gradient is ready, and frees that gradient at once.

    Compared with calling a plain optimizer after ``backward()``, peak memory drops by up
    to the size of all gradients, since no two gradients need to be alive at once
    (except those of parameters that share a gradient bucket, e.g. under FSDP).

    To everything that takes an optimizer it looks like
    ``optimizer_cls(params, **optimizer_kwargs)``: the same ``param_groups``,
    ``defaults`` and ``state``, and ``state_dict()`` / ``load_state_dict()`` in the
    standard torch format, interchangeable with the plain optimizer both ways. So
    ``torch.optim.lr_scheduler`` schedulers, ``torch.distributed.checkpoint.state_dict``
    (full and sharded, FSDP2 included) and torchtune's checkpointing work on it
    unchanged. Internally one ``optimizer_cls`` instance per trainable parameter does
    the arithmetic, on the state held in ``self.state``, with the hyperparameters of
    the param group that holds the parameter at the moment it steps: a learning rate
    set by a scheduler applies to every parameter from the next update on.

    Parameters with ``requires_grad=False`` at construction (e.g. the frozen base of a
    LoRA model) stay in ``param_groups``, like in the plain optimizer, but get no hook
    and no per-parameter optimizer. If one later receives a gradient, :meth:`step`
    updates it and from then on it is updated in backward like the others.

    Each parameter is updated by at most one :class:`OptimizerInBackward`. Building a
    new one over parameters that already have one moves them to the new one: the
    earlier instance's hooks on them are removed and it no longer updates them (it
    keeps them in its ``param_groups``). That keeps the common pattern of building a
    fresh optimizer to load a checkpoint into working, with no parameter ever updated
    twice or left with an optimizer that never runs. :meth:`remove_hooks` detaches
    an instance from backward altogether.

    .. warning::
        After ``backward()`` the ``.grad`` of every parameter this optimizer updates is
        ``None``: the gradient was used and freed inside backward. Gradient clipping
        cannot be combined with it (the global norm is only known once backward is
        over, after the updates), and neither can gradient accumulation over several
        backward passes (every backward pass updates the parameters). Scale the loss
        before ``backward()`` instead of scaling gradients after it.

    .. note::
        :meth:`step` and :meth:`zero_grad` can be called in the training loop exactly
        as with a plain optimizer. After a normal backward, :meth:`step` has nothing
        left to do. Call ``zero_grad()`` once per step: it also restarts
        :attr:`grad_norm`.

    Args:
        params (iterable): parameters to optimize, or dicts defining param groups, or
            ``(name, parameter)`` pairs such as ``model.named_parameters()``. Passing
            names is optional; it lets :meth:`load_state_dict` load torchtune 0.6.1
            in-backward checkpoints and name parameters in error messages.
        optimizer_cls (Callable[..., Optimizer]): builds an optimizer from a list of
            parameters (and ``optimizer_kwargs``), e.g. ``torch.optim.AdamW`` or
            ``functools.partial(torchtune.config.instantiate, cfg.optimizer)``.
        **optimizer_kwargs: hyperparameters passed to ``optimizer_cls``.

    Raises:
        TypeError: if ``optimizer_cls`` does not return a ``torch.optim.Optimizer``.
        ValueError: if ``params`` is empty.

    Example:
        >>> optimizer = OptimizerInBackward(
        ...     model.parameters(), torch.optim.AdamW, lr=2e-5, weight_decay=0.01
        ... )
        >>> scheduler = get_cosine_schedule_with_warmup(optimizer, 100, 1000)
        >>> for batch in dataloader:
        ...     loss = loss_fn(model(batch["tokens"]), batch["labels"])
        ...     loss.backward()  # parameters are updated here
        ...     log({"loss": loss.item(), "grad_norm": optimizer.grad_norm.item()})
        ...     optimizer.step()  # nothing left to do; kept so the loop is the same
        ...     optimizer.zero_grad(set_to_none=True)
        ...     scheduler.step()
        >>> torch.save(optimizer.state_dict(), "optim.pt")
        >>> plain = torch.optim.AdamW(model.parameters())
        >>> plain.load_state_dict(torch.load("optim.pt"))  # Adam moments and all
        >>> len(plain.state) == len(list(model.parameters()))
        True
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_cls: Callable[..., Optimizer],
        **optimizer_kwargs: Any,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("OptimizerInBackward got an empty parameter list")
        # A real instance gives param_groups and defaults exactly as the plain
        # optimizer has them (every hyperparameter key, names if given). It holds no
        # state, so it costs no memory.
        outward = optimizer_cls(params, **optimizer_kwargs)
        if not isinstance(outward, Optimizer):
            raise TypeError(
                "optimizer_cls must build a torch.optim.Optimizer, but "
                f"{optimizer_cls!r} returned {type(outward).__name__}"
            )
        self._setup(optimizer_cls, optimizer_kwargs, adopted={}, names={})
        super().__init__(outward.param_groups, outward.defaults)

    # -- construction helpers ---------------------------------------------------

    def _setup(
        self,
        optimizer_cls: Callable[..., Optimizer] | None,
        optimizer_kwargs: dict[str, Any],
        adopted: dict[torch.Tensor, Optimizer],
        names: dict[torch.Tensor, str],
    ) -> None:
        """Set the private attributes. Must run before ``Optimizer.__init__``, which
        calls :meth:`add_param_group`."""
        self._optimizer_cls = optimizer_cls
        self._optimizer_kwargs = optimizer_kwargs
        # Per-parameter optimizers to take over instead of building new ones (0.6.1 API).
        self._adopted = adopted
        # Names known from outside param_groups (0.6.1 API).
        self._extra_names = names
        # True while the 0.6.1 API builds this object from its per-parameter optimizers.
        self._adopting = bool(adopted)
        # The per-parameter optimizer of every parameter this instance updates.
        self._inner: dict[torch.Tensor, Optimizer] = {}
        self._hook_handles: dict[torch.Tensor, RemovableHandle] = {}
        self._hooks_enabled = True
        # Parameter -> the outer param group that holds it.
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        # Sum of squared gradient norms since zero_grad(), keyed by how to reduce it
        # across ranks: None for plain tensors, (mesh, mesh dims) for DTensors.
        self._grad_sq_sums: dict[Any, torch.Tensor] = {}

    def _build_inner(self, param: torch.Tensor) -> Optimizer:
        inner = self._adopted.pop(param, None)
        if inner is None:
            if self._optimizer_cls is None:
                raise RuntimeError(
                    "this optimizer was built from 0.6.1-style per-parameter optimizers "
                    "and cannot build one for a new parameter; use "
                    "OptimizerInBackward(params, optimizer_cls, **kwargs) instead"
                )
            inner = self._optimizer_cls([param], **self._optimizer_kwargs)
            existing = None
        else:
            existing = inner.state[param] if param in inner.state else None
        inner.state = _OneParamState(self, param)
        if existing:
            self.state[param] = existing
        if inner not in _HOOKED_INNER:
            inner.register_load_state_dict_post_hook(_reclaim_inner_state)
            _HOOKED_INNER.add(inner)
        return inner

    def _attach(self, param: torch.Tensor) -> None:
        """Make this instance the one that updates ``param``."""
        previous = _owner_of(param)
        if previous is not None and previous is not self:
            previous._release(param)
        if param not in self._inner:
            self._inner[param] = self._build_inner(param)
        if (
            self._hooks_enabled
            and param.requires_grad
            and param not in self._hook_handles
        ):
            self._hook_handles[param] = param.register_post_accumulate_grad_hook(
                self._on_grad_ready
            )
        _OWNERS[param] = weakref.ref(self)

    def _release(self, param: torch.Tensor) -> None:
        """Stop updating ``param``: another instance took it over."""
        handle = self._hook_handles.pop(param, None)
        if handle is not None:
            handle.remove()
        self._inner.pop(param, None)

    def _index_groups(self) -> None:
        self._group_of = {
            p: group for group in self.param_groups for p in group["params"]
        }

    def _param_names(self) -> dict[torch.Tensor, str]:
        names = dict(self._extra_names)
        for group in self.param_groups:
            if "param_names" in group:
                names.update(zip(group["params"], group["param_names"], strict=True))
        return names

    # -- the update ---------------------------------------------------------------

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        # A None grad means another hook already used it (e.g. a hand-written 0.6.1
        # hook that steps and clears): never update a parameter twice.
        if param.grad is not None and param in self._inner:
            self._update(param)

    @torch.no_grad()
    def _update(self, param: torch.Tensor) -> None:
        self._accumulate_grad_norm(param.grad)
        inner = self._inner[param]
        # The outer group is the one schedulers and load_state_dict write to.
        inner_group = inner.param_groups[0]
        for key, value in self._group_of[param].items():
            if key not in _NON_HYPERPARAMETER_KEYS:
                inner_group[key] = value
        inner.step()
        param.grad = None

    def _accumulate_grad_norm(self, grad: torch.Tensor) -> None:
        key = None
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                grad = grad.redistribute(
                    placements=[
                        Replicate() if p.is_partial() else p for p in grad.placements
                    ]
                )
            # Every mesh dim that is not replicated holds a different slice of the
            # gradient. Test "not replicate" rather than is_shard(): FSDP over a
            # tensor-parallel weight places a _StridedShard, whose is_shard() is False.
            shard_dims = tuple(
                i for i, p in enumerate(grad.placements) if not p.is_replicate()
            )
            key = (grad.device_mesh, shard_dims) if shard_dims else None
            grad = grad.to_local()
        squared = torch.linalg.vector_norm(grad, 2.0, dtype=torch.float32).square()
        total = self._grad_sq_sums.get(key)
        self._grad_sq_sums[key] = squared if total is None else total + squared

    # -- torch.optim.Optimizer API -------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, exactly as in ``torch.optim.Optimizer``; its trainable
        parameters are updated in backward from the next backward pass on and appear in
        :meth:`state_dict`.

        Args:
            param_group (dict[str, Any]): ``params`` plus any hyperparameters to
                override the defaults for this group.

        Raises:
            ValueError: as ``torch.optim.Optimizer.add_param_group`` does, e.g. if a
                parameter is already in another group.
            RuntimeError: on the deprecated :class:`OptimizerInBackwardWrapper`,
                which has no ``optimizer_cls`` to build optimizers for new parameters.
        """
        if self._optimizer_cls is None and not self._adopting:
            raise RuntimeError(
                "add_param_group is not supported on an optimizer built from 0.6.1-style "
                "per-parameter optimizers; build OptimizerInBackward(params, "
                "optimizer_cls, **kwargs) instead"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for param in group["params"]:
            self._group_of[param] = group
            if param.requires_grad:
                self._attach(param)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Update every parameter of this optimizer that still holds a gradient, then
        set its ``.grad`` to ``None``.

        After a normal backward pass all gradients were already used inside it and
        this does nothing. Gradients are still present when backward ran without the
        hooks (after :meth:`remove_hooks`, or for a parameter that was frozen at
        construction), or when they were set by hand: e.g. the zero gradients with
        ``lr=0`` that ``torch.distributed.checkpoint`` uses to create optimizer state.
        Those updates are exactly what the plain optimizer would do.

        Args:
            closure (None): not supported; must be ``None``.

        Raises:
            NotImplementedError: if a closure is given. A closure re-runs forward and
                backward, and the backward pass would already update the parameters.
        """
        if closure is not None:
            raise NotImplementedError(
                "OptimizerInBackward.step() does not take a closure: the closure's "
                "backward pass would already update the parameters. Call step() "
                "without arguments."
            )
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param not in self._inner:
                    owner = _owner_of(param)
                    if owner is not None and owner is not self:
                        continue  # another OptimizerInBackward updates it
                    self._attach(param)
                self._update(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients as ``torch.optim.Optimizer.zero_grad`` does, and restart
        :attr:`grad_norm` from zero.

        Args:
            set_to_none (bool): set gradients to ``None`` rather than zero them.
                Default: ``True``
        """
        super().zero_grad(set_to_none=set_to_none)
        self._grad_sq_sums = {}

    @property
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of all gradients this optimizer used since the last
        :meth:`zero_grad`, as a 0-dim float32 tensor (on the gradients' device; ``0.``
        if there were none).

        For DTensor parameters (FSDP2, tensor parallel) each rank adds up the squares of
        its local shards and reading this property all-reduces them, so it must be read
        on every rank, like any collective.
        """
        total: torch.Tensor | None = None
        for key, squared in self._grad_sq_sums.items():
            if key is not None:
                mesh, shard_dims = key
                squared = squared.clone()
                for mesh_dim in shard_dims:
                    dist.all_reduce(squared, group=mesh.get_group(mesh_dim))
            total = squared if total is None else total + squared.to(total.device)
        if total is None:
            return torch.zeros((), dtype=torch.float32)
        return total.sqrt()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load optimizer state, as ``torch.optim.Optimizer.load_state_dict`` does.

        Accepts the standard torch format, whether saved from this class or from the
        plain optimizer, and torchtune 0.6.1 in-backward checkpoints (a dict keyed by
        parameter name). The latter needs parameter names: they are known when this
        optimizer was built from ``model.named_parameters()`` or through the
        deprecated 0.6.1 functions. Otherwise convert it with
        :func:`convert_legacy_optim_in_bwd_state_dict` and load that through
        ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict``.

        Args:
            state_dict (Mapping[str, Any]): the state to load.

        Raises:
            ValueError: if the state dict's parameters do not match this optimizer's:
                the message names what is missing and what is extra. Nothing is
                dropped silently.
        """
        if _is_legacy_in_bwd_state_dict(state_dict):
            state_dict = self._from_legacy(state_dict)
        self._check_matches(state_dict)
        super().load_state_dict(state_dict)
        self._index_groups()

    # -- state dict helpers -----------------------------------------------------------

    def _check_matches(self, state_dict: Mapping[str, Any]) -> None:
        missing_keys = {"state", "param_groups"} - set(state_dict)
        if missing_keys:
            raise ValueError(
                f"optimizer state dict has no {sorted(missing_keys)} entry; expected "
                "the torch format {'state': ..., 'param_groups': [...]}, got keys "
                f"{list(state_dict)[:5]}"
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state dict has {len(saved_groups)} param groups, but this "
                f"optimizer has {len(self.param_groups)}"
            )
        names = self._param_names()
        problems = []
        index = 0
        for group_index, (group, saved) in enumerate(
            zip(self.param_groups, saved_groups, strict=True)
        ):
            params, saved_ids = group["params"], list(saved["params"])
            saved_names = saved.get("param_names")
            if saved_names is not None and "param_names" in group:
                ours = list(group["param_names"])
                missing = [n for n in ours if n not in set(saved_names)]
                extra = [n for n in saved_names if n not in set(ours)]
                if missing or extra:
                    problems.append(
                        f"group {group_index}: missing {missing}, extra {extra}"
                    )
                elif ours != list(saved_names):
                    problems.append(
                        f"group {group_index}: same parameters in a different order"
                    )
            elif len(saved_ids) != len(params):
                missing = [
                    _describe(p, names.get(p), index + i)
                    for i, p in enumerate(params)
                    if i >= len(saved_ids)
                ]
                extra = [f"saved id {pid}" for pid in saved_ids[len(params) :]]
                problems.append(
                    f"group {group_index} holds {len(params)} parameters, the state "
                    f"dict's holds {len(saved_ids)}: missing [{', '.join(missing)}], "
                    f"extra [{', '.join(extra)}]"
                )
            index += len(params)
        known_ids = {pid for saved in saved_groups for pid in saved["params"]}
        unknown = [pid for pid in state_dict["state"] if pid not in known_ids]
        if unknown:
            problems.append(
                f"state for ids {unknown} that are in no param group (extra)"
            )
        if problems:
            raise ValueError(
                "optimizer state dict does not match this optimizer's parameters: "
                + "; ".join(problems)
            )

    def _from_legacy(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Turn a 0.6.1 in-backward state dict into the torch format for this optimizer."""
        names = self._param_names()
        if not names:
            raise ValueError(
                "this is a torchtune 0.6.1 in-backward optimizer state dict (keyed by "
                "parameter name), but this optimizer does not know parameter names. "
                "Build it from model.named_parameters(), or load "
                "convert_legacy_optim_in_bwd_state_dict(state_dict) with "
                "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict."
            )
        entries = _legacy_entries(state_dict)
        ours = {
            names[p]
            for group in self.param_groups
            for p in group["params"]
            if p in names and p.requires_grad
        }
        unnamed = sum(
            1 for g in self.param_groups for p in g["params"] if p not in names
        )
        missing = sorted(ours - set(entries))
        extra = sorted(set(entries) - set(names.values()))
        if missing or extra or unnamed:
            raise ValueError(
                "0.6.1 in-backward optimizer state dict does not match this "
                f"optimizer's parameters: missing {missing}, extra {extra}"
                + (f", {unnamed} parameters without a name" if unnamed else "")
            )
        state: dict[int, Any] = {}
        groups = []
        index = 0
        for group in self.param_groups:
            ids = list(range(index, index + len(group["params"])))
            index += len(ids)
            hyperparameters = {
                k: v for k, v in group.items() if k not in _NON_HYPERPARAMETER_KEYS
            }
            for pid, param in zip(ids, group["params"], strict=True):
                entry = entries.get(names[param])
                if entry is None:
                    continue
                param_state, saved_hyperparameters = entry
                if param_state is not None:
                    state[pid] = param_state
                if pid == ids[0]:
                    hyperparameters.update(saved_hyperparameters)
            groups.append({**hyperparameters, "params": ids})
        return {"state": state, "param_groups": groups}

    # -- hooks ------------------------------------------------------------------------

    def remove_hooks(self) -> None:
        """Stop updating parameters in backward.

        Gradients then stay in ``.grad`` after backward and :meth:`step` updates the
        parameters from them, as a plain optimizer would. This instance keeps its
        parameters: no other optimizer in backward takes them over.
        """
        for handle in self._hook_handles.values():
            handle.remove()
        self._hook_handles = {}
        self._hooks_enabled = False


# ---------------------------------------------------------------------------
# Deprecated 0.6.1 API
# ---------------------------------------------------------------------------

_DEPRECATION = (
    "{what} is deprecated and will be removed in a future release. Use "
    "torchtune.training.OptimizerInBackward(params, optimizer_cls, **kwargs): it is a "
    "torch.optim.Optimizer, so LR schedulers, checkpointing and training.get_lr work "
    "on it unchanged."
)


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


def _warn_deprecated(what: str) -> None:
    warnings.warn(_DEPRECATION.format(what=what), DeprecationWarning, stacklevel=3)


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
        adopted: dict[torch.Tensor, Optimizer] = {}
        names: dict[torch.Tensor, str] = {}
        for name, optimizer in optim_map.items():
            param = _single_param(optimizer)
            adopted[param] = optimizer
            names[param] = name
        first = next(iter(optim_map.values()))
        group = {
            k: v
            for k, v in first.param_groups[0].items()
            if k not in _NON_HYPERPARAMETER_KEYS
        }
        group["params"] = list(adopted)
        self._setup(None, {}, adopted=adopted, names=names)
        Optimizer.__init__(self, [group], dict(first.defaults))
        self._adopting = False
        self.lr_scheduler: LRScheduler | None = None

    @property
    def optim_map(self) -> dict[str, Optimizer]:
        """Parameter name -> the per-parameter optimizer that updates it."""
        return {
            self._extra_names[p]: inner
            for p, inner in self._inner.items()
            if p in self._extra_names
        }

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
            if not any(target is inner for inner in self._inner.values()):
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
    "ACWrapPolicyType",
    "DEFAULT_LOG_MESSAGE",
    "OptimizerInBackward",
    "OptimizerInBackwardWrapper",
    "cleanup_before_training",
    "convert_legacy_optim_in_bwd_state_dict",
    "create_optim_in_bwd_wrapper",
    "get_memory_stats",
    "log_memory_stats",
    "register_optim_in_bwd_hooks",
    "set_activation_checkpointing",
]
