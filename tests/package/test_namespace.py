"""The public namespaces: one package per stage, the top level, and the names that moved."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import triaccel_jax
from triaccel_jax._src import packages

# Every public subpackage, each reachable as an attribute of the top level (the lazy ones import
# on first use): triaccel_jax._src.packages, the one list.
PACKAGES = packages.PUBLIC


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_documents_its_stage_and_exports_what_it_lists(package):
    module = importlib.import_module(f"triaccel_jax.{package}")
    assert module.__doc__ and len(module.__doc__.split()) > 20
    for name in module.__all__:
        obj = getattr(module, name)
        if not callable(obj):  # a constant (a tuple of names): no docstring, no home module
            continue
        assert getattr(obj, "__doc__", None), f"triaccel_jax.{package}.{name} has no docstring"
        # Public names are defined in the package's own private modules, not re-exported from
        # another stage's.
        assert obj.__module__.startswith(f"triaccel_jax.{package}."), (name, obj.__module__)


def test_the_top_level_names_are_the_subpackages_objects():
    for name in triaccel_jax.__all__:
        obj = getattr(triaccel_jax, name)
        home = importlib.import_module(obj.__module__.rsplit(".", 1)[0])
        assert getattr(home, name) is obj, name


def test_dir_lists_only_public_names_that_resolve():
    # Autocompletion shows dir(): every name there resolves without a warning, and no private
    # or moved name is offered.
    listed = dir(triaccel_jax)
    assert set(triaccel_jax.__all__) <= set(listed)
    for name in listed:
        assert not name.startswith("_") or name == "__version__", name
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            getattr(triaccel_jax, name)
    assert len(listed) == len(triaccel_jax.__all__) + 1 + len(PACKAGES)


def test_the_version_marks_unreleased_work():
    # No release has been made: the version is a pre-release of the first one (PEP 440).
    from packaging.version import Version

    version = Version(triaccel_jax.__version__)
    assert version.is_prerelease and version.release == (0, 1, 0)


def test_no_top_level_name_shadows_an_optax_name_with_other_semantics():
    import optax

    assert not hasattr(triaccel_jax, "apply_updates")
    for name in triaccel_jax.__all__:
        assert not hasattr(optax, name), name


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
