"""Tests for torchtune/training/memory.py: OptimizerInBackward and the memory utilities.

Tolerances. An in-backward run and a plain run apply the same optimizer kernels to
the same values, parameter by parameter, so they must agree bitwise (``rtol=0,
atol=0``); this holds for SGD and AdamW with and without foreach on CPU. So does
``grad_norm``: like ``clip_grad_norm_`` it takes the norm of the stacked
per-parameter norms, stacked in parameter order whatever order the gradients
arrive in.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from collections.abc import Callable
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR

from tests.torchtune.distributed_launcher import DistributedRun
from tests.torchtune.training.optimizer_in_backward_scenarios import SCENARIOS
from torchtune import config, training
from torchtune.training import OptimizerInBackward, get_cosine_schedule_with_warmup
from torchtune.training.memory import (
    cleanup_before_training,
    get_memory_stats,
    hyperparameters,
    log_memory_stats,
    set_activation_checkpointing,
)

BITWISE = {"rtol": 0, "atol": 0}

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    "sgd_momentum": (
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    ),
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "adamw_foreach": (
        torch.optim.AdamW,
        {"lr": 0.05, "weight_decay": 0.1, "foreach": True},
    ),
}
SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], LRScheduler]] = {
    "steplr": lambda o: StepLR(o, step_size=2, gamma=0.1),
    "lambdalr": lambda o: LambdaLR(o, lambda step: 1.0 / (1 + step)),
    "cosine_warmup": lambda o: get_cosine_schedule_with_warmup(o, 2, 6),
}
ADAMW = OPTIMIZERS["adamw"]


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    )


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(step))


def loss_fn(model: nn.Module, step: int) -> torch.Tensor:
    return model(batch(step)).square().mean()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    scheduler: LRScheduler | None = None,
) -> None:
    """The training loop every recipe uses, whatever the optimizer."""
    for step in steps:
        loss_fn(model, step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def plain_and_in_backward(
    name: str = "adamw",
    params: Callable[[nn.Module], object] = nn.Module.parameters,
    bucket_cap_mb: float | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, OptimizerInBackward]:
    cls, kwargs = OPTIMIZERS[name]
    reference, model = make_model(), make_model()
    plain = cls(params(reference), **kwargs)
    in_bwd = OptimizerInBackward(
        params(model), cls, bucket_cap_mb=bucket_cap_mb, **kwargs
    )
    return reference, plain, model, in_bwd


def bucket_sizes(optimizer: OptimizerInBackward) -> list[int]:
    """How many parameters each bucket holds, in parameter order."""
    return [len(bucket.params) for bucket in optimizer._buckets()]


# Bucket caps. make_model's parameters hold 192, 32, 256, 32, 96 and 12 bytes.
# "two_per_bucket" (300 bytes) gives buckets [0.weight, 0.bias], [2.weight, 2.bias],
# [4.weight, 4.bias]; in two_groups' layout the same, as the first group is layer 0.
BUCKET_CAPS = {
    "per_parameter": 0,
    "two_per_bucket": 300 / 2**20,
    "default_one_bucket": None,
}


def two_groups(model: nn.Module) -> list[dict]:
    """The first layer at twice the lr and without weight decay, the rest default."""
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return [{"params": first, "lr": 0.1, "weight_decay": 0.0}, {"params": rest}]


# -- looks like the plain optimizer ----------------------------------------------


def test_param_groups_and_defaults_are_those_of_the_plain_optimizer() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward(
        "adamw_foreach", params=two_groups
    )
    assert in_bwd.defaults == plain.defaults
    assert len(in_bwd.param_groups) == 2
    for ours, theirs in zip(in_bwd.param_groups, plain.param_groups, strict=True):
        assert {k: v for k, v in ours.items() if k != "params"} == {
            k: v for k, v in theirs.items() if k != "params"
        }
    assert isinstance(in_bwd, torch.optim.Optimizer)


def test_named_parameters_give_param_names_like_the_plain_optimizer() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward(
        params=nn.Module.named_parameters
    )
    assert in_bwd.param_groups[0]["param_names"] == plain.param_groups[0]["param_names"]
    train(reference, plain, range(2))
    train(model, in_bwd, range(2))
    assert in_bwd.state_dict()["param_groups"] == plain.state_dict()["param_groups"]


def test_optimizer_cls_can_be_a_config_instantiate_partial_without_kwargs() -> None:
    cfg = OmegaConf.create(
        {"_component_": "torch.optim.AdamW", "lr": 0.05, "weight_decay": 0.1}
    )
    reference, model = make_model(), make_model()
    plain = config.instantiate(cfg, reference.parameters())
    in_bwd = OptimizerInBackward(
        model.parameters(), functools.partial(config.instantiate, cfg)
    )
    train(reference, plain, range(3))
    train(model, in_bwd, range(3))
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)


def test_optimizer_cls_that_does_not_build_an_optimizer_raises_type_error() -> None:
    with pytest.raises(TypeError, match="must build a torch.optim.Optimizer"):
        OptimizerInBackward(make_model().parameters(), lambda params: object())


def test_empty_params_raise_value_error() -> None:
    with pytest.raises(ValueError, match="empty parameter list"):
        OptimizerInBackward([], torch.optim.AdamW)


def test_hyperparameters_are_every_group_key_but_params_and_param_names() -> None:
    model = make_model()
    group = torch.optim.AdamW(model.named_parameters(), lr=0.5).param_groups[0]
    assert {"params", "param_names", "lr", "betas"} <= set(group)
    assert hyperparameters(group) == {
        k: v for k, v in group.items() if k not in ("params", "param_names")
    }


# -- training equivalence with LR schedulers -----------------------------------------


@pytest.mark.parametrize("bucket_caps", BUCKET_CAPS)
@pytest.mark.parametrize("scheduler_name", SCHEDULERS)
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_in_backward_training_with_scheduler_matches_plain_bitwise(
    optimizer_name: str, scheduler_name: str, bucket_caps: str
) -> None:
    # A foreach step over a bucket does the per-element arithmetic of the plain
    # foreach step over all parameters: bitwise, whatever the bucketing.
    reference, plain, model, in_bwd = plain_and_in_backward(
        optimizer_name, params=two_groups, bucket_cap_mb=BUCKET_CAPS[bucket_caps]
    )
    assert (
        bucket_sizes(in_bwd)
        == {
            "per_parameter": [1] * 6,
            "two_per_bucket": [2, 2, 2],
            # Buckets never mix param groups: their hyperparameters differ.
            "default_one_bucket": [2, 4],
        }[bucket_caps]
    )
    plain_scheduler = SCHEDULERS[scheduler_name](plain)
    in_bwd_scheduler = SCHEDULERS[scheduler_name](in_bwd)
    for step in range(6):
        train(reference, plain, range(step, step + 1), plain_scheduler)
        train(model, in_bwd, range(step, step + 1), in_bwd_scheduler)
        torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
        assert in_bwd_scheduler.get_last_lr() == plain_scheduler.get_last_lr()
    torch.testing.assert_close(
        in_bwd.state_dict()["state"], plain.state_dict()["state"], **BITWISE
    )


def test_warmup_from_zero_lr_holds_every_parameter_at_step_zero() -> None:
    # 0.6.1 gave lr 0 only to the first parameter's optimizer.
    model = make_model()
    optimizer = OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, 3, 10)
    before = snapshot(model)
    train(model, optimizer, range(1), scheduler)
    torch.testing.assert_close(snapshot(model), before, **BITWISE)
    after_first = snapshot(model)
    train(model, optimizer, range(1, 2), scheduler)
    for name, param in model.named_parameters():
        assert not torch.equal(param, after_first[name]), name


# -- state dict interchange --------------------------------------------------------


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adamw"])
@pytest.mark.parametrize("save_in_backward", [True, False], ids=["in_bwd", "plain"])
def test_state_dict_loads_into_the_other_kind_and_training_resumes_bitwise(
    optimizer_name: str, save_in_backward: bool
) -> None:
    cls, kwargs = OPTIMIZERS[optimizer_name]
    reference = make_model()
    train(reference, cls(reference.parameters(), **kwargs), range(6))

    def build(in_backward: bool, model: nn.Module) -> torch.optim.Optimizer:
        if in_backward:
            return OptimizerInBackward(model.parameters(), cls, **kwargs)
        return cls(model.parameters(), **kwargs)

    model = make_model()
    optimizer = build(save_in_backward, model)
    train(model, optimizer, range(3))
    saved = copy.deepcopy(optimizer.state_dict())

    resumed = make_model(seed=1)
    resumed.load_state_dict(model.state_dict())
    new_optimizer = build(not save_in_backward, resumed)
    new_optimizer.load_state_dict(saved)
    # Every entry (Adam's step, exp_avg, exp_avg_sq; SGD's momentum_buffer) arrived.
    torch.testing.assert_close(
        new_optimizer.state_dict()["state"], saved["state"], **BITWISE
    )
    train(resumed, new_optimizer, range(3, 6))
    torch.testing.assert_close(snapshot(resumed), snapshot(reference), **BITWISE)


def test_state_dict_with_fewer_params_raises_naming_the_missing_ones() -> None:
    model = make_model()
    saved = torch.optim.AdamW(model[0].parameters()).state_dict()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"missing \[#2 \(shape \(8, 8\)\), #3"):
        optimizer.load_state_dict(saved)
    named = OptimizerInBackward(model.named_parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"missing \['2.weight', '2.bias'"):
        named.load_state_dict(saved)


def test_state_dict_with_more_params_raises_naming_the_extra_ones() -> None:
    model = make_model()
    saved = torch.optim.AdamW(model.parameters()).state_dict()
    optimizer = OptimizerInBackward(model[0].parameters(), torch.optim.AdamW)
    with pytest.raises(
        ValueError, match=r"extra \[saved id 2, saved id 3, saved id 4, saved id 5\]"
    ):
        optimizer.load_state_dict(saved)


def test_state_dict_with_state_for_unknown_ids_raises() -> None:
    model = make_model()
    plain = torch.optim.AdamW(model.parameters())
    train(model, plain, range(1))
    saved = plain.state_dict()
    saved["state"][99] = saved["state"][0]
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"ids \[99\] that are in no param group"):
        optimizer.load_state_dict(saved)


def test_state_dict_with_other_param_names_raises_naming_missing_and_extra() -> None:
    model = make_model()
    saved = torch.optim.AdamW(model.named_parameters()).state_dict()
    saved["param_groups"][0]["param_names"][0] = "renamed.weight"
    optimizer = OptimizerInBackward(model.named_parameters(), torch.optim.AdamW)
    with pytest.raises(
        ValueError, match=r"missing \['0.weight'\], extra \['renamed.weight'\]"
    ):
        optimizer.load_state_dict(saved)


def test_state_dict_with_other_group_count_raises() -> None:
    model = make_model()
    saved = torch.optim.AdamW(two_groups(model)).state_dict()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    with pytest.raises(
        ValueError, match="has 2 param groups, but this optimizer has 1"
    ):
        optimizer.load_state_dict(saved)


# -- torchtune 0.6.1 in-backward checkpoints -------------------------------------------
# This class loads the torch format only; converting 0.6.1's is tested in
# test_optim_in_bwd_legacy_state_dict.py.


def reference_after_6_steps() -> nn.Module:
    reference = make_model()
    cls, kwargs = ADAMW
    train(reference, cls(reference.parameters(), **kwargs), range(6))
    return reference


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_0_6_1_checkpoint_is_refused_saying_how_to_convert_it(named: bool) -> None:
    model = make_model()
    saved = {
        name: torch.optim.AdamW([p]).state_dict()
        for name, p in model.named_parameters()
    }
    params = model.named_parameters() if named else model.parameters()
    optimizer = OptimizerInBackward(params, torch.optim.AdamW)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "training.convert_legacy_optim_in_bwd_state_dict(state_dict, "
            "model.named_parameters())"
        ),
    ):
        optimizer.load_state_dict(saved)
    assert len(optimizer.state) == 0


# -- step() ------------------------------------------------------------------------


def test_step_after_backward_changes_nothing() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=0.1)
    loss_fn(model, 0).backward()
    assert all(p.grad is None for p in model.parameters())
    after_backward = snapshot(model)
    optimizer.step()
    torch.testing.assert_close(snapshot(model), after_backward, **BITWISE)


def test_step_updates_params_holding_a_grad_exactly_like_plain_step() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward()
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        a.grad = torch.full_like(a, 0.5)
        b.grad = torch.full_like(b, 0.5)
    plain.step()
    in_bwd.step()
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(
        in_bwd.state_dict()["state"], plain.state_dict()["state"], **BITWISE
    )


def test_step_with_a_closure_raises() -> None:
    optimizer = OptimizerInBackward(make_model().parameters(), torch.optim.AdamW)
    with pytest.raises(NotImplementedError, match="closure"):
        optimizer.step(lambda: torch.tensor(0.0))


def test_dcp_state_initialization_creates_the_plain_optimizers_state() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward()
    plain_state = get_optimizer_state_dict(reference, plain)
    in_bwd_state = get_optimizer_state_dict(model, in_bwd)
    torch.testing.assert_close(in_bwd_state["state"], plain_state["state"], **BITWISE)
    # The zero-gradient step DCP takes runs with lr=0: the weights do not move.
    torch.testing.assert_close(snapshot(model), snapshot(make_model()), **BITWISE)


# -- partial and changing parameter sets ---------------------------------------------


def freeze_first_layer(model: nn.Module) -> nn.Module:
    model[0].requires_grad_(False)
    return model


def test_frozen_params_get_no_update_no_state_and_stay_in_param_groups() -> None:
    cls, kwargs = ADAMW
    reference, model = (
        freeze_first_layer(make_model()),
        freeze_first_layer(make_model()),
    )
    plain = cls(reference.parameters(), **kwargs)
    optimizer = OptimizerInBackward(model.parameters(), cls, **kwargs)
    assert len(optimizer.param_groups[0]["params"]) == 6  # as in the plain optimizer
    train(reference, plain, range(3))
    train(model, optimizer, range(3))
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
    torch.testing.assert_close(model[0].weight, make_model()[0].weight, **BITWISE)
    assert model[0].weight not in optimizer.state
    assert optimizer.state_dict()["state"].keys() == {2, 3, 4, 5}
    # The same format as the plain one's: a fresh plain optimizer loads it and
    # trains on exactly like the uninterrupted one.
    fresh_reference = make_model()
    fresh_reference.load_state_dict(model.state_dict())
    freeze_first_layer(fresh_reference)
    fresh = cls(fresh_reference.parameters(), **kwargs)
    fresh.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    torch.testing.assert_close(fresh.state_dict(), plain.state_dict(), **BITWISE)
    train(reference, plain, range(3, 5))
    train(fresh_reference, fresh, range(3, 5))
    torch.testing.assert_close(
        snapshot(fresh_reference), snapshot(reference), **BITWISE
    )


def test_param_unfrozen_later_is_updated_like_with_the_plain_optimizer() -> None:
    cls, kwargs = ADAMW
    reference, model = (
        freeze_first_layer(make_model()),
        freeze_first_layer(make_model()),
    )
    plain = cls(reference.parameters(), **kwargs)
    optimizer = OptimizerInBackward(model.parameters(), cls, **kwargs)
    train(reference, plain, range(2))
    train(model, optimizer, range(2))
    reference[0].requires_grad_(True)
    model[0].requires_grad_(True)
    train(reference, plain, range(2, 5))
    train(model, optimizer, range(2, 5))
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
    loss_fn(model, 5).backward()
    assert model[0].weight.grad is None  # now updated inside backward


def test_add_param_group_params_are_updated_in_backward_and_saved() -> None:
    cls, kwargs = ADAMW
    reference, model = make_model(), make_model()
    plain = cls(reference[0].parameters(), **kwargs)
    optimizer = OptimizerInBackward(model[0].parameters(), cls, **kwargs)
    for m, opt in ((reference, plain), (model, optimizer)):
        opt.add_param_group({"params": list(m[2].parameters()), "lr": 0.01})
        opt.add_param_group({"params": list(m[4].parameters())})
    train(reference, plain, range(3))
    train(model, optimizer, range(3))
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
    torch.testing.assert_close(optimizer.state_dict(), plain.state_dict(), **BITWISE)
    loss_fn(model, 3).backward()
    assert all(p.grad is None for p in model.parameters())


def test_add_param_group_with_a_param_already_in_a_group_raises() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match="more than one parameter group"):
        optimizer.add_param_group({"params": [model[0].weight]})


def test_second_optimizer_takes_over_params_and_the_first_stops_updating() -> None:
    cls, kwargs = ADAMW
    reference = make_model()
    train(reference, cls(reference.parameters(), **kwargs), range(3))
    model = make_model()
    first = OptimizerInBackward(model.parameters(), cls, **kwargs)
    second = OptimizerInBackward(model.parameters(), cls, **kwargs)
    train(model, second, range(3))
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
    assert len(first.state) == 0 and len(second.state) == 6
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = snapshot(model)
    first.step()  # no longer its parameters
    torch.testing.assert_close(snapshot(model), before, **BITWISE)


def test_second_optimizer_over_part_of_a_bucket_splits_it_and_removes_hooks() -> None:
    """The first optimizer's one bucket holds every parameter; a second one takes
    layer 0. Each parameter then has exactly one hook, the first optimizer updates
    the rest as one bucket, the second layer 0, and training equals one plain
    AdamW over everything (same hyperparameters, elementwise update)."""
    cls, kwargs = ADAMW
    reference = make_model()
    train(reference, cls(reference.parameters(), **kwargs), range(3))
    model = make_model()
    first = OptimizerInBackward(model.parameters(), cls, **kwargs)
    assert bucket_sizes(first) == [6]
    second = OptimizerInBackward(model[0].parameters(), cls, **kwargs)
    assert bucket_sizes(first) == [4] and bucket_sizes(second) == [2]
    for p in model.parameters():
        assert len(p._post_accumulate_grad_hooks) == 1
    for p in model[0].parameters():
        assert p not in first._hook_handles
    for step in range(3):
        loss_fn(model, step).backward()
        assert all(p.grad is None for p in model.parameters())
        first.zero_grad()
        second.zero_grad()
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
    assert len(first.state) == 4 and len(second.state) == 2


def test_fresh_optimizer_built_to_load_a_checkpoint_resumes_bitwise() -> None:
    cls, kwargs = ADAMW
    model = make_model()
    first = OptimizerInBackward(model.parameters(), cls, **kwargs)
    train(model, first, range(3))
    fresh = OptimizerInBackward(model.parameters(), cls, **kwargs)
    fresh.load_state_dict(copy.deepcopy(first.state_dict()))
    train(model, fresh, range(3, 6))
    torch.testing.assert_close(
        snapshot(model), snapshot(reference_after_6_steps()), **BITWISE
    )


def test_remove_hooks_leaves_grads_for_step_like_a_plain_optimizer() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward()
    in_bwd.remove_hooks()
    loss_fn(model, 0).backward()
    assert all(p.grad is not None for p in model.parameters())
    in_bwd.step()
    assert all(p.grad is None for p in model.parameters())
    train(reference, plain, range(1))
    train(model, in_bwd, range(1, 3))
    train(reference, plain, range(1, 3))
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)


# -- gradient norm and memory ----------------------------------------------------------


def test_grad_norm_equals_clip_grad_norm_total_norm_of_a_plain_run() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward()
    for step in range(4):
        loss_fn(reference, step).backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
        plain.step()
        plain.zero_grad()
        loss_fn(model, step).backward()
        torch.testing.assert_close(in_bwd.grad_norm, expected, **BITWISE)
        in_bwd.step()
        in_bwd.zero_grad()


def test_grad_norm_not_recorded_is_refused_never_wrong() -> None:
    """With record_grad_norm off the updates are the same and grad_norm raises
    until the next zero_grad(); turned back on, it is the plain run's again."""
    reference, plain, model, in_bwd = plain_and_in_backward()
    in_bwd.record_grad_norm = False
    train(reference, plain, range(2))
    for step in range(2):
        loss_fn(model, step).backward()
        with pytest.raises(RuntimeError, match="record_grad_norm was False"):
            _ = in_bwd.grad_norm
        in_bwd.step()
        in_bwd.zero_grad()
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
    in_bwd.record_grad_norm = True
    loss_fn(reference, 2).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    loss_fn(model, 2).backward()
    torch.testing.assert_close(in_bwd.grad_norm, expected, **BITWISE)


def test_grad_norm_is_zero_before_backward_and_after_zero_grad() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    assert optimizer.grad_norm.item() == 0.0
    loss_fn(model, 0).backward()
    assert optimizer.grad_norm.item() > 0.0
    assert optimizer.grad_norm.dtype == torch.float32 and optimizer.grad_norm.ndim == 0
    optimizer.zero_grad()
    assert optimizer.grad_norm.item() == 0.0


def count_alive_gradients(model: nn.Module) -> list[int]:
    """After each parameter's gradient is ready (and any optimizer in backward used
    it), how many parameters hold a gradient."""
    alive: list[int] = []
    for p in model.parameters():  # registered after the optimizer's: run after it
        p.register_post_accumulate_grad_hook(
            lambda _: alive.append(sum(q.grad is not None for q in model.parameters()))
        )
    loss_fn(model, 0).backward()
    return alive


@pytest.mark.parametrize("in_backward", [True, False], ids=["in_bwd", "plain"])
def test_no_two_gradients_are_alive_at_once_per_parameter(in_backward: bool) -> None:
    model = make_model()
    if in_backward:
        OptimizerInBackward(model.parameters(), torch.optim.AdamW, bucket_cap_mb=0)
    alive = count_alive_gradients(model)
    assert len(alive) == 6
    assert max(alive) == (0 if in_backward else 6)


def test_at_most_one_bucket_of_gradients_is_alive_during_backward() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(
        model.parameters(),
        torch.optim.AdamW,
        bucket_cap_mb=BUCKET_CAPS["two_per_bucket"],
    )
    # Gradients arrive from the last layer back: 4.bias and 4.weight in some order,
    # then layer 2's, then layer 0's. The first of each pair waits for the second,
    # then both are freed.
    assert count_alive_gradients(model) == [1, 0, 1, 0, 1, 0]
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.grad_norm.item() > 0


def test_bucket_cap_holds_consecutive_params_of_one_group_up_to_the_cap() -> None:
    model = make_model()
    caps_and_sizes = [
        (0, [1] * 6),
        (192 / 2**20, [1, 1, 1, 3]),  # 192, 32 (+256 > 192), 256, 32+96+12
        (224 / 2**20, [2, 1, 3]),  # 192+32, 256 alone, 32+96+12
        (300 / 2**20, [2, 2, 2]),
        (1.0, [6]),
        (None, [6]),  # the default, 4 MiB
    ]
    for cap, sizes in caps_and_sizes:
        optimizer = OptimizerInBackward(
            model.parameters(), torch.optim.AdamW, bucket_cap_mb=cap
        )
        assert bucket_sizes(optimizer) == sizes, cap
        flat = [p for b in optimizer._buckets() for p in b.params]
        assert all(a is b for a, b in zip(flat, model.parameters(), strict=True))


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "16"])
def test_bucket_cap_must_be_a_non_negative_number(bad: object) -> None:
    with pytest.raises((ValueError, TypeError), match="bucket_cap_mb must be"):
        OptimizerInBackward(
            make_model().parameters(), torch.optim.AdamW, bucket_cap_mb=bad
        )


@pytest.mark.parametrize("bucket_caps", BUCKET_CAPS)
def test_bucket_whose_param_gets_no_gradient_updates_at_the_end_of_backward(
    bucket_caps: str,
) -> None:
    """Layer 2 is skipped on odd steps (like layer dropout): its bucket's gradients
    never all arrive, so the bucket is updated when backward ends; a plain optimizer
    skips the parameters without a gradient the same way."""

    def skipping_loss(model: nn.Module, step: int) -> torch.Tensor:
        x = torch.tanh(model[0](batch(step)))
        if step % 2 == 0:
            x = torch.tanh(model[2](x))
        return model[4](x).square().mean()

    cls, kwargs = ADAMW
    reference, model = make_model(), make_model()
    plain = cls(reference.parameters(), **kwargs)
    in_bwd = OptimizerInBackward(
        model.parameters(), cls, bucket_cap_mb=BUCKET_CAPS[bucket_caps], **kwargs
    )
    for step in range(4):
        skipping_loss(reference, step).backward()
        expected_norm = torch.nn.utils.get_total_norm(
            [p.grad for p in reference.parameters() if p.grad is not None]
        )
        plain.step()
        plain.zero_grad()
        skipping_loss(model, step).backward()
        # Every update happened inside backward, none is left for step().
        assert all(p.grad is None for p in model.parameters())
        torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
        torch.testing.assert_close(in_bwd.grad_norm, expected_norm, **BITWISE)
        in_bwd.step()
        in_bwd.zero_grad()
    assert in_bwd.state[model[2].weight]["step"] == 2
    torch.testing.assert_close(
        in_bwd.state_dict()["state"], plain.state_dict()["state"], **BITWISE
    )


def failing_loss(model: nn.Module) -> torch.Tensor:
    """A loss whose backward raises after layers 4 and 2 have their gradients,
    before layer 0's."""
    hidden = model[0](batch(99))

    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("failed in backward")

    hidden.register_hook(fail)
    return model[4](torch.tanh(model[2](torch.tanh(hidden)))).square().mean()


def test_a_backward_pass_that_raises_keeps_the_updates_already_made() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(
        model.parameters(),
        torch.optim.AdamW,
        bucket_cap_mb=BUCKET_CAPS["two_per_bucket"],
    )
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="failed in backward"):
        failing_loss(model).backward()
    after = snapshot(model)
    for name in before:
        changed = not torch.equal(after[name], before[name])
        assert changed == (not name.startswith("0.")), name
    assert len(optimizer.state) == 4


def test_after_a_backward_pass_that_raised_zero_grad_starts_clean() -> None:
    """With one bucket nothing was updated when backward raised, but the bucket had
    counted four gradients. After zero_grad() no bucket counts anything, and
    training goes on exactly like a plain optimizer's, every update inside
    backward."""
    reference, plain, model, in_bwd = plain_and_in_backward()
    for net, optimizer in ((reference, plain), (model, in_bwd)):
        with pytest.raises(RuntimeError, match="failed in backward"):
            failing_loss(net).backward()
        optimizer.zero_grad(set_to_none=True)
    assert [len(b.ready) for b in in_bwd._buckets()] == [0]
    for step in range(3):
        loss_fn(reference, step).backward()
        plain.step()
        plain.zero_grad()
        loss_fn(model, step).backward()
        assert all(p.grad is None for p in model.parameters()), step
        in_bwd.zero_grad()
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
    torch.testing.assert_close(
        in_bwd.state_dict()["state"], plain.state_dict()["state"], **BITWISE
    )


def test_gradient_hook_called_outside_backward_updates_its_bucket_at_once() -> None:
    """A hook called by hand (as FSDP does after a reduce-scatter) with no backward
    pass to wait for must not leave the update pending."""
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=1.0)
    weight = model[0].weight
    before = weight.detach().clone()
    weight.grad = torch.ones_like(weight)
    for hook in weight._post_accumulate_grad_hooks.values():
        hook(weight)
    assert weight.grad is None
    torch.testing.assert_close(weight.detach(), before - 1.0, **BITWISE)
    assert optimizer.grad_norm.item() == pytest.approx(weight.numel() ** 0.5)


# -- the training loop never needs to know ----------------------------------------------


def test_get_lr_and_schedulers_need_no_special_case() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward()
    plain_scheduler, in_bwd_scheduler = StepLR(plain, 1, 0.5), StepLR(in_bwd, 1, 0.5)
    for step in range(3):
        train(reference, plain, range(step, step + 1), plain_scheduler)
        train(model, in_bwd, range(step, step + 1), in_bwd_scheduler)
        assert training.get_lr(in_bwd) == training.get_lr(plain)


# -- distributed (2 processes, gloo) ---------------------------------------------------


@pytest.mark.parametrize(
    "scenario", [n for n in SCENARIOS if not n.startswith("checkpoint_client")]
)
def test_two_gloo_processes(
    optimizer_in_backward_distributed_run: DistributedRun, scenario: str
) -> None:
    """FSDP2 and plain-module runs: training equivalence and grad_norm, and
    in-backward <-> plain resume through DCP's get/set_optimizer_state_dict (sharded
    and full) and torchtune's get_full_/load_from_full_optimizer_state_dict, with
    torch AdamW, torchao's AdamW8bit (FSDP2) and bitsandbytes' AdamW8bit (replicas),
    and through sharded step checkpoints. See optimizer_in_backward_scenarios.py."""
    outcome = optimizer_in_backward_distributed_run.outcome(scenario)
    assert outcome == "ok", outcome


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
