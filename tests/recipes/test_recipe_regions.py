"""Recipes that do the same thing do it with the same lines, so that they cannot
drift apart again: the methods below are compared, as source text, across the
recipes that share them. What differs between recipes stays visible in each: a
method that must differ is not listed here, and a line only some recipes add to a
shared method is named in the list, with the recipes that add it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SINGLE_DEVICE_SFT = ["full_finetune_single_device", "lora_finetune_single_device"]
DISTRIBUTED_SFT = [
    "full_finetune_distributed",
    "lora_finetune_distributed",
    "qat_distributed",
]
DISTRIBUTED = [
    *DISTRIBUTED_SFT,
    "dev/early_exit_finetune_distributed",
    "full_dpo_distributed",
]
LORA = ["lora_finetune_single_device", "lora_finetune_distributed"]
FULL_DISTRIBUTED = ["full_finetune_distributed", "dev/early_exit_finetune_distributed"]
# QAT turns fake quantization on at its configured step, before each batch.
QAT_ONLY = {"qat_distributed": ["self._update_fake_quant()"]}
SHARED = [
    # (method, the recipes whose copies must be the same, lines only some add)
    ("cleanup", SINGLE_DEVICE_SFT, {}),
    ("cleanup", DISTRIBUTED, {}),
    ("train", SINGLE_DEVICE_SFT, {}),
    ("train", DISTRIBUTED_SFT, QAT_ONLY),
    ("_loss_step", [*SINGLE_DEVICE_SFT, *DISTRIBUTED_SFT], {}),
    ("_setup_data", SINGLE_DEVICE_SFT, {}),
    ("_setup_data", FULL_DISTRIBUTED, {}),
    ("_setup_optimizer", LORA, {}),
    ("_setup_optimizer", FULL_DISTRIBUTED, {}),
    ("_adapter_config", LORA, {}),
]


def method_lines(recipe: str, name: str) -> list[str]:
    source = (RECIPES / f"{recipe}.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node).splitlines()
    raise AssertionError(f"recipes/{recipe}.py has no method {name}")


@pytest.mark.parametrize(
    ("name", "recipes", "own_lines"), SHARED, ids=[f"{m}-{r[0]}" for m, r, _ in SHARED]
)
def test_recipes_that_do_the_same_thing_use_the_same_lines(
    name: str, recipes: list[str], own_lines: dict[str, list[str]]
) -> None:
    first, *others = recipes
    expected = method_lines(first, name)
    for recipe in others:
        own = own_lines.get(recipe, [])
        lines = method_lines(recipe, name)
        added = [line.strip() for line in lines if line.strip() in own]
        assert added == own, f"recipes/{recipe}.py's {name} lacks {own}"
        assert [line for line in lines if line.strip() not in own] == expected, (
            f"{name} of recipes/{recipe}.py differs from recipes/{first}.py's: make "
            "them the same, or take the method out of this test if they must differ"
        )


def test_every_recipe_releases_output_dir_when_it_ends() -> None:
    for path in [*RECIPES.glob("*.py"), *RECIPES.glob("dev/*.py")]:
        recipe = str(path.relative_to(RECIPES).with_suffix(""))
        if recipe == "__init__":
            continue
        lines = [line.strip() for line in method_lines(recipe, "cleanup")]
        assert "self._checkpoint.close()" in lines, recipe
