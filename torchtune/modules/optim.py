"""Optimizers. ``torchtune.modules.optim.OptimizerInBackward`` is the name later
torchtune releases use; it is the same class as
:class:`torchtune.training.OptimizerInBackward`."""

from torchtune.training.memory import OptimizerInBackward

__all__ = ["OptimizerInBackward"]
