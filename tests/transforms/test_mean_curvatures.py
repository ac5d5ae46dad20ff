"""``mean_curvatures``: each leaf's mean curvature as a tree like the params, the figure
``signals`` reports, as arrays usable inside ``jit``, from every triaccel state in the optimizer
state; None where no triaccel state trains a leaf."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax.transforms import mean_curvatures
from triaccel_jax.transforms import scale_by_triaccel


def make_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "dense": {"kernel": jax.random.normal(k1, (3, 2)), "bias": jax.random.normal(k2, (2,))},
        "steps": jnp.int32(0),
    }


def test_it_is_the_mean_curvature_signals_reports_as_a_tree_of_arrays():
    params = make_params()
    tx = triaccel_jax.triaccel(1e-2, curvature_every=1)  # a chain: the state is found inside
    state = tx.init(params)
    for _ in range(2):
        grads = jax.tree.map(lambda p: p * 0.5 if p.dtype == jnp.float32 else p, params)
        _, state = tx.update(grads, state, params)
    kappa = jax.jit(mean_curvatures)(state, params)
    assert kappa["steps"] is None
    chex.assert_trees_all_equal_structs(kappa["dense"], params["dense"])
    reported = triaccel_jax.signals(state)
    for name in ("kernel", "bias"):
        value = kappa["dense"][name]
        chex.assert_shape(value, ())
        chex.assert_type(value, jnp.float32)
        assert float(value) > 0
        np.testing.assert_allclose(float(value), reported[f"dense/{name}"]["mean_curvature"])


def test_it_gathers_the_leaves_of_several_triaccel_states_and_leaves_others_none():
    params = {"a": jnp.ones(3), "b": jnp.ones(2), "c": jnp.ones(4)}
    tx = optax.multi_transform(
        {
            "one": scale_by_triaccel(curvature_every=1),
            "two": scale_by_triaccel(curvature_every=1),
            "sgd": optax.sgd(0.1),
        },
        {"a": "one", "b": "two", "c": "sgd"},
    )
    state = tx.init(params)
    grads = {"a": jnp.full(3, 2.0), "b": jnp.full(2, 3.0), "c": jnp.ones(4)}
    _, state = tx.update(grads, state, params)
    kappa = mean_curvatures(state, params)
    assert kappa["c"] is None
    reported = triaccel_jax.signals(state)
    assert set(reported) == {"a", "b"}
    for name in ("a", "b"):
        np.testing.assert_allclose(float(kappa[name]), reported[name]["mean_curvature"])
    assert float(kappa["b"]) > float(kappa["a"]) > 0  # the Fisher estimate: 9 and 4, corrected


def test_a_state_without_curvature_or_of_other_params_is_refused():
    params = {"a": jnp.ones(3)}
    with pytest.raises(ValueError, match="no triaccel state"):
        mean_curvatures(optax.sgd(0.1).init(params), params)
    state = triaccel_jax.triaccel(0.1).init(params)
    with pytest.raises(ValueError, match="does not have"):
        mean_curvatures(state, {"other": jnp.ones(3)})
    doubled = optax.chain(scale_by_triaccel(), scale_by_triaccel())
    with pytest.raises(ValueError, match="two states hold"):
        mean_curvatures(doubled.init(params), params)
