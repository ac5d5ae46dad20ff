"""The precision policy: which dtype each leaf computes and keeps its state in, and the casts.

The types every stage above shares, below both the optimizer (``triaccel_jax.transforms``) and
the planner (``triaccel_jax.precision``):

* formats and their unit roundoffs (``fp32``, ``bf16``, ``fp16``, ``fp8_e4m3``; fp8 compute
  copies are carried in bfloat16): :class:`FloatFormat`, :func:`float_format`,
  :func:`format_name`, :func:`carrier_dtype`, :func:`carried_itemsize`;
* :class:`PrecisionPolicy`, a plain, hashable map from leaf path to :class:`LeafPrecision`, and
  :class:`PrecisionPlan`, what the planner returns (the policy, and the hysteresis streaks to
  pass back next time); :func:`check_policy` checks what a caller passed;
* the formats optimizer state is stored in (float32, bfloat16, 8- and 4-bit codes), one
  registry that ``quantize_state``, the state planner and the policy read:
  :class:`StateFormat`, :data:`STATE_FORMATS`, :func:`state_format`,
  :func:`measure_error_variance`;
* the casts: :func:`cast_params` (the compute copy), :func:`master_params`,
  :func:`stochastic_apply_updates` (stochastically rounded updates of low-precision masters).

See ``docs/design.md`` (sections 3.6 and 7).
"""

from triaccel_jax.policy._casting import cast_by_path
from triaccel_jax.policy._casting import cast_params
from triaccel_jax.policy._casting import master_params
from triaccel_jax.policy._casting import stochastic_apply_updates
from triaccel_jax.policy._dtypes import STATE_NAMES
from triaccel_jax.policy._dtypes import FloatFormat
from triaccel_jax.policy._dtypes import carried_itemsize
from triaccel_jax.policy._dtypes import carrier_dtype
from triaccel_jax.policy._dtypes import float_format
from triaccel_jax.policy._dtypes import format_name
from triaccel_jax.policy._policy import LeafPrecision
from triaccel_jax.policy._policy import PrecisionPlan
from triaccel_jax.policy._policy import PrecisionPolicy
from triaccel_jax.policy._policy import check_policy
from triaccel_jax.policy._policy import pending_from_document
from triaccel_jax.policy._policy import trainable_paths
from triaccel_jax.policy._state_format import STATE_FORMATS
from triaccel_jax.policy._state_format import StateFormat
from triaccel_jax.policy._state_format import measure_error_variance
from triaccel_jax.policy._state_format import state_format

__all__ = (
    "STATE_FORMATS",
    "STATE_NAMES",
    "FloatFormat",
    "LeafPrecision",
    "PrecisionPlan",
    "PrecisionPolicy",
    "StateFormat",
    "carried_itemsize",
    "carrier_dtype",
    "cast_by_path",
    "cast_params",
    "check_policy",
    "float_format",
    "format_name",
    "master_params",
    "measure_error_variance",
    "pending_from_document",
    "state_format",
    "stochastic_apply_updates",
    "trainable_paths",
)
