"""Tests for torchtune/training/recipe_options.py: ``parse_compile_config`` (the
``compile`` option every recipe reads), ``check_optimizer_in_bwd_options`` and
``check_fsdp_optimizer``."""

import pytest
from omegaconf import OmegaConf

from torchtune import training
from torchtune.training import TORCH_PROFILER


@pytest.mark.parametrize("enabled", [True, False])
def test_a_bool_compiles_model_and_loss_but_never_the_optimizer_step(enabled):
    assert training.parse_compile_config(enabled) == {
        "model": enabled,
        "loss": enabled,
        "optimizer_step": False,
    }


def test_a_mapping_picks_each_part_and_leaves_the_rest_off():
    cfg = OmegaConf.create({"compile": {"loss": True, "optimizer_step": True}})
    assert training.parse_compile_config(cfg.compile) == {
        "model": False,
        "loss": True,
        "optimizer_step": True,
    }


def test_an_unknown_key_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"\['optimizer'\].*'optimizer_step'"):
        training.parse_compile_config({"optimizer": True})


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"clip_grad_norm": 1.0}, "clip_grad_norm=1.0"),
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps=4"),
        ({"compile_optimizer_step": True}, "compile.optimizer_step=True"),
    ],
)
def test_check_optimizer_in_bwd_options_refuses_each_incompatible_option(
    options, named
):
    with pytest.raises(ValueError) as info:
        training.check_optimizer_in_bwd_options(**options)
    message = str(info.value)
    # what was asked, and the fix for each of the two keys
    assert message.startswith(f"optimizer_in_bwd=True cannot be combined with {named}")
    assert "optimizer_in_bwd=False" in message
    assert f"Set {named.split('=')[0]}=" in message


def test_check_optimizer_in_bwd_options_accepts_compatible_options():
    training.check_optimizer_in_bwd_options(
        clip_grad_norm=None, gradient_accumulation_steps=1, compile_optimizer_step=False
    )


@pytest.mark.parametrize(
    "component",
    [
        "bitsandbytes.optim.AdamW8bit",
        "bitsandbytes.optim.PagedAdamW8bit",
        "bitsandbytes.optim.AdamW32bit",
        "bitsandbytes.optim.PagedAdamW",
        "bitsandbytes.optim.Lion8bit",
        # The class where bitsandbytes defines it, not only its usual alias.
        "bitsandbytes.optim.adamw.AdamW",
    ],
)
def test_check_fsdp_optimizer_refuses_bitsandbytes_8_and_32_bit_paged_or_not(
    component,
):
    with pytest.raises(ValueError) as info:
        training.check_fsdp_optimizer(component, epochs=1)
    message = str(info.value)
    # what was asked, why it fails, and what works instead
    assert message.startswith(f"optimizer._component_={component} cannot train")
    assert "DTensor" in message
    assert "Use torch.optim.AdamW or torchao.optim._AdamW" in message


@pytest.mark.parametrize(
    "component", ["torchao.optim.AdamW8bit", "torchao.optim.AdamW4bit"]
)
def test_check_fsdp_optimizer_refuses_torchao_low_bit_only_when_an_epoch_saves_it(
    component,
):
    training.check_fsdp_optimizer(component, epochs=1)
    with pytest.raises(ValueError) as info:
        training.check_fsdp_optimizer(component, epochs=2)
    message = str(info.value)
    assert message.startswith(
        f"optimizer._component_={component} cannot be combined with epochs=2"
    )
    assert "Set epochs=1 (step checkpoints, save_every_n_steps, are sharded" in message


@pytest.mark.parametrize(
    "component",
    [
        "torch.optim.AdamW",
        "torch.optim.SGD",
        "torchao.optim._AdamW",
        # bitsandbytes' pure-PyTorch LARS runs no bitsandbytes kernel.
        "bitsandbytes.optim.PytorchLARS",
    ],
)
def test_check_fsdp_optimizer_accepts_optimizers_that_train_and_checkpoint_sharded(
    component,
):
    training.check_fsdp_optimizer(component, epochs=3)


@pytest.mark.parametrize(
    "cfg_profiler",
    [None, {"enabled": False}, {"_component_": None}, {"_component_": TORCH_PROFILER}],
)
def test_check_profiler_component_takes_the_default_however_it_is_given(cfg_profiler):
    training.check_profiler_component(
        None if cfg_profiler is None else OmegaConf.create(cfg_profiler)
    )


def test_check_profiler_component_refuses_another_naming_it_and_the_fix():
    with pytest.raises(ValueError) as info:
        training.check_profiler_component(OmegaConf.create({"_component_": "my.prof"}))
    message = str(info.value)
    assert message.startswith("profiler._component_=my.prof is not supported")
    assert message.endswith(
        f"Set profiler._component_={TORCH_PROFILER}, or null for the same."
    )


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), True, "16"])
def test_check_optimizer_in_bwd_options_refuses_a_bad_bucket_cap_naming_the_key(bad):
    with pytest.raises(ValueError, match="optimizer_in_bwd_bucket_cap_mb=") as info:
        training.check_optimizer_in_bwd_options(bucket_cap_mb=bad)
    assert "leave it unset for the default" in str(info.value)


@pytest.mark.parametrize("good", [None, 0, 0.5, 16, 1024])
def test_check_optimizer_in_bwd_options_accepts_any_bucket_cap_from_zero_up(good):
    training.check_optimizer_in_bwd_options(bucket_cap_mb=good)
