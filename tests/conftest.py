"""Shared pytest setup: the tiny test assets.

Every test runs by default; ``-m "not integration_test"`` (the marker is registered
in ``pyproject.toml``) skips the recipe runs.

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
