"""Sphinx configuration of the triaccel_jax documentation (built in CI with warnings as errors)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import triaccel_jax

project = "triaccel_jax"
author = "The triaccel_jax authors"
copyright = "2026, The triaccel_jax authors"
release = triaccel_jax.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "notebooks/README.md"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# Docstrings are Google style (Args/Returns/Example), as in optax.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}

myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# The notebooks carry no outputs in the repository; the build executes them (on CPU, a minute or
# so each) so that the pages show their plots and tables.
nb_execution_mode = "auto"
nb_execution_timeout = 600
nb_execution_raise_on_error = True

html_theme = "sphinx_book_theme"
html_title = "triaccel_jax"
html_theme_options = {"show_toc_level": 2}
