"""``full_finetune_single_device`` and ``lora_finetune_single_device``: in-backward
equals plain, and a resume from epoch 0 equals the uninterrupted run, in fp32 and
bf16, in either mode.

The runs are ``tests/recipes/single_device.py``'s, shared with the recipes' own test
files. Every comparison names the exact steps it compares and checks that both runs
logged those steps; what trains (the final weights, or the LoRA adapter) is compared
too: it holds the last step's update, which no logged loss shows.
``assert_series_close`` and ``assert_weights_close`` print the largest difference
they see (``pytest -s``); the values below were measured that way on this project's
x86 CPU.

Tolerances:

- Same mode, same computation (a resume against the uninterrupted run of the same
  mode, fp32 or bf16): the same CPU kernels see the same values, so losses, grad
  norms and what trains must be bitwise equal: ``rtol=0, atol=0``.
- In-backward against plain, fp32 and bf16, and a resume that switches mode: both
  backpropagate ``mean * tokens``, multiply the gradients by ``1 / tokens``, measure
  them and clip them with the same operations (in-backward inside backward, per
  bucket), so losses, grad norms and weights are bitwise equal too. The AdamW runs
  clip at the recipe's ``clip``, which their grad norm crosses (some steps clip,
  some do not); the bf16 runs do not clip.
- SGD with gradient accumulation (plain: two half batches of 4 per step) against
  in-backward (one batch of 8): the same examples, but the half batches are padded
  to other lengths and their token sums are added before the division, so the
  gradients differ by float rounding, about an ulp per entry (measured values in
  ``ACROSS_MODES``). A real error is far larger: backpropagating ``mean * tokens``
  with no division, as 0.6.1's in-backward path did (an SGD step ~24x too large for
  the full model, ~100x for LoRA), moves the second SGD loss by 47% (full; checked
  by putting that bug back) and by more than 1e-2 relative (LoRA).
- Learning rates come from the same scheduler arithmetic in both modes: equal
  exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch

from tests.recipes.single_device import (
    ALL_STEPS,
    BF16_ALL_STEPS,
    BF16_EPOCH_1,
    EPOCH_1,
    FULL,
    LORA,
    SGD_STEPS,
    Recipe,
    Runs,
)
from tests.recipes.utils import (
    BITWISE_TRAINING,
    assert_same_training,
    assert_trains_as_plain,
    series,
)

pytestmark = pytest.mark.integration_test

# In-backward vs plain (module docstring): bitwise, but for SGD's accumulation.
ACROSS_MODES = {
    FULL.name: {
        "adamw_cosine_warmup": BITWISE_TRAINING,
        "sgd_momentum": {
            "loss": {"rtol": 1e-6, "atol": 0.0},  # 1.0e-7
            "grad_norm": {"rtol": 2e-6, "atol": 0.0},  # 2.5e-7
            "weights": {"rtol": 0.0, "atol": 1e-6},  # 1.2e-7, an ulp of a weight near 1
        },
    },
    LORA.name: {
        "adamw_cosine_warmup": BITWISE_TRAINING,
        "sgd_momentum": {
            "loss": {"rtol": 1e-6, "atol": 0.0},  # 8.2e-8
            "grad_norm": {"rtol": 2e-6, "atol": 0.0},  # 2.2e-7
            "weights": {"rtol": 0.0, "atol": 1e-6},  # 1.0e-7 (the adapter)
        },
    },
}


@pytest.fixture(scope="module", params=[FULL, LORA], ids=lambda recipe: recipe.name)
def runs(
    request: pytest.FixtureRequest, single_device_runs: Callable[[Recipe], Runs]
) -> Runs:
    return single_device_runs(request.param)


@pytest.mark.parametrize("optimizer", ["adamw_cosine_warmup", "sgd_momentum"])
def test_in_backward_gives_the_plain_loss_at_every_step(
    runs: Runs, optimizer: str
) -> None:
    adamw = optimizer == "adamw_cosine_warmup"
    pair = runs.adamw if adamw else runs.sgd
    plain, bwd = pair["plain"], pair["bwd"]
    assert_trains_as_plain(
        bwd,
        plain,
        ACROSS_MODES[runs.recipe.name][optimizer],
        ALL_STEPS if adamw else SGD_STEPS,
        # What each mode ends with, after the last update too.
        final_weights=partial(runs.recipe.trained, epoch=1 if adamw else 0),
    )
    if adamw:
        norms = series(plain, "grad_norm", ALL_STEPS)
        assert (norms > runs.recipe.clip).any() and (norms < runs.recipe.clip).any()
    for run in (plain, bwd):
        for values in run.metrics.values():
            assert {"loss", "lr", "tokens_per_second_per_gpu", "grad_norm"} <= set(
                values
            )
            # CPU: no peak memory stats, even though the SGD runs asked for them.
            assert not any(name.startswith("peak_memory") for name in values)


@pytest.mark.parametrize(
    "source,target",
    [("plain", "plain"), ("bwd", "bwd"), ("plain", "bwd"), ("bwd", "plain")],
    ids=lambda mode: mode,
)
def test_resume_from_epoch_0_gives_the_uninterrupted_losses(
    runs: Runs, source: str, target: str
) -> None:
    # The resumed run starts at the step after epoch 0, on the scheduler's position,
    # and ends with what the uninterrupted run ends with, after all three updates:
    # bitwise in either mode (module docstring).
    assert_same_training(
        runs.resumed(source, target),
        runs.adamw[source],
        BITWISE_TRAINING,
        EPOCH_1,
        reference_steps=ALL_STEPS,
        final_weights=runs.recipe.trained,
    )


def test_bf16_in_backward_trains_as_plain_and_resumes_bitwise(runs: Runs) -> None:
    plain, bwd, resumed = (runs.bf16[k] for k in ("plain", "bwd", "resumed"))
    trained = runs.recipe.trained
    assert_trains_as_plain(
        bwd, plain, BITWISE_TRAINING, BF16_ALL_STEPS, final_weights=trained
    )
    assert all(w.dtype == torch.bfloat16 for w in trained(bwd).values())
    # bf16 weights and optimizer state are saved and loaded as they are: the same
    # kernels on the same values.
    assert_same_training(
        resumed,
        bwd,
        BITWISE_TRAINING,
        BF16_EPOCH_1,
        reference_steps=BF16_ALL_STEPS,
        final_weights=trained,
    )
