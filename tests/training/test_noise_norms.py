"""value_and_grad_with_noise: the batch's gradient and the noise scale's two norms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triaccel_jax.training import value_and_grad_with_noise


def data(num=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 2.0]) + rng.normal(size=num)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def sq_norm(tree):
    return sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(tree))


def test_the_gradient_is_the_batchs_and_the_norms_are_the_averages_and_the_halves():
    params = {"w": jnp.array([0.5, 0.0, -0.5]), "b": jnp.zeros(())}
    batch = data()
    value, grads, norms = jax.jit(value_and_grad_with_noise(loss))(params, batch)
    want_value, want_grads = jax.value_and_grad(loss)(params, batch)
    assert float(value) == pytest.approx(float(want_value), rel=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, want_grads
    )
    halves = [jax.tree.map(lambda x, i=i: x[i * 16 : (i + 1) * 16], batch) for i in range(2)]
    half_norms = [sq_norm(jax.grad(loss)(params, h)) for h in halves]
    assert float(norms["grad_sq_norm"]) == pytest.approx(sq_norm(want_grads), rel=1e-5)
    assert float(norms["micro_grad_sq_norm"]) == pytest.approx(np.mean(half_norms), rel=1e-5)
    assert norms["grad_sq_norm"].dtype == jnp.float32


def test_aux_is_the_halves_mean_and_extra_arguments_pass_through():
    def with_aux(params, batch, scale):
        x, y = batch
        error = x @ params["w"] + params["b"] - y
        return scale * jnp.mean(error**2), {"mean_error": jnp.mean(error)}

    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    batch = data()
    (value, aux), grads, _ = value_and_grad_with_noise(with_aux, has_aux=True)(params, batch, 2.0)
    (want, want_aux), want_grads = jax.value_and_grad(with_aux, has_aux=True)(params, batch, 2.0)
    assert float(value) == pytest.approx(float(want), rel=1e-5)
    assert float(aux["mean_error"]) == pytest.approx(float(want_aux["mean_error"]), rel=1e-5)
    np.testing.assert_allclose(grads["w"], want_grads["w"], rtol=1e-5)


def test_an_odd_batch_is_refused_naming_the_shape():
    x, y = data(num=31)
    with pytest.raises(ValueError, match=r"even number of samples.*\(31, 3\)"):
        value_and_grad_with_noise(loss)({"w": jnp.zeros(3), "b": jnp.zeros(())}, (x, y))
