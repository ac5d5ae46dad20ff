"""The controller's decisions through Python's :mod:`logging`, beside the event log.

Every :class:`triaccel_jax.controller.Event` the controller records is also logged to the
``triaccel_jax.controller`` logger, so a training script sees re-plans, bucket changes, compiles
and out-of-memory retries with nothing more than ``logging.basicConfig(level=logging.INFO)``.
Levels:

* ``WARNING``: an out-of-memory retry (``"oom"``): a step failed and is re-run smaller.
* ``INFO``: every other decision (start, grow, shrink, reject, replan, learning rate, compile,
  restore, a background compile decided).
* ``DEBUG``: one line per step (batch, loss, loss scale, seconds): noise for most runs.

As the standard library advises for libraries, the only handler added is a
:class:`logging.NullHandler` on the package logger ``triaccel_jax``: where the application
configures no logging, nothing is printed (not even Python's last-resort ``WARNING`` output),
and the application decides where records go and at which level.

Each decision's record carries the :class:`Event` itself as ``record.event``, for handlers
that want the figures as data rather than text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

PACKAGE_LOGGER = "triaccel_jax"
logger = logging.getLogger(f"{PACKAGE_LOGGER}.controller")
logging.getLogger(PACKAGE_LOGGER).addHandler(logging.NullHandler())

# An out-of-memory retry is the one decision forced by a failure; the others are the controller
# working as designed, so they are INFO.
EVENT_LEVELS = {"oom": logging.WARNING}


def event_level(kind: str) -> int:
    """The logging level of an event of ``kind``.

    Args:
      kind: the event's kind (``"grow"``, ``"oom"``, ...).

    Returns:
      ``logging.WARNING`` for ``"oom"``, ``logging.INFO`` for every other kind.

    Example:
      >>> import logging
      >>> from triaccel_jax.controller._logging import event_level
      >>> logging.getLevelName(event_level("oom")), logging.getLevelName(event_level("grow"))
      ('WARNING', 'INFO')
    """
    return EVENT_LEVELS.get(kind, logging.INFO)


def log_event(event: Any) -> None:
    """Logs one :class:`triaccel_jax.controller.Event` to the ``triaccel_jax.controller`` logger.

    Args:
      event: the event; the record gets it as ``record.event``.

    Example:
      >>> import logging, sys
      >>> from triaccel_jax.controller import Event
      >>> from triaccel_jax.controller._logging import log_event, logger
      >>> handler = logging.StreamHandler(sys.stdout)
      >>> logger.addHandler(handler)
      >>> logger.setLevel(logging.INFO)
      >>> log_event(Event(3, "grow", 16, 32, "memory to spare", {"limit_bytes": 1000}))
      step 3: grow 16 -> 32 (memory to spare; limit_bytes=1000)
      >>> logger.removeHandler(handler)
      >>> logger.setLevel(logging.NOTSET)
    """
    level = event_level(event.kind)
    if not logger.isEnabledFor(level):  # formatting the figures is not free: skip it
        return
    figures = "".join(f"; {name}={value}" for name, value in event.figures.items())
    logger.log(
        level,
        "step %d: %s %s -> %s (%s%s)",
        event.step,
        event.kind,
        event.old,
        event.new,
        event.reason,
        figures,
        extra={"event": event},
    )


def log_step(info: Any) -> None:
    """Logs one :class:`triaccel_jax.controller.StepInfo` at ``DEBUG``.

    Args:
      info: the step's info; the record gets it as ``record.step_info``.

    Example:
      >>> import logging, sys
      >>> from triaccel_jax.controller import StepInfo
      >>> from triaccel_jax.controller._logging import log_step, logger
      >>> handler = logging.StreamHandler(sys.stdout)
      >>> logger.addHandler(handler)
      >>> logger.setLevel(logging.DEBUG)
      >>> info = StepInfo(5, 64, 32, 0.25, {"loss": 0.25, "loss_scale": 1.0}, None, None, (), 0.5)
      >>> log_step(info)
      step 5: batch 64 (micro-batch 32), loss 0.25, loss scale 1, 0.500 s
      >>> logger.removeHandler(handler)
      >>> logger.setLevel(logging.NOTSET)
    """
    if not logger.isEnabledFor(logging.DEBUG):
        return
    logger.debug(
        "step %d: batch %d (micro-batch %d), loss %.4g, loss scale %g, %.3f s",
        info.step,
        info.batch_size,
        info.micro_batch,
        info.loss,
        info.metrics.get("loss_scale", 1.0),
        info.seconds,
        extra={"step_info": info},
    )


def logging_callback(callback: Callable[[Any], None] | None) -> Callable[[Any], None]:
    """``callback`` preceded by :func:`log_step`: what the controller calls after each step.

    Args:
      callback: the user's progress callback, or None.

    Returns:
      A callable taking a :class:`triaccel_jax.controller.StepInfo`.

    Example:
      >>> from triaccel_jax.controller import StepInfo
      >>> from triaccel_jax.controller._logging import logging_callback
      >>> seen = []
      >>> logging_callback(seen.append)(StepInfo(1, 8, 8, 0.5, {"loss": 0.5}, None, None, (), 0.1))
      >>> [info.step for info in seen]
      [1]
    """

    def call(info: Any) -> None:
        log_step(info)
        if callback is not None:
            callback(info)

    return call
