"""``torchtune.modules.optim.OptimizerInBackward``, the name later torchtune releases
use, is the same class and takes the same keyword arguments."""

import torch
from torch import nn

from torchtune import training
from torchtune.modules.optim import OptimizerInBackward


def test_modules_optim_name_is_the_training_class() -> None:
    assert OptimizerInBackward is training.OptimizerInBackward


def test_code_written_for_later_upstream_api_runs_unchanged() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = OptimizerInBackward(
        params=model.parameters(), optimizer_cls=torch.optim.AdamW, lr=0.01
    )
    before = model.weight.detach().clone()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    assert not torch.equal(model.weight, before)
    assert model.weight.grad is None
    optimizer.load_state_dict(optimizer.state_dict())
    assert set(optimizer.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
