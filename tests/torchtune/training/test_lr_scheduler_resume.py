"""LR schedulers over ``OptimizerInBackward``: a run that stops, saves and resumes
equals the uninterrupted run, in either mode and across modes; in-backward (with its
default buckets, and with one bucket per parameter) equals plain at every step.

Every run takes ``STEPS`` optimizer steps on the same tiny model, seed and batches.
An interrupted run takes ``RESUME_AT`` steps, saves the model's, the optimizer's and
the scheduler's state dicts (through ``torch.save``, as a checkpoint would), then a
fresh model, optimizer and scheduler (built from another seed, so only the checkpoint
can bring the weights back) load them and take the remaining steps. Each test
compares, at every one of the ``STEPS`` steps, the learning rate (and the momentum or
Adam ``beta1`` where the scheduler drives it) the step used and the loss, and then
the final weights, with the uninterrupted plain run.

Tolerance: none, everything bitwise (``rtol=0, atol=0``). In-backward and plain apply
the same single-tensor kernels (the default for ``torch.optim`` on CPU) to the same
gradients of the same loss, with hyperparameters read from the same param groups; a
scheduler's arithmetic depends only on its step count and those groups. Nothing
differs but when each parameter's update runs, which changes no value (measured:
every comparison here is bitwise equal).
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LambdaLR,
    LinearLR,
    LRScheduler,
    OneCycleLR,
    SequentialLR,
    StepLR,
)
from torch.testing import assert_close

from tests.helpers import BITWISE, loss_fn, make_model, train, weights_of
from torchtune.training import (
    OptimizerInBackward,
    OptimizerInBackwardWrapper,
    create_optim_in_bwd_wrapper,
    get_cosine_schedule_with_warmup,
    register_optim_in_bwd_hooks,
)

STEPS = 8  # optimizer steps of every run, all compared
RESUME_AT = 3  # an interrupted run saves after 3 steps; the resumed one takes 5

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "sgd_momentum": (
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    ),
}
SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], LRScheduler]] = {
    # Warmup ends at step 2, so the resume at step 3 is in the cosine decay.
    "cosine_warmup": lambda o: get_cosine_schedule_with_warmup(o, 2, STEPS),
    # Halves at steps 2, 4, 6: the resume at step 3 is in the middle of a period,
    # and StepLR's chainable form reads the lr back from the param groups.
    "steplr": lambda o: StepLR(o, step_size=2, gamma=0.5),
    "lambdalr": lambda o: LambdaLR(o, lambda step: 1.0 / (1 + step)),
    # Also drives SGD's momentum and AdamW's beta1 (cycle_momentum); its peak is at
    # step 0.3 * 8 = 2.4, so the resume at step 3 is on the way down.
    "onecycle": lambda o: OneCycleLR(o, max_lr=0.1, total_steps=STEPS),
}
# How each run steps: a plain optimizer, OptimizerInBackward as built by default
# (buckets of parameters: for this tiny model one bucket, updated when its last
# gradient arrives), and one bucket per parameter (each updated as soon as its own
# gradient is ready, so each parameter's update reads the param group on its own).
PER_PARAMETER = {"bucket_cap_mb": 0}
MODES = ("plain", "in_bwd", "in_bwd_per_param")
DIRECTIONS = {
    "plain_to_plain": ("plain", "plain"),
    "plain_to_in_bwd": ("plain", "in_bwd"),
    "in_bwd_to_plain": ("in_bwd", "plain"),
    "in_bwd_to_in_bwd": ("in_bwd", "in_bwd"),
    "plain_to_in_bwd_per_param": ("plain", "in_bwd_per_param"),
    "in_bwd_per_param_to_plain": ("in_bwd_per_param", "plain"),
    "in_bwd_to_in_bwd_per_param": ("in_bwd", "in_bwd_per_param"),
    "in_bwd_per_param_to_in_bwd": ("in_bwd_per_param", "in_bwd"),
}
_HAS_BUCKETS = "bucket_cap_mb" in inspect.signature(OptimizerInBackward).parameters


def momentum_of(group: dict) -> float | None:
    """What ``cycle_momentum`` drives: SGD's ``momentum`` or Adam's ``beta1``."""
    if "betas" in group:
        return group["betas"][0]
    return group.get("momentum")


@dataclass
class Trajectory:
    """What each step used and gave, in step order."""

    lrs: list[float] = field(default_factory=list)
    momenta: list[float | None] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)

    def of(self, optimizer: Any) -> Callable[[torch.Tensor], None]:
        """``train``'s ``after_backward``: records the step's lr and momentum (read
        from ``optimizer``'s param group, which only the scheduler changes) and loss."""

        def record(loss: torch.Tensor) -> None:
            group = optimizer.param_groups[0]
            self.lrs.append(group["lr"])
            self.momenta.append(momentum_of(group))
            self.losses.append(loss.detach().clone())

        return record


def build(
    mode: str, optimizer_name: str, scheduler_name: str, seed: int
) -> tuple[nn.Module, torch.optim.Optimizer, LRScheduler]:
    model = make_model(seed)
    cls, kwargs = OPTIMIZERS[optimizer_name]
    if mode == "plain":
        optimizer = cls(model.parameters(), **kwargs)
    else:
        if mode == "in_bwd_per_param":
            if not _HAS_BUCKETS:
                pytest.skip("OptimizerInBackward has no bucket_cap_mb")
            kwargs = kwargs | PER_PARAMETER
        optimizer = OptimizerInBackward(model.parameters(), cls, **kwargs)
    return model, optimizer, SCHEDULERS[scheduler_name](optimizer)


def through_a_file(state: dict) -> dict:
    """``state`` saved and loaded back as a checkpoint is (weights only)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def uninterrupted(
    mode: str, optimizer_name: str, scheduler_name: str
) -> tuple[Trajectory, dict[str, torch.Tensor]]:
    model, optimizer, scheduler = build(mode, optimizer_name, scheduler_name, seed=0)
    record = Trajectory()
    train(
        model, optimizer, range(STEPS), scheduler, after_backward=record.of(optimizer)
    )
    return record, weights_of(model)


def interrupted_and_resumed(
    first_mode: str,
    then_mode: str,
    optimizer_name: str,
    scheduler_name: str,
) -> tuple[Trajectory, dict[str, torch.Tensor]]:
    model, optimizer, scheduler = build(
        first_mode, optimizer_name, scheduler_name, seed=0
    )
    record = Trajectory()
    train(
        model,
        optimizer,
        range(RESUME_AT),
        scheduler,
        after_backward=record.of(optimizer),
    )
    saved = through_a_file(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
    )
    # Built as a fresh process builds them (its scheduler has taken its own first
    # step), then everything is loaded, as torch's checkpointing recipe does it.
    model, optimizer, scheduler = build(
        then_mode, optimizer_name, scheduler_name, seed=1
    )
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    train(
        model,
        optimizer,
        range(RESUME_AT, STEPS),
        scheduler,
        after_backward=record.of(optimizer),
    )
    return record, weights_of(model)


def assert_same_trajectory(
    run: tuple[Trajectory, dict[str, torch.Tensor]],
    reference: tuple[Trajectory, dict[str, torch.Tensor]],
) -> None:
    (record, weights), (expected, expected_weights) = run, reference
    assert len(record.lrs) == len(expected.lrs) == STEPS
    assert record.lrs == expected.lrs
    assert record.momenta == expected.momenta
    assert_close(torch.stack(record.losses), torch.stack(expected.losses), **BITWISE)
    assert_close(weights, expected_weights, **BITWISE)


@pytest.mark.parametrize("mode", MODES[1:])
@pytest.mark.parametrize("scheduler_name", SCHEDULERS)
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_uninterrupted_in_backward_run_matches_plain_bitwise(
    optimizer_name: str, scheduler_name: str, mode: str
) -> None:
    reference = uninterrupted("plain", optimizer_name, scheduler_name)
    # The schedule moves: a scheduler that did not drive the updates would show.
    assert len(set(reference[0].lrs)) >= 4
    assert_same_trajectory(
        uninterrupted(mode, optimizer_name, scheduler_name), reference
    )


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("scheduler_name", SCHEDULERS)
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_resumed_run_matches_the_uninterrupted_plain_run_bitwise(
    optimizer_name: str, scheduler_name: str, direction: str
) -> None:
    first_mode, then_mode = DIRECTIONS[direction]
    resumed = interrupted_and_resumed(
        first_mode, then_mode, optimizer_name, scheduler_name
    )
    assert_same_trajectory(
        resumed, uninterrupted("plain", optimizer_name, scheduler_name)
    )


@pytest.mark.parametrize("mode", MODES[1:])
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_one_cycle_momentum_reaches_every_in_backward_update(
    optimizer_name: str, mode: str
) -> None:
    reference = uninterrupted("plain", optimizer_name, "onecycle")
    momenta = reference[0].momenta
    # cycle_momentum moves the momentum opposite to the lr, from 0.95 at the start
    # down to 0.85 at the lr's peak and back: 0.95 at step 0, lower in the middle.
    assert momenta[0] == pytest.approx(0.95)
    assert min(momenta) < 0.9
    assert len(set(momenta)) >= 4
    in_bwd = uninterrupted(mode, optimizer_name, "onecycle")
    # The same momentum in the param groups at every step, and the same weights:
    # an update that kept the momentum it was built with would end elsewhere.
    assert_same_trajectory(in_bwd, reference)


def _sequential(optimizer: torch.optim.Optimizer) -> SequentialLR:
    """Linear warmup over 2 steps from a tenth of the lr, then cosine decay."""
    return SequentialLR(
        optimizer,
        schedulers=[
            LinearLR(optimizer, start_factor=0.1, total_iters=2),
            CosineAnnealingLR(optimizer, T_max=STEPS - 2),
        ],
        milestones=[2],
    )


def _0_6_1_in_backward(seed: int):
    """Model, wrapper and scheduler built as torchtune 0.6.1 recipes built them:
    one optimizer per parameter, hooks, the wrapper, and the scheduler built on one
    of the per-parameter optimizers and handed to ``set_lr_scheduler``."""
    cls, kwargs = OPTIMIZERS["adamw"]
    model = make_model(seed)
    optim_dict = {p: cls([p], **kwargs) for p in model.parameters()}
    with pytest.warns(DeprecationWarning, match="OptimizerInBackward"):
        register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
    with pytest.warns(DeprecationWarning, match="OptimizerInBackward"):
        wrapper = create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict)
    scheduler = _sequential(next(iter(wrapper.optim_map.values())))
    wrapper.set_lr_scheduler(scheduler)
    return model, wrapper, scheduler


def train_0_6_1(
    model: nn.Module,
    wrapper: OptimizerInBackwardWrapper,
    steps: range,
    record: Trajectory,
) -> None:
    """A 0.6.1 recipe's loop: backward updates; no optimizer step() or zero_grad()."""
    for step in steps:
        loss = loss_fn(model, step)
        loss.backward()
        record.of(wrapper)(loss)
        wrapper.step_lr_scheduler()


def test_sequential_lr_through_0_6_1_set_lr_scheduler_matches_plain_and_resumes() -> (
    None
):
    cls, kwargs = OPTIMIZERS["adamw"]
    model = make_model(0)
    plain = cls(model.parameters(), **kwargs)
    plain_scheduler = _sequential(plain)
    expected = Trajectory()
    train(
        model, plain, range(STEPS), plain_scheduler, after_backward=expected.of(plain)
    )
    reference = (expected, weights_of(model))
    # Warmup from 0.005 to 0.05, then the cosine: the lr changes at every step.
    assert len(set(expected.lrs)) == STEPS

    model, wrapper, scheduler = _0_6_1_in_backward(seed=0)
    record = Trajectory()
    train_0_6_1(model, wrapper, range(STEPS), record)
    assert wrapper.get_last_lr() == plain_scheduler.get_last_lr()[0]
    assert_same_trajectory((record, weights_of(model)), reference)

    # Interrupted after RESUME_AT steps, saved, and resumed in a fresh 0.6.1 setup.
    model, wrapper, scheduler = _0_6_1_in_backward(seed=0)
    record = Trajectory()
    train_0_6_1(model, wrapper, range(RESUME_AT), record)
    saved = through_a_file(
        {
            "model": model.state_dict(),
            "optimizer": wrapper.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
    )
    # 0.6.1's format: one per-parameter optimizer state dict per name.
    assert list(saved["optimizer"]) == [n for n, _ in model.named_parameters()]
    model, wrapper, scheduler = _0_6_1_in_backward(seed=1)
    model.load_state_dict(saved["model"])
    wrapper.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    train_0_6_1(model, wrapper, range(RESUME_AT, STEPS), record)
    assert wrapper.get_last_lr() == plain_scheduler.get_last_lr()[0]
    assert_same_trajectory((record, weights_of(model)), reference)
