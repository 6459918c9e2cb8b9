"""Tests for torchtune/training/memory.py: memory statistics and activation
checkpointing. ``OptimizerInBackward`` is tested in test_optimizer_in_backward.py.

Recomputing a checkpointed forward in backward runs the same kernels on the same
values, so its gradients must be bitwise those of the plain backward.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from torch import nn

from tests.helpers import BITWISE, loss_fn, make_model
from torchtune.training.memory import (
    cleanup_before_training,
    get_memory_stats,
    log_memory_stats,
    set_activation_checkpointing,
)

# -- memory utilities on CPU ---------------------------------------------------------


def current_rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024**3


linux_only = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset is Linux-only"
)


@linux_only
def test_get_memory_stats_on_cpu_reports_and_resets_peak_rss() -> None:
    get_memory_stats(torch.device("cpu"), reset_stats=True)
    baseline = current_rss_gib()
    block = torch.ones(64 * 1024**2)  # 0.25 GiB, touched
    del block
    stats = get_memory_stats(torch.device("cpu"), reset_stats=True)
    assert set(stats) == {
        "peak_memory_active",
        "peak_memory_alloc",
        "peak_memory_reserved",
    }
    assert stats["peak_memory_alloc"] - baseline >= 0.24
    after_reset = get_memory_stats(torch.device("cpu"))
    assert after_reset["peak_memory_alloc"] < stats["peak_memory_alloc"] - 0.2


def test_cleanup_before_training_runs_on_cpu() -> None:
    cleanup_before_training()  # 0.6.1 called torch.cpu.empty_cache, which is missing
    stats = get_memory_stats(torch.device("cpu"), reset_stats=False)
    assert stats["peak_memory_alloc"] > 0


def test_log_memory_stats_logs_every_value() -> None:
    with mock.patch("torchtune.training.memory._log") as log:
        log_memory_stats(
            {
                "peak_memory_active": 1.0,
                "peak_memory_alloc": 2.0,
                "peak_memory_reserved": 3.0,
            },
            message="after init:",
        )
    text = log.info.call_args.args[0]
    assert text.startswith("after init:")
    assert all(f"{v:.2f} GiB" in text for v in (1.0, 2.0, 3.0))


def test_set_activation_checkpointing_wraps_the_given_module_types() -> None:
    reference, model = make_model(), make_model()
    set_activation_checkpointing(model, {nn.Linear})
    wrapped = [m for m in model.modules() if type(m).__name__ == "CheckpointWrapper"]
    assert len(wrapped) == 3
    loss_fn(reference, 0).backward()
    loss_fn(model, 0).backward()
    # Recomputing the forward in backward gives the same gradients.
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, **BITWISE)
