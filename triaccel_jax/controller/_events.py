"""The controller's event log: one record per decision (docs/design.md §5), for timelines and audits."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple


class Event(NamedTuple):
    """One controller decision.

    Attributes:
      step: the training step the decision was taken at (before that step ran).
      kind: what changed: ``"start"``, ``"grow"``, ``"shrink"``, ``"oom"``, ``"reject"``,
        ``"replan"``, ``"learning_rate"``, ``"compile"`` or ``"restore"``.
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
