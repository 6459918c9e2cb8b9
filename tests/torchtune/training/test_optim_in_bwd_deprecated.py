"""Tests for torchtune/training/optim_in_bwd_deprecated.py: torchtune 0.6.1's
optimizer-in-backward API, which recipes written against 0.6.1 still call.

As in test_memory.py, the per-parameter optimizers apply the same kernels to the same
values as a plain optimizer, so results must agree bitwise.
"""

from __future__ import annotations

import copy
import gc
import re
import warnings
import weakref
from collections import OrderedDict
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
    loss_fn,
    make_model,
    reference_after_6_steps,
    snapshot,
    train,
    two_groups,
)
from tests.torchtune.training.test_optim_in_bwd_legacy_state_dict import (
    legacy_checkpoint,
    sgd_entries,
)
from torchtune import training
from torchtune.training import OptimizerInBackward, get_cosine_schedule_with_warmup
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


@pytest.mark.parametrize("hooks_first", [False, True], ids=["wrapper", "hooks"])
def test_0_6_1_wrapper_state_dict_is_standard_and_loads_legacy_format(
    hooks_first: bool,
) -> None:
    """With ``hooks_first``, as 0.6.1 recipes did: register_optim_in_bwd_hooks over
    the same per-parameter optimizers first, whose wrapper the second one replaces."""
    cls, kwargs = ADAMW
    model = make_model()
    legacy = copy.deepcopy(legacy_checkpoint(model, "single_device"))
    optim_dict = {p: cls([p], **kwargs) for p in model.parameters()}
    with pytest.warns(DeprecationWarning):
        if hooks_first:
            register_optim_in_bwd_hooks(model, optim_dict)
        wrapper = create_optim_in_bwd_wrapper(model, optim_dict)
    wrapper.load_state_dict(legacy)
    assert len(wrapper.state) == 6
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


def test_legacy_state_dict_with_an_extra_entry_is_refused_naming_it() -> None:
    cls, kwargs = ADAMW
    model = make_model()
    legacy = copy.deepcopy(legacy_checkpoint(model, "single_device"))
    legacy["9.weight"] = legacy["0.weight"]
    with pytest.warns(DeprecationWarning):
        wrapper = create_optim_in_bwd_wrapper(
            model, {p: cls([p], **kwargs) for p in model.parameters()}
        )
    with pytest.raises(ValueError, match=re.escape("missing [], extra ['9.weight']")):
        wrapper.load_state_dict(legacy)


def test_legacy_state_dict_sets_each_groups_hyperparameters_from_its_first_param() -> (
    None
):
    """0.6.1 schedulers stepped one per-parameter optimizer, so the entries' lrs can
    differ: each of the wrapper's groups (one per set of hyperparameters of the
    per-parameter optimizers) takes its first parameter's."""
    model = make_model()
    optim_dict = {
        p: torch.optim.SGD([p], lr=0.5 if i < 2 else 0.1)
        for i, p in enumerate(model.parameters())
    }
    with pytest.warns(DeprecationWarning):
        wrapper = create_optim_in_bwd_wrapper(model, optim_dict)
    assert [len(g["params"]) for g in wrapper.param_groups] == [2, 4]
    names = [n for n, _ in model.named_parameters()]
    legacy = sgd_entries(model, {n: 0.01 * (i + 1) for i, n in enumerate(names)})
    wrapper.load_state_dict(legacy)
    assert [g["lr"] for g in wrapper.param_groups] == [0.01, 0.03]


# -- state loaded through a per-parameter optimizer -----------------------------------


def test_a_per_parameter_optimizers_own_load_moves_its_state_to_the_wrapper() -> None:
    """0.6.1 recipes load per-parameter state through optim_map; the wrapper's state
    holds it right after, not only after the next update or save."""
    cls, kwargs = ADAMW
    model = make_model()
    with pytest.warns(DeprecationWarning):
        wrapper = create_optim_in_bwd_wrapper(
            model, {p: cls([p], **kwargs) for p in model.parameters()}
        )
    loss_fn(model, 0).backward()
    per_param, param = wrapper.optim_map["0.weight"], model[0].weight
    saved = copy.deepcopy(per_param.state_dict())
    loss_fn(model, 1).backward()
    per_param.load_state_dict(saved)
    torch.testing.assert_close(wrapper.state[param], saved["state"][0], **BITWISE)
    assert per_param.state[param] is wrapper.state[param]  # one state, shared again


class _LoadsWithoutTorchHooks(torch.optim.SGD):
    """Like bitsandbytes' optimizers: load_state_dict runs no torch hooks."""

    def load_state_dict(self, state_dict) -> None:
        hooks = self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_post_hooks = hooks


def test_a_load_that_runs_no_torch_hooks_is_what_the_next_save_holds() -> None:
    model = make_model()
    with pytest.warns(DeprecationWarning):
        wrapper = create_optim_in_bwd_wrapper(
            model,
            {
                p: _LoadsWithoutTorchHooks([p], lr=0.1, momentum=0.9)
                for p in model.parameters()
            },
        )
    loss_fn(model, 0).backward()
    per_param = wrapper.optim_map["2.weight"]
    post_hook_calls = []
    per_param.register_load_state_dict_post_hook(post_hook_calls.append)
    saved = copy.deepcopy(per_param.state_dict())
    loss_fn(model, 1).backward()
    per_param.load_state_dict(saved)
    assert post_hook_calls == []  # the class ran no torch hook
    pid = [n for n, _ in model.named_parameters()].index("2.weight")
    torch.testing.assert_close(
        wrapper.state_dict()["state"][pid], saved["state"][0], **BITWISE
    )


def test_adopted_per_parameter_optimizers_bring_the_state_they_hold() -> None:
    """0.6.1's create_optim_in_bwd_wrapper over per-parameter optimizers that have
    already stepped: their state is the wrapper's."""
    model = make_model()
    optim_dict = {p: torch.optim.AdamW([p]) for p in model.parameters()}
    loss_fn(model, 0).backward()
    for per_param in optim_dict.values():
        per_param.step()
    model.zero_grad()
    expected = {p: copy.deepcopy(o.state[p]) for p, o in optim_dict.items()}
    with pytest.warns(DeprecationWarning, match="OptimizerInBackward"):
        wrapper = create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict)
    assert len(wrapper.state) == len(expected)
    for p, entry in expected.items():
        torch.testing.assert_close(wrapper.state[p], entry, **BITWISE)


def test_a_replaced_per_parameter_optimizer_no_longer_writes_the_owners_state() -> None:
    """Loading into a per-parameter optimizer whose parameter another optimizer in
    backward took over leaves the new owner's state alone."""
    cls, kwargs = ADAMW
    model = make_model()
    with pytest.warns(DeprecationWarning):
        wrapper = create_optim_in_bwd_wrapper(
            model, {p: cls([p], **kwargs) for p in model.parameters()}
        )
    loss_fn(model, 0).backward()
    stale = wrapper.optim_map["0.weight"]
    saved = copy.deepcopy(stale.state_dict())
    second = OptimizerInBackward(model.parameters(), cls, **kwargs)
    assert "0.weight" not in wrapper.optim_map
    loss_fn(model, 1).backward()
    before = copy.deepcopy(second.state_dict()["state"])
    stale.load_state_dict(saved)
    torch.testing.assert_close(second.state_dict()["state"], before, **BITWISE)


def test_a_per_parameter_optimizer_loads_alone_once_the_wrapper_is_gone() -> None:
    """A per-parameter optimizer whose parameter another optimizer took over keeps
    what it loads, and goes on loading after its wrapper is garbage collected."""
    cls, kwargs = ADAMW
    model = make_model()
    weight = model[0].weight
    per_param = cls([weight], **kwargs)
    with pytest.warns(DeprecationWarning):
        wrapper = OptimizerInBackwardWrapper({"0.weight": per_param})
    loss_fn(model, 0).backward()
    saved = copy.deepcopy(per_param.state_dict())
    taker = OptimizerInBackward([weight], cls, **kwargs)
    per_param.load_state_dict(saved)
    wrapper_ref = weakref.ref(wrapper)
    del wrapper
    gc.collect()
    assert wrapper_ref() is None
    per_param.load_state_dict(saved)
    torch.testing.assert_close(per_param.state[weight], saved["state"][0], **BITWISE)
    assert weight not in taker.state


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
