"""Memory utilities: activation checkpointing and memory statistics.

torchtune 0.6.1's deprecated optimizer-in-backward functions
(:mod:`torchtune.training.optim_in_bwd_deprecated`) are importable from here too, as
in 0.6.1; :class:`~torchtune.training.OptimizerInBackward` and
:func:`~torchtune.training.build_optimizer` live in
:mod:`torchtune.training.optimizer_in_backward`."""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

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
    "DEFAULT_LOG_MESSAGE",
    "cleanup_before_training",
    "get_memory_stats",
    "log_memory_stats",
    "set_activation_checkpointing",
    *_DEPRECATED,
]
