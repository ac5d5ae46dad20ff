"""The bucket rules as pure functions of the figures: growth, shrinking, hysteresis, ceilings."""

from __future__ import annotations

import pytest

from triaccel_jax.controller import bucket_sizes
from triaccel_jax.controller import decide_bucket
from triaccel_jax.controller import predict_peak

BUCKETS = (16, 32, 64, 128, 256)


def test_bucket_sizes_are_powers_of_two_times_the_data_parallel_size():
    assert bucket_sizes(1, 8) == (1, 2, 4, 8)
    assert bucket_sizes(20, 200, multiple=3) == (24, 48, 96, 192)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((64, 16), "min_batch.*<= `max_batch`"),
        ((0, 16), "min_batch"),
        ((-4, 16), "min_batch"),
        ((4, 16.0), "max_batch"),
        ((4, 16, 0), "multiple"),
        ((9, 15, 8), "no batch size"),
    ],
)
def test_bucket_sizes_reject_bad_ranges(args, message):
    with pytest.raises(ValueError, match=message):
        bucket_sizes(*args)


def test_predict_peak_interpolates_and_extrapolates_linearly():
    peaks = {16: 1_100, 64: 1_400}
    assert predict_peak(64, peaks) == 1_400
    assert predict_peak(32, peaks) == 1_200
    assert predict_peak(128, peaks) == 1_800
    # One known point: the fixed bytes do not grow with the batch.
    assert predict_peak(32, {16: 1_100}, fixed_bytes=1_000) == 1_200
    assert predict_peak(32, {}) is None


def test_grows_to_the_largest_bucket_predicted_to_fit_after_patience():
    peaks = {16: 200, 32: 300}  # 100 + 6.25 per sample
    first = decide_bucket(16, BUCKETS, peaks, 1000, patience=2)
    assert (first.bucket, first.kind, first.grow_streak) == (16, "keep", 1)
    second = decide_bucket(16, BUCKETS, peaks, 1000, patience=2, grow_streak=first.grow_streak)
    # 128 -> 900 > 850 does not fit the 85% target; 64 -> 500 does.
    assert (second.bucket, second.kind) == (64, "grow")


def test_ceiling_blocks_growth():
    peaks = {16: 200, 32: 300}
    decision = decide_bucket(16, BUCKETS, peaks, 10**6, patience=1, ceiling=64)
    assert decision.bucket == 32


def test_shrinks_over_the_high_water_mark_to_a_fitting_bucket():
    peaks = {16: 100, 32: 200, 64: 400, 128: 980}
    first = decide_bucket(128, BUCKETS, peaks, 1000, patience=2)
    assert (first.kind, first.shrink_streak) == ("keep", 1)
    second = decide_bucket(128, BUCKETS, peaks, 1000, patience=2, shrink_streak=1)
    assert (second.bucket, second.kind) == (64, "shrink")


def test_between_target_and_high_water_nothing_changes():
    peaks = {32: 900, 64: 1800}
    decision = decide_bucket(32, BUCKETS, peaks, 1000, patience=1)
    assert (decision.bucket, decision.kind) == (32, "keep")


def test_unknown_limit_keeps_the_bucket():
    assert decide_bucket(32, BUCKETS, {32: 10}, None).kind == "keep"


def test_noise_around_the_high_water_mark_changes_the_bucket_at_most_twice():
    import numpy as np

    rng = np.random.default_rng(0)
    bucket, grow, shrink, changes = 64, 0, 0, 0
    for _ in range(100):
        # The step at 64 peaks at 95% of the limit, +/-5%; smaller buckets scale linearly.
        peaks = {bucket: int(950 * bucket / 64 * (1 + rng.uniform(-0.05, 0.05)))}
        decision = decide_bucket(
            bucket, BUCKETS, peaks, 1000, grow_streak=grow, shrink_streak=shrink
        )
        grow, shrink = decision.grow_streak, decision.shrink_streak
        changes += decision.bucket != bucket
        bucket = decision.bucket
    assert changes <= 2


def test_a_grow_resets_the_streak_so_the_next_grow_waits_for_patience_again():
    # Hysteresis must hold after every move, not only the first: a grow starts a new streak.
    peaks = {8: 100, 16: 200}
    buckets = (8, 16, 32, 64)
    first = decide_bucket(8, buckets, peaks, 1000, patience=2, grow_streak=1, target=0.3)
    assert first.kind == "grow" and first.bucket == 16
    assert first.grow_streak == 0 and first.shrink_streak == 0
    # More memory became free right after: one check alone does not grow again.
    second = decide_bucket(16, buckets, peaks, 10_000, patience=2, grow_streak=first.grow_streak)
    assert second.kind == "keep" and second.grow_streak == 1
    third = decide_bucket(16, buckets, peaks, 10_000, patience=2, grow_streak=second.grow_streak)
    assert third.kind == "grow"
