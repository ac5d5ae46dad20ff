"""The optimizer stage: gradients in, updates and per-leaf signals out.

Everything here is an optax transform or reads one's state (optax's ``transforms/`` is the
model):

* :func:`triaccel` (the optimizer) and :func:`scale_by_triaccel` (its direction, Adam moments
  times a per-leaf curvature step scale), configured by :class:`TriAccelConfig`, each composed
  from the curvature signals, Adam's direction and the step scale;
* the curvature estimators :func:`fisher_diagonal` and :func:`hutchinson_diagonal` (with
  :func:`unmask` for a loss under ``optax.masked``);
* the compressed curvature store (:class:`CompressedDiagonal`, :func:`compress_diagonal`,
  :func:`expand_diagonal`, with :func:`block_counts` and :func:`uses_channel_pairs` for its
  layout), updated without gathering sharded leaves, and :class:`CurvatureStores`, every
  leaf's store laid end to end as the signals' state keeps them;
* :func:`curvature_signals` (state :class:`CurvatureSignalsState`), an observer that keeps
  the curvature and noise signals beside any optax optimizer, leaving its updates untouched
  (beside Adam's direction, in :func:`triaccel`, they keep Adam's moments: state
  :class:`AdamSignalsState`), and :func:`scale_by_curvature`, Tri-Accel's per-leaf
  step scale over any direction (SGD, Muon, a whole optax optimizer), with
  :func:`muon_dimension_numbers`, which has ``optax.contrib.muon`` train every kernel (conv
  kernels folded into matrices) and leave the rest to Adam;
* :func:`signals`, the per-leaf curvature, noise and step-size figures of any state holding
  curvature signals, :func:`mean_curvatures`, each leaf's mean curvature as a tree
  usable inside ``jit``, :func:`convert_state`, which recasts the moments for a precision policy,
  and :func:`find_signal_states`, which finds those states inside any optimizer state;
* dynamic loss scaling (:class:`LossScaling`, :func:`dynamic_loss_scale`, and
  :func:`select_tree`, which skips an overflowing step), with the pieces a train step uses:
  :func:`needs_loss_scaling`, :func:`holds_loss_scale`, :func:`unscale`, :func:`leaf_finite`
  and :func:`all_finite`;
* :func:`fused_triaccel` (a :class:`FusedTriAccel`: a ``triaccel`` optimizer and its fused
  form) and :func:`fused_apply`, a triaccel step that writes the moments, the master and its
  compute copy in one pass per leaf (the fused kernel on CUDA where it is selected), with
  :func:`unfused_reason` and :func:`uses_triton` to say when it applies;
* :func:`quantize_state`, any optax optimizer's state kept in bfloat16, block-wise 8- or 4-bit
  codes or factored second moments between its updates (state :class:`QuantizedState`, leaves
  :class:`QuantizedLeaf`, :class:`FactoredLeaf` and :class:`Bfloat16Leaf`, centered moments
  :class:`CenteredState`), :func:`to_quantized_state`
  and :func:`dequantize_state`, which convert a plain optimizer state to a quantized one and
  back, and :func:`compiled_state_bytes` (a :class:`StateBytes`), the bytes
  per parameter of the parameters and a state as XLA's compiled update holds them.

The algorithm is described in the repository's ``docs/design.md`` (sections 3.1 to 3.5, 3.8,
3.9).
"""

from triaccel_jax.transforms._alias import scale_by_curvature
from triaccel_jax.transforms._alias import scale_by_triaccel
from triaccel_jax.transforms._alias import triaccel
from triaccel_jax.transforms._compression import CompressedDiagonal
from triaccel_jax.transforms._compression import block_counts
from triaccel_jax.transforms._compression import compress_diagonal
from triaccel_jax.transforms._compression import expand_diagonal
from triaccel_jax.transforms._compression import uses_channel_pairs
from triaccel_jax.transforms._compression_grouped import CurvatureStores
from triaccel_jax.transforms._config import TriAccelConfig
from triaccel_jax.transforms._estimators import HutchinsonDiagonalState
from triaccel_jax.transforms._estimators import fisher_diagonal
from triaccel_jax.transforms._estimators import hutchinson_diagonal
from triaccel_jax.transforms._estimators import unmask
from triaccel_jax.transforms._fused_apply import FusedApply
from triaccel_jax.transforms._fused_apply import FusedTriAccel
from triaccel_jax.transforms._fused_apply import fused_apply
from triaccel_jax.transforms._fused_apply import fused_triaccel
from triaccel_jax.transforms._fused_apply import unfused_reason
from triaccel_jax.transforms._fused_apply import uses_triton
from triaccel_jax.transforms._loss_scaling import DynamicLossScaleState
from triaccel_jax.transforms._loss_scaling import LossScaleState
from triaccel_jax.transforms._loss_scaling import LossScaling
from triaccel_jax.transforms._loss_scaling import all_finite
from triaccel_jax.transforms._loss_scaling import dynamic_loss_scale
from triaccel_jax.transforms._loss_scaling import holds_loss_scale
from triaccel_jax.transforms._loss_scaling import leaf_finite
from triaccel_jax.transforms._loss_scaling import loss_scale
from triaccel_jax.transforms._loss_scaling import needs_loss_scaling
from triaccel_jax.transforms._loss_scaling import select_tree
from triaccel_jax.transforms._loss_scaling import unscale
from triaccel_jax.transforms._muon import muon_dimension_numbers
from triaccel_jax.transforms._observer import AdamSignalsState
from triaccel_jax.transforms._observer import CurvatureSignalsState
from triaccel_jax.transforms._observer import curvature_signals
from triaccel_jax.transforms._observer import find_signal_states
from triaccel_jax.transforms._refresh import LeafSignals
from triaccel_jax.transforms._signals import mean_curvatures
from triaccel_jax.transforms._signals import signals
from triaccel_jax.transforms._state_conversion import convert_state
from triaccel_jax.transforms._state_precision import Bfloat16Leaf
from triaccel_jax.transforms._state_precision import CenteredState
from triaccel_jax.transforms._state_precision import FactoredLeaf
from triaccel_jax.transforms._state_precision import QuantizedLeaf
from triaccel_jax.transforms._state_precision import QuantizedState
from triaccel_jax.transforms._state_precision import StateBytes
from triaccel_jax.transforms._state_precision import compiled_state_bytes
from triaccel_jax.transforms._state_precision import dequantize_state
from triaccel_jax.transforms._state_precision import quantize_state
from triaccel_jax.transforms._state_precision import to_quantized_state

__all__ = (
    "AdamSignalsState",
    "Bfloat16Leaf",
    "CenteredState",
    "CompressedDiagonal",
    "CurvatureSignalsState",
    "CurvatureStores",
    "DynamicLossScaleState",
    "FactoredLeaf",
    "FusedApply",
    "FusedTriAccel",
    "HutchinsonDiagonalState",
    "LeafSignals",
    "LossScaleState",
    "LossScaling",
    "QuantizedLeaf",
    "QuantizedState",
    "StateBytes",
    "TriAccelConfig",
    "all_finite",
    "block_counts",
    "compiled_state_bytes",
    "compress_diagonal",
    "convert_state",
    "curvature_signals",
    "dequantize_state",
    "dynamic_loss_scale",
    "expand_diagonal",
    "find_signal_states",
    "fisher_diagonal",
    "fused_apply",
    "fused_triaccel",
    "holds_loss_scale",
    "hutchinson_diagonal",
    "leaf_finite",
    "loss_scale",
    "mean_curvatures",
    "muon_dimension_numbers",
    "needs_loss_scaling",
    "quantize_state",
    "scale_by_curvature",
    "scale_by_triaccel",
    "select_tree",
    "signals",
    "to_quantized_state",
    "triaccel",
    "unfused_reason",
    "unmask",
    "unscale",
    "uses_channel_pairs",
    "uses_triton",
)
