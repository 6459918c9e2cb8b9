"""``training.lora_checkpoint``: a LoRA epoch checkpoint's entries, built without
touching the state dict they come from, and the adapter a resumed run starts from."""

from __future__ import annotations

import re
import weakref

import pytest
import torch

from torchtune import training
from torchtune.training.lora_checkpoint import (
    lora_epoch_checkpoint,
    lora_epoch_model_state,
    resumed_adapter,
)

RANK, ALPHA = 2, 4.0


def _state_dict(dora: bool = False) -> dict[str, torch.Tensor]:
    """One adapted projection, one plain weight (and a DoRA magnitude)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    state_dict = {
        "q_proj.weight": randn(4, 3),
        "q_proj.lora_a.weight": randn(RANK, 3),
        "q_proj.lora_b.weight": randn(4, RANK),
        "norm.scale": randn(3),
    }
    if dora:
        state_dict["q_proj.magnitude"] = randn(4).abs()
    return state_dict


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_epoch_checkpoint_merges_without_writing_to_the_tensors_it_is_given(
    dora: bool,
) -> None:
    state_dict = _state_dict(dora)
    # On CPU these are the live model's tensors.
    live = dict(state_dict)
    before = {name: value.clone() for name, value in state_dict.items()}

    ckpt = lora_epoch_checkpoint(
        state_dict, rank=RANK, alpha=ALPHA, target_modules=["q_proj"]
    )

    assert all(torch.equal(live[k], before[k]) for k in before)
    adapter_names = ["q_proj.lora_a.weight", "q_proj.lora_b.weight"]
    adapter_names += ["q_proj.magnitude"] if dora else []
    assert sorted(ckpt[training.ADAPTER_KEY]) == sorted(adapter_names)
    assert all(
        torch.equal(ckpt[training.ADAPTER_KEY][k], before[k]) for k in adapter_names
    )
    assert ckpt[training.ADAPTER_CONFIG] == {
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": ["q_proj"],
        "peft_type": "LORA",
    }
    merged = ckpt[training.MODEL_KEY]
    assert sorted(merged) == ["norm.scale", "q_proj.weight"]
    weight = before["q_proj.weight"] + (ALPHA / RANK) * (
        before["q_proj.lora_b.weight"] @ before["q_proj.lora_a.weight"]
    )
    if dora:
        weight = weight * (before["q_proj.magnitude"] / weight.norm(dim=1)).view(-1, 1)
    torch.testing.assert_close(merged["q_proj.weight"], weight)
    assert merged["norm.scale"] is live["norm.scale"]


def test_epoch_checkpoint_holds_no_weight_twice_after_the_merge() -> None:
    # A state dict of CPU copies (an accelerator's weights): once a base weight is
    # copied for the merge, the dict holds the copy only, and the original is freed.
    state_dict = _state_dict()
    original = weakref.ref(state_dict["q_proj.weight"])
    ckpt = lora_epoch_checkpoint(
        state_dict, rank=RANK, alpha=ALPHA, target_modules=["q_proj"]
    )
    assert original() is None
    assert ckpt[training.MODEL_KEY] is state_dict


def test_adapter_only_epoch_checkpoint_has_no_merged_weights() -> None:
    state_dict = _state_dict()
    ckpt = lora_epoch_checkpoint(
        state_dict, rank=RANK, alpha=ALPHA, target_modules=["q_proj"], adapter_only=True
    )
    assert sorted(ckpt) == sorted([training.ADAPTER_KEY, training.ADAPTER_CONFIG])
    assert sorted(ckpt[training.ADAPTER_KEY]) == [
        "q_proj.lora_a.weight",
        "q_proj.lora_b.weight",
    ]


def test_resumed_adapter_is_the_epoch_checkpoints_and_none_otherwise() -> None:
    base = {training.MODEL_KEY: {"w": torch.zeros(1)}}
    adapter = {"w.lora_a.weight": torch.ones(1)}
    # A new run, or a step checkpoint's resume, whose adapter resume() loads.
    assert resumed_adapter(base) is None
    epoch = base | {training.EPOCHS_KEY: 1, training.OPT_KEY: {}}
    assert resumed_adapter(epoch | {training.ADAPTER_KEY: adapter}) is adapter
    message = (
        "resume_from_checkpoint=True, but no adapter weights were found. Set "
        "checkpointer.adapter_checkpoint, or resume from an output_dir whose latest "
        "epoch_* folder holds adapter_model.pt."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        resumed_adapter(epoch)


@pytest.mark.parametrize("adapter_only", [False, True])
def test_epoch_model_state_of_a_model_config_is_its_epoch_checkpoint(
    adapter_only: bool,
) -> None:
    kwargs = {
        "lora_rank": RANK,
        "lora_alpha": ALPHA,
        "lora_attn_modules": ["q_proj", "v_proj"],
        "apply_lora_to_mlp": True,
    }
    epoch_model_state = lora_epoch_model_state(kwargs, adapter_only=adapter_only)
    expected = lora_epoch_checkpoint(
        _state_dict(),
        rank=RANK,
        alpha=ALPHA,
        # The modules the config adapts, as the PEFT adapter config names them.
        target_modules=["q_proj", "v_proj", "w1", "w2", "w3"],
        adapter_only=adapter_only,
    )
    got = epoch_model_state(_state_dict())
    assert got[training.ADAPTER_CONFIG] == expected[training.ADAPTER_CONFIG]
    assert sorted(got) == sorted(expected)
    for key in set(got) - {training.ADAPTER_CONFIG}:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
