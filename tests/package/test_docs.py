"""Documentation cannot rot: the docstring examples and the README's Python blocks run."""

from __future__ import annotations

import doctest
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

import triaccel_jax
from triaccel_jax._src import packages

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Where the importable tree lies in the repository.
# kernels/ installs as triaccel_jax.kernels (pyproject.toml's package-dir).
PACKAGE_ROOTS = {"triaccel_jax": ROOT / "triaccel_jax", "triaccel_jax.kernels": ROOT / "kernels"}


def _modules_with_examples() -> list[str]:
    """Every module under triaccel_jax/ and kernels/ whose source has a ``>>>`` example."""
    names = []
    for package, folder in PACKAGE_ROOTS.items():
        for path in sorted(folder.rglob("*.py")):
            if ">>>" not in path.read_text():
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join((package, *parts)))
    return sorted(names)


MODULES = _modules_with_examples()


def _import_or_skip(name: str):
    """The module ``name``; skips the test when it needs an optional package not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing == "triaccel_jax" or missing.startswith("triaccel_jax."):
            raise
        pytest.skip(f"{name} needs the optional package {missing!r}, which is not installed")


def test_the_collection_finds_modules_of_every_stage():
    # A collection that finds nothing (a moved folder, a broken glob) must not pass quietly.
    for stage in packages.PUBLIC:
        assert any(name.startswith(f"triaccel_jax.{stage}.") for name in MODULES), stage


# Modules whose examples run a Flax layer that promotes internally (avg_pool mixes an int constant
# with the input's dtype): they run under standard promotion, every other module under strict.
_FLAX_PROMOTES = {"triaccel_jax.models._small_cnn"}
# Modules whose examples run an optax optimizer's update, which promotes its integer count inside
# (``decay ** count`` in Adam's bias correction).
_OPTAX_PROMOTES = {"triaccel_jax.transforms._state_precision"}


# Modules whose examples train for a while (tens of seconds on 2 cores): slow, the full suite's.
_SLOW_EXAMPLES = {
    "triaccel_jax.transforms._alias",
    "triaccel_jax.models._resnet",
    "triaccel_jax.models._efficientnet",
    "triaccel_jax.kernels.quantize",
}


def _example_marks(name: str) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.slow] if name in _SLOW_EXAMPLES else []
    if name in _FLAX_PROMOTES:
        marks.append(pytest.mark.standard_promotion("Flax's avg_pool promotes internally"))
    elif name in _OPTAX_PROMOTES:
        marks.append(pytest.mark.standard_promotion("optax's Adam promotes its count inside"))
    return marks


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=_example_marks(name)) for name in MODULES]
)
def test_docstring_examples(name):
    module = _import_or_skip(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring examples"
    assert result.failed == 0


def test_every_public_name_has_a_docstring_with_an_example():
    for name in triaccel_jax.__all__:
        doc = getattr(triaccel_jax, name).__doc__ or ""
        assert doc.strip(), name
        if callable(getattr(triaccel_jax, name)) and not isinstance(
            getattr(triaccel_jax, name), type
        ):
            assert ">>>" in doc, f"{name} has no example"


@pytest.mark.standard_promotion(
    "optax promotes inside its own transforms (integer leaves, MultiSteps, injected hyperparameters)"
)
@pytest.mark.standard_promotion("optax's adamw and muon in the README promote inside")
@pytest.mark.slow
def test_readme_python_blocks_run():
    # In order, in one namespace, as a reader pasting them into a notebook runs them.
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 2, "README.md has no python example, or no example over another optimizer"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)


def test_the_readme_example_shows_per_layer_step_scales_that_differ():
    # The headline example must show the feature: with one leaf the median curvature is its own
    # and every scale is 1.00. It prints what the README says it prints, to the shown digits.
    text = (ROOT / "README.md").read_text()
    example = text.split("## Example", 1)[1]
    code = re.search(r"```python\n(.*?)```", example, re.S).group(1)
    shown = re.search(r"It prints.*?```text\n(.*?)```", example, re.S).group(1)
    # In a fresh Python compiled as a user's is: the figures shown depend on the last bits of
    # every step, and the tests compile without LLVM's optimisations (tests/conftest.py).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout
    scales = [float(s) for s in re.findall(r"step scale (\d+\.\d+)", printed)]
    assert len(scales) >= 3 and len(set(scales)) >= 2, printed
    # To the shown digits, give or take 0.02: 500 steps amplify the last bits, which move with
    # the jax release (out/w's scale printed 0.63 under jax 0.12.0 and 0.62 under 0.12.1).
    expected = [float(s) for s in re.findall(r"step scale (\d+\.\d+)", shown)]
    assert scales == pytest.approx(expected, abs=0.02), (printed, shown)
    assert printed.splitlines()[0] == shown.splitlines()[0]  # the loss line


def _tool(name: str):
    """The module ``tools/NAME.py`` (the tools folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lowest_versions_smoke_finds_the_readme_example():
    # CI's lowest-versions step runs the README's headline example from tools/lowest_versions_smoke.py;
    # it must find the block this file's headline test runs, whatever the heading's title says.
    text = (ROOT / "README.md").read_text()
    expected = re.search(r"```python\n(.*?)```", text.split("## Example", 1)[1], re.S).group(1)
    assert _tool("lowest_versions_smoke").readme_example(ROOT / "README.md") == expected


def test_the_lowest_versions_smoke_names_a_readme_without_an_example(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# t\n\n## Examples of use\n\n```python\nprint(1)\n```\n")
    with pytest.raises(SystemExit, match="no '## Example' heading"):
        _tool("lowest_versions_smoke").readme_example(readme)


# --- The built site's check (tools/check_docs_site.py, run by tools/docs.sh after the build) ---


def _check_site():
    return _tool("check_docs_site").check_site


def _site(tmp_path, index_body, css=""):
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "theme.css").write_text(css)
    (tmp_path / "_static" / "local.js").write_text("")
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "page.html").write_text(
        '<html><body><h1 id="top">API</h1><a href="../index.html#intro">back</a></body></html>'
    )
    (tmp_path / "index.html").write_text(
        '<html><head><link rel="stylesheet" href="_static/theme.css">'
        '<script src="_static/local.js"></script></head>'
        f'<body><p id="intro">hi</p><a href="api/page.html#top">API</a>'
        f'<a href="https://arxiv.org/abs/2508.16905">paper</a>{index_body}</body></html>'
    )
    return tmp_path


def test_site_check_passes_an_offline_site_with_working_links(tmp_path):
    problems, summary = _check_site()(_site(tmp_path, ""))
    assert problems == [], problems
    assert "internal links" in summary


@pytest.mark.parametrize(
    ("body", "css", "expected"),
    [
        # The MathJax tag Sphinx writes by default: the formulas need the network.
        (
            '<script defer src="https://cdn.jsdelivr.net/npm/mathjax@4/tex-mml-chtml.js"></script>',
            "",
            "remote resource",
        ),
        ('<link rel="stylesheet" href="//fonts.example.org/x.css">', "", "remote resource"),
        ("", "@font-face { src: url(https://fonts.example.org/a.woff2); }", "remote resource"),
        ('<a href="api/page.html#no-such-entry">x</a>', "", "missing anchor"),
        ('<a href="#nowhere">x</a>', "", "missing anchor"),
        ('<a href="guide.html">x</a>', "", "missing file"),
        ("<pre>File /work/main/triaccel_jax/x.py</pre>", "", "contains"),
    ],
)
def test_site_check_finds_remote_resources_broken_links_and_paths(tmp_path, body, css, expected):
    problems, _ = _check_site()(_site(tmp_path, body, css), forbid=["/work/main/"])
    assert len(problems) == 1 and expected in problems[0], problems


# --- The API reference: grouped by task, every public name documented exactly once ----------------
# docs/api/*.md place names with markers that docs/conf.py expands into autodoc entries:
# `<!-- api: MODULE: name ... -->` (entries, in that order), a hand-written `.. py:data:: NAME` with
# `:module: MODULE` (constants), and `<!-- api-rest: MODULE -->` (every name of MODULE no marker
# places). The kernels page documents triaccel_jax.kernels with automodule.

_API_PACKAGES = tuple(f"triaccel_jax.{name}" for name in packages.DOCUMENTED)
_API_MARKER = re.compile(r"<!-- (api-contents|api-summary|api-rest|api)(?::\s*(.*?))?\s*-->", re.S)
_API_MANUAL = re.compile(r"^\s*\.\. py:data:: (\w+)\n\s+:module: ([\w.]+)", re.M)
_API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))


def _api_layout():
    """(module, name) -> pages placing it, and module -> pages holding its api-rest marker."""
    placed: dict[tuple[str, str], list[str]] = {}
    rests: dict[str, list[str]] = {}
    for page in _API_PAGES:
        text = page.read_text()
        for match in _API_MANUAL.finditer(text):
            placed.setdefault((match.group(2), match.group(1)), []).append(page.name)
        for match in _API_MARKER.finditer(text):
            kind, arg = match.group(1), (match.group(2) or "").strip()
            if kind == "api":
                module, _, names = arg.partition(":")
                for name in names.split():
                    placed.setdefault((module.strip(), name), []).append(page.name)
            elif kind == "api-rest":
                rests.setdefault(arg, []).append(page.name)
    return placed, rests


def test_api_pages_place_every_public_name_exactly_once():
    placed, rests = _api_layout()
    public = {(m, n) for m in _API_PACKAGES for n in _import_or_skip(m).__all__}
    assert not {k: v for k, v in placed.items() if len(v) > 1}, "placed twice"
    assert set(placed) <= public, f"not public: {sorted(set(placed) - public)}"
    # Each package has one page for the names no marker places yet (none today).
    assert {m: len(p) for m, p in rests.items()} == {m: 1 for m in _API_PACKAGES}
    unplaced = sorted(f"{m}.{n}" for m, n in public - set(placed))
    assert unplaced == [], (
        f"add these to a <!-- api: MODULE: ... --> marker in docs/api/: {unplaced}"
    )


def test_api_pages_come_in_task_order_and_cover_the_top_level_names():
    text = (ROOT / "docs" / "api.md").read_text()
    toctree = re.search(r"```\{toctree\}\n:hidden:\n\n(.*?)```", text, re.S).group(1).split()
    assert toctree[:6] == [
        "api/optimizers",
        "api/precision",
        "api/controller",
        "api/flax",
        "api/checkpoint",
        "api/data",
    ]
    assert {f"api/{page.stem}" for page in _API_PAGES} == set(toctree)
    # The optimizers page opens with the recommended configuration's names, not state classes.
    first = _API_MARKER.search(
        (ROOT / "docs" / "api" / "optimizers.md").read_text().split("<!-- api-contents -->")[1]
    )
    assert first.group(2).split(":")[1].split()[:2] == [
        "curvature_signals",
        "muon_dimension_numbers",
    ]
    # Every name of the top-level namespace is in the overview's tables.
    summarised = {
        name
        for match in _API_MARKER.finditer(text)
        if match.group(1) == "api-summary"
        for name in match.group(2).partition(":")[2].split()
    }
    assert set(triaccel_jax.__all__) <= summarised, set(triaccel_jax.__all__) - summarised


def test_the_reference_readable_without_a_build_is_what_the_docstrings_say():
    # docs/reference/ is the API reference as plain Markdown (GitHub shows it; nothing to build),
    # written by tools/api_reference.py from the same pages and docstrings as the built one.
    written = _tool("api_reference").pages()
    folder = ROOT / "docs" / "reference"
    committed = {page.name: page.read_text() for page in folder.glob("*.md")}
    assert sorted(committed) == sorted(written)
    stale = [name for name in written if committed[name] != written[name]]
    assert stale == [], f"stale: {stale}; run .venv/bin/python tools/api_reference.py"
    # Every public name of every documented package has its entry, the kernels' too.
    text = "\n".join(written.values())
    for module in _API_PACKAGES:
        for name in _import_or_skip(module).__all__:
            assert f"### `{module}.{name}`" in text or f"{name}\n   :module: {module}" in text, (
                module,
                name,
            )
    assert "### `triaccel_jax.kernels.cast.cast`" in text
