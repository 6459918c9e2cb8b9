"""Tests for torchtune/training/gradients.py: gradient norms, scaling and clipping.

Norms and clipped gradients are compared bitwise (``rtol=0, atol=0``) with torch's own
functions: the helpers run the same kernels in the same order. How
``OptimizerInBackward`` scales and clips inside backward is tested in
test_optimizer_in_backward.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from tests.helpers import BITWISE
from torchtune.training import scale_and_clip_grads_


def _params_with_grads(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(n, generator=g)) for n in (3, 7, 5)]
    for p in params[:2]:  # the last one has no gradient
        p.grad = torch.randn(p.shape, generator=g) * 10
    return params


def test_the_norm_is_bitwise_get_total_norm_and_skips_missing_gradients() -> None:
    params = _params_with_grads()
    expected = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    assert_close(scale_and_clip_grads_(params), expected, **BITWISE)
    assert_close(
        scale_and_clip_grads_([nn.Parameter(torch.ones(2))]), torch.tensor(0.0)
    )


def test_the_norm_is_bitwise_get_total_norm_for_mixed_dtypes() -> None:
    """get_total_norm stacks the norms of its (device, dtype) groups in the order of
    torch's grouping, not of first appearance (here float64, bfloat16, float32); the
    float64 sum of the stacked norms rounds differently in the other order for some
    values (2 of these 50 draws)."""
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        grads = [
            torch.randn(7, generator=g),
            torch.randn(3, 4, generator=g).bfloat16(),
            torch.randn(5, generator=g, dtype=torch.float64),
            torch.randn(2, generator=g),
        ]
        params = []
        for grad in grads:
            p = nn.Parameter(torch.zeros_like(grad))
            p.grad = grad.clone()
            params.append(p)
        expected = nn.utils.get_total_norm(grads)
        assert_close(scale_and_clip_grads_(params), expected, **BITWISE, msg=str(seed))


def test_the_norm_of_a_huge_gradient_does_not_overflow() -> None:
    """The norm of the stacked per-gradient norms, as get_total_norm computes it,
    not the square root of their summed squares: this gradient's square overflows
    float32 (and sqrt(x * x) == x whenever it does not, in IEEE arithmetic)."""
    grad = torch.tensor([1e20])
    param = nn.Parameter(torch.zeros(1))
    param.grad = grad.clone()
    expected = nn.utils.get_total_norm([grad])
    assert expected.square().sqrt() != expected
    assert_close(scale_and_clip_grads_([param]), expected, **BITWISE)


def test_the_norm_of_a_sparse_gradient_is_that_of_its_dense_values() -> None:
    # get_total_norm cannot measure a sparse tensor; duplicates must be summed first.
    indices = torch.tensor([[0, 2, 2, 5]])
    values = torch.tensor(
        [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], dtype=torch.float64
    )
    sparse = torch.sparse_coo_tensor(indices, values, (6, 2))
    p = nn.Parameter(torch.zeros(6, 2, dtype=torch.float64))
    p.grad = sparse
    # float64, a few values: the dense and the coalesced sums agree exactly.
    assert_close(
        scale_and_clip_grads_([p]),
        torch.linalg.vector_norm(sparse.to_dense()),
        **BITWISE,
    )


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clips", "never_clips"])
def test_clipping_scales_as_clip_grad_norm_does(max_norm: float) -> None:
    ours, theirs = _params_with_grads(), _params_with_grads()
    norm = scale_and_clip_grads_(ours, max_norm=max_norm)
    expected = nn.utils.clip_grad_norm_(theirs, max_norm)
    assert_close(norm, expected, **BITWISE)
    for a, b in zip(ours, theirs, strict=True):
        assert_close(a.grad, b.grad, **BITWISE)
    assert (norm > max_norm) == (max_norm == 0.5)  # the cases do what they say


def test_scaling_multiplies_every_gradient_before_the_norm_and_the_clip() -> None:
    """The plain step's ``grad *= 1 / tokens`` (tensor on the gradient's device),
    then clip_grad_norm_ of the scaled gradients."""
    ours, theirs = _params_with_grads(), _params_with_grads()
    scale = 1 / torch.tensor(7)
    norm = scale_and_clip_grads_(ours, scale, max_norm=0.5)
    for p in theirs:
        if p.grad is not None:
            p.grad *= scale
    expected = nn.utils.clip_grad_norm_(theirs, 0.5)
    assert_close(norm, expected, **BITWISE)
    for a, b in zip(ours, theirs, strict=True):
        assert_close(a.grad, b.grad, **BITWISE)
