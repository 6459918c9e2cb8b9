"""The ``tune`` CLI of the patched distribution: every upstream recipe and config still
resolves, and the recipes rewritten here are served from this tree."""

import subprocess
import sys
from pathlib import Path

import pytest

import torchtune
from torchtune._cli.run import Run
from torchtune._cli.tune import TuneCLIParser
from torchtune._recipe_registry import get_all_recipes

REPO = Path(__file__).resolve().parents[1]
INSTALLED_ROOT = Path(torchtune.__file__).parent.parent


def _resolve(monkeypatch, recipe: str, config: str) -> tuple[str, str]:
    """Runs ``tune run RECIPE --config CONFIG`` up to the point where it would start the
    recipe, and returns the recipe and config paths it resolved."""
    seen = {}

    def record(self, args, is_builtin):
        seen["recipe"] = args.recipe
        seen["config"] = args.recipe_args[args.recipe_args.index("--config") + 1]

    monkeypatch.setattr(Run, "_run_single_device", record)
    monkeypatch.setattr(Run, "_run_distributed", record)
    argv = ["tune", "run", recipe, "--config", config]
    monkeypatch.setattr(sys, "argv", argv)
    parser = TuneCLIParser()
    parser.run(parser.parse_args())  # reads sys.argv, as `tune` does
    return seen["recipe"], seen["config"]


def test_tune_ls_lists_every_upstream_recipe_and_config():
    out = subprocess.run(
        [str(Path(sys.executable).parent / "tune"), "ls"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    listed = out.split()
    for recipe in get_all_recipes():
        assert recipe.name in listed, recipe.name
        for config in recipe.configs:
            assert config.name in listed, (recipe.name, config.name)


def test_tune_run_resolves_every_upstream_recipe_and_config(monkeypatch):
    recipes = get_all_recipes()
    assert len(recipes) > 10
    missing = set()
    for recipe in recipes:
        for config in recipe.configs or []:
            recipe_path, config_path = _resolve(monkeypatch, recipe.name, config.name)
            assert Path(recipe_path).is_file(), recipe_path
            if not Path(config_path).is_file():
                missing.add(config.name)
    # The 0.6.1 wheel itself registers this config but does not ship its file; nothing
    # else may be missing.
    assert missing == {"llama2/7B_full_early_exit"}


@pytest.mark.parametrize(
    "recipe",
    [
        "full_finetune_single_device",
        "full_finetune_distributed",
        "lora_finetune_single_device",
    ],
)
def test_tune_run_serves_the_rewritten_recipe_from_this_tree(monkeypatch, recipe):
    ours = REPO / "recipes" / f"{recipe}.py"
    if not ours.exists():
        pytest.skip(f"recipes/{recipe}.py is not rewritten in this tree yet")
    config = next(r for r in get_all_recipes() if r.name == recipe).configs[0].name
    recipe_path, _ = _resolve(monkeypatch, recipe, config)
    assert Path(recipe_path).read_bytes() == ours.read_bytes()
