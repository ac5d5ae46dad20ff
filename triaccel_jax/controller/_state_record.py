"""The controller's saved state: its envelope, the checkpoint it hands over, and field readers.

:meth:`Controller.state_dict` composes JSON-ready data from its own fields (step, last loss,
loss scale, the sampler's cursor, compiled peaks) and the ``state_dict()`` of each part that
decides (``"bucket"``: :class:`._bucket_tracker.BucketTracker`; ``"goodput"``:
:class:`._goodput_tracker.GoodputTracker`; ``"precision"``:
:class:`._precision_schedule.PrecisionSchedule`; ``"learning_rate"``:
:class:`._learning_rate.LearningRateScaling`); params and optimizer state are saved beside it.
Reading one checks that it was written by a controller configured the same way, so a resumed run
takes the same decisions (docs/design.md §5). Each part reads its own fields with the readers
here, so every malformed field is refused with a message that names it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from triaccel_jax.policy import PrecisionPolicy
from triaccel_jax.transforms import LossScaleState

STATE_FORMAT = "triaccel_jax.Controller"
# 2: each deciding part saves its own fields under its own key.
STATE_VERSION = 2


class ControllerCheckpoint(NamedTuple):
    """What a checkpointer saves of a controller (:meth:`Controller.checkpoint_state`).

    Attributes:
      step: steps completed (the checkpoint's step).
      arrays: ``{"params", "opt_state", "model_state"}``: the training state's arrays.
      policy: the precision policy in force, or None.
      state: the controller's own state, JSON-ready (:meth:`Controller.state_dict`).
    """

    step: int
    arrays: dict[str, Any]
    policy: PrecisionPolicy | None
    state: dict[str, Any]


def to_state_dict(fields: Mapping[str, Any], identity: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` (JSON-ready already) in the envelope, with ``identity`` (seed, buckets,
    keep_global_batch).

    Example:
      >>> from triaccel_jax.controller._state_record import from_state_dict, to_state_dict
      >>> state = to_state_dict({"step": 3}, {"seed": 0})
      >>> state["format"], from_state_dict(state, {"seed": 0})["step"]
      ('triaccel_jax.Controller', 3)
    """
    return {"format": STATE_FORMAT, "version": STATE_VERSION, **identity, **fields}


def from_state_dict(state: Any, identity: Mapping[str, Any]) -> Mapping[str, Any]:
    """Checks :func:`to_state_dict`'s envelope and that it matches this controller's
    ``identity``; returns the state for the parts to read their fields from.

    Raises:
      ValueError: the state is not a controller state, of another version, or was saved by a
        controller configured differently.
    """
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a controller state: expected a mapping with format {STATE_FORMAT!r}")
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"controller state version {state.get('version')!r} is not supported (this "
            f"controller reads version {STATE_VERSION}; save the run again with it)"
        )
    for key, mine in identity.items():
        if state.get(key) != mine:
            raise ValueError(
                f"the controller state was saved with {key}={state.get(key)!r}, this "
                f"controller has {key}={mine!r}"
            )
    return state


def fields(state: Any, part: str | None, names: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` checked to be a mapping holding every key of ``names`` (a part's
    ``state_dict()``, or any mapping with its keys).

    Raises:
      ValueError: ``state`` is not a mapping, or lacks a key (named).
    """
    where = "not a controller state" if part is None else f"controller state `{part}`"
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {state!r}")
    for name in names:
        if name not in state:
            raise ValueError(f"not a controller state: it has no {name!r}")
    return state


def integer(value: Any, name: str, low: int | None = None) -> int:
    """``value`` as an int (a bool or a fraction refused), at least ``low`` when given."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"controller state: `{name}` must be an integer, got {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"controller state: `{name}` must be an integer, got {value!r}") from None
    if not isinstance(value, str) and number != value:
        raise ValueError(f"controller state: `{name}` must be an integer, got {value!r}")
    if low is not None and number < low:
        raise ValueError(f"controller state: `{name}` must be >= {low}, got {value!r}")
    return number


def number(value: Any, name: str, *, finite_at_least: float | None = None) -> float:
    """``value`` as a float (a bool refused); with ``finite_at_least``, finite and at least it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"controller state: `{name}` must be a number, got {value!r}")
    if finite_at_least is not None and not (math.isfinite(value) and value >= finite_at_least):
        raise ValueError(
            f"controller state: `{name}` must be finite and >= {finite_at_least:g}, got {value!r}"
        )
    return float(value)


def optional(value: Any, kind: type, name: str) -> Any:
    """``value`` as ``kind`` (None kept), or a ValueError naming the field."""
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"controller state: `{name}` must be a number or null, got {value!r}"
        ) from None


def mapping(value: Any, name: str) -> Mapping[str, Any]:
    """``value``, checked to be a mapping."""
    if not isinstance(value, Mapping):
        raise ValueError(f"controller state: `{name}` must be a mapping, got {value!r}")
    return value


def loss_scale_document(state: LossScaleState) -> dict[str, Any]:
    """The dynamic loss scale's state as JSON-ready numbers."""
    return {k: np.asarray(v).item() for k, v in state._asdict().items()}


def loss_scale(document: Any) -> LossScaleState:
    """Reads :func:`loss_scale_document`'s output (the dtypes the step expects)."""
    document = fields(document, "loss_scale", dict.fromkeys(LossScaleState._fields))
    try:
        return LossScaleState(
            jnp.float32(document["scale"]),
            jnp.int32(document["good_steps"]),
            jnp.int32(document["skipped_steps"]),
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"controller state: `loss_scale` is malformed: {error}") from None
