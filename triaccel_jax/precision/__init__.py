"""The precision stage: the planner that chooses a precision policy, and what it costs in memory.

The policy itself, the formats and the casts are ``triaccel_jax.policy``, below the optimizer;
this stage sits above the optimizer, whose signals it reads:

* :func:`plan_precision`, the planner (its settings as one value: :class:`PlannerConfig`): curvature-weighted rounding noise against a budget; it
  returns a :class:`triaccel_jax.policy.PrecisionPlan` (the policy, and the hysteresis streaks
  to pass back next time);
* :func:`memory_report`, the training memory by component at the dtypes the step really holds
  (a :class:`MemoryReport`), with :func:`compute_copy_dtype`, the dtype a compute copy is
  carried in;
* :func:`compiled_peak_bytes`, XLA's predicted peak of a compiled function, which the report and
  the controller's bucket decisions read, and :func:`step_peak_bytes`, your own step's peak at
  any batch size (``AdaptiveBatches(peak_bytes=...)``).

See ``docs/design.md`` (sections 3.6, 3.7 and 7).
"""

from triaccel_jax.precision._memory import MemoryReport
from triaccel_jax.precision._memory import compiled_peak_bytes
from triaccel_jax.precision._memory import compute_copy_dtype
from triaccel_jax.precision._memory import memory_report
from triaccel_jax.precision._memory import step_peak_bytes
from triaccel_jax.precision._planner import PlannerConfig
from triaccel_jax.precision._planner import plan_precision
from triaccel_jax.precision._state_formats import StateFormatPlan
from triaccel_jax.precision._state_formats import plan_state_formats

__all__ = (
    "MemoryReport",
    "PlannerConfig",
    "StateFormatPlan",
    "compiled_peak_bytes",
    "compute_copy_dtype",
    "memory_report",
    "plan_precision",
    "plan_state_formats",
    "step_peak_bytes",
)
