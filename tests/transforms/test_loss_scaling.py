"""Dynamic loss scaling: skipped steps leave everything bit-identical; the scale backs off and
regrows; nothing in the state ever becomes non-finite."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax


def assert_trees_bit_identical(*trees):
    chex.assert_trees_all_equal_comparator(
        lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
        lambda a, b: f"not bit-identical: {a} != {b}",
        *trees,
    )


def make_problem():
    params = {"w": jnp.array([-0.0, 0.5, -1.5, 2.0]), "b": jnp.zeros(3), "step": jnp.array(0)}

    def loss(p):
        return jnp.sum((p["w"] - 1.0) ** 2) + jnp.sum((p["b"] + 0.5) ** 2)

    return params, loss


@pytest.mark.slow
def test_injected_nonfinite_steps_are_skipped_and_state_stays_finite():
    params, loss = make_problem()
    tx = triaccel_jax.transforms.dynamic_loss_scale(
        triaccel_jax.triaccel(0.05, config=triaccel_jax.TriAccelConfig(state_dtype=jnp.bfloat16)),
        initial_scale=2.0**10,
        growth_interval=3,
    )
    state = tx.init(params)
    bad_steps = {2: jnp.inf, 3: jnp.nan, 7: -jnp.inf}

    @jax.jit
    def step(params, state, poison):
        scale = triaccel_jax.transforms.loss_scale(state)
        grads = jax.grad(lambda p: loss(p) * scale, allow_int=True)(params)
        grads = {**grads, "step": jnp.zeros((), jnp.int32)}
        grads["w"] = grads["w"].at[1].add(poison)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    scales = []
    for t in range(12):
        before_params, before_state = params, state
        params, state = step(params, state, bad_steps.get(t, 0.0))
        scales.append(float(state.scale))
        if t in bad_steps:
            assert_trees_bit_identical(before_params, params)
            assert_trees_bit_identical(before_state.inner_state, state.inner_state)
        chex.assert_tree_all_finite(state)
    assert int(state.skipped_steps) == 3
    assert int(state.nonfinite_count["w"]) == 3 and int(state.nonfinite_count["b"]) == 0
    # 1024 -> (steps 0, 1 fine) -> backoff at 2, 3 -> 256 -> grows after 3 good steps (4, 5, 6)
    # -> 512 -> backoff at 7 -> 256 -> grows after 8, 9, 10 -> 512.
    assert scales == [1024, 1024, 512, 256, 256, 256, 512, 256, 256, 256, 512, 512]
    assert float(loss(params)) < float(loss(make_problem()[0]))


def test_scale_respects_bounds():
    tx = triaccel_jax.transforms.dynamic_loss_scale(
        optax.sgd(0.1), initial_scale=4.0, min_scale=2.0, max_scale=8.0, growth_interval=1
    )
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update({"w": jnp.full(2, jnp.nan)}, state, params)
    assert float(state.scale) == 2.0
    for _ in range(5):
        _, state = tx.update({"w": jnp.ones(2)}, state, params)
    assert float(state.scale) == 8.0


def test_gradients_are_unscaled_before_the_inner_update():
    tx = triaccel_jax.transforms.dynamic_loss_scale(optax.sgd(1.0), initial_scale=64.0)
    params = {"w": jnp.ones(2)}
    updates, _ = tx.update({"w": jnp.full(2, 64.0 * 0.25)}, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.25)


def test_forwards_extra_arguments():
    params = {"w": jnp.ones(3)}
    loss_fn = lambda p: jnp.sum(2.0 * p["w"] ** 2)
    tx = triaccel_jax.transforms.dynamic_loss_scale(
        triaccel_jax.triaccel(0.1, config=triaccel_jax.TriAccelConfig(estimator="hutchinson"))
    )
    _, state = tx.update(jax.grad(loss_fn)(params), tx.init(params), params, loss_fn=loss_fn)
    assert triaccel_jax.signals(state)["w"]["mean_curvature"] == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"initial_scale": 0.0}, "initial_scale"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"min_scale": 4.0, "max_scale": 2.0}, "max_scale"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        triaccel_jax.transforms.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


def test_loss_scale_needs_exactly_one_state():
    with pytest.raises(ValueError, match="found 0"):
        triaccel_jax.transforms.loss_scale(optax.sgd(0.1).init({"w": jnp.ones(1)}))


def test_unscaled_gradients_stay_in_float32_and_do_not_underflow():
    # A float16 gradient of 1e-8 scaled by 2**15 is 3.3e-4, which float16 holds; divided by the
    # scale in float16 it would underflow to 0 (float16's smallest subnormal is 6e-8).
    scale = 2.0**15
    tx = triaccel_jax.transforms.dynamic_loss_scale(optax.sgd(1.0), initial_scale=scale)
    params = {"w": jnp.ones(2, jnp.float16)}
    scaled = {"w": (jnp.array([1e-8, -3e-8], jnp.float32) * scale).astype(jnp.float16)}
    updates, _ = tx.update(scaled, tx.init(params), params)
    assert updates["w"].dtype == jnp.float32
    expected = np.asarray(scaled["w"], np.float32) / scale
    np.testing.assert_allclose(updates["w"], -expected, rtol=1e-7)
    assert np.all(np.asarray(updates["w"]) != 0)
