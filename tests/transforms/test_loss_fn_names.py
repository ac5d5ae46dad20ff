"""The loss as an extra argument under optax's other names: ``obj_fn`` (contrib.sophia) and
``value_fn`` (the line searches), so one ``update`` call feeds every transform in a chain."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax

PARAMS = {"w": jnp.array([1.0, -2.0, 0.5])}
CURVATURE = jnp.array([3.0, 5.0, 7.0])


def loss(p):
    return jnp.sum(CURVATURE * p["w"] ** 2)


def hutchinson():
    return triaccel_jax.triaccel(
        0.1, config=triaccel_jax.TriAccelConfig(estimator="hutchinson"), curvature_every=1
    )


@pytest.mark.parametrize("name", ["obj_fn", "value_fn"])
def test_other_names_of_the_loss_feed_the_hutchinson_estimator(name):
    tx = hutchinson()
    grads = jax.grad(loss)(PARAMS)
    reference, reference_state = tx.update(grads, tx.init(PARAMS), PARAMS, loss_fn=loss)
    updates, state = jax.jit(lambda g, s: tx.update(g, s, PARAMS, **{name: loss}))(
        grads, tx.init(PARAMS)
    )
    np.testing.assert_allclose(updates["w"], reference["w"], rtol=1e-6)
    # The Hessian diagonal of the loss, 2 * CURVATURE, whose mean is 10.
    curvature = triaccel_jax.signals(state)["w"]["mean_curvature"]
    assert curvature == pytest.approx(10.0, rel=1e-5)
    assert curvature == triaccel_jax.signals(reference_state)["w"]["mean_curvature"]


@pytest.mark.parametrize("name", ["obj_fn", "value_fn"])
def test_hutchinson_diagonal_takes_the_other_names(name):
    tx = triaccel_jax.transforms.hutchinson_diagonal()
    diagonal, _ = tx.update(PARAMS, tx.init(PARAMS), PARAMS, **{name: loss})
    np.testing.assert_allclose(diagonal["w"], 2 * CURVATURE, rtol=1e-6)


@pytest.mark.slow
def test_one_value_fn_feeds_triaccel_and_a_line_search():
    tx = optax.chain(
        triaccel_jax.scale_by_triaccel(
            config=triaccel_jax.TriAccelConfig(estimator="hutchinson"), curvature_every=1
        ),
        optax.scale_by_learning_rate(1.0),  # a descent direction, which the line search scales
        optax.scale_by_zoom_linesearch(max_linesearch_steps=8),
    )
    params, state = PARAMS, tx.init(PARAMS)
    value_and_grad = optax.value_and_grad_from_state(loss)
    for _ in range(5):
        value, grad = value_and_grad(params, state=state)
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=loss)
        params = optax.apply_updates(params, updates)
    assert float(loss(params)) < 0.1 * float(loss(PARAMS))
    assert triaccel_jax.signals(state)["w"]["mean_curvature"] == pytest.approx(10.0, rel=1e-5)


def test_the_same_function_under_two_names_is_fine_two_different_ones_are_not():
    tx = hutchinson()
    state = tx.init(PARAMS)
    tx.update(PARAMS, state, PARAMS, loss_fn=loss, value_fn=loss)
    with pytest.raises(ValueError, match=r"loss_fn.*value_fn.*different"):
        tx.update(PARAMS, state, PARAMS, loss_fn=loss, value_fn=lambda p: 2 * loss(p))
    with pytest.raises(ValueError, match=r"obj_fn.*value_fn.*different"):
        estimator = triaccel_jax.transforms.hutchinson_diagonal()
        estimator.update(
            PARAMS, estimator.init(PARAMS), PARAMS, obj_fn=loss, value_fn=lambda p: loss(p)
        )
    with pytest.raises(TypeError, match=r"value_fn.*callable"):
        tx.update(PARAMS, state, PARAMS, value_fn=3.0)


def test_missing_loss_lists_every_accepted_name():
    tx = hutchinson()
    with pytest.raises(ValueError, match=r"loss_fn=.*obj_fn.*value_fn"):
        tx.update(PARAMS, tx.init(PARAMS), PARAMS)
