"""Running one controller step: the due checks, the samples drawn, the compiled step and its retry.

An out-of-memory step changed nothing (the state is not donated), so it is re-run on the *same
samples* at the next smaller bucket until it fits (:mod:`._out_of_memory`); the samples drawn are
exactly the step's batch, so none is lost or repeated (docs/design.md §5).
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import numpy as np

from triaccel_jax.controller import _events as events_lib
from triaccel_jax.controller import _out_of_memory as out_of_memory


def run_step(controller: Any) -> events_lib.StepInfo:
    """Runs one step of ``controller`` (checks and re-plans first when they are due).

    Args:
      controller: the :class:`triaccel_jax.controller.Controller`.

    Returns:
      The step's :class:`triaccel_jax.controller.StepInfo`, also given to the callback.
    """
    timings = controller.timings
    start = time.perf_counter()
    spent_before = timings["step"] + timings["compile"] + timings["data"]
    first_event = len(controller.events)
    controller._background.poll(controller)  # a grow whose compile is ready switches now
    if controller.step_count > 0 and controller.step_count % controller.config.check_every == 0:
        controller._check_memory()
    if controller.config.replan_due(controller.step_count):
        controller._replan()
    indices = controller.sampler.take(controller.batch_size)
    metrics, micro = run_with_retry(controller, indices)
    controller.step_count += 1
    # The rate between steps is the next batch's (an out-of-memory retry may have shrunk it);
    # the step itself trained at the rate of its own samples.
    controller._set_learning_rate()
    # A non-finite loss is a step the loss scaling skipped: it changed nothing, and the
    # planner's relative budget needs a finite loss, so the last finite one is kept.
    if math.isfinite(metrics["loss"]):
        controller._last_loss = metrics["loss"]
    seconds = time.perf_counter() - start
    spent = timings["step"] + timings["compile"] + timings["data"] - spent_before
    timings["control"] += seconds - spent
    info = events_lib.StepInfo(
        controller.step_count,
        len(indices),  # the samples this step trained, also when an OOM shrank the bucket
        micro,  # the micro-batch it ran at, which an out-of-memory retry may have lowered
        metrics["loss"],
        metrics,
        controller._known_peaks().get(micro),
        controller._bucket.limit,
        tuple(controller.events[first_event:]),
        seconds,
    )
    if controller._callback is not None:
        controller._callback(info)
    return info


def run_with_retry(controller: Any, indices: np.ndarray) -> tuple[dict[str, float], int]:
    """Trains ``indices`` as one step, re-running them at smaller buckets while out of memory.

    Returns:
      The step's metrics as floats, and the micro-batch it ran at.

    Raises:
      OutOfMemoryError: the step ran out of memory at the smallest bucket.
    """
    tried = []
    timings = controller.timings
    while True:
        micro = controller._micro
        keep_global = controller._keep_global
        num_micro = controller._num_micro(micro) if keep_global else len(indices) // micro
        start = None  # the dispatch times itself; the read is timed here
        try:
            out = dispatch_step(controller, indices, micro, num_micro)
            start = time.perf_counter()
            metrics = controller._read_metrics(out.metrics)
        except jax.errors.JaxRuntimeError as error:
            if start is not None:
                timings["step"] += time.perf_counter() - start
            if not out_of_memory.is_out_of_memory(error):
                raise
            tried.append(f"{num_micro}x{micro}")
            controller._on_out_of_memory(micro, tried, error)
            continue
        # Replacing the state frees the previous step's buffers, as in any training loop,
        # so it is timed as part of the step, not as the controller's own work.
        controller.params, controller.opt_state, controller.model_state, controller.loss_scale = (
            out.params,
            out.opt_state,
            out.model_state,
            out.loss_scale,
        )
        timings["step"] += time.perf_counter() - start
        return metrics, micro


def dispatch_step(controller: Any, indices: np.ndarray, micro: int, num_micro: int) -> Any:
    """Gathers ``indices`` as ``num_micro`` x ``micro`` and dispatches the compiled step on them.

    Returns:
      The step's :class:`triaccel_jax.training.StepOutput`, on the device (JAX
      dispatches asynchronously: nothing waits for the step to run).

    Raises:
      jax.errors.JaxRuntimeError: XLA's error when the step fails at dispatch (e.g. out of memory).
    """
    controller._set_learning_rate(len(indices))  # the rate of the samples this step trains
    compiled = controller._compiled_step(micro, num_micro)
    start = time.perf_counter()
    batch = controller._feeder.device_batch(indices, num_micro, micro)
    controller.timings["data"] += time.perf_counter() - start
    start = time.perf_counter()
    try:
        return compiled(
            controller.params,
            controller.opt_state,
            controller.model_state,
            batch,
            np.int32(controller.step_count),
            np.float32(controller._lr.update_multiplier()),
            controller.loss_scale,
        )
    finally:
        controller.timings["step"] += time.perf_counter() - start


def read_metrics(metrics: Any) -> dict[str, float]:
    """The step's metrics as floats (a transfer that waits for the step to finish)."""
    return {k: float(v) for k, v in jax.device_get(metrics).items()}
