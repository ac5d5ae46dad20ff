"""The step scale's bound: Tri-Accel's hard clip against the smooth (tanh in log) bound."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import triaccel_jax
from triaccel_jax.transforms._step_scale import bounded_scale

RATIOS = jnp.array([1e-4, 0.01, 0.1, 0.25, 0.9, 1.0, 1.1, 4.0, 10.0, 100.0, 1e4])


def scales(bound, alpha=0.5):
    # kappa_ref / kappa = RATIOS
    return np.asarray(
        bounded_scale(
            jnp.float32(1.0), 1.0 / RATIOS, alpha=alpha, min_scale=0.5, max_scale=2.0, bound=bound
        )
    )


def test_clip_sits_at_its_bounds_where_smooth_still_moves():
    clip, smooth = scales("clip"), scales("smooth")
    far = (RATIOS <= 0.1) | (RATIOS >= 10.0)
    assert set(clip[np.asarray(far)].tolist()) == {0.5, 2.0}
    # Smooth: strictly inside the bounds below the float32 saturation, strictly increasing.
    assert np.all(np.diff(smooth) > 0) and np.all((smooth > 0.5) & (smooth < 2.0))
    # At ratios 10 and 100 the clip gives 2 both times; the smooth bound tells them apart.
    assert smooth[RATIOS.tolist().index(100.0)] - smooth[RATIOS.tolist().index(10.0)] > 0.05


def test_both_bounds_agree_at_the_median_and_share_its_slope():
    for bound in ("clip", "smooth"):
        near = np.asarray(
            bounded_scale(
                jnp.float32(1.0),
                jnp.array([1.0, 1 / 1.001]),
                alpha=0.5,
                min_scale=0.5,
                max_scale=2.0,
                bound=bound,
            )
        )
        assert near[0] == 1.0
        # d s / d log(ratio) at the median is alpha for both.
        np.testing.assert_allclose((near[1] - 1.0) / np.log(1.001), 0.5, rtol=1e-2)


def test_alpha_zero_and_nan_give_one():
    assert set(scales("smooth", alpha=0.0).tolist()) == {1.0}
    nan = bounded_scale(
        jnp.float32(jnp.nan), jnp.float32(1.0), alpha=0.5, min_scale=0.5, max_scale=2.0,
        bound="smooth",
    )  # fmt: skip
    assert float(nan) == 1.0


@pytest.mark.parametrize("scale", ["leaf", "block"])
def test_the_optimizer_reports_smooth_scales_inside_the_bounds(scale):
    config = triaccel_jax.TriAccelConfig(bound="smooth", scale=scale, block_size=4)
    tx = triaccel_jax.triaccel(1e-2, config=config, curvature_every=1)
    params = {"sharp": jnp.ones((4, 4)), "mid": jnp.ones(8), "flat": jnp.ones(8)}
    grads = {"sharp": jnp.full((4, 4), 30.0), "mid": jnp.full(8, 1.0), "flat": jnp.full(8, 0.01)}
    _, state = tx.update(grads, tx.init(params), params)
    reported = {k: v["step_scale"] for k, v in triaccel_jax.signals(state).items()}
    assert 0.5 < reported["sharp"] < 0.6 and 1.9 < reported["flat"] < 2.0
    assert reported["mid"] == 1.0


def test_an_unknown_bound_is_refused_by_name():
    with pytest.raises(ValueError, match="bound"):
        triaccel_jax.TriAccelConfig(bound="soft")
