"""The controller's saved state: its envelope, the checkpoint it hands over, and the codec.

Each part that saves state defines what it saves as a frozen dataclass beside itself
(:class:`._bucket_tracker.BucketTrackerState`, :class:`._goodput_tracker.GoodputTrackerState`,
:class:`._precision_schedule.PrecisionScheduleState`, :class:`._learning_rate.LearningRateState`,
:class:`._sampler.SamplerState`), and :class:`._controller.ControllerState` holds the
controller's own fields and those. :func:`encode` writes such a dataclass as JSON-ready data and
:func:`decode` reads it back, checking every field against its annotation, so a malformed field
is refused with a message that names it by its dotted path (``goodput.step_times[3]``) before any
part takes anything. :func:`to_state_dict` puts the controller's fields in an envelope (format,
version, and the settings a state must share with the controller loading it), and
:func:`from_state_dict` checks the envelope: a resumed run takes the same decisions
(docs/design.md §5); params and optimizer state are saved beside it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

from triaccel_jax.policy import PrecisionPolicy

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


def to_state_dict(fields: Any, identity: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` (a saved state, :func:`encode`-d here) in the envelope, with ``identity``
    (seed, buckets, keep_global_batch).

    Example:
      >>> from triaccel_jax.controller._state_record import from_state_dict, to_state_dict
      >>> state = to_state_dict({"step": 3}, {"seed": 0})
      >>> state["format"], from_state_dict(state, {"seed": 0})
      ('triaccel_jax.Controller', {'step': 3})
    """
    return {"format": STATE_FORMAT, "version": STATE_VERSION, **identity, **encode(fields)}


def from_state_dict(state: Any, identity: Mapping[str, Any]) -> dict[str, Any]:
    """Checks :func:`to_state_dict`'s envelope and that it matches this controller's
    ``identity``; returns the fields inside it (the envelope's keys left out).

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
    envelope = {"format", "version", *identity}
    return {key: value for key, value in state.items() if key not in envelope}


# -- the codec --------------------------------------------------------------------------------------
# Written here rather than taken from a library: none of the project's dependencies reads JSON data
# back into annotated dataclasses (dacite, cattrs and pydantic are not among them), and the
# refusals must name the field by its dotted path and keep the controller's rules (a bool is not
# an int, an int is a float, NaN and infinities are numbers), which a general converter would
# each need configuring for.


@dataclasses.dataclass(frozen=True)
class AtLeast:
    """A bound on a saved number, written ``Annotated[int, AtLeast(0)]`` in a saved state.

    Attributes:
      low: the smallest value read.
      finite: whether NaN and the infinities are refused too (otherwise NaN passes the bound,
        as a comparison with it is false).

    Example:
      >>> from typing import Annotated
      >>> from triaccel_jax.controller._state_record import AtLeast, decode
      >>> decode(Annotated[int, AtLeast(1)], 3, "trial[0]")
      3
    """

    low: float
    finite: bool = False


def encode(value: Any) -> Any:
    """A saved state (a frozen dataclass of the kinds :func:`decode` reads) as JSON-ready data.

    Dataclasses become mappings of their fields, tuples lists, an int-keyed mapping's keys
    decimal strings and a :class:`PrecisionPolicy` its JSON document; numbers, strings, bools
    and None are kept.

    Args:
      value: a saved state, or any value one holds.

    Returns:
      Data that ``json.dumps`` writes and :func:`decode` reads back to an equal value.

    Example:
      >>> from triaccel_jax.controller._state_record import encode
      >>> encode({"measured_peaks": {16: 1000}, "trial": (8, 16), "ceiling": None})
      {'measured_peaks': {'16': 1000}, 'trial': [8, 16], 'ceiling': None}
    """
    if isinstance(value, PrecisionPolicy):  # a dataclass too, saved as its own document
        return json.loads(value.to_json())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [encode(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    return value


def decode(kind: Any, data: Any, path: str, *, what: str = "controller state") -> Any:
    """``data`` (JSON-ready, as :func:`encode` writes it) read as ``kind``, every field checked.

    ``kind`` is an annotation: ``int`` (a bool refused), ``float`` (an int taken; NaN and the
    infinities kept), ``bool``, ``str``, ``X | None``, ``tuple[X, ...]``, ``tuple[X, Y]``,
    ``dict[str, X]``, ``dict[int, X]`` (keys written as decimal strings), a
    :class:`PrecisionPolicy`, ``Annotated[X, AtLeast(...)]`` or a dataclass of these, whose
    fields must all be present and no other.

    Args:
      kind: the annotation to read ``data`` as.
      data: the saved data.
      path: the field's dotted path, named in the refusals (``"goodput"``).
      what: what the data is a state of, the start of each refusal.

    Returns:
      The value read (a tuple for a tuple annotation, a dict for a mapping).

    Raises:
      ValueError: a field is missing, unknown, of another type or out of its bounds; the
        message names it by its dotted path (``goodput.step_times[3]``).

    Example:
      >>> from triaccel_jax.controller._state_record import decode
      >>> decode(tuple[int, float], [3, 2], "block")
      (3, 2.0)
      >>> decode(tuple[int, float], [True, 2], "block")
      Traceback (most recent call last):
      ...
      ValueError: controller state: `block[0]` must be an integer, got True
    """

    def refuse(where: str, wanted: str, value: Any) -> ValueError:
        field = f": `{where}`" if where else ""
        return ValueError(f"{what}{field} must be {wanted}, got {value!r}")

    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Annotated:
        value = decode(args[0], data, path, what=what)
        for bound in args[1:]:
            if isinstance(bound, AtLeast) and (
                (bound.finite and not math.isfinite(value)) or value < bound.low
            ):
                finite = "finite and " if bound.finite else ""
                raise refuse(path, f"{finite}>= {bound.low:g}", data)
        return value
    if origin in (types.UnionType, typing.Union):
        options = [a for a in args if a is not type(None)]
        if len(options) != 1 or len(args) != 2:
            raise TypeError(f"decode reads only `X | None` unions, not {kind!r}")
        return None if data is None else decode(options[0], data, path, what=what)
    if kind is bool:
        if not isinstance(data, bool):
            raise refuse(path, "true or false", data)
        return data
    if kind is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise refuse(path, "an integer", data)
        return int(data)
    if kind is float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise refuse(path, "a number", data)
        return float(data)
    if kind is str:
        if not isinstance(data, str):
            raise refuse(path, "a string", data)
        return data
    if origin is tuple:
        if not isinstance(data, list | tuple):
            raise refuse(path, "a list", data)
        if len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],) * len(data)
        elif len(data) != len(args):
            raise refuse(path, f"a list of {len(args)}", data)
        return tuple(
            decode(a, v, f"{path}[{i}]", what=what)
            for i, (a, v) in enumerate(zip(args, data, strict=True))
        )
    if origin is dict:
        if not isinstance(data, Mapping) or not all(isinstance(k, str) for k in data):
            raise refuse(path, "a mapping with string keys", data)
        key_kind, value_kind = args
        read = {}
        for key, value in data.items():
            where = f"{path}[{key!r}]"
            if key_kind is int:
                if not _DECIMAL.fullmatch(key):
                    raise refuse(where, "keyed by an integer", key)
                read[int(key)] = decode(value_kind, value, where, what=what)
            else:
                read[key] = decode(value_kind, value, where, what=what)
        return read
    if kind is PrecisionPolicy:
        if not isinstance(data, Mapping):
            raise refuse(path, "a precision policy's JSON document", data)
        try:
            return PrecisionPolicy.from_json(json.dumps(data))
        except (TypeError, ValueError, KeyError) as error:
            raise ValueError(f"{what}: `{path}` is not a precision policy: {error}") from None
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        if not isinstance(data, Mapping):
            raise refuse(path, "a mapping", data)
        hints = typing.get_type_hints(kind, include_extras=True)
        names = [f.name for f in dataclasses.fields(kind)]
        prefix = f"{path}." if path else ""
        for name in names:
            if name not in data:
                raise ValueError(f"{what}: it has no {name!r} (`{prefix}{name}`)")
        unknown = sorted(str(k) for k in data if k not in names)
        if unknown:
            raise ValueError(
                f"{what}: `{prefix}{unknown[0]}` is not a field of {kind.__name__} "
                f"(its fields: {', '.join(names)})"
            )
        return kind(**{n: decode(hints[n], data[n], f"{prefix}{n}", what=what) for n in names})
    raise TypeError(f"decode cannot read {kind!r}")


_DECIMAL = re.compile(r"-?[0-9]+")
