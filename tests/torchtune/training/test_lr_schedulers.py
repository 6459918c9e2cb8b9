"""Tests for torchtune/training/lr_schedulers.py."""

import math

import pytest
import torch
from torch import nn

from torchtune.training import (
    OptimizerInBackward,
    get_cosine_schedule_with_warmup,
    get_lr,
)


def lrs_over(optimizer: torch.optim.Optimizer, scheduler, steps: int) -> list[float]:
    values = []
    for _ in range(steps):
        values.append(get_lr(optimizer))
        optimizer.step()
        scheduler.step()
    return values


@pytest.mark.parametrize("in_backward", [False, True], ids=["plain", "in_bwd"])
def test_cosine_schedule_warms_up_linearly_then_decays_to_zero(
    in_backward: bool,
) -> None:
    params = nn.Linear(2, 2).parameters()
    optimizer = (
        OptimizerInBackward(params, torch.optim.SGD, lr=1.0)
        if in_backward
        else torch.optim.SGD(params, lr=1.0)
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, 4, 12)
    lrs = lrs_over(optimizer, scheduler, 13)
    # Exact: the factors are computed in float64 and multiply a base lr of 1.0.
    assert lrs[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert lrs[8] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)), abs=1e-15)
    assert lrs[12] == pytest.approx(0.0, abs=1e-15)


def test_cosine_schedule_with_more_cycles_never_goes_negative() -> None:
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 0, 10, num_cycles=1.5)
    assert min(lrs_over(optimizer, scheduler, 11)) >= 0.0


def test_cosine_schedule_resumes_from_last_epoch() -> None:
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    fresh = get_cosine_schedule_with_warmup(optimizer, 2, 10)
    expected = lrs_over(optimizer, fresh, 6)[5]
    resumed_optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    for group in resumed_optimizer.param_groups:
        group["initial_lr"] = 1.0
    get_cosine_schedule_with_warmup(resumed_optimizer, 2, 10, last_epoch=4)
    assert get_lr(resumed_optimizer) == expected


def test_get_lr_of_in_backward_optimizer_follows_its_scheduler() -> None:
    optimizer = OptimizerInBackward(
        nn.Linear(2, 2).parameters(), torch.optim.AdamW, lr=0.1
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    assert lrs_over(optimizer, scheduler, 3) == pytest.approx([0.1, 0.01, 0.001])


def test_get_lr_raises_when_groups_disagree() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "lr": 0.1},
            {"params": model[1].parameters(), "lr": 0.2},
        ]
    )
    with pytest.raises(RuntimeError, match=r"different learning rates \[0.1, 0.2\]"):
        get_lr(optimizer)


def test_get_lr_raises_without_param_groups() -> None:
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    optimizer.param_groups = []
    with pytest.raises(RuntimeError, match="no param groups"):
        get_lr(optimizer)
