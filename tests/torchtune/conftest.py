"""Fixtures shared by the torchtune unit tests."""

from __future__ import annotations

import pytest

from tests.torchtune.distributed_launcher import DistributedRun, run_distributed


@pytest.fixture(scope="session")
def optimizer_in_backward_distributed_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> DistributedRun:
    """All 2-process gloo scenarios of
    ``tests/torchtune/training/optimizer_in_backward_scenarios.py``, run once per
    session; tests assert on their per-scenario reports. A hung collective fails
    after 60 s (gloo timeout), the whole run after 600 s. The ranks fork from the
    preloaded server, not from this process: forked from a pytest process that has
    run recipes in-process (torch.compile's worker pools included), they could hang
    in their own compiles."""
    return run_distributed(
        "tests.torchtune.training.optimizer_in_backward_scenarios",
        "main",
        tmp_path_factory.mktemp("optimizer_in_backward_distributed"),
        world_size=2,
        timeout_s=600,
        start="preloaded",
    )
