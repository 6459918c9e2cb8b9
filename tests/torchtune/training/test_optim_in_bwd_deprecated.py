"""Tests for torchtune/training/optim_in_bwd_deprecated.py: torchtune 0.6.1's
optimizer-in-backward API, which recipes written against 0.6.1 still call.

Every run here is a 0.6.1 recipe's loop: per-parameter optimizers, hooks and the
wrapper, ``loss.backward()`` (which updates), the scheduler's ``step()``, and no
optimizer ``step()`` or ``zero_grad()``. The per-parameter optimizers apply the same
kernels to the same values as one plain optimizer over all parameters, so results must
agree bitwise (``rtol=0, atol=0``).
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable

import bitsandbytes.optim as bnb
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)
from torch.optim.lr_scheduler import LRScheduler, OneCycleLR
from torch.testing import assert_close

from tests import helpers
from tests.helpers import BITWISE, batch, loss_fn, make_model, train, weights_of
from tests.torchtune.training.optimizer_in_backward_scenarios import (
    ADAMW,
    assert_same_state_dict,
    freeze_first_layer,
    reference_after_6_steps,
    round_trip,
)
from tests.torchtune.training.test_optim_in_bwd_legacy_state_dict import (
    legacy_checkpoint,
    run_like_0_6_1,
)
from torchtune import training
from torchtune.training import OptimizerInBackward, get_cosine_schedule_with_warmup
from torchtune.training.memory import (
    OptimizerInBackwardWrapper,
    create_optim_in_bwd_wrapper,
    register_optim_in_bwd_hooks,
)


def set_up_like_0_6_1(
    model: nn.Module, make_optimizer: Callable[[list], torch.optim.Optimizer]
) -> OptimizerInBackwardWrapper:
    """A 0.6.1 recipe's _setup_optimizer: an optimizer per parameter, frozen ones
    included, the hooks, then the wrapper."""
    optim_dict = {p: make_optimizer([p]) for p in model.parameters()}
    with pytest.warns(DeprecationWarning, match="OptimizerInBackward"):
        register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
    with pytest.warns(DeprecationWarning, match="OptimizerInBackward") as caught:
        wrapper = create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict)
    assert len(caught) == 1  # one warning for one call
    return wrapper


def adamw(params: list) -> torch.optim.Optimizer:
    cls, kwargs = ADAMW
    return cls(params, **kwargs)


def train_like_0_6_1(
    model: nn.Module, steps: range, scheduler: LRScheduler | None = None
) -> None:
    for step in steps:
        loss_fn(model, step).backward()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda o: get_cosine_schedule_with_warmup(o, 2, 6),
        # Also drives AdamW's beta1, from keys of its own in the param group.
        lambda o: OneCycleLR(o, max_lr=0.1, total_steps=7),
    ],
    ids=["cosine_warmup", "onecycle"],
)
def test_0_6_1_recipe_calls_update_each_parameter_once_on_the_schedule(
    make_scheduler: Callable[[torch.optim.Optimizer], LRScheduler],
) -> None:
    reference = make_model()
    plain = adamw(list(reference.parameters()))
    plain_scheduler = make_scheduler(plain)
    train(reference, plain, range(6), plain_scheduler)

    model = make_model()
    wrapper = set_up_like_0_6_1(model, adamw)
    assert list(wrapper.optim_map) == [n for n, _ in model.named_parameters()]
    # 0.6.1 recipes built the scheduler on one per-parameter optimizer.
    scheduler = make_scheduler(next(iter(wrapper.optim_map.values())))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no scheduler-order warnings
        wrapper.set_lr_scheduler(scheduler)
        train_like_0_6_1(model, range(6), scheduler)
    assert_close(weights_of(model), weights_of(reference), **BITWISE)
    assert wrapper.get_last_lr() == plain_scheduler.get_last_lr()[0]
    assert wrapper.get_optim_key("lr") == plain.param_groups[0]["lr"]
    assert wrapper.get_optim_key("betas") == plain.param_groups[0]["betas"]
    assert training.get_lr(wrapper) == training.get_lr(plain)
    wrapper.step_lr_scheduler()
    plain_scheduler.step()
    assert wrapper.get_last_lr() == plain_scheduler.get_last_lr()[0]


def test_a_wrapper_built_after_the_hooks_takes_them_over() -> None:
    """Built directly, as 0.6.1's docstring did, over the optimizers that
    register_optim_in_bwd_hooks hooked: the schedule it is given drives them."""
    reference = make_model()
    plain = adamw(list(reference.parameters()))
    train(reference, plain, range(3), torch.optim.lr_scheduler.StepLR(plain, 1, 0.5))
    model = make_model()
    optim_dict = {p: adamw([p]) for p in model.parameters()}
    with pytest.warns(DeprecationWarning):
        register_optim_in_bwd_hooks(model, optim_dict)
        wrapper = OptimizerInBackwardWrapper(
            {n: optim_dict[p] for n, p in model.named_parameters()}
        )
    scheduler = torch.optim.lr_scheduler.StepLR(optim_dict[model[0].weight], 1, 0.5)
    wrapper.set_lr_scheduler(scheduler)
    train_like_0_6_1(model, range(3), scheduler)
    assert_close(weights_of(model), weights_of(reference), **BITWISE)


def test_a_hand_written_0_6_1_hook_that_steps_and_clears_is_not_doubled() -> None:
    reference = make_model()
    train(reference, adamw(list(reference.parameters())), range(3))
    model = make_model()
    optim_dict = {p: adamw([p]) for p in model.parameters()}

    def step_and_clear(param: torch.Tensor) -> None:
        optim_dict[param].step()
        optim_dict[param].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_and_clear)
    with pytest.warns(DeprecationWarning):
        create_optim_in_bwd_wrapper(model, optim_dict)
    train_like_0_6_1(model, range(3))
    assert_close(weights_of(model), weights_of(reference), **BITWISE)


def test_the_0_6_1_calls_take_over_the_params_of_an_optimizer_in_backward() -> None:
    """Each parameter is updated once per backward, by its 0.6.1 optimizer; the
    OptimizerInBackward built before over the same parameters (at another lr)
    updates none of them."""
    reference = make_model()
    train(reference, adamw(list(reference.parameters())), range(2))
    model = make_model()
    earlier = training.OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, lr=0.5
    )
    set_up_like_0_6_1(model, adamw)
    train_like_0_6_1(model, range(2))
    assert_close(weights_of(model), weights_of(reference), **BITWISE)
    assert not earlier.state


def test_an_optimizer_in_backward_takes_over_the_params_of_the_0_6_1_calls() -> None:
    """The reverse: an OptimizerInBackward built after the 0.6.1 calls updates each
    parameter once; their per-parameter optimizers (at another lr) none."""
    cls, kwargs = ADAMW
    reference = make_model()
    train(reference, cls(reference.parameters(), **kwargs), range(2))
    model = make_model()
    wrapper = set_up_like_0_6_1(model, lambda p: torch.optim.AdamW(p, lr=0.5))
    optimizer = training.OptimizerInBackward(model.parameters(), cls, **kwargs)
    train(model, optimizer, range(2))
    assert_close(weights_of(model), weights_of(reference), **BITWISE)
    assert not any(o.state for o in wrapper.optim_map.values())


def test_optimizers_stepped_for_other_parameters_are_refused() -> None:
    model = make_model()
    optim_dict = {p: adamw([p]) for p in model.parameters()}
    with pytest.warns(DeprecationWarning):
        register_optim_in_bwd_hooks(model, optim_dict)
        with pytest.raises(ValueError, match="already stepped in backward"):
            OptimizerInBackwardWrapper({"0.weight": optim_dict[model[0].weight]})


def test_optimizers_only_some_of_which_are_stepped_in_backward_are_refused() -> None:
    # As many parameters as the earlier instance steps, but one optimizer is new.
    model = make_model()
    optim_dict = {p: adamw([p]) for p in model.parameters()}
    first, *rest = model.parameters()
    with pytest.warns(DeprecationWarning):
        register_optim_in_bwd_hooks(model, optim_dict)
        optim_map = {"new": adamw([first])} | {
            str(i): optim_dict[p] for i, p in enumerate(rest)
        }
        with pytest.raises(ValueError, match="already stepped in backward"):
            OptimizerInBackwardWrapper(optim_map)


def test_a_one_parameter_model_trains_with_the_0_6_1_calls_as_plain() -> None:
    torch.manual_seed(0)
    reference = nn.Linear(6, 3, bias=False)
    model = copy.deepcopy(reference)
    plain = adamw(reference.parameters())
    set_up_like_0_6_1(model, adamw)
    for step in range(3):
        reference(batch(step)).square().mean().backward()
        plain.step()
        plain.zero_grad()
        model(batch(step)).square().mean().backward()
    assert_close(model.weight, reference.weight, **BITWISE)


def test_the_deprecation_warnings_point_at_the_callers_line() -> None:
    # Each call straight from this function: one frame further up is pytest's.
    model = make_model()
    optim_dict = {p: adamw([p]) for p in model.parameters()}
    with pytest.warns(DeprecationWarning) as caught:
        register_optim_in_bwd_hooks(model, optim_dict)
        create_optim_in_bwd_wrapper(model, optim_dict)
        OptimizerInBackwardWrapper(
            {n: optim_dict[p] for n, p in model.named_parameters()}
        )
    assert [w.filename for w in caught] == [__file__] * 3


def test_per_parameter_optimizers_with_different_hyperparameters_are_refused() -> None:
    """The refusal names the key that differs with both values, and the way that
    works: one OptimizerInBackward with a param group per setting (its example is
    checked to train, in-backward, with the two weight decays)."""
    model = make_model()
    optim_dict = {
        p: torch.optim.AdamW([p], weight_decay=0.01 if p.dim() > 1 else 0.0)
        for p in model.parameters()
    }
    with pytest.warns(DeprecationWarning):
        with pytest.raises(ValueError, match="different hyperparameters") as refused:
            register_optim_in_bwd_hooks(model, optim_dict)
    message = str(refused.value)
    assert "'weight_decay': (0.01, 0.0)" in message
    example = re.search(r"OptimizerInBackward\(\[.*?lr=2e-5\)", message).group(0)
    decayed = [p for p in model.parameters() if p.dim() > 1]
    norms_and_biases = [p for p in model.parameters() if p.dim() == 1]
    optimizer = eval(
        example,
        {"OptimizerInBackward": OptimizerInBackward, "torch": torch},
        {"decayed": decayed, "norms_and_biases": norms_and_biases},
    )
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    loss_fn(model, 0).backward()
    assert len(optimizer.state) == len(list(model.parameters()))


def test_an_optimizer_over_several_parameters_is_refused() -> None:
    model = make_model()
    with pytest.warns(DeprecationWarning):
        with pytest.raises(ValueError, match="exactly one parameter.*holds 2"):
            OptimizerInBackwardWrapper({"0": adamw(list(model[0].parameters()))})


# -- saving and resuming ----------------------------------------------------------------


@pytest.mark.parametrize("hooks_first", [True, False], ids=["hooks", "wrapper_only"])
def test_0_6_1_checkpoints_load_and_the_wrapper_saves_0_6_1s_format(
    hooks_first: bool,
) -> None:
    model = make_model()
    legacy = copy.deepcopy(legacy_checkpoint(model, "single_device"))
    optim_dict = {p: adamw([p]) for p in model.parameters()}
    with pytest.warns(DeprecationWarning):
        if hooks_first:
            register_optim_in_bwd_hooks(model, optim_dict)
        wrapper = create_optim_in_bwd_wrapper(model, optim_dict)
    wrapper.load_state_dict(legacy)
    train_like_0_6_1(model, range(3, 6))
    assert_close(weights_of(model), weights_of(reference_after_6_steps()), **BITWISE)
    # What 0.6.1's per-parameter optimizers held after the same 6 steps.
    expected_model = make_model()
    expected = run_like_0_6_1(expected_model, range(6))
    assert_same_state_dict(
        wrapper.state_dict(),
        {n: expected[p].state_dict() for n, p in expected_model.named_parameters()},
    )


def test_a_0_6_1_checkpoint_with_an_extra_entry_is_refused_naming_it() -> None:
    model = make_model()
    legacy = copy.deepcopy(legacy_checkpoint(model, "single_device"))
    legacy["9.weight"] = legacy["0.weight"]
    del legacy["4.bias"]
    wrapper = set_up_like_0_6_1(model, adamw)
    with pytest.raises(
        RuntimeError, match=r"missing \['4.bias'\], extra \['9.weight'\]"
    ):
        wrapper.load_state_dict(legacy)
    assert all(not o.state for o in wrapper.optim_map.values())  # nothing loaded


def test_state_loaded_through_a_per_parameter_optimizer_is_used_and_saved() -> None:
    model = make_model()
    legacy = copy.deepcopy(legacy_checkpoint(model, "single_device"))
    wrapper = set_up_like_0_6_1(model, adamw)
    # What 0.6.1 recipes did to resume: load each per-parameter optimizer.
    for name, optimizer in wrapper.optim_map.items():
        optimizer.load_state_dict(legacy[name])
    train_like_0_6_1(model, range(3, 6))
    assert_close(weights_of(model), weights_of(reference_after_6_steps()), **BITWISE)


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
    wrapper = set_up_like_0_6_1(
        model, lambda params: _LoadsWithoutTorchHooks(params, lr=0.1, momentum=0.9)
    )
    loss_fn(model, 0).backward()
    per_param = wrapper.optim_map["2.weight"]
    saved = copy.deepcopy(per_param.state_dict())
    loss_fn(model, 1).backward()
    per_param.load_state_dict(saved)
    assert_close(wrapper.state_dict()["2.weight"]["state"], saved["state"], **BITWISE)


def test_per_parameter_optimizers_that_stepped_before_keep_their_state() -> None:
    """0.6.1's create_optim_in_bwd_wrapper over per-parameter optimizers that have
    already stepped: they update on from that state."""
    model = make_model()
    optim_dict = {p: adamw([p]) for p in model.parameters()}
    loss_fn(model, 0).backward()
    for per_param in optim_dict.values():
        per_param.step()
    model.zero_grad()
    expected = {p: copy.deepcopy(o.state[p]) for p, o in optim_dict.items()}
    with pytest.warns(DeprecationWarning, match="OptimizerInBackward"):
        wrapper = create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict)
    for name, p in model.named_parameters():
        assert_close(wrapper.optim_map[name].state[p], expected[p], **BITWISE)
    train_like_0_6_1(model, range(1, 3))
    reference = make_model()
    train(reference, adamw(list(reference.parameters())), range(3))
    assert_close(weights_of(model), weights_of(reference), **BITWISE)


def test_bitsandbytes_8bit_per_parameter_optimizers_resume_through_the_wrapper() -> (
    None
):
    """bitsandbytes packs its 8-bit state in its own state_dict() and keeps it
    uint8 in its own load_state_dict(): each per-parameter optimizer's methods run."""

    def wide(seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)  # 64x64 weights: big enough to be quantized
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))

    def wide_loss(model: nn.Module, step: int) -> torch.Tensor:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        return (model(x) - x).square().mean()

    def adamw8bit(params: list) -> torch.optim.Optimizer:
        return bnb.AdamW8bit(params, lr=1e-2)

    reference = wide()
    plain = adamw8bit(list(reference.parameters()))
    for step in range(5):
        wide_loss(reference, step).backward()
        plain.step()
        plain.zero_grad()

    model = wide()
    wrapper = set_up_like_0_6_1(model, adamw8bit)
    for step in range(3):
        wide_loss(model, step).backward()
    saved = round_trip({"model": model.state_dict(), "optim": wrapper.state_dict()})
    quant = saved["optim"]["0.weight"]["state"][0]["__bnb_optimizer_quant_state__"]
    assert quant["state1"].dtype == torch.uint8
    resumed = wide(seed=1)
    resumed.load_state_dict(saved["model"])
    resumed_wrapper = set_up_like_0_6_1(resumed, adamw8bit)
    resumed_wrapper.load_state_dict(saved["optim"])
    for step in range(3, 5):
        wide_loss(resumed, step).backward()
    assert_close(weights_of(resumed), weights_of(reference), **BITWISE)


@pytest.fixture
def one_process_group():
    """A gloo process group of one process, for torchtune's distributed helpers."""
    with helpers.one_process_group():
        yield


@pytest.mark.parametrize("style", ["single_device", "distributed"])
def test_0_6_1_checkpoint_with_frozen_entries_resumes_through_optim_map(
    style: str, one_process_group: None
) -> None:
    # 0.6.1 recipes built a per-parameter optimizer for every parameter, frozen ones
    # included, saved one entry for each, and resumed through optim_map[name].
    model = freeze_first_layer(make_model())
    saved = copy.deepcopy(legacy_checkpoint(model, style))
    assert {"0.weight", "0.bias"} <= set(saved)

    wrapper = set_up_like_0_6_1(model, adamw)
    assert list(wrapper.optim_map) == [n for n, _ in model.named_parameters()]
    for name, entry in saved.items():
        if style == "single_device":
            wrapper.optim_map[name].load_state_dict(entry)
        else:  # the call of 0.6.1's distributed recipes, in a 1-process group
            training.load_from_full_optimizer_state_dict(
                model, wrapper.optim_map[name], entry, torch.device("cpu")
            )
    train_like_0_6_1(model, range(3, 6))
    assert_close(
        weights_of(model),
        weights_of(reference_after_6_steps(frozen_first_layer=True)),
        **BITWISE,
    )
    # And what a 0.6.1-API recipe saves (one entry per name) holds every parameter,
    # the trainable ones with their moments.
    resaved = {
        name: get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True)
        )
        for name, optimizer in wrapper.optim_map.items()
    }
    assert set(resaved) == set(saved)
    assert [name for name, entry in resaved.items() if entry["state"]] == [
        "2.weight",
        "2.bias",
        "4.weight",
        "4.bias",
    ]


def test_a_float64_model_trains_in_backward_with_the_0_6_1_hooks() -> None:
    """The norm bookkeeping of the optimizer in backward must not force float32."""
    model = nn.Linear(3, 2).double()
    reference = copy.deepcopy(model)
    optim_dict = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    with pytest.warns(DeprecationWarning):
        register_optim_in_bwd_hooks(model, optim_dict)
    x = torch.randn(4, 3, dtype=torch.float64)
    model(x).sum().backward()
    reference(x).sum().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert_close(
        dict(model.named_parameters()), dict(reference.named_parameters()), **BITWISE
    )


def test_each_forward_pass_restarts_the_gradient_norm_record() -> None:
    """0.6.1 loops never call zero_grad() on the optimizer in backward, which keeps a
    norm per gradient for its grad_norm until then: each forward pass restarts it, so
    the record holds one step, not every step of the run."""
    model = make_model()
    wrapper = set_up_like_0_6_1(model, adamw)
    reference = make_model()
    plain = adamw(list(reference.parameters()))
    for step in range(3):
        loss_fn(reference, step).backward()
        expected = torch.nn.utils.get_total_norm(
            [p.grad for p in reference.parameters()]
        )
        plain.step()
        plain.zero_grad()
        loss_fn(model, step).backward()
        assert_close(wrapper._optimizer.grad_norm, expected, **BITWISE)


# -- imports ----------------------------------------------------------------------------

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
    """Each module imported first into a fresh ``torchtune`` (its modules dropped from
    ``sys.modules`` in between), in one new interpreter that imports torch once: a
    cycle would be among torchtune's own modules."""
    firsts = [
        "optim_in_bwd_deprecated",
        "optim_in_bwd_legacy_state_dict",
        "memory",
    ]
    code = (
        "import importlib, sys, torch\n"
        f"for first in {firsts!r}:\n"
        "    for name in [m for m in sys.modules if m.split('.')[0] == 'torchtune']:\n"
        "        del sys.modules[name]\n"
        "    importlib.import_module('torchtune.training.' + first)\n"
        "    from torchtune.training.memory import create_optim_in_bwd_wrapper\n"
        "    from torchtune.training.memory import OptimizerInBackward\n"
        "    print(first, 'ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    )
    assert done.stdout.split() == [w for f in firsts for w in (f, "ok")]
