"""Tests for torchtune/training/recipe_options.py: ``RecipeOptions``, every option
the recipes share, read and checked once (``compile``, what ``optimizer_in_bwd``
refuses, the optimizers FSDP2 refuses, the profiler a recipe can build)."""

import dataclasses
import importlib.util
import logging
import re

import pytest
import torch
from omegaconf import OmegaConf

from torchtune import training
from torchtune.training.recipe_options import BOOL_KEYS, COUNT_KEYS, warn_unknown_keys

CPU = torch.device("cpu")
TORCH_PROFILER = "torchtune.training.setup_torch_profiler"


def _options(**kwargs) -> training.RecipeOptions:
    return training.RecipeOptions(device=CPU, dtype=torch.float32, **kwargs)


def _cfg(**options) -> OmegaConf:
    return OmegaConf.create(
        {
            "device": "cpu",
            "dtype": "fp32",
            "epochs": 1,
            "optimizer": {"_component_": "torch.optim.AdamW"},
            **options,
        }
    )


def _compile(cfg_compile) -> dict[str, bool]:
    return training.RecipeOptions.from_config(_cfg(compile=cfg_compile)).compile


@pytest.mark.parametrize("enabled", [True, False])
def test_a_bool_compiles_model_and_loss_but_never_the_optimizer_step(enabled):
    assert _compile(enabled) == {
        "model": enabled,
        "loss": enabled,
        "optimizer_step": False,
    }


def test_a_mapping_picks_each_part_and_leaves_the_rest_off():
    assert _compile({"loss": True, "optimizer_step": True}) == {
        "model": False,
        "loss": True,
        "optimizer_step": True,
    }


def test_an_unknown_key_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"\['optimizer'\].*'optimizer_step'"):
        _compile({"optimizer": True})


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps=4"),
        (
            {"compile": {"model": False, "loss": False, "optimizer_step": True}},
            "compile.optimizer_step=True",
        ),
    ],
)
def test_in_backward_refuses_each_incompatible_option(options, named):
    with pytest.raises(ValueError) as info:
        _options(optimizer_in_bwd=True, **options)
    message = str(info.value)
    # what was asked, and the fix for each of the two keys
    assert message.startswith(f"optimizer_in_bwd=True cannot be combined with {named}")
    assert "optimizer_in_bwd=False" in message
    assert f"Set {named.split('=')[0]}=" in message
    _options(**options)  # fine without in-backward


def test_in_backward_refuses_clipping_with_activation_offloading():
    # The second backward pass of clipping needs the activations offloading frees.
    cuda = {"device": torch.device("cuda"), "dtype": torch.float32}
    offloading = {"enable_activation_offloading": True}
    offloading |= {"enable_activation_checkpointing": True}
    with pytest.raises(ValueError) as info:
        training.RecipeOptions(
            **cuda, **offloading, optimizer_in_bwd=True, clip_grad_norm=1.0
        )
    message = str(info.value)
    assert message.startswith(
        "optimizer_in_bwd=True with clip_grad_norm=1.0 cannot be combined with "
        "enable_activation_offloading=True"
    )
    for fix in (
        "enable_activation_offloading=False",
        "clip_grad_norm=null",
        "optimizer_in_bwd=False",
    ):
        assert fix in message
    training.RecipeOptions(**cuda, **offloading, optimizer_in_bwd=True)
    # Clipping happens inside OptimizerInBackward.backward().
    _options(optimizer_in_bwd=True, clip_grad_norm=1.0)


def _distributed(component: str, async_save: bool = False) -> training.RecipeOptions:
    cfg = _cfg(
        optimizer={"_component_": component}, enable_async_checkpointing=async_save
    )
    return training.RecipeOptions.from_config(cfg, distributed=True)


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
def test_distributed_refuses_bitsandbytes_8_and_32_bit_paged_or_not(component):
    with pytest.raises(ValueError) as info:
        _distributed(component)
    message = str(info.value)
    # what was asked, why it fails, and what works instead
    assert message.startswith(f"optimizer._component_={component} cannot train")
    assert "DTensor" in message
    assert "Use torch.optim.AdamW or torchao.optim._AdamW" in message
    # One device: bitsandbytes trains.
    training.RecipeOptions.from_config(_cfg(optimizer={"_component_": component}))


@pytest.mark.parametrize(
    "component", ["torchao.optim.AdamW8bit", "torchao.optim.AdamW4bit"]
)
def test_distributed_refuses_torchao_low_bit_only_with_asynchronous_saves(component):
    _distributed(component, async_save=False)
    with pytest.raises(ValueError) as info:
        _distributed(component, async_save=True)
    message = str(info.value)
    assert message.startswith(
        f"optimizer._component_={component} cannot be combined with "
        "enable_async_checkpointing=True"
    )
    assert "Set enable_async_checkpointing=False" in message


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
def test_distributed_accepts_optimizers_that_train_and_checkpoint_sharded(component):
    _distributed(component, async_save=True)


@pytest.mark.parametrize(
    ("component", "in_bwd"),
    [
        ("torch.optim.LBFGS", False),
        ("torch.optim.SparseAdam", False),
        ("torchao.optim.CPUOffloadOptimizer", True),
    ],
)
def test_an_optimizer_the_recipes_cannot_step_is_refused_naming_it(component, in_bwd):
    cfg = _cfg(optimizer={"_component_": component}, optimizer_in_bwd=in_bwd)
    with pytest.raises(ValueError, match=f"^optimizer._component_={component} cannot"):
        training.RecipeOptions.from_config(cfg)


@pytest.mark.parametrize(
    "cfg_profiler",
    [{"enabled": False}, {"_component_": None}, {"_component_": TORCH_PROFILER}],
)
def test_the_profiler_component_takes_the_default_however_it_is_given(cfg_profiler):
    training.RecipeOptions.from_config(_cfg(profiler=cfg_profiler))


def test_another_profiler_component_is_refused_naming_it_and_the_fix():
    with pytest.raises(ValueError) as info:
        training.RecipeOptions.from_config(_cfg(profiler={"_component_": "my.prof"}))
    message = str(info.value)
    assert message.startswith("profiler._component_=my.prof is not supported")
    assert message.endswith(
        f"Set profiler._component_={TORCH_PROFILER}, or null for the same."
    )


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), True, "16"])
def test_in_backward_refuses_a_bad_bucket_cap_naming_the_key(bad):
    with pytest.raises(ValueError, match="optimizer_in_bwd_bucket_cap_mb=") as info:
        _options(optimizer_in_bwd=True, bucket_cap_mb=bad)
    assert "leave it unset for the default" in str(info.value)


@pytest.mark.parametrize("good", [None, 0, 0.5, 16, 1024])
def test_in_backward_accepts_any_bucket_cap_from_zero_up(good):
    _options(optimizer_in_bwd=True, bucket_cap_mb=good)


# -- RecipeOptions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "optimizer_in_bwd",
        "enable_activation_checkpointing",
        "enable_activation_offloading",
        "fsdp_cpu_offload",
        "fsdp_reshard_after_forward",
        "enable_async_checkpointing",
        "log_peak_memory_stats",
    ],
)
@pytest.mark.parametrize("value", ["False", 2, 0, None])
def test_recipe_options_refuse_a_flag_that_is_not_a_bool_naming_it(
    key: str, value: object
) -> None:
    # 'False' (a string) and 2 are truthy: they would turn the option on.
    with pytest.raises(ValueError, match=f"^{key}={value!r} is not a bool"):
        _options(**{key: value})


@pytest.mark.parametrize("key", ["gradient_accumulation_steps", "log_every_n_steps"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_recipe_options_refuse_a_count_that_is_not_a_positive_integer(
    key: str, value: object
) -> None:
    with pytest.raises(ValueError, match=f"^{key}={value!r} is not a positive integer"):
        _options(**{key: value})


@pytest.mark.parametrize("value", [0, -1.0, "1.0", True])
def test_recipe_options_refuse_a_clip_grad_norm_that_is_not_positive(value) -> None:
    with pytest.raises(
        ValueError, match=f"^clip_grad_norm={value!r} is not a positive"
    ) as info:
        _options(clip_grad_norm=value)
    # the fix
    assert str(info.value).endswith(
        "set it to a number > 0, inf (measure the norm only) or null (no clipping)."
    )


def test_recipe_options_apply_the_in_backward_refusals_only_in_backward() -> None:
    _options(clip_grad_norm=1.0, gradient_accumulation_steps=4)
    _options(optimizer_in_bwd=True, clip_grad_norm=1.0)  # clipped inside backward
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
        _options(optimizer_in_bwd=True, gradient_accumulation_steps=4)


def test_recipe_options_warn_that_a_bucket_cap_without_in_backward_is_ignored(
    caplog,
) -> None:
    with caplog.at_level("WARNING"):
        _options(bucket_cap_mb=8)
    assert "optimizer_in_bwd_bucket_cap_mb=8 is ignored" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        _options(optimizer_in_bwd=True, bucket_cap_mb=8)
    assert "ignored" not in caplog.text


def test_recipe_options_refuse_offloading_without_activation_checkpointing() -> None:
    # On a CUDA device (the object only: nothing runs there), the second rule.
    with pytest.raises(RuntimeError, match="needs enable_activation_checkpointing"):
        training.RecipeOptions(
            device=torch.device("cuda"),
            dtype=torch.float32,
            enable_activation_offloading=True,
        )
    training.RecipeOptions(
        device=torch.device("cuda"),
        dtype=torch.float32,
        enable_activation_offloading=True,
        enable_activation_checkpointing=True,
    )


def test_recipe_options_from_config_take_0_6_1_defaults_for_missing_keys() -> None:
    options = training.RecipeOptions.from_config(_cfg())
    assert options == _options()
    assert options.compile == {"model": False, "loss": False, "optimizer_step": False}


def test_recipe_options_from_config_read_a_clip_grad_norm_string_as_its_number():
    # torchtune documents clip_grad_norm='inf': measure the norm, never clip.
    options = training.RecipeOptions.from_config(_cfg(clip_grad_norm="inf"))
    assert options.clip_grad_norm == float("inf")
    assert (
        training.RecipeOptions.from_config(_cfg(clip_grad_norm="0.5")).clip_grad_norm
        == 0.5
    )
    with pytest.raises(ValueError, match="^clip_grad_norm='big' is not a positive"):
        training.RecipeOptions.from_config(_cfg(clip_grad_norm="big"))
    with pytest.raises(ValueError, match="^clip_grad_norm=nan is not a positive"):
        training.RecipeOptions.from_config(_cfg(clip_grad_norm="nan"))


def test_recipe_options_from_config_turn_off_what_means_nothing_on_cpu(caplog) -> None:
    with caplog.at_level("INFO"):
        options = training.RecipeOptions.from_config(
            _cfg(fsdp_cpu_offload=True, log_peak_memory_stats=True), distributed=True
        )
    assert not options.fsdp_cpu_offload and not options.log_peak_memory_stats
    assert "fsdp_cpu_offload=True is ignored on CPU, which has nothing to move" in (
        caplog.text
    )
    assert "log_peak_memory_stats=True is ignored on CPU, which has no such" in (
        caplog.text
    )
    assert options.process_group_backend == "gloo"


def test_recipe_options_from_config_read_what_build_sharded_model_takes() -> None:
    options = training.RecipeOptions.from_config(
        _cfg(
            fsdp_reshard_after_forward=False,
            custom_sharded_layers=["tok_embeddings", "output"],
            ac_mode="selective",
            ac_option=2,
        ),
        distributed=True,
    )
    assert not options.fsdp_reshard_after_forward
    assert options.custom_sharded_layers == ["tok_embeddings", "output"]
    assert (options.ac_mode, options.ac_option) == ("selective", 2)
    assert options.custom_sharded_layers.__class__ is list


def test_recipe_options_from_config_refuse_an_inference_collate_function() -> None:
    cfg = _cfg(collate_fn="torchtune.data.left_pad_sequence")
    with pytest.raises(RuntimeError, match="is for inference only"):
        training.RecipeOptions.from_config(cfg)


@pytest.mark.parametrize(
    ("key", "closest"),
    [
        ("save_every_n_step", "save_every_n_steps"),
        ("optimizer_in_bwd_buket_cap_mb", "optimizer_in_bwd_bucket_cap_mb"),
        ("gradient_accumulation_step", "gradient_accumulation_steps"),
    ],
)
def test_a_near_miss_of_a_known_key_is_asked_about_with_that_key(key, closest, caplog):
    cfg = OmegaConf.create({"device": "cpu", "dtype": "fp32", key: 2})
    with caplog.at_level(logging.WARNING):
        training.RecipeOptions.from_config(cfg)
    assert (
        f"{key}=2: did you mean {closest}? No shipped recipe or config reads {key} "
        "(if your own recipe does, ignore this)." in caplog.text
    )


@pytest.mark.parametrize(
    "key",
    [
        "my_eval_every",  # a copied recipe's own key: nothing close
        "eval_every_n_steps",  # 4 edits from log_every_n_steps: not a typo of it
    ],
)
def test_a_key_far_from_every_known_key_is_not_named(key, caplog):
    # A recipe copied with tune cp may read keys of its own: claiming they have no
    # effect, or suggesting an unrelated key, would mislead.
    cfg = OmegaConf.create({"device": "cpu", "dtype": "fp32", key: 2})
    with caplog.at_level(logging.WARNING):
        training.RecipeOptions.from_config(cfg)
    assert key not in caplog.text


def test_shipped_test_and_demo_configs_name_no_unknown_key(caplog):
    import importlib.util
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    shipped = Path(importlib.util.find_spec("recipes").origin).parent / "configs"
    paths = [
        *shipped.rglob("*.yaml"),
        *(repo / "tests" / "recipes" / "configs").glob("*.yaml"),
        *(repo / "demo").glob("*.yaml"),
    ]
    assert len(paths) > 50
    with caplog.at_level(logging.WARNING):
        for path in paths:
            warn_unknown_keys(OmegaConf.load(path))
    assert "did you mean" not in caplog.text


def test_a_key_read_by_interpolation_is_known(caplog):
    cfg = OmegaConf.create({"my_root": "/data", "output_dir": "${my_root}/out"})
    with caplog.at_level(logging.WARNING):
        warn_unknown_keys(cfg)
    assert "did you mean" not in caplog.text


BOOL_OPTIONS = sorted(
    {f.name for f in dataclasses.fields(training.RecipeOptions) if f.type == "bool"}
    | set(BOOL_KEYS)
    | {"compile", "compile.model"}
)


@pytest.mark.parametrize("key", BOOL_OPTIONS)
@pytest.mark.parametrize("value", ["False", "True", 0, 1])
def test_every_flag_refuses_what_is_not_a_bool(key, value):
    # A quoted 'False' is a non-empty string, true to Python: taking it would turn
    # the flag on while the user asked for it off (resume_from_checkpoint='False'
    # would resume). It is refused, naming key, value and fix.
    cfg = _cfg()
    OmegaConf.update(cfg, key, value, force_add=True)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{key}={value!r} is not a bool: set {key}=True or {key}=False."
        ),
    ):
        training.RecipeOptions.from_config(cfg)


@pytest.mark.parametrize("key", COUNT_KEYS)
@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_every_count_refuses_what_is_not_a_positive_integer(key, value):
    # epochs=0 would train nothing and still export; a quoted '2' or a float would
    # fail deep in the data loader; True is an int to Python. Each is refused first,
    # naming key, value and fix.
    cfg = _cfg()
    OmegaConf.update(cfg, key, value, force_add=True)
    null = " or null (no limit)" if key == "max_steps_per_epoch" else ""
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{key}={value!r} is not a positive integer: set {key} to a whole number "
            f">= 1{null}."
        ),
    ):
        training.RecipeOptions.from_config(cfg)


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        ({"lr": "abc"}, "optimizer.lr='abc' is not a number: set it to one, e.g. "),
        ({"weight_decay": "0.1x"}, "optimizer.weight_decay='0.1x' is not a number"),
        ({"betas": [0.9]}, "optimizer.betas=[0.9] is not 2 numbers: set it like "),
        ({"betas": "0.9,0.99"}, "optimizer.betas='0.9,0.99' is not 2 numbers"),
        ({"lrr": 0.1}, "optimizer.lrr=0.1: AdamW takes no argument lrr (it takes lr,"),
    ],
)
def test_a_bad_optimizer_argument_is_refused_before_anything_is_built(
    optimizer, message
):
    cfg = _cfg(optimizer={"_component_": "torch.optim.AdamW", **optimizer})
    with pytest.raises(ValueError, match=re.escape(message)):
        training.RecipeOptions.from_config(cfg)


def test_an_optimizer_that_does_not_import_is_named_with_the_fix():
    cfg = _cfg(optimizer={"_component_": "bitsandbyte.optim.PagedAdamW8bit"})
    with pytest.raises(
        ValueError,
        match=r"^optimizer._component_=bitsandbyte.optim.PagedAdamW8bit cannot be "
        r"imported \(.*\): check the name",
    ):
        training.RecipeOptions.from_config(cfg)


@pytest.mark.parametrize("seed", ["abc", 1.5, True])
def test_a_seed_that_is_not_a_whole_number_is_refused(seed):
    with pytest.raises(ValueError, match=re.escape(f"seed={seed!r} is not a whole")):
        training.RecipeOptions.from_config(_cfg(seed=seed))


def test_every_shipped_configs_optimizer_arguments_are_accepted():
    from pathlib import Path

    from torchtune.training.recipe_options import _check_optimizer_arguments

    configs = Path(importlib.util.find_spec("recipes").origin).parent / "configs"
    checked = 0
    for path in sorted(configs.rglob("*.yaml")):
        optimizer = OmegaConf.load(path).get("optimizer")
        if optimizer and "_component_" in optimizer:
            _check_optimizer_arguments(optimizer)
            checked += 1
    assert checked > 50
