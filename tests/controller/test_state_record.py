"""The controller's saved-state codec: each annotation it reads, each refusal naming the field by
its dotted path, the envelope's version, and a round trip through JSON of random saved states."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Annotated

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from triaccel_jax.controller import AdaptiveBatches
from triaccel_jax.controller import BudgetMemoryProbe
from triaccel_jax.controller._adaptive_batches import AdaptiveBatchesState
from triaccel_jax.controller._controller import ControllerState
from triaccel_jax.controller._controller import LossScaleRecord
from triaccel_jax.controller._state_record import STATE_VERSION
from triaccel_jax.controller._state_record import AtLeast
from triaccel_jax.controller._state_record import decode
from triaccel_jax.controller._state_record import encode
from triaccel_jax.controller._state_record import from_state_dict
from triaccel_jax.controller._state_record import to_state_dict
from triaccel_jax.policy import PrecisionPolicy
from triaccel_jax.transforms import LossScaleState

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


def test_the_loss_scale_record_keeps_the_steps_dtypes():
    scale = LossScaleState(jnp.float32(512.0), jnp.int32(7), jnp.int32(2))
    record = decode(LossScaleRecord, _through_json(encode(LossScaleRecord.of(scale))), "loss_scale")
    chex.assert_trees_all_equal(record.loss_scale_state(), scale)
    chex.assert_trees_all_equal_dtypes(record.loss_scale_state(), scale)


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


def test_a_deep_field_of_the_controllers_state_is_named_from_the_top():
    data = _through_json(encode(_controller_state()))
    data["goodput"]["step_times"][1][4] = "slow"
    with pytest.raises(ValueError, match=r"controller state: `goodput\.step_times\[1\]\[4\]`"):
        decode(ControllerState, data, "")


def test_adaptive_batches_refuse_a_bad_field_by_its_path_and_keep_their_state():
    x = np.arange(64 * 2, dtype=np.float32).reshape(64, 2)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    batches = AdaptiveBatches(
        x, tx.init(jnp.zeros(2)), probe=BudgetMemoryProbe(2**30), batch_rule="memory"
    )
    for _, (_, _settings) in zip(range(3), batches, strict=False):
        batches.report({"loss": 1.0})
    before = batches.state_dict()
    saved = _through_json(before)
    saved["step"] = 0
    saved["goodput"]["clock"] = [10, True]
    with pytest.raises(ValueError, match=r"AdaptiveBatches state: `goodput\.clock\[1\]`"):
        batches.load_state_dict(saved)
    saved["goodput"]["clock"] = [10, 20]  # well typed, but decided after the samples read
    with pytest.raises(ValueError, match=r"`goodput\.clock` must be \[samples read"):
        batches.load_state_dict(saved)
    saved["goodput"]["clock"] = before["goodput"]["clock"]
    saved["put_back"] = [[]]
    with pytest.raises(ValueError, match="`put_back` must hold lists of sample indices"):
        batches.load_state_dict(saved)
    assert batches.state_dict() == before
    saved["put_back"] = []
    batches.load_state_dict(saved)
    assert batches.state_dict() == {**before, "step": 0}


def test_the_envelope_refuses_another_version_naming_both():
    state = to_state_dict(_controller_state(), {"seed": 0})
    with pytest.raises(ValueError, match=rf"version 7 is not supported.*version {STATE_VERSION}"):
        from_state_dict({**state, "version": 7}, {"seed": 0})
    fields = from_state_dict(_through_json(state), {"seed": 0})
    assert decode(ControllerState, fields, "") == _controller_state()


# -- random saved states ---------------------------------------------------------------------------


def _strategy(kind) -> st.SearchStrategy:
    """Values of ``kind`` (an annotation a saved state uses), within its bounds."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Annotated:
        (bound,) = args[1:]
        if args[0] is int:
            return st.integers(min_value=int(bound.low), max_value=2**40)
        if bound.finite:
            return st.floats(min_value=bound.low, allow_nan=False, allow_infinity=False)
        return st.floats(min_value=bound.low) | st.just(math.nan)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in args if a is not type(None)]
        return st.none() | _strategy(inner)
    if kind is int:
        return st.integers(min_value=-(2**40), max_value=2**40)
    if kind is float:
        return st.floats()
    if kind is bool:
        return st.booleans()
    if kind is str:
        return st.text(max_size=6)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_strategy(args[0]), max_size=3).map(tuple)
        return st.tuples(*(_strategy(a) for a in args))
    if origin is dict:
        keys = st.integers(-(2**20), 2**20) if args[0] is int else st.text(max_size=6)
        return st.dictionaries(keys, _strategy(args[1]), max_size=3)
    if kind is PrecisionPolicy:
        return st.sampled_from(POLICIES)
    hints = typing.get_type_hints(kind, include_extras=True)
    return st.builds(kind, **{f.name: _strategy(hints[f.name]) for f in dataclasses.fields(kind)})


def _controller_state() -> ControllerState:
    data = {
        "step": 12,
        "last_loss": 0.5,
        "loss_scale": {"scale": 1024.0, "good_steps": 3, "skipped_steps": 0},
        "sampler": {
            "format": "triaccel_jax.controller.ElasticSampler",
            "num_examples": 64,
            "seed": 0,
            "shuffle": True,
            "epoch": 2,
            "cursor": 8,
        },
        "compiled_peaks": {"none": {"8": 1000}},
        "bucket": {
            "micro_batch": 8,
            "ceiling": None,
            "grow_streak": 1,
            "shrink_streak": 0,
            "measured_peaks": {"8": 900},
            "limit_bytes": 4096,
        },
        "goodput": {
            "noise": [1.0, 2.0, 1.0, 4.0, 2.0, 1.0, 1.0, 64],
            "recent_noise": [[11, 1.0, 2.0, 1.0, 4.0, 2.0, 1.0, 1.0, 56]],
            "step_times": [[8, 1, "none", 30, 0.3, 0.003, 3], [16, 1, "none", 2, 0.05, 0.01, 1]],
            "last_key": [8, 1, "none"],
            "trial": None,
            "clock": [768, 512],
            "block": [2, 0.02],
        },
        "precision": {"policy": json.loads(POLICIES[0].to_json()), "pending": {"w": ["fp32", 1]}},
        "learning_rate": {
            "tuned_learning_rate": 0.1,
            "tuned_weight_decay": None,
            "factor": 1.0,
            "schedule_progress": 12.0,
        },
    }
    return decode(ControllerState, data, "")


@settings(max_examples=60)
@given(st.data())
def test_random_saved_states_round_trip_through_json(data):
    kind = data.draw(st.sampled_from([ControllerState, AdaptiveBatchesState]))
    state = data.draw(_strategy(kind))
    written = json.dumps(encode(state), sort_keys=True)
    back = decode(kind, json.loads(written), "")
    # NaN is not equal to itself: the JSON written again, which spells it out, is compared.
    assert json.dumps(encode(back), sort_keys=True) == written
