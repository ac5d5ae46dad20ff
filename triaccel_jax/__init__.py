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
from triaccel_jax._src.planner import plan_precision
from triaccel_jax._src.policy import LeafPrecision
from triaccel_jax._src.policy import PrecisionPolicy
from triaccel_jax._src.signals import signals
from triaccel_jax._src.transform import LeafSignals
from triaccel_jax._src.transform import ScaleByTriAccelState
from triaccel_jax._src.transform import scale_by_triaccel

__version__ = "0.1.0"

__all__ = (
    "CompressedDiagonal",
    "HutchinsonDiagonalState",
    "LeafPrecision",
    "LeafSignals",
    "PrecisionPolicy",
    "ScaleByTriAccelState",
    "compress_diagonal",
    "expand_diagonal",
    "fisher_diagonal",
    "hutchinson_diagonal",
    "plan_precision",
    "scale_by_triaccel",
    "signals",
    "triaccel",
)
