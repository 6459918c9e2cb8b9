"""``OptimizerInBackward`` on a CUDA device: training, gradient norm, state dicts,
bitsandbytes' paged state and peak memory.

Every test here needs a CUDA device and is skipped, with that reason, where there is
none (CI has none). ``scripts/gpu_check.sh`` runs them on a GPU machine. They cover
what the CPU tests cannot: the update running inside CUDA backward (on the stream the
autograd engine runs the gradient's producer on) with CUDA's foreach and fused AdamW
kernels; optimizer state that lives on the GPU (fused AdamW keeps even its step count
there) moving between the modes through a checkpoint file; bitsandbytes'
``PagedAdamW8bit`` with really paged (CUDA managed memory) state; and gradients freed
inside backward lowering ``torch.cuda.max_memory_allocated``.

Tolerances:

- Parameters and optimizer state, in-backward against plain and resumed against
  uninterrupted: bitwise (``rtol=0, atol=0``). Both modes run the same optimizer
  kernels, element by element, on the same gradients; foreach, fused and
  bitsandbytes' blockwise 8-bit kernels compute each element (each 256-element
  block, for bitsandbytes' quantization) on its own, so which parameters share a
  call does not change a bit. The gradients are the same only if backward is
  deterministic: the model is made of linear layers, ``tanh`` and an RMS norm, whose
  CUDA kernels (cuBLAS matmuls, elementwise ops, tree reductions) are, and the tests
  run with ``torch.use_deterministic_algorithms(True)`` and
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` so that a non-deterministic kernel would
  raise rather than blur the comparison. ``test_plain_training_is_bitwise_reproducible``
  checks that premise on its own, so a failure there points at the device, not at
  ``OptimizerInBackward``.
- ``grad_norm``: bitwise. The reference is ``training.scale_and_clip_grads_`` over
  the plain run's gradients, in their dtype, as the recipes log it. Both take each gradient's
  norm with ``torch._foreach_norm`` (whose CUDA kernel reduces each tensor on its own,
  whatever else is in the list) and combine the norms in parameter order. A wrong
  norm is far off: leaving out the smallest parameter's gradient (the first bias)
  lowers it by 2.1e-4, any weight's by more than 0.1 (measured on this model on the
  CPU).
- Peak memory: bounds derived from the model's sizes in
  ``test_in_backward_frees_each_gradient_inside_backward_on_cuda``.
"""

from __future__ import annotations

import functools
import io
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import BITWISE
from tests.helpers import train as recipe_loop
from tests.torchtune.training.optimizer_in_backward_scenarios import (
    assert_same_params,
    assert_same_state_dict,
)
from torchtune import training
from torchtune.modules import RMSNorm
from torchtune.training import OptimizerInBackward

# cuBLAS is deterministic only with a fixed workspace configuration; torch refuses
# cuBLAS calls under use_deterministic_algorithms(True) without it. Set before any
# test of the session runs a CUDA kernel (modules are imported at collection).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (scripts/gpu_check.sh runs these on a GPU machine)",
)

GRAD_NORM = BITWISE  # see the module docstring
STEPS = 5
RESUME_AT = 3
WIDTH = 512
BATCH = 64

ADAMW: dict[str, dict[str, Any]] = {
    "foreach": {"lr": 1e-2, "weight_decay": 0.1, "foreach": True},
    "fused": {"lr": 1e-2, "weight_decay": 0.1, "fused": True},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# bucket_cap_mb: 0 updates each parameter alone; None is the default cap (4 MiB),
# which groups make_model's parameters into 3 buckets in fp32 and 2 in bf16.
BUCKETINGS = {"per_parameter": 0, "bucketed": None}
DIRECTIONS = {
    "plain->in_bwd": (False, True),
    "in_bwd->plain": (True, False),
    "in_bwd->in_bwd": (True, True),
}


@pytest.fixture(autouse=True)
def _deterministic_kernels() -> Iterator[None]:
    """Deterministic CUDA kernels for the test, and the previous setting after it."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def make_model(dtype: torch.dtype) -> nn.Module:
    """Six parameters on the GPU: weights of 0.5M and 1M elements (large enough for
    bitsandbytes' 8-bit and paged state), biases and a norm scale (small ones, kept
    in 32 bits by bitsandbytes)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH),
            nn.Tanh(),
            nn.Linear(2 * WIDTH, 2 * WIDTH),
            nn.Tanh(),
            RMSNorm(2 * WIDTH),
            nn.Linear(2 * WIDTH, WIDTH, bias=False),
        )
    return model.to(dtype)


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    target = torch.randn(BATCH, WIDTH, generator=generator)
    return x.to("cuda", dtype), target.to("cuda")


def loss_fn(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    x, target = batch(step, dtype)
    return (model(x).float() - target).square().mean()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    dtype: torch.dtype,
    grad_norms: list[torch.Tensor] | None = None,
) -> None:
    """The recipes' loop (``tests.helpers.train``) on this module's batches.
    ``grad_norms`` collects each step's gradient norm: the in-backward optimizer's
    own, or for a plain optimizer the one the recipes log (the reference; see the
    module docstring)."""

    def record_norm(loss: torch.Tensor) -> None:
        if isinstance(optimizer, OptimizerInBackward):
            grad_norms.append(optimizer.grad_norm)
        else:
            grad_norms.append(training.scale_and_clip_grads_(model.parameters()))

    recipe_loop(
        model,
        optimizer,
        steps,
        loss_of=functools.partial(loss_fn, dtype=dtype),
        after_backward=None if grad_norms is None else record_norm,
    )


def build(
    optimizer_cls: Callable[..., torch.optim.Optimizer],
    kwargs: dict[str, Any],
    model: nn.Module,
    in_backward: bool,
    bucket_cap_mb: float | None = None,
) -> torch.optim.Optimizer:
    if in_backward:
        return OptimizerInBackward(
            model.parameters(), optimizer_cls, bucket_cap_mb=bucket_cap_mb, **kwargs
        )
    return optimizer_cls(model.parameters(), **kwargs)


def through_file(state_dict: dict[str, Any]) -> dict[str, Any]:
    """What a recipe's checkpoint gives back: ``torch.save``, then ``torch.load`` onto
    the CPU (as torchtune's checkpointers load), so the optimizer's own
    ``load_state_dict`` must put the state back on the GPU."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=False)


def resumed_run(
    optimizer_cls: Callable[..., torch.optim.Optimizer],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    *,
    save_in_backward: bool,
    load_in_backward: bool,
) -> tuple[nn.Module, dict[str, Any]]:
    """RESUME_AT steps, a checkpoint through a file, a fresh model and optimizer that
    load it, and the remaining steps. Returns the model and the final state dict."""
    model = make_model(dtype)
    optimizer = build(optimizer_cls, kwargs, model, save_in_backward)
    train(model, optimizer, range(RESUME_AT), dtype)
    model_state = through_file(model.state_dict())
    optimizer_state = through_file(optimizer.state_dict())

    resumed = make_model(dtype)
    resumed.load_state_dict(model_state)
    optimizer = build(optimizer_cls, kwargs, resumed, load_in_backward)
    optimizer.load_state_dict(optimizer_state)
    train(resumed, optimizer, range(RESUME_AT, STEPS), dtype)
    return resumed, optimizer.state_dict()


@functools.cache
def plain_run(
    impl: str, dtype_name: str
) -> tuple[nn.Module, dict[str, Any], list[torch.Tensor]]:
    """The reference: plain AdamW for all steps; its state dict and gradient norms."""
    dtype, norms = DTYPES[dtype_name], []
    model = make_model(dtype)
    optimizer = build(torch.optim.AdamW, ADAMW[impl], model, in_backward=False)
    train(model, optimizer, range(STEPS), dtype, norms)
    return model, optimizer.state_dict(), norms


# -- the premise -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("impl", ADAMW)
def test_plain_training_is_bitwise_reproducible(impl: str, dtype_name: str) -> None:
    """The bitwise comparisons below assume the device computes the same plain run
    twice; if this fails, the kernels are not deterministic here."""
    dtype = DTYPES[dtype_name]
    model = make_model(dtype)
    train(
        model, build(torch.optim.AdamW, ADAMW[impl], model, False), range(STEPS), dtype
    )
    assert_same_params(model, plain_run(impl, dtype_name)[0], **BITWISE)


# -- training ----------------------------------------------------------------------------


@pytest.mark.parametrize("bucketing", BUCKETINGS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("impl", ADAMW)
def test_in_backward_gives_the_plain_parameters_state_and_grad_norm_on_cuda(
    impl: str, dtype_name: str, bucketing: str
) -> None:
    dtype = DTYPES[dtype_name]
    model = make_model(dtype)
    optimizer = build(
        torch.optim.AdamW, ADAMW[impl], model, True, BUCKETINGS[bucketing]
    )
    n_buckets, n_params = len(optimizer._buckets), len(list(model.parameters()))
    if bucketing == "per_parameter":
        assert n_buckets == n_params
    else:  # some buckets hold several parameters: one kernel call updates them all
        assert 1 < n_buckets < n_params
    norms: list[torch.Tensor] = []
    train(model, optimizer, range(STEPS), dtype, norms)
    plain_model, plain_state, plain_norms = plain_run(impl, dtype_name)

    assert_same_params(model, plain_model, **BITWISE)
    # The state lives where the plain optimizer keeps it: moments on the GPU, the
    # step count on the GPU for fused and on the CPU for foreach (assert_close checks
    # devices too).
    state = optimizer.state_dict()
    assert state["state"][0]["exp_avg"].device.type == "cuda"
    assert_same_state_dict(state, plain_state, **BITWISE)
    assert all(norm.device.type == "cuda" for norm in norms)
    torch.testing.assert_close(
        torch.stack(norms), torch.stack(plain_norms), **GRAD_NORM
    )


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("impl", ADAMW)
def test_resume_through_a_cpu_loaded_file_equals_plain_to_plain_on_cuda(
    impl: str, dtype_name: str, direction: str
) -> None:
    save_in_backward, load_in_backward = DIRECTIONS[direction]
    dtype = DTYPES[dtype_name]
    model, state = resumed_run(
        torch.optim.AdamW,
        ADAMW[impl],
        dtype,
        save_in_backward=save_in_backward,
        load_in_backward=load_in_backward,
    )
    expected_model, expected_state = resumed_run(
        torch.optim.AdamW,
        ADAMW[impl],
        dtype,
        save_in_backward=False,
        load_in_backward=False,
    )
    assert_same_params(model, expected_model, **BITWISE)
    assert state["state"][0]["exp_avg"].device.type == "cuda"
    assert_same_state_dict(state, expected_state, **BITWISE)


# -- bitsandbytes' paged 8-bit AdamW (the shipped single-device configs' optimizer) ----


def _paged_adamw8bit() -> Callable[..., torch.optim.Optimizer]:
    bnb = pytest.importorskip("bitsandbytes")
    return bnb.optim.PagedAdamW8bit


PAGED_KWARGS = {"lr": 1e-2}


def _quant_state(state_dict: dict[str, Any], index: int) -> dict[str, Any]:
    """bitsandbytes' own ``state_dict()`` packs each 8-bit parameter's state one level
    down."""
    return state_dict["state"][index]["__bnb_optimizer_quant_state__"]


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_paged_adamw8bit_in_backward_pages_its_state_and_trains_as_plain_on_cuda(
    dtype_name: str,
) -> None:
    optimizer_cls, dtype = _paged_adamw8bit(), DTYPES[dtype_name]
    runs = {}
    for in_backward in (False, True):
        model = make_model(dtype)
        optimizer = build(optimizer_cls, PAGED_KWARGS, model, in_backward)
        assert optimizer.is_paged
        train(model, optimizer, range(STEPS), dtype)
        runs[in_backward] = (model, optimizer)

    for model, optimizer in runs.values():
        weight = next(model.parameters())  # 0.5M elements: 8-bit, paged
        state1 = optimizer.state[weight]["state1"]
        assert state1.dtype == torch.uint8
        # Paged: CUDA managed memory that bitsandbytes prefetches to the GPU before
        # each update (a host tensor over that memory, marked is_paged).
        assert getattr(state1, "is_paged", False), "the 8-bit state is not paged"
    (plain_model, plain), (model, in_bwd) = runs[False], runs[True]
    assert_same_params(model, plain_model, **BITWISE)
    assert_same_state_dict(in_bwd.state_dict(), plain.state_dict(), **BITWISE)
    assert _quant_state(in_bwd.state_dict(), 0)["state1"].dtype == torch.uint8


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_paged_adamw8bit_resume_equals_plain_to_plain_on_cuda(direction: str) -> None:
    # bf16, as the shipped configs train.
    optimizer_cls, dtype = _paged_adamw8bit(), torch.bfloat16
    save_in_backward, load_in_backward = DIRECTIONS[direction]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, state = resumed_run(
            optimizer_cls,
            PAGED_KWARGS,
            dtype,
            save_in_backward=save_in_backward,
            load_in_backward=load_in_backward,
        )
        expected_model, expected_state = resumed_run(
            optimizer_cls,
            PAGED_KWARGS,
            dtype,
            save_in_backward=False,
            load_in_backward=False,
        )
    assert_same_params(model, expected_model, **BITWISE)
    assert _quant_state(state, 0)["state1"].dtype == torch.uint8
    assert_same_state_dict(state, expected_state, **BITWISE)


# -- peak memory ---------------------------------------------------------------------------

MEMORY_LAYERS = 16
MEMORY_WIDTH = 2048
MIB = 2**20


def _extra_peak_of_a_step(in_backward: bool) -> tuple[int, int, int]:
    """Bytes allocated at the peak of a training step above what is allocated between
    steps (parameters and optimizer state), and the gradients' and the largest
    parameter's bytes."""
    torch.manual_seed(0)
    layers = []
    for _ in range(MEMORY_LAYERS):
        layers += [nn.Linear(MEMORY_WIDTH, MEMORY_WIDTH, bias=False), nn.Tanh()]
    with torch.device("cuda"):
        model = nn.Sequential(*layers)
    optimizer = build(
        torch.optim.AdamW, ADAMW["foreach"], model, in_backward, bucket_cap_mb=0
    )
    x = torch.randn(8, MEMORY_WIDTH, device="cuda")

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # the first step allocates the optimizer state
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    between_steps = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - between_steps
    params = list(model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    return extra, grad_bytes, largest


def test_in_backward_frees_each_gradient_inside_backward_on_cuda() -> None:
    """16 weights of 16 MiB (fp32), per-parameter buckets, foreach AdamW. The
    activations of a batch of 8 are 64 KiB per layer, 2 MiB in all.

    Plain: at its step every gradient is alive (256 MiB), plus foreach AdamW's
    temporaries; so its extra peak is at least the gradients' bytes.
    In-backward: while a weight is updated, its gradient (16 MiB) and one
    AdamW temporary of its size are alive, and the engine may already hold the next
    weight's gradient (16 MiB): at most 3 parameters' bytes, plus the activations and
    the gradient flowing back (under 4 MiB together). An implementation that kept the
    gradients until backward ends would need 256 MiB more.
    """
    plain_extra, grad_bytes, largest = _extra_peak_of_a_step(in_backward=False)
    bwd_extra, _, _ = _extra_peak_of_a_step(in_backward=True)
    print(
        f"extra peak of a step: plain {plain_extra / MIB:.1f} MiB, in-backward "
        f"{bwd_extra / MIB:.1f} MiB; gradients {grad_bytes / MIB:.0f} MiB"
    )
    assert grad_bytes == MEMORY_LAYERS * largest == 256 * MIB
    assert plain_extra >= grad_bytes
    assert bwd_extra <= 3 * largest + 4 * MIB
