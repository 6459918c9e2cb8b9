"""Tests for torchtune/training/optim_in_bwd_legacy_state_dict.py: torchtune 0.6.1's
in-backward checkpoints (parameter name -> per-parameter optimizer state dict) and
``convert_legacy_optim_in_bwd_state_dict``, in both of its forms.

Tolerances: every comparison is bitwise (``rtol=0, atol=0``). A converted state dict
holds the tensors 0.6.1's per-parameter optimizers saved, and the optimizer that
loads it, plain or in-backward, applies the same kernels to the same values as those
per-parameter optimizers would have gone on to (see test_optimizer_in_backward.py).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from tests.helpers import BITWISE, loss_fn, make_model, train, weights_of
from tests.torchtune.training.optimizer_in_backward_scenarios import (
    ADAMW,
    freeze_first_layer,
    reference_after_6_steps,
)
from torchtune.training import (
    OptimizerInBackward,
    set_activation_checkpointing,
)
from torchtune.training.optim_in_bwd_legacy_state_dict import (
    convert_legacy_optim_in_bwd_state_dict,
    is_legacy_in_bwd_state_dict,
)


def run_like_0_6_1(
    model: nn.Module, steps: range
) -> dict[torch.Tensor, torch.optim.Optimizer]:
    """What 0.6.1 recipes did: one AdamW per parameter (frozen ones included), each
    trainable one stepped by a hook."""
    cls, kwargs = ADAMW
    per_param = {p: cls([p], **kwargs) for p in model.parameters()}

    def step_and_clear(param: torch.Tensor) -> None:
        per_param[param].step()
        per_param[param].zero_grad()

    handles = [
        p.register_post_accumulate_grad_hook(step_and_clear)
        for p in per_param
        if p.requires_grad
    ]
    for step in steps:
        loss_fn(model, step).backward()
    for handle in handles:
        handle.remove()
    return per_param


def legacy_checkpoint(model: nn.Module, style: str) -> dict:
    """A 0.6.1 in-backward checkpoint after 3 steps: ``single_device`` recipes saved
    ``{name: optimizer.state_dict()}``, distributed ones the full state dict of each
    per-parameter optimizer, keyed by name inside too."""
    per_param = run_like_0_6_1(model, range(3))
    if style == "single_device":
        return {n: per_param[p].state_dict() for n, p in model.named_parameters()}
    return {
        n: get_optimizer_state_dict(
            model, per_param[p], options=StateDictOptions(full_state_dict=True)
        )
        for n, p in model.named_parameters()
    }


def with_activation_checkpointing(model: nn.Module) -> nn.Module:
    """``model`` with every linear layer wrapped, so its parameter names carry the
    wrapper's prefix, as in a 0.6.1 run with activation checkpointing on."""
    set_activation_checkpointing(model, {nn.Linear})
    assert all(_CHECKPOINT_PREFIX in name for name, _ in model.named_parameters())
    return model


def unwrapped_weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name.replace(_CHECKPOINT_PREFIX, ""): value
        for name, value in weights_of(model).items()
    }


def sgd_entries(model: nn.Module, lrs: dict[str, float]) -> dict:
    """A 0.6.1 in-backward state dict of SGD optimizers, no state yet: per parameter
    name in ``lrs``, with that learning rate."""
    return {
        name: torch.optim.SGD([p], lr=lrs[name]).state_dict()
        for name, p in model.named_parameters()
        if name in lrs
    }


BUILDS = {
    "plain": lambda cls, model, kw: cls(model.parameters(), **kw),
    "in_bwd": lambda cls, model, kw: OptimizerInBackward(model.parameters(), cls, **kw),
    "in_bwd_named": lambda cls, model, kw: OptimizerInBackward(
        model.named_parameters(), cls, **kw
    ),
}


# -- the format ------------------------------------------------------------------------


def test_only_a_mapping_of_per_parameter_state_dicts_is_the_0_6_1_format() -> None:
    model = make_model()
    assert is_legacy_in_bwd_state_dict(legacy_checkpoint(model, "single_device"))
    assert not is_legacy_in_bwd_state_dict(
        torch.optim.AdamW(model.parameters()).state_dict()
    )
    assert not is_legacy_in_bwd_state_dict({})
    assert not is_legacy_in_bwd_state_dict([])
    assert not is_legacy_in_bwd_state_dict({"0.weight": {"state": {}}})


@pytest.mark.parametrize("named", [False, True], ids=["name_keyed", "index_keyed"])
def test_a_standard_state_dict_is_refused(named: bool) -> None:
    model = make_model()
    standard = torch.optim.AdamW(model.parameters()).state_dict()
    args = (model.named_parameters(),) if named else ()
    with pytest.raises(ValueError, match="0.6.1 in-backward optimizer state dict"):
        convert_legacy_optim_in_bwd_state_dict(standard, *args)


@pytest.mark.parametrize("named", [False, True], ids=["name_keyed", "index_keyed"])
def test_an_entry_that_holds_more_than_one_parameter_is_refused(named: bool) -> None:
    model = make_model()
    legacy = sgd_entries(model, {"0.weight": 0.1})
    legacy["0.weight"] = torch.optim.SGD(model[0].parameters(), lr=0.1).state_dict()
    args = (model.named_parameters(),) if named else ()
    with pytest.raises(ValueError, match=r"'0.weight' should hold one parameter"):
        convert_legacy_optim_in_bwd_state_dict(legacy, *args)


# -- keyed by name (without named_params) ----------------------------------------------


@pytest.mark.parametrize(
    ("form", "build"),
    # Keyed by name (without named_params): set_optimizer_state_dict loads it, into
    # either mode; keyed by index (with named_params): load_state_dict, into any.
    [("name_keyed", build) for build in ("in_bwd", "plain")]
    + [("index_keyed", build) for build in BUILDS],
)
@pytest.mark.parametrize("style", ["single_device", "distributed"])
def test_either_form_loads_and_resumes_bitwise(
    style: str, form: str, build: str
) -> None:
    model = make_model()
    saved = copy.deepcopy(legacy_checkpoint(model, style))
    cls, kwargs = ADAMW
    optimizer = BUILDS[build](cls, model, kwargs)
    if form == "name_keyed":
        set_optimizer_state_dict(
            model, optimizer, convert_legacy_optim_in_bwd_state_dict(saved)
        )
    else:
        optimizer.load_state_dict(
            convert_legacy_optim_in_bwd_state_dict(saved, model.named_parameters())
        )
        assert len(optimizer.state) == 6
    train(model, optimizer, range(3, 6))
    torch.testing.assert_close(
        weights_of(model), weights_of(reference_after_6_steps()), **BITWISE
    )


def test_name_keyed_form_drops_the_activation_checkpointing_prefix() -> None:
    """The names 0.6.1 saved carry the wrapper's prefix; those of
    get_optimizer_state_dict never do, so the converted state dict loads into the
    wrapped model."""
    model = with_activation_checkpointing(make_model())
    saved = copy.deepcopy(legacy_checkpoint(model, "single_device"))
    converted = convert_legacy_optim_in_bwd_state_dict(saved)
    names = [name for name, _ in make_model().named_parameters()]
    assert converted["param_groups"][0]["params"] == names
    assert list(converted["state"]) == names
    cls, kwargs = ADAMW
    optimizer = cls(model.parameters(), **kwargs)
    set_optimizer_state_dict(model, optimizer, converted)
    train(model, optimizer, range(3, 6))
    torch.testing.assert_close(
        unwrapped_weights_of(model), weights_of(reference_after_6_steps()), **BITWISE
    )


def test_name_keyed_form_takes_the_first_entrys_hyperparameters() -> None:
    """0.6.1's scheduler drove the first per-parameter optimizer, the only one that
    holds its initial_lr."""
    model = make_model()
    names = [name for name, _ in model.named_parameters()]
    legacy = sgd_entries(model, {n: 0.01 * (i + 1) for i, n in enumerate(names)})
    legacy[names[0]]["param_groups"][0]["initial_lr"] = 0.5
    (group,) = convert_legacy_optim_in_bwd_state_dict(legacy)["param_groups"]
    assert group["lr"] == 0.01 and group["initial_lr"] == 0.5


# -- keyed by index (with named_params) ------------------------------------------------


@pytest.mark.parametrize(
    "saved_wrapped, loaded_wrapped", [(True, False), (False, True), (True, True)]
)
def test_index_form_matches_names_with_or_without_the_prefix_on_either_side(
    saved_wrapped: bool, loaded_wrapped: bool
) -> None:
    saving = make_model()
    if saved_wrapped:
        with_activation_checkpointing(saving)
    saved = copy.deepcopy(legacy_checkpoint(saving, "single_device"))
    model = make_model(seed=1)
    if loaded_wrapped:
        with_activation_checkpointing(model)
    with torch.no_grad():
        for param, trained in zip(model.parameters(), saving.parameters(), strict=True):
            param.copy_(trained)
    cls, kwargs = ADAMW
    optimizer = OptimizerInBackward(model.parameters(), cls, **kwargs)
    optimizer.load_state_dict(
        convert_legacy_optim_in_bwd_state_dict(saved, model.named_parameters())
    )
    train(model, optimizer, range(3, 6))
    torch.testing.assert_close(
        unwrapped_weights_of(model), weights_of(reference_after_6_steps()), **BITWISE
    )


@pytest.mark.parametrize("build", ["plain", "in_bwd"])
def test_index_form_gives_params_named_none_no_state(build: str) -> None:
    """As in 0.6.1's PPO recipe, which saved the value model's per-parameter
    optimizers only: the policy's parameters, first in the optimizer, are named
    None. The value model resumes as 0.6.1 would have; the policy starts afresh."""
    policy, value = make_model(seed=1), make_model()
    saved = copy.deepcopy(legacy_checkpoint(value, "single_device"))
    named = [(None, p) for p in policy.parameters()] + list(value.named_parameters())
    converted = convert_legacy_optim_in_bwd_state_dict(saved, named)
    assert sorted(converted["state"]) == list(range(6, 12))
    assert converted["param_groups"][0]["params"] == list(range(12))

    cls, kwargs = ADAMW
    both = nn.ModuleList([policy, value])
    optimizer = BUILDS[build](cls, both, kwargs)
    optimizer.load_state_dict(converted)
    assert not any(p in optimizer.state for p in policy.parameters())
    train(value, optimizer, range(3, 6))
    torch.testing.assert_close(
        weights_of(value), weights_of(reference_after_6_steps()), **BITWISE
    )
    torch.testing.assert_close(weights_of(policy), weights_of(make_model(seed=1)))


def test_index_form_names_the_missing_and_the_extra_params() -> None:
    model = make_model()
    saved = legacy_checkpoint(model, "single_device")

    def refused(legacy: dict) -> str:
        with pytest.raises(ValueError) as error:
            convert_legacy_optim_in_bwd_state_dict(legacy, model.named_parameters())
        return str(error.value)

    both = dict(saved)
    del both["4.bias"]
    both["ghost.weight"] = saved["4.weight"]
    assert "missing ['4.bias'], extra ['ghost.weight']" in refused(both)
    missing = {n: entry for n, entry in saved.items() if n != "0.weight"}
    assert "missing ['0.weight'], extra []" in refused(missing)
    assert "missing [], extra ['9.weight']" in refused(
        {**saved, "9.weight": saved["0.weight"]}
    )


@pytest.mark.parametrize("frozen_saved", [True, False], ids=["saved", "not_saved"])
def test_index_form_takes_frozen_params_with_or_without_an_entry(
    frozen_saved: bool,
) -> None:
    """0.6.1 recipes saved an entry for every parameter, frozen ones included (with
    no state); a frozen parameter without one is accepted too."""
    model = freeze_first_layer(make_model())
    saved = copy.deepcopy(legacy_checkpoint(model, "single_device"))
    if not frozen_saved:
        del saved["0.weight"], saved["0.bias"]
    converted = convert_legacy_optim_in_bwd_state_dict(saved, model.named_parameters())
    assert sorted(converted["state"]) == [2, 3, 4, 5]
    cls, kwargs = ADAMW
    optimizer = OptimizerInBackward(model.parameters(), cls, **kwargs)
    optimizer.load_state_dict(converted)
    train(model, optimizer, range(3, 6))
    reference = freeze_first_layer(make_model())
    train(reference, cls(reference.parameters(), **kwargs), range(6))
    torch.testing.assert_close(weights_of(model), weights_of(reference), **BITWISE)


def test_index_form_takes_the_hyperparameters_of_the_first_saved_param() -> None:
    """0.6.1 schedulers stepped one per-parameter optimizer, so the entries' lrs can
    differ: the group takes the first parameter's."""
    model = make_model()
    names = [name for name, _ in model.named_parameters()]
    legacy = sgd_entries(model, {n: 0.01 * (i + 1) for i, n in enumerate(names)})
    converted = convert_legacy_optim_in_bwd_state_dict(legacy, model.named_parameters())
    assert converted["param_groups"][0]["lr"] == 0.01


@pytest.mark.parametrize("build", ["plain", "in_bwd"])
def test_index_form_after_an_unsaved_frozen_first_param(build: str) -> None:
    """The first parameter frozen and absent from the 0.6.1 state dict (as a frozen
    base weight may be): the group's hyperparameters are the next parameter's, and
    every saved parameter's state loads."""
    model = make_model()
    model[0].weight.requires_grad_(False)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    legacy = sgd_entries(model, dict.fromkeys(trainable, 0.01))
    for i, (name, p) in enumerate(trainable.items()):
        legacy[name]["param_groups"][0]["momentum"] = 0.9
        legacy[name]["state"] = {0: {"momentum_buffer": torch.full_like(p, i + 1.0)}}
    optimizer = BUILDS[build](torch.optim.SGD, model, {"lr": 0.1, "momentum": 0.9})
    optimizer.load_state_dict(
        convert_legacy_optim_in_bwd_state_dict(legacy, model.named_parameters())
    )
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert set(optimizer.state) == set(trainable.values())
    for name, entry in legacy.items():
        torch.testing.assert_close(
            optimizer.state[trainable[name]], entry["state"][0], **BITWISE
        )


@pytest.mark.parametrize(
    "bad",
    [
        lambda model: model.parameters(),
        lambda model: [["0.weight", model[0].weight]],
        lambda model: [("0.weight", model[0].weight, 0)],
        lambda model: [(model[0].weight, "0.weight")],
        lambda model: [(0, model[0].weight)],
    ],
    ids=["params", "list", "triple", "swapped", "int_name"],
)
def test_named_params_must_be_name_and_parameter_pairs(bad) -> None:
    model = make_model()
    legacy = legacy_checkpoint(model, "single_device")
    with pytest.raises(TypeError, match=re.escape("(name or None, parameter) pairs")):
        convert_legacy_optim_in_bwd_state_dict(legacy, bad(model))


def test_a_state_dict_in_another_format_is_refused_naming_its_first_keys() -> None:
    not_legacy = {f"key{i}": i for i in range(7)}
    with pytest.raises(ValueError) as error:
        convert_legacy_optim_in_bwd_state_dict(not_legacy)
    assert str(error.value).endswith(
        "got keys ['key0', 'key1', 'key2', 'key3', 'key4']"
    )
