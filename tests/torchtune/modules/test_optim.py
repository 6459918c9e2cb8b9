"""``torchtune.modules.optim.OptimizerInBackward``, the name later torchtune releases
use, is the same class and takes the same keyword arguments."""

import copy

import torch
from torch import nn

from tests.helpers import BITWISE
from torchtune import training
from torchtune.modules.optim import OptimizerInBackward


def test_modules_optim_name_is_the_training_class() -> None:
    assert OptimizerInBackward is training.OptimizerInBackward


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_code_written_for_later_upstream_api_runs_unchanged() -> None:
    """Keyword arguments as later releases name them; the updates, the state and a
    save/load round trip are the plain AdamW's, bitwise (same kernels, same values)."""
    model, reference = _model(), _model()
    optimizer = OptimizerInBackward(
        params=model.parameters(), optimizer_cls=torch.optim.AdamW, lr=0.01
    )
    plain = torch.optim.AdamW(reference.parameters(), lr=0.01)
    before = model.weight.detach().clone()
    _step(model, optimizer, 0)
    _step(reference, plain, 0)
    assert not torch.equal(model.weight, before)
    assert model.weight.grad is None
    torch.testing.assert_close(model.state_dict(), reference.state_dict(), **BITWISE)
    saved = copy.deepcopy(optimizer.state_dict())
    torch.testing.assert_close(saved, plain.state_dict(), **BITWISE)

    # A fresh optimizer over a fresh model (a resumed run), loading the saved state,
    # continues exactly like the plain one.
    model = _model()
    model.load_state_dict(reference.state_dict())
    resumed = OptimizerInBackward(
        params=model.parameters(), optimizer_cls=torch.optim.AdamW, lr=0.01
    )
    resumed.load_state_dict(saved)
    torch.testing.assert_close(resumed.state_dict(), saved, **BITWISE)
    _step(model, resumed, 1)
    _step(reference, plain, 1)
    torch.testing.assert_close(model.state_dict(), reference.state_dict(), **BITWISE)
    assert int(resumed.state[model.weight]["step"]) == 2
