"""Steps in flight: dispatch a step before reading the previous one's metrics (docs/design.md §8).

Reading a step's metrics with ``jax.device_get`` before dispatching the next leaves the device
idle while the host reads, decides and feeds; on a launch-bound model that is most of a step.
:func:`dispatch` queues a step and :func:`finish_oldest` reads the oldest queued one, so the
host's read of step ``n`` overlaps the device's run of step ``n + 1``. The guarantees of the
synchronous loop hold:

* with async dispatch an out-of-memory error may surface when a result is read, not when the step
  is dispatched. The state is not donated, so each queued step keeps its inputs: the failed step
  and every step queued after it (which consumed its outputs) are rolled back and re-run, in
  order, on their *same samples*, synchronously, through the usual retry;
* each step's :class:`StepInfo` reaches the callback and :meth:`Controller.run`, in order, a few
  steps late;
* the memory check and the re-plan read figures a step produces (the probe's peak, the last
  loss), so :func:`dispatch` reads every queued step first when one is due, as does
  :meth:`Controller.state_dict`.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any
from typing import NamedTuple

import jax
import numpy as np

from triaccel_jax.controller import _events as events_lib
from triaccel_jax.controller import _out_of_memory as out_of_memory
from triaccel_jax.controller import _step_runner as step_runner


class PendingStep(NamedTuple):
    """A dispatched step whose metrics are not read yet.

    Attributes:
      step: the step's index (``step_count`` when it was dispatched).
      indices: the samples it trains.
      attempt: ``"micro-batches x micro-batch"`` it was dispatched at.
      inputs: ``(params, opt_state, model_state, loss_scale)`` it started from, for a retry.
      metrics: its metrics, on the device.
      first_event: the index of the first event logged for it.
      plan: the precision plan it ran under: a rollback to ``inputs`` restores it too, since a
        switch taken after it was dispatched converted a state the rollback discards.
    """

    step: int
    indices: np.ndarray
    attempt: tuple[int, int]
    inputs: tuple[Any, Any, Any, Any]
    metrics: Any
    first_event: int
    plan: Any


class InFlight:
    """The controller's queued steps and the :class:`StepInfo` of those read since last asked."""

    def __init__(self) -> None:
        self.pending: collections.deque[PendingStep] = collections.deque()
        self.finished: list[events_lib.StepInfo] = []
        self.last_finish = time.perf_counter()
        self.delivered_events = 0  # events up to here went out with a StepInfo

    def take_finished(self) -> list[events_lib.StepInfo]:
        """The :class:`StepInfo` read since the last call, in step order."""
        finished, self.finished = self.finished, []
        return finished


def _state(controller: Any) -> tuple[Any, Any, Any, Any]:
    return controller.params, controller.opt_state, controller.model_state, controller.loss_scale


def _set_state(controller: Any, state: tuple[Any, Any, Any, Any]) -> None:
    controller.params, controller.opt_state, controller.model_state, controller.loss_scale = state


def dispatch(controller: Any) -> None:
    """Runs the due checks, draws the next step's samples and queues the step on the device.

    An out-of-memory error at dispatch reads every queued step, then runs this one through the
    synchronous retry (:func:`triaccel_jax.controller._step_runner.run_with_retry`).
    """
    controller._background.poll(controller)  # a grow whose compile is ready switches now
    flight, count = controller._in_flight, controller.step_count
    check_due = count > 0 and count % controller.config.check_every == 0
    replan_due = controller.config.replan_due(count)
    if check_due or replan_due:
        flush(controller)  # the checks read what the queued steps produce
    first_event = len(controller.events)
    start = time.perf_counter()
    if check_due:
        controller._check_memory()
    if replan_due:
        controller._replan()
    controller.timings["control"] += time.perf_counter() - start
    indices = controller.sampler.take(controller.batch_size)
    inputs, plan = _state(controller), controller.plan
    micro = controller._micro
    num_micro = controller._num_micro(micro)
    try:
        out = step_runner.dispatch_step(controller, indices, micro, num_micro)
    except jax.errors.JaxRuntimeError as error:
        if not out_of_memory.is_out_of_memory(error):
            raise
        flush(controller)
        tried = [f"{num_micro}x{micro}"]
        controller._on_out_of_memory(micro, tried, error)
        _rerun(
            controller,
            PendingStep(
                count, indices, (num_micro, micro), inputs, None, first_event, controller.plan
            ),
            last=True,
        )
        return
    for leaf in jax.tree.leaves(out.metrics):
        leaf.copy_to_host_async()  # the read a step later then finds the figures on the host
    _set_state(controller, (out.params, out.opt_state, out.model_state, out.loss_scale))
    controller.step_count += 1
    step = PendingStep(count, indices, (num_micro, micro), inputs, out.metrics, first_event, plan)
    flight.pending.append(step)


def finish_oldest(controller: Any) -> None:
    """Reads the oldest queued step; an out-of-memory error re-runs it and all queued after it."""
    flight = controller._in_flight
    oldest = flight.pending[0]
    start = time.perf_counter()
    try:
        metrics = controller._read_metrics(oldest.metrics)
    except jax.errors.JaxRuntimeError as error:
        controller.timings["step"] += time.perf_counter() - start
        if not out_of_memory.is_out_of_memory(error):
            raise
        queued = list(flight.pending)
        flight.pending.clear()
        _set_state(controller, oldest.inputs)
        controller.plan = oldest.plan  # the policy those inputs' moments are in
        controller.step_count = oldest.step
        num_micro, micro = oldest.attempt
        controller._on_out_of_memory(micro, [f"{num_micro}x{micro}"], error)
        for step in queued:
            _rerun(controller, step, last=step is queued[-1])
        return
    controller.timings["step"] += time.perf_counter() - start
    flight.pending.popleft()
    _deliver(controller, oldest, metrics, oldest.attempt[1])


def run_steps(controller: Any, num_steps: int, window: int) -> list[events_lib.StepInfo]:
    """Runs ``num_steps`` steps with up to ``window`` queued; returns their :class:`StepInfo`.

    Example:
      >>> import jax.numpy as jnp, numpy as np, triaccel_jax
      >>> x = np.ones((64, 2), np.float32)
      >>> controller = triaccel_jax.Controller(
      ...     lambda p, b, *, policy, rng: jnp.mean((b @ p - 1.0) ** 2),
      ...     jnp.zeros(2),
      ...     triaccel_jax.triaccel(0.05),
      ...     x,
      ...     min_batch=16,
      ...     max_batch=16,
      ...     probe=triaccel_jax.BudgetMemoryProbe(2**30),
      ... )
      >>> [info.step for info in run_steps(controller, 4, window=1)]
      [1, 2, 3, 4]
    """
    flush(controller)
    controller._in_flight.take_finished()
    for _ in range(num_steps):
        dispatch(controller)
        while len(controller._in_flight.pending) > window:
            finish_oldest(controller)
    flush(controller)
    return controller._in_flight.take_finished()


def flush(controller: Any) -> None:
    """Reads every queued step, oldest first."""
    while controller._in_flight.pending:
        finish_oldest(controller)


def _rerun(controller: Any, step: PendingStep, *, last: bool) -> None:
    """Re-runs ``step`` on its samples from the state it started from, synchronously.

    Each re-run trains at the rate of its own samples; after the ``last`` one the rate follows
    the batch in force for the steps to come (the retry shrank it), logged with that step.
    """
    controller.step_count = step.step
    metrics, micro = step_runner.run_with_retry(controller, step.indices)
    controller.step_count += 1
    if last:
        controller._set_learning_rate()
    _deliver(controller, step, metrics, micro)


def _deliver(controller: Any, step: PendingStep, metrics: dict[str, float], micro: int) -> None:
    """The bookkeeping of a step whose metrics are read: loss, rate, :class:`StepInfo`, callback."""
    flight = controller._in_flight
    if math.isfinite(metrics["loss"]):
        controller._last_loss = metrics["loss"]
    # A re-run logs its events after those of the steps queued behind it; each StepInfo takes
    # the events not yet delivered, up to the next queued step's, so none is lost or repeated.
    begin = max(step.first_event, flight.delivered_events)
    end = flight.pending[0].first_event if flight.pending else len(controller.events)
    end = max(begin, end)
    flight.delivered_events = end
    now = time.perf_counter()
    info = events_lib.StepInfo(
        step.step + 1,
        len(step.indices),
        micro,  # the micro-batch the step ran at, not the bucket in force when it is read
        metrics["loss"],
        metrics,
        controller._known_peaks().get(micro),
        controller._bucket.limit,
        tuple(controller.events[begin:end]),
        now - flight.last_finish,
    )
    flight.last_finish = now
    flight.finished.append(info)
    if controller._callback is not None:
        controller._callback(info)
