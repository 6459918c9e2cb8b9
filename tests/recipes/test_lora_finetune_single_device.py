"""``lora_finetune_single_device``: checkpoints load back, saving leaves the model
alone, DoRA and QLoRA update inside backward, and 0.6.1's epoch checkpoints resume.
What it shares with ``full_finetune_single_device`` (in-backward equals plain,
resumes from epoch 0, bf16) is in ``test_single_device_recipes.py``, with the runs
of ``single_device.py`` used here too.

The runs are real ``tune run`` command lines of the tiny LoRA Llama2 on CPU (see
``tests/recipes/configs/tiny_lora_single_device.yaml``), run in this process
(``tune_run_here``), which saves the ~10 s of imports a subprocess pays
(``tests/recipes/test_harness_smoke.py`` shows the two train alike, bitwise).

Every comparison names the exact steps it compares and checks that both runs
logged those steps; the final adapters are compared too (they hold the last step's
update, which no logged loss shows). ``assert_series_close``,
``assert_weights_close`` and ``assert_same_update`` print the largest difference
they see (``pytest -s``); the values below were measured that way on this
project's x86 CPU.

Tolerances:

- A resume of 0.6.1's epoch checkpoint, in either mode: bitwise (``rtol=0,
  atol=0``), as any resume that switches mode (``test_single_device_recipes.py``).
- In-backward against plain, DoRA and QLoRA with activation checkpointing: both
  backpropagate ``mean * tokens``, multiply the gradients by ``1 / tokens``, measure
  them with the same operations (in-backward inside backward, per bucket), so
  losses, grad norms and adapters are bitwise equal. These runs do not clip.
- The merged checkpoint against the adapter model it came from: ``x (W + s B A)^T``
  against ``x W^T + s (x A^T) B^T`` is the same sum in a different order, a few fp32
  ulps per layer: measured 3.0e-7 at most on logits up to 0.61, ``atol=3e-6``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from tests.assets.make_assets import TinyAssets
from tests.helpers import BITWISE
from tests.recipes.single_device import (
    ALL_STEPS,
    EPOCH_1,
    LORA,
    SHARD,
    STEPS_PER_EPOCH,
    Recipe,
    Runs,
    mode_name,
)
from tests.recipes.utils import (
    BITWISE_TRAINING,
    TuneRun,
    as_indexed,
    assert_same_steps,
    assert_same_training,
    assert_series_close,
    assert_weights_close,
    format_override,
    full_optimizer_state,
    load_recipe_class,
    series,
)

pytestmark = pytest.mark.integration_test

RECIPE, CONFIG = LORA.name, LORA.config
# The tiny config's adapters.
LORA_KWARGS = {
    "lora_attn_modules": ["q_proj", "v_proj", "output_proj"],
    "apply_lora_to_mlp": True,
    "apply_lora_to_output": False,
    "lora_rank": 4,
    "lora_alpha": 8,
}


def _num_lora_b(num_layers: int) -> int:
    """How many ``lora_b`` weights the adapters of ``LORA_KWARGS`` have: one per
    adapted projection of each layer (q, v and output; the MLP's w1, w2 and w3)."""
    return num_layers * (len(LORA_KWARGS["lora_attn_modules"]) + 3)


def tune_run_here(
    config: Path, overrides: Mapping[str, object] | list[str], output_dir: Path
) -> TuneRun:
    """``tune run RECIPE --config config overrides`` in this process."""
    return LORA.run(config, overrides, output_dir)


def _write_0_6_1_epoch_checkpoint(
    run: TuneRun, out: Path, steps_per_epoch: int
) -> None:
    """Write into ``out`` the epoch-0 checkpoint torchtune 0.6.1 would have left:
    ``run``'s ``epoch_0`` and a ``recipe_state/recipe_state.pt`` holding the optimizer
    state of the end of epoch 0 (taken from ``run``'s step checkpoint there; 0.6.1's
    LoRA recipes had no in-backward mode, so it is in the plain format)."""
    from torchtune import training

    shutil.copytree(run.output_dir / "epoch_0", out / "epoch_0")
    step = run.output_dir / f"step_{steps_per_epoch}"
    state = {
        training.OPT_KEY: as_indexed(full_optimizer_state(step)),
        training.SEED_KEY: 0,
        training.EPOCHS_KEY: 1,
        training.TOTAL_EPOCHS_KEY: 2,
        training.MAX_STEPS_KEY: steps_per_epoch,
    }
    (out / "recipe_state").mkdir()
    torch.save(state, out / "recipe_state" / "recipe_state.pt")


@pytest.fixture(scope="module")
def runs(single_device_runs: Callable[[Recipe], Runs]) -> Runs:
    return single_device_runs(LORA)


@pytest.fixture(scope="module")
def adamw_runs(runs: Runs) -> dict[str, TuneRun]:
    return runs.adamw


@pytest.mark.parametrize("source,target", [("plain", "bwd"), ("bwd", "plain")])
def test_resume_from_a_0_6_1_epoch_checkpoint_gives_the_uninterrupted_losses(
    runs: Runs, tmp_path: Path, source: str, target: str
) -> None:
    # 0.6.1 failed this on CPU in every mode: its epoch-0 save merged the adapter
    # into the live base weights, so the uninterrupted epoch 1 trained a corrupted
    # model, while the resumed one started from clean base weights. The plain run's
    # 0.6.1 checkpoint names its adapter with checkpointer.adapter_checkpoint; the
    # in-backward run's (adapter only) is found in the latest epoch_* folder.
    _write_0_6_1_epoch_checkpoint(runs.adamw[source], tmp_path, STEPS_PER_EPOCH)
    named = {}
    if source == "plain":
        named["checkpointer.adapter_checkpoint"] = "epoch_0/adapter_model.pt"
    resumed = LORA.run(CONFIG, runs.resume_settings(target) | named, tmp_path)
    # Bitwise in either mode (test_single_device_recipes.py).
    assert_same_training(
        resumed,
        runs.adamw[source],
        BITWISE_TRAINING,
        EPOCH_1,
        reference_steps=ALL_STEPS,
        final_weights=LORA.trained,
    )


def _lora_model(tiny_assets: TinyAssets, adapter_file: Path) -> torch.nn.Module:
    """The tiny LoRA model with the asset's base weights and the saved adapter."""
    from torchtune import training
    from torchtune.models.llama2 import lora_llama2
    from torchtune.modules.peft import validate_missing_and_unexpected_for_lora

    # lora_llama2 takes no rope_base; the assets use its default.
    kwargs = {k: v for k, v in tiny_assets.model_kwargs.items() if k != "rope_base"}
    model = lora_llama2(**kwargs, **LORA_KWARGS)
    checkpointer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(tiny_assets.checkpoint_dir),
        checkpoint_files=list(tiny_assets.checkpoint_files),
        model_type="LLAMA2",
        output_dir=str(adapter_file.parent / "unused"),
    )
    base = checkpointer.load_checkpoint()[training.MODEL_KEY]
    base_missing, base_unexpected = model.load_state_dict(base, strict=False)
    adapter = torch.load(adapter_file, weights_only=True)
    lora_missing, lora_unexpected = model.load_state_dict(adapter, strict=False)
    # Every base weight and every adapter weight, nothing else.
    validate_missing_and_unexpected_for_lora(
        lora_attn_modules=LORA_KWARGS["lora_attn_modules"],
        apply_lora_to_mlp=LORA_KWARGS["apply_lora_to_mlp"],
        apply_lora_to_output=LORA_KWARGS["apply_lora_to_output"],
        base_missing=base_missing,
        base_unexpected=base_unexpected,
        lora_missing=lora_missing,
        lora_unexpected=lora_unexpected,
    )
    return model


def test_merged_checkpoint_loads_back_and_computes_what_the_adapter_model_does(
    tiny_assets: TinyAssets, adamw_runs: dict[str, TuneRun], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from torchtune import training
    from torchtune.models.llama2 import llama2

    final = adamw_runs["plain"].output_dir / "epoch_1"
    original = load_file(tiny_assets.checkpoint_dir / tiny_assets.checkpoint_files[0])
    merged = load_file(final / SHARD)
    # HF key names and shapes, an index, the model's config.
    assert set(merged) == set(original)
    assert (final / "model.safetensors.index.json").is_file()
    assert (final / "config.json").is_file()
    # The adapter was merged where there is one, and nowhere else.
    for key in original:
        adapted = any(m in key for m in ("q_proj", "v_proj", "o_proj", "mlp"))
        assert torch.equal(merged[key], original[key]) != adapted, key

    checkpointer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(final),
        checkpoint_files=[SHARD],
        model_type="LLAMA2",
        output_dir=str(tmp_path),
    )
    model = llama2(**tiny_assets.model_kwargs)
    # strict: every key, every shape
    model.load_state_dict(checkpointer.load_checkpoint()[training.MODEL_KEY])
    lora_model = _lora_model(tiny_assets, final / "adapter_model.pt")
    tokens = torch.randint(
        0, tiny_assets.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        # Tolerance: see the module docstring.
        assert_close(model(tokens), lora_model(tokens), rtol=0.0, atol=3e-6)


def test_adapter_only_checkpoint_loads_back(
    tiny_assets: TinyAssets, adamw_runs: dict[str, TuneRun]
) -> None:
    from safetensors.torch import load_file

    from torchtune.models.convert_weights import tune_to_peft_adapter_weights

    out = adamw_runs["bwd"].output_dir
    for epoch in ("epoch_0", "epoch_1"):
        assert not list((out / epoch).glob("model-*.safetensors")), epoch
    final = out / "epoch_1"
    # Loads into the LoRA model as its exact set of adapter weights (checked inside).
    lora_model = _lora_model(tiny_assets, final / "adapter_model.pt")
    adapter = torch.load(final / "adapter_model.pt", weights_only=True)
    assert all(torch.equal(lora_model.state_dict()[k], v) for k, v in adapter.items())

    # The PEFT copy holds the same numbers under PEFT's names and layout.
    kwargs = tiny_assets.model_kwargs
    peft = tune_to_peft_adapter_weights(
        adapter,
        num_heads=kwargs["num_heads"],
        num_kv_heads=kwargs["num_kv_heads"],
        dim=kwargs["embed_dim"],
    )
    assert_close(load_file(final / "adapter_model.safetensors"), peft, **BITWISE)
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == LORA_KWARGS["lora_rank"]
    assert config["lora_alpha"] == LORA_KWARGS["lora_alpha"]
    assert config["peft_type"] == "LORA"

    # Trained: every lora_b starts at zero.
    lora_b = [v for k, v in adapter.items() if "lora_b" in k]
    assert len(lora_b) == _num_lora_b(tiny_assets.model_kwargs["num_layers"])
    assert all(v.abs().max() > 0 for v in lora_b)


# A 1-layer Llama2 wide enough for NF4, whose blocks need >= 16384 weights per
# matrix (the tiny asset model's hold 4096).
QLORA_MODEL_KWARGS = {
    "vocab_size": 512,
    "num_layers": 1,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 256,
    "intermediate_dim": 512,
    "max_seq_len": 256,
    "norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def qlora_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random ``QLORA_MODEL_KWARGS`` Llama2 as a Hugging Face checkpoint."""
    from safetensors.torch import save_file

    from torchtune.models.convert_weights import tune_to_hf
    from torchtune.models.llama2 import llama2

    model = llama2(**QLORA_MODEL_KWARGS)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(
                torch.ones_like(param)
                if name.endswith("scale")
                else torch.normal(0.0, 0.02, param.shape, generator=generator)
            )
    out = tmp_path_factory.mktemp("qlora_checkpoint")
    state_dict = tune_to_hf(
        model.state_dict(),
        num_heads=QLORA_MODEL_KWARGS["num_heads"],
        num_kv_heads=QLORA_MODEL_KWARGS["num_kv_heads"],
        dim=QLORA_MODEL_KWARGS["embed_dim"],
    )
    save_file(
        {k: v.contiguous() for k, v in state_dict.items()}, out / "model.safetensors"
    )
    kwargs = QLORA_MODEL_KWARGS
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": kwargs["embed_dim"],
                "intermediate_size": kwargs["intermediate_dim"],
                "num_attention_heads": kwargs["num_heads"],
                "num_key_value_heads": kwargs["num_kv_heads"],
                "num_hidden_layers": kwargs["num_layers"],
                "vocab_size": kwargs["vocab_size"],
                "rms_norm_eps": kwargs["norm_eps"],
                "max_position_embeddings": kwargs["max_seq_len"],
                "tie_word_embeddings": False,
            }
        )
    )
    return out


def _variant_overrides(variant: str, qlora_checkpoint_dir: Path) -> dict[str, object]:
    if variant == "dora":
        return {"model.use_dora": True}
    if variant == "qlora":
        return {
            "model.quantize_base": True,
            **{f"model.{k}": v for k, v in QLORA_MODEL_KWARGS.items()},
            "checkpointer.checkpoint_dir": qlora_checkpoint_dir,
            "low_cpu_ram": True,
        }
    return {}


@pytest.mark.parametrize("variant", ["lora", "dora", "qlora"])
def test_saving_a_checkpoint_leaves_the_model_unchanged(
    variant: str,
    tiny_assets: TinyAssets,
    qlora_checkpoint_dir: Path,
    tmp_path: Path,
) -> None:
    from omegaconf import OmegaConf

    overrides = {
        "assets_dir": tiny_assets.root,
        "output_dir": tmp_path,
        "epochs": 2,  # epoch 0's end: a step checkpoint and the export
        **_variant_overrides(variant, qlora_checkpoint_dir),
    }
    cfg = OmegaConf.merge(
        OmegaConf.load(CONFIG),
        OmegaConf.from_dotlist([format_override(k, v) for k, v in overrides.items()]),
    )
    recipe = load_recipe_class(RECIPE, "LoRAFinetuneRecipeSingleDevice")(cfg)
    recipe.setup(cfg)
    model = recipe._model
    # A trained adapter: 0.6.1's in-place merge of a fresh one (lora_b = 0) adds 0.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in recipe.adapter_params.values():
            param.normal_(1.0, 0.5, generator=generator)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    # What the loop does at an epoch's end.
    recipe.progress.epochs_run += 1
    recipe._checkpoint.save(epoch_end=True)

    after = model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"saving changed {changed}"
    assert (tmp_path / "epoch_0" / "adapter_model.pt").is_file()
    assert (tmp_path / "epoch_0" / SHARD).is_file()


VARIANT_STEPS = range(1, 5)


@pytest.mark.parametrize("variant", ["dora", "qlora"])
def test_dora_and_qlora_with_activation_checkpointing_update_inside_backward(
    variant: str,
    tiny_assets: TinyAssets,
    qlora_checkpoint_dir: Path,
    tmp_path: Path,
) -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from torchtune.training import OptimizerInBackward

    # OptimizerInBackward.step() performs any update the backward hooks missed, so
    # matching losses alone would not show that the updates ran inside backward.
    # Record, at every step() of the in-backward optimizer, how many trainable
    # parameters still hold a gradient: all of them, had no hook fired.
    left_for_step: list[tuple[int, int]] = []

    def before_step(optimizer, args, kwargs) -> None:
        if isinstance(optimizer, OptimizerInBackward):
            trainable = [
                p
                for g in optimizer.param_groups
                for p in g["params"]
                if p.requires_grad
            ]
            with_grad = sum(p.grad is not None for p in trainable)
            left_for_step.append((len(trainable), with_grad))

    handle = register_optimizer_step_pre_hook(before_step)
    try:
        runs = {
            mode_name(bwd): tune_run_here(
                CONFIG,
                {
                    "assets_dir": tiny_assets.root,
                    # Every step but the first follows an update at the peak lr.
                    "max_steps_per_epoch": len(VARIANT_STEPS),
                    "lr_scheduler.num_warmup_steps": 0,
                    # Recomputing activations in backward must not upset the
                    # in-backward updates, which run as each gradient is accumulated.
                    "enable_activation_checkpointing": True,
                    "optimizer_in_bwd": bwd,
                    "clip_grad_norm": None,
                    **_variant_overrides(variant, qlora_checkpoint_dir),
                },
                tmp_path / mode_name(bwd),
            )
            for bwd in (False, True)
        }
    finally:
        handle.remove()
    plain, bwd = runs["plain"], runs["bwd"]
    steps = assert_same_steps(bwd, plain, VARIANT_STEPS)
    # One step() a step, each finding every trainable parameter's gradient used.
    assert len(left_for_step) == len(steps), left_for_step
    assert all(n > 0 and left == 0 for n, left in left_for_step), left_for_step
    # The norm in-backward logs was recorded as the hooks updated the parameters,
    # before step(): it is the plain run's norm only if every update ran in backward.
    assert (series(bwd, "grad_norm", steps) > 0).all()
    assert_series_close(bwd, plain, "grad_norm", steps, **BITWISE)
    assert_series_close(bwd, plain, "loss", steps, **BITWISE)
    num_layers = (
        QLORA_MODEL_KWARGS["num_layers"]
        if variant == "qlora"
        else (tiny_assets.model_kwargs["num_layers"])
    )
    adapters = {name: LORA.trained(run, 0) for name, run in runs.items()}
    for adapter in adapters.values():
        # lora_b starts at zero: it moved, so the adapter trained.
        lora_b = [v for k, v in adapter.items() if "lora_b" in k]
        assert len(lora_b) == _num_lora_b(num_layers), sorted(adapter)
        assert all(v.abs().max() > 0 for v in lora_b)
    assert_weights_close(adapters["bwd"], adapters["plain"], **BITWISE)


def test_resume_from_an_epoch_checkpoint_without_its_adapter_is_refused(
    tiny_assets: TinyAssets, adamw_runs: dict[str, TuneRun], tmp_path: Path
) -> None:
    # A 0.6.1 epoch-0 recipe state, but no adapter_model.pt. Without an adapter the
    # checkpointer reads the model from output_dir, as for a full fine-tune: give it
    # one there, so that only the adapter is missing.
    _write_0_6_1_epoch_checkpoint(adamw_runs["plain"], tmp_path, STEPS_PER_EPOCH)
    (tmp_path / "epoch_0" / "adapter_model.pt").unlink()
    for name in tiny_assets.checkpoint_files:
        shutil.copy(tiny_assets.checkpoint_dir / name, tmp_path / name)
    message = (
        "resume_from_checkpoint=True, but no adapter weights were found. Set "
        "checkpointer.adapter_checkpoint, or resume from an output_dir whose latest "
        "epoch_* folder holds adapter_model.pt."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        tune_run_here(
            CONFIG,
            {"assets_dir": tiny_assets.root, "resume_from_checkpoint": True},
            tmp_path,
        )
    assert not (tmp_path / "epoch_1").exists()
