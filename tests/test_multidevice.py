"""Curvature across devices: with the batch sharded over 8 simulated CPU devices, ``jit`` averages
the Hutchinson and Fisher estimates like the gradient, so they equal the single-device ones.

XLA's device count is fixed when jax is imported, so the check runs in a subprocess.
"""

from __future__ import annotations

import textwrap

from simulated_devices import run_script

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
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
        tx = triaccel_jax.scale_by_triaccel(estimator=estimator, block_size=1, rho=1.0)

        @jax.jit
        def run(params, x, y):
            grads = jax.grad(loss)(params, x, y)
            _, state = tx.update(grads, tx.init(params), params, loss_fn=lambda p: loss(p, x, y))
            return state.curvature

        return run(params, x, y)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded = NamedSharding(mesh, P("data"))
    xs, ys = jax.device_put(x, sharded), jax.device_put(y, sharded)
    assert len(xs.sharding.device_set) == 8
    for estimator in ("fisher", "hutchinson"):
        single = estimate(estimator, x, y)
        multi = estimate(estimator, xs, ys)
        for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(multi), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    print("ok")
    """
)


def test_curvature_is_averaged_across_devices_like_gradients():
    run_script(SCRIPT, devices=8, timeout=300)
