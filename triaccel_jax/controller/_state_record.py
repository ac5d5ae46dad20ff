"""The controller's state record: what :meth:`Controller.state_dict` saves, as JSON-ready data.

A record holds the controller's own decisions and memory (bucket, ceiling, hysteresis streaks,
peaks, policy and the planner's pending streaks, loss scale, sampler cursor, the learning-rate
schedule's progress); params and optimizer state are saved beside it. Reading one checks that
it was written by a controller configured the same way, so a resumed run takes the same
decisions (docs/design.md §5).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from triaccel_jax.policy import PrecisionPolicy
from triaccel_jax.policy import pending_from_document
from triaccel_jax.transforms import LossScaleState

STATE_FORMAT = "triaccel_jax.Controller"
STATE_VERSION = 1


class ControllerRecord(NamedTuple):
    """The controller's state, decoded.

    Attributes:
      step: steps completed.
      micro_batch: the batch bucket.
      ceiling: the out-of-memory ceiling, or None.
      grow_streak, shrink_streak: the bucket hysteresis counters.
      measured_peaks: ``{bucket: bytes}`` the probe measured under the current policy.
      compiled_peaks: ``{policy signature: {bucket: bytes}}`` from XLA's analyses (as
        :meth:`CompileCache.peaks_record` writes them).
      limit_bytes: the memory limit at the last check, or None.
      last_loss: the last finite loss, or None.
      lr_factor: the learning-rate factor in force (saved for reading; it follows the bucket).
      tuned_learning_rate: the injected rate at the reference batch (None when the optimizer
        holds no injected constant rate); a resumed controller scales this one, not the scaled
        rate its optimizer state holds.
      loss_scale: the dynamic loss scale's state.
      policy: the precision policy, or None.
      pending: the planner's hysteresis streaks ``{path: (compute dtype, count)}``.
      sampler: the sampler's own state.
      noise_scale: the gradient noise scale's smoothed estimates ``(|G|^2, tr(Sigma),
        weight)`` (:class:`triaccel_jax.controller._goodput.NoiseScale`).
      schedule_progress: the training progress in reference-batch steps, that a learning-rate
        schedule is evaluated at (:attr:`triaccel_jax.Controller.schedule_progress`), >= 0.
      recent_noise: ``(step, |G|^2, tr(Sigma), weight)``: the smoothed estimates after each of
        the last steps read, in step order, that AdaScale's gain of the next steps comes from
        (:func:`triaccel_jax.controller._learning_rate.noise_before`).
    """

    step: int
    micro_batch: int
    ceiling: int | None
    grow_streak: int
    shrink_streak: int
    measured_peaks: dict[int, int]
    compiled_peaks: dict[str, dict[str, int]]
    limit_bytes: int | None
    last_loss: float | None
    lr_factor: float
    loss_scale: LossScaleState
    policy: PrecisionPolicy | None
    pending: dict[str, tuple[str, int]]
    sampler: Mapping[str, Any]
    tuned_learning_rate: float | None
    noise_scale: tuple[float, float, float]
    schedule_progress: float = 0.0
    recent_noise: tuple[tuple[int, float, float, float], ...] = ()


def to_state_dict(record: ControllerRecord, identity: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` as JSON-ready data, with ``identity`` (seed, buckets, keep_global_batch).

    Example:
      >>> from triaccel_jax.controller._state_record import ControllerRecord, to_state_dict
      >>> from triaccel_jax.transforms import LossScaling
      >>> record = ControllerRecord(
      ...     3,
      ...     16,
      ...     None,
      ...     0,
      ...     0,
      ...     {16: 900},
      ...     {},
      ...     1000,
      ...     0.5,
      ...     1.0,
      ...     LossScaling().init(),
      ...     None,
      ...     {},
      ...     {"epoch": 0},
      ...     None,
      ...     (0.0, 0.0, 0.0),
      ... )
      >>> to_state_dict(record, {"seed": 0})["measured_peaks"]
      {'16': 900}
    """
    data = record._asdict()
    data["measured_peaks"] = {str(b): v for b, v in record.measured_peaks.items()}
    data["policy"] = None if record.policy is None else json.loads(record.policy.to_json())
    data["pending"] = {p: list(v) for p, v in record.pending.items()}
    data["sampler"] = dict(record.sampler)
    data["noise_scale"] = list(record.noise_scale)
    data["schedule_progress"] = float(record.schedule_progress)
    data["recent_noise"] = [list(entry) for entry in record.recent_noise]
    data["loss_scale"] = {k: np.asarray(v).item() for k, v in record.loss_scale._asdict().items()}
    return {"format": STATE_FORMAT, "version": STATE_VERSION, **identity, **data}


def from_state_dict(state: Any, identity: Mapping[str, Any]) -> ControllerRecord:
    """Reads :func:`to_state_dict`'s output, checking it matches this controller's ``identity``.

    Raises:
      ValueError: the state is malformed or was saved by a controller configured differently.
    """
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a controller state: expected a mapping with format {STATE_FORMAT!r}")
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"controller state version {state.get('version')!r} is not supported")
    for key, mine in identity.items():
        if state.get(key) != mine:
            raise ValueError(
                f"the controller state was saved with {key}={state.get(key)!r}, this "
                f"controller has {key}={mine!r}"
            )
    if state["micro_batch"] not in identity.get("buckets", (state["micro_batch"],)):
        raise ValueError(f"saved micro_batch {state['micro_batch']!r} is not a bucket")
    document = state["policy"]
    policy = None
    if document is not None:
        policy = PrecisionPolicy.from_json(json.dumps(document))
    pending = pending_from_document({"pending": state["pending"]})
    ceiling = _optional(state["ceiling"], int, "ceiling")
    if ceiling is not None and ceiling not in identity.get("buckets", (ceiling,)):
        raise ValueError(f"controller state: ceiling {ceiling!r} is not a bucket")
    try:
        return ControllerRecord(
            step=int(state["step"]),
            micro_batch=int(state["micro_batch"]),
            ceiling=ceiling,
            grow_streak=int(state["grow_streak"]),
            shrink_streak=int(state["shrink_streak"]),
            measured_peaks={int(b): int(v) for b, v in state["measured_peaks"].items()},
            compiled_peaks={
                str(sig): {str(int(b)): int(v) for b, v in peaks.items()}
                for sig, peaks in dict(state["compiled_peaks"]).items()
            },
            limit_bytes=_optional(state["limit_bytes"], int, "limit_bytes"),
            last_loss=_optional(state["last_loss"], float, "last_loss"),
            lr_factor=float(state["lr_factor"]),
            loss_scale=_loss_scale(state["loss_scale"]),
            policy=policy,
            pending=pending,
            sampler=state["sampler"],
            tuned_learning_rate=_optional(
                state["tuned_learning_rate"], float, "tuned_learning_rate"
            ),
            noise_scale=_three_floats(state["noise_scale"], "noise_scale"),
            schedule_progress=_progress(state["schedule_progress"]),
            recent_noise=_recent_noise(state["recent_noise"]),
        )
    except KeyError as error:
        raise ValueError(f"not a controller state: it has no {error.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"not a controller state: {error}") from None


def _optional(value: Any, kind: type, name: str) -> Any:
    """``value`` as ``kind`` (None kept), or a ValueError naming the field."""
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"controller state: `{name}` must be a number or null, got {value!r}"
        ) from None


def _three_floats(value: Any, name: str) -> tuple[float, float, float]:
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise ValueError(f"controller state: `{name}` must hold 3 numbers, got {value!r}")
    return float(value[0]), float(value[1]), float(value[2])


def _progress(value: Any) -> float:
    """A saved schedule progress: a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"controller state: `schedule_progress` must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"controller state: `schedule_progress` must be finite and >= 0, got {value!r}"
        )
    return float(value)


def _recent_noise(value: Any) -> tuple[tuple[int, float, float, float], ...]:
    """Saved recent noise estimates: ``[step, |G|^2, tr(Sigma), weight]`` entries, the steps
    increasing."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"controller state: `recent_noise` must be a list, got {value!r}")
    entries: list[tuple[int, float, float, float]] = []
    for entry in value:
        if not isinstance(entry, list | tuple) or len(entry) != 4 or isinstance(entry[0], bool):
            raise ValueError(
                "controller state: each `recent_noise` entry must be [step, |G|^2, tr(Sigma), "
                f"weight], got {entry!r}"
            )
        step, grad_sq, trace, weight = int(entry[0]), *map(float, entry[1:])
        if step != entry[0] or (entries and step <= entries[-1][0]):
            raise ValueError(
                f"controller state: `recent_noise` steps must be increasing integers, got {value!r}"
            )
        entries.append((step, grad_sq, trace, weight))
    return tuple(entries)


def _loss_scale(record: Mapping[str, Any]) -> LossScaleState:
    return LossScaleState(
        jnp.float32(record["scale"]),
        jnp.int32(record["good_steps"]),
        jnp.int32(record["skipped_steps"]),
    )
