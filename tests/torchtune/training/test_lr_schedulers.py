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
    """The learning rate of each of ``steps`` training steps, with a real backward
    pass in each (which is where an optimizer in backward updates)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    values = []
    for _ in range(steps):
        values.append(get_lr(optimizer))
        sum(p.sum() for p in params).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return values


def sgd_deltas_over(
    optimizer: torch.optim.Optimizer, scheduler, steps: int
) -> tuple[list[float], list[torch.Tensor]]:
    """Per step: the learning rate, and how much one weight moved. With plain SGD
    and a loss whose gradient is 1 for every weight, a step moves each weight by
    exactly its learning rate, so the two lists are equal when the schedule reaches
    the update."""
    weight = optimizer.param_groups[0]["params"][0]
    lrs, deltas = [], []
    for _ in range(steps):
        lrs.append(get_lr(optimizer))
        before = weight.detach().clone()
        sum(p.sum() for g in optimizer.param_groups for p in g["params"]).backward()
        optimizer.step()
        optimizer.zero_grad()
        deltas.append(before - weight.detach())
        scheduler.step()
    return lrs, deltas


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


@pytest.mark.parametrize("bucket_cap_mb", [0, None], ids=["per_param", "bucketed"])
def test_get_lr_of_in_backward_optimizer_is_the_lr_its_updates_use(
    bucket_cap_mb: float | None,
) -> None:
    torch.manual_seed(0)
    optimizer = OptimizerInBackward(
        nn.Linear(2, 2).parameters(),
        torch.optim.SGD,
        bucket_cap_mb=bucket_cap_mb,
        lr=0.5,
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    lrs, deltas = sgd_deltas_over(optimizer, scheduler, 3)
    assert lrs == [0.5, 0.25, 0.125]
    assert len(deltas) == 3
    for lr, delta in zip(lrs, deltas, strict=True):
        # The update w - lr rounds by at most half a float32 ulp of the result
        # (|w| < 2 here: ulp <= 2.4e-7); atol is a whole ulp.
        torch.testing.assert_close(
            delta, torch.full_like(delta, lr), rtol=0, atol=2.4e-7
        )


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
