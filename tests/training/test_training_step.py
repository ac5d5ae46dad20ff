"""The one training update, ``triaccel_jax.training.apply_gradients``, and the step's gradient
norms: an overflowing step is skipped whole (carry included), a finite one is optax's update,
fused and unfused agree, the controller's step and Flax's train state give the same params, and
the squared gradient norms of the noise-scale estimate match a hand computation."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax import training
from triaccel_jax.flax import TrainState
from triaccel_jax.transforms import LossScaling
from triaccel_jax.transforms import select_tree


def assert_trees_bit_identical(*trees):
    chex.assert_trees_all_equal_comparator(
        lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
        lambda a, b: f"not bit-identical: {a} != {b}",
        *trees,
    )


def make_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(k1, (3, 2)), "b": jax.random.normal(k2, (2,))}


def make_grads(seed=1):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(k1, (3, 2)), "b": jax.random.normal(k2, (2,))}


def make_batch(n, seed=2):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (n, 3)), "y": jax.random.normal(ky, (n, 2))}


def mse(params, batch):
    prediction = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((prediction - batch["y"]) ** 2)


def sq_norm(tree):
    return sum(float(jnp.sum(jnp.square(leaf))) for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("scaled", [False, True])
def test_a_finite_step_is_optax_update_then_apply_updates(scaled):
    params, grads = make_params(), make_grads()
    tx = triaccel_jax.triaccel(1e-2)
    opt_state = tx.init(params)
    rule = LossScaling(initial_scale=2.0**10) if scaled else None
    given = jax.tree.map(lambda g: g * 2.0**10, grads) if scaled else grads
    out = training.apply_gradients(
        tx, given, opt_state, params, loss_scale=(rule or LossScaling()).init(), loss_scaling=rule
    )
    updates, expected_state = tx.update(grads, opt_state, params)
    chex.assert_trees_all_equal(out.params, optax.apply_updates(params, updates))
    chex.assert_trees_all_equal(out.opt_state, expected_state)
    assert bool(out.finite)


def test_an_overflowing_step_is_skipped_whole_and_keeps_the_carry():
    params, grads = make_params(), make_grads()
    tx = triaccel_jax.triaccel(0.1)
    opt_state = tx.init(params)
    rule = LossScaling(initial_scale=8.0)
    grads = {**grads, "w": grads["w"].at[1, 0].set(jnp.nan)}
    carry_before = {"mean": jnp.zeros(2), "count": jnp.int32(3)}
    carry = {"mean": jnp.ones(2), "count": jnp.int32(4)}
    out = jax.jit(
        lambda g, s, p, c, cb: training.apply_gradients(
            tx, g, s, p, loss_scale=rule.init(), loss_scaling=rule, carry=c, carry_before=cb
        )
    )(grads, opt_state, params, carry, carry_before)
    assert not bool(out.finite)
    assert_trees_bit_identical(out.params, params)
    assert_trees_bit_identical(out.opt_state, opt_state)
    assert_trees_bit_identical(out.carry, carry_before)
    assert float(out.loss_scale.scale) == 4.0 and int(out.loss_scale.skipped_steps) == 1
    chex.assert_tree_all_finite(out.params)


def test_without_a_rule_nothing_is_checked_and_the_carry_passes_through():
    params = make_params()
    tx = optax.sgd(0.1)
    carry = {"n": jnp.int32(1)}
    out = training.apply_gradients(
        tx, make_grads(), tx.init(params), params, carry=carry, loss_scale=None
    )
    assert bool(out.finite) and out.loss_scale is None
    chex.assert_trees_all_equal(out.carry, carry)


def test_a_carry_before_of_another_structure_is_rejected():
    params = make_params()
    tx = optax.sgd(0.1)
    rule = LossScaling()
    with pytest.raises(ValueError, match="carry_before"):
        training.apply_gradients(
            tx,
            make_grads(),
            tx.init(params),
            params,
            loss_scale=rule.init(),
            loss_scaling=rule,
            carry={"n": jnp.int32(1)},
        )
    with pytest.raises(ValueError, match="loss_scale"):
        training.apply_gradients(tx, make_grads(), tx.init(params), params, loss_scaling=rule)


def test_select_tree_selects_whole_trees_and_needs_a_boolean_scalar():
    new, old = (
        {"k": jax.random.key(1), "x": jnp.ones(2)},
        {"k": jax.random.key(2), "x": jnp.zeros(2)},
    )
    chosen = select_tree(jnp.asarray(False), new, old)
    chex.assert_trees_all_equal(jax.random.key_data(chosen["k"]), jax.random.key_data(old["k"]))
    chex.assert_trees_all_equal(chosen["x"], old["x"])
    with pytest.raises(ValueError, match="scalar boolean"):
        select_tree(jnp.asarray([True, False]), new, old)


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_fused_and_unfused_agree(factor):
    params, grads = make_params(), make_grads()
    form = triaccel_jax.transforms.fused_triaccel(1e-2)
    tx = form.tx
    opt_state = tx.init(params)
    rule = LossScaling(initial_scale=4.0)
    scaled = jax.tree.map(lambda g: g * 4.0, grads)

    def run(fused):
        return training.apply_gradients(
            tx,
            scaled,
            opt_state,
            params,
            loss_scale=rule.init(),
            loss_scaling=rule,
            fused=form if fused else None,
            learning_rate_factor=jnp.float32(factor),
        )

    fused, unfused = run(True), run(False)
    # The fused update multiplies the rate rather than the finished update: an ulp apart.
    chex.assert_trees_all_close(fused.params, unfused.params, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(fused.opt_state, unfused.opt_state, rtol=1e-6, atol=1e-7)
    moved = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), fused.params, params)
    assert all(float(m) > 0 for m in jax.tree.leaves(moved))


def make_step(num_micro, loss_scaling=None, tx=None):
    loss = training.normalize_loss_fn(mse, has_aux=False, has_model_state=False)
    tx = tx or optax.sgd(0.1)
    step = training.make_train_step(
        loss, tx, policy=None, num_micro=num_micro, seed=0, loss_scaling=loss_scaling
    )
    return jax.jit(step), tx


def run_step(step, tx, params, batch, num_micro, loss_scale=None):
    micro = jax.tree.map(lambda x: x.reshape(num_micro, -1, *x.shape[1:]), batch)
    loss_scale = LossScaling().init() if loss_scale is None else loss_scale
    return step(params, tx.init(params), None, micro, jnp.int32(0), jnp.float32(1.0), loss_scale)


@pytest.mark.parametrize("num_micro", [1, 4])
def test_the_gradient_norm_metrics_match_a_hand_computation(num_micro):
    params, batch = make_params(), make_batch(16)
    step, tx = make_step(num_micro)
    out = run_step(step, tx, params, batch, num_micro)
    size = 16 // num_micro
    micro_grads = [
        jax.grad(mse)(params, jax.tree.map(lambda x, i=i: x[i * size : (i + 1) * size], batch))
        for i in range(num_micro)
    ]
    big = jax.grad(mse)(params, batch)  # the mean of the micro-batch means
    expected_small = np.mean([sq_norm(g) for g in micro_grads])
    metrics = out.metrics
    for name in ("grad_sq_norm", "micro_grad_sq_norm"):
        chex.assert_shape(metrics[name], ())
        chex.assert_type(metrics[name], jnp.float32)
    np.testing.assert_allclose(float(metrics["grad_sq_norm"]), sq_norm(big), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["micro_grad_sq_norm"]), expected_small, rtol=1e-5)
    if num_micro == 1:
        assert float(metrics["micro_grad_sq_norm"]) == float(metrics["grad_sq_norm"])
    else:
        assert float(metrics["micro_grad_sq_norm"]) > float(metrics["grad_sq_norm"])


def test_the_norms_are_of_the_unscaled_gradients_under_loss_scaling():
    params, batch = make_params(), make_batch(16)
    plain, tx = make_step(4)
    scaled, _ = make_step(4, loss_scaling=LossScaling(initial_scale=2.0**12))
    state = LossScaling(initial_scale=2.0**12).init()
    reference = run_step(plain, tx, params, batch, 4)
    out = run_step(scaled, tx, params, batch, 4, loss_scale=state)
    for name in ("grad_sq_norm", "micro_grad_sq_norm"):
        np.testing.assert_allclose(
            float(out.metrics[name]), float(reference.metrics[name]), rtol=1e-5
        )
    chex.assert_trees_all_close(out.params, reference.params, rtol=1e-6)
    assert float(out.metrics["skipped"]) == 0.0


def test_an_overflowing_controller_step_keeps_params_and_model_state():
    def loss_with_state(params, batch, *, model_state):
        value = mse(params, batch) * jnp.inf  # every gradient overflows
        return value, {"model_state": model_state + 1}

    loss = training.normalize_loss_fn(loss_with_state, has_aux=True, has_model_state=True)
    tx = optax.sgd(0.1)
    rule = LossScaling(initial_scale=16.0)
    step = jax.jit(
        training.make_train_step(loss, tx, policy=None, num_micro=2, seed=0, loss_scaling=rule)
    )
    params, batch = make_params(), make_batch(8)
    micro = jax.tree.map(lambda x: x.reshape(2, 4, *x.shape[1:]), batch)
    model_state = jnp.zeros(3)
    out = step(
        params, tx.init(params), model_state, micro, jnp.int32(0), jnp.float32(1.0), rule.init()
    )
    assert float(out.metrics["skipped"]) == 1.0
    assert float(out.loss_scale.scale) == 8.0
    assert_trees_bit_identical(out.params, params)
    assert_trees_bit_identical(out.model_state, model_state)


ADAM = pytest.param(
    lambda: optax.adam(1e-2),
    marks=pytest.mark.standard_promotion("optax.adam raises its decay rates to an int32 count"),
    id="adam",
)


@pytest.mark.parametrize(
    "make_tx", [ADAM, pytest.param(lambda: triaccel_jax.triaccel(1e-2), id="triaccel")]
)
def test_the_train_state_and_the_controller_step_give_the_same_params(make_tx):
    params, batch = make_params(), make_batch(8)
    tx = make_tx()
    step, _ = make_step(1, tx=tx)
    out = run_step(step, tx, params, batch, 1)
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    # Hutchinson's estimator is not used: the default estimator needs no loss.
    state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, jax.grad(mse)(params, batch))
    chex.assert_trees_all_close(state.params, out.params, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(state.opt_state, out.opt_state, rtol=1e-6, atol=1e-7)
