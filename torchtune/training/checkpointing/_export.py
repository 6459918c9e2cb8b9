"""The epoch export, ``epoch_{N}/``: the weights users take away after each epoch.

It is written through torchtune's own checkpointers, in the format the config asks
(Hugging Face, Meta or torchtune), as torchtune 0.6.1 wrote it; a LoRA model's export
holds its adapter, the adapter's PEFT config and, unless the run saves the adapter
only, the weights with the adapter merged in. Its manifest, beside the folder, records
the run and step that wrote it, so that a resume can tell a torn export, or another
run's, from its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchtune import utils
from torchtune.modules import peft
from torchtune.training._distributed import gather_cpu_state_dict
from torchtune.training.checkpointing._step_format import (
    CheckpointError,
    export_manifest,
    in_process_group,
    process_rank,
    verify,
)
from torchtune.training.checkpointing._utils import (
    ADAPTER_CONFIG,
    ADAPTER_KEY,
    MODEL_KEY,
)

log = utils.get_logger("DEBUG")


def export_state(
    model: torch.nn.Module,
    *,
    device: torch.device,
    adapter_config: Mapping[str, Any] | None,
    adapter_only: bool,
) -> dict[str, Any] | None:
    """What a checkpointer's ``save_checkpoint`` is given to export ``model``: its
    full weights on the CPU or, for a LoRA model (``adapter_config`` given), the
    adapter, its config and, unless ``adapter_only``, the merged weights. Call it on
    every rank (a sharded model is gathered); rank 0 gets the state, the others
    ``None``. The live weights are never changed."""
    if in_process_group():
        state = gather_cpu_state_dict(model, process_rank() == 0, device, adapter_only)
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if process_rank() != 0:
        return None
    if adapter_config is None:
        return {MODEL_KEY: state}
    export = {ADAPTER_KEY: peft.get_adapter_state_dict(state)}
    # A copy: the Hugging Face checkpointer rewrites the config it saves.
    export[ADAPTER_CONFIG] = dict(adapter_config)
    if adapter_only:
        return export
    # Merged into copies: a CPU state dict may hold the model's own tensors.
    for key in [k for k in state if k.endswith("lora_a.weight")]:
        base = key.removesuffix("lora_a.weight") + "weight"
        state[base] = state[base].clone()
    rank, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    export[MODEL_KEY] = peft.get_merged_lora_ckpt(state, rank, alpha)
    return export


def save_export(
    checkpointer: Any,
    state: dict[str, Any],
    *,
    epoch: int,
    adapter_only: bool,
    final: bool,
) -> None:
    """Write ``epoch_{epoch}`` through ``checkpointer``.

    torchtune's checkpointers write an epoch's weights alone only as a final save
    (``intermediate_checkpoint=False``; an intermediate one also writes 0.6.1's
    ``recipe_state/recipe_state.pt``), and say so: "Saving final epoch checkpoint.".
    So before the ``final`` epoch they are heard at warning level only, and the
    manager says where the export went."""
    quiet = not final
    level = log.level  # the logger every torchtune module shares
    if quiet:
        log.setLevel(logging.WARNING)
    try:
        checkpointer.save_checkpoint(state, epoch=epoch, adapter_only=adapter_only)
    finally:
        if quiet:
            log.setLevel(level)


def not_this_runs_export(folder: Path, *, run_id: str | None, step: int) -> str | None:
    """Why the export ``folder`` is not the one run ``run_id`` wrote at ``step``
    (damaged, torn, or written by another run or by a timeline this run branched
    from), or ``None`` when it is."""
    try:
        manifest = verify(folder, export_manifest(folder))
    except CheckpointError as e:
        return str(e)
    written_by = manifest.get("run_id")
    if (written_by, manifest.get("step")) != (run_id, step):
        return f"{folder} holds the weights of run {written_by}"
    return None


__all__ = ["export_state", "not_this_runs_export", "save_export"]
