"""Gradient norms, scaling and clipping, computed the way
``torch.nn.utils.clip_grad_norm_`` computes them, for plain training and for
:class:`~torchtune.training.OptimizerInBackward` alike.

The norm is split in two halves so that an optimizer that sees the gradients a few
at a time, inside backward, gets the very number a plain loop gets after backward:
:func:`tensor_norms` measures each gradient, and :func:`total_norm` combines those
norms. Both halves run the same operations, in the same order, whether they are fed
all gradients at once or one bucket at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import (
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)


class GradNorm(NamedTuple):
    """The 2-norm of one gradient, and what :func:`total_norm` needs to know of the
    gradient to combine it with the others once the gradient itself is gone."""

    #: The norm: a 0-dim tensor in the gradient's real dtype (a partial DTensor
    #: for a DTensor gradient, reduced across ranks by :func:`total_norm`).
    norm: torch.Tensor
    #: The gradient's device mesh, ``None`` for a plain tensor.
    mesh: Any
    #: The gradient's device and dtype, by which ``clip_grad_norm_`` groups them.
    device: torch.device
    dtype: torch.dtype


def _norms_of_group(grads: list[torch.Tensor], device: torch.device) -> list[Any]:
    # As torch.nn.utils.get_total_norm: one foreach kernel where the device has one,
    # else one vector_norm per tensor. A sparse gradient's norm is that of its
    # coalesced values (duplicates summed), which is what the dense gradient's is.
    if not any(g.is_sparse for g in grads) and _has_foreach_support(grads, device):
        return list(torch._foreach_norm(grads, 2.0))
    return [
        torch.linalg.vector_norm(g.coalesce().values() if g.is_sparse else g, 2.0)
        for g in grads
    ]


def tensor_norms(grads: Sequence[torch.Tensor]) -> list[GradNorm]:
    """The 2-norm of each gradient, computed as ``clip_grad_norm_`` computes it.

    Norms are computed in the gradient's own dtype (with the wider accumulation
    torch's kernels use), so a float64 gradient is measured in float64; a complex
    gradient's norm is real; a sparse gradient is measured over its coalesced values.

    Args:
        grads (Sequence[torch.Tensor]): gradients, plain tensors or DTensors.

    Returns:
        list[GradNorm]: one entry per gradient, in the order given.
    """
    # One kernel per mesh, device and dtype, as get_total_norm runs on each mesh's
    # gradients (DTensors and plain tensors cannot share a kernel).
    groups: dict[tuple[Any, torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        key = (getattr(g, "device_mesh", None), g.device, g.dtype)
        groups.setdefault(key, []).append(i)
    norms: list[Any] = [None] * len(grads)
    for (mesh, device, dtype), indices in groups.items():
        group_norms = _norms_of_group([grads[i] for i in indices], device)
        for i, norm in zip(indices, group_norms, strict=True):
            norms[i] = GradNorm(norm, mesh, device, dtype)
    return norms


def total_norm(norms: Iterable[GradNorm]) -> torch.Tensor:
    """The global 2-norm of the gradients whose norms are ``norms``, given in
    parameter order: bitwise what :func:`scale_and_clip_grads_` returns for those
    gradients.

    Norms are grouped by device mesh (plain tensors form one group of their own),
    and within a mesh by device and dtype, in the order torch's own grouping
    gives them; each mesh's norms are stacked in that order and reduced as
    ``torch.nn.utils.get_total_norm`` stacks and reduces them (for DTensors that is
    DTensor's own reduction across ranks), then the meshes' norms are combined.

    Args:
        norms (Iterable[GradNorm]): from :func:`tensor_norms`, in parameter order.

    Returns:
        torch.Tensor: the norm, a 0-dim tensor (``0.`` when ``norms`` is empty).
    """
    by_mesh: dict[Any, dict[tuple[torch.device, torch.dtype], list]] = {}
    for entry in norms:
        groups = by_mesh.setdefault(entry.mesh, {})
        groups.setdefault((entry.device, entry.dtype), []).append(entry)
    if not by_mesh:
        return torch.zeros(())
    totals = []
    for groups in by_mesh.values():
        # get_total_norm's order of the (device, dtype) groups is that of torch's
        # grouping (not their first appearance): group one empty tensor of each.
        empty = [torch.empty(0, device=d, dtype=t) for d, t in groups]
        keys = _group_tensors_by_device_and_dtype([empty])
        ordered = [entry for key in keys for entry in groups[key]]
        first_device = next(iter(groups))[0]  # the first gradient's
        total = torch.linalg.vector_norm(
            torch.stack([entry.norm.to(first_device) for entry in ordered]), 2.0
        )
        totals.append(total.full_tensor() if isinstance(total, DTensor) else total)
    if len(totals) == 1:
        return totals[0]
    return torch.linalg.vector_norm(torch.stack(totals))


def clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """What ``clip_grad_norm_`` multiplies every gradient by:
    ``clamp(max_norm / (total + 1e-6), max=1)``.

    Args:
        max_norm (float): the largest norm allowed.
        total (torch.Tensor): the gradients' global norm.

    Returns:
        torch.Tensor: the coefficient, a 0-dim tensor of ``total``'s dtype.
    """
    return (float(max_norm) / (total + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def scale_grads_(grads: Iterable[torch.Tensor], scale: torch.Tensor | float) -> None:
    """Multiply gradients by ``scale`` in place, one ``grad *= scale`` each, with a
    tensor ``scale`` moved to each gradient's device.

    Args:
        grads (Iterable[torch.Tensor]): the gradients.
        scale (torch.Tensor | float): the factor.
    """
    on_device: dict[torch.device, Any] = {}
    for grad in grads:
        if isinstance(scale, torch.Tensor) and grad.device not in on_device:
            on_device[grad.device] = scale.to(grad.device)
        grad *= on_device.get(grad.device, scale)


def scale_and_clip_grads_(
    parameters: Iterable[nn.Parameter],
    scale: torch.Tensor | float | None = None,
    max_norm: float | None = None,
) -> torch.Tensor:
    """What a training step does to its gradients after backward: multiply them by
    ``scale`` (e.g. ``1 / num_tokens`` to turn a summed loss into a mean), measure
    their global norm and, with ``max_norm``, clip them to it, by
    ``clip_grad_norm_``'s rule (:func:`clip_coefficient`).

    The norm is ``clip_grad_norm_``'s (bitwise ``torch.nn.utils.get_total_norm`` for
    dense plain tensors), also for sparse gradients and for a model that mixes
    DTensors of several device meshes with plain tensors (tensor parallelism leaves
    some parameters unsharded), which ``clip_grad_norm_`` refuses.
    :class:`~torchtune.training.OptimizerInBackward` does the same to each bucket
    inside backward, with the same operations, so both compute the same numbers.

    Args:
        parameters (Iterable[nn.Parameter]): the parameters, in model order.
        scale (torch.Tensor | float | None): the factor every gradient is multiplied
            by; ``None``: leave them as they are. Default: ``None``
        max_norm (float | None): the largest global norm allowed; ``None``: no
            clipping. Default: ``None``

    Returns:
        torch.Tensor: the global norm after scaling, before clipping.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if scale is not None:
        scale_grads_(grads, scale)
    norm = total_norm(tensor_norms(grads))
    if max_norm is not None:
        scale_grads_(grads, clip_coefficient(max_norm, norm))
    return norm


__all__ = [
    "GradNorm",
    "clip_coefficient",
    "scale_and_clip_grads_",
    "scale_grads_",
    "tensor_norms",
    "total_norm",
]
