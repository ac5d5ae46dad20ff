"""Measuring the noise scale does not change training (``make_train_step(split=True)``).

A model with state (batch norm) trains on the whole micro-batch and updates its statistics once,
as without measuring, while the half-batch norm is measured beside it; the halves are taken
within each shard, explicit sharding included, and a micro-batch that cannot be halved on every
shard is refused by name instead of failing in a reshape."""

from __future__ import annotations

import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from simulated_devices import run_script

from triaccel_jax import training
from triaccel_jax.transforms import LossScaling


def batch_norm_loss(params, batch, *, model_state):
    """A linear model over batch-normalised inputs: the statistics are the batch's own."""
    inputs, targets = batch
    mean, var = jnp.mean(inputs, axis=0), jnp.var(inputs, axis=0)
    normalised = (inputs - mean) / jnp.sqrt(var + 1e-5)
    loss = jnp.mean((normalised @ params["w"] + params["b"] - targets) ** 2)
    running = {
        "mean": 0.9 * model_state["mean"] + 0.1 * mean,
        "var": 0.9 * model_state["var"] + 0.1 * var,
    }
    return loss, {"model_state": running}


def _run(split, params, state, x, y):
    normalized = training.normalize_loss_fn(batch_norm_loss, has_aux=True, has_model_state=True)
    tx = optax.sgd(0.05, momentum=0.9)
    step = training.make_train_step(normalized, tx, policy=None, num_micro=1, seed=0, split=split)
    return jax.jit(step)(
        params, tx.init(params), state, (x, y), np.int32(0), np.float32(1.0), LossScaling().init()
    )


def test_a_batch_norm_step_trains_the_same_with_and_without_measuring():
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 3.0, size=(1, 32, 4)).astype(np.float32)
    y = rng.normal(size=(1, 32)).astype(np.float32)
    params = {"w": jnp.asarray(rng.normal(size=4), jnp.float32), "b": jnp.float32(0.5)}
    state = {"mean": jnp.zeros(4), "var": jnp.ones(4)}
    plain, measured = _run(False, params, state, x, y), _run(True, params, state, x, y)
    chex.assert_trees_all_equal(measured.params, plain.params)
    chex.assert_trees_all_equal(measured.model_state, plain.model_state)
    assert float(measured.metrics["grad_sq_norm"]) == float(plain.metrics["grad_sq_norm"])

    def half_loss(p):
        return batch_norm_loss(p, (x[0, 0::2], y[0, 0::2]), model_state=state)[0]

    half = jax.grad(half_loss)(params)
    expected = sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(half))
    assert float(measured.metrics["micro_grad_sq_norm"]) == pytest.approx(expected, rel=1e-5)
    assert float(plain.metrics["micro_grad_sq_norm"]) == float(plain.metrics["grad_sq_norm"])


EXPLICIT_SPLIT_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from triaccel_jax import training
    from triaccel_jax.transforms import LossScaling

    mesh = jax.make_mesh((8,), ("data",))
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)

    def loss(params, batch):
        inputs, targets = batch
        return jnp.mean((inputs @ params - targets) ** 2)

    normalized = training.normalize_loss_fn(loss, has_aux=False, has_model_state=False)
    tx = optax.sgd(0.1)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=5), jnp.float32)
    step = training.make_train_step(normalized, tx, policy=None, num_micro=1, seed=0, split=True)
    args = (np.int32(0), np.float32(1.0), LossScaling().init())
    for size in (16, 32):
        x = rng.normal(size=(1, size, 5)).astype(np.float32)
        y = rng.normal(size=(1, size)).astype(np.float32)
        unsharded = jax.jit(step)(w, tx.init(w), None, (x, y), *args)
        with jax.set_mesh(mesh):
            sharding = NamedSharding(mesh, P(None, "data"))
            batch = (jax.device_put(x, sharding), jax.device_put(y, sharding))
            out = jax.jit(step)(w, tx.init(w), None, batch, *args)
        for name in ("grad_sq_norm", "micro_grad_sq_norm"):
            np.testing.assert_allclose(out.metrics[name], unsharded.metrics[name], rtol=1e-5)
        np.testing.assert_allclose(out.params, unsharded.params, rtol=1e-6)
    # Eight samples on eight devices: one a shard, which cannot be halved within it.
    x = rng.normal(size=(1, 8, 5)).astype(np.float32)
    with jax.set_mesh(mesh):
        sharding = NamedSharding(mesh, P(None, "data"))
        batch = (jax.device_put(x, sharding), jax.device_put(x[..., 0], sharding))
        try:
            jax.jit(step)(w, tx.init(w), None, batch, *args)
        except ValueError as error:
            assert "even number of samples on every shard, got 1 samples on each of 8 shards" in str(error), error
        else:
            raise AssertionError("a micro-batch of one sample a shard was split")
    print("ok")
    """
)


def test_halves_follow_explicit_shardings_and_one_sample_a_shard_is_refused_by_name():
    run_script(EXPLICIT_SPLIT_SCRIPT, devices=8)


@pytest.mark.standard_promotion(
    "optax.scale_by_adam's bias correction raises a float to an int32 count"
)
def test_preconditioned_norms_weigh_each_element_by_the_second_moment_held():
    rng = np.random.default_rng(5)
    params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), "b": jnp.zeros(2)}
    x = rng.normal(size=(2, 8, 3)).astype(np.float32)  # two micro-batches of eight
    y = rng.normal(size=(2, 8, 2)).astype(np.float32)

    def loss(p, batch):
        inputs, targets = batch
        return jnp.mean((inputs @ p["w"] + p["b"] - targets) ** 2)

    tx = optax.adam(0.1)
    state = tx.init(params)
    nu = {"w": jnp.asarray(rng.uniform(0.1, 2.0, (3, 2)), jnp.float32), "b": jnp.full(2, 0.5)}
    state = (state[0]._replace(nu=nu), *state[1:])
    normalized = training.normalize_loss_fn(loss, has_aux=False, has_model_state=False)
    step = training.make_train_step(
        normalized, tx, policy=None, num_micro=2, seed=0, noise_weights="preconditioned"
    )
    out = jax.jit(step)(
        params, state, None, (x, y), np.int32(0), np.float32(1.0), LossScaling().init()
    )
    # Adam's preconditioner up to one factor: the mean of nu over every element.
    mean = (float(jnp.sum(nu["w"])) + float(jnp.sum(nu["b"]))) / 8
    weights = jax.tree.map(lambda v: mean / (jnp.sqrt(v) + 1e-3 * mean**0.5) ** 2, nu)

    def weighted(g):
        return sum(
            float(jnp.sum(w * gl**2))
            for w, gl in zip(jax.tree.leaves(weights), jax.tree.leaves(g), strict=True)
        )

    micro = [jax.grad(loss)(params, (x[i], y[i])) for i in range(2)]
    whole = jax.tree.map(lambda a, b: (a + b) / 2, *micro)
    m = out.metrics
    assert float(m["preconditioned_grad_sq_norm"]) == pytest.approx(weighted(whole), rel=1e-5)
    expected_micro = np.mean([weighted(g) for g in micro])
    assert float(m["preconditioned_micro_grad_sq_norm"]) == pytest.approx(expected_micro, rel=1e-5)
    # The plain norms are there too, unweighted.
    assert float(m["grad_sq_norm"]) == pytest.approx(
        sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(whole)), rel=1e-5
    )
    # The weighted norms do not depend on nu's scale (it warms up from 0 over thousands of
    # steps, and the noise scale averages the norms across them); before any second moment the
    # step carries no estimate.
    for scale, expected in ((1e-6, m["preconditioned_grad_sq_norm"]), (0.0, 0.0)):
        scaled = (state[0]._replace(nu=jax.tree.map(lambda v, s=scale: v * s, nu)), *state[1:])
        again = jax.jit(step)(
            params, scaled, None, (x, y), np.int32(0), np.float32(1.0), LossScaling().init()
        ).metrics
        assert float(again["preconditioned_grad_sq_norm"]) == pytest.approx(
            float(expected), rel=1e-4
        )
        assert float(again["preconditioned_micro_grad_sq_norm"]) >= 0.0


def test_preconditioned_norms_need_a_second_moment_and_say_so():
    params = {"w": jnp.ones(3)}
    normalized = training.normalize_loss_fn(
        lambda p, batch: jnp.mean(batch @ p["w"]), has_aux=False, has_model_state=False
    )
    tx = optax.sgd(0.1)
    step = training.make_train_step(
        normalized, tx, policy=None, num_micro=1, seed=0, noise_weights="preconditioned"
    )
    with pytest.raises(ValueError, match=r"holds 0 such: use an optimizer with one"):
        jax.jit(step)(
            params,
            tx.init(params),
            None,
            np.ones((1, 4, 3), np.float32),
            np.int32(0),
            np.float32(1.0),
            LossScaling().init(),
        )
