"""The control stage: the host-side loop that adapts batch size and precision while training.

:class:`Controller` orchestrates: it holds the state and writes the event log, and asks a part
with one job for each decision. The parts are pure functions of measured figures or small
classes, testable without a device; the public ones are exported here:

* settings: :class:`ControllerConfig` (the controller's keywords as one frozen, validated
  value) and :class:`BatchLayout` (the buckets it allows on a data-parallel width);
* batch buckets: :func:`bucket_sizes`, :func:`decide_bucket`, :func:`predict_peak`;
* memory: the probes (:class:`DeviceMemoryProbe`, :class:`BudgetMemoryProbe`,
  :class:`FakeMemoryProbe`, the :class:`MemoryProbe` protocol) and
  :func:`compiled_peak_bytes`;
* precision: :func:`replan` (signals -> planner -> optimizer state converted), the one re-plan
  step that the controller and hand-written loops share, returning a :class:`Replan`;
* the data: :class:`ElasticSampler` serves any batch size without dropping or repeating a
  sample;
* the log: :class:`Event` and :func:`event_records`; :class:`StepInfo` for progress callbacks;
  :class:`MetricWriterCallback` writes steps and events to a ``clu.metric_writers`` writer
  (TensorBoard; the ``clu`` extra), and every event also goes to the ``triaccel_jax.controller``
  logger (``_logging``);
* out-of-memory handling: :func:`is_out_of_memory`, :class:`OutOfMemoryError`.

Private modules hold the other parts: batch feeding and placement (``_feeding``), the compile
cache and compiled peaks (``_compile_cache``), compiling a step (``_step_compiler``), compiling a
bigger bucket in the background (``_background_compile``), running one (``_step_runner``),
keeping steps in flight (``_in_flight``), the periodic memory check (``_memory_check``), the bucket and its memory
figures (``_bucket_tracker``), learning-rate scaling (``_learning_rate``), the out-of-memory retry
(``_out_of_memory``), the state record (``_state_record``), the train step (``_train_step``) and
the Flax train-state bridge (``_train_state_bridge``).

See ``docs/design.md`` (section 5).
"""

from triaccel_jax.controller._buckets import BucketDecision
from triaccel_jax.controller._buckets import bucket_sizes
from triaccel_jax.controller._buckets import decide_bucket
from triaccel_jax.controller._buckets import predict_peak
from triaccel_jax.controller._config import BatchLayout
from triaccel_jax.controller._config import ControllerConfig
from triaccel_jax.controller._controller import Controller
from triaccel_jax.controller._events import Event
from triaccel_jax.controller._events import StepInfo
from triaccel_jax.controller._events import event_records
from triaccel_jax.controller._memory_probe import BudgetMemoryProbe
from triaccel_jax.controller._memory_probe import DeviceMemoryProbe
from triaccel_jax.controller._memory_probe import FakeMemoryProbe
from triaccel_jax.controller._memory_probe import MemoryProbe
from triaccel_jax.controller._memory_probe import MemoryReading
from triaccel_jax.controller._memory_probe import compiled_peak_bytes
from triaccel_jax.controller._memory_probe import default_memory_probe
from triaccel_jax.controller._metric_writer import MetricWriterCallback
from triaccel_jax.controller._out_of_memory import OutOfMemoryError
from triaccel_jax.controller._out_of_memory import is_out_of_memory
from triaccel_jax.controller._replan import Replan
from triaccel_jax.controller._replan import replan
from triaccel_jax.controller._sampler import ElasticSampler

__all__ = (
    "BatchLayout",
    "BucketDecision",
    "BudgetMemoryProbe",
    "Controller",
    "ControllerConfig",
    "DeviceMemoryProbe",
    "ElasticSampler",
    "Event",
    "FakeMemoryProbe",
    "MemoryProbe",
    "MemoryReading",
    "MetricWriterCallback",
    "OutOfMemoryError",
    "Replan",
    "StepInfo",
    "bucket_sizes",
    "compiled_peak_bytes",
    "decide_bucket",
    "default_memory_probe",
    "event_records",
    "is_out_of_memory",
    "predict_peak",
    "replan",
)
