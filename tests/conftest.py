"""Shared pytest setup: the ``integration_test`` marker and the tiny test assets.

Every test runs by default; ``-m "not integration_test"`` skips the recipe runs.

Under pytest-xdist with ``--dist loadgroup`` (as ``scripts/test.sh`` runs the suite),
each test module is one unit of work, so its module-scoped runs are made once; the
modules whose tests share a session-scoped multi-process run are one unit together,
so that run is made once too. The units that train (recipe runs, the shared
multi-process run) are handed out first and the quick unit tests fill in after them,
so that no worker is left with a long unit at the end.

The asset fixtures are session-scoped. The first one used generates
``tests/assets/generated/`` (about 10 s, most of it importing torchtune) unless it is
already up to date; ``tests/assets/make_assets.py`` locks the folder, so concurrent
sessions wait for one generator.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.assets.make_assets import DEFAULT_OUT, TinyAssets, ensure_assets

# torch 2.13's on-disk AOT-autograd cache hands a graph compiled for one torchao
# optimizer (AdamW8bit) to another (AdamW4bit, _AdamW) in a later process, which then
# fails ("'Tensor' object has no attribute 'codes'"). The tests compile torchao's
# steps in several processes (this one and the recipes' subprocesses, which inherit
# the environment), so they keep that cache off.
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers used in this test suite."""
    config.addinivalue_line(
        "markers",
        "integration_test: runs a recipe end to end in a subprocess (tune run)",
    )


# Session-scoped fixtures that start processes and are shared by several modules.
_SHARED_SESSION_RUNS = ("optimizer_in_backward_distributed_run",)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    """Under ``--dist loadgroup``: group the tests into units of work and order the
    units (module docstring). Before pytest-xdist's own hook, which reads the
    groups."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    shared = {
        item.path: name
        for item in items
        for name in _SHARED_SESSION_RUNS
        if name in getattr(item, "fixturenames", ())
    }
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        group = shared.get(item.path) or item.path.relative_to(config.rootpath)
        groups.setdefault(str(group), []).append(item)

    def trains(group: list[pytest.Item]) -> bool:
        return any(
            item.path in shared or item.get_closest_marker("integration_test")
            for item in group
        )

    ordered = sorted(groups.items(), key=lambda g: not trains(g[1]))  # stable
    items[:] = []
    for name, group in ordered:
        for item in group:
            item.add_marker(pytest.mark.xdist_group(name))
        items.extend(group)


@pytest.fixture(scope="session")
def tiny_assets() -> TinyAssets:
    """All tiny assets: tokenizer, instruct data, HF checkpoint, model sizes."""
    return ensure_assets(DEFAULT_OUT)


@pytest.fixture(scope="session")
def tiny_assets_dir(tiny_assets: TinyAssets) -> Path:
    """The folder that holds the assets; the tiny configs' ``assets_dir``."""
    return tiny_assets.root


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tiny_assets: TinyAssets) -> Path:
    """The sentencepiece ``tokenizer.model`` for ``llama2_tokenizer``."""
    return tiny_assets.tokenizer_path


@pytest.fixture(scope="session")
def tiny_train_data(tiny_assets: TinyAssets) -> Path:
    """The training split: a JSON list of ``input``/``output`` records."""
    return tiny_assets.train_data


@pytest.fixture(scope="session")
def tiny_test_data(tiny_assets: TinyAssets) -> Path:
    """The held-out split, disjoint from the training split."""
    return tiny_assets.test_data


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tiny_assets: TinyAssets) -> Path:
    """The Hugging Face checkpoint folder (``config.json`` + ``model.safetensors``)."""
    return tiny_assets.checkpoint_dir
