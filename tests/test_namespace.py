"""The public namespaces: one package per stage, the top level, and the names that moved."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import triaccel_jax

PACKAGES = ("transforms", "precision", "controller", "flax", "checkpoint", "cli")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_documents_its_stage_and_exports_what_it_lists(package):
    module = importlib.import_module(f"triaccel_jax.{package}")
    assert module.__doc__ and len(module.__doc__.split()) > 20
    for name in module.__all__:
        obj = getattr(module, name)
        assert getattr(obj, "__doc__", None), f"triaccel_jax.{package}.{name} has no docstring"
        # Public names are defined in the package's own private modules, not re-exported from
        # another stage's.
        assert obj.__module__.startswith(f"triaccel_jax.{package}."), (name, obj.__module__)


def test_the_top_level_names_are_the_subpackages_objects():
    for name in triaccel_jax.__all__:
        obj = getattr(triaccel_jax, name)
        home = importlib.import_module(obj.__module__.rsplit(".", 1)[0])
        assert getattr(home, name) is obj, name


@pytest.mark.parametrize("name", sorted(triaccel_jax._MOVED))
def test_a_moved_name_still_resolves_with_a_warning_naming_its_new_home(name):
    home = triaccel_jax._MOVED[name]
    with pytest.warns(DeprecationWarning, match=rf"moved to {home}\.{name}"):
        obj = getattr(triaccel_jax, name)
    assert obj is getattr(importlib.import_module(home), name)
    assert name not in triaccel_jax.__all__


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        triaccel_jax.not_a_name  # noqa: B018


def test_import_triaccel_jax_imports_neither_flax_nor_orbax_nor_matplotlib():
    code = (
        "import sys, triaccel_jax; "
        "print(sorted(m for m in ('flax', 'orbax', 'matplotlib') if m in sys.modules)); "
        "triaccel_jax.flax.TrainState; print('flax' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0] == "[]"  # nothing heavy at import
    assert out[1] == "True"  # the subpackage imports on first use
