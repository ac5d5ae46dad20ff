"""``muon_dimension_numbers``: optax's Muon trains a Flax conv kernel as the matrix it folds to."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

from triaccel_jax.transforms import muon_dimension_numbers

pytestmark = pytest.mark.standard_promotion("optax's muon promotes inside (its int32 count)")


def test_a_conv_kernel_steps_as_its_folded_matrix_and_vectors_go_to_adam():
    keys = jax.random.split(jax.random.key(0), 2)
    conv = jax.random.normal(keys[0], (3, 3, 2, 4))
    grad = jax.random.normal(keys[1], (3, 3, 2, 4))
    params = {"conv": conv, "bias": jnp.ones(4), "step": jnp.int32(0)}
    grads = {"conv": grad, "bias": jnp.full(4, 0.5), "step": jnp.int32(0)}
    numbers = muon_dimension_numbers(params)
    assert numbers["bias"] is None and numbers["step"] is None
    tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=muon_dimension_numbers)
    updates, _ = tx.update(grads, tx.init(params), params)
    # The same Muon step on the (3 * 3 * 2, 4) matrix, given as a matrix.
    matrix = {"m": conv.reshape(18, 4)}
    plain = optax.contrib.muon(0.02)
    expected, _ = plain.update({"m": grad.reshape(18, 4)}, plain.init(matrix), matrix)
    chex.assert_trees_all_close(updates["conv"].reshape(18, 4), expected["m"], rtol=1e-5)
    # Without the numbers, optax gives the 4-D kernel to Adam: a different step.
    default = optax.contrib.muon(0.02)
    adam_step, _ = default.update(grads, default.init(params), params)
    assert not jnp.allclose(adam_step["conv"], updates["conv"], rtol=0.1)
    chex.assert_trees_all_close(adam_step["bias"], updates["bias"])
