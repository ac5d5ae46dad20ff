"""Step records: everything a step depends on, kept whole so that a rollback restores a whole.

Under steps in flight (docs/design.md §8) a step is dispatched before the previous one is read,
and with asynchronous dispatch an out-of-memory error may surface only when a result is read.
The failed step and every step queued behind it (which consumed its outputs) are then rolled
back and re-run on their same samples. That is only sound if the state they are rolled back to
is consistent: the optimizer state's moments are in the dtypes of the policy they were made
under, and the bucket is the one the step ran at. So the controller snapshots its whole training
state, policy and bucket included, into one :class:`TrainingRecord` before each dispatch, and a
rollback restores it as one value; a switch (grow, re-plan, ``set_policy``) taken after the
dispatch belongs to the steps after it and is undone with them.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import numpy as np

from triaccel_jax.controller import _events as events_lib


class TrainingRecord(NamedTuple):
    """What a step starts from: the training state and the choices in force.

    Attributes:
      params: the parameters.
      opt_state: the optimizer state (moments in ``plan``'s state dtypes).
      model_state: the non-trained state (e.g. BatchNorm statistics), or None.
      loss_scale: the dynamic loss scale's state.
      plan: the :class:`triaccel_jax.policy.PrecisionPlan` in force, or None.
      micro: the batch bucket in force.
      progress: the training progress before the step, in reference-batch steps (what a
        learning-rate schedule is evaluated at: :attr:`triaccel_jax.Controller.schedule_progress`).
    """

    params: Any
    opt_state: Any
    model_state: Any
    loss_scale: Any
    plan: Any
    micro: int
    progress: float


class PendingStep(NamedTuple):
    """A dispatched step whose metrics are not read yet.

    Attributes:
      step: the step's index (``step_count`` when it was dispatched).
      indices: the samples it trains (its place in the sampler's epoch).
      num_micro: micro-batches it was dispatched with.
      micro: the micro-batch it ran at.
      learning_rate: the injected learning rate it ran at (None when the rate is not an
        injected constant).
      update_scale: the factor its update was multiplied by (1 when the rate is injected).
      before: the :class:`TrainingRecord` it started from, restored by a rollback.
      metrics: its metrics, on the device (None for a step not dispatched).
      noise: its :class:`triaccel_jax.training.NoiseNorms`, on the device (None for a step not
        dispatched).
      first_event: the index of the first event logged for it.
    """

    step: int
    indices: np.ndarray
    num_micro: int
    micro: int
    learning_rate: float | None
    update_scale: float
    before: TrainingRecord
    metrics: Any
    noise: Any
    first_event: int


class InFlight:
    """The queued steps, and the :class:`StepInfo` of the steps read since last taken.

    Args:
      clock: the controller's clock (``Controller(clock=)``), read for the time the first
        step's seconds start from; default ``time.perf_counter``.

    Example:
      >>> from triaccel_jax.controller._step_records import InFlight
      >>> flight = InFlight()
      >>> len(flight.pending), flight.take_finished()
      (0, [])
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.pending: collections.deque[PendingStep] = collections.deque()
        self.finished: list[events_lib.StepInfo] = []
        self.last_finish = clock()
        self.delivered_events = 0  # events up to here went out with a StepInfo

    def take_finished(self) -> list[events_lib.StepInfo]:
        """The :class:`StepInfo` read since the last call, in step order."""
        finished, self.finished = self.finished, []
        return finished

    def event_span(self, step: PendingStep, num_events: int) -> tuple[int, int]:
        """The events that go out with ``step``'s :class:`StepInfo`: those not delivered yet, up
        to the next queued step's first (a re-run logs its events after those of the steps queued
        behind it, so none is lost or repeated)."""
        begin = max(step.first_event, self.delivered_events)
        end = self.pending[0].first_event if self.pending else num_events
        end = max(begin, end)
        self.delivered_events = end
        return begin, end
