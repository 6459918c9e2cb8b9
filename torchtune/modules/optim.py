# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Optimizers. ``torchtune.modules.optim.OptimizerInBackward`` is the name later
torchtune releases use; it is the same class as
:class:`torchtune.training.OptimizerInBackward`."""

from torchtune.training.memory import OptimizerInBackward

__all__ = ["OptimizerInBackward"]
