"""Sharded params: the optimizer state follows their shardings, and sharded training matches.

Eight simulated CPU devices in a 2 x 4 (``data`` x ``model``) mesh; the params are sharded over
``model`` (column- then row-parallel, Megatron style), the batch over ``data``. XLA's device
count is fixed when jax starts, so the check runs in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import triaccel_jax

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(keys[0], (64, 256)) * 0.1,
        "w2": jax.random.normal(keys[1], (256, 8)) * 0.1,
        "b": jnp.zeros(256),
    }
    specs = {"w1": P(None, "model"), "w2": P("model", None), "b": P("model")}
    sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x = jax.random.normal(keys[2], (32, 64))
    y = jax.random.normal(keys[3], (32, 8))
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    tx = triaccel_jax.triaccel(1e-2, curvature_every=1, block_size=16, rho=0.05)

    state = tx.init(sharded)
    moments = state[0]
    for name in ("mu", "nu"):
        for k, leaf in getattr(moments, name).items():
            assert leaf.sharding == sharded[k].sharding, (name, k, leaf.sharding)
    for k, store in moments.curvature.items():
        for leaf in store:
            assert leaf.sharding == NamedSharding(mesh, P()), (k, leaf.sharding)

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"] - y) ** 2)

    @jax.jit
    def step(p, s, x, y):
        updates, s = tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, updates), s

    p1, s1 = params, tx.init(params)
    p8, s8 = sharded, state
    for _ in range(5):
        p1, s1 = step(p1, s1, x, y)
        p8, s8 = step(p8, s8, xs, ys)
    for k in params:
        np.testing.assert_allclose(p1[k], p8[k], rtol=1e-5, atol=1e-6)
        wanted = NamedSharding(mesh, specs[k])
        assert p8[k].sharding.is_equivalent_to(wanted, p8[k].ndim), (k, p8[k].sharding)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s8), strict=True):
        a, b = np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    print("ok")
    """
)


def test_state_follows_sharded_params_and_training_matches_one_device():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok")
