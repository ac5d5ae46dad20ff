"""Sphinx configuration of the triaccel_jax documentation (built in CI with warnings as errors).

Build it with ``bash tools/docs.sh``: it installs the pinned tools into ``.venv`` and runs
``sphinx-build -W --keep-going -E -b html docs docs/_build/html``.
"""

from __future__ import annotations

import importlib
import os
import re
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
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "jupyter_execute", "Thumbs.db", ".DS_Store", "notebooks/README.md"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# Docstrings are Google style (Args/Returns/Raises/Example), as in optax.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# NamedTuple fields and properties are documented by autodoc itself; an "Attributes:" section
# becomes a field list instead of a second description of the same attribute.
napoleon_use_ivar = True
# An ":ivar name:" field makes ``name`` a cross-reference; two NamedTuples with a field of the same
# name (``FusedApply.opt_state``, ``Replan.opt_state``) make it ambiguous. Sphinx then links the
# first match, which is harmless, so that one warning category is not an error.
suppress_warnings = ["ref.python"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
autosummary_generate = False

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# The notebooks carry no outputs in the repository; the build executes them and the pages with
# code cells on the CPU (about three minutes on two cores). TRIACCEL_DOCS_EXECUTE picks myst-nb's
# mode: "cache" (tools/docs.sh's default: re-run a page only when its code changed), "force" (CI),
# or "off" (a quick check of the text and the API reference).
nb_execution_mode = os.environ.get("TRIACCEL_DOCS_EXECUTE", "cache")
nb_execution_cache_path = os.path.join(os.path.dirname(__file__), "_build", ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True

html_theme = "sphinx_book_theme"
html_title = "triaccel_jax"
html_theme_options = {"show_toc_level": 2}


# --- API summaries --------------------------------------------------------------------------------
# A line `<!-- api-summary: MODULE -->` in a page becomes an autosummary table of every name in
# MODULE.__all__, so the reference lists a name the day it is exported. For `triaccel_jax` itself
# each re-exported name links to the subpackage that documents it.

_SUMMARY = re.compile(r"^<!-- api-summary: ([\w.]+) -->$", re.M)
_HOMES = (
    "triaccel_jax.transforms",
    "triaccel_jax.precision",
    "triaccel_jax.controller",
    "triaccel_jax.flax",
    "triaccel_jax.checkpoint",
)


def _summary(match: re.Match) -> str:
    name = match.group(1)
    module = importlib.import_module(name)
    entries = []
    for member in module.__all__:
        if name == "triaccel_jax":
            home = next(h for h in _HOMES if member in importlib.import_module(h).__all__)
            entries.append(f"   ~{home}.{member}")
        else:
            entries.append(f"   ~{name}.{member}")
    lines = ["```{eval-rst}", ".. autosummary::", "   :nosignatures:", "", *entries, "```"]
    return "\n".join(lines)


def _expand_summaries(app, docname, source):
    source[0] = _SUMMARY.sub(_summary, source[0])


# Napoleon reads the first line of a "Returns:" section as "type: description". A ``literal``
# that opens on that line and closes on the next one (a dict written out over two lines) would be
# split at its first colon; joining such a line with the next keeps the literal whole (one
# paragraph either way).
def _join_split_literals(app, what, name, obj, options, lines):
    i = 0
    while i < len(lines) - 2:
        if lines[i].strip() in ("Returns:", "Yields:"):
            first = i + 1
            while (
                first + 1 < len(lines)
                and lines[first].count("``") % 2
                and lines[first + 1].count("``") % 2
            ):
                lines[first] = lines[first].rstrip() + " " + lines.pop(first + 1).strip()
        i += 1


def setup(app):
    app.connect("source-read", _expand_summaries)
    app.connect("autodoc-process-docstring", _join_split_literals, priority=400)
