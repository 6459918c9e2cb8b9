"""Fixtures of the recipe tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.assets.make_assets import TinyAssets
from tests.recipes.single_device import Recipe, Runs


@pytest.fixture(scope="module", autouse=True)
def _offline_hf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What ``run_tune`` gives its subprocesses, for the runs made in this process
    (``run_tune_in_process``): never reach the Hugging Face hub, and keep the datasets
    cache out of ``$HOME``.

    Hugging Face libraries read these when first imported, which for this process is
    normally the first in-process run of the module.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
        yield


@pytest.fixture(scope="session")
def single_device_runs(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Recipe], Runs]:
    """A single-device recipe's shared runs (``tests/recipes/single_device.py``), one
    set per recipe for the session: the modules that use them make each run once."""
    made: dict[str, Runs] = {}

    def runs(recipe: Recipe) -> Runs:
        if recipe.name not in made:
            made[recipe.name] = Runs(recipe, tiny_assets, tmp_path_factory)
        return made[recipe.name]

    return runs
