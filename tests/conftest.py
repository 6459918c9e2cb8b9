"""Shared pytest setup: the tiny test assets.

Every test runs by default; ``-m "not integration_test"`` (the marker is registered
in ``pyproject.toml``) skips the recipe runs.

The ``tiny_assets`` fixture is session-scoped. Its first use generates
``tests/assets/generated/`` (about 10 s, most of it importing torchtune) unless it is
already up to date; ``tests/assets/make_assets.py`` locks the folder, so concurrent
sessions wait for one generator.
"""

from __future__ import annotations

import os

import pytest

from tests.assets.make_assets import DEFAULT_OUT, TinyAssets, ensure_assets

# torch 2.13's on-disk AOT-autograd cache hands a graph compiled for one torchao
# optimizer (AdamW8bit) to another (AdamW4bit, _AdamW) in a later process, which then
# fails ("'Tensor' object has no attribute 'codes'"). The tests compile torchao's
# steps in several processes (this one and the recipes' subprocesses, which inherit
# the environment), so they keep that cache off.
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")


@pytest.fixture(scope="session")
def tiny_assets() -> TinyAssets:
    """All tiny assets: tokenizer, instruct data, HF checkpoint, model sizes."""
    return ensure_assets(DEFAULT_OUT)
