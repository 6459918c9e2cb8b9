"""``training.parse_compile_config``: the ``compile`` option every recipe reads."""

import pytest
from omegaconf import OmegaConf

from torchtune import training


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
