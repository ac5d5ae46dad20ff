"""The fitted step-time model behind goodput's throughput (controller/_throughput.py)."""

import math

import numpy as np
import pytest

from triaccel_jax.controller._throughput import StepTimes
from triaccel_jax.controller._throughput import fit_step_time


def _timed(seconds_by_batch):
    times = {}
    for batch, seconds in seconds_by_batch.items():
        t = StepTimes()
        for s in seconds:
            t = t.add(float(s))
        times[batch] = t
    return times


def test_nothing_timed_gives_no_model():
    assert fit_step_time({}) is None
    assert fit_step_time({32: StepTimes()}) is None


def test_one_size_reads_its_own_samples_per_second_from_sums():
    # The sums, not a mean of per-step rates: one fast step (0.4 ms) does not inflate the figure.
    seconds = [0.010, 0.0004, 0.011, 0.009, 0.010]
    model = fit_step_time(_timed({16: seconds}))
    rate, spread = model.throughput(16)
    assert rate == pytest.approx(16 * len(seconds) / sum(seconds))
    mean_of_rates = np.mean([16 / s for s in seconds])
    assert mean_of_rates > 3 * rate  # what the old figure would have read
    assert spread > 0


def test_one_size_is_optimistic_and_says_it_is_a_guess():
    model = fit_step_time(_timed({16: [0.01] * 20}))
    assert model.sizes == 1
    rate16, spread16 = model.throughput(16)
    rate64, spread64 = model.throughput(64)
    assert rate64 == pytest.approx(4 * rate16)  # in proportion to the batch
    assert spread64 > 0.5 * rate64  # the guess is known to be one
    assert spread16 < 0.05 * rate16


def test_an_exact_line_is_recovered_and_throughput_predicted_between_and_beyond():
    times = _timed({b: [0.002 + 0.0003 * b] * 5 for b in (8, 32, 128)})
    model = fit_step_time(times)
    assert model.fixed == pytest.approx(0.002, rel=1e-6)
    assert model.per_sample == pytest.approx(0.0003, rel=1e-6)
    assert model.throughput(64)[0] == pytest.approx(64 / (0.002 + 0.0003 * 64), rel=1e-6)


def test_coefficients_stay_non_negative():
    falling = fit_step_time(_timed({8: [0.02] * 5, 64: [0.018] * 5}))
    assert falling.per_sample == 0.0
    assert falling.fixed == pytest.approx(0.019, rel=0.01)
    through_origin = fit_step_time(_timed({8: [0.008] * 5, 64: [0.070] * 5}))
    assert through_origin.fixed == 0.0 and through_origin.per_sample > 0


def test_noisy_times_give_intervals_that_cover_the_truth():
    rng = np.random.default_rng(0)
    fixed, per_sample = 0.004, 0.0002
    covered = 0
    trials = 200
    for _ in range(trials):
        seconds = {
            b: (fixed + per_sample * b) * (1 + 0.1 * rng.standard_normal(12)) for b in (16, 32, 64)
        }
        model = fit_step_time(_timed(seconds))
        truth = 128 / (fixed + per_sample * 128)
        rate, spread = model.throughput(128)
        covered += abs(rate - truth) <= 1.96 * spread
    assert 0.85 * trials <= covered <= trials


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_a_bad_step_time_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="seconds must be finite and >= 0"):
        StepTimes().add(bad)
