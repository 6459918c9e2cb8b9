"""Tests for torchtune/training/optim_in_bwd_deprecated.py: torchtune 0.6.1's
optimizer-in-backward API, which recipes written against 0.6.1 still call.

As in test_memory.py, the per-parameter optimizers apply the same kernels to the same
values as a plain optimizer, so results must agree bitwise.
"""

from __future__ import annotations

import copy
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)

from tests.torchtune.training.test_memory import (
    ADAMW,
    BITWISE,
    freeze_first_layer,
    legacy_checkpoint,
    loss_fn,
    make_model,
    reference_after_6_steps,
    snapshot,
    train,
    two_groups,
)
from torchtune import training
from torchtune.training import get_cosine_schedule_with_warmup
from torchtune.training.memory import (
    OptimizerInBackwardWrapper,
    create_optim_in_bwd_wrapper,
    register_optim_in_bwd_hooks,
)


def test_0_6_1_recipe_calls_warn_and_update_each_parameter_once() -> None:
    cls, kwargs = ADAMW
    reference = make_model()
    plain = cls(reference.parameters(), **kwargs)
    plain_scheduler = get_cosine_schedule_with_warmup(plain, 2, 6)
    train(reference, plain, range(6), plain_scheduler)

    model = make_model()
    optim_dict = {p: cls([p], **kwargs) for p in model.parameters()}
    with pytest.warns(DeprecationWarning, match="OptimizerInBackward"):
        register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
    with pytest.warns(DeprecationWarning, match="OptimizerInBackward"):
        wrapper = create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict)
    assert list(wrapper.optim_map) == [n for n, _ in model.named_parameters()]
    # 0.6.1 recipes built the scheduler on one per-parameter optimizer.
    scheduler = get_cosine_schedule_with_warmup(
        next(iter(wrapper.optim_map.values())), 2, 6
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("error", UserWarning)  # no scheduler-order warnings
        wrapper.set_lr_scheduler(scheduler)
        for step in range(6):
            loss_fn(model, step).backward()
            scheduler.step()
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
    assert wrapper.get_last_lr() == plain_scheduler.get_last_lr()[0]
    assert wrapper.get_optim_key("lr") == plain.param_groups[0]["lr"]
    assert training.get_lr(wrapper) == training.get_lr(plain)
    wrapper.step_lr_scheduler()
    plain_scheduler.step()
    assert wrapper.get_last_lr() == plain_scheduler.get_last_lr()[0]


def test_0_6_1_wrapper_built_after_registered_hooks_takes_them_over() -> None:
    cls, kwargs = ADAMW
    reference = make_model()
    train(reference, cls(reference.parameters(), **kwargs), range(3))
    model = make_model()
    optim_dict = {p: cls([p], **kwargs) for p in model.parameters()}
    with pytest.warns(DeprecationWarning):
        register_optim_in_bwd_hooks(model, optim_dict)
        wrapper = OptimizerInBackwardWrapper(
            {n: optim_dict[p] for n, p in model.named_parameters()}
        )
    for step in range(3):
        loss_fn(model, step).backward()
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
    assert len(wrapper.state) == 6


def test_hand_written_0_6_1_hook_that_steps_and_clears_is_not_doubled() -> None:
    cls, kwargs = ADAMW
    reference = make_model()
    train(reference, cls(reference.parameters(), **kwargs), range(3))
    model = make_model()
    optim_dict = {p: cls([p], **kwargs) for p in model.parameters()}

    def step_and_clear(param: torch.Tensor) -> None:
        optim_dict[param].step()
        optim_dict[param].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_and_clear)
    with pytest.warns(DeprecationWarning):
        create_optim_in_bwd_wrapper(model, optim_dict)
    for step in range(3):
        loss_fn(model, step).backward()
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)


def test_0_6_1_wrapper_state_dict_is_standard_and_loads_legacy_format() -> None:
    cls, kwargs = ADAMW
    model = make_model()
    legacy = copy.deepcopy(legacy_checkpoint(model, "single_device"))
    with pytest.warns(DeprecationWarning):
        wrapper = create_optim_in_bwd_wrapper(
            model, {p: cls([p], **kwargs) for p in model.parameters()}
        )
    wrapper.load_state_dict(legacy)
    saved = wrapper.state_dict()
    assert set(saved) == {"state", "param_groups"}
    plain = cls(model.parameters(), **kwargs)
    plain.load_state_dict(copy.deepcopy(saved))
    train(model, plain, range(3, 6))
    torch.testing.assert_close(
        snapshot(model), snapshot(reference_after_6_steps()), **BITWISE
    )


def test_state_loaded_through_a_0_6_1_per_parameter_optimizer_is_used() -> None:
    cls, kwargs = ADAMW
    model = make_model()
    legacy = copy.deepcopy(legacy_checkpoint(model, "single_device"))
    with pytest.warns(DeprecationWarning):
        wrapper = create_optim_in_bwd_wrapper(
            model, {p: cls([p], **kwargs) for p in model.parameters()}
        )
    # What 0.6.1 recipes did to resume: load each per-parameter optimizer.
    for name, optimizer in wrapper.optim_map.items():
        optimizer.load_state_dict(legacy[name])
    assert len(wrapper.state) == 6
    train(model, wrapper, range(3, 6))
    torch.testing.assert_close(
        snapshot(model), snapshot(reference_after_6_steps()), **BITWISE
    )


def test_add_param_group_on_0_6_1_wrapper_raises_clearly() -> None:
    model = make_model()
    with pytest.warns(DeprecationWarning):
        wrapper = OptimizerInBackwardWrapper(
            {"0.weight": torch.optim.AdamW([model[0].weight])}
        )
    with pytest.raises(RuntimeError, match="add_param_group is not supported"):
        wrapper.add_param_group({"params": [model[0].bias]})


def test_each_parameter_keeps_the_hyperparameters_of_its_own_optimizer() -> None:
    cls, kwargs = ADAMW
    reference = make_model()
    plain = cls(two_groups(reference), **kwargs)
    train(reference, plain, range(3))

    model = make_model()
    optim_dict = {
        p: cls([p], **{**kwargs, **{k: v for k, v in group.items() if k != "params"}})
        for group in two_groups(model)
        for p in group["params"]
    }
    with pytest.warns(DeprecationWarning):
        register_optim_in_bwd_hooks(model, optim_dict)
        wrapper = create_optim_in_bwd_wrapper(model, optim_dict)
    # Parameters whose optimizers agree share a group, as in the plain optimizer.
    assert [(g["lr"], g["weight_decay"]) for g in wrapper.param_groups] == [
        (g["lr"], g["weight_decay"]) for g in plain.param_groups
    ]
    train(model, wrapper, range(3))
    torch.testing.assert_close(snapshot(model), snapshot(reference), **BITWISE)
    # So its state dict is the plain two-group optimizer's.
    plain.load_state_dict(copy.deepcopy(wrapper.state_dict()))


def frozen_reference_after_6_steps() -> torch.nn.Module:
    cls, kwargs = ADAMW
    reference = freeze_first_layer(make_model())
    train(reference, cls(reference.parameters(), **kwargs), range(6))
    return reference


@pytest.fixture
def one_process_group():
    """A gloo process group of one process, for torchtune's distributed helpers."""
    dist.init_process_group(
        "gloo",
        rank=0,
        world_size=1,
        store=dist.HashStore(),
        timeout=timedelta(seconds=60),
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("style", ["single_device", "distributed"])
def test_0_6_1_checkpoint_with_frozen_entries_resumes_through_optim_map(
    style: str, one_process_group: None
) -> None:
    # 0.6.1 recipes built a per-parameter optimizer for every parameter, frozen ones
    # included, saved one entry for each, and resumed through optim_map[name].
    model = freeze_first_layer(make_model())
    saved = copy.deepcopy(legacy_checkpoint(model, style))
    assert {"0.weight", "0.bias"} <= set(saved)

    cls, kwargs = ADAMW
    optim_dict = {p: cls([p], **kwargs) for p in model.parameters()}
    with pytest.warns(DeprecationWarning):
        register_optim_in_bwd_hooks(model, optim_dict)
        wrapper = create_optim_in_bwd_wrapper(model, optim_dict)
    assert list(wrapper.optim_map) == [n for n, _ in model.named_parameters()]
    for name, entry in saved.items():
        if style == "single_device":
            wrapper.optim_map[name].load_state_dict(entry)
        else:  # the call of 0.6.1's distributed recipes, in a 1-process group
            training.load_from_full_optimizer_state_dict(
                model, wrapper.optim_map[name], entry, torch.device("cpu")
            )
    assert len(wrapper.state) == 4  # the trainable parameters' moments
    train(model, wrapper, range(3, 6))
    torch.testing.assert_close(
        snapshot(model), snapshot(frozen_reference_after_6_steps()), **BITWISE
    )
    # And what a 0.6.1-API recipe saves (one entry per name) holds every parameter.
    resaved = {
        name: get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True)
        )
        for name, optimizer in wrapper.optim_map.items()
    }
    assert set(resaved) == set(saved)


# The public names of torchtune 0.6.1's torchtune/training/memory.py.
MEMORY_0_6_1 = [
    "set_activation_checkpointing",
    "cleanup_before_training",
    "OptimizerInBackwardWrapper",
    "create_optim_in_bwd_wrapper",
    "register_optim_in_bwd_hooks",
    "get_memory_stats",
    "log_memory_stats",
    "DEFAULT_LOG_MESSAGE",
]


@pytest.mark.parametrize("name", MEMORY_0_6_1)
def test_every_0_6_1_import_path_keeps_working(name: str) -> None:
    import importlib

    from torchtune.training import optim_in_bwd_deprecated

    memory = importlib.import_module("torchtune.training.memory")
    from_memory = getattr(memory, name)
    if name != "DEFAULT_LOG_MESSAGE":  # 0.6.1 did not export it from training
        assert getattr(training, name) is from_memory
    if name in optim_in_bwd_deprecated.__all__:
        assert from_memory is getattr(optim_in_bwd_deprecated, name)


def test_modules_import_without_a_cycle_in_any_order() -> None:
    import subprocess
    import sys

    for first in (
        "optim_in_bwd_deprecated",
        "optim_in_bwd_legacy_state_dict",
        "memory",
    ):
        code = (
            f"import torchtune.training.{first}; "
            "from torchtune.training.memory import create_optim_in_bwd_wrapper"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
