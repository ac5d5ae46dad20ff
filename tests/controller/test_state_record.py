"""The controller's saved-state codec: each annotation it reads, each refusal naming the field by
its dotted path."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Annotated

import jax.numpy as jnp
import pytest

from triaccel_jax.controller._state_record import AtLeast
from triaccel_jax.controller._state_record import decode
from triaccel_jax.controller._state_record import encode
from triaccel_jax.policy import PrecisionPolicy

POLICIES = (
    PrecisionPolicy.uniform({"w": jnp.ones((2, 2))}, "bf16"),
    PrecisionPolicy.uniform({"a": jnp.ones(3), "b": {"c": jnp.ones((2,))}}, "fp32"),
)


@dataclasses.dataclass(frozen=True)
class Inner:
    count: Annotated[int, AtLeast(0)]
    seconds: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str
    flag: bool
    rate: float | None
    peaks: dict[int, int]
    streaks: dict[str, tuple[str, int]]
    inner: Inner
    block: tuple[int, Annotated[float, AtLeast(0.0, finite=True)]]


OUTER = Outer(
    name="run",
    flag=True,
    rate=None,
    peaks={8: 100, 16: 220},
    streaks={"w": ("bf16", 2)},
    inner=Inner(3, (0.5, 1.0)),
    block=(2, 0.25),
)


def _through_json(data):
    return json.loads(json.dumps(data))


# -- each annotation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "data", "expected"),
    [
        (int, 3, 3),
        (int, -2, -2),
        (float, 1.5, 1.5),
        (float, 2, 2.0),  # an int is a float
        (bool, False, False),
        (str, "none", "none"),
        (int | None, None, None),
        (int | None, 4, 4),
        (tuple[int, ...], [], ()),
        (tuple[int, ...], [1, 2, 3], (1, 2, 3)),
        (tuple[int, str, float], [1, "a", 2], (1, "a", 2.0)),
        (dict[str, int], {"a": 1}, {"a": 1}),
        (dict[int, int], {"8": 1, "-1": 2}, {8: 1, -1: 2}),
        (dict[str, dict[int, int]], {"sig": {"16": 3}}, {"sig": {16: 3}}),
        (Annotated[int, AtLeast(1)], 1, 1),
        (Annotated[float, AtLeast(0.0)], math.inf, math.inf),
    ],
)
def test_each_annotation_reads_what_encode_writes(kind, data, expected):
    value = decode(kind, data, "field")
    assert value == expected and type(value) is type(expected)
    assert _through_json(encode(value)) == _through_json(data)


def test_a_float_field_keeps_nan_and_the_infinities_unless_bounded_finite():
    for value in (math.nan, math.inf, -math.inf):
        read = decode(float, _through_json(value), "last_loss")
        assert math.isnan(read) if math.isnan(value) else read == value
    assert math.isnan(decode(Annotated[float, AtLeast(0.0)], math.nan, "seconds"))
    with pytest.raises(ValueError, match=r"`block\[1\]` must be finite and >= 0, got nan"):
        decode(Annotated[float, AtLeast(0.0, finite=True)], math.nan, "block[1]")


def test_a_dataclass_round_trips_through_json():
    data = _through_json(encode(OUTER))
    assert data["peaks"] == {"8": 100, "16": 220} and data["inner"]["seconds"] == [0.5, 1.0]
    assert decode(Outer, data, "outer") == OUTER


def test_a_policy_is_saved_as_its_json_document():
    data = _through_json(encode(POLICIES[1]))
    assert data == json.loads(POLICIES[1].to_json())
    assert decode(PrecisionPolicy | None, data, "precision.policy") == POLICIES[1]


# -- each refusal names the field ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"flag": 1}, r"`outer\.flag` must be true or false, got 1"),
        ({"name": 3}, r"`outer\.name` must be a string, got 3"),
        ({"rate": "0.1"}, r"`outer\.rate` must be a number, got '0\.1'"),
        ({"rate": True}, r"`outer\.rate` must be a number, got True"),
        ({"peaks": {"8": True}}, r"`outer\.peaks\['8'\]` must be an integer, got True"),
        ({"peaks": {"8": 1.5}}, r"`outer\.peaks\['8'\]` must be an integer, got 1\.5"),
        ({"peaks": {"eight": 1}}, r"`outer\.peaks\['eight'\]` must be keyed by an integer"),
        ({"peaks": [1]}, r"`outer\.peaks` must be a mapping with string keys, got \[1\]"),
        ({"streaks": {"w": ["bf16"]}}, r"`outer\.streaks\['w'\]` must be a list of 2"),
        ({"inner": {"count": -1, "seconds": []}}, r"`outer\.inner\.count` must be >= 0, got -1"),
        ({"inner": {"count": 0, "seconds": [1, "x"]}}, r"`outer\.inner\.seconds\[1\]` must be a"),
        ({"inner": {"count": 0}}, r"has no 'seconds' \(`outer\.inner\.seconds`\)"),
        ({"inner": 3}, r"`outer\.inner` must be a mapping, got 3"),
        ({"block": [True, 0.0]}, r"`outer\.block\[0\]` must be an integer, got True"),
        ({"block": (1, -0.5)}, r"`outer\.block\[1\]` must be finite and >= 0, got -0\.5"),
        ({"block": 7}, r"`outer\.block` must be a list, got 7"),
    ],
)
def test_each_malformed_field_is_refused_by_its_dotted_path(change, message):
    with pytest.raises(ValueError, match=message):
        decode(Outer, {**encode(OUTER), **change}, "outer")


def test_a_missing_or_unknown_field_is_refused_by_name():
    data = encode(OUTER)
    with pytest.raises(ValueError, match=r"has no 'block' \(`outer\.block`\)"):
        decode(Outer, {k: v for k, v in data.items() if k != "block"}, "outer")
    with pytest.raises(ValueError, match=r"`outer\.extra` is not a field of Outer"):
        decode(Outer, {**data, "extra": 1}, "outer")
    with pytest.raises(ValueError, match=r"has no 'name' \(`name`\)"):
        decode(Outer, {}, "")  # at the top, the field alone
    with pytest.raises(ValueError, match=r"^controller state must be a mapping, got 'text'$"):
        decode(Outer, "text", "")


def test_a_malformed_policy_is_refused_by_its_path():
    with pytest.raises(ValueError, match=r"`precision\.policy` is not a precision policy"):
        decode(PrecisionPolicy, {"format": "other"}, "precision.policy")
