"""What the step accepts from a loss function, and the errors that name what is wrong."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from triaccel_jax import training


def _trace(loss_fn, *, has_aux):
    normalized = training.normalize_loss_fn(loss_fn, has_aux=has_aux, has_model_state=False)
    return jax.eval_shape(
        lambda: normalized(jnp.ones(3), None, jnp.ones((4, 3)), None, jax.random.key(0))
    )


def test_a_loss_returning_loss_and_aux_without_has_aux_is_told_to_set_it():
    def loss(params, batch):
        return jnp.mean(batch @ params), {"accuracy": jnp.float32(1.0)}

    with pytest.raises(TypeError, match=r"returned a tuple of 2.*needs has_aux=True"):
        _trace(loss, has_aux=False)
    loss_value, (metrics, _) = _trace(loss, has_aux=True)
    assert loss_value.shape == () and set(metrics) == {"accuracy"}


def test_a_scalar_loss_with_has_aux_is_told_what_was_expected():
    with pytest.raises(
        TypeError, match=r"has_aux=True the loss function must return \(loss, aux\)"
    ):
        _trace(lambda params, batch: jnp.mean(batch @ params), has_aux=True)
