"""Recipes with ``optimizer_in_bwd: True`` on a CUDA device: in-backward equals plain.

Every test here needs a CUDA device and is skipped, with that reason, where there is
none (CI has none); ``scripts/gpu_check.sh`` runs them on a GPU machine. They cover
the paths a CPU cannot run:

- ``full_finetune_distributed`` on one GPU with NCCL, where FSDP2 calls the
  parameters' post-accumulate-grad hooks (so the in-backward update) on its
  reduce-scatter stream, with and without ``fsdp_cpu_offload``. With CPU offload
  the sharded gradient is copied to pinned CPU memory and the in-backward update
  reads it on the CPU at once: the copy must be finished by then (torch 2.13's FSDP2
  makes it blocking when a parameter has such a hook; an FSDP2 that overlapped it
  would hand the optimizer memory still being written, and train on wrong
  gradients with no error).
- ``full_finetune_single_device`` with activation checkpointing and activation
  offloading, whose CUDA streams move activations to the CPU and back while
  in-backward updates run.

The model is a 2-layer Llama2 of width 1024 (33M parameters, the largest 16 MiB in
fp32), made here with a random checkpoint: its gradients take long enough to copy
(about a millisecond) that an update reading one before the copy ends would see it
half written. The tiny model of the CPU tests, whose largest gradient is 128 KiB,
could hide that. Runs are fp32, 4 steps, on the tiny instruct data.

Tolerances. In-backward and plain scale, measure and clip the gradients with the
same operations, so on the CPU they are bitwise equal. On CUDA some kernels sum in
another order from run to run (the fp32 attention backward accumulates with
atomics), about an ulp per gradient entry; in fp32 that cannot flip the sign of an AdamW update (a gradient entry that
small is far below AdamW's ``eps``). Not measured on a GPU when they were written,
the tolerances are about 100 times the CPU measurement: ``rtol=1e-5`` for losses
and grad norms, and the two runs' updates from the initial checkpoint agree within
1e-4 of the update's norm (``assert_same_update``). A real error is far larger: a
gradient read before its copy finished gives that tensor an update from garbage or
stale values for that step, at AdamW's full step size: for one 4M-element weight
that moves the updates apart by about a tenth of their norm, and for 1% of its
entries by about 1e-2; a gradient scaled twice by the token count changes grad_norm
by a factor of tens. The learning rate comes from the same schedule:
equal exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.assets.make_assets import TinyAssets, hf_config
from tests.recipes.utils import (
    TuneRun,
    assert_same_training,
    assert_same_update,
    load_weights,
    run_tune,
    run_tune_in_process,
    tiny_config,
    tolerances,
)

pytestmark = [
    pytest.mark.integration_test,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (scripts/gpu_check.sh runs these on a GPU machine)",
    ),
]

STEPS = 4
ALL_STEPS = range(1, STEPS + 1)
TIMEOUT_S = 300  # a hung collective fails the test instead of hanging it
# rtol for the losses and grad norms (docstring).
ACROSS_MODES = tolerances(1e-5, 1e-5)
UPDATE_ACROSS_MODES = 1e-4  # of the update's norm (docstring)
SHARD = "model-00001-of-00001.safetensors"

# llama2 keyword arguments of the model the tests train; the vocabulary is the tiny
# tokenizer's.
WIDTH = 1024
MODEL_KWARGS: dict[str, Any] = {
    "num_layers": 2,
    "num_heads": 8,
    "num_kv_heads": 4,
    "embed_dim": WIDTH,
    "intermediate_dim": 4 * WIDTH,
    "max_seq_len": 256,
    "norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def checkpoint_dir(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A seeded random init of the model, as a Hugging Face checkpoint (the format of
    the tiny one, only wider)."""
    from safetensors.torch import save_file

    from torchtune.models.convert_weights import tune_to_hf
    from torchtune.models.llama2 import llama2

    torch.manual_seed(0)
    model = llama2(vocab_size=tiny_assets.vocab_size, **MODEL_KWARGS)
    weights = tune_to_hf(
        model.state_dict(),
        num_heads=MODEL_KWARGS["num_heads"],
        num_kv_heads=MODEL_KWARGS["num_kv_heads"],
        dim=WIDTH,
    )
    config = hf_config(tiny_assets.vocab_size) | {
        "hidden_size": WIDTH,
        "intermediate_size": MODEL_KWARGS["intermediate_dim"],
        "num_attention_heads": MODEL_KWARGS["num_heads"],
        "num_key_value_heads": MODEL_KWARGS["num_kv_heads"],
        "num_hidden_layers": MODEL_KWARGS["num_layers"],
    }
    out = tmp_path_factory.mktemp("llama2_width1024_hf")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / SHARD))
    return out


def _overrides(
    assets: TinyAssets, checkpoint_dir: Path, **settings: Any
) -> dict[str, Any]:
    return {
        "assets_dir": assets.root,
        **{f"model.{k}": v for k, v in MODEL_KWARGS.items()},
        "checkpointer.checkpoint_dir": checkpoint_dir,
        "checkpointer.checkpoint_files": [SHARD],
        "device": "cuda",
        "dtype": "fp32",
        "epochs": 1,
        "max_steps_per_epoch": STEPS,
        # As a user writes it on the command line: null means no clipping.
        "clip_grad_norm": None,
        **settings,
    }


def _final_weights(run: TuneRun) -> dict[str, torch.Tensor]:
    return load_weights(run.output_dir / "epoch_0" / SHARD)


def _same_update(initial: dict[str, torch.Tensor]) -> Callable[..., None]:
    """Two runs' final weights moved from ``initial`` by the same update, within
    ``UPDATE_ACROSS_MODES`` of its norm (docstring)."""
    return partial(assert_same_update, rtol=UPDATE_ACROSS_MODES, initial=initial)


@pytest.mark.parametrize("fsdp_cpu_offload", [False, True], ids=["gpu", "cpu_offload"])
def test_full_finetune_distributed_in_backward_equals_plain_on_one_gpu(
    fsdp_cpu_offload: bool,
    tiny_assets: TinyAssets,
    checkpoint_dir: Path,
    tmp_path: Path,
) -> None:
    runs = {}
    for optimizer_in_bwd in (False, True):
        settings = _overrides(
            tiny_assets,
            checkpoint_dir,
            optimizer_in_bwd=optimizer_in_bwd,
            fsdp_cpu_offload=fsdp_cpu_offload,
            # One rank takes the whole batch of tiny_full_single_device.yaml.
            batch_size=8,
        )
        runs[optimizer_in_bwd] = run_tune(
            "full_finetune_distributed",
            tiny_config("tiny_full_distributed"),
            settings,
            nproc=1,
            output_dir=tmp_path / ("bwd" if optimizer_in_bwd else "plain"),
            timeout=TIMEOUT_S,
        )
    assert_same_training(
        runs[True],
        runs[False],
        ACROSS_MODES,
        ALL_STEPS,
        final_weights=_final_weights,
        weights_match=_same_update(load_weights(checkpoint_dir / SHARD)),
    )


def test_activation_offloading_with_in_backward_equals_plain_on_cuda(
    tiny_assets: TinyAssets, checkpoint_dir: Path, tmp_path: Path
) -> None:
    def run(name: str, **settings: Any) -> TuneRun:
        overrides = _overrides(
            tiny_assets,
            checkpoint_dir,
            enable_activation_checkpointing=True,
            **settings,
        )
        return run_tune_in_process(
            "full_finetune_single_device",
            tiny_config("tiny_full_single_device"),
            overrides,
            tmp_path / name,
        )

    offload = {"enable_activation_offloading": True}
    plain = run("plain_offload", optimizer_in_bwd=False, **offload)
    in_bwd = run("bwd_offload", optimizer_in_bwd=True, **offload)
    same_update = _same_update(load_weights(checkpoint_dir / SHARD))
    assert_same_training(
        in_bwd,
        plain,
        ACROSS_MODES,
        ALL_STEPS,
        final_weights=_final_weights,
        weights_match=same_update,
    )
    # Offloading moves activations, not values: without it the in-backward run is the
    # same up to CUDA's run-to-run rounding (the same tolerances).
    in_bwd_kept = run("bwd_no_offload", optimizer_in_bwd=True)
    assert_same_training(
        in_bwd,
        in_bwd_kept,
        ACROSS_MODES,
        ALL_STEPS,
        final_weights=_final_weights,
        weights_match=same_update,
    )
