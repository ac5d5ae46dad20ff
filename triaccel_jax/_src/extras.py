"""Optional dependencies: a feature used without its extra says which extra to install.

The core install (``pip install -e .`` in a clone: the package is not on PyPI yet) holds only what the optax transforms, the precision planner and
the controller need (jax, optax, numpy, psutil). Flax (``triaccel_jax.flax``,
``triaccel_jax.models``, the main job) and orbax (``triaccel_jax.checkpoint``) are extras; each
subpackage that needs one calls :func:`require` before importing it.
"""

from __future__ import annotations

import importlib.util
import sys


def install_hint(extra: str) -> str:
    """How to install ``extra``: from a clone, as the package is not on PyPI yet.

    Example:
      >>> from triaccel_jax._src.extras import install_hint
      >>> install_hint("flax")
      "pip install -e '.[flax]' (in a clone of triaccel_jax)"
    """
    return f"pip install -e '.[{extra}]' (in a clone of triaccel_jax)"


# What each extra of pyproject.toml provides, for the messages: (module, pip name) pairs.
EXTRAS = {
    "flax": (("flax", "Flax"),),
    "checkpoint": (("orbax.checkpoint", "orbax-checkpoint"),),
    "tensorboard": (("tensorboardX", "tensorboardX"),),
    "demo": (
        ("flax", "Flax"),
        ("sklearn", "scikit-learn"),
        ("tqdm", "tqdm"),
        ("matplotlib", "matplotlib"),
    ),
}


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (orbax takes ~1 s).

    A module set to ``None`` in ``sys.modules`` counts as missing, as ``import`` treats it.
    """
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        # For a dotted name this imports the parents (``orbax``, a namespace package: cheap).
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing or blocked
        return False
    except ValueError:  # loaded without a spec (a test stub, an embedded interpreter): present
        return True


def require(extra: str, feature: str) -> None:
    """Raises ``ModuleNotFoundError`` naming ``extra`` when any of its packages is not installed.

    Args:
      extra: the extra of pyproject.toml, a key of :data:`EXTRAS` (e.g. ``"flax"``).
      feature: what needs it, for the message (e.g. ``"triaccel_jax.flax"``).

    Raises:
      ModuleNotFoundError: (an ``ImportError``) packages are missing; the message names all of
        them and the extra, and ``name`` is the first missing module, as Python's own error has
        it.

    Example:
      >>> from triaccel_jax._src import extras
      >>> extras.require("flax", "triaccel_jax.flax")  # Flax is installed: nothing happens
    """
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; choose one of {sorted(EXTRAS)}")
    missing = [(module, package) for module, package in EXTRAS[extra] if not is_installed(module)]
    if missing:
        names = [package for _, package in missing]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        which = "which is" if len(names) == 1 else "which are"
        raise ModuleNotFoundError(
            f"{feature} needs {listed}, {which} not installed: {install_hint(extra)}",
            name=missing[0][0],
        )
