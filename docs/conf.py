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

from sphinx.util import logging as sphinx_logging

import triaccel_jax
from triaccel_jax._src import packages

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
    # MathJax 3.2.2 copied into _static/mathjax: the formulas render without a network (Sphinx's
    # default loads MathJax from a CDN).
    "sphinx-mathjax-offline",
    "sphinx.ext.viewcode",
    "sphinx_design",
]
mathjax_path = "mathjax/tex-chtml.js"

# docs/reference/ is the reference as plain Markdown for readers without a build
# (tools/api_reference.py); the site has the built one (api/).
exclude_patterns = [
    "_build",
    "jupyter_execute",
    "Thumbs.db",
    ".DS_Store",
    "notebooks/README.md",
    "reference",
]
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
# The code annotates with private module aliases (`policy_lib.PrecisionPolicy`). Where autodoc
# cannot evaluate an annotation (a class's __init__, a Flax dataclass whose optax field names an
# unexported alias) it prints that text, so each alias is rewritten to the public name, in
# signatures, in the types of the description's fields and in napoleon's attribute types.
autodoc_type_aliases = {
    "policy_lib.PrecisionPolicy": "triaccel_jax.policy.PrecisionPolicy",
    "policy_lib.PrecisionPlan": "triaccel_jax.policy.PrecisionPlan",
    "policy_lib.LeafPrecision": "triaccel_jax.policy.LeafPrecision",
    "memory_probe.MemoryProbe": "triaccel_jax.controller.MemoryProbe",
    "loss_scaling_lib.LossScaling": "triaccel_jax.transforms.LossScaling",
    "config_lib.ControllerConfig": "triaccel_jax.controller.ControllerConfig",
    "config_lib.TriAccelConfig": "triaccel_jax.transforms.TriAccelConfig",
}
_ALIAS = re.compile(r"\b(?:{})\b".format("|".join(map(re.escape, autodoc_type_aliases))))
# A type that links shows its name only (`PrecisionPolicy`); the link says where it lives.
python_use_unqualified_type_names = True
autodoc_default_options = {"members": True, "show-inheritance": False}
autosummary_generate = False

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# The notebooks carry no outputs in the repository; the build executes them and the pages with
# code cells on the CPU (about three minutes on two cores). TRIACCEL_DOCS_EXECUTE picks myst-nb's
# mode: "cache" (tools/docs.sh's default: re-run a page only when its code changed), "force" (CI),
# or "off" (a quick check of the text and the API reference). In CI the notebooks are not executed
# here but by the tests, whose outputs are rendered (TRIACCEL_EXECUTED_NOTEBOOKS, below).
nb_execution_mode = os.environ.get("TRIACCEL_DOCS_EXECUTE", "cache")
nb_execution_cache_path = os.path.join(os.path.dirname(__file__), "_build", ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True

html_theme = "sphinx_book_theme"
html_title = "triaccel_jax"
html_theme_options = {"show_toc_level": 2}
html_static_path = ["_static"]
html_css_files = ["triaccel.css"]


# --- The API reference, by task -------------------------------------------------------------------
# The reference is grouped by what a user does (docs/api/*.md: optimizers and observers, precision,
# the controller, Flax, checkpoints, data, models, kernels), not by the package a name lives in.
# Each page places names with markers, which the build expands into autodoc entries, so that every
# public name is documented exactly once, under its package (`triaccel_jax.transforms.triaccel`):
#
#   <!-- api: triaccel_jax.transforms: curvature_signals signals LeafSignals -->
#       one autodoc entry per name, in the order given;
#   <!-- api-rest: triaccel_jax.transforms -->
#       every name of the package's __all__ that no marker (and no hand-written `.. py:data::`
#       with `:module:`, for constants autodoc cannot describe) places: a name exported tomorrow
#       is documented the day it is exported, at the end of its package's page, until a marker
#       places it where a reader looks for it; each package has exactly one such marker;
#   <!-- api-contents -->
#       a summary table (name and first line) of every entry on the page, in page order;
#   <!-- api-summary: MODULE: name name -->, <!-- api-summary: MODULE -->
#       a summary table of the names given, or of all of MODULE.__all__ (links, not entries).
#
# A name placed twice, a name that is not public, or a package without a home is a warning (an
# error in the build); tests/package/test_docs.py checks the same on the sources.

_DOCS = os.path.dirname(os.path.abspath(__file__))
_API_PAGES = (
    "api",
    *(f"api/{n[:-3]}" for n in sorted(os.listdir(os.path.join(_DOCS, "api"))) if n.endswith(".md")),
)
_MARKER = re.compile(r"<!-- (api-contents|api-summary|api-rest|api)(?::\s*(.*?))?\s*-->", re.S)
_MANUAL = re.compile(r"^\s*\.\. py:data:: (\w+)\n\s+:module: ([\w.]+)", re.M)
# The packages the reference documents with markers (no two export the same name); the kernels
# page documents triaccel_jax.kernels with automodule.
_HOMES = tuple(f"triaccel_jax.{name}" for name in packages.DOCUMENTED)


def _public(module: str) -> list[str]:
    return list(importlib.import_module(module).__all__)


def _read_layout():
    """Per page, its entries [(module, name, how)], and the problems found in the markers."""
    pages: dict[str, list[tuple[str, str, str]]] = {}
    problems: list[str] = []
    placed: dict[tuple[str, str], str] = {}
    rests: dict[str, str] = {}
    texts = {}
    for page in _API_PAGES:
        with open(os.path.join(_DOCS, page + ".md")) as f:
            texts[page] = f.read()
    for page, text in texts.items():
        entries = pages.setdefault(page, [])
        for match in _MANUAL.finditer(text):
            entries.append((match.group(2), match.group(1), "manual"))
        for match in _MARKER.finditer(text):
            kind, arg = match.group(1), match.group(2) or ""
            if kind == "api":
                module, _, names = arg.partition(":")
                entries.extend((module.strip(), n, "auto") for n in names.split())
            elif kind == "api-rest":
                if arg in rests:
                    problems.append(f"{arg} has two api-rest markers ({rests[arg]}, {page})")
                rests[arg] = page
        for module, name, _ in entries:
            if (module, name) in placed:
                problems.append(f"{module}.{name} is placed twice ({placed[module, name]}, {page})")
            placed[module, name] = page
            if module not in _HOMES or name not in _public(module):
                problems.append(f"{page}: {module}.{name} is not a public name documented there")
    for module in _HOMES:
        if module not in rests:
            problems.append(f"{module} has no page (no <!-- api-rest: {module} --> marker)")
    rest = {module: [n for n in _public(module) if (module, n) not in placed] for module in _HOMES}
    return pages, rest, rests, problems


_PAGES, _REST, _HOME_PAGE, _LAYOUT_PROBLEMS = _read_layout()


def _entry(module: str, name: str) -> str:
    obj = getattr(importlib.import_module(module), name)
    options = ""
    if isinstance(obj, type):
        kind = "exception" if issubclass(obj, BaseException) else "class"
        # A class's members from one of the library's private bases are its own to a reader
        # (the two signals states share theirs); those of tuple and object are not.
        if any(
            base.__name__.startswith("_") and base.__module__.startswith("triaccel_jax")
            for base in obj.__mro__[1:]
        ):
            options = "\n   :inherited-members: tuple, object"
    elif callable(obj):
        kind = "function"
    else:
        kind = "data"
    return f".. auto{kind}:: {module}.{name}{options}"


def _entries(pairs, declare=()) -> str:
    """Autodoc entries; the first entry of a module in ``declare`` declares the module there."""
    lines = ["```{eval-rst}"]
    current = None
    declare = set(declare)
    pairs = list(pairs)
    if not pairs:
        return ""
    for module, name in pairs:
        if module != current:
            directive = "module" if module in declare else "currentmodule"
            lines += [f".. py:{directive}:: {module}", ""]
            declare.discard(module)
            current = module
        lines += [_entry(module, name), ""]
    return "\n".join([*lines, "```"])


def _table(pairs) -> str:
    if not pairs:
        return ""
    rows = [f"   ~{module}.{name}" for module, name in pairs]
    return "\n".join(["```{eval-rst}", ".. autosummary::", "   :nosignatures:", "", *rows, "```"])


def _expand_markers(app, docname, source):
    if docname not in _PAGES:
        return
    constants = [(m, n) for m, n, how in _PAGES[docname] if how == "manual"]
    # Each package is declared (`.. py:module::`, the target of a link to the package) at its
    # first entry on the page that holds its api-rest marker.
    undeclared = {m for m, page in _HOME_PAGE.items() if page == docname}

    def entries(pairs):
        pairs = list(pairs)
        text = _entries(pairs, undeclared)
        undeclared.difference_update(m for m, _ in pairs)
        return text

    def expand(match: re.Match) -> str:
        kind, arg = match.group(1), (match.group(2) or "").strip()
        if kind == "api":
            module, _, names = arg.partition(":")
            return entries((module.strip(), n) for n in names.split())
        if kind == "api-rest":
            if arg in undeclared:  # no entry of its own here: declared without one
                undeclared.discard(arg)
                return "\n".join(
                    (
                        "```{eval-rst}",
                        f".. py:module:: {arg}",
                        "```",
                        _entries((arg, n) for n in _REST[arg]),
                    )
                )
            return entries((arg, n) for n in _REST[arg])
        if kind == "api-summary":
            module, _, names = arg.partition(":")
            module = module.strip()
            names = names.split() or importlib.import_module(module).__all__
            if module == "triaccel_jax":
                return _table((_home_of(n), n) for n in names)
            return _table((module, n) for n in names)
        # api-contents: the page's entries, the rest in its place, constants listed after.
        pairs = []
        for m in _MARKER.finditer(source[0]):
            if m.group(1) == "api":
                module, _, names = (m.group(2) or "").partition(":")
                pairs += [(module.strip(), n) for n in names.split()]
            elif m.group(1) == "api-rest":
                pairs += [(m.group(2).strip(), n) for n in _REST[m.group(2).strip()]]
        table = _table(pairs)
        if constants:
            table += (
                "\n\nConstants: " + ", ".join(f"{{py:data}}`~{m}.{n}`" for m, n in constants) + "."
            )
        return table

    source[0] = _MARKER.sub(expand, source[0])


def _home_of(name: str) -> str:
    obj = getattr(triaccel_jax, name)
    for home in _HOMES:
        package = importlib.import_module(home)
        if name in package.__all__ and getattr(package, name) is obj:
            return home
    raise LookupError(f"triaccel_jax.{name} is exported by none of {_HOMES}")


def _report_layout(app):
    for problem in _LAYOUT_PROBLEMS:
        _logger.warning("API reference: %s", problem, type="triaccel", subtype="api")
    for module, names in _REST.items():
        if names:
            _logger.info("API reference: %s placed by api-rest only: %s", module, ", ".join(names))


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


# --- Cross-references to re-exported names --------------------------------------------------------
# The pages write names as code uses them, `{py:obj}`~triaccel_jax.triaccel``, and docstrings
# annotate with private modules (`triaccel_jax.policy._policy.PrecisionPolicy`); the reference
# documents each object once, under its package (`triaccel_jax.transforms.triaccel`). A reference
# Sphinx cannot resolve is looked up by object: the first package in _HOMES that exports the same
# object names it. A `triaccel_jax` reference that is found nowhere is a warning (an error in the
# build), so a link in the guide cannot silently turn into plain text; a private name is not one.

_logger = sphinx_logging.getLogger(__name__)


def _documented_name(target: str) -> str | None:
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        first, rest = parts[split], parts[split + 1 :]
        if not hasattr(module, first):
            return None
        obj = getattr(module, first)
        for home in _HOMES:
            package = importlib.import_module(home)
            if first in package.__all__ and getattr(package, first) is obj:
                return ".".join((home, first, *rest))
        return None
    return None


def _resolve_reexports(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    if not target.startswith("triaccel_jax"):
        return None
    name = _documented_name(target)
    if name is not None and name != target:
        domain = env.domains["py"]
        resolved = domain.resolve_xref(
            env, node["refdoc"], app.builder, node["reftype"], name, node, contnode
        )
        if resolved is None:  # a method given as an attribute, a class as a function, ...
            resolved = domain.resolve_xref(
                env, node["refdoc"], app.builder, "obj", name, node, contnode
            )
        if resolved is not None:
            return resolved
    if any(part.startswith("_") for part in target.split(".")):
        return None  # a docstring pointing at a private module's notes: shown as code, unlinked
    _logger.warning(
        "unresolved reference to %s", target, location=node, type="triaccel", subtype="ref"
    )
    return None


def _public(text: str) -> str:
    return _ALIAS.sub(lambda match: autodoc_type_aliases[match.group(0)], text)


def _public_docstring(app, what, name, obj, options, lines):
    lines[:] = [_public(line) for line in lines]


def _public_annotations(app, domain, objtype, contentnode):
    for fields in app.env.current_document.autodoc_annotations.values():
        if "_Sentinel" in fields.get("parent", ""):
            del fields["parent"]  # Flax's own field of every Linen module (see below)
        for key, value in fields.items():
            fields[key] = _public(value)


# A default that is a class prints as its repr with the private module (`<class
# 'triaccel_jax.models._resnet.BasicBlock'>`), and Flax adds `parent=<..._Sentinel object>` to
# every Linen module (a field set by Flax itself, never by the caller).
_CLASS_REPR = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>")
_FLAX_PARENT = re.compile(r",? ?parent=<flax\.linen\.module\._Sentinel object>")


def _public_signature(app, what, name, obj, options, signature, return_annotation):
    if signature is None:
        return None
    signature = _FLAX_PARENT.sub("", _CLASS_REPR.sub(r"\1", _public(signature)))
    return signature, return_annotation and _public(return_annotation)


# --- The notebooks, executed once -----------------------------------------------------------------
# CI (.ci/run) runs the tests with TRIACCEL_EXECUTED_NOTEBOOKS=FOLDER: tests/package/test_notebooks.py
# executes every notebook, checks it (no cell raises, every plot draws a figure) and writes it there
# with its outputs. A build with the same variable renders those outputs instead of executing the
# notebooks a second time: each stored notebook takes the executed copy's outputs, once every cell
# is checked to be the stored one (a copy from other sources is a warning, so an error in the
# build), and its page's execution is off. A notebook without an executed copy there is executed as
# usual; the pages with code cells always are.
_EXECUTED_NOTEBOOKS = os.environ.get("TRIACCEL_EXECUTED_NOTEBOOKS", "")


def _reuse_executed_notebook(app, docname, source):
    if not _EXECUTED_NOTEBOOKS or not str(app.env.doc2path(docname)).endswith(".ipynb"):
        return
    import nbformat

    executed_path = os.path.join(_EXECUTED_NOTEBOOKS, os.path.basename(docname) + ".ipynb")
    if not os.path.isfile(executed_path):
        _logger.info("%s: no executed copy in TRIACCEL_EXECUTED_NOTEBOOKS, executing it", docname)
        return
    stored = nbformat.reads(source[0], as_version=4)
    executed = nbformat.read(executed_path, as_version=4)
    cells = lambda nb: [(cell.cell_type, cell.source) for cell in nb.cells]
    if cells(stored) != cells(executed):
        _logger.warning(
            "%s: the executed copy %s has other cells than the notebook (run its test again)",
            docname,
            executed_path,
            type="triaccel",
            subtype="notebooks",
        )
        return
    for cell, done in zip(stored.cells, executed.cells, strict=True):
        if cell.cell_type == "code":
            cell.outputs = done.outputs
            cell.execution_count = done.execution_count
    stored.metadata["mystnb"] = {**stored.metadata.get("mystnb", {}), "execution_mode": "off"}
    source[0] = nbformat.writes(stored)
    _logger.info("%s: outputs from the tests' run (%s), not executed again", docname, executed_path)


def setup(app):
    # After napoleon (500) has turned "Attributes:" into fields, before the types are merged.
    app.connect("autodoc-process-docstring", _public_docstring, priority=600)
    app.connect("object-description-transform", _public_annotations, priority=400)
    app.connect("autodoc-process-signature", _public_signature)
    app.connect("missing-reference", _resolve_reexports)
    app.connect("source-read", _expand_markers)
    app.connect("source-read", _reuse_executed_notebook)
    app.connect("builder-inited", _report_layout)
    app.connect("autodoc-process-docstring", _join_split_literals, priority=400)
