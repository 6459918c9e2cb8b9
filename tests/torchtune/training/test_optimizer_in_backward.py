"""Tests for torchtune/training/memory.py: ``OptimizerInBackward``.

Sections: the plain optimizer's face; training with LR schedulers; state dicts;
``step()`` and ``zero_grad()``; frozen and added parameters; buckets and gradient
memory; ``grad_norm``; the bucket state view and the wrapped optimizer's attributes;
scaling and clipping inside ``backward()``; every optimizer family (torch.optim,
bitsandbytes, torchao); 2 gloo processes. The CUDA tests are in test_memory_cuda.py.

Tolerances: an in-backward run and a plain run apply the same optimizer kernels to the
same values, parameter by parameter, so they must agree bitwise (``rtol=0, atol=0``):
an optimizer step over a bucket does the per-element arithmetic of the plain step over
all parameters, and ``grad_norm`` takes the norm of the per-parameter norms stacked in
parameter order, as ``clip_grad_norm_`` does, whatever order the gradients arrive in.
The exceptions are explained where they are made: torchao's bf16 stochastic rounding,
and one norm computed another way (all squares summed at once).
"""

from __future__ import annotations

import copy
import functools
import pickle
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import bitsandbytes.optim as bnb
import pytest
import torch
import torchao.optim as ao
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR
from torch.testing import assert_close

from tests.helpers import (
    BITWISE,
    batch,
    loss_fn,
    make_model,
    one_process_group,
    train,
    weights_of,
)
from tests.torchtune.distributed_launcher import DistributedRun
from tests.torchtune.training.optimizer_in_backward_scenarios import (
    ADAMW,
    SCENARIOS,
    assert_same_params,
    assert_same_state_dict,
    freeze_first_layer,
    round_trip,
)
from torchtune import config, training
from torchtune.training import OptimizerInBackward, get_cosine_schedule_with_warmup
from torchtune.training.memory import (
    DEFAULT_BUCKET_CAP_MB,
    _BucketState,
    _local_bytes,
    hyperparameters,
)

MIB = 1024**2

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    "sgd_momentum": (
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    ),
    "adamw": ADAMW,
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
    return [len(bucket.params) for bucket in optimizer._buckets]


# Bucket caps. make_model's parameters hold 192, 32, 256, 32, 96 and 12 bytes.
# "two_per_bucket" (300 bytes) gives buckets [0.weight, 0.bias], [2.weight, 2.bias],
# [4.weight, 4.bias]; in two_groups' layout the same, as the first group is layer 0.
BUCKET_CAPS = {
    "per_parameter": 0,
    "two_per_bucket": 300 / MIB,
    "default_one_bucket": None,
}


def two_groups(model: nn.Module) -> list[dict]:
    """The first layer at twice the lr and without weight decay, the rest default."""
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return [{"params": first, "lr": 0.1, "weight_decay": 0.0}, {"params": rest}]


@pytest.fixture
def gloo_world_of_one() -> Iterator[DeviceMesh]:
    """A one-process gloo group and a 1-D mesh over it, torn down after the test."""
    with one_process_group():
        yield DeviceMesh("cpu", [0])


# -- the plain optimizer's face ---------------------------------------------------------


def test_the_class_and_build_optimizer_are_defined_in_training_memory() -> None:
    """Where torchtune 0.6.1 kept its in-backward pieces: importable from there, and
    defined there (not re-exported from another module)."""
    from torchtune.training import memory

    for name in ("OptimizerInBackward", "build_optimizer"):
        assert getattr(memory, name).__module__ == "torchtune.training.memory"
        assert getattr(training, name) is getattr(memory, name)


def test_param_groups_and_defaults_are_those_of_the_plain_optimizer() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward(
        "adamw_foreach", params=two_groups
    )
    assert in_bwd.defaults == plain.defaults
    assert len(in_bwd.param_groups) == 2
    for ours, theirs in zip(in_bwd.param_groups, plain.param_groups, strict=True):
        assert hyperparameters(ours) == hyperparameters(theirs)
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
    assert_close(weights_of(model), weights_of(reference), **BITWISE)


def test_params_and_optimizer_cls_may_be_keywords_and_the_cap_is_keyword_only() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(
        params=model.parameters(), optimizer_cls=torch.optim.SGD, lr=0.1
    )
    assert optimizer.param_groups[0]["lr"] == 0.1
    with pytest.raises(TypeError):
        OptimizerInBackward(model.parameters(), torch.optim.SGD, 0.5)


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


def test_get_lr_and_schedulers_need_no_special_case() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward()
    plain_scheduler, in_bwd_scheduler = StepLR(plain, 1, 0.5), StepLR(in_bwd, 1, 0.5)
    for step in range(3):
        train(reference, plain, range(step, step + 1), plain_scheduler)
        train(model, in_bwd, range(step, step + 1), in_bwd_scheduler)
        assert training.get_lr(in_bwd) == training.get_lr(plain)


# -- training with LR schedulers --------------------------------------------------------


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
        assert_close(weights_of(model), weights_of(reference), **BITWISE)
        assert in_bwd_scheduler.get_last_lr() == plain_scheduler.get_last_lr()
    assert_close(in_bwd.state_dict()["state"], plain.state_dict()["state"], **BITWISE)


def test_warmup_from_zero_lr_holds_every_parameter_at_step_zero() -> None:
    # 0.6.1 gave lr 0 only to the first parameter's optimizer.
    model = make_model()
    optimizer = OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, 3, 10)
    before = weights_of(model)
    train(model, optimizer, range(1), scheduler)
    assert_close(weights_of(model), before, **BITWISE)
    after_first = weights_of(model)
    train(model, optimizer, range(1, 2), scheduler)
    for name, param in model.named_parameters():
        assert not torch.equal(param, after_first[name]), name


def test_loaded_hyperparameters_are_the_ones_later_updates_use() -> None:
    """torch's load_state_dict replaces the param group dicts. The in-backward
    updates must read the new ones: the saved (scheduled) lr and the lr a scheduler
    sets after the load."""

    def run(in_backward: bool) -> dict[str, torch.Tensor]:
        def build(model: nn.Module) -> torch.optim.Optimizer:
            if in_backward:
                return OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
            return torch.optim.SGD(model.parameters(), lr=0.1)

        model = make_model()
        optimizer = build(model)
        train(model, optimizer, range(2), StepLR(optimizer, step_size=1, gamma=0.5))
        saved = copy.deepcopy(optimizer.state_dict())
        assert saved["param_groups"][0]["lr"] == 0.025
        resumed_model = make_model(seed=1)
        resumed_model.load_state_dict(model.state_dict())
        resumed = build(resumed_model)
        resumed.load_state_dict(saved)
        for step in range(2, 4):
            train(resumed_model, resumed, range(step, step + 1))
            for group in resumed.param_groups:
                group["lr"] *= 3.0
        return weights_of(resumed_model)

    assert_close(run(True), run(False), **BITWISE)


# -- state dicts ------------------------------------------------------------------------


def _saved_by(build: Callable[[nn.Module], torch.optim.Optimizer]) -> dict[str, Any]:
    model = make_model()
    optimizer = build(model)
    train(model, optimizer, range(1))
    return copy.deepcopy(optimizer.state_dict())


def _renamed(state_dict: dict[str, Any]) -> dict[str, Any]:
    state_dict["param_groups"][0]["param_names"][0] = "renamed.weight"
    return state_dict


def _swapped(state_dict: dict[str, Any]) -> dict[str, Any]:
    names = state_dict["param_groups"][0]["param_names"]
    names[0], names[1] = names[1], names[0]
    return state_dict


def _with_unknown_id(state_dict: dict[str, Any]) -> dict[str, Any]:
    state_dict["state"][99] = state_dict["state"][0]
    return state_dict


# (what saved it, what was changed, the message). torch refuses other group counts
# and sizes; OptimizerInBackward refuses what torch would load silently.
MISMATCHES = {
    "fewer_params": (
        lambda m: torch.optim.AdamW(m[0].parameters()),
        lambda sd: sd,
        "doesn't match the size",
    ),
    "more_params": (
        lambda m: torch.optim.AdamW([*m.parameters(), nn.Parameter(torch.ones(2))]),
        lambda sd: sd,
        "doesn't match the size",
    ),
    "other_group_count": (
        lambda m: torch.optim.AdamW(two_groups(m)),
        lambda sd: sd,
        "different number of parameter groups",
    ),
    "state_of_unknown_ids": (
        lambda m: torch.optim.AdamW(m.named_parameters()),
        _with_unknown_id,
        r"state for ids \[99\] in no param group",
    ),
    "other_param_names": (
        lambda m: torch.optim.AdamW(m.named_parameters()),
        _renamed,
        r"holds parameters \['renamed.weight', '0.bias'.*\], this optimizer "
        r"\['0.weight', '0.bias'",
    ),
    "same_names_in_another_order": (
        lambda m: torch.optim.AdamW(m.named_parameters()),
        _swapped,
        r"holds parameters \['0.bias', '0.weight'.*\], this optimizer "
        r"\['0.weight', '0.bias'",
    ),
}


@pytest.mark.parametrize("mismatch", MISMATCHES)
def test_a_state_dict_of_other_parameters_is_refused_before_anything_loads(
    mismatch: str,
) -> None:
    save, change, message = MISMATCHES[mismatch]
    model = make_model()
    optimizer = OptimizerInBackward(model.named_parameters(), torch.optim.AdamW)
    groups = copy.deepcopy(optimizer.param_groups)
    with pytest.raises(ValueError, match=message):
        optimizer.load_state_dict(change(_saved_by(save)))
    assert len(optimizer.state) == 0
    assert [hyperparameters(g) for g in optimizer.param_groups] == [
        hyperparameters(g) for g in groups
    ]


def test_a_state_dict_saved_with_the_same_names_loads_back() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.named_parameters(), torch.optim.AdamW)
    loss_fn(model, 0).backward()
    saved = optimizer.state_dict()
    optimizer.load_state_dict(copy.deepcopy(saved))
    reloaded = optimizer.state_dict()
    assert_close(reloaded["state"], saved["state"], **BITWISE)
    assert reloaded["param_groups"] == saved["param_groups"]


def test_0_6_1_checkpoint_is_refused_saying_how_to_convert_it() -> None:
    model = make_model()
    saved = {
        name: torch.optim.AdamW([p]).state_dict()
        for name, p in model.named_parameters()
    }
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError) as error:
        optimizer.load_state_dict(saved)
    message = str(error.value)
    assert "got keys ['0.weight', '0.bias', '2.weight', '2.bias', '4.weight']" in (
        message
    )
    assert (
        "torchtune.training.optim_in_bwd_legacy_state_dict."
        "convert_legacy_optim_in_bwd_state_dict(state_dict, "
        "model.named_parameters())" in message
    )
    assert len(optimizer.state) == 0


def test_state_dict_hooks_run_where_the_plain_optimizers_run() -> None:
    """Hooks registered on the in-backward optimizer are the wrapped optimizer's and
    run at the same points as on a plain one."""
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    calls = []

    def save_pre(opt):
        calls.append("save_pre")

    def save_post(opt, state_dict):
        calls.append("save_post")
        return {**state_dict, "saved_by": "post"}

    def load_pre(opt, state_dict):
        calls.append("load_pre")
        groups = [{**g, "lr": 0.7} for g in state_dict["param_groups"]]
        return {"state": state_dict["state"], "param_groups": groups}

    def load_post(opt):
        calls.append("load_post")

    optimizer.register_state_dict_pre_hook(save_pre)
    optimizer.register_state_dict_post_hook(save_post)
    optimizer.register_load_state_dict_pre_hook(load_pre)
    optimizer.register_load_state_dict_post_hook(load_post)
    wrapped = optimizer._optimizer
    for name, hook in (
        ("_optimizer_state_dict_pre_hooks", save_pre),
        ("_optimizer_state_dict_post_hooks", save_post),
        ("_optimizer_load_state_dict_pre_hooks", load_pre),
        ("_optimizer_load_state_dict_post_hooks", load_post),
    ):
        assert list(getattr(wrapped, name).values()) == [hook], name

    state_dict = optimizer.state_dict()
    assert calls == ["save_pre", "save_post"] and state_dict["saved_by"] == "post"
    optimizer.load_state_dict(state_dict)
    assert calls == ["save_pre", "save_post", "load_pre", "load_post"]
    assert [g["lr"] for g in optimizer.param_groups] == [0.7]


def test_dcp_state_initialization_creates_the_plain_optimizers_state() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward()
    plain_state = get_optimizer_state_dict(reference, plain)
    in_bwd_state = get_optimizer_state_dict(model, in_bwd)
    assert_close(in_bwd_state["state"], plain_state["state"], **BITWISE)
    # The zero-gradient step DCP takes runs with lr=0: the weights do not move.
    assert_close(weights_of(model), weights_of(make_model()), **BITWISE)


# -- step() and zero_grad() -------------------------------------------------------------


def test_step_after_backward_changes_nothing() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=0.1)
    loss_fn(model, 0).backward()
    assert all(p.grad is None for p in model.parameters())
    after_backward = weights_of(model)
    optimizer.step()
    assert_close(weights_of(model), after_backward, **BITWISE)


def test_step_updates_params_holding_a_grad_exactly_like_plain_step() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward()
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        a.grad = torch.full_like(a, 0.5)
        b.grad = torch.full_like(b, 0.5)
    plain.step()
    in_bwd.step()
    assert_close(weights_of(model), weights_of(reference), **BITWISE)
    assert all(p.grad is None for p in model.parameters())
    assert_close(in_bwd.state_dict()["state"], plain.state_dict()["state"], **BITWISE)


def test_step_with_a_closure_raises() -> None:
    optimizer = OptimizerInBackward(make_model().parameters(), torch.optim.AdamW)
    with pytest.raises(NotImplementedError, match="closure"):
        optimizer.step(lambda: torch.tensor(0.0))


def test_zero_grad_sets_grads_to_none_unless_told_otherwise() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # set by hand: no hook runs
    optimizer.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# Far above the gradient norms of make_model's first losses (0.51 and 0.13), so a
# clipped backward multiplies each gradient by exactly 1: bitwise the unclipped step.
NEVER_CLIPS_HERE = 1e6


@pytest.mark.parametrize("first_cap", [None, 0], ids=["one_bucket", "per_parameter"])
@pytest.mark.parametrize("clipped", [False, True], ids=["backward", "clipped_backward"])
def test_a_second_optimizer_over_the_same_params_takes_them_over(
    first_cap: float | None, clipped: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The first one's hooks are removed, so each backward updates each parameter
    once, as one plain optimizer with the second's hyperparameters. Without the
    takeover the first (built with another lr) updated some or all of them, and in
    the second's clipped backward, whose first pass only measures, updated them in
    each of the two passes."""
    cls, kwargs = ADAMW
    model = make_model()
    first = OptimizerInBackward(
        model.parameters(), cls, bucket_cap_mb=first_cap, lr=0.5, weight_decay=0.0
    )
    max_norm = NEVER_CLIPS_HERE if clipped else None
    second = OptimizerInBackward(model.parameters(), cls, max_norm=max_norm, **kwargs)
    assert "took over 6 parameters that an earlier one (AdamW)" in caplog.text
    for step in range(2):
        second.backward(loss_fn(model, step))
        for optimizer in (first, second):
            optimizer.step()
            optimizer.zero_grad()
    reference = make_model()
    plain = cls(reference.parameters(), **kwargs)
    train(reference, plain, range(2))
    assert_close(weights_of(model), weights_of(reference), **BITWISE)
    assert_same_state_dict(second.state_dict(), plain.state_dict())
    # The first keeps its param_groups (and so its state dict's layout), no state.
    assert len(first.param_groups[0]["params"]) == 6 and not first.state


def test_the_earlier_optimizers_step_leaves_the_params_taken_over_alone() -> None:
    """Gradients set by hand (no hook runs) are stepped by the instance that took
    the parameters over, once; the earlier one's step() skips them."""
    model = make_model()
    first = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.5)
    second = OptimizerInBackward(model[4].parameters(), torch.optim.SGD, lr=0.1)
    reference = make_model()
    plain = torch.optim.SGD(
        [
            {"params": list(reference[:4].parameters()), "lr": 0.5},
            {"params": list(reference[4].parameters())},
        ],
        lr=0.1,
    )
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        a.grad = torch.full_like(a, 0.25)
        b.grad = torch.full_like(b, 0.25)
    plain.step()
    first.step()
    assert all(p.grad is not None for p in model[4].parameters())
    second.step()
    assert_close(weights_of(model), weights_of(reference), **BITWISE)


# -- frozen and added parameters --------------------------------------------------------


def test_frozen_params_get_no_update_no_state_and_stay_in_param_groups() -> None:
    cls, kwargs = ADAMW
    reference = freeze_first_layer(make_model())
    model = freeze_first_layer(make_model())
    plain = cls(reference.parameters(), **kwargs)
    optimizer = OptimizerInBackward(model.parameters(), cls, **kwargs)
    assert len(optimizer.param_groups[0]["params"]) == 6  # as in the plain optimizer
    train(reference, plain, range(3))
    train(model, optimizer, range(3))
    assert_close(weights_of(model), weights_of(reference), **BITWISE)
    assert_close(model[0].weight, make_model()[0].weight, **BITWISE)
    assert model[0].weight not in optimizer.state
    assert optimizer.state_dict()["state"].keys() == {2, 3, 4, 5}
    # The same format as the plain one's: a fresh plain optimizer loads it and
    # trains on exactly like the uninterrupted one.
    fresh_reference = make_model()
    fresh_reference.load_state_dict(model.state_dict())
    freeze_first_layer(fresh_reference)
    fresh = cls(fresh_reference.parameters(), **kwargs)
    fresh.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert_close(fresh.state_dict(), plain.state_dict(), **BITWISE)
    train(reference, plain, range(3, 5))
    train(fresh_reference, fresh, range(3, 5))
    assert_close(weights_of(fresh_reference), weights_of(reference), **BITWISE)


def test_param_unfrozen_later_is_updated_like_with_the_plain_optimizer() -> None:
    cls, kwargs = ADAMW
    reference = freeze_first_layer(make_model())
    model = freeze_first_layer(make_model())
    plain = cls(reference.parameters(), **kwargs)
    optimizer = OptimizerInBackward(model.parameters(), cls, **kwargs)
    train(reference, plain, range(2))
    train(model, optimizer, range(2))
    reference[0].requires_grad_(True)
    model[0].requires_grad_(True)
    train(reference, plain, range(2, 5))
    train(model, optimizer, range(2, 5))
    assert_close(weights_of(model), weights_of(reference), **BITWISE)
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
    assert_close(weights_of(model), weights_of(reference), **BITWISE)
    assert_close(optimizer.state_dict(), plain.state_dict(), **BITWISE)
    loss_fn(model, 3).backward()
    assert all(p.grad is None for p in model.parameters())


def test_add_param_group_with_a_param_already_in_a_group_raises() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match="more than one parameter group"):
        optimizer.add_param_group({"params": [model[0].weight]})


# -- buckets and gradient memory --------------------------------------------------------


# (dtype, numels, bucket_cap_mb, parameters per bucket). A bucket takes consecutive
# parameters while their gradient bytes stay within the cap, and each bucket counts
# from zero.
BUCKETINGS = {
    # float32, 4 bytes an element: two fill an 8-byte cap exactly, in each bucket.
    "exactly_full": (torch.float32, [1, 1, 1, 1], 8 / MIB, [2, 2]),
    # 8 bytes alone; then 4 + 4 > 7 in the second bucket too.
    "over_the_cap": (torch.float32, [2, 1, 1], 7 / MIB, [1, 1, 1]),
    # The cap is in MiB of gradient bytes: 512 KiB each in float32...
    "mib_float32": (torch.float32, [128 * 1024] * 3, 1, [2, 1]),
    # ...256 KiB each in bfloat16.
    "mib_bfloat16": (torch.bfloat16, [128 * 1024] * 3, 1, [3]),
    # The default: 4 MiB, four 1 MiB parameters.
    "default": (torch.float32, [256 * 1024] * 5, None, [4, 1]),
    "per_parameter": (torch.float32, [1, 2, 3], 0, [1, 1, 1]),
}


@pytest.mark.parametrize("bucketing", BUCKETINGS)
def test_buckets_hold_consecutive_params_up_to_the_cap_in_mib_of_gradients(
    bucketing: str,
) -> None:
    dtype, numels, cap, expected = BUCKETINGS[bucketing]
    assert DEFAULT_BUCKET_CAP_MB == 4.0
    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]
    optimizer = OptimizerInBackward(params, torch.optim.SGD, lr=0.1, bucket_cap_mb=cap)
    assert bucket_sizes(optimizer) == expected
    flat = [p for bucket in optimizer._buckets for p in bucket.params]
    assert all(a is b for a, b in zip(flat, params, strict=True))


def test_dtensor_params_are_counted_by_their_local_shard(
    gloo_world_of_one: DeviceMesh,
) -> None:
    mesh = gloo_world_of_one
    plain = torch.zeros(5, 3, dtype=torch.bfloat16)
    assert _local_bytes(plain) == 5 * 3 * 2
    # As rank 0 of 2 would hold it: local rows 4 of 8.
    sharded = DTensor.from_local(
        torch.zeros(4, 3),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=(8, 3),
        stride=(3, 1),
    )
    assert sharded.numel() == 24
    assert _local_bytes(sharded) == 4 * 3 * 4


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "16"])
def test_bucket_cap_must_be_a_non_negative_number(bad: object) -> None:
    with pytest.raises((ValueError, TypeError), match="bucket_cap_mb must be"):
        OptimizerInBackward(
            make_model().parameters(), torch.optim.AdamW, bucket_cap_mb=bad
        )


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
        assert_close(weights_of(model), weights_of(reference), **BITWISE)
        assert_close(in_bwd.grad_norm, expected_norm, **BITWISE)
        in_bwd.step()
        in_bwd.zero_grad()
    assert in_bwd.state[model[2].weight]["step"] == 2
    assert_close(in_bwd.state_dict()["state"], plain.state_dict()["state"], **BITWISE)


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
    before = weights_of(model)
    with pytest.raises(RuntimeError, match="failed in backward"):
        failing_loss(model).backward()
    after = weights_of(model)
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
    assert [len(b.ready) for b in in_bwd._buckets] == [0]
    for step in range(3):
        loss_fn(reference, step).backward()
        plain.step()
        plain.zero_grad()
        loss_fn(model, step).backward()
        assert all(p.grad is None for p in model.parameters()), step
        in_bwd.zero_grad()
    assert_close(weights_of(model), weights_of(reference), **BITWISE)
    assert_close(in_bwd.state_dict()["state"], plain.state_dict()["state"], **BITWISE)


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
    assert_close(weight.detach(), before - 1.0, **BITWISE)
    assert optimizer.grad_norm.item() == pytest.approx(weight.numel() ** 0.5)


# -- grad_norm --------------------------------------------------------------------------


def test_grad_norm_is_bitwise_clip_grad_norms_total_norm_of_a_plain_run() -> None:
    reference, plain, model, in_bwd = plain_and_in_backward()
    for step in range(4):
        loss_fn(reference, step).backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
        plain.step()
        plain.zero_grad()
        loss_fn(model, step).backward()
        assert_close(in_bwd.grad_norm, expected, **BITWISE)
        in_bwd.step()
        in_bwd.zero_grad()


@pytest.mark.parametrize("max_norm", [None, 1e-3], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("reset", ["none", "model.zero_grad"])
def test_grad_norm_is_the_last_backward_passs_whatever_the_loop_resets(
    max_norm: float | None, reset: str
) -> None:
    """Without optimizer.zero_grad() (nothing, or model.zero_grad(), which plain torch
    lets a loop call instead), grad_norm reads the last pass's gradients alone,
    bitwise a twin run's that calls optimizer.zero_grad(), and holds one norm per
    parameter: after 50 steps as many as after one."""

    def run(zero: Callable[[nn.Module, OptimizerInBackward], None]) -> tuple:
        model = make_model()
        optimizer = OptimizerInBackward(
            model.parameters(), torch.optim.SGD, lr=0.1, max_norm=max_norm
        )
        norms, recorded = [], []
        for step in range(50):
            optimizer.backward(loss_fn(model, step))
            norms.append(optimizer.grad_norm)
            recorded.append(len(optimizer._grad_norms))
            optimizer.step()
            zero(model, optimizer)
        return torch.stack(norms), max(recorded)

    def by_loop(model: nn.Module, _: OptimizerInBackward) -> None:
        if reset == "model.zero_grad":
            model.zero_grad()

    norms, recorded = run(by_loop)
    expected, expected_recorded = run(lambda _, optimizer: optimizer.zero_grad())
    assert_close(norms, expected, **BITWISE)
    assert recorded == expected_recorded == len(list(make_model().parameters()))


def test_an_added_groups_params_are_updated_in_the_next_backward() -> None:
    model = make_model()
    groups = [{"params": list(model[i].parameters())} for i in (0, 2)]
    optimizer = OptimizerInBackward(groups, torch.optim.SGD, lr=0.1, bucket_cap_mb=0)
    optimizer.add_param_group({"params": list(model[4].parameters())})
    before = [p.detach().clone() for p in model[4].parameters()]
    loss_fn(model, 0).backward()  # no step(): the update happens in backward
    for p, old in zip(model[4].parameters(), before, strict=True):
        assert p.grad is None
        assert not torch.equal(p.detach(), old)


def test_grad_norm_is_zero_before_backward_and_after_zero_grad() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    assert optimizer.grad_norm.item() == 0.0
    loss_fn(model, 0).backward()
    assert optimizer.grad_norm.item() > 0.0
    assert optimizer.grad_norm.dtype == torch.float32 and optimizer.grad_norm.ndim == 0
    optimizer.zero_grad()
    assert optimizer.grad_norm.item() == 0.0


def test_grad_norm_of_dtensor_and_plain_gradients_is_the_plain_paths_bitwise(
    gloo_world_of_one: DeviceMesh,
) -> None:
    """Sharded, replicated and partial DTensor gradients and plain ones, alone and
    mixed: the in-backward norm is bitwise the plain path's
    (``scale_and_clip_grads_``; DTensor reduces each mesh's norms), and it is the
    norm of all the gradients together. How the reduction runs across ranks is
    checked on 2 processes by the FSDP scenarios."""
    mesh = gloo_world_of_one
    torch.manual_seed(0)
    sharded = nn.Parameter(DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)]))
    replicated = nn.Parameter(DTensor.from_local(torch.randn(3), mesh, [Replicate()]))
    plain = nn.Parameter(torch.randn(2))
    partial = nn.Parameter(DTensor.from_local(torch.randn(3), mesh, [Replicate()]))
    cases = ([sharded], [replicated], [sharded, replicated, plain], [partial, plain])
    for params in cases:
        optimizer = OptimizerInBackward(params, torch.optim.SGD, lr=0.0)
        grads = []
        for i, p in enumerate(params):
            grad = torch.full(p.shape, float(i + 1))
            if p is partial:
                grad = DTensor.from_local(grad, mesh, [Partial()])
            elif isinstance(p, DTensor):
                grad = DTensor.from_local(grad, mesh, p.placements)
            p.grad = grad
            grads.append(grad.full_tensor() if isinstance(grad, DTensor) else grad)
        expected = training.scale_and_clip_grads_(params)
        optimizer.step()
        assert_close(optimizer.grad_norm, expected, **BITWISE)
        # rtol: the reference sums all squares at once, not per parameter, which
        # rounds differently by a few float32 ulps (eps is 1.2e-7).
        everything = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        assert_close(optimizer.grad_norm, everything, rtol=1e-6, atol=0)


# -- the bucket state view and the wrapped optimizer's attributes -----------------------


def test_a_buckets_state_is_a_live_view_of_the_owners_state() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    params = list(model.parameters())
    (bucket,) = optimizer._buckets
    view = bucket.optimizer.state
    assert isinstance(view, _BucketState)
    assert len(view) == 0 and list(view) == [] and params[0] not in view
    assert view.get(params[0], "none") == "none"
    assert len(optimizer.state) == 0  # get() created nothing

    loss_fn(model, 0).backward()
    assert len(view) == len(params) == len(optimizer.state)
    assert list(view) == params  # the bucket's order
    for p in params:
        assert p in view and view[p] is optimizer.state[p]
        assert view.get(p) is optimizer.state[p]
    assert repr(view).startswith("_BucketState({")

    del view[params[1]]
    assert params[1] not in optimizer.state and len(view) == len(params) - 1
    view[params[1]] = {"marker": 1}
    assert optimizer.state[params[1]] == {"marker": 1}
    # Like a defaultdict(dict): reading a missing entry creates it.
    del optimizer.state[params[2]]
    assert view[params[2]] == {} and params[2] in optimizer.state


def test_a_buckets_state_refuses_tensors_of_other_buckets() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, bucket_cap_mb=0
    )
    loss_fn(model, 0).backward()
    first, second = optimizer._buckets[:2]
    other = second.params[0]
    equal_but_other = first.params[0].detach().clone()
    view = first.optimizer.state
    assert other in optimizer.state and other not in view
    assert equal_but_other not in view
    assert view.get(other, "none") == "none"
    for key in (other, equal_but_other):
        with pytest.raises(KeyError, match="bucket's parameters"):
            view[key]
        with pytest.raises(KeyError, match="bucket's parameters"):
            view[key] = {}
        with pytest.raises(KeyError, match="bucket's parameters"):
            del view[key]
    assert len(optimizer.state) == 6


class _FlavouredSGD(torch.optim.SGD):
    flavour = "vanilla"

    def describe(self) -> str:
        return f"{self.flavour} SGD"


def test_public_attributes_are_the_wrapped_optimizers() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), _FlavouredSGD, lr=0.1)
    assert optimizer.flavour == "vanilla" and optimizer.describe() == "vanilla SGD"
    with pytest.raises(AttributeError, match="no attribute 'not_there'"):
        _ = optimizer.not_there
    with pytest.raises(AttributeError, match="'OptimizerInBackward' object has no"):
        _ = optimizer._private_of_the_wrapped
    # Before __init__ has run (as during unpickling) nothing is forwarded.
    bare = OptimizerInBackward.__new__(OptimizerInBackward)
    with pytest.raises(AttributeError, match="no attribute 'flavour'"):
        _ = bare.flavour


def test_state_param_groups_and_defaults_are_read_and_written_through() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    wrapped = optimizer._optimizer
    assert optimizer.param_groups is wrapped.param_groups
    assert optimizer.defaults is wrapped.defaults
    assert optimizer.state is wrapped.state
    groups, defaults, state = list(wrapped.param_groups), {"lr": 0.5}, {}
    optimizer.param_groups = groups
    optimizer.defaults = defaults
    optimizer.state = state
    assert wrapped.param_groups is groups
    assert wrapped.defaults is defaults
    assert wrapped.state is state


def test_repr_names_the_wrapped_optimizer_and_copies_are_refused() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    assert repr(optimizer) == f"OptimizerInBackward({optimizer._optimizer!r})"
    for copier in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="Save state_dict"):
            copier(optimizer)


# -- scaling and clipping inside backward() ---------------------------------------------
# Bitwise as a plain step: the in-backward optimizer multiplies each gradient by the
# same factors, with the same operations, measures it with the same kernel and combines
# the norms in the same order as the plain step does after backward, and a second
# backward pass over the same graph recomputes the same gradients. The 2-process FSDP2
# counterpart is the fsdp_clipped_training_matches_plain_bitwise scenario.

# The plain run's grad norms of the last _train_both call, step by step.
NORMS: list[torch.Tensor] = []
VOCAB, WIDTH, TOKENS = 40, 12, (3, 8)
# A max_norm under every step's norm (clips every step), and one above it (never).
CLIPS, NEVER_CLIPS = 0.05, 1e6


class TinyLM(nn.Module):
    """Embedding, a dropout MLP block and an output projection: enough for the
    gradients to differ in size and arrive in an order that is not parameter order."""

    def __init__(self, *, sparse: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, sparse=sparse)
        self.block = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH),
            nn.Dropout(0.2),
            nn.GELU(),
            nn.Linear(2 * WIDTH, WIDTH),
        )
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.out(h + self.block(h))


def _lm(dtype: torch.dtype = torch.float32, **kwargs) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(**kwargs).to(dtype)


def _loss_sum(model: nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A recipe's loss: the token sum of the cross-entropy, and the token count."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, TOKENS, generator=g)
    labels = torch.randint(0, VOCAB, TOKENS, generator=g)
    labels[0, :3] = -100  # ignored tokens, as padding is
    torch.manual_seed(100 + step)  # the same dropout masks in both runs
    logits = model(tokens).float()
    loss = nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum"
    )
    return loss, (labels != -100).sum()


def _train_both(
    make,
    make_optimizer,
    *,
    max_norm: float | None,
    steps: int = 4,
    bucket_cap_mb: float | None = None,
    wrap=None,
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    plain_model = make()
    bwd_model = copy.deepcopy(plain_model)
    if wrap is not None:
        wrap(plain_model)
        wrap(bwd_model)
    plain = make_optimizer(list(plain_model.parameters()))
    in_bwd = OptimizerInBackward(
        bwd_model.parameters(),
        make_optimizer,
        bucket_cap_mb=bucket_cap_mb,
        max_norm=max_norm,
    )
    NORMS.clear()
    for step in range(steps):
        loss, tokens = _loss_sum(plain_model, step)
        loss.backward()
        plain_norm = training.scale_and_clip_grads_(
            plain_model.parameters(), 1 / tokens, max_norm
        )
        NORMS.append(plain_norm)
        plain.step()
        plain.zero_grad(set_to_none=True)

        loss, tokens = _loss_sum(bwd_model, step)
        in_bwd.backward(loss, grad_scale=1 / tokens)
        assert all(p.grad is None for p in bwd_model.parameters())
        assert_close(in_bwd.grad_norm, plain_norm, **BITWISE)
        in_bwd.step()
        in_bwd.zero_grad(set_to_none=True)
    return plain_model, bwd_model, plain, in_bwd


def _assert_same(plain_model, bwd_model, plain, in_bwd) -> None:
    assert_close(
        dict(bwd_model.named_parameters()),
        dict(plain_model.named_parameters()),
        **BITWISE,
    )
    assert_close(in_bwd.state_dict()["state"], plain.state_dict()["state"], **BITWISE)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("max_norm", [None, CLIPS, NEVER_CLIPS, float("inf")])
@pytest.mark.parametrize("bucket_cap_mb", [0, None])
def test_in_backward_scaling_and_clipping_equal_plain_bitwise(
    dtype, max_norm, bucket_cap_mb
) -> None:
    runs = _train_both(
        lambda: _lm(dtype), _adamw, max_norm=max_norm, bucket_cap_mb=bucket_cap_mb
    )
    _assert_same(*runs)
    # The max_norms do what their names say: every step's norm is above CLIPS and
    # below NEVER_CLIPS.
    norms = torch.stack(NORMS).float()
    assert bool((norms > CLIPS).all()) and bool((norms < NEVER_CLIPS).all())


def test_clipping_every_step_changes_the_result() -> None:
    """The clipped runs above would pass if clipping did nothing: pin that it acts."""
    clipped = _train_both(_lm, _adamw, max_norm=CLIPS)[1]
    unclipped = _train_both(_lm, _adamw, max_norm=None)[1]
    assert not torch.equal(clipped.out.weight, unclipped.out.weight)


def test_in_backward_clipping_is_exact_through_activation_checkpointing() -> None:
    """Non-reentrant activation checkpointing recomputes the block in each backward
    pass and restores the dropout RNG each time: the second pass sees the first's
    gradients."""

    def wrap(model: TinyLM) -> None:
        # torch's default wrapper is the non-reentrant checkpoint.
        training.set_activation_checkpointing(model, {nn.Sequential})
        assert isinstance(model.block, CheckpointWrapper)

    _assert_same(*_train_both(_lm, _adamw, max_norm=CLIPS, wrap=wrap))


def test_in_backward_sgd_on_fp16_and_complex_parameters_equals_plain_bitwise() -> None:
    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    _assert_same(*_train_both(lambda: _lm(torch.float16), sgd, max_norm=CLIPS))

    torch.manual_seed(0)
    z = nn.Parameter(torch.randn(5, dtype=torch.complex64))
    w = nn.Parameter(torch.randn(5, dtype=torch.float64))
    plain_params = [z, w]
    bwd_params = [nn.Parameter(z.detach().clone()), nn.Parameter(w.detach().clone())]
    plain = torch.optim.Adam(plain_params, lr=0.1)
    in_bwd = OptimizerInBackward(bwd_params, torch.optim.Adam, lr=0.1, max_norm=0.5)
    for step in range(3):
        target = torch.full((5,), 1.0 + step)
        (plain_params[0].abs() * plain_params[1] - target).square().sum().backward()
        plain_norm = training.scale_and_clip_grads_(plain_params, 0.5, 0.5)
        plain.step()
        plain.zero_grad()
        loss = (bwd_params[0].abs() * bwd_params[1] - target).square().sum()
        in_bwd.backward(loss, grad_scale=0.5)
        assert in_bwd.grad_norm.dtype == torch.float64  # the widest dtype's precision
        assert_close(in_bwd.grad_norm, plain_norm, **BITWISE)
        in_bwd.zero_grad()
    assert_close(bwd_params, plain_params, **BITWISE)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
        lambda params: torch.optim.Adagrad(params, lr=0.5),
    ],
    ids=["sgd", "adagrad"],
)
def test_in_backward_sparse_embedding_gradients_equal_plain_bitwise(
    make_optimizer,
) -> None:
    _assert_same(*_train_both(lambda: _lm(sparse=True), make_optimizer, max_norm=CLIPS))


def test_sparse_adam_in_backward_equals_plain_bitwise() -> None:
    """SparseAdam takes sparse gradients only: an embedding alone."""

    def make():
        torch.manual_seed(0)
        return nn.Embedding(VOCAB, WIDTH, sparse=True)

    plain_model = make()
    bwd_model = copy.deepcopy(plain_model)
    plain = torch.optim.SparseAdam(plain_model.parameters(), lr=0.1)
    in_bwd = OptimizerInBackward(
        bwd_model.parameters(), torch.optim.SparseAdam, lr=0.1, max_norm=0.5
    )
    for step in range(3):
        tokens = torch.randint(
            0, VOCAB, (10,), generator=torch.Generator().manual_seed(step)
        )
        plain_model(tokens).square().sum().backward()
        norm = training.scale_and_clip_grads_(plain_model.parameters(), 0.1, 0.5)
        plain.step()
        plain.zero_grad()
        in_bwd.backward(bwd_model(tokens).square().sum(), grad_scale=0.1)
        assert_close(in_bwd.grad_norm, norm, **BITWISE)
        in_bwd.zero_grad()
    assert_close(bwd_model.weight, plain_model.weight, **BITWISE)


def test_a_plain_backward_with_clipping_on_raises_before_updating_anything() -> None:
    model = _lm()
    before = copy.deepcopy(model.state_dict())
    optimizer = OptimizerInBackward(model.parameters(), _adamw, max_norm=1.0)
    loss, _ = _loss_sum(model, 0)
    with pytest.raises(
        RuntimeError,
        match=r"clips gradients \(max_norm=1.0\).*optimizer\.backward\(loss\)",
    ):
        loss.backward()
    assert_close(model.state_dict(), before, **BITWISE)
    assert not optimizer.state
    optimizer.zero_grad()
    # Turning clipping off makes a plain backward update again.
    optimizer.max_norm = None
    _loss_sum(model, 0)[0].backward()
    assert len(optimizer.state) == len(list(model.parameters()))


def _count_backward_passes(optimizer: OptimizerInBackward, model: TinyLM) -> int:
    passes = []
    handle = model.out.register_full_backward_hook(lambda *args: passes.append(1))
    optimizer.backward(_loss_sum(model, 0)[0])
    handle.remove()
    return len(passes)


def test_clipping_off_runs_one_backward_pass_and_on_runs_two() -> None:
    model = _lm()
    optimizer = OptimizerInBackward(model.parameters(), _adamw)
    assert _count_backward_passes(optimizer, model) == 1
    optimizer.max_norm = float("inf")  # clip_grad_norm='inf': nothing to clip
    assert _count_backward_passes(optimizer, model) == 1
    optimizer.max_norm = 1.0
    assert _count_backward_passes(optimizer, model) == 2


def test_step_clips_gradients_set_by_hand_as_the_plain_step_does() -> None:
    """Gradients written to ``.grad`` (no hook runs): step() does what the plain
    optimizer does after clip_grad_norm_."""
    plain_model = _lm()
    bwd_model = copy.deepcopy(plain_model)
    plain = _adamw(plain_model.parameters())
    in_bwd = OptimizerInBackward(bwd_model.parameters(), _adamw, max_norm=CLIPS)
    _loss_sum(plain_model, 0)[0].backward()
    for p, q in zip(plain_model.parameters(), bwd_model.parameters(), strict=True):
        q.grad = p.grad.clone()
    norm = training.scale_and_clip_grads_(plain_model.parameters(), max_norm=CLIPS)
    plain.step()
    in_bwd.step()
    assert_close(in_bwd.grad_norm, norm, **BITWISE)
    _assert_same(plain_model, bwd_model, plain, in_bwd)


def test_max_norm_must_be_a_positive_number() -> None:
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="max_norm must be a positive number"):
            OptimizerInBackward(_lm().parameters(), _adamw, max_norm=bad)


def test_before_update_pass_runs_once_between_the_passes_of_a_clipped_backward():
    """It sees every gradient measured and no parameter updated yet; without
    clipping there is one pass and it is not called."""
    model = _lm()
    before = copy.deepcopy(model.state_dict())
    optimizer = OptimizerInBackward(model.parameters(), _adamw, max_norm=CLIPS)
    seen = []

    def between() -> None:
        assert_close(model.state_dict(), before, **BITWISE)
        seen.append(optimizer.grad_norm.clone())

    optimizer.backward(_loss_sum(model, 0)[0], before_update_pass=between)
    assert len(seen) == 1
    assert_close(seen[0], optimizer.grad_norm, **BITWISE)
    assert not torch.equal(model.out.weight, before["out.weight"])
    optimizer.zero_grad()
    optimizer.max_norm = None
    optimizer.backward(_loss_sum(model, 1)[0], before_update_pass=between)
    assert len(seen) == 1


# -- every optimizer family -------------------------------------------------------------
# For each optimizer a torchtune config can name, in fp32 and bf16: five in-backward
# steps give the plain optimizer's parameters and state dict, and a checkpoint saved
# after three steps resumes in every direction to exactly what plain -> plain gives.

STEPS = 5
RESUME_AT = 3

# name -> (optimizer class, kwargs). Learning rates are large enough that five steps
# move every parameter by many ulps, so a wrong update cannot hide in rounding.
FAMILIES: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]] = {
    "torch.SGD(momentum)": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "torch.Adam(foreach)": (torch.optim.Adam, {"lr": 1e-2, "foreach": True}),
    "torch.Adam(fused)": (torch.optim.Adam, {"lr": 1e-2, "fused": True}),
    "torch.AdamW(foreach)": (torch.optim.AdamW, {"lr": 1e-2, "foreach": True}),
    "torch.AdamW(fused)": (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
    "torch.AdamW(amsgrad)": (torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}),
    "torch.Adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
    "torch.NAdam": (torch.optim.NAdam, {"lr": 1e-2}),
    "torch.RAdam": (torch.optim.RAdam, {"lr": 1e-2}),
    "torch.Adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "torch.Adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "torch.RMSprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5}),
    "bnb.AdamW": (bnb.AdamW, {"lr": 1e-2}),
    "bnb.AdamW8bit": (bnb.AdamW8bit, {"lr": 1e-2}),
    "bnb.PagedAdamW": (bnb.PagedAdamW, {"lr": 1e-2}),
    "bnb.PagedAdamW8bit": (bnb.PagedAdamW8bit, {"lr": 1e-2}),
    "bnb.PagedAdamW32bit": (bnb.PagedAdamW32bit, {"lr": 1e-2}),
    "bnb.Lion8bit": (bnb.Lion8bit, {"lr": 1e-3}),
    "torchao.AdamW8bit": (ao.AdamW8bit, {"lr": 1e-2}),
    "torchao.AdamW4bit": (ao.AdamW4bit, {"lr": 1e-2}),
    "torchao._AdamW(bf16_stochastic_round)": (
        ao._AdamW,
        {"lr": 1e-2, "bf16_stochastic_round": True},
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Optimizers whose state holds a quantized (8- or 4-bit) form of the weights' moments.
QUANTIZED = {
    "bnb.AdamW8bit",
    "bnb.PagedAdamW8bit",
    "bnb.Lion8bit",
    "torchao.AdamW8bit",
    "torchao.AdamW4bit",
}

CASES = [
    pytest.param(name, dtype_name, id=f"{name}-{dtype_name}")
    for name in FAMILIES
    for dtype_name in DTYPES
]

# With bf16 stochastic rounding, torchao rounds each updated bf16 parameter up or down
# at random, drawing from the global RNG one parameter after the other. The plain
# optimizer updates the parameters in param-group order, the in-backward one in the
# order backward produces their gradients (the reverse), so the same random numbers
# go to different parameters and the results cannot be bitwise equal. Each step can
# put an element one bf16 ulp apart (2**-7 of its magnitude, at most 2**-3 here: the
# Linear init bound is 1/sqrt(64)), so after five steps elements are at most five
# such ulps apart, absolute. (A relative bound would not hold: a few elements sit
# near zero.) In fp32 the flag does nothing and everything is bitwise.
STOCHASTIC_ROUNDING_TOLERANCE = {"rtol": 0.0, "atol": STEPS * 2**-7 * 2**-3}


def tolerance(name: str, dtype: torch.dtype) -> dict[str, float]:
    if name == "torchao._AdamW(bf16_stochastic_round)" and dtype == torch.bfloat16:
        return STOCHASTIC_ROUNDING_TOLERANCE
    return BITWISE


def make_wide_model(dtype: torch.dtype) -> nn.Module:
    # Two 64x64 weights (4096 elements: the smallest size that bitsandbytes and
    # torchao quantize, and a multiple of torchao's block sizes) and one 64-element
    # bias, whose state both keep unquantized. So each run mixes both kinds of state.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64, bias=False)
    ).to(dtype)


def train_wide(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, dtype
) -> None:
    # The same loop for both kinds: with OptimizerInBackward, backward() updates the
    # parameters and step() finds nothing left to do.
    for step in steps:
        torch.manual_seed(1000 + step)  # the data and any random rounding per step
        x = torch.randn(8, 64, dtype=dtype)
        loss = (model(x) - x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def build(
    name: str, in_backward: bool, model: nn.Module, bucket_cap_mb: float | None = None
) -> torch.optim.Optimizer:
    cls, kwargs = FAMILIES[name]
    with warnings.catch_warnings():
        # Paged bitsandbytes optimizers fall back to unpaged memory on the CPU.
        warnings.simplefilter("ignore")
        if in_backward:
            return OptimizerInBackward(
                model.parameters(), cls, bucket_cap_mb=bucket_cap_mb, **kwargs
            )
        return cls(model.parameters(), **kwargs)


@functools.cache
def plain_run(name: str, dtype_name: str) -> tuple[nn.Module, dict[str, Any]]:
    """The reference: the plain optimizer for all steps, and its final state dict."""
    dtype = DTYPES[dtype_name]
    model = make_wide_model(dtype)
    optimizer = build(name, False, model)
    train_wide(model, optimizer, range(STEPS), dtype)
    return model, optimizer.state_dict()


def resumed_run(
    name: str, dtype_name: str, *, save_in_backward: bool, load_in_backward: bool
) -> tuple[nn.Module, dict[str, Any]]:
    """Train RESUME_AT steps, save model and optimizer through a file, build a new
    model and optimizer, load both, and train the remaining steps."""
    dtype = DTYPES[dtype_name]
    model = make_wide_model(dtype)
    optimizer = build(name, save_in_backward, model)
    train_wide(model, optimizer, range(RESUME_AT), dtype)
    model_state = round_trip(model.state_dict())
    optimizer_state = round_trip(optimizer.state_dict())

    resumed = make_wide_model(dtype)
    resumed.load_state_dict(model_state)
    optimizer = build(name, load_in_backward, resumed)
    optimizer.load_state_dict(optimizer_state)
    train_wide(resumed, optimizer, range(RESUME_AT, STEPS), dtype)
    return resumed, optimizer.state_dict()


@functools.cache
def plain_resumed_run(name: str, dtype_name: str) -> tuple[nn.Module, dict[str, Any]]:
    return resumed_run(name, dtype_name, save_in_backward=False, load_in_backward=False)


# The default cap puts the model's three parameters in one bucket, stepped by one
# optimizer call; 0 gives each its own.
FAMILY_BUCKETINGS = {"one_bucket": None, "per_parameter": 0}
DIRECTIONS = {
    "plain->in_bwd": (False, True),
    "in_bwd->plain": (True, False),
    "in_bwd->in_bwd": (True, True),
}


@pytest.mark.parametrize("bucketing", FAMILY_BUCKETINGS)
@pytest.mark.parametrize(("name", "dtype_name"), CASES)
def test_every_family_in_backward_gives_the_plain_parameters_and_state_dict(
    name: str, dtype_name: str, bucketing: str
) -> None:
    dtype = DTYPES[dtype_name]
    model = make_wide_model(dtype)
    optimizer = build(name, True, model, FAMILY_BUCKETINGS[bucketing])
    assert len(optimizer._buckets) == (1 if bucketing == "one_bucket" else 3)
    train_wide(model, optimizer, range(STEPS), dtype)
    plain_model, plain_state = plain_run(name, dtype_name)

    tol = tolerance(name, dtype)
    assert_same_params(model, plain_model, **tol)
    # The in-backward state dict is the plain class's own: the same entries, dtypes
    # and packing (bitsandbytes' __bnb_optimizer_quant_state__, torchao's subclasses).
    assert_same_state_dict(optimizer.state_dict(), plain_state, **tol)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(("name", "dtype_name"), CASES)
def test_every_family_resumes_in_any_direction_as_plain_to_plain(
    name: str, dtype_name: str, direction: str
) -> None:
    save_in_backward, load_in_backward = DIRECTIONS[direction]
    model, state = resumed_run(
        name,
        dtype_name,
        save_in_backward=save_in_backward,
        load_in_backward=load_in_backward,
    )
    expected_model, expected_state = plain_resumed_run(name, dtype_name)

    tol = tolerance(name, DTYPES[dtype_name])
    assert_same_params(model, expected_model, **tol)
    assert_same_state_dict(state, expected_state, **tol)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_optimizers_keep_their_low_bit_state_through_a_resume(
    name: str, dtype_name: str
) -> None:
    # Guards the matrix itself: the weights' moments really are stored in 8 or 4 bits
    # (so the tests above exercise the quantized code), and a resumed in-backward
    # optimizer holds them in the same form, not cast to the parameters' dtype.
    _, state = resumed_run(
        name, dtype_name, save_in_backward=True, load_in_backward=True
    )
    weight_state = state["state"][0]  # the first 64x64 weight
    if name.startswith("bnb."):
        quant = weight_state["__bnb_optimizer_quant_state__"]
        assert quant["state1"].dtype == torch.uint8
        assert quant["absmax1"].dtype == torch.float32
    else:
        assert type(weight_state["exp_avg"]).__name__ in {
            "OptimState8bit",
            "OptimState4bit",
        }


# torch.distributed.checkpoint's state-dict API, on one process, for one optimizer of
# each family. The distributed (FSDP2) case is covered by the 2-process tests.
DCP_FAMILIES = ["torch.AdamW(foreach)", "bnb.PagedAdamW8bit", "torchao.AdamW8bit"]


@pytest.mark.parametrize("full_state_dict", [True, False], ids=["full", "sharded"])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("name", DCP_FAMILIES)
def test_dcp_get_and_set_optimizer_state_dict_resume_like_plain(
    name: str, direction: str, full_state_dict: bool
) -> None:
    dtype = torch.bfloat16
    options = StateDictOptions(full_state_dict=full_state_dict)
    runs = {}
    for key, (save, load) in {
        "plain": (False, False),
        "tested": DIRECTIONS[direction],
    }.items():
        model = make_wide_model(dtype)
        optimizer = build(name, save, model)
        train_wide(model, optimizer, range(RESUME_AT), dtype)
        saved = round_trip(get_optimizer_state_dict(model, optimizer, options=options))
        model_state = round_trip(model.state_dict())
        resumed = make_wide_model(dtype)
        resumed.load_state_dict(model_state)
        optimizer = build(name, load, resumed)
        set_optimizer_state_dict(resumed, optimizer, saved, options=options)
        train_wide(resumed, optimizer, range(RESUME_AT, STEPS), dtype)
        runs[key] = (resumed, optimizer.state_dict())

    assert_same_params(runs["tested"][0], runs["plain"][0])
    assert_same_state_dict(runs["tested"][1], runs["plain"][1])


# -- distributed (2 processes, gloo) ----------------------------------------------------


# The checkpoint_manager_* scenarios are checkpointing/test_checkpoint_manager.py's.
@pytest.mark.parametrize(
    "scenario", [n for n in SCENARIOS if not n.startswith("checkpoint_manager")]
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


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_a_non_finite_loss_updates_nothing_and_reads_a_non_finite_norm(
    max_norm: float | None,
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    before = copy.deepcopy(model.state_dict())
    optimizer = OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, lr=0.1, max_norm=max_norm
    )
    loss = model(torch.randn(4, 3)).sum() * float("nan")
    optimizer.backward(loss)
    assert_close(model.state_dict(), before, **BITWISE)
    assert not torch.isfinite(optimizer.grad_norm)
    assert all(p.grad is None for p in model.parameters())


def test_with_clipping_a_non_finite_norm_updates_nothing() -> None:
    # A finite loss whose gradients are not: the measuring pass sees a non-finite
    # norm, so the updating pass does not run.
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    before = copy.deepcopy(model.state_dict())
    optimizer = OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, lr=0.1, max_norm=1.0
    )
    # sqrt at 0: the loss is 0, its gradient inf * 0 = NaN.
    loss = model(torch.randn(4, 3)).square().sum().mul(0).sqrt()
    assert torch.isfinite(loss)
    optimizer.backward(loss)
    assert_close(model.state_dict(), before, **BITWISE)
    assert not torch.isfinite(optimizer.grad_norm)


# -- loops users write: compile with clipping, loss scaling, code ported from plain ----


def _compiled_lm_loss(model: nn.Module, step: int) -> torch.Tensor:
    """A batch of another length each step: after the second, torch.compile builds
    a graph for dynamic shapes, whose backward it compiles ahead of time."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (2, 4 + 3 * step), generator=g)
    torch.manual_seed(100 + step)  # the same dropout masks in every run
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


@pytest.fixture
def fresh_compile() -> Iterator[None]:
    """torch.compile as in a new process: no graph compiled, donated buffers on (the
    default) before, and both restored after."""
    torch._dynamo.reset()
    with torch._functorch.config.patch(donated_buffer=True):
        yield
    torch._dynamo.reset()


def test_a_compiled_model_with_clipping_trains_as_plain_compiled_bitwise(
    fresh_compile: None,
) -> None:
    """The clipped backward runs the compiled backward twice; with the default
    donated buffers the second batch length made it raise at step 3. aot_eager runs
    the traced aten ops eagerly: the plain run's kernels."""
    plain_model, bwd_model = _lm(), _lm()
    in_bwd = OptimizerInBackward(bwd_model.parameters(), _adamw, max_norm=CLIPS)
    plain = _adamw(plain_model.parameters())
    compiled_plain = torch.compile(plain_model, backend="aot_eager")
    compiled_bwd = torch.compile(bwd_model, backend="aot_eager")
    for step in range(4):
        _compiled_lm_loss(compiled_plain, step).backward()
        norm = training.scale_and_clip_grads_(plain_model.parameters(), None, CLIPS)
        plain.step()
        plain.zero_grad()
        in_bwd.backward(_compiled_lm_loss(compiled_bwd, step))
        assert_close(in_bwd.grad_norm, norm, **BITWISE)
        assert norm > CLIPS  # clipped
    _assert_same(plain_model, bwd_model, plain, in_bwd)


def test_a_model_compiled_and_trained_before_the_optimizer_is_compiled_again(
    fresh_compile: None,
) -> None:
    """Graphs compiled before the clipping optimizer was built, with donated
    buffers, would run their backward twice on memory it may reuse: they are
    compiled again (counted here), and training goes on bitwise as the same model's
    without compile."""
    compiles = []

    def counting_aot_eager(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        compiles.append(1)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def run(compiled: bool) -> nn.Module:
        model = _lm()
        forward = (
            torch.compile(model, backend=counting_aot_eager) if compiled else model
        )
        plain = _adamw(model.parameters())
        for step in range(2):  # the second length compiles the dynamic graph
            _compiled_lm_loss(forward, step).backward()
            plain.step()
            plain.zero_grad()
        compiled_before = len(compiles)
        optimizer = OptimizerInBackward(model.parameters(), _adamw, max_norm=CLIPS)
        optimizer.load_state_dict(plain.state_dict())
        del plain
        for step in range(2, 4):
            optimizer.backward(_compiled_lm_loss(forward, step))
        if compiled:
            assert len(compiles) > compiled_before == 2
        return model

    assert_close(
        weights_of(run(compiled=True)), weights_of(run(compiled=False)), **BITWISE
    )


def test_grad_scaler_step_is_refused_naming_bf16() -> None:
    """torch.amp.GradScaler unscales and checks for infs after backward, too late
    for updates made in it: its step() is refused with what to do instead (it used
    to fail on "No inf checks were recorded")."""
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_fn(model, 0)).backward()
    with pytest.raises(RuntimeError, match=r"loss scaling.*bf16.*optimizer_in_bwd"):
        scaler.step(optimizer)


def test_a_plain_backward_that_updates_says_once_that_gradients_are_freed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Code ported from a plain loop reads gradients after backward
    (clip_grad_norm_ returns 0 and clips nothing): the first loss.backward() that
    updates names what to use instead; optimizer.backward() is the documented way
    and says nothing."""
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    optimizer.backward(loss_fn(model, 0))
    assert "frees their gradients" not in caplog.text
    for step in range(2):
        loss_fn(model, step).backward()
    assert caplog.text.count("frees their gradients") == 1
    for what in (
        "clip_grad_norm_",
        "optimizer.grad_norm",
        "max_norm",
        "backward(loss)",
    ):
        assert what in caplog.text


def test_a_plain_optimizer_over_params_updated_in_backward_is_refused() -> None:
    """It would see no gradient and silently change nothing: refused before it
    steps, naming the OptimizerInBackward; over other parameters it steps as ever."""
    model = make_model()
    OptimizerInBackward(list(model[0].parameters()), torch.optim.AdamW)
    other = torch.optim.SGD(model[2].parameters(), lr=0.1)
    both = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn(model, 0).backward()
    before = model[2].weight.detach().clone()
    other.step()
    assert not torch.equal(model[2].weight, before)
    with pytest.raises(
        RuntimeError, match=r"SGD.step\(\).*OptimizerInBackward \(AdamW\)"
    ):
        both.step()


def test_step_hooks_run_around_step_after_the_update_in_backward() -> None:
    """As documented in step(): the pre-hook sees the parameters backward updated,
    and runs before the post-hook."""
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    initial = model[0].weight.detach().clone()
    seen = []
    optimizer.register_step_pre_hook(
        lambda *_: seen.append(("pre", torch.equal(model[0].weight, initial)))
    )
    optimizer.register_step_post_hook(lambda *_: seen.append(("post", None)))
    loss_fn(model, 0).backward()
    optimizer.step()
    assert seen == [("pre", False), ("post", None)]


def test_a_non_scalar_loss_gets_torchs_message() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError) as torchs:
        model(batch(0)).backward()
    with pytest.raises(RuntimeError) as ours:
        optimizer.backward(model(batch(0)))
    assert str(ours.value).startswith(str(torchs.value))
    assert not optimizer.state
