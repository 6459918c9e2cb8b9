"""Fixtures every recipe test module gets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


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
