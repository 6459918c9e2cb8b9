"""Sphinx configuration for the optimizer-in-backward patch set's documentation.

Build (warnings are errors) and run the docstring examples as doctests::

    python -m sphinx -W -b html docs/source docs/build/html
    python -m sphinx -W -b doctest docs/source docs/build/doctest
"""

import importlib.metadata

project = "torchtune optimizer-in-backward"
author = "the optimizer-in-backward patch set's authors"
release = importlib.metadata.version("torchtune")
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
]

# Google-style docstrings, as in torchtune and torch.optim.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
# Type hints name upstream and torch classes this site does not document.
nitpicky = False
suppress_warnings = ["ref.python"]

# Every `>>>` example in the pages and in the documented docstrings runs as a doctest.
# The examples share a tiny Llama2 ``model``, a ``dataloader`` of two batches, a
# ``loss_fn`` and a no-op ``log``, and run in a scratch directory.
doctest_global_setup = """
import os
import tempfile
import warnings

import torch
import torch.nn.functional as F
from torchtune import training
from torchtune.models.llama2 import llama2
from torchtune.training import *
from torchtune.training import CheckpointManager, CheckpointOptions, TrainingProgress
from torchtune.training.optim_in_bwd_legacy_state_dict import (
    convert_legacy_optim_in_bwd_state_dict,
)

os.chdir(tempfile.mkdtemp())
warnings.simplefilter("ignore", DeprecationWarning)
torch.manual_seed(0)
model = llama2(
    vocab_size=32, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16, max_seq_len=8
)
dataloader = [
    {"tokens": torch.randint(0, 32, (2, 8)), "labels": torch.randint(0, 32, (2, 8))}
    for _ in range(2)
]


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def log(metrics):
    pass
"""

html_theme = "alabaster"
exclude_patterns = []
