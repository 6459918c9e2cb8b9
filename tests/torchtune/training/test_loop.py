"""Tests for torchtune/training/loop.py: what every recipe's loop repeats.

Norms and clipped gradients are compared bitwise with torch's own functions: the
helpers must compute exactly what the recipes computed before them.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from torchtune import training

BITWISE = {"rtol": 0, "atol": 0}


def _params_with_grads(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(n, generator=g)) for n in (3, 7, 5)]
    for p in params[:2]:  # the last one has no gradient
        p.grad = torch.randn(p.shape, generator=g) * 10
    return params


def test_grad_norm_is_bitwise_get_total_norm_and_skips_missing_gradients() -> None:
    params = _params_with_grads()
    expected = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.testing.assert_close(training.grad_norm(params), expected, **BITWISE)
    torch.testing.assert_close(
        training.grad_norm([nn.Parameter(torch.ones(2))]), torch.tensor(0.0)
    )


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clips", "never_clips"])
def test_clip_grads_with_norm_scales_as_clip_grad_norm_does(max_norm: float) -> None:
    ours, theirs = _params_with_grads(), _params_with_grads()
    total = training.grad_norm(ours)
    training.clip_grads_with_norm_(ours, max_norm, total)
    nn.utils.clip_grad_norm_(theirs, max_norm)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, **BITWISE)


@pytest.mark.parametrize(
    ("batches", "accumulation", "limit", "expected"),
    [(10, 1, None, 10), (10, 3, None, 3), (10, 1, 4, 4), (10, 4, 9, 2)],
)
def test_steps_per_epoch_counts_full_steps_up_to_the_limit(
    batches, accumulation, limit, expected
) -> None:
    assert training.steps_per_epoch(batches, accumulation, limit) == expected


def _loader(n: int = 12, batch_size: int = 2) -> StatefulDataLoader:
    data = list(range(n))
    sampler = StatefulDistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
    return StatefulDataLoader(data, batch_size=batch_size, sampler=sampler)


class _CountingProfiler:
    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        self.steps += 1


def test_epoch_batches_stop_after_the_epochs_last_full_step_stepping_the_profiler():
    profiler = _CountingProfiler()
    seen = list(
        training.epoch_batches(
            _loader(),
            0,
            steps_done=0,
            steps_per_epoch=2,
            gradient_accumulation_steps=2,
            profiler=profiler,
        )
    )
    # 6 batches in the epoch, 2 steps of 2 batches: the last 2 are left unused.
    assert [idx for idx, _ in seen] == [0, 1, 2, 3]
    assert profiler.steps == 2  # once per optimizer step


def test_epoch_batches_resume_mid_epoch_where_the_saved_loader_was() -> None:
    uninterrupted = [
        b.tolist()
        for _, b in training.epoch_batches(
            _loader(), 1, steps_done=0, steps_per_epoch=6
        )
    ]
    loader = _loader()
    batches = training.epoch_batches(loader, 1, steps_done=0, steps_per_epoch=6)
    first = [next(batches)[1].tolist() for _ in range(2)]
    state = loader.state_dict()
    resumed = list(
        training.epoch_batches(
            _loader(), 1, steps_done=2, steps_per_epoch=6, loader_state=state
        )
    )
    assert [idx for idx, _ in resumed] == [2, 3, 4, 5]
    assert first + [b.tolist() for _, b in resumed] == uninterrupted
    # The data order depends on the epoch only.
    epoch_0 = [
        b.tolist()
        for _, b in training.epoch_batches(
            _loader(), 0, steps_done=0, steps_per_epoch=6
        )
    ]
    assert epoch_0 != uninterrupted


def _scheduler_lrs(global_step: int) -> list[float]:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = training.setup_lr_scheduler(
        partial(training.get_cosine_schedule_with_warmup, num_warmup_steps=2),
        optimizer,
        num_training_steps=8,
        global_step=global_step,
    )
    lrs = []
    for _ in range(global_step, 8):
        lrs.append(training.get_lr(optimizer))
        optimizer.step()
        scheduler.step()
    return lrs


def test_setup_lr_scheduler_puts_a_resumed_run_where_the_interrupted_one_was() -> None:
    # A fresh optimizer has no initial_lr (a sharded checkpoint cannot restore it):
    # the helper gives each group the optimizer's base lr.
    assert _scheduler_lrs(3) == _scheduler_lrs(0)[3:]
    assert (
        training.setup_lr_scheduler(
            None,
            torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1),
            num_training_steps=8,
            global_step=0,
        )
        is None
    )


def test_setup_profiler_is_a_no_op_without_a_section_and_torchs_with_one(
    tmp_path: Path,
) -> None:
    profiler, window = training.setup_profiler(None, device=torch.device("cpu"))
    assert isinstance(profiler, training.DummyProfiler) and window is None
    # A null _component_ means setup_torch_profiler, as in 0.6.1.
    profiler, window = training.setup_profiler(
        {"_component_": None, "enabled": True, "output_dir": str(tmp_path)},
        device=torch.device("cpu"),
    )
    assert isinstance(profiler, torch.profiler.profile)
    # The CUDA memory snapshot is for CUDA devices only.
    assert window is None
