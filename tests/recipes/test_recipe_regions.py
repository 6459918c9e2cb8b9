"""Recipes that do the same thing do it with the same lines, so that they cannot
drift apart again: the methods below are compared, as source text, across the
recipes that share them. What differs between recipes stays visible in each (a
method that must differ is simply not listed here)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SINGLE_DEVICE_SFT = ["full_finetune_single_device", "lora_finetune_single_device"]
DISTRIBUTED = [
    "full_finetune_distributed",
    "lora_finetune_distributed",
    "qat_distributed",
    "dev/early_exit_finetune_distributed",
    "full_dpo_distributed",
]
SHARED = [
    # (method, the recipes whose copies must be the same)
    ("cleanup", SINGLE_DEVICE_SFT),
    ("cleanup", DISTRIBUTED),
    ("_loss_step", [*SINGLE_DEVICE_SFT, "lora_finetune_distributed"]),
    ("_adapter_config", ["lora_finetune_single_device", "lora_finetune_distributed"]),
]


def method_source(recipe: str, name: str) -> str:
    source = (RECIPES / f"{recipe}.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise AssertionError(f"recipes/{recipe}.py has no method {name}")


@pytest.mark.parametrize(("name", "recipes"), SHARED, ids=lambda v: str(v))
def test_recipes_that_do_the_same_thing_use_the_same_lines(
    name: str, recipes: list[str]
) -> None:
    first, *others = recipes
    expected = method_source(first, name)
    for recipe in others:
        assert method_source(recipe, name) == expected, (
            f"{name} of recipes/{recipe}.py differs from recipes/{first}.py's: make "
            "them the same, or take the method out of this test if they must differ"
        )


def test_every_recipe_releases_output_dir_when_it_ends() -> None:
    for path in [*RECIPES.glob("*.py"), *RECIPES.glob("dev/*.py")]:
        recipe = str(path.relative_to(RECIPES).with_suffix(""))
        if recipe == "__init__":
            continue
        assert "self._checkpoint.close()" in method_source(recipe, "cleanup"), recipe
