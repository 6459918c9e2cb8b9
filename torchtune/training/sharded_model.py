"""Building a model sharded with FSDP2 (and optionally tensor parallel), as the
distributed recipes do: :func:`build_sharded_model`."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from torchtune import modules, utils
from torchtune.training._compile import compile_model
from torchtune.training._distributed import (
    get_shard_conditions,
    load_from_full_model_state_dict,
    prepare_mha_for_tp,
    shard_model,
    validate_no_params_on_meta_device,
)
from torchtune.training.activations import apply_selective_activation_checkpointing
from torchtune.training.memory import (
    get_memory_stats,
    log_memory_stats,
    set_activation_checkpointing,
)
from torchtune.training.precision import set_default_dtype

log = utils.get_logger("DEBUG")


def build_sharded_model(
    build: Callable[[], nn.Module],
    state_dict: dict[str, Any],
    *,
    device: torch.device,
    dtype: torch.dtype,
    dp_mesh: DeviceMesh | None = None,
    tp_mesh: DeviceMesh | None = None,
    tp_plan: dict[str, Any] | None = None,
    compile: bool = False,
    activation_checkpointing: bool = False,
    ac_mode: str | None = None,
    ac_option: int | str | None = None,
    prepare: Callable[[nn.Module], nn.Module] | None = None,
    custom_sharded_layers: list[str] | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Build a model without memory, parallelize it, and load its weights into each
    rank's shards; call it on every rank.

    The steps, in order:

    1. build the model on the meta device in ``dtype`` (and compile it if asked);
    2. tensor parallelism over ``tp_mesh`` with ``tp_plan``, when that mesh has
       more than one rank;
    3. activation checkpointing of every transformer layer, or selective activation
       checkpointing (``ac_mode``/``ac_option``) when full checkpointing is off;
       then ``prepare`` (e.g. a QAT quantizer's swap of its layers);
    4. FSDP2: each transformer layer and each of ``custom_sharded_layers`` its own
       unit, over ``dp_mesh`` (over every rank when ``None``; not at all when it has
       one rank);
    5. RoPE buffers computed on ``device``, and the full ``state_dict`` loaded into
       the shards (each rank materializes only its own).

    Args:
        build (Callable[[], nn.Module]): builds the model, e.g.
            ``functools.partial(config.instantiate, cfg.model)``.
        state_dict (dict[str, Any]): the model's full state dict.
        device (torch.device): the training device.
        dtype (torch.dtype): the parameters' dtype.
        dp_mesh (DeviceMesh | None): the data parallel mesh. Default: every rank.
        tp_mesh (DeviceMesh | None): the tensor parallel mesh. Default: none.
        tp_plan (dict[str, Any] | None): the tensor parallel plan.
        compile (bool): compile the model. Default: ``False``
        activation_checkpointing (bool): checkpoint every transformer layer.
            Default: ``False``
        ac_mode (str | None): selective activation checkpointing's mode.
        ac_option (int | str | None): selective activation checkpointing's option.
        prepare (Callable[[nn.Module], nn.Module] | None): applied before sharding.
        custom_sharded_layers (list[str] | None): more modules to shard on their own,
            e.g. ``["tok_embeddings", "output"]``.
        cpu_offload (bool): offload parameters, gradients and optimizer state to
            CPU. Default: ``False``
        reshard_after_forward (bool): free gathered parameters after forward.
            Default: ``True``

    Returns:
        nn.Module: the sharded model with its weights loaded.
    """
    start = time.perf_counter()
    is_rank_zero = dist.get_rank() == 0
    with set_default_dtype(dtype), torch.device("meta"):
        model = build()
    if compile:
        compile_model(model, verbose=is_rank_zero)

    if tp_mesh is not None and tp_mesh.size() > 1:
        # Heads and embed_dim become per-rank numbers before the plan splits them.
        model = prepare_mha_for_tp(model, tp_mesh)
        parallelize_module(model, tp_mesh, tp_plan)

    if activation_checkpointing:
        set_activation_checkpointing(
            model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
        )
    elif ac_mode is not None:
        apply_selective_activation_checkpointing(model, ac_mode, ac_option)
    if prepare is not None:
        model = prepare(model)

    if dp_mesh is None or dp_mesh.size() > 1:
        shard_model(
            model=model,
            shard_conditions=[
                partial(get_shard_conditions, names_to_match=custom_sharded_layers)
            ],
            cpu_offload=cpu_offload,
            reshard_after_forward=reshard_after_forward,
            dp_mesh=dp_mesh,
        )

    with set_default_dtype(dtype), device:
        for m in model.modules():
            # RoPE buffers are not in the state dict: compute them on the device.
            if hasattr(m, "rope_init"):
                m.rope_init()
    load_from_full_model_state_dict(
        model, state_dict, device, strict=True, cpu_offload=cpu_offload
    )
    validate_no_params_on_meta_device(model)
    utils.log_rank_zero(
        log,
        f"Model built, sharded and loaded in {time.perf_counter() - start:.2f} s, "
        f"in {dtype}.",
    )
    if is_rank_zero and device.type != "cpu":
        log_memory_stats(get_memory_stats(device=device))
    dist.barrier()
    return model


__all__ = ["build_sharded_model"]
