"""ElasticSampler: every sample once per epoch whatever the batch sizes, and a resumable cursor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from triaccel_jax.controller import ElasticSampler


def test_changing_batch_sizes_neither_drop_nor_repeat_samples():
    sampler = ElasticSampler(1000, seed=3)
    sizes = np.random.default_rng(0).choice([1, 7, 16, 64, 128, 333], size=200)
    drawn = np.concatenate([sampler.take(int(n)) for n in sizes])
    epochs = len(drawn) // 1000
    for epoch in range(epochs):
        chunk = drawn[epoch * 1000 : (epoch + 1) * 1000]
        np.testing.assert_array_equal(np.sort(chunk), np.arange(1000))
        np.testing.assert_array_equal(chunk, sampler.order(epoch))
    assert sampler.samples_seen == len(drawn)


def test_epochs_have_different_deterministic_permutations():
    a, b = ElasticSampler(50, seed=1), ElasticSampler(50, seed=1)
    np.testing.assert_array_equal(a.take(120), b.take(120))
    assert not np.array_equal(a.order(0), a.order(1))
    assert not np.array_equal(a.order(0), ElasticSampler(50, seed=2).order(0))
    np.testing.assert_array_equal(ElasticSampler(5, shuffle=False).take(7), [0, 1, 2, 3, 4, 0, 1])


def test_state_round_trip_through_json_continues_the_same_stream():
    sampler = ElasticSampler(100, seed=7)
    sampler.take(64)
    sampler.take(64)  # crosses into epoch 1
    saved = json.loads(json.dumps(sampler.state_dict()))
    expected = sampler.take(50)
    restored = ElasticSampler(100, seed=7)
    restored.load_state_dict(saved)
    assert (restored.epoch, restored.cursor) == (1, 28)
    np.testing.assert_array_equal(restored.take(50), expected)


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ("nonsense", "not a sampler state"),
        (
            {"format": "triaccel_jax.controller.ElasticSampler", "num_examples": 99, "seed": 7},
            "num_examples",
        ),
        (
            {"format": "triaccel_jax.controller.ElasticSampler", "num_examples": 100, "seed": 8},
            "seed",
        ),
    ],
)
def test_load_rejects_a_foreign_state(state, message):
    with pytest.raises(ValueError, match=message):
        ElasticSampler(100, seed=7).load_state_dict(state)


def test_load_rejects_a_cursor_past_the_end():
    state = ElasticSampler(10).state_dict() | {"cursor": 10}
    with pytest.raises(ValueError, match="cursor 10 is past"):
        ElasticSampler(10).load_state_dict(state)


@pytest.mark.parametrize("size", [0, -1, 2.5, True])
def test_bad_sizes_are_rejected(size):
    with pytest.raises(ValueError, match="num_examples"):
        ElasticSampler(size)
    with pytest.raises(ValueError, match="batch_size"):
        ElasticSampler(10).take(size)
