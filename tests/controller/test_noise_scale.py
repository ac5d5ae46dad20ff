"""The per-sample noise scale with its interval (controller/_noise_scale.py)."""

import math

import numpy as np
import pytest

from triaccel_jax.controller._noise_scale import NoiseScaleEstimate
from triaccel_jax.controller._noise_scale import observe_noise


def _simulated_norms(rng, grad, sigma, batch, sub_batch):
    """The two squared norms of a step whose sub-gradients have per-sample noise ``sigma``."""
    k = batch // sub_batch
    subs = grad + rng.standard_normal((k, grad.size)) * sigma / math.sqrt(sub_batch)
    return float(np.sum(subs.mean(0) ** 2)), float(np.mean(np.sum(subs**2, axis=1)))


def test_exact_norms_give_the_noise_scale_and_a_zero_width_interval():
    state = NoiseScaleEstimate()
    for _ in range(4):
        state = observe_noise(
            state, grad_sq_norm=3.0, sub_grad_sq_norm=9.0, batch=32, sub_batch=8, horizon=1e4
        )
    assert state.simple == pytest.approx(64.0)
    low, high = state.interval()
    assert low == pytest.approx(64.0) and high == pytest.approx(64.0)


def test_memory_is_counted_in_samples_not_steps():
    small, large = NoiseScaleEstimate(), NoiseScaleEstimate()
    for _ in range(64):
        small = observe_noise(
            small, grad_sq_norm=3.0, sub_grad_sq_norm=9.0, batch=16, sub_batch=8, horizon=2048
        )
    for _ in range(16):
        large = observe_noise(
            large, grad_sq_norm=3.0, sub_grad_sq_norm=9.0, batch=64, sub_batch=8, horizon=2048
        )
    assert small.samples == large.samples == 1024
    assert small.weight == pytest.approx(large.weight)
    assert small.weight == pytest.approx(1 - math.exp(-1024 / 2048))
    assert large.effective_count < small.effective_count  # fewer, heavier estimates


def test_the_interval_covers_the_true_noise_scale_on_simulated_gradients():
    dim, sigma = 50, 1.0
    grad = np.full(dim, 0.2)
    truth = dim * sigma**2 / float(grad @ grad)  # tr(Sigma) / |G|^2 = 25
    covered, trials = 0, 100
    for seed in range(trials):
        rng = np.random.default_rng(seed)
        state = NoiseScaleEstimate()
        for _ in range(60):
            full, sub = _simulated_norms(rng, grad, sigma, 32, 8)
            state = observe_noise(
                state, grad_sq_norm=full, sub_grad_sq_norm=sub, batch=32, sub_batch=8, horizon=1e5
            )
        low, high = state.interval()
        covered += low <= truth <= high
    assert covered >= 85


def test_the_ratio_of_means_resists_a_near_zero_gradient_estimate():
    rng = np.random.default_rng(1)
    grad = np.full(50, 0.2)
    state = NoiseScaleEstimate()
    for _ in range(50):
        full, sub = _simulated_norms(rng, grad, 1.0, 32, 8)
        state = observe_noise(
            state, grad_sq_norm=full, sub_grad_sq_norm=sub, batch=32, sub_batch=8, horizon=1e4
        )
    before = state.simple
    # One step whose |G|^2 estimate is about 0 (its own ratio would be enormous).
    spike = observe_noise(
        state, grad_sq_norm=2.0, sub_grad_sq_norm=8.0, batch=32, sub_batch=8, horizon=1e4
    )
    assert spike.simple == pytest.approx(before, rel=0.1)


def test_a_step_without_an_estimate_changes_nothing():
    state = observe_noise(
        NoiseScaleEstimate(),
        grad_sq_norm=3.0,
        sub_grad_sq_norm=9.0,
        batch=32,
        sub_batch=8,
        horizon=1e4,
    )
    assert (
        observe_noise(
            state, grad_sq_norm=1.0, sub_grad_sq_norm=1.0, batch=32, sub_batch=32, horizon=1e4
        )
        is state
    )
    assert (
        observe_noise(
            state, grad_sq_norm=math.nan, sub_grad_sq_norm=9.0, batch=32, sub_batch=8, horizon=1e4
        )
        is state
    )
    assert NoiseScaleEstimate().simple is None and state.interval() is None


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="sub_batch"):
        observe_noise(
            NoiseScaleEstimate(),
            grad_sq_norm=1.0,
            sub_grad_sq_norm=2.0,
            batch=32,
            sub_batch=5,
            horizon=1e4,
        )
    with pytest.raises(ValueError, match="horizon"):
        observe_noise(
            NoiseScaleEstimate(),
            grad_sq_norm=1.0,
            sub_grad_sq_norm=2.0,
            batch=32,
            sub_batch=8,
            horizon=0.0,
        )
