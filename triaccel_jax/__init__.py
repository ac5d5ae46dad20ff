"""triaccel_jax: curvature-aware, precision-adaptive, memory-elastic optimisation for JAX.

An implementation of Tri-Accel (arXiv 2508.16905) as optax transforms.
"""

from triaccel_jax._src.alias import triaccel
from triaccel_jax._src.buckets import BucketDecision
from triaccel_jax._src.buckets import bucket_sizes
from triaccel_jax._src.buckets import decide_bucket
from triaccel_jax._src.buckets import predict_peak
from triaccel_jax._src.checkpoint import Checkpointer
from triaccel_jax._src.checkpoint import CheckpointError
from triaccel_jax._src.compression import CompressedDiagonal
from triaccel_jax._src.compression import compress_diagonal
from triaccel_jax._src.compression import expand_diagonal
from triaccel_jax._src.controller import Controller
from triaccel_jax._src.controller import OutOfMemoryError
from triaccel_jax._src.controller import StepInfo
from triaccel_jax._src.controller import is_out_of_memory
from triaccel_jax._src.curvature import HutchinsonDiagonalState
from triaccel_jax._src.curvature import fisher_diagonal
from triaccel_jax._src.curvature import hutchinson_diagonal
from triaccel_jax._src.events import Event
from triaccel_jax._src.events import event_records
from triaccel_jax._src.flax_precision import apply_with_policy
from triaccel_jax._src.flax_precision import precision_interceptor
from triaccel_jax._src.loss_scaling import DynamicLossScaleState
from triaccel_jax._src.loss_scaling import LossScaleState
from triaccel_jax._src.loss_scaling import LossScaling
from triaccel_jax._src.loss_scaling import dynamic_loss_scale
from triaccel_jax._src.loss_scaling import loss_scale
from triaccel_jax._src.memory import MemoryReport
from triaccel_jax._src.memory import memory_report
from triaccel_jax._src.memory_probe import BudgetMemoryProbe
from triaccel_jax._src.memory_probe import DeviceMemoryProbe
from triaccel_jax._src.memory_probe import FakeMemoryProbe
from triaccel_jax._src.memory_probe import MemoryProbe
from triaccel_jax._src.memory_probe import MemoryReading
from triaccel_jax._src.memory_probe import compiled_peak_bytes
from triaccel_jax._src.memory_probe import default_memory_probe
from triaccel_jax._src.planner import plan_precision
from triaccel_jax._src.policy import LeafPrecision
from triaccel_jax._src.policy import PrecisionPolicy
from triaccel_jax._src.precision import apply_updates
from triaccel_jax._src.precision import cast_params
from triaccel_jax._src.precision import convert_state
from triaccel_jax._src.precision import master_params
from triaccel_jax._src.sampler import ElasticSampler
from triaccel_jax._src.signals import signals
from triaccel_jax._src.transform import LeafSignals
from triaccel_jax._src.transform import ScaleByTriAccelState
from triaccel_jax._src.transform import TriAccelConfig
from triaccel_jax._src.transform import scale_by_triaccel

__version__ = "0.1.0"

__all__ = (
    "BucketDecision",
    "BudgetMemoryProbe",
    "CheckpointError",
    "Checkpointer",
    "CompressedDiagonal",
    "Controller",
    "DeviceMemoryProbe",
    "DynamicLossScaleState",
    "ElasticSampler",
    "Event",
    "FakeMemoryProbe",
    "HutchinsonDiagonalState",
    "LeafPrecision",
    "LeafSignals",
    "LossScaleState",
    "LossScaling",
    "MemoryProbe",
    "MemoryReading",
    "MemoryReport",
    "OutOfMemoryError",
    "PrecisionPolicy",
    "ScaleByTriAccelState",
    "StepInfo",
    "TriAccelConfig",
    "apply_updates",
    "apply_with_policy",
    "bucket_sizes",
    "cast_params",
    "compiled_peak_bytes",
    "compress_diagonal",
    "convert_state",
    "decide_bucket",
    "default_memory_probe",
    "dynamic_loss_scale",
    "event_records",
    "expand_diagonal",
    "fisher_diagonal",
    "hutchinson_diagonal",
    "is_out_of_memory",
    "loss_scale",
    "master_params",
    "memory_report",
    "plan_precision",
    "precision_interceptor",
    "predict_peak",
    "scale_by_triaccel",
    "signals",
    "triaccel",
)
