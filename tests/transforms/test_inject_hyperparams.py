"""triaccel under optax.inject_hyperparams: shape-setting options stay static, numbers are injected.

``optax.inject_hyperparams`` turns every int or float argument into a traced array, so options
that set array shapes (the curvature store's layout, the number of probes) live in one frozen
:class:`triaccel_jax.TriAccelConfig`, which it passes through untouched.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 16).reshape(4, 4), "b": jnp.full(4, 0.5)}
NUMERIC = {
    "b1",
    "b2",
    "eps",
    "curvature_every",
    "curvature_decay",
    "alpha",
    "min_scale",
    "max_scale",
    "seed",
}


def _loss(p):
    return jnp.sum(jnp.arange(1.0, 17.0).reshape(4, 4) * p["w"] ** 2) + jnp.sum(p["b"] ** 2)


def test_the_snippet_from_the_issue_needs_no_static_args():
    tx = optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=1e-3)
    state = jax.jit(tx.init)(PARAMS)
    assert set(state.hyperparams) == NUMERIC | {"learning_rate", "weight_decay"}
    updates, state = jax.jit(tx.update)(jax.grad(_loss)(PARAMS), state, PARAMS)
    chex.assert_tree_all_finite(updates)
    # The defaults' layout: one block of 16 (block_size 64), ceil(0.01 * 16) = 1 outlier.
    store = state.inner_state[0].curvature_by_leaf()["w"]
    chex.assert_shape([store.block_means, store.outlier_values], (1,))


def test_scale_by_triaccel_under_inject_hyperparams_with_jitted_init():
    tx = optax.inject_hyperparams(triaccel_jax.scale_by_triaccel)()
    state = jax.jit(tx.init)(PARAMS)
    assert set(state.hyperparams) == NUMERIC
    updates, _ = jax.jit(tx.update)(jax.grad(_loss)(PARAMS), state, PARAMS)
    chex.assert_shape(updates["w"], (4, 4))


@pytest.mark.slow
def test_config_sets_layout_estimator_and_state_dtype_under_jit():
    config = triaccel_jax.TriAccelConfig(
        estimator="hutchinson", block_size=8, rho=0.25, num_samples=2, state_dtype=jnp.bfloat16
    )
    tx = optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=0.1, config=config)
    state = jax.jit(tx.init)(PARAMS)
    inner = state.inner_state[0]
    store = inner.curvature_by_leaf()["w"]
    chex.assert_shape([store.block_means, store.outlier_values], [(2,), (4,)])
    chex.assert_type(inner.mu["w"], jnp.bfloat16)
    update = jax.jit(lambda g, s: tx.update(g, s, PARAMS, loss_fn=_loss))
    _, state = update(jax.grad(_loss)(PARAMS), state)
    # Hutchinson on a quadratic: the Hessian diagonal 2 * (1..16) exactly, whose mean is 17.
    np.testing.assert_allclose(triaccel_jax.signals(state)["w"]["mean_curvature"], 17.0, rtol=1e-5)


def test_changing_an_injected_hyperparameter_changes_the_update_without_retracing():
    tx = optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=0.1, weight_decay=0.0)
    traces = []

    @jax.jit
    def update(grads, state):
        traces.append(1)
        return tx.update(grads, state, PARAMS)[0]

    def with_value(state, name, value):
        old = state.hyperparams[name]  # same dtype and weak type: the same compiled update
        return state._replace(hyperparams={**state.hyperparams, name: jnp.full_like(old, value)})

    grads = jax.grad(_loss)(PARAMS)
    state = tx.init(PARAMS)
    base = update(grads, state)
    flat = update(grads, with_value(state, "alpha", 0.0))
    wide = update(grads, with_value(state, "max_scale", 8.0))
    assert len(traces) == 1
    # alpha = 0 is plain AdamW: the first step is lr * sign(g); alpha = 0.5 scales it per leaf.
    np.testing.assert_allclose(flat["w"], -0.1 * np.sign(grads["w"]), rtol=1e-5)
    assert not np.allclose(base["w"], flat["w"])
    assert not np.allclose(base["b"], wide["b"])  # "b" is flat: its scale was clipped at 2


def test_config_is_frozen_hashable_and_checked():
    config = triaccel_jax.TriAccelConfig(block_size=8, state_dtype="bfloat16")
    assert hash(config) == hash(triaccel_jax.TriAccelConfig(block_size=8, state_dtype=jnp.bfloat16))
    assert config.state_dtype == "bfloat16"
    with pytest.raises(AttributeError):
        config.block_size = 4
    with pytest.raises(ValueError, match=r"block_size.*>= 1"):
        triaccel_jax.TriAccelConfig(block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        triaccel_jax.TriAccelConfig(block_size=2.5)
    with pytest.raises(ValueError, match=r"rho.*\(0.0, 1.0\]"):
        triaccel_jax.TriAccelConfig(rho=0.0)
    with pytest.raises(ValueError, match="rho"):
        triaccel_jax.TriAccelConfig(rho=1.5)
    with pytest.raises(ValueError, match="num_samples"):
        triaccel_jax.TriAccelConfig(num_samples=0)
    with pytest.raises(ValueError, match=r"estimator.*fisher.*hutchinson"):
        triaccel_jax.TriAccelConfig(estimator="newton")
    with pytest.raises(ValueError, match=r"state_dtype.*bfloat16"):
        triaccel_jax.TriAccelConfig(state_dtype=jnp.float16)
    with pytest.raises(TypeError, match=r"config.*TriAccelConfig"):
        triaccel_jax.triaccel(0.1, config={"block_size": 8})


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("block_size", 8),
        ("rho", 0.5),
        ("num_samples", 2),
        ("estimator", "hutchinson"),
        ("state_dtype", jnp.bfloat16),
        ("impl", "reference"),
        ("scale", "block"),
    ],
)
def test_config_options_are_only_accepted_in_config(keyword, value):
    # One way to say each thing: the options that are not numbers to tune live in
    # TriAccelConfig, where inject_hyperparams never traces them.
    with pytest.raises(TypeError, match=keyword):
        triaccel_jax.triaccel(0.1, **{keyword: value})
    with pytest.raises(TypeError, match=keyword):
        triaccel_jax.scale_by_triaccel(**{keyword: value})
    triaccel_jax.triaccel(0.1, config=triaccel_jax.TriAccelConfig(**{keyword: value}))


def test_a_number_for_the_state_dtype_is_refused():
    with pytest.raises(ValueError, match=r"state_dtype.*dtype.*number"):
        triaccel_jax.TriAccelConfig(state_dtype=np.float32(1.0))


@pytest.mark.standard_promotion(
    "optax promotes inside its own transforms (integer leaves, MultiSteps, injected hyperparameters)"
)
def test_hyperparameters_rounded_to_bfloat16_params_are_explained():
    # inject_hyperparams keeps hyperparameters in the params' dtype: b2 = 0.999 becomes 1.0.
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
    tx = optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=1e-3)
    with pytest.raises(ValueError, match=r"b2.*hyperparam_dtype=jnp.float32"):
        tx.init(params)
    tx = optax.inject_hyperparams(triaccel_jax.triaccel, hyperparam_dtype=jnp.float32)(1e-3)
    updates, _ = tx.update(params, tx.init(params), params)
    assert updates["w"].dtype == jnp.bfloat16  # float32 hyperparameters do not promote updates
