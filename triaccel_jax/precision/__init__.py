"""The precision stage: which dtype each leaf computes and keeps its state in, and the casts.

* formats and their unit roundoffs (``fp32``, ``bf16``, ``fp16``, ``fp8_e4m3``; fp8 compute
  copies are carried in bfloat16);
* :class:`PrecisionPolicy`, a plain, hashable map from leaf path to :class:`LeafPrecision`;
* :func:`plan_precision`, the planner: curvature-weighted rounding noise against a budget; it
  returns a :class:`PrecisionPlan` (the policy, and the hysteresis streaks to pass back next
  time);
* the casts: :func:`cast_params` (the compute copy), :func:`master_params`,
  :func:`stochastic_apply_updates` (stochastically rounded updates of low-precision masters);
* :func:`memory_report`, the training memory by component at the dtypes the step really holds.

See ``docs/design.md`` (sections 3.6, 3.7 and 7).
"""

from triaccel_jax.precision._casting import cast_params
from triaccel_jax.precision._casting import master_params
from triaccel_jax.precision._casting import stochastic_apply_updates
from triaccel_jax.precision._memory import MemoryReport
from triaccel_jax.precision._memory import memory_report
from triaccel_jax.precision._planner import plan_precision
from triaccel_jax.precision._policy import LeafPrecision
from triaccel_jax.precision._policy import PrecisionPlan
from triaccel_jax.precision._policy import PrecisionPolicy

__all__ = (
    "LeafPrecision",
    "MemoryReport",
    "PrecisionPlan",
    "PrecisionPolicy",
    "cast_params",
    "master_params",
    "memory_report",
    "plan_precision",
    "stochastic_apply_updates",
)
