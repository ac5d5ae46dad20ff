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


@pytest.mark.parametrize(
    "returned",
    [
        lambda loss: [loss, {}],  # a list, not a tuple
        lambda loss: [loss, {"accuracy": jnp.float32(1.0)}],
        lambda loss: (loss, {}, {}),
    ],
    ids=["list", "list-with-metrics", "tuple-of-3"],
)
def test_a_loss_returning_a_sequence_without_has_aux_is_told_to_set_it(returned):
    """Not JAX's "Value '{}' with dtype object is not a valid JAX array type"."""

    def loss(params, batch):
        return returned(jnp.mean(batch @ params))

    with pytest.raises(TypeError, match=r"needs has_aux=True") as error:
        _trace(loss, has_aux=False)
    assert "dtype object" not in str(error.value)


def test_a_loss_returning_a_dict_is_told_to_return_a_scalar():
    def loss(params, batch):
        return {"loss": jnp.mean(batch @ params)}

    with pytest.raises(TypeError, match=r"scalar float loss, got a dict") as error:
        _trace(loss, has_aux=False)
    assert "dtype object" not in str(error.value)
    with pytest.raises(TypeError, match=r"scalar float loss, got a dict"):
        _trace(lambda params, batch: (loss(params, batch), {}), has_aux=True)


def test_the_controller_names_has_aux_for_a_loss_returning_a_list():
    import numpy as np
    import optax

    import triaccel_jax

    def loss(params, batch):
        return [jnp.mean((batch @ params["w"]) ** 2), {}]

    data = np.ones((32, 3), np.float32)
    with pytest.raises(TypeError, match=r"wrong structure.*has_aux=True") as error:
        triaccel_jax.Controller(
            loss, {"w": jnp.ones(3)}, optax.sgd(0.1), data, min_batch=8, max_batch=8
        )
    assert "dtype object" not in str(error.value)
    assert "Controller(..., has_aux=True)" in str(error.value)
