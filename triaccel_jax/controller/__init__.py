"""The control stage: the host-side loop that adapts batch size and precision while training.

:class:`Controller` runs the loop (the in-flight queue, the switches at step boundaries, the
rollback and retry) and composes the parts that decide; each part owns its state, private and
changed only by its methods, with a ``state_dict()`` of its own. Decisions are pure functions of
measured figures, testable without a device; the public ones are exported here:

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
* the saved state: :class:`ControllerCheckpoint`, what a checkpointer saves
  (:meth:`Controller.checkpoint_state`) and gives back (:meth:`Controller.restore`);
* the log: :class:`Event` and :func:`event_records`; :class:`StepInfo` for progress callbacks;
  :class:`MetricWriterCallback` writes steps and events to TensorBoard files
  (:class:`TensorBoardWriter`, the ``tensorboard`` extra) or any metric writer, and every event
  also goes to the ``triaccel_jax.controller`` logger;
* out of memory: :func:`is_out_of_memory`, :class:`OutOfMemoryError`, and fault injection for
  chaos-testing a run (:class:`OutOfMemoryFaults`, :class:`FaultSite`,
  :func:`simulated_out_of_memory`).

The private modules, one concept each (docs/design.md §5 has the map): ``_controller`` (the
object and its loop), ``_step_records`` (what a step depends on, restored whole by a rollback),
``_compiling`` (the compile cache, compiled peaks and the background worker), ``_buckets`` and
``_bucket_tracker`` (the bucket decision and the bucket's memory figures), ``_goodput`` and
``_goodput_tracker`` (the goodput choice, and the noise scale, throughput and streak it decides
from), ``_precision_speed`` and ``_precision_schedule`` (the verdict on a speed trial, and the
plan, trials and waiting re-plan), ``_out_of_memory`` (the retry rule and fault injection),
``_learning_rate`` (the learning rate's owner: tuned rate, batch rule, schedule clock),
``_replan``, ``_state_record`` (the saved state's envelope and its codec), ``_feeding``
(batches on the devices),
``_sampler``, ``_config``, ``_events``, ``_logging``, ``_metric_writer``, ``_memory_probe`` and
``_agreement`` (memory figures agreed across processes).
"""

from triaccel_jax.controller._adaptive_batches import AdaptiveBatches
from triaccel_jax.controller._adaptive_batches import StepSettings
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
from triaccel_jax.controller._memory_probe import default_memory_probe
from triaccel_jax.controller._metric_writer import MetricWriterCallback
from triaccel_jax.controller._metric_writer import TensorBoardWriter
from triaccel_jax.controller._out_of_memory import FaultSite
from triaccel_jax.controller._out_of_memory import OutOfMemoryError
from triaccel_jax.controller._out_of_memory import OutOfMemoryFaults
from triaccel_jax.controller._out_of_memory import is_out_of_memory
from triaccel_jax.controller._out_of_memory import simulated_out_of_memory
from triaccel_jax.controller._replan import Replan
from triaccel_jax.controller._replan import replan
from triaccel_jax.controller._sampler import ElasticSampler
from triaccel_jax.controller._sampler import SamplerState
from triaccel_jax.controller._state_record import ControllerCheckpoint

__all__ = (
    "AdaptiveBatches",
    "BatchLayout",
    "BucketDecision",
    "BudgetMemoryProbe",
    "Controller",
    "ControllerCheckpoint",
    "ControllerConfig",
    "DeviceMemoryProbe",
    "ElasticSampler",
    "Event",
    "FakeMemoryProbe",
    "FaultSite",
    "MemoryProbe",
    "MemoryReading",
    "MetricWriterCallback",
    "OutOfMemoryError",
    "OutOfMemoryFaults",
    "Replan",
    "SamplerState",
    "StepInfo",
    "StepSettings",
    "TensorBoardWriter",
    "bucket_sizes",
    "decide_bucket",
    "default_memory_probe",
    "event_records",
    "is_out_of_memory",
    "predict_peak",
    "replan",
    "simulated_out_of_memory",
)
