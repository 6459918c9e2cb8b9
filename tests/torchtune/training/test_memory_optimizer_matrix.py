"""``OptimizerInBackward`` is the optimizer it wraps, for every optimizer family a
torchtune config can name: ``torch.optim``, bitsandbytes and torchao.

For each optimizer, in fp32 and bf16:

- five in-backward steps give the plain optimizer's parameters and state dict;
- a checkpoint saved after three steps (``torch.save``/``torch.load``) resumes in every
  direction (plain -> in-backward, in-backward -> plain, in-backward -> in-backward)
  to exactly what plain -> plain gives.

Everything is compared bitwise (the same kernels run on the same values), with one
exception, explained where it is made: torchao's bf16 stochastic rounding.
"""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Callable
from typing import Any

import bitsandbytes.optim as bnb
import pytest
import torch
import torchao.optim as ao
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from torchtune.training import OptimizerInBackward

BITWISE = {"rtol": 0, "atol": 0}
STEPS = 5
RESUME_AT = 3

# name -> (optimizer class, kwargs). Learning rates are large enough that five steps
# move every parameter by many ulps, so a wrong update cannot hide in rounding.
OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]] = {
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
    for name in OPTIMIZERS
    for dtype_name in DTYPES
]


def stochastic_rounding(name: str, dtype: torch.dtype) -> bool:
    return name == "torchao._AdamW(bf16_stochastic_round)" and dtype == torch.bfloat16


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
    return (
        STOCHASTIC_ROUNDING_TOLERANCE if stochastic_rounding(name, dtype) else BITWISE
    )


def make_model(dtype: torch.dtype) -> nn.Module:
    # Two 64x64 weights (4096 elements: the smallest size that bitsandbytes and
    # torchao quantize, and a multiple of torchao's block sizes) and one 64-element
    # bias, whose state both keep unquantized. So each run mixes both kinds of state.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64, bias=False)
    ).to(dtype)


def train(
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
    cls, kwargs = OPTIMIZERS[name]
    with warnings.catch_warnings():
        # Paged bitsandbytes optimizers fall back to unpaged memory on the CPU.
        warnings.simplefilter("ignore")
        if in_backward:
            return OptimizerInBackward(
                model.parameters(), cls, bucket_cap_mb=bucket_cap_mb, **kwargs
            )
        return cls(model.parameters(), **kwargs)


def round_trip(state_dict: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint file gives back: ``torch.save`` then ``torch.load``."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The plain tensors a state value is made of (a torchao quantized state is a
    tensor subclass holding codes, scales and a code book)."""
    if type(value) is torch.Tensor or isinstance(value, nn.Parameter):
        return [value]
    attrs, _ = value.__tensor_flatten__()
    return [t for attr in attrs for t in tensors_of(getattr(value, attr))]


def assert_same_state_dict(
    actual: Any, expected: Any, path: str = "", **tol: float
) -> None:
    """Same structure, same types and dtypes, same values (by ``tol``)."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} vs {type(expected)}"
    if isinstance(expected, torch.Tensor):
        for a, e in zip(tensors_of(actual), tensors_of(expected), strict=True):
            torch.testing.assert_close(a, e, msg=lambda m: f"{path}: {m}", **tol)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{path}: keys differ"
        for key in expected:
            assert_same_state_dict(actual[key], expected[key], f"{path}/{key}", **tol)
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{path}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state_dict(a, e, f"{path}[{i}]", **tol)
    else:
        assert actual == expected, f"{path}: {actual!r} vs {expected!r}"


def assert_same_params(actual: nn.Module, expected: nn.Module, **tol: float) -> None:
    for (name, a), e in zip(
        actual.named_parameters(), expected.parameters(), strict=True
    ):
        torch.testing.assert_close(a, e, msg=lambda m, n=name: f"{n}: {m}", **tol)


@functools.cache
def plain_run(name: str, dtype_name: str) -> tuple[nn.Module, dict[str, Any]]:
    """The reference: the plain optimizer for all steps, and its final state dict."""
    dtype = DTYPES[dtype_name]
    model = make_model(dtype)
    optimizer = build(name, False, model)
    train(model, optimizer, range(STEPS), dtype)
    return model, optimizer.state_dict()


def resumed_run(
    name: str, dtype_name: str, *, save_in_backward: bool, load_in_backward: bool
) -> tuple[nn.Module, dict[str, Any]]:
    """Train RESUME_AT steps, save model and optimizer through a file, build a new
    model and optimizer, load both, and train the remaining steps."""
    dtype = DTYPES[dtype_name]
    model = make_model(dtype)
    optimizer = build(name, save_in_backward, model)
    train(model, optimizer, range(RESUME_AT), dtype)
    model_state = round_trip(model.state_dict())
    optimizer_state = round_trip(optimizer.state_dict())
    if save_in_backward:
        optimizer.remove_hooks()  # the interrupted run is over

    resumed = make_model(dtype)
    resumed.load_state_dict(model_state)
    optimizer = build(name, load_in_backward, resumed)
    optimizer.load_state_dict(optimizer_state)
    train(resumed, optimizer, range(RESUME_AT, STEPS), dtype)
    return resumed, optimizer.state_dict()


@functools.cache
def plain_resumed_run(name: str, dtype_name: str) -> tuple[nn.Module, dict[str, Any]]:
    return resumed_run(name, dtype_name, save_in_backward=False, load_in_backward=False)


# The default cap puts the model's three parameters in one bucket, stepped by one
# optimizer call; 0 gives each its own.
BUCKETINGS = {"one_bucket": None, "per_parameter": 0}


@pytest.mark.parametrize("bucketing", BUCKETINGS)
@pytest.mark.parametrize(("name", "dtype_name"), CASES)
def test_in_backward_gives_the_plain_parameters_and_state_dict(
    name: str, dtype_name: str, bucketing: str
) -> None:
    dtype = DTYPES[dtype_name]
    model = make_model(dtype)
    optimizer = build(name, True, model, BUCKETINGS[bucketing])
    assert len(optimizer._buckets()) == (1 if bucketing == "one_bucket" else 3)
    train(model, optimizer, range(STEPS), dtype)
    plain_model, plain_state = plain_run(name, dtype_name)

    tol = tolerance(name, dtype)
    assert_same_params(model, plain_model, **tol)
    # The in-backward state dict is the plain class's own: the same entries, dtypes
    # and packing (bitsandbytes' __bnb_optimizer_quant_state__, torchao's subclasses).
    assert_same_state_dict(optimizer.state_dict(), plain_state, **tol)


@pytest.mark.parametrize(
    ("save_in_backward", "load_in_backward"),
    [(False, True), (True, False), (True, True)],
    ids=["plain->in_bwd", "in_bwd->plain", "in_bwd->in_bwd"],
)
@pytest.mark.parametrize(("name", "dtype_name"), CASES)
def test_resume_in_any_direction_equals_plain_to_plain(
    name: str, dtype_name: str, save_in_backward: bool, load_in_backward: bool
) -> None:
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
DCP_OPTIMIZERS = ["torch.AdamW(foreach)", "bnb.PagedAdamW8bit", "torchao.AdamW8bit"]


@pytest.mark.parametrize("full_state_dict", [True, False], ids=["full", "sharded"])
@pytest.mark.parametrize(
    ("save_in_backward", "load_in_backward"),
    [(False, True), (True, False), (True, True)],
    ids=["plain->in_bwd", "in_bwd->plain", "in_bwd->in_bwd"],
)
@pytest.mark.parametrize("name", DCP_OPTIMIZERS)
def test_dcp_get_and_set_optimizer_state_dict_resume_like_plain(
    name: str, save_in_backward: bool, load_in_backward: bool, full_state_dict: bool
) -> None:
    dtype = torch.bfloat16
    options = StateDictOptions(full_state_dict=full_state_dict)
    runs = {}
    for key, (save, load) in {
        "plain": (False, False),
        "tested": (save_in_backward, load_in_backward),
    }.items():
        model = make_model(dtype)
        optimizer = build(name, save, model)
        train(model, optimizer, range(RESUME_AT), dtype)
        saved = round_trip(get_optimizer_state_dict(model, optimizer, options=options))
        model_state = round_trip(model.state_dict())
        if save:
            optimizer.remove_hooks()
        resumed = make_model(dtype)
        resumed.load_state_dict(model_state)
        optimizer = build(name, load, resumed)
        set_optimizer_state_dict(resumed, optimizer, saved, options=options)
        train(resumed, optimizer, range(RESUME_AT, STEPS), dtype)
        runs[key] = (resumed, optimizer.state_dict())

    assert_same_params(runs["tested"][0], runs["plain"][0], **BITWISE)
    assert_same_state_dict(runs["tested"][1], runs["plain"][1], **BITWISE)
