"""triaccel_jax: curvature-aware, precision-adaptive, memory-elastic optimisation for JAX.

An implementation of Tri-Accel (arXiv 2508.16905) as optax transforms.
"""

from triaccel_jax._src.alias import triaccel
from triaccel_jax._src.compression import CompressedDiagonal
from triaccel_jax._src.compression import compress_diagonal
from triaccel_jax._src.compression import expand_diagonal
from triaccel_jax._src.curvature import HutchinsonDiagonalState
from triaccel_jax._src.curvature import fisher_diagonal
from triaccel_jax._src.curvature import hutchinson_diagonal
from triaccel_jax._src.flax_precision import apply_with_policy
from triaccel_jax._src.flax_precision import precision_interceptor
from triaccel_jax._src.loss_scaling import DynamicLossScaleState
from triaccel_jax._src.loss_scaling import dynamic_loss_scale
from triaccel_jax._src.loss_scaling import loss_scale
from triaccel_jax._src.memory import MemoryReport
from triaccel_jax._src.memory import memory_report
from triaccel_jax._src.planner import plan_precision
from triaccel_jax._src.policy import LeafPrecision
from triaccel_jax._src.policy import PrecisionPolicy
from triaccel_jax._src.precision import apply_updates
from triaccel_jax._src.precision import cast_params
from triaccel_jax._src.precision import convert_state
from triaccel_jax._src.precision import master_params
from triaccel_jax._src.signals import signals
from triaccel_jax._src.transform import LeafSignals
from triaccel_jax._src.transform import ScaleByTriAccelState
from triaccel_jax._src.transform import scale_by_triaccel

__version__ = "0.1.0"

__all__ = (
    "CompressedDiagonal",
    "DynamicLossScaleState",
    "HutchinsonDiagonalState",
    "LeafPrecision",
    "LeafSignals",
    "MemoryReport",
    "PrecisionPolicy",
    "ScaleByTriAccelState",
    "apply_updates",
    "apply_with_policy",
    "cast_params",
    "compress_diagonal",
    "convert_state",
    "dynamic_loss_scale",
    "expand_diagonal",
    "fisher_diagonal",
    "hutchinson_diagonal",
    "loss_scale",
    "master_params",
    "memory_report",
    "plan_precision",
    "precision_interceptor",
    "scale_by_triaccel",
    "signals",
    "triaccel",
)
