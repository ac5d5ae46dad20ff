"""The subpackages of triaccel_jax: one list, which every reader of it takes from here.

The top level (which subpackages ``dir(triaccel_jax)`` offers and which it imports on first
use), the layering test (``tests/package/test_layering.py``), the namespace and docs tests, the
API reference's build (``docs/conf.py``) and CI's packaging check (``.ci/run``, against
``pyproject.toml``'s explicit list) all read these names, so that a subpackage is added in one
place. Nothing here imports anything: the docs build and CI read it without importing jax.
"""

from __future__ import annotations

# Bottom-up: a subpackage imports only subpackages of a lower layer (the layering test), and
# only their public names (``_src`` is the shared private base every layer may use).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_src",),
    ("kernels",),
    ("policy",),  # dtypes, PrecisionPolicy, PrecisionPlan, the casts, the state formats
    ("transforms",),
    ("precision",),  # the planners, the memory report
    ("training",),  # the pure train step
    ("controller",),
    ("flax",),  # the train state, and a train state through the controller
    ("checkpoint", "data", "models"),
    ("cli",),
)
SUBPACKAGES: tuple[str, ...] = tuple(name for layer in LAYERS for name in layer)
PUBLIC: tuple[str, ...] = tuple(name for name in SUBPACKAGES if not name.startswith("_"))
# Imported on first use: they pull in optional or heavy dependencies (Flax, orbax, matplotlib,
# tensorflow-datasets), so ``import triaccel_jax`` stays an optax-only import.
LAZY: frozenset[str] = frozenset({"checkpoint", "cli", "data", "flax", "kernels", "models"})
# Where a subpackage's folder is not ``triaccel_jax/<name>/`` (relative to the repository's
# root): the Triton kernels and their references live at the top, beside the library.
FOLDERS: dict[str, str] = {"kernels": "kernels"}
# The subpackages the API reference documents name by name (docs/api/*.md markers): every public
# one but the kernels (documented as a module) and the command line (no API).
DOCUMENTED: tuple[str, ...] = tuple(name for name in PUBLIC if name not in ("kernels", "cli"))
