"""``scale_by_curvature``: Tri-Accel's per-leaf step scale over any direction.

The harness (tests/harness.py) runs the common checks on it over adamw; here: over Adam's
direction it is ``scale_by_triaccel``, over SGD and Muon it multiplies their steps by the scale
``signals()`` reports, ``alpha=0`` leaves the direction alone, and bad input is refused.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax

# optax's own directions promote on the integer leaf these params hold (and adam raises a float
# to its int32 count); the wrapper's own arithmetic runs under strict promotion in the harness.
pytestmark = pytest.mark.standard_promotion("optax's directions promote inside")

_CURVATURE = {"sharp": 20.0, "mid": 1.0, "flat": 0.05}


def make_params():
    keys = jax.random.split(jax.random.key(2), 3)
    return {
        "sharp": jax.random.normal(keys[0], (6, 5)),
        "mid": jax.random.normal(keys[1], (5, 4)),
        "flat": jax.random.normal(keys[2], (12,)),
        "count": jnp.int32(3),
    }


def loss(params):
    return sum(0.5 * c * jnp.sum(params[k] ** 2) for k, c in _CURVATURE.items())


def run(tx, steps=5):
    params = make_params()
    state = tx.init(params)
    history = []
    for _ in range(steps):
        grads = jax.grad(loss, allow_int=True)(params)
        grads["count"] = jnp.int32(0)
        updates, state = tx.update(grads, state, params, loss_fn=loss)
        history.append(updates)
        params = optax.apply_updates(params, updates)
    return history, state


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["fisher", "hutchinson"])
def test_over_adams_direction_it_is_scale_by_triaccel(estimator):
    config = triaccel_jax.TriAccelConfig(estimator=estimator, block_size=4)
    kw = {"config": config, "curvature_every": 2, "alpha": 0.7, "seed": 1}
    ours, ours_state = run(
        triaccel_jax.scale_by_curvature(optax.scale_by_adam(0.9, 0.99, 1e-8), b1=0.9, b2=0.99, **kw)
    )
    theirs, theirs_state = run(triaccel_jax.scale_by_triaccel(0.9, 0.99, 1e-8, **kw))
    chex.assert_trees_all_close(ours, theirs, rtol=1e-5, atol=1e-7)
    for path in ("sharp", "mid", "flat"):
        a, b = triaccel_jax.signals(ours_state)[path], triaccel_jax.signals(theirs_state)[path]
        assert a["step_scale"] == pytest.approx(b["step_scale"], rel=1e-6)
        assert a["noise_to_signal"] == pytest.approx(b["noise_to_signal"], rel=1e-5, abs=1e-12)


@pytest.mark.slow
def test_over_sgd_flat_leaves_step_longer_and_alpha_0_is_sgd():
    sgd = optax.sgd(0.01)
    (first,), state = run(triaccel_jax.scale_by_curvature(sgd, curvature_every=1), steps=1)
    scales = {k: v["step_scale"] for k, v in triaccel_jax.signals(state).items()}
    assert scales["flat"] == 2.0 and scales["sharp"] == 0.5  # at the clips: 400x apart
    grads = jax.grad(loss, allow_int=True)(make_params())
    for path in ("sharp", "mid", "flat"):
        np.testing.assert_allclose(first[path], -0.01 * scales[path] * grads[path], rtol=1e-6)
    assert first["count"] == 0  # an integer leaf passes through
    plain, _ = run(triaccel_jax.scale_by_curvature(sgd, alpha=0.0))
    chex.assert_trees_all_close(plain, run(sgd)[0])


def test_over_muon_the_steps_are_muons_times_the_reported_scale():
    muon = optax.contrib.muon(0.02, adam_learning_rate=1e-3)
    (scaled,), state = run(triaccel_jax.scale_by_curvature(muon, curvature_every=1), steps=1)
    (alone,), _ = run(muon, steps=1)
    signals = triaccel_jax.signals(state)
    for path in ("sharp", "mid", "flat"):
        np.testing.assert_allclose(
            scaled[path], signals[path]["step_scale"] * alone[path], rtol=1e-6
        )
    assert len({signals[p]["step_scale"] for p in ("sharp", "mid", "flat")}) == 3


def test_injected_alpha_changes_the_scale_without_recompiling(count_compiles):
    tx = optax.inject_hyperparams(triaccel_jax.scale_by_curvature, hyperparam_dtype=jnp.float32)(
        direction=optax.sgd(0.1), alpha=0.5, curvature_every=1
    )
    params = make_params()
    grads = {**jax.grad(loss, allow_int=True)(params), "count": jnp.int32(0)}
    update = jax.jit(lambda s: tx.update(grads, s, params))
    _, state = update(tx.init(params))
    state.hyperparams["alpha"] = jnp.asarray(0.0, jnp.float32)
    with count_compiles() as counter:
        updates, _ = update(state)
    assert counter.count == 0
    np.testing.assert_allclose(updates["sharp"], -0.1 * grads["sharp"], rtol=1e-6)


def test_bad_input_is_refused_by_name():
    with pytest.raises(TypeError, match="direction"):
        triaccel_jax.scale_by_curvature(lambda g: g)
    with pytest.raises(ValueError, match="block"):
        triaccel_jax.scale_by_curvature(
            optax.sgd(0.1), config=triaccel_jax.TriAccelConfig(scale="block")
        )
    with pytest.raises(ValueError, match="min_scale"):
        triaccel_jax.scale_by_curvature(optax.sgd(0.1), min_scale=3.0, max_scale=2.0)
    with pytest.raises(ValueError, match="alpha"):
        triaccel_jax.scale_by_curvature(optax.sgd(0.1), alpha=-1.0)
