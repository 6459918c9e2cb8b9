"""Gradient norms, scaling and clipping (``torchtune.training.gradients``), and
``OptimizerInBackward.backward``, which scales and clips inside backward.

Every in-backward vs plain comparison here is bitwise (``rtol=0, atol=0``): the
in-backward optimizer multiplies each gradient by the same factors, with the same
operations, measures it with the same kernel and combines the norms in the same
order as the plain step does after backward, and a second backward pass over the
same graph recomputes the same gradients. The 2-process FSDP2 counterpart is the
``fsdp_clipped_training_matches_plain_bitwise`` scenario in
``optimizer_in_backward_scenarios.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
)
from torch.testing import assert_close

from torchtune import training
from torchtune.training import OptimizerInBackward

BITWISE = {"rtol": 0, "atol": 0}
# The plain run's grad norms of the last _train_both call, step by step.
NORMS: list[torch.Tensor] = []
VOCAB, WIDTH, TOKENS = 40, 12, (3, 8)


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


def _model(dtype: torch.dtype = torch.float32, **kwargs) -> TinyLM:
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
    make_model,
    make_optimizer,
    *,
    max_norm: float | None,
    steps: int = 4,
    bucket_cap_mb: float | None = None,
    wrap=None,
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    plain_model = make_model()
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


# A max_norm under every step's norm (clips every step), and one above it (never).
CLIPS, NEVER_CLIPS = 0.05, 1e6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("max_norm", [None, CLIPS, NEVER_CLIPS, float("inf")])
@pytest.mark.parametrize("bucket_cap_mb", [0, None])
def test_in_backward_scaling_and_clipping_equal_plain_bitwise(
    dtype, max_norm, bucket_cap_mb
) -> None:
    runs = _train_both(
        lambda: _model(dtype), _adamw, max_norm=max_norm, bucket_cap_mb=bucket_cap_mb
    )
    _assert_same(*runs)
    # The max_norms do what their names say: every step's norm is above CLIPS and
    # below NEVER_CLIPS.
    norms = torch.stack(NORMS).float()
    assert bool((norms > CLIPS).all()) and bool((norms < NEVER_CLIPS).all())


def test_clipping_every_step_changes_the_result() -> None:
    """The clipped runs above would pass if clipping did nothing: pin that it acts."""
    clipped = _train_both(_model, _adamw, max_norm=CLIPS)[1]
    unclipped = _train_both(_model, _adamw, max_norm=None)[1]
    assert not torch.equal(clipped.out.weight, unclipped.out.weight)


def test_in_backward_clipping_is_exact_through_activation_checkpointing() -> None:
    """Non-reentrant activation checkpointing recomputes the block in each backward
    pass and restores the dropout RNG each time: the second pass sees the first's
    gradients."""

    def wrap(model: TinyLM) -> None:
        # torch's default wrapper is the non-reentrant checkpoint.
        training.set_activation_checkpointing(model, {nn.Sequential})
        assert isinstance(model.block, CheckpointWrapper)

    _assert_same(*_train_both(_model, _adamw, max_norm=CLIPS, wrap=wrap))


def test_in_backward_sgd_on_fp16_and_complex_parameters_equals_plain_bitwise() -> None:
    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    _assert_same(*_train_both(lambda: _model(torch.float16), sgd, max_norm=CLIPS))

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
    _assert_same(
        *_train_both(lambda: _model(sparse=True), make_optimizer, max_norm=CLIPS)
    )


def test_sparse_adam_in_backward_equals_plain_bitwise() -> None:
    """SparseAdam takes sparse gradients only: an embedding alone."""

    def make_model():
        torch.manual_seed(0)
        return nn.Embedding(VOCAB, WIDTH, sparse=True)

    plain_model = make_model()
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


def test_a_float64_model_trains_in_backward_with_the_0_6_1_hooks() -> None:
    """0.6.1's register_optim_in_bwd_hooks on a float64 model: the norm bookkeeping
    must not force float32."""
    model = nn.Linear(3, 2).double()
    reference = copy.deepcopy(model)
    optim_dict = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    with pytest.warns(DeprecationWarning):
        training.register_optim_in_bwd_hooks(model, optim_dict)
    x = torch.randn(4, 3, dtype=torch.float64)
    model(x).sum().backward()
    reference(x).sum().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert_close(
        dict(model.named_parameters()), dict(reference.named_parameters()), **BITWISE
    )


def test_a_plain_backward_with_clipping_on_raises_before_updating_anything() -> None:
    model = _model()
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
    model = _model()
    optimizer = OptimizerInBackward(model.parameters(), _adamw)
    assert _count_backward_passes(optimizer, model) == 1
    optimizer.max_norm = float("inf")  # clip_grad_norm='inf': nothing to clip
    assert _count_backward_passes(optimizer, model) == 1
    optimizer.max_norm = 1.0
    assert _count_backward_passes(optimizer, model) == 2


def test_step_clips_gradients_left_by_a_backward_without_hooks() -> None:
    """After remove_hooks() the gradients stay, and step() does what the plain
    optimizer does after clip_grad_norm_."""
    plain_model = _model()
    bwd_model = copy.deepcopy(plain_model)
    plain = _adamw(plain_model.parameters())
    in_bwd = OptimizerInBackward(bwd_model.parameters(), _adamw, max_norm=CLIPS)
    in_bwd.remove_hooks()
    for model in (plain_model, bwd_model):
        _loss_sum(model, 0)[0].backward()
    norm = training.scale_and_clip_grads_(plain_model.parameters(), max_norm=CLIPS)
    plain.step()
    in_bwd.step()
    assert_close(in_bwd.grad_norm, norm, **BITWISE)
    _assert_same(plain_model, bwd_model, plain, in_bwd)


def test_max_norm_must_be_a_positive_number() -> None:
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="max_norm must be a positive number"):
            OptimizerInBackward(_model().parameters(), _adamw, max_norm=bad)


def test_grad_norm_is_bitwise_get_total_norm_for_mixed_dtypes() -> None:
    grads = [
        torch.randn(7),
        torch.randn(3, 4, dtype=torch.bfloat16),
        torch.randn(5, dtype=torch.float64),
        torch.randn(2),
    ]
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    assert_close(training.grad_norm(params), nn.utils.get_total_norm(grads), **BITWISE)


def test_grad_norm_of_a_sparse_gradient_is_that_of_its_dense_values() -> None:
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
        training.grad_norm([p]), torch.linalg.vector_norm(sparse.to_dense()), **BITWISE
    )


def test_before_update_pass_runs_once_between_the_passes_of_a_clipped_backward():
    """It sees every gradient measured and no parameter updated yet; without
    clipping there is one pass and it is not called."""
    model = _model()
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
