"""What several test files need: the bitwise tolerance, a tiny model and the training
loop every recipe runs, a model's weights, a folder's files, and state of a recipe's
own for the checkpoint manager to save (:class:`WeightAverage`), and a process group
of this process alone (:func:`one_process_group`).

Two kinds of "snapshot", named apart: :func:`weights_of` (a model's parameters, to
compare trainings) and :func:`snapshot_files` (every file and folder under a path,
to show that a refused run changed nothing there).

The recipe-run helpers (``tune run``, reading its metrics back, comparing runs) are
in ``tests/recipes/utils.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BITWISE = {"rtol": 0, "atol": 0}
"""``torch.testing.assert_close`` tolerances of a bitwise comparison."""


def make_model(
    seed: int = 0, *, sizes: Sequence[int] = (6, 8, 8, 3), dropout: float | None = None
) -> nn.Sequential:
    """Linear layers of ``sizes`` with tanh between, the weights drawn from ``seed``.

    By default three layers, whose parameters hold 192, 32, 256, 32, 96 and 12 bytes.
    With ``dropout`` (a probability) each tanh is preceded by ``nn.Dropout``, so that
    training draws from the global RNG (0.0: the same module layout, no draws).
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        if i:
            if dropout is not None:
                layers.append(nn.Dropout(dropout))
            layers.append(nn.Tanh())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def batch(step: int) -> torch.Tensor:
    """Step ``step``'s batch for :func:`make_model`: 5 samples of 6 numbers."""
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(step))


def loss_fn(model: nn.Module, step: int) -> torch.Tensor:
    return model(batch(step)).square().mean()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    loss_of: Callable[[nn.Module, int], torch.Tensor] = loss_fn,
    after_backward: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """The training loop every recipe uses, whatever the optimizer (in backward, the
    update runs inside ``backward()`` and ``step()`` has nothing left to do).

    ``loss_of(model, step)``: each step's loss. ``after_backward(loss)``: called once
    the gradients are ready, before ``step()`` (to record what the step used or
    measured)."""
    for step in steps:
        loss = loss_of(model, step)
        loss.backward()
        if after_backward is not None:
            after_backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def snapshot_files(root: Path) -> dict[str, tuple[str, int] | None]:
    """Everything under ``root``: each file's content hash and modification time, and
    each folder (``None``), to show that a refused run left a folder untouched."""
    return {
        str(p.relative_to(root)): (
            (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            if p.is_file()
            else None
        )
        for p in sorted(root.rglob("*"))
    }


class WeightAverage:
    """An exponential moving average of a model's weights (a sharded model's as
    shards): state of a recipe's own, which the checkpoint manager saves and
    restores as one more entry of the mapping its ``load()`` takes."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.average = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self) -> None:
        for name, value in self.model.state_dict().items():
            self.average[name].mul_(0.9).add_(value, alpha=0.1)

    def state_dict(self) -> dict[str, Any]:
        return {"average": self.average}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.average = {k: v.clone() for k, v in state_dict["average"].items()}


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """A gloo process group of this process alone, for FSDP2 and torchtune's
    distributed helpers on one process; destroyed on exit. A collective that waits
    longer than a minute fails instead of hanging the suite."""
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
