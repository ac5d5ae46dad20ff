"""Curvature across devices: with the batch sharded over 8 simulated CPU devices, ``jit`` averages
the Hutchinson and Fisher estimates like the gradient, so they equal the single-device ones.

XLA's device count is fixed when jax is imported, so the check runs in a subprocess.
"""

from __future__ import annotations

import textwrap

import pytest
from simulated_devices import run_script

SCRIPT = textwrap.dedent(
    """
    import chex, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import triaccel_jax

    assert jax.device_count() == 8, jax.devices()
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(keys[0], (6, 4)), "b": jnp.zeros(4)}
    x = jax.random.normal(keys[1], (64, 6))
    y = jax.random.normal(keys[2], (64, 4))

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)

    def estimate(estimator, x, y):
        tx = triaccel_jax.scale_by_triaccel(
            config=triaccel_jax.TriAccelConfig(estimator=estimator, block_size=1, rho=1.0)
        )

        @jax.jit
        def run(params, x, y):
            grads = jax.grad(loss)(params, x, y)
            _, state = tx.update(grads, tx.init(params), params, loss_fn=lambda p: loss(p, x, y))
            return state[0].curvature

        return run(params, x, y)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded = NamedSharding(mesh, P("data"))
    xs, ys = jax.device_put(x, sharded), jax.device_put(y, sharded)
    assert len(xs.sharding.device_set) == 8
    for estimator in ("fisher", "hutchinson"):
        single = estimate(estimator, x, y)
        multi = estimate(estimator, xs, ys)
        chex.assert_trees_all_close(single, multi, rtol=1e-5, atol=1e-7)
    print("ok")
    """
)


@pytest.mark.slow
def test_curvature_is_averaged_across_devices_like_gradients():
    run_script(SCRIPT, devices=8, timeout=300)


DATA_PARALLEL = textwrap.dedent(
    """
    import dataclasses
    import chex, jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, PartitionSpec as P
    import triaccel_jax

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older JAX
        from jax.experimental.shard_map import shard_map

    assert jax.device_count() == 8, jax.devices()
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w": 0.5 * jax.random.normal(keys[0], (6, 4)), "b": jnp.zeros(4)}
    x = jax.random.normal(keys[1], (64, 6))
    y = jax.random.normal(keys[2], (64, 4))
    mesh = Mesh(np.array(jax.devices()), ("data",))
    HUTCHINSON = triaccel_jax.TriAccelConfig(estimator="hutchinson")

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)

    def train(axis_name):
        config = dataclasses.replace(HUTCHINSON, axis_name=axis_name)
        tx = triaccel_jax.triaccel(1e-2, config=config, curvature_every=1)

        def step(params, state, x, y):
            # Each replica holds its own copy of the state (leading axis of 1 here).
            state = jax.tree.map(lambda s: s[0], state)
            local_loss = lambda p: loss(p, x, y)
            grads = jax.lax.pmean(jax.grad(local_loss)(params), "data")
            updates, state = tx.update(grads, state, params, loss_fn=local_loss)
            params = optax.apply_updates(params, updates)
            return params, jax.tree.map(lambda s: s[None], state)

        step = jax.jit(
            shard_map(
                step,
                mesh=mesh,
                in_specs=(P(), P("data"), P("data"), P("data")),
                out_specs=(P(), P("data")),
                **({"check_vma": False} if hasattr(jax, "shard_map") else {"check_rep": False}),
            )
        )
        state = jax.tree.map(lambda s: jnp.stack([s] * 8), tx.init(params))
        p = params
        for _ in range(20):
            p, state = step(p, state, x, y)
        return state

    def spread(state):
        # Largest difference between any replica's copy of a state leaf and replica 0's.
        return max(
            float(np.max(np.abs(np.asarray(s, np.float64) - np.asarray(s[:1], np.float64))))
            for s in jax.tree.leaves(state)
            if s.size
        )

    local = spread(train(None))
    averaged = train("data")
    print("spread without axis_name", local, "with", spread(averaged))
    assert local > 1e-4, local  # local Hutchinson estimates: the replicas' states drift apart
    for replica in range(1, 8):
        chex.assert_trees_all_equal(
            jax.tree.map(lambda s: s[replica], averaged), jax.tree.map(lambda s: s[0], averaged)
        )

    # The averaged estimate is the global batch's: one step equals the single-device one.
    tx = triaccel_jax.scale_by_triaccel(config=dataclasses.replace(HUTCHINSON, axis_name="data"))

    def curvature(params, x, y):
        local_loss = lambda p: loss(p, x, y)
        grads = jax.lax.pmean(jax.grad(local_loss)(params), "data")
        _, state = tx.update(grads, tx.init(params), params, loss_fn=local_loss)
        return state[0].leaf_signals

    sharded = jax.jit(
        shard_map(
            curvature, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(),
            **({"check_vma": False} if hasattr(jax, "shard_map") else {"check_rep": False}),
        )
    )(params, x, y)
    single_tx = triaccel_jax.scale_by_triaccel(config=HUTCHINSON)
    _, single = single_tx.update(
        jax.grad(loss)(params, x, y), single_tx.init(params), params,
        loss_fn=lambda p: loss(p, x, y),
    )
    # On one step the noise is an exact cancellation (v_hat = m_hat**2): what is left is the
    # rounding of two means summed in different orders (one flat buffer on one device, leaf by
    # leaf under shard_map), a noise-to-signal ratio of order float32's epsilon.
    chex.assert_trees_all_close(
        sharded._replace(noise_to_signal=None),
        single[0].leaf_signals._replace(noise_to_signal=None),
        rtol=1e-5,
        atol=1e-9,
    )
    np.testing.assert_allclose(sharded.noise_to_signal, single[0].leaf_signals.noise_to_signal, atol=1e-6)
    print("ok")
    """
)


@pytest.mark.slow
def test_axis_name_keeps_data_parallel_replicas_identical():
    run_script(DATA_PARALLEL, devices=8, timeout=600)
