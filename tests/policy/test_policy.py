"""PrecisionPolicy: constructors, hashing, JSON, tables, and errors that name the problem."""

from __future__ import annotations

import json
import pickle

import jax.numpy as jnp
import pytest

from triaccel_jax.policy import LeafPrecision
from triaccel_jax.policy import PrecisionPolicy
from triaccel_jax.policy import _dtypes as dtypes
from triaccel_jax.policy import pending_from_document

PARAMS = {
    "encoder": {"kernel": jnp.ones((16, 16)), "bias": jnp.zeros(16)},
    "head": {"kernel": jnp.ones((16, 4))},
    "step": jnp.array(0, jnp.int32),
}


def test_uniform_covers_trainable_leaves_only():
    policy = PrecisionPolicy.uniform(PARAMS, "bf16", "bf16")
    assert list(policy) == ["encoder/bias", "encoder/kernel", "head/kernel"]
    assert {policy[p] for p in policy} == {LeafPrecision("bf16", "bf16")}


def test_patterns_first_match_wins_and_default_applies():
    policy = PrecisionPolicy.from_patterns(
        PARAMS, {"head/*": ("fp32", "fp32"), "*/kernel": "fp16"}, default="bf16"
    )
    assert policy["head/kernel"] == LeafPrecision("fp32", "fp32")
    assert policy["encoder/kernel"] == LeafPrecision("fp16", "fp32")
    assert policy["encoder/bias"] == LeafPrecision("bf16", "fp32")


def test_hash_and_equality_ignore_reasons():
    a = PrecisionPolicy.uniform(PARAMS, "bf16")
    b = PrecisionPolicy(a.leaves, reasons={"head/kernel": "because"})
    assert a == b and hash(a) == hash(b) and a.signature == b.signature
    assert {a: 1}[b] == 1
    c = a.replace(**{"head/kernel": "fp32"})
    assert c != a and c.signature != a.signature


def test_json_round_trip_keeps_leaves_and_reasons():
    policy = PrecisionPolicy(
        PrecisionPolicy.uniform(PARAMS, "fp16").leaves, reasons={"head/kernel": "why"}
    )
    again = PrecisionPolicy.from_json(policy.to_json())
    assert again == policy
    assert again.reasons == policy.reasons


def test_json_holding_an_entry_to_json_never_writes_is_refused():
    # The planner's streaks belong to a PrecisionPlan, never to the policy's document.
    document = json.loads(PrecisionPolicy.uniform(PARAMS, "bf16").to_json())
    document["pending"] = {"encoder/kernel": ["fp32", 1]}
    with pytest.raises(ValueError, match=r"not a precision policy: unknown entries \['pending'\]"):
        PrecisionPolicy.from_json(json.dumps(document))


def test_pending_streaks_are_read_from_their_own_entry():
    document = {"pending": {"encoder/kernel": ["fp32", 1]}}
    assert pending_from_document(document) == {"encoder/kernel": ("fp32", 1)}
    assert pending_from_document({}) == {}
    with pytest.raises(ValueError, match=r"'pending' must map paths to \[compute dtype, count\]"):
        pending_from_document({"pending": {"w": "bf16"}})


def test_lookup_by_path_uses_an_index():
    params = {f"layer{i}": {"kernel": jnp.ones((2, 2))} for i in range(2000)}
    policy = PrecisionPolicy.uniform(params, "bf16")
    assert policy["layer1999/kernel"] == ("bf16", "fp32")
    assert all(policy[path] == leaf for path, leaf in policy.leaves)
    with pytest.raises(KeyError, match="no leaf 'nope' in the policy; it has 2000 leaves"):
        policy["nope"]


def test_dtype_tree_matches_params():
    policy = PrecisionPolicy.from_patterns(PARAMS, {"*/kernel": ("bf16", "bf16")})
    compute = policy.dtype_tree(PARAMS)
    assert compute["encoder"]["kernel"] == jnp.bfloat16
    assert compute["encoder"]["bias"] == jnp.float32
    assert compute["step"] is None
    assert policy.dtype_tree(PARAMS, "state")["head"]["kernel"] == jnp.bfloat16


def test_table_is_readable():
    text = str(PrecisionPolicy.uniform(PARAMS, "bf16"))
    assert text.splitlines()[0].split() == ["leaf", "compute", "state", "reason"]
    assert "encoder/kernel" in text and "bf16" in text
    assert "3 bf16" in repr(PrecisionPolicy.uniform(PARAMS, "bf16"))


@pytest.mark.parametrize("name", ["fp64", "int8", "float", "bfloat"])
def test_unknown_dtype_name(name):
    with pytest.raises(ValueError, match=rf"unknown compute dtype '{name}'.*valid: fp32, bf16"):
        PrecisionPolicy.uniform(PARAMS, name)


def test_state_dtype_below_bf16_is_refused():
    with pytest.raises(ValueError, match="unknown state dtype 'fp16'"):
        PrecisionPolicy.uniform(PARAMS, "bf16", "fp16")


def test_mismatched_tree_names_the_paths():
    policy = PrecisionPolicy.uniform(PARAMS, "bf16")
    other = {**PARAMS, "extra": {"kernel": jnp.ones(3)}}
    with pytest.raises(ValueError, match=r"extra/kernel"):
        policy.check_matches(other)
    with pytest.raises(ValueError, match=r"head/kernel"):
        policy.check_matches({"encoder": PARAMS["encoder"]})


def test_fp8_without_dtype_support_is_a_clear_error(monkeypatch):
    formats = {k: v for k, v in dtypes.FORMATS.items() if k != "fp8_e4m3"}
    monkeypatch.setattr(dtypes, "FORMATS", formats)
    with pytest.raises(ValueError, match=r"float8_e4m3fn.*does not provide"):
        PrecisionPolicy.uniform(PARAMS, "fp8_e4m3")


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (pickle.dumps({"leaves": {}}), "not UTF-8 JSON"),
        ("{not json", "invalid JSON"),
        ('{"leaves": {}}', "format"),
        ('{"format": "triaccel_jax.PrecisionPolicy", "version": 99, "leaves": {}}', "version 99"),
        ('{"format": "triaccel_jax.PrecisionPolicy", "version": 1, "leaves": {"a": 1}}', "leaves"),
    ],
)
def test_from_json_rejects_what_is_not_a_policy(payload, message):
    with pytest.raises(ValueError, match=message):
        PrecisionPolicy.from_json(payload)
