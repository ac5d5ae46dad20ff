"""Curvature estimators: Fisher, and Hutchinson against a known Hessian diagonal."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax


def test_fisher_is_squared_gradient_and_skips_non_float():
    tx = triaccel_jax.transforms.fisher_diagonal()
    grads = {"w": jnp.array([1.0, -3.0], jnp.bfloat16), "step": jnp.array(4), "none": None}
    diag, _ = tx.update(grads, tx.init(grads))
    chex.assert_type(diag["w"], jnp.float32)
    np.testing.assert_array_equal(diag["w"], [1.0, 9.0])
    assert diag["step"] is grads["step"] and diag["none"] is None


def _quadratic_with_known_diagonal(n=32, seed=0):
    """0.5 x^T A x with A symmetric positive definite, dense off-diagonal part."""
    rng = np.random.default_rng(seed)
    diagonal = rng.uniform(1.0, 10.0, n)
    off = rng.normal(0.0, 0.15, (n, n))
    a = np.diag(diagonal) + (off + off.T) / 2 - np.diag(np.diag((off + off.T) / 2))
    a = jnp.asarray(a, jnp.float32)
    return (lambda p: 0.5 * p["x"] @ a @ p["x"]), diagonal


def test_hutchinson_single_estimate_is_exact_for_diagonal_hessian():
    tx = triaccel_jax.transforms.hutchinson_diagonal(num_samples=1, seed=3)
    params = {"x": jnp.ones(5)}
    scales = jnp.arange(1.0, 6.0)
    diag, state = tx.update(
        params, tx.init(params), params, loss_fn=lambda p: jnp.sum(scales * p["x"] ** 2)
    )
    np.testing.assert_allclose(diag["x"], 2 * scales, rtol=1e-6)
    chex.assert_type(state.key, jnp.uint32)


def test_hutchinson_ema_within_five_percent_of_true_diagonal():
    loss_fn, true_diagonal = _quadratic_with_known_diagonal()
    # block_size=1 and rho=1 make the store lossless, so this measures estimator + EMA alone.
    tx = triaccel_jax.scale_by_triaccel(
        config=triaccel_jax.TriAccelConfig(
            estimator="hutchinson", block_size=1, rho=1.0, num_samples=4
        ),
        curvature_every=1,
        curvature_decay=0.995,
        seed=11,
    )
    params = {"x": jnp.ones(true_diagonal.size)}
    state = tx.init(params)
    step = jax.jit(lambda s: tx.update(params, s, params, loss_fn=loss_fn)[1])
    for _ in range(600):
        state = step(state)
    (signals,) = triaccel_jax.transforms.find_signal_states(state)
    correction = 1 - 0.995 ** int(signals.curvature_count)
    store = signals.curvature_by_leaf()["x"]
    estimate = triaccel_jax.transforms.expand_diagonal(store, (true_diagonal.size,)) / correction
    np.testing.assert_allclose(estimate, true_diagonal, rtol=0.05)


def test_hutchinson_handles_integer_and_none_leaves():
    tx = triaccel_jax.transforms.hutchinson_diagonal()
    params = {"x": jnp.ones(3), "count": jnp.array(2, jnp.int32), "skip": None}

    def loss_fn(p):
        return jnp.sum(p["x"] ** 2) * p["count"].astype(jnp.float32)

    grads = {"x": jnp.ones(3), "count": jnp.zeros((), jnp.int32), "skip": None}
    diag, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p, loss_fn=loss_fn))(grads, params)
    np.testing.assert_allclose(diag["x"], [4.0, 4.0, 4.0])
    chex.assert_type(diag["count"], jnp.int32)
    assert diag["skip"] is None


def test_hutchinson_needs_loss_fn_with_helpful_message():
    tx = triaccel_jax.transforms.hutchinson_diagonal()
    params = {"x": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"loss_fn=.*apply_gradients"):
        tx.update(params, tx.init(params), params)


def test_hutchinson_num_samples_must_be_positive():
    with pytest.raises(ValueError, match="num_samples"):
        triaccel_jax.transforms.hutchinson_diagonal(num_samples=0)


def test_estimators_are_gradient_transformations():
    for tx in (
        triaccel_jax.transforms.fisher_diagonal(),
        triaccel_jax.transforms.hutchinson_diagonal(),
    ):
        assert isinstance(tx, optax.GradientTransformationExtraArgs)


@pytest.mark.parametrize("wrapper", ["masked", "multi_transform"])
def test_hutchinson_under_masked_explains_and_unmask_gives_the_trained_leaves_curvature(wrapper):
    # optax hands the inner update the params with MaskedNode for the leaves it leaves out; a
    # plain loss cannot take them. The error says how to give the loss the whole tree back.
    params = {"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.5])}
    scale = jnp.array([3.0, 5.0])  # H_w = diag(6, 10): Hutchinson is exact for it
    loss = lambda p: jnp.sum(scale * p["w"] ** 2) + jnp.sum(jnp.sin(p["b"]))
    inner = triaccel_jax.triaccel(0.1, config=triaccel_jax.TriAccelConfig(estimator="hutchinson"))
    if wrapper == "masked":
        tx = optax.masked(inner, {"w": True, "b": False})
    else:
        labels = {"w": "curved", "b": "plain"}
        tx = optax.multi_transform({"curved": inner, "plain": optax.sgd(0.1)}, labels)
    state = tx.init(params)
    grads = jax.grad(loss)(params)
    with pytest.raises(
        ValueError, match=r"MaskedNode.*triaccel_jax\.transforms\.unmask\(p, params\)"
    ):
        jax.jit(lambda g, s: tx.update(g, s, params, loss_fn=loss))(grads, state)
    unmasked_loss = lambda p: loss(triaccel_jax.transforms.unmask(p, params))
    _, state = jax.jit(lambda g, s: tx.update(g, s, params, loss_fn=unmasked_loss))(grads, state)
    signals = triaccel_jax.signals(state)
    assert set(signals) == {"w"}
    np.testing.assert_allclose(signals["w"]["mean_curvature"], 8.0, rtol=1e-5)
