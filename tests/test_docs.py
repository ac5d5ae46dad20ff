"""Documentation cannot rot: the docstring examples and the README's Python blocks run."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re

import pytest

import triaccel_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(
    {
        importlib.import_module(getattr(triaccel_jax, name).__module__)
        for name in triaccel_jax.__all__
    }
    | {importlib.import_module("triaccel_jax.kernels.cast")},
    key=lambda module: module.__name__,
)


@pytest.mark.parametrize("module", MODULES, ids=lambda module: module.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module.__name__} has no docstring examples"
    assert result.failed == 0


def test_every_public_name_has_a_docstring_with_an_example():
    for name in triaccel_jax.__all__:
        doc = getattr(triaccel_jax, name).__doc__ or ""
        assert doc.strip(), name
        if callable(getattr(triaccel_jax, name)) and not isinstance(
            getattr(triaccel_jax, name), type
        ):
            assert ">>>" in doc, f"{name} has no example"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "README.md has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
