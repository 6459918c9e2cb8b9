"""The published figures of ``benchmarks/published_memory.py`` are estimated as
listed: each cites a source the script names, and the overrides of each apply to
its shipped config, every key one the config has. A key a later config renames
would otherwise be added silently and the figure estimated with the config's own
value.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from torchtune.config._parse import TuneRecipeArgumentParser
from torchtune.config._utils import _merge_yaml_and_cli_args
from torchtune.training.memory_estimate import RECIPES, _config_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import published_memory  # noqa: E402

ESTIMATED = [f for f in published_memory.FIGURES if not f.not_reproduced]
_ABSENT = object()


def test_every_figure_cites_a_source_and_is_estimated_or_says_why_not() -> None:
    assert len(ESTIMATED) >= 10
    for fig in published_memory.FIGURES:
        assert fig.source in published_memory.SOURCES, fig
        assert fig.unit in ("GiB", "GB") and fig.mode in ("plain", "in-backward")
        assert bool(fig.config) != bool(fig.not_reproduced), fig


@pytest.mark.parametrize("fig", ESTIMATED, ids=[f.run_key for f in ESTIMATED])
def test_the_overrides_apply_to_keys_of_the_shipped_config(fig) -> None:
    path, recipe = _config_path(fig.config)
    assert recipe in RECIPES and (fig.nproc == 1 or RECIPES[recipe]), fig
    shipped = OmegaConf.load(path)
    for override in fig.overrides:
        key = override.split("=", 1)[0]
        assert OmegaConf.select(shipped, key, default=_ABSENT) is not _ABSENT, key
    parser = TuneRecipeArgumentParser(description="", add_help=False)
    yaml_args, cli_args = parser.parse_known_args(
        ["--config", str(path), *fig.overrides]
    )
    cfg = _merge_yaml_and_cli_args(yaml_args, cli_args)
    assert cfg.batch_size == int(
        dict(o.split("=", 1) for o in fig.overrides)["batch_size"]
    )
