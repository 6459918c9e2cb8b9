"""Memory: optimizer-in-backward, activation checkpointing and memory statistics.

:class:`OptimizerInBackward` updates each parameter inside ``backward()``, a bucket of
them at a time, as soon as its gradients are ready, and frees them: the gradients'
bytes of peak memory saved (how it works, what it saves and costs:
``docs/source/optimizer_in_backward.rst``). :func:`build_optimizer` builds it or the
plain optimizer a recipe asks for. torchtune 0.6.1's deprecated optimizer-in-backward
functions (:mod:`torchtune.training.optim_in_bwd_deprecated`) are importable from here
too, as in 0.6.1.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
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
_STAT_KEYS = ("peak_memory_active", "peak_memory_alloc", "peak_memory_reserved")


def _accelerator_namespace(device_type: str) -> Any | None:
    """The ``torch.<device_type>`` module if it has a caching allocator to query."""
    namespace = getattr(torch, device_type, None)
    if device_type == "cpu" or not hasattr(namespace, "max_memory_allocated"):
        return None
    return namespace


def _cpu_peak_rss_bytes() -> int:
    """Peak resident set size of this process, in bytes.

    Reads ``VmHWM`` from ``/proc/self/status`` (Linux), which
    :func:`_reset_cpu_peak_rss` can reset. Elsewhere falls back to
    ``getrusage(RUSAGE_SELF).ru_maxrss``, the peak since the process started.
    """
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource  # Unix only, hence imported here

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in bytes on macOS and in KiB on Linux.
    return peak if sys.platform == "darwin" else peak * 1024


def _reset_cpu_peak_rss() -> None:
    """Reset the process's peak RSS to its current RSS, where the OS can.

    Linux (4.0+) resets ``VmHWM`` when ``5`` is written to ``/proc/self/clear_refs``.
    """
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


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
        return dict.fromkeys(_STAT_KEYS, peak_rss)
    active = namespace.memory_stats(device).get("active_bytes.all.peak", 0)
    stats = {
        "peak_memory_active": active / _GIB,
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
# Plain or in backward
# ---------------------------------------------------------------------------

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


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters of a param group: every key but ``params`` and
    ``param_names``.

    Args:
        group (Mapping[str, Any]): a param group, as in ``optimizer.param_groups``.

    Returns:
        dict[str, Any]: a new dict of its other entries (``lr``, ``betas``, ...).
    """
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _wrapped_attribute(name: str) -> property:
    """An attribute that is the wrapped optimizer's own, read and written through."""

    def fget(self: OptimizerInBackward) -> Any:
        return getattr(self._optimizer, name)

    def fset(self: OptimizerInBackward, value: Any) -> None:
        setattr(self._optimizer, name, value)

    return property(fget, fset, doc=f"The wrapped optimizer's ``{name}``.")


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
        return iter([p for p in self._params.values() if p in self._owner.state])

    def __len__(self) -> int:
        return sum(1 for p in self._params.values() if p in self._owner.state)

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


# Parameter -> a weak reference to the OptimizerInBackward that updates it in backward.
# A new instance over a parameter takes it over from the one before, so that no
# parameter is ever updated by two of them. Weak both ways: the map keeps neither a
# parameter nor an optimizer alive.
_UPDATED_BY: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _updater(param: torch.Tensor) -> OptimizerInBackward | None:
    """The live :class:`OptimizerInBackward` that updates ``param``, if any."""
    ref = _UPDATED_BY.get(param)
    return None if ref is None else ref()


def _refuse_other_steps(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """A step pre-hook of every optimizer: refuse a step of an optimizer that is not
    the one updating its parameters in backward, for it would see no gradient (the
    update freed them) and silently do nothing. An OptimizerInBackward's own
    step() leaves alone the parameters another one took over."""
    if isinstance(optimizer, OptimizerInBackward) or not _UPDATED_BY:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = _updater(param)
            # A gradient set by hand (torch.distributed.checkpoint's zeros, which
            # create state) is this optimizer's to step.
            if (
                owner is None
                or param.grad is not None
                or owner._steps(param, optimizer)
            ):
                continue
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() was called on parameters that an "
                f"OptimizerInBackward ({type(owner._optimizer).__name__}) updates "
                "inside backward, which frees their gradients: this optimizer would "
                "see none and change nothing. Step only the OptimizerInBackward (its "
                "step() and zero_grad() keep a plain loop working), or build this "
                "optimizer over other parameters."
            )


# The handle of _refuse_other_steps, once the first OptimizerInBackward is built.
_REFUSE_OTHER_STEPS: list[RemovableHandle] = []


def _check_max_norm(max_norm: object) -> None:
    if max_norm is not None and not (
        isinstance(max_norm, int | float)
        and not isinstance(max_norm, bool)
        and max_norm > 0
    ):
        raise ValueError(
            f"max_norm must be a positive number or None, got {max_norm!r}"
        )


def _let_compiled_backward_run_twice() -> None:
    """Make torch.compile's graphs safe to backpropagate twice, as a clipped
    :meth:`OptimizerInBackward.backward` does.

    AOTAutograd lets a compiled backward reuse ("donate") the memory of the tensors
    its forward saved, which ``retain_graph=True`` forbids; it compiles a backward
    ahead of time, with donation, for dynamic shapes (a batch of another length).
    Graphs compiled before are dropped, to be compiled again without donation.
    """
    if torch._functorch.config.donated_buffer:
        torch._functorch.config.donated_buffer = False
        torch._dynamo.reset()
        _log.info(
            "OptimizerInBackward clips gradients: turned off torch.compile's donated "
            "buffers (torch._functorch.config.donated_buffer) and dropped the graphs"
            " compiled so far (torch._dynamo.reset()), so that the measuring pass "
            "can run a compiled backward before the updating pass runs it again."
        )


def _local_bytes(param: torch.Tensor) -> int:
    """Bytes of ``param``'s gradient on this rank (its local shard for a DTensor)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


class OptimizerInBackward(Optimizer):
    r"""An optimizer that updates each parameter inside ``backward()`` as soon as its
    gradient is ready and frees it, saving about the gradients' bytes of peak memory.

    It *is* ``optimizer_cls(params, **optimizer_kwargs)`` but for the update: that
    instance's ``param_groups``, ``state``, ``state_dict()`` and ``load_state_dict()``
    are this object's, so plain and in-backward checkpoints are the same thing and LR
    schedulers, ``torch.distributed.checkpoint`` and FSDP2 work on it unchanged. Each
    bucket (consecutive trainable parameters of a group, up to ``bucket_cap_mb`` MiB of
    gradients) is updated by an ``optimizer_cls`` of its own, on the bucket's entries of
    ``state``, with the group's current hyperparameters: the plain optimizer's numbers
    for any optimizer whose update of a parameter reads only its gradient and state.
    :meth:`backward` also scales and clips the gradients, bitwise as
    :func:`~torchtune.training.scale_and_clip_grads_` does after a plain backward.

    .. warning::
        ``.grad`` is ``None`` after backward: no gradient accumulation, nothing for
        ``clip_grad_norm_`` to read (use ``max_norm`` and :attr:`grad_norm`), and
        another optimizer over these parameters refuses to step. With
        ``max_norm``, call :meth:`backward` (``loss.backward()`` raises). No loss
        scaling (``torch.amp.GradScaler``): train in bf16. A second instance over
        parameters this one updates takes them over (with a warning): this one
        then no longer updates them, though they stay in its ``param_groups`` and
        ``state_dict()``.

    Args:
        params (Iterable[Any]): parameters, group dicts or ``(name, parameter)`` pairs.
        optimizer_cls (Callable[..., Optimizer]): builds the optimizer from a list of
            parameters and ``optimizer_kwargs``, e.g. ``torch.optim.AdamW``.
        bucket_cap_mb (float | None): most MiB of gradients (this rank's shards) per
            bucket, ``0`` for one parameter each. Default: :data:`DEFAULT_BUCKET_CAP_MB`
        max_norm (float | None): the global norm :meth:`backward` clips gradients to;
            ``None`` or ``inf``: no clipping. Default: ``None``
        **optimizer_kwargs: hyperparameters passed to ``optimizer_cls``.

    Raises:
        TypeError: if ``optimizer_cls`` does not build a ``torch.optim.Optimizer``.
        ValueError: if ``params`` is empty, ``bucket_cap_mb`` or ``max_norm`` invalid.

    Example:
        >>> optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
        >>> for batch in dataloader:
        ...     optimizer.backward(loss_fn(model(batch["tokens"]), batch["labels"]))
        ...     optimizer.step()  # nothing left to do: the loop stays the plain one
        ...     optimizer.zero_grad(set_to_none=True)
    """

    state = _wrapped_attribute("state")
    param_groups = _wrapped_attribute("param_groups")
    defaults = _wrapped_attribute("defaults")
    # torch's hooks around state_dict() and load_state_dict(): the wrapped optimizer's
    # own methods run them.
    _optimizer_state_dict_pre_hooks = _wrapped_attribute(
        "_optimizer_state_dict_pre_hooks"
    )
    _optimizer_state_dict_post_hooks = _wrapped_attribute(
        "_optimizer_state_dict_post_hooks"
    )
    _optimizer_load_state_dict_pre_hooks = _wrapped_attribute(
        "_optimizer_load_state_dict_pre_hooks"
    )
    _optimizer_load_state_dict_post_hooks = _wrapped_attribute(
        "_optimizer_load_state_dict_post_hooks"
    )

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
        self._bucket_cap_bytes = _bucket_cap_bytes(bucket_cap_mb)
        _check_max_norm(max_norm)
        optimizer = optimizer_cls(params, **optimizer_kwargs)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                "optimizer_cls must build a torch.optim.Optimizer, but "
                f"{optimizer_cls!r} returned {type(optimizer).__name__}"
            )
        # Not Optimizer.__init__: param_groups, state and defaults are the wrapped
        # optimizer's; only the step hooks, run around this object's step(), are ours.
        torch._C._log_api_usage_once("python.optimizer")
        self._optimizer = optimizer
        self._optimizer_cls = optimizer_cls
        self._optimizer_kwargs = optimizer_kwargs
        self.max_norm = max_norm
        # Whether a loss.backward() that updated has been announced (once).
        self._told_grads_are_freed = False
        # The buckets in the order they were made, and the one of each parameter.
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[torch.Tensor, _Bucket] = {}
        # Each trainable parameter's post-accumulate-grad hook, to remove it when a
        # newer instance takes the parameter over.
        self._hooks: dict[torch.Tensor, RemovableHandle] = {}
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        # The backward pass (autograd graph task) whose end updates the buckets it
        # left unfinished, if one was queued.
        self._flush_task: int | None = None
        # The norm of each gradient of the last backward pass (of the last step()
        # that found gradients set by hand), and that pass's autograd graph task:
        # the first norm a new pass records replaces the last pass's, so they never
        # pile up, whichever zero_grad() a loop calls or does not call.
        self._grad_norms: dict[torch.Tensor, GradNorm] = {}
        self._norms_task: int | None = None
        # Inside backward(): None outside it, "measure" in the pass that only measures
        # the gradients, "update" in the pass that updates; the factor every gradient
        # is multiplied by first, and the clip coefficient of the measuring pass.
        self._phase: str | None = None
        self._grad_scale: torch.Tensor | float | None = None
        self._clip_coef: torch.Tensor | None = None
        self._optimizer_step_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable] = OrderedDict()
        self._patch_step_function()
        self._index_groups()
        for group in self.param_groups:
            self._attach_in_buckets([p for p in group["params"] if p.requires_grad])
        self._take_over(list(self._hooks))
        if not _REFUSE_OTHER_STEPS:
            hook = register_optimizer_step_pre_hook(_refuse_other_steps)
            _REFUSE_OTHER_STEPS.append(hook)

    @property
    def max_norm(self) -> float | None:
        """The largest global gradient norm :meth:`backward` clips to; ``None`` or
        ``inf``: no clipping. Setting it turns off torch.compile's donated buffers
        when it clips, for graphs compiled from then on."""
        return self._max_norm

    @max_norm.setter
    def max_norm(self, max_norm: float | None) -> None:
        _check_max_norm(max_norm)
        self._max_norm = max_norm
        if self._clips:
            _let_compiled_backward_run_twice()

    def _steps(self, param: torch.Tensor, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` is the one that updates ``param``'s bucket."""
        bucket = self._bucket_of.get(param)
        return bucket is not None and bucket.optimizer is optimizer

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

    # -- buckets ---------------------------------------------------------------------

    def _attach_in_buckets(self, params: list[torch.Tensor]) -> None:
        """Update ``params`` (of one param group, in its order) in consecutive
        buckets of at most the cap's gradient bytes each."""
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

    def _attach(self, params: list[torch.Tensor]) -> None:
        """Update ``params`` (of one param group, in its order) as one bucket, by an
        ``optimizer_cls`` instance that sees their entries of this object's state."""
        inner = self._optimizer_cls(params, **self._optimizer_kwargs)
        inner.state = _BucketState(self, params)
        bucket = _Bucket(params, inner)
        self._buckets.append(bucket)
        for param in params:
            self._bucket_of[param] = bucket
            if param.requires_grad:
                hook = param.register_post_accumulate_grad_hook(self._on_grad_ready)
                self._hooks[param] = hook

    def _take_over(self, params: list[torch.Tensor]) -> None:
        """Become the one instance that updates ``params`` in backward: any earlier
        one stops updating those it held, so no parameter is updated twice."""
        taken: dict[OptimizerInBackward, int] = {}
        for param in params:
            previous = _updater(param)
            if previous is not None and previous is not self:
                previous._release(param)
                taken[previous] = taken.get(previous, 0) + 1
            _UPDATED_BY[param] = weakref.ref(self)
        for previous, count in taken.items():
            _log.warning(
                f"A new OptimizerInBackward ({type(self._optimizer).__name__}) took "
                f"over {count} parameters that an earlier one "
                f"({type(previous._optimizer).__name__}) updated in backward. The "
                "earlier one no longer updates them, but they stay in its param_groups"
                " and state_dict(), with the state they had then. Build one "
                "OptimizerInBackward per set of parameters, and drop the earlier one."
            )

    def _release(self, param: torch.Tensor) -> None:
        """Stop updating ``param``, which a newer instance has taken over: remove its
        hook and take it out of its bucket, whose optimizer would step it otherwise."""
        hook = self._hooks.pop(param, None)  # none if it was frozen when attached
        if hook is not None:
            hook.remove()
        bucket = self._bucket_of.pop(param)
        bucket.ready.discard(id(param))
        bucket.params = [p for p in bucket.params if p is not param]
        # An emptied bucket is never stepped again: its optimizer is left as it was
        # (the deprecated API's is the user's own per-parameter optimizer).
        if bucket.params:
            bucket.optimizer.param_groups[0]["params"] = list(bucket.params)
        else:
            self._buckets.remove(bucket)

    def _index_groups(self) -> None:
        # Parameter -> the group that holds it: a scan of the groups in every hook
        # would be quadratic in the number of parameters.
        self._group_of = {
            p: group for group in self.param_groups for p in group["params"]
        }

    # -- the update ------------------------------------------------------------------

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        # A None grad means another hook already used it (e.g. a hand-written 0.6.1
        # hook that steps and clears): never update a parameter twice.
        if param.grad is None:
            return
        if self._phase is None and self._clips:
            raise RuntimeError(
                f"This OptimizerInBackward clips gradients (max_norm={self.max_norm}), "
                "so it cannot update inside a plain loss.backward(): the global norm "
                "is not known yet. Call optimizer.backward(loss) instead, or set "
                "optimizer.max_norm = None to train without clipping."
            )
        if self._phase is None and not self._told_grads_are_freed:
            self._told_grads_are_freed = True
            _log.warning(
                "OptimizerInBackward updates parameters inside loss.backward() and "
                "frees their gradients: .grad is None after it, so code that reads "
                "gradients after backward sees none (torch.nn.utils.clip_grad_norm_ "
                "returns 0 and clips nothing). Read optimizer.grad_norm for the norm, "
                "and to clip set max_norm and call optimizer.backward(loss)."
            )
        if self._phase == "measure":
            # The updating pass computes the gradient again: scale it, record its
            # norm and free it.
            if self._grad_scale is not None:
                scale_grads_([param.grad], self._grad_scale)
            self._record_norms([param])
            param.grad = None
            return
        bucket = self._bucket_of[param]
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
        for bucket in self._buckets:
            if bucket.ready:
                self._update(bucket)

    @torch.no_grad()
    def _update(self, bucket: _Bucket) -> None:
        """Step ``bucket``'s optimizer on its parameters that hold a gradient, then
        free those gradients. Each gradient first gets what a plain step does to it
        after backward, with the same operations: the scale, the norm, the clip."""
        bucket.ready.clear()
        params = [p for p in bucket.params if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        if self._grad_scale is not None:
            scale_grads_(grads, self._grad_scale)
        if self._clip_coef is None:
            self._record_norms(params)
        else:  # the measuring pass recorded the norms
            scale_grads_(grads, self._clip_coef)
        inner = bucket.optimizer
        # The outer group is the one schedulers and load_state_dict write to; all of
        # a bucket's parameters are in the same one.
        inner.param_groups[0].update(hyperparameters(self._group_of[params[0]]))
        inner.step()
        for param in params:
            param.grad = None

    def _record_norms(self, params: list[torch.Tensor]) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._norms_task:
            # The first gradients of a new backward pass.
            self._grad_norms = {}
            self._norms_task = task
        norms = tensor_norms([p.grad for p in params])
        self._grad_norms.update(zip(params, norms, strict=True))

    def _clip_coefficient(
        self, measure: Callable[[], Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``measure``, which records the norms of the gradients about to be
        used, and return their global norm and its clip coefficient."""
        self._grad_norms = {}
        measure()
        norm = self._total_norm(self._grad_norms)
        return norm, clip_coefficient(self.max_norm, norm)

    def _finite(self, value: torch.Tensor, *, on_every_rank: bool) -> bool:
        """Whether ``value`` is finite; ``on_every_rank`` for a value that differs
        between ranks (a loss): a sharded (DTensor) model's ranks must all update,
        or none. A global norm is the same on every rank already."""
        finite = torch.isfinite(value.detach()).to(torch.int32)
        sharded = any(isinstance(p, DTensor) for p in self._group_of)
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        if on_every_rank and sharded and distributed:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite)

    def _total_norm(self, norms: Mapping[torch.Tensor, GradNorm]) -> torch.Tensor:
        # In parameter order, as a plain step combines them.
        return total_norm(
            norms[p]
            for group in self.param_groups
            for p in group["params"]
            if p in norms
        )

    @property
    def _clips(self) -> bool:
        # clip_grad_norm_ with an infinite max_norm multiplies by 1: nothing to do.
        return self.max_norm is not None and self.max_norm != float("inf")

    # -- torch.optim.Optimizer API ---------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group through the wrapped optimizer's own ``add_param_group``;
        its trainable parameters are updated in backward from the next backward pass.

        Args:
            param_group (dict[str, Any]): ``params`` plus any hyperparameters to
                override the defaults for this group.
        """
        self._optimizer.add_param_group(param_group)
        self._index_groups()
        trainable = [p for p in self.param_groups[-1]["params"] if p.requires_grad]
        self._attach_in_buckets(trainable)
        self._take_over(trainable)

    # torch.amp.GradScaler.step() then passes itself to step(), which refuses it.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: None = None, *, grad_scaler: Any = None
    ) -> None:
        """Update every parameter that still holds a gradient, as the plain optimizer
        would, and set its ``.grad`` to ``None``; after a backward pass there is none
        left. Gradients are present when set by hand (e.g. the zero gradients with
        ``lr=0`` that ``torch.distributed.checkpoint`` steps to create state) or for a
        parameter frozen at construction, which is updated in backward from then on.

        The step hooks (``register_step_pre_hook`` and ``register_step_post_hook``)
        run around this call, as on any optimizer, so after a backward pass a
        pre-hook sees the parameters already updated: the update ran in backward.

        Args:
            closure (None): not supported; must be ``None``.
            grad_scaler (Any): what ``torch.amp.GradScaler.step`` passes; refused.

        Raises:
            NotImplementedError: if a closure is given: its backward pass would
                already update the parameters.
            RuntimeError: if called by ``torch.amp.GradScaler.step``: loss scaling
                needs every gradient checked for infs before any update.
        """
        if closure is not None:
            raise NotImplementedError(
                "OptimizerInBackward.step() does not take a closure: the closure's "
                "backward pass would already update the parameters. Call step() "
                "without arguments."
            )
        # GradScaler passes itself, or (as it plans to) sets found_inf first.
        if grad_scaler is not None or "found_inf" in self.__dict__:
            raise RuntimeError(
                "OptimizerInBackward does not support loss scaling "
                "(torch.amp.GradScaler): it updates each parameter inside backward, "
                "before the scaler can unscale the gradients and skip a step whose "
                "gradients overflowed, so this backward applied scaled gradients. "
                "Train in bf16 (dtype: bf16, or torch.autocast with "
                "dtype=torch.bfloat16), which needs no loss scaling, or use the "
                "plain optimizer (optimizer_in_bwd: False) with the scaler."
            )
        # Not the parameters a newer instance took over: that one updates them.
        params = [
            p
            for g in self.param_groups
            for p in g["params"]
            if p.grad is not None and _updater(p) in (None, self)
        ]
        for param in params:
            if param not in self._bucket_of:
                self._attach([param])
                self._take_over([param])
        if not params:  # after backward: nothing left to do
            return
        due = {id(b): b for b in map(self._bucket_of.__getitem__, params)}
        # A step of its own: grad_norm is that of these gradients.
        self._grad_norms, self._norms_task = {}, None
        # Clip the gradients present by their global norm, as clip_grad_norm_ would.
        clips_here = self._clips and self._phase is None
        if clips_here:
            _, self._clip_coef = self._clip_coefficient(
                lambda: self._record_norms(params)
            )
        try:
            for bucket in due.values():
                self._update(bucket)
        finally:
            if clips_here:
                self._clip_coef = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients as ``torch.optim.Optimizer.zero_grad`` does (after a
        backward pass there are none left), and :attr:`grad_norm` to zero.

        Args:
            set_to_none (bool): set gradients to ``None`` rather than zero them.
                Default: ``True``
        """
        super().zero_grad(set_to_none=set_to_none)
        self._grad_norms, self._norms_task = {}, None
        # A backward pass that raised may have left buckets half counted.
        for bucket in self._buckets:
            bucket.ready.clear()

    def backward(
        self,
        loss: torch.Tensor,
        *,
        grad_scale: torch.Tensor | float | None = None,
        before_update_pass: Callable[[], Any] | None = None,
    ) -> None:
        """Backpropagate ``loss`` and update every parameter inside backward, with each
        gradient first multiplied by ``grad_scale`` and, when :attr:`max_norm` is set,
        clipped: the numbers a plain optimizer computes after ``loss.backward()``,
        ``training.scale_and_clip_grads_(params, grad_scale, max_norm)`` and ``step()``.

        With clipping this is two backward passes over one graph: the first measures
        each gradient and frees it, so the global norm is known before any update; the
        second computes the gradients again and updates with them scaled by
        ``clamp(max_norm / (norm + 1e-6), max=1)``, ``clip_grad_norm_``'s rule.

        Args:
            loss (torch.Tensor): a scalar to backpropagate.
            grad_scale (torch.Tensor | float | None): the factor every gradient is
                multiplied by first, e.g. ``1 / num_tokens`` for a summed loss.
                Default: ``None``
            before_update_pass (Callable[[], Any] | None): with clipping, called
                between the two passes. FSDP2 gathers a unit's parameters again only
                when backward reaches the unit's outputs, so parameters used outside
                their unit's forward need ``before_update_pass=model.unshard``.
                Default: ``None``

        A non-finite ``loss`` (on any rank), or with clipping a non-finite measured
        norm, updates nothing: the pass only measures, so :attr:`grad_norm` reads
        non-finite, for the caller to stop before anything is saved. Without
        clipping, a finite loss whose gradients overflow is seen only as each
        bucket updates: :attr:`grad_norm` reads non-finite after the update.

        Raises:
            RuntimeError: if called from inside another :meth:`backward`.
        """
        if self._phase is not None:
            raise RuntimeError("OptimizerInBackward.backward() is already running")
        if loss.numel() != 1:
            # torch's words for loss.backward() of a non-scalar.
            raise RuntimeError(
                "grad can be implicitly created only for scalar outputs: "
                f"OptimizerInBackward.backward() got a loss of shape {tuple(loss.shape)}"
            )
        self._grad_scale = grad_scale
        try:
            if not self._finite(loss, on_every_rank=True):
                self._phase = "measure"
                loss.backward()
                return
            if self._clips:
                self._phase = "measure"
                norm, self._clip_coef = self._clip_coefficient(
                    lambda: loss.backward(retain_graph=True)
                )
                if not self._finite(norm, on_every_rank=False):
                    return
                if before_update_pass is not None:
                    before_update_pass()
            self._phase = "update"
            loss.backward()
        finally:
            self._phase = self._grad_scale = self._clip_coef = None

    @property
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients of the last backward pass (or of the last
        :meth:`step` that found gradients set by hand) since :meth:`zero_grad`, after
        ``grad_scale``, before clipping: a 0-dim tensor (``0.`` if none),
        bitwise what :func:`~torchtune.training.scale_and_clip_grads_` returns after a
        plain backward when the parameters are in the model's order. For DTensor
        parameters reading it is a collective: read it on every rank."""
        return self._total_norm(self._grad_norms)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's own ``state_dict()``, in its class's format.

        Returns:
            dict[str, Any]: the state dict.
        """
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load through the wrapped optimizer's own ``load_state_dict()``: what the
        plain ``optimizer_cls`` accepts, saved from this class or from the plain one.

        Args:
            state_dict (Mapping[str, Any]): the state to load.

        Raises:
            ValueError: if it is not in the torch format (e.g. a torchtune 0.6.1
                in-backward checkpoint: convert it with
                :func:`~torchtune.training.optim_in_bwd_legacy_state_dict.convert_legacy_optim_in_bwd_state_dict`),
                or its groups or parameters do not match this optimizer's.
        """
        if not {"state", "param_groups"} <= set(state_dict):
            raise ValueError(
                "optimizer state dict has no 'state' and 'param_groups' entries; got "
                f"keys {list(state_dict)[:5]}. A torchtune 0.6.1 in-backward checkpoint "
                "(keyed by parameter name) loads after "
                "torchtune.training.optim_in_bwd_legacy_state_dict."
                "convert_legacy_optim_in_bwd_state_dict(state_dict, "
                "model.named_parameters())."
            )
        # torch checks the counts of groups and of their parameters, not which ids
        # hold state nor param_names: a mismatch there would load silently.
        saved = state_dict["param_groups"]
        ids = {i for group in saved for i in group["params"]}
        unknown = [i for i in state_dict["state"] if i not in ids]
        if unknown:
            raise ValueError(
                f"optimizer state dict has state for ids {unknown} in no param group"
            )
        for ours, theirs in zip(self.param_groups, saved, strict=False):
            names = [
                list(g["param_names"]) for g in (ours, theirs) if "param_names" in g
            ]
            if len(names) == 2 and names[0] != names[1]:
                raise ValueError(
                    f"optimizer state dict holds parameters {names[1]}, this "
                    f"optimizer {names[0]}"
                )
        self._optimizer.load_state_dict(state_dict)
        self._index_groups()


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


# torchtune 0.6.1's optimizer-in-backward functions, which 0.6.1 code imports from
# this module; imported on first use, so that this module imports no optimizer.
_DEPRECATED = (
    "OptimizerInBackwardWrapper",
    "create_optim_in_bwd_wrapper",
    "register_optim_in_bwd_hooks",
)


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        from torchtune.training import optim_in_bwd_deprecated

        return getattr(optim_in_bwd_deprecated, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ACWrapPolicyType",
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_LOG_MESSAGE",
    "OptimizerInBackward",
    "build_optimizer",
    "cleanup_before_training",
    "get_memory_stats",
    "hyperparameters",
    "is_valid_bucket_cap",
    "log_memory_stats",
    "set_activation_checkpointing",
    *_DEPRECATED,
]
