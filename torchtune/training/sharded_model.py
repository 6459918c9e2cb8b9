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
from torchtune.training.recipe_options import RecipeOptions

log = utils.get_logger("DEBUG")


def build_sharded_model(
    build: Callable[[], nn.Module],
    state_dict: dict[str, Any],
    options: RecipeOptions,
    *,
    checkpoint_activations: bool = True,
    prepare: Callable[[nn.Module], nn.Module] | None = None,
    device_mesh: DeviceMesh | None = None,
    tp_plan: dict[str, Any] | None = None,
) -> nn.Module:
    """Build a model without memory, parallelize it, and load its weights into each
    rank's shards; call it on every rank.

    The steps, in order:

    1. build the model on the meta device in ``options.dtype`` (and compile it if
       ``options.compile["model"]``);
    2. tensor parallelism over ``device_mesh["tp"]`` with ``tp_plan``, when that
       mesh has more than one rank;
    3. activation checkpointing of every transformer layer
       (``options.enable_activation_checkpointing``), or else selective activation
       checkpointing (``options.ac_mode``, ``options.ac_option``); then ``prepare``
       (e.g. a QAT quantizer's swap of its layers);
    4. FSDP2 (``options.fsdp_cpu_offload``, ``fsdp_reshard_after_forward``): each
       transformer layer and each of ``options.custom_sharded_layers`` its own unit,
       over ``device_mesh["dp"]`` (over every rank without a mesh; not at all when
       it has one rank);
    5. RoPE buffers computed on ``options.device``, and the full ``state_dict``
       loaded into the shards (each rank materializes only its own).

    Args:
        build (Callable[[], nn.Module]): builds the model, e.g.
            ``functools.partial(config.instantiate, cfg.model)``.
        state_dict (dict[str, Any]): the model's full state dict.
        options (RecipeOptions): the recipe's options, read as above.
        checkpoint_activations (bool): ``False``: no activation checkpointing,
            whatever ``options`` ask (a frozen model run without autograd).
            Default: ``True``
        prepare (Callable[[nn.Module], nn.Module] | None): applied before sharding.
            Default: ``None``
        device_mesh (DeviceMesh | None): a mesh with ``"dp"`` and ``"tp"`` dimensions.
            Default: data parallel over every rank.
        tp_plan (dict[str, Any] | None): the tensor parallel plan. Default: ``None``

    Returns:
        nn.Module: the sharded model with its weights loaded.
    """
    device, dtype = options.device, options.dtype
    dp_mesh = tp_mesh = None
    if device_mesh is not None:
        dp_mesh, tp_mesh = device_mesh["dp"], device_mesh["tp"]
    start = time.perf_counter()
    is_rank_zero = dist.get_rank() == 0
    with set_default_dtype(dtype), torch.device("meta"):
        model = build()
    if options.compile["model"]:
        compile_model(model, verbose=is_rank_zero)

    if tp_mesh is not None and tp_mesh.size() > 1:
        # Heads and embed_dim become per-rank numbers before the plan splits them.
        model = prepare_mha_for_tp(model, tp_mesh)
        parallelize_module(model, tp_mesh, tp_plan)

    if checkpoint_activations and options.enable_activation_checkpointing:
        set_activation_checkpointing(
            model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
        )
    elif checkpoint_activations and options.ac_mode is not None:
        apply_selective_activation_checkpointing(
            model, options.ac_mode, options.ac_option
        )
    if prepare is not None:
        model = prepare(model)

    if dp_mesh is None or dp_mesh.size() > 1:
        layers = options.custom_sharded_layers
        shard_model(
            model=model,
            shard_conditions=[partial(get_shard_conditions, names_to_match=layers)],
            cpu_offload=options.fsdp_cpu_offload,
            reshard_after_forward=options.fsdp_reshard_after_forward,
            dp_mesh=dp_mesh,
        )

    with set_default_dtype(dtype), device:
        for m in model.modules():
            # RoPE buffers are not in the state dict: compute them on the device.
            if hasattr(m, "rope_init"):
                m.rope_init()
    load_from_full_model_state_dict(
        model, state_dict, device, strict=True, cpu_offload=options.fsdp_cpu_offload
    )
    validate_no_params_on_meta_device(model)
    elapsed = time.perf_counter() - start
    utils.log_rank_zero(
        log, f"Model built, sharded and loaded in {elapsed:.2f} s, in {dtype}."
    )
    if is_rank_zero and device.type != "cpu":
        log_memory_stats(get_memory_stats(device=device))
    dist.barrier()
    return model
