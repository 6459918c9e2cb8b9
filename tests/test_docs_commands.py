"""Every ``tune run`` command the README and the docs show resolves as written: the
recipe exists, the config resolves (a shipped config name or a file of this repo),
the overrides apply, and the recipe's shared option checks
(``training.RecipeOptions.from_config``) accept the result. A command whose config
a later release changes (say, a shipped ``gradient_accumulation_steps: 8`` under an
``optimizer_in_bwd=True`` example) fails here instead of in a user's terminal.

The device is the one thing swapped (``device=cpu``): this machine has no GPU, and
options that need one are turned off with a message, never refused, on CPU. Commands
with a placeholder config (``<your config>``, ``...``) are skipped.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from torchtune import training
from torchtune._recipe_registry import get_all_recipes
from torchtune.config._parse import TuneRecipeArgumentParser
from torchtune.config._utils import _merge_yaml_and_cli_args

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs" / "source").rglob("*.rst"))]
DISTRIBUTED = {
    "full_finetune_distributed",
    "lora_finetune_distributed",
    "full_dpo_distributed",
    "qat_distributed",
    "dev/early_exit_finetune_distributed",
}


def _commands() -> list[tuple[str, str]]:
    """(where, command) for each ``tune run`` line, continuation lines joined."""
    found = []
    for path in DOCS:
        text = path.read_text().replace("\\\n", " ")
        for number, line in enumerate(text.splitlines(), start=1):
            match = re.search(r"(?:^|[\s`#=])(tune run .*)$", line)
            if match is None or "--config" not in match.group(1):
                continue
            command = match.group(1).split("`")[0].strip()
            found.append((f"{path.relative_to(REPO)}:{number}", command))
    return found


COMMANDS = _commands()


def _config_path(name: str) -> Path:
    if name.endswith(".yaml"):
        return REPO / name
    configs = Path(importlib.util.find_spec("recipes").origin).parent / "configs"
    for recipe in get_all_recipes():
        for config in recipe.configs:
            if config.name == name:
                return configs / config.file_path
    raise AssertionError(f"--config {name} is not a shipped config")


def test_the_docs_show_the_commands_this_test_checks() -> None:
    # The test can fail: it finds the in-backward commands of the README.
    assert len(COMMANDS) >= 10, COMMANDS
    assert any("optimizer_in_bwd=True" in command for _, command in COMMANDS)


@pytest.mark.parametrize(
    "where,command", COMMANDS, ids=[where for where, _ in COMMANDS]
)
def test_a_shown_command_resolves_and_passes_the_option_checks(
    where: str, command: str, caplog: pytest.LogCaptureFixture
) -> None:
    args = shlex.split(command)[2:]  # after "tune run"
    while args[0].startswith("--nproc"):
        args = args[2:]
    recipe, args = args[0], args[1:]
    assert args[0] == "--config", command
    config_name, overrides = args[1], args[2:]
    if "<" in config_name or config_name == "...":
        pytest.skip("placeholder config")
    assert recipe in {r.name for r in get_all_recipes()}, recipe
    path = _config_path(config_name)
    assert path.is_file(), path
    parser = TuneRecipeArgumentParser(description="", add_help=False)
    yaml_args, cli_args = parser.parse_known_args(
        ["--config", str(path), *overrides, "device=cpu"]
    )
    cfg = _merge_yaml_and_cli_args(yaml_args, cli_args)
    assert OmegaConf.is_config(cfg)
    with caplog.at_level(logging.WARNING):
        training.RecipeOptions.from_config(cfg, distributed=recipe in DISTRIBUTED)
    # No key of the command is a near miss of a known key (a typo).
    assert "did you mean" not in caplog.text, caplog.text
