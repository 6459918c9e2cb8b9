"""Memory utilities: activation checkpointing, memory statistics, and the
optimizer that runs inside ``backward()`` (:class:`OptimizerInBackward`).

torchtune 0.6.1's optimizer-in-backward functions, deprecated, live in
:mod:`torchtune.training.optim_in_bwd_deprecated` and are importable from here too,
as in 0.6.1. Its in-backward checkpoint format is read by
:mod:`torchtune.training.optim_in_bwd_legacy_state_dict`."""

from __future__ import annotations

import gc
import importlib
import logging
import math
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from torchtune.training.gradients import (
    GradNorm,
    clip_coefficient,
    scale_grads_,
    tensor_norms,
    total_norm,
)
from torchtune.utils import get_device_support, get_logger, log_rank_zero

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

# torch.optim.Optimizer's hooks around state_dict() and load_state_dict(). They belong
# to the wrapped optimizer, whose own methods run them.
_STATE_DICT_HOOKS = (
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


#: Default most gradient bytes, in MiB, that :class:`OptimizerInBackward` updates in
#: one optimizer call.
DEFAULT_BUCKET_CAP_MB = 4.0


def is_valid_bucket_cap(bucket_cap_mb: object) -> bool:
    """Whether ``bucket_cap_mb`` is a valid bucket cap: a finite number ``>= 0`` (not
    a bool, not NaN or infinite) or ``None`` for the default."""
    if bucket_cap_mb is None:
        return True
    return (
        isinstance(bucket_cap_mb, int | float)
        and not isinstance(bucket_cap_mb, bool)
        and 0 <= bucket_cap_mb < math.inf
    )


def _bucket_cap_bytes(bucket_cap_mb: float | None) -> int:
    if not is_valid_bucket_cap(bucket_cap_mb):
        raise ValueError(
            f"bucket_cap_mb must be a finite number >= 0, got {bucket_cap_mb!r}: 0 updates "
            "each parameter on its own, larger values update up to that many MiB of "
            "gradients in one optimizer call"
        )
    if bucket_cap_mb is None:
        bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
    return int(bucket_cap_mb * 1024**2)


# Param group keys that are not hyperparameters.
_NON_HYPERPARAMETER_KEYS = frozenset({"params", "param_names"})


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters of a param group: every key but ``params`` and
    ``param_names``.

    Args:
        group (Mapping[str, Any]): a param group, as in ``optimizer.param_groups``.

    Returns:
        dict[str, Any]: a new dict of its other entries (``lr``, ``betas``, ...).
    """
    return {k: v for k, v in group.items() if k not in _NON_HYPERPARAMETER_KEYS}


def _owner_of(param: torch.Tensor) -> OptimizerInBackward | None:
    ref = _OWNERS.get(param)
    return None if ref is None else ref()


class _BucketState(MutableMapping):
    """What a bucket's optimizer sees as its ``state``: the entries of the outer
    optimizer's ``state`` that belong to the bucket's parameters.

    Entries are looked up in ``owner.state`` on every access, so the moments live in
    one place and stay linked after ``owner.load_state_dict`` replaces ``owner.state``.
    Like a ``defaultdict(dict)``, reading a missing entry creates it.
    """

    __slots__ = ("_owner", "_params")

    def __init__(self, owner: OptimizerInBackward, params: list[torch.Tensor]) -> None:
        self._owner = owner
        # Keyed by identity, in the bucket's order.
        self._params = {id(p): p for p in params}

    def _check(self, key: Any) -> None:
        if self._params.get(id(key)) is not key:
            raise KeyError(
                "this bucket's optimizer only holds state for the bucket's parameters"
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
        return self._params.get(id(key)) is key and key in self._owner.state

    def get(self, key: Any, default: Any = None) -> Any:
        # Unlike __getitem__, never creates an entry (as for a defaultdict).
        return self._owner.state[key] if key in self else default

    def __iter__(self) -> Iterator[torch.Tensor]:
        state = self._owner.state
        return iter([p for p in self._params.values() if p in state])

    def __len__(self) -> int:
        state = self._owner.state
        return sum(1 for p in self._params.values() if p in state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"


class _Bucket:
    """Parameters of one param group that one ``optimizer_cls`` instance updates
    together, once every one of them has its gradient."""

    __slots__ = ("params", "optimizer", "ready")

    def __init__(self, params: list[torch.Tensor], optimizer: Optimizer) -> None:
        self.params = params
        self.optimizer = optimizer
        # Parameters whose gradient arrived in this backward pass, by identity.
        self.ready: set[int] = set()


def _local_bytes(param: torch.Tensor) -> int:
    """Bytes of ``param``'s gradient on this rank (its local shard for a DTensor)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


def _describe(param: torch.Tensor, name: str | None, index: int) -> str:
    if name is not None:
        return repr(name)
    return f"#{index} (shape {tuple(param.shape)})"


def _wrapped_attribute(name: str, doc: str) -> property:
    """An attribute that is the wrapped optimizer's own, read and written through."""

    def fget(self: OptimizerInBackward) -> Any:
        return getattr(self._optimizer, name)

    def fset(self: OptimizerInBackward, value: Any) -> None:
        setattr(self._optimizer, name, value)

    return property(fget, fset, doc=doc)


class OptimizerInBackward(Optimizer):
    r"""An optimizer that updates parameters inside ``backward()``, as soon as their
    gradients are ready, and frees those gradients at once.

    Parameters are updated in buckets: consecutive parameters of one param group,
    holding up to ``bucket_cap_mb`` MiB of gradients together. A bucket is updated by
    one optimizer call (one ``foreach`` or fused kernel launch for ``torch.optim``'s
    optimizers) when the last of its gradients arrives, and its gradients are freed
    right after. Compared with calling a plain optimizer after ``backward()``, peak
    memory drops by about the size of all gradients less one bucket's: with
    ``bucket_cap_mb=0`` each parameter is its own bucket and no two gradients need to
    be alive at once (except those of parameters that share a buffer anyway, e.g. an
    FSDP unit's reduce-scatter output). Larger buckets make fewer, larger optimizer
    calls, which is faster for many small parameters.

    It *is* the optimizer it wraps, as far as everything outside the update goes:
    construction builds ``optimizer_cls(params, **optimizer_kwargs)``, and that
    instance's ``param_groups``, ``defaults`` and ``state`` are this object's, and its
    own ``state_dict()`` and ``load_state_dict()`` (with the class's overrides, hooks,
    dtype policy and saved format, e.g. bitsandbytes' packed 8-bit state) produce and
    consume every state dict. So plain and in-backward checkpoints are the same thing,
    loadable into either, and ``torch.optim.lr_scheduler`` schedulers,
    ``torch.distributed.checkpoint.state_dict`` (full and sharded, FSDP2 included) and
    torchtune's checkpointing work on it unchanged. Any other public attribute (for
    example bitsandbytes' ``is_paged``) is read from the wrapped optimizer too.

    The update is done inside backward by one ``optimizer_cls`` instance per bucket,
    on its parameters' entries of ``state``, with the hyperparameters of the param
    group that holds them at that moment: a learning rate set by a scheduler applies
    to every parameter from the next update on. A bucket whose parameters do not all
    get a gradient in a backward pass (an unused layer, a dropped layer) is updated
    when that backward pass ends. An optimizer step over a subset of parameters does
    the same per-element arithmetic as one over all of them, so training equals the
    plain optimizer's whatever the buckets. This works for any
    optimizer whose update of one parameter depends only on that parameter's gradient
    and state (``torch.optim``'s, bitsandbytes', torchao's low-bit ones); it cannot
    work for one that couples parameters in its step (e.g. a global-norm LAMB
    variant, Shampoo).

    Parameters with ``requires_grad=False`` at construction (e.g. the frozen base of a
    LoRA model) stay in ``param_groups``, like in the plain optimizer, but get no hook
    and no bucket. If one later receives a gradient, :meth:`step`
    updates it and from then on it is updated in backward like the others.

    Each parameter is updated by at most one :class:`OptimizerInBackward`. Building a
    new one over parameters that already have one moves them to the new one: the
    earlier instance's hooks on them are removed and it no longer updates them (it
    keeps them in its ``param_groups``). That keeps the common pattern of building a
    fresh optimizer to load a checkpoint into working, with no parameter ever updated
    twice or left with an optimizer that never runs. :meth:`remove_hooks` detaches
    an instance from backward altogether.

    Scaling and clipping gradients, which a plain loop does between ``backward()``
    and ``step()``, happen inside :meth:`backward`: ``optimizer.backward(loss,
    grad_scale=s)`` multiplies every gradient by ``s`` before it is used, and with
    ``max_norm`` set it clips them by their global norm, exactly as
    ``clip_grad_norm_`` does, at the price of a second backward pass. The result is
    bitwise what the plain optimizer computes after ``loss.backward()``,
    :func:`~torchtune.training.scale_and_clip_grads_` and ``step()``.

    .. warning::
        After ``backward()`` the ``.grad`` of every parameter this optimizer updates is
        ``None``: the gradient was used and freed inside backward. Gradient
        accumulation over several backward passes cannot be combined with it (every
        backward pass updates the parameters). With ``max_norm`` set, a plain
        ``loss.backward()`` raises before anything is updated: only
        :meth:`backward` knows the norm in time. If backward raises, the buckets it
        updated before the error stay updated.

    .. note::
        :meth:`step` and :meth:`zero_grad` can be called in the training loop exactly
        as with a plain optimizer. After a normal backward, :meth:`step` has nothing
        left to do. Call ``zero_grad()`` once per step: it also restarts
        :attr:`grad_norm`.

    Args:
        params (iterable): parameters to optimize, or dicts defining param groups, or
            ``(name, parameter)`` pairs such as ``model.named_parameters()``, exactly
            as ``optimizer_cls`` takes them. With names, the param groups and the
            state dict hold ``param_names`` as ``optimizer_cls``'s would, and error
            messages name the parameters.
        optimizer_cls (Callable[..., Optimizer]): builds an optimizer from a list of
            parameters (and ``optimizer_kwargs``), e.g. ``torch.optim.AdamW``,
            ``bitsandbytes.optim.PagedAdamW8bit`` or
            ``functools.partial(torchtune.config.instantiate, cfg.optimizer)``.
        bucket_cap_mb (float | None): most MiB of gradients (of this rank's shards,
            for DTensor parameters) one bucket holds; a parameter larger than that
            is a bucket of its own. ``0`` updates each parameter on its own, for the
            lowest memory. ``None`` means :data:`DEFAULT_BUCKET_CAP_MB`.
            Default: ``None``
        max_norm (float | None): clip gradients to this global L2 norm in
            :meth:`backward` (also settable later as :attr:`max_norm`). ``None`` or
            ``inf``: no clipping. Default: ``None``
        **optimizer_kwargs: hyperparameters passed to ``optimizer_cls``.

    Raises:
        TypeError: if ``optimizer_cls`` does not return a ``torch.optim.Optimizer``.
        ValueError: if ``params`` is empty, ``bucket_cap_mb`` is not a number
            ``>= 0``, or ``max_norm`` is not a positive number.

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

    state = _wrapped_attribute("state", "The wrapped optimizer's ``state``.")
    param_groups = _wrapped_attribute(
        "param_groups", "The wrapped optimizer's ``param_groups``."
    )
    defaults = _wrapped_attribute("defaults", "The wrapped optimizer's ``defaults``.")
    _optimizer_state_dict_pre_hooks = _wrapped_attribute(_STATE_DICT_HOOKS[0], "")
    _optimizer_state_dict_post_hooks = _wrapped_attribute(_STATE_DICT_HOOKS[1], "")
    _optimizer_load_state_dict_pre_hooks = _wrapped_attribute(_STATE_DICT_HOOKS[2], "")
    _optimizer_load_state_dict_post_hooks = _wrapped_attribute(_STATE_DICT_HOOKS[3], "")

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_cls: Callable[..., Optimizer],
        *,
        bucket_cap_mb: float | None = None,
        max_norm: float | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("OptimizerInBackward got an empty parameter list")
        cap_bytes = _bucket_cap_bytes(bucket_cap_mb)
        if max_norm is not None and not (
            isinstance(max_norm, int | float)
            and not isinstance(max_norm, bool)
            and max_norm > 0
        ):
            raise ValueError(
                f"max_norm must be a positive number or None, got {max_norm!r}"
            )
        optimizer = optimizer_cls(params, **optimizer_kwargs)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                "optimizer_cls must build a torch.optim.Optimizer, but "
                f"{optimizer_cls!r} returned {type(optimizer).__name__}"
            )
        self._optimizer_cls = optimizer_cls
        self._optimizer_kwargs = optimizer_kwargs
        self._wrap(optimizer, bucket_cap_bytes=cap_bytes)
        self.max_norm = max_norm

    def __getattr__(self, name: str) -> Any:
        # Reached only for names this object does not have. Public ones are the
        # wrapped optimizer's (bitsandbytes' is_paged, a schedule-free train(), ...).
        wrapped = self.__dict__.get("_optimizer")
        if name.startswith("_") or wrapped is None:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}"
            )
        return getattr(wrapped, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or copied: it holds autograd "
            "hooks on its parameters. Save state_dict() instead and load it into a "
            "new instance."
        )

    # -- extension points -----------------------------------------------------------
    # A subclass that gets its wrapped optimizer and its bucket optimizers from
    # elsewhere calls _wrap instead of __init__ and overrides _new_bucket_optimizer;
    # _attach and _optimizer_of let it place parameters in buckets and find them, and
    # _param_names may add names for error messages.

    def _wrap(self, optimizer: Optimizer, *, bucket_cap_bytes: int) -> None:
        """Become ``optimizer`` as far as everything but the update goes, and update
        its trainable parameters in backward, in buckets.

        This replaces ``Optimizer.__init__``: ``param_groups``, ``state`` and
        ``defaults`` are ``optimizer``'s and must not be reset; only the step hooks,
        which run around this object's :meth:`step`, are this object's own. Each
        bucket's optimizer comes from :meth:`_new_bucket_optimizer`.

        Args:
            optimizer (Optimizer): the wrapped optimizer, holding every parameter.
            bucket_cap_bytes (int): most gradient bytes a bucket holds (a parameter
                larger than that has a bucket of its own); 0 for one parameter per
                bucket.
        """
        torch._C._log_api_usage_once("python.optimizer")
        self._optimizer = optimizer
        self._bucket_cap_bytes = bucket_cap_bytes
        # The bucket of every parameter this instance updates.
        self._bucket_of: dict[torch.Tensor, _Bucket] = {}
        self._hook_handles: dict[torch.Tensor, RemovableHandle] = {}
        self._hooks_enabled = True
        # The backward pass (autograd graph task) whose end will update the buckets
        # it left unfinished, if one was queued.
        self._flush_task: int | None = None
        # Parameter -> the param group that holds it.
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        # The norm of every gradient used since zero_grad(), by parameter, in the
        # order they arrived; grad_norm combines them in parameter order.
        self._grad_norms: dict[torch.Tensor, list[GradNorm]] = {}
        #: The largest global gradient norm: with a number, :meth:`backward` clips
        #: the gradients to it, exactly as ``clip_grad_norm_`` would, before they
        #: are used. ``None``: no clipping.
        self.max_norm: float | None = None
        # What backward() is doing: None outside it, "measure" in the pass that only
        # measures the gradients, "update" in the pass that updates.
        self._phase: str | None = None
        # Inside backward(): the factor every gradient is multiplied by first, and the
        # clip coefficient of the measuring pass, applied in the updating pass.
        self._grad_scale: torch.Tensor | float | None = None
        self._clip_coef: torch.Tensor | None = None
        #: Whether updates record their gradients' norms for :attr:`grad_norm`. A
        #: training loop that logs only every few steps can turn it off before the
        #: backward passes of the others, to skip one read of every gradient.
        self.record_grad_norm = True
        # Whether a gradient went unrecorded since zero_grad().
        self._grad_norm_missing = False
        self._optimizer_step_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable] = OrderedDict()
        self._patch_step_function()
        self._index_groups()
        for group in self.param_groups:
            self._attach_in_buckets([p for p in group["params"] if p.requires_grad])

    def _new_bucket_optimizer(self, params: list[torch.Tensor]) -> Optimizer:
        """The optimizer that will update the bucket ``params``:
        ``optimizer_cls(params, **optimizer_kwargs)``.

        Its ``state`` is then replaced with the bucket's view of this object's
        ``state``, and its param group's hyperparameters are refreshed from this
        object's before each update. A subclass may return an optimizer built
        elsewhere, after moving any state it holds for ``params`` into ``state``.

        Args:
            params (list[torch.Tensor]): the bucket's parameters, of one param group,
                in its order.

        Returns:
            Optimizer: an optimizer over exactly ``params``.
        """
        return self._optimizer_cls(params, **self._optimizer_kwargs)

    def _attach(self, params: list[torch.Tensor]) -> None:
        """Make this instance the one that updates ``params``, as one bucket, with
        the optimizer :meth:`_new_bucket_optimizer` gives; any other instance that
        updated one of them stops.

        Args:
            params (list[torch.Tensor]): parameters of one param group, in its order.
                Those with ``requires_grad=True`` get a hook (unless hooks were
                removed); the others are updated only by :meth:`step`.
        """
        for param in params:
            previous = _owner_of(param)
            if previous is not None and previous is not self:
                previous._release(param)
            self._detach(param)
        self._new_bucket(params)
        for param in params:
            if (
                self._hooks_enabled
                and param.requires_grad
                and param not in self._hook_handles
            ):
                self._hook_handles[param] = param.register_post_accumulate_grad_hook(
                    self._on_grad_ready
                )
            _OWNERS[param] = weakref.ref(self)

    def _optimizer_of(self, param: torch.Tensor) -> Optimizer | None:
        """The optimizer of ``param``'s bucket, or ``None`` if this instance does
        not update ``param``.

        Args:
            param (torch.Tensor): a parameter.

        Returns:
            Optimizer | None: the bucket's optimizer.
        """
        bucket = self._bucket_of.get(param)
        return None if bucket is None else bucket.optimizer

    def _param_names(self) -> dict[torch.Tensor, str]:
        """Parameter -> its name in ``param_groups``' ``param_names``, where the
        groups have them, for error messages. A subclass that knows other names may
        add them."""
        names = {}
        for group in self.param_groups:
            if "param_names" in group:
                names.update(zip(group["params"], group["param_names"], strict=True))
        return names

    # -- construction helpers ---------------------------------------------------

    def _attach_in_buckets(self, params: list[torch.Tensor]) -> None:
        """Attach ``params`` (of one param group, in its order) in consecutive
        buckets of at most ``bucket_cap_bytes`` gradient bytes each."""
        bucket: list[torch.Tensor] = []
        size = 0
        for param in params:
            nbytes = _local_bytes(param)
            if bucket and size + nbytes > self._bucket_cap_bytes:
                self._attach(bucket)
                bucket, size = [], 0
            bucket.append(param)
            size += nbytes
        if bucket:
            self._attach(bucket)

    def _new_bucket(self, params: list[torch.Tensor]) -> _Bucket:
        """A bucket of ``params`` whose optimizer sees this object's state."""
        inner = self._new_bucket_optimizer(params)
        inner.state = _BucketState(self, params)
        bucket = _Bucket(params, inner)
        for param in params:
            self._bucket_of[param] = bucket
        return bucket

    def _detach(self, param: torch.Tensor) -> None:
        """Take ``param`` out of its bucket, if it has one; the rest of the bucket
        gets an optimizer of its own."""
        bucket = self._bucket_of.pop(param, None)
        if bucket is None:
            return
        rest = [p for p in bucket.params if p is not param]
        if rest:
            self._new_bucket(rest).ready = bucket.ready - {id(param)}

    def _release(self, param: torch.Tensor) -> None:
        """Stop updating ``param``: another instance took it over."""
        handle = self._hook_handles.pop(param, None)
        if handle is not None:
            handle.remove()
        self._detach(param)

    def _index_groups(self) -> None:
        self._group_of = {
            p: group for group in self.param_groups for p in group["params"]
        }

    def _buckets(self) -> list[_Bucket]:
        return list({id(b): b for b in self._bucket_of.values()}.values())

    # -- the update ---------------------------------------------------------------

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        # A None grad means another hook already used it (e.g. a hand-written 0.6.1
        # hook that steps and clears): never update a parameter twice.
        bucket = self._bucket_of.get(param)
        if param.grad is None or bucket is None:
            return
        if self._phase is None and self._clips:
            raise RuntimeError(
                f"This OptimizerInBackward clips gradients (max_norm={self.max_norm}), "
                "so it cannot update inside a plain loss.backward(): the global norm "
                "is not known yet. Call optimizer.backward(loss) instead, or set "
                "optimizer.max_norm = None to train without clipping."
            )
        if self._phase == "measure":
            self._measure(param)
            return
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._update(bucket)
            return
        task = torch._C._current_graph_task_id()
        if task == -1:
            # Not called from autograd (e.g. by hand): there is nothing to wait for.
            self._update(bucket)
        elif task != self._flush_task:
            # Some parameters of the bucket may get no gradient in this backward
            # pass (unused, or frozen since): update the bucket when it ends.
            Variable._execution_engine.queue_callback(self._flush)
            self._flush_task = task

    def _flush(self) -> None:
        """At the end of backward: update the buckets whose gradients did not all
        arrive."""
        self._flush_task = None
        for bucket in self._buckets():
            if bucket.ready:
                self._update(bucket)

    @torch.no_grad()
    def _measure(self, param: torch.Tensor) -> None:
        """In the measuring pass of a clipped :meth:`backward`: scale the gradient,
        record its norm and free it."""
        if self._grad_scale is not None:
            scale_grads_([param.grad], self._grad_scale)
        self._record_norms([param])
        param.grad = None

    @torch.no_grad()
    def _update(self, bucket: _Bucket) -> None:
        """Step ``bucket``'s optimizer on the parameters that hold a gradient, then
        free those gradients.

        Each gradient gets what a plain step does to it after backward, with the
        same operations: it is multiplied by the scale :meth:`backward` was given,
        its norm is recorded, and it is multiplied by the clip coefficient."""
        bucket.ready.clear()
        params = [p for p in bucket.params if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        if self._grad_scale is not None:
            scale_grads_(grads, self._grad_scale)
        if self._clip_coef is not None:
            # The measuring pass recorded the norms.
            scale_grads_(grads, self._clip_coef)
        elif self.record_grad_norm:
            self._record_norms(params)
        else:
            self._grad_norm_missing = True
        inner = bucket.optimizer
        # The outer group is the one schedulers and load_state_dict write to; all of
        # a bucket's parameters are in the same one.
        inner.param_groups[0].update(hyperparameters(self._group_of[params[0]]))
        inner.step()
        for param in params:
            param.grad = None

    def _record_norms(self, params: list[torch.Tensor]) -> None:
        norms = tensor_norms([p.grad for p in params])
        for param, norm in zip(params, norms, strict=True):
            self._grad_norms.setdefault(param, []).append(norm)

    def _clip_coefficient(self, measure: Callable[[], Any]) -> torch.Tensor:
        """Run ``measure``, which records the norms of the gradients about to be
        used, and return the clip coefficient of those norms alone; they are kept
        after any recorded earlier since zero_grad()."""
        earlier, self._grad_norms = self._grad_norms, {}
        measure()
        coef = clip_coefficient(self.max_norm, self._total_norm(self._grad_norms))
        for param, norms in earlier.items():
            self._grad_norms[param] = norms + self._grad_norms.get(param, [])
        return coef

    def _total_norm(self, norms: Mapping[torch.Tensor, list[GradNorm]]) -> torch.Tensor:
        """The global norm of the recorded gradients, combined in parameter order
        as :func:`~torchtune.training.grad_norm` combines them."""
        return total_norm(
            norm
            for group in self.param_groups
            for p in group["params"]
            for norm in norms.get(p, ())
        )

    # -- torch.optim.Optimizer API -------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group through the wrapped optimizer's own ``add_param_group``;
        its trainable parameters are updated in backward from the next backward pass
        on and appear in :meth:`state_dict`.

        Args:
            param_group (dict[str, Any]): ``params`` plus any hyperparameters to
                override the defaults for this group.

        Raises:
            ValueError: as ``torch.optim.Optimizer.add_param_group`` does, e.g. if a
                parameter is already in another group.
        """
        self._optimizer.add_param_group(param_group)
        group = self.param_groups[-1]
        for param in group["params"]:
            self._group_of[param] = group
        self._attach_in_buckets([p for p in group["params"] if p.requires_grad])

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
        due: dict[int, _Bucket] = {}
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param not in self._bucket_of:
                    owner = _owner_of(param)
                    if owner is not None and owner is not self:
                        continue  # another OptimizerInBackward updates it
                    self._attach([param])
                bucket = self._bucket_of[param]
                due[id(bucket)] = bucket
        if not self._clips or self._phase is not None:
            for bucket in due.values():
                self._update(bucket)
            return
        # Clip the gradients present, by their global norm, as clip_grad_norm_ would.
        ours = {id(p) for bucket in due.values() for p in bucket.params}
        params = [
            p
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None and id(p) in ours
        ]
        self._clip_coef = self._clip_coefficient(lambda: self._record_norms(params))
        try:
            for bucket in due.values():
                self._update(bucket)
        finally:
            self._clip_coef = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients as ``torch.optim.Optimizer.zero_grad`` does, and restart
        :attr:`grad_norm` from zero.

        Args:
            set_to_none (bool): set gradients to ``None`` rather than zero them.
                Default: ``True``
        """
        super().zero_grad(set_to_none=set_to_none)
        self._grad_norms = {}
        self._grad_norm_missing = False
        # A backward pass that raised may have left buckets half counted.
        for bucket in self._buckets():
            bucket.ready.clear()

    def backward(
        self,
        loss: torch.Tensor,
        *,
        grad_scale: torch.Tensor | float | None = None,
        before_update_pass: Callable[[], Any] | None = None,
    ) -> None:
        """Backpropagate ``loss`` and update every parameter inside backward, with
        each gradient first multiplied by ``grad_scale`` and, when :attr:`max_norm`
        is set, clipped: the very numbers a plain optimizer computes after
        ``loss.backward()``, ``training.scale_and_clip_grads_(params, grad_scale,
        max_norm)`` and ``step()``.

        Without clipping this is one backward pass. With clipping it is two over the
        same graph: the first measures each gradient and frees it at once, so that
        the global norm is known before any update; the second computes the
        gradients again and updates each bucket with them scaled by
        ``clamp(max_norm / (norm + 1e-6), max=1)``, ``clip_grad_norm_``'s rule. The
        graph is kept between the two, so activations stay alive until the second
        pass frees them, and the backward work doubles. A graph that cannot be run
        twice (its saved tensors freed by a custom hook, as activation offloading
        does) cannot be clipped this way.

        Args:
            loss (torch.Tensor): a scalar to backpropagate.
            grad_scale (torch.Tensor | float | None): the factor every gradient is
                multiplied by before it is measured and used, e.g. ``1 /
                num_tokens`` when ``loss`` is a sum over tokens. ``None``: ``1``.
                Default: ``None``
            before_update_pass (Callable[[], Any] | None): with clipping, called
                between the two passes. FSDP2 frees a unit's gathered parameters
                at the end of each backward and gathers them again when the next
                backward reaches the unit's outputs; parameters used outside the
                unit's forward (e.g. the root's output projection applied to
                intermediate hidden states) must be gathered again by hand:
                ``before_update_pass=model.unshard``. Default: ``None``

        Raises:
            RuntimeError: if called from inside another :meth:`backward`.
        """
        if self._phase is not None:
            raise RuntimeError("OptimizerInBackward.backward() is already running")
        self._grad_scale = grad_scale
        try:
            if not self._clips:
                self._phase = "update"
                loss.backward()
                return
            self._phase = "measure"
            self._clip_coef = self._clip_coefficient(
                lambda: loss.backward(retain_graph=True)
            )
            if before_update_pass is not None:
                before_update_pass()
            self._phase = "update"
            loss.backward()
        finally:
            self._phase = None
            self._grad_scale = None
            self._clip_coef = None

    @property
    def _clips(self) -> bool:
        # clip_grad_norm_ with an infinite max_norm multiplies by 1: nothing to do.
        return self.max_norm is not None and self.max_norm != float("inf")

    @property
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of all gradients this optimizer used since the last
        :meth:`zero_grad` (after ``grad_scale``, before clipping), as a 0-dim tensor
        (``0.`` if there were none): bitwise what
        :func:`~torchtune.training.grad_norm` returns on the same gradients after a
        plain backward, as long as this optimizer's parameters are in the model's
        order. Gradients are measured in their own dtype.

        For DTensor parameters (FSDP2, tensor parallel) reading this property reduces
        the norms across ranks, so it must be read on every rank, like any collective.

        Raises:
            RuntimeError: if some of those gradients were used while
                :attr:`record_grad_norm` was ``False``: the norm would be wrong.
        """
        if self._grad_norm_missing:
            raise RuntimeError(
                "grad_norm is unknown: gradients were used since the last zero_grad() "
                "while record_grad_norm was False. Set optimizer.record_grad_norm = "
                "True before the backward passes of a step whose grad_norm you read."
            )
        return self._total_norm(self._grad_norms)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's own ``state_dict()``: exactly what the plain
        ``optimizer_cls`` instance saves, in its format.

        Returns:
            dict[str, Any]: the state dict.
        """
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load optimizer state through the wrapped optimizer's own
        ``load_state_dict()``, exactly as the plain ``optimizer_cls`` instance loads it.

        Accepts what that class accepts, whether saved from this class or from the
        plain optimizer. A torchtune 0.6.1 in-backward checkpoint (a dict keyed by
        parameter name) is refused: convert it first with
        :func:`convert_legacy_optim_in_bwd_state_dict`.

        Args:
            state_dict (Mapping[str, Any]): the state to load.

        Raises:
            ValueError: if the state dict is not in the torch format, or its
                parameters do not match this optimizer's: the message names what is
                missing and what is extra. This is checked before anything is
                loaded, and nothing is dropped silently.
        """
        self._check_matches(state_dict)
        self._optimizer.load_state_dict(state_dict)
        self._index_groups()

    # -- state dict helpers -----------------------------------------------------------

    def _check_matches(self, state_dict: Mapping[str, Any]) -> None:
        missing_keys = {"state", "param_groups"} - set(state_dict)
        if missing_keys:
            raise ValueError(
                f"optimizer state dict has no {sorted(missing_keys)} entry; expected "
                "the torch format {'state': ..., 'param_groups': [...]}, got keys "
                f"{list(state_dict)[:5]}. A torchtune 0.6.1 in-backward checkpoint "
                "(keyed by parameter name) loads after "
                "training.convert_legacy_optim_in_bwd_state_dict(state_dict, "
                "model.named_parameters())."
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


def build_optimizer(
    params: Iterable[torch.Tensor],
    make_optimizer: Callable[[list[torch.Tensor]], Optimizer],
    *,
    in_backward: bool = False,
    bucket_cap_mb: float | None = None,
    max_norm: float | None = None,
) -> Optimizer:
    """The optimizer a recipe trains with: ``make_optimizer(params)``, or with
    ``in_backward`` an :class:`OptimizerInBackward` that runs the same class inside
    backward.

    Give it every parameter of the model, frozen ones too, as torchtune 0.6.1 did:
    a frozen parameter gets no state (and no in-backward hook), and the state dicts
    of either mode, and 0.6.1's, then hold the same parameters, so each loads into
    the other.

    Args:
        params (Iterable[torch.Tensor]): the parameters, in model order.
        make_optimizer (Callable[[list[torch.Tensor]], Optimizer]): builds the plain
            optimizer over a list of parameters, e.g.
            ``functools.partial(config.instantiate, cfg.optimizer)``.
        in_backward (bool): update inside backward. Default: ``False``
        bucket_cap_mb (float | None): MiB of gradients per in-backward optimizer
            call; ``None``: the default.
        max_norm (float | None): with ``in_backward``, the global gradient norm
            :meth:`OptimizerInBackward.backward` clips to; a plain optimizer's loop
            clips after backward itself. Default: ``None``

    Returns:
        Optimizer: the optimizer.

    Example:
        >>> optimizer = build_optimizer(
        ...     model.parameters(), torch.optim.AdamW, in_backward=True
        ... )
        >>> type(optimizer).__name__
        'OptimizerInBackward'
    """
    params = list(params)
    if in_backward:
        optimizer = OptimizerInBackward(
            params, make_optimizer, bucket_cap_mb=bucket_cap_mb, max_norm=max_norm
        )
    else:
        optimizer = make_optimizer(params)
    log_rank_zero(_log, f"Optimizer is initialized: {type(optimizer).__name__}.")
    return optimizer


# Names importable from here that live in the 0.6.1 compatibility modules: the
# deprecated 0.6.1 API (defined here in 0.6.1) and the converter of its checkpoints.
# They are imported on first use: those modules import this one, so importing them at
# the top would be a cycle.
_COMPAT_NAMES = {
    "OptimizerInBackwardWrapper": "optim_in_bwd_deprecated",
    "create_optim_in_bwd_wrapper": "optim_in_bwd_deprecated",
    "register_optim_in_bwd_hooks": "optim_in_bwd_deprecated",
    "convert_legacy_optim_in_bwd_state_dict": "optim_in_bwd_legacy_state_dict",
}


def __getattr__(name: str) -> Any:
    if name in _COMPAT_NAMES:
        module = importlib.import_module(f"torchtune.training.{_COMPAT_NAMES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ACWrapPolicyType",
    "DEFAULT_LOG_MESSAGE",
    "OptimizerInBackward",
    "build_optimizer",
    "cleanup_before_training",
    "get_memory_stats",
    "log_memory_stats",
    "set_activation_checkpointing",
]
