"""triaccel_jax: curvature-aware, precision-adaptive, memory-elastic optimisation for JAX.

An implementation of Tri-Accel (arXiv 2508.16905) as optax transforms, a precision planner and a
host-side controller. One subpackage per stage of the data path::

    triaccel_jax.policy       dtypes, PrecisionPolicy, PrecisionPlan, the casts
    triaccel_jax.transforms   the optimizer: moments, curvature store, signals, loss scaling
    triaccel_jax.precision    the planner (plan_precision), memory_report
    triaccel_jax.controller   Controller and its parts: buckets, probes, sampler, events
    triaccel_jax.flax         TrainState and the Linen precision interceptor (the flax extra)
    triaccel_jax.checkpoint   Checkpointer (orbax, the checkpoint extra)
    triaccel_jax.data         Fashion-MNIST, digits, CIFAR; augmentation
    triaccel_jax.models       SmallCNN, ResNet-20/18, EfficientNet-B0
    triaccel_jax.kernels      cast and fused-update kernels (Triton) beside their references
    triaccel_jax.cli          the main job, ``python -m triaccel_jax``

The names most code needs are re-exported here; the design is in ``docs/design.md``.
``import triaccel_jax`` needs only jax, optax, numpy and psutil: the subpackages that need Flax,
orbax, matplotlib or tensorflow-datasets are imported on first use, and one used without its
extra raises an ``ImportError`` naming it (``pip install -e '.[flax]'`` in a clone, ``[checkpoint]``).
"""

import importlib as _importlib
import typing as _typing

from triaccel_jax._src import packages as _packages
from triaccel_jax.controller import BudgetMemoryProbe
from triaccel_jax.controller import Controller
from triaccel_jax.controller import DeviceMemoryProbe
from triaccel_jax.controller import FakeMemoryProbe
from triaccel_jax.controller import OutOfMemoryError
from triaccel_jax.controller import StepInfo
from triaccel_jax.policy import LeafPrecision
from triaccel_jax.policy import PrecisionPlan
from triaccel_jax.policy import PrecisionPolicy
from triaccel_jax.policy import cast_params
from triaccel_jax.policy import master_params
from triaccel_jax.policy import stochastic_apply_updates
from triaccel_jax.precision import MemoryReport
from triaccel_jax.precision import memory_report
from triaccel_jax.precision import plan_precision
from triaccel_jax.transforms import TriAccelConfig
from triaccel_jax.transforms import curvature_signals
from triaccel_jax.transforms import quantize_state
from triaccel_jax.transforms import scale_by_curvature
from triaccel_jax.transforms import scale_by_triaccel
from triaccel_jax.transforms import signals
from triaccel_jax.transforms import triaccel

if _typing.TYPE_CHECKING:  # for type checkers; at run time they load on first use (__getattr__)
    from triaccel_jax.checkpoint import Checkpointer
    from triaccel_jax.checkpoint import CheckpointError

__version__ = "0.1.0.dev0"

__all__ = (
    "BudgetMemoryProbe",
    "CheckpointError",
    "Checkpointer",
    "Controller",
    "DeviceMemoryProbe",
    "FakeMemoryProbe",
    "LeafPrecision",
    "MemoryReport",
    "OutOfMemoryError",
    "PrecisionPlan",
    "PrecisionPolicy",
    "StepInfo",
    "TriAccelConfig",
    "cast_params",
    "curvature_signals",
    "master_params",
    "memory_report",
    "plan_precision",
    "quantize_state",
    "scale_by_curvature",
    "scale_by_triaccel",
    "signals",
    "stochastic_apply_updates",
    "triaccel",
)

# Top-level names (in __all__) that live in a lazy subpackage: the checkpoint package needs orbax.
_LAZY_NAMES = {
    "CheckpointError": "triaccel_jax.checkpoint",
    "Checkpointer": "triaccel_jax.checkpoint",
}


def __getattr__(name: str):
    if name in _packages.LAZY:
        return _importlib.import_module(f"triaccel_jax.{name}")
    if name in _LAZY_NAMES:
        return getattr(_importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'triaccel_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(
        {
            *__all__,
            "__version__",
            *_packages.PUBLIC,
        }
    )
