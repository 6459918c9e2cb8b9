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
doctest_global_setup = """
import torch
from torchtune import training
"""

html_theme = "alabaster"
exclude_patterns = []
