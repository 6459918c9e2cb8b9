"""What a LoRA recipe's epoch checkpoints hold, and the adapter a resumed run starts
from: :func:`lora_epoch_checkpoint` and :func:`resumed_adapter`, for
:class:`~torchtune.training.CheckpointClient`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from torchtune.modules.peft import (
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
)
from torchtune.training.checkpointing._utils import (
    ADAPTER_CONFIG,
    ADAPTER_KEY,
    EPOCHS_KEY,
    MODEL_KEY,
)


def lora_epoch_checkpoint(
    state_dict: dict[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    target_modules: list[str],
    adapter_only: bool = False,
) -> dict[str, Any]:
    """The model entries of a LoRA model's epoch checkpoint, from its full state dict:
    the ``epoch_model_state`` of :meth:`CheckpointClient.track
    <torchtune.training.CheckpointClient.track>`.

    No tensor of ``state_dict`` is written to: each base weight that the merge adds
    an adapter into is copied first, since a state dict on CPU may hold the live
    model's own tensors (``.cpu()`` returns a CPU tensor as it is) and saving must
    never merge the adapter into the model being trained. The dict itself becomes
    the merged weights: each copy replaces its original there at once, so a state
    dict of CPU copies of an accelerator's weights holds at most one weight twice.

    Args:
        state_dict (dict[str, torch.Tensor]): the model's full (unsharded) state dict
            on CPU, which the merge consumes; with ``adapter_only``, its adapter
            weights are enough (and it is left as it is).
        rank (int): the adapters' rank (``lora_rank``).
        alpha (float): their scaling numerator (``lora_alpha``).
        target_modules (list[str]): the names of the adapted modules, as
            :func:`~torchtune.modules.peft.get_lora_module_names` returns them.
        adapter_only (bool): leave out the merged weights
            (``save_adapter_weights_only``). Default: ``False``

    Returns:
        dict[str, Any]: the adapter weights under ``training.ADAPTER_KEY``, the PEFT
        adapter config under ``training.ADAPTER_CONFIG`` and, unless
        ``adapter_only``, the base weights with the adapter merged into them under
        ``training.MODEL_KEY``.

    Example:
        >>> state_dict = {
        ...     "w.weight": torch.zeros(2, 2),
        ...     "w.lora_a.weight": torch.ones(1, 2),
        ...     "w.lora_b.weight": torch.ones(2, 1),
        ... }
        >>> live_weight = state_dict["w.weight"]
        >>> ckpt = lora_epoch_checkpoint(
        ...     state_dict, rank=1, alpha=2, target_modules=["w"]
        ... )
        >>> ckpt["model"]["w.weight"]
        tensor([[2., 2.],
                [2., 2.]])
        >>> live_weight
        tensor([[0., 0.],
                [0., 0.]])
    """
    checkpoint: dict[str, Any] = {
        ADAPTER_KEY: get_adapter_state_dict(state_dict),
        ADAPTER_CONFIG: {
            "r": rank,
            "lora_alpha": alpha,
            "target_modules": target_modules,
            "peft_type": "LORA",
        },
    }
    if not adapter_only:
        # get_merged_lora_ckpt adds each adapter into its base weight in place and
        # deletes the adapter's entries from the dict it is given.
        for name in list(state_dict):
            if name.endswith("lora_a.weight"):
                base = name.removesuffix("lora_a.weight") + "weight"
                state_dict[base] = state_dict[base].clone()
        checkpoint[MODEL_KEY] = get_merged_lora_ckpt(state_dict, rank=rank, alpha=alpha)
    return checkpoint


def lora_epoch_model_state(
    lora_model_kwargs: Mapping[str, Any], *, adapter_only: bool = False
) -> Callable[[dict[str, torch.Tensor]], dict[str, Any]]:
    """:func:`lora_epoch_checkpoint` for a LoRA model built with
    ``lora_model_kwargs`` (its ``lora_rank``, ``lora_alpha``, ``lora_attn_modules``,
    ``apply_lora_to_mlp`` and ``apply_lora_to_output``, e.g. a recipe's ``model``
    config), ready to pass as ``epoch_model_state`` to
    :meth:`CheckpointClient.track <torchtune.training.CheckpointClient.track>`.

    Args:
        lora_model_kwargs (Mapping[str, Any]): the LoRA model builder's arguments.
        adapter_only (bool): leave out the merged weights. Default: ``False``

    Returns:
        Callable[[dict[str, torch.Tensor]], dict[str, Any]]: the epoch checkpoint's
        model entries from the model's full state dict.
    """
    return partial(
        lora_epoch_checkpoint,
        rank=lora_model_kwargs["lora_rank"],
        alpha=lora_model_kwargs["lora_alpha"],
        target_modules=get_lora_module_names(
            list(lora_model_kwargs["lora_attn_modules"]),
            lora_model_kwargs["apply_lora_to_mlp"],
            lora_model_kwargs.get("apply_lora_to_output", False),
        ),
        adapter_only=adapter_only,
    )


def resumed_adapter(checkpoint_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The adapter weights a LoRA run starts from, out of what
    :meth:`CheckpointClient.load_base_checkpoint
    <torchtune.training.CheckpointClient.load_base_checkpoint>` returned.

    A run resumed from an epoch checkpoint gets the adapter with it (the configured
    checkpointer reads ``checkpointer.adapter_checkpoint``, by default the latest
    ``epoch_*`` folder's ``adapter_model.pt``, along with the recipe state). A new
    run starts with fresh adapters, and a run resumed from a step or an asynchronous
    checkpoint gets its adapter from :meth:`CheckpointClient.resume
    <torchtune.training.CheckpointClient.resume>`, once the model is built: for
    those this returns ``None``.

    Args:
        checkpoint_dict (dict[str, Any]): what ``load_base_checkpoint`` returned.

    Returns:
        dict[str, Any] | None: the adapter's state dict, or ``None``.

    Raises:
        ValueError: if the run resumes from an epoch checkpoint (the checkpointer read
            its recipe state) but found no adapter weights.
    """
    if EPOCHS_KEY in checkpoint_dict and ADAPTER_KEY not in checkpoint_dict:
        raise ValueError(
            "resume_from_checkpoint=True, but no adapter weights were found. Set "
            "checkpointer.adapter_checkpoint, or resume from an output_dir whose "
            "latest epoch_* folder holds adapter_model.pt."
        )
    return checkpoint_dict.get(ADAPTER_KEY)


__all__ = ["lora_epoch_checkpoint", "resumed_adapter"]
