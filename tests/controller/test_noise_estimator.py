"""The Hessian-weighted noise scale in the controller (noise_estimator="hessian")."""

from __future__ import annotations

import optax
import pytest
from controller_harness import BIG
from controller_harness import linear_probe

from triaccel_jax.controller import ControllerConfig
from triaccel_jax.controller._noise_scale import NoiseScaleEstimate
from triaccel_jax.controller._noise_scale import observe_noise


@pytest.mark.slow
def test_the_hessian_estimator_smooths_the_curvature_weighted_norms(make_controller):
    settings = dict(min_batch=16, max_batch=16, probe=linear_probe(limit=BIG))
    weighted = make_controller(noise_estimator="hessian", **settings)
    infos = weighted.run(30)
    expected = NoiseScaleEstimate()
    horizon = weighted.config.noise_horizon_for(16)
    for info in infos:
        assert "curvature_grad_sq_norm" in info.metrics
        if info.metrics["curvature_micro_grad_sq_norm"] > 0:  # once curvature is estimated
            expected = observe_noise(
                expected,
                grad_sq_norm=info.metrics["curvature_grad_sq_norm"],
                sub_grad_sq_norm=info.metrics["curvature_micro_grad_sq_norm"],
                batch=16,
                sub_batch=8,  # one micro-batch of 16, split in two halves
                horizon=horizon,
            )
        assert info.noise_scale == expected.simple
    assert expected.simple is not None and expected.simple > 0
    plain = make_controller(**settings)
    plain_infos = plain.run(30)
    # Same data and seed: the plain estimate differs, since the curvature differs by layer.
    assert plain_infos[-1].noise_scale != pytest.approx(infos[-1].noise_scale, rel=0.01)


def test_the_hessian_estimator_needs_an_optimizer_that_holds_curvature(make_controller):
    with pytest.raises(ValueError, match="curvature"):
        make_controller(noise_estimator="hessian", tx=optax.sgd(0.1))


def test_adascale_takes_the_plain_variance():
    with pytest.raises(ValueError, match="adascale"):
        ControllerConfig(noise_estimator="hessian", lr_scaling="adascale")
    with pytest.raises(ValueError, match="noise_estimator"):
        ControllerConfig(noise_estimator="fisher")
