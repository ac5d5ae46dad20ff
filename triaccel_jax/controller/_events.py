"""The controller's event log: one record per decision (docs/design.md §5), for timelines and audits.

Also :class:`StepInfo`, what one step did (its events included), as a progress callback gets it.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import numpy as np


class Event(NamedTuple):
    """One controller decision.

    Attributes:
      step: the training step the decision was taken at (before that step ran).
      kind: what changed: ``"start"``, ``"grow"``, ``"shrink"``, ``"oom"``, ``"reject"``,
        ``"replan"``, ``"precision_trial"`` (a lower precision's timed trial judged: old is
        the trial policy's signature, new the one kept), ``"learning_rate"`` (old and new are
        the rates themselves), ``"update_scale"`` (the batch's factor on the update, where the
        rate is a schedule or not injected; both logged when a change of batch changes the
        rate, not for each move of AdaScale's gain: :class:`StepInfo` has every step's),
        ``"compile"``, ``"restore"``, ``"evaluate"`` (the metrics of :meth:`Controller.run`'s
        ``evaluate`` in the figures), or, with
        ``compile_in_background``, ``"grow_decided"`` and ``"replan_decided"`` (the step the
        change needs is compiling). Each is also logged (``triaccel_jax.controller`` logger:
        ``"oom"`` at WARNING, the others at INFO).
      old: the value before (a batch size, a policy signature, a learning rate, ...).
      new: the value after.
      reason: why, in words.
      figures: the numbers the decision was taken from (bytes, ratios, counts).
    """

    step: int
    kind: str
    old: Any
    new: Any
    reason: str
    figures: Mapping[str, Any]

    def as_record(self) -> dict[str, Any]:
        """A flat dict: the fields, with ``figures`` spread into ``figure_<name>`` keys."""
        record = {k: getattr(self, k) for k in ("step", "kind", "old", "new", "reason")}
        record.update({f"figure_{k}": v for k, v in self.figures.items()})
        return record


class StepInfo(NamedTuple):
    """What one controller step did, as passed to the progress callback.

    Attributes:
      step: the number of steps completed, this one included.
      batch_size: samples this step trained (the global batch; after an out-of-memory retry,
        the batch drawn before the bucket shrank).
      micro_batch: samples per micro-batch (the batch bucket after the step); when it is
        smaller than ``batch_size``, ``batch_size // micro_batch`` micro-batches were
        accumulated.
      loss: the step's mean loss.
      metrics: the step's mean metrics (``loss`` included), as Python floats, with
        ``skipped`` (1.0 when loss scaling found a non-finite gradient and the step changed
        nothing), ``loss_scale`` (the scale the loss was multiplied by, 1.0 unscaled),
        ``grad_sq_norm`` (the squared L2 norm of the step's averaged, unscaled gradient) and
        ``micro_grad_sq_norm`` (the mean over micro-batches of each one's squared gradient
        norm, equal to ``grad_sq_norm`` with one micro-batch): the ``|G_big|^2`` and
        ``|G_small|^2`` of a gradient-noise-scale estimate (McCandlish et al., 2018,
        "An Empirical Model of Large-Batch Training", appendix A).
      peak_bytes: the current bucket's peak bytes as last measured or compiled, or None.
      limit_bytes: the memory limit at the last check, or None.
      events: the events logged during this step.
      seconds: wall time of the step, compiles included.
      indices: the samples it trained (indices into the data), in batch order.
      learning_rate: the injected learning rate the step ran at (None when the rate is not an
        injected constant).
      update_scale: the factor the step's update was multiplied by (1.0 when the rate is
        injected; the batch rule's factor otherwise).
      noise_scale: the controller's smoothed gradient noise scale after this step
        (:attr:`Controller.noise_scale`), or None before any step of several micro-batches.
    """

    step: int
    batch_size: int
    micro_batch: int
    loss: float
    metrics: dict[str, float]
    peak_bytes: int | None
    limit_bytes: int | None
    events: tuple[Event, ...]
    seconds: float
    indices: np.ndarray | None = None
    learning_rate: float | None = None
    update_scale: float = 1.0
    noise_scale: float | None = None


def event_records(events: Iterable[Event]) -> list[dict[str, Any]]:
    """Events as flat dicts, ready for ``pandas.DataFrame(event_records(events))``.

    Example:
      >>> from triaccel_jax.controller import Event, event_records
      >>> event_records([Event(3, "grow", 16, 32, "fits", {"limit_bytes": 1000})])
      [{'step': 3, 'kind': 'grow', 'old': 16, 'new': 32, 'reason': 'fits', 'figure_limit_bytes': 1000}]
    """
    records = []
    for event in events:
        if not isinstance(event, Event):
            raise TypeError(
                f"event_records takes triaccel_jax.controller.Event objects, got {type(event).__name__}"
            )
        records.append(event.as_record())
    return records
