"""Learning-rate schedule helpers. They take any ``torch.optim.Optimizer``,
:class:`torchtune.training.OptimizerInBackward` included, with no special case."""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def get_cosine_schedule_with_warmup(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
) -> LambdaLR:
    """Linear warmup from 0 to each group's base lr, then cosine decay.

    During the first ``num_warmup_steps`` steps the lr factor rises linearly from 0 to 1.
    Over the remaining ``num_training_steps - num_warmup_steps`` steps it follows
    ``0.5 * (1 + cos(2 * pi * num_cycles * progress))`` with ``progress`` going from 0
    to 1, so the default ``num_cycles=0.5`` is one half-cosine down to 0. The factor is
    never negative. This is the schedule Hugging Face ``transformers`` calls
    ``get_cosine_schedule_with_warmup``.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer whose param groups' lr the
            schedule sets.
        num_warmup_steps (int): number of warmup steps.
        num_training_steps (int): total number of training steps.
        num_cycles (float): number of cosine periods after warmup. Default: ``0.5``
        last_epoch (int): index of the last step taken when resuming; ``-1`` starts
            from scratch. Default: ``-1``

    Returns:
        torch.optim.lr_scheduler.LambdaLR: the scheduler.

    Example:
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
        >>> scheduler = get_cosine_schedule_with_warmup(
        ...     optimizer, num_warmup_steps=2, num_training_steps=10
        ... )
        >>> lrs = []
        >>> for step in range(4):
        ...     lrs.append(round(get_lr(optimizer), 4))
        ...     optimizer.step()
        ...     scheduler.step()
        >>> lrs
        [0.0, 0.05, 0.1, 0.0962]
    """

    def lr_factor(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        decay_steps = max(1, num_training_steps - num_warmup_steps)
        progress = (step - num_warmup_steps) / decay_steps
        return max(0.0, 0.5 * (1.0 + math.cos(2.0 * math.pi * num_cycles * progress)))

    return LambdaLR(optimizer, lr_factor, last_epoch)


def get_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate shared by all of ``optimizer``'s param groups.

    torchtune recipes schedule one lr for every group; this returns it and checks that
    the groups agree.

    Args:
        optimizer (torch.optim.Optimizer): any optimizer, including
            :class:`torchtune.training.OptimizerInBackward`.

    Returns:
        float: the learning rate (a tensor if the optimizer keeps lr as a tensor).

    Raises:
        RuntimeError: if the optimizer has no param groups, or its groups have
            different learning rates.

    Example:
        >>> optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
        >>> get_lr(optimizer)
        0.1
    """
    groups = optimizer.param_groups
    if not groups:
        raise RuntimeError("optimizer has no param groups, so it has no learning rate")
    lr = groups[0]["lr"]
    if any(group["lr"] != lr for group in groups[1:]):
        raise RuntimeError(
            "param groups have different learning rates "
            f"{[group['lr'] for group in groups]}; get_lr expects one shared lr"
        )
    return lr
