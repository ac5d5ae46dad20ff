"""Sharded params: the optimizer state follows their shardings, and sharded training matches.

Eight simulated CPU devices in a 2 x 4 (``data`` x ``model``) mesh; the params are sharded over
``model`` (column- then row-parallel, Megatron style), the batch over ``data``. XLA's device
count is fixed when jax starts, so the checks run in a subprocess:

* every state leaf's sharding, at init and after 5 steps: moments as their params, the compressed
  curvature replicated;
* 5 steps equal the unsharded run;
* the compiled step gathers no whole sharded leaf: every all-gather in its HLO
  (``compiled.as_text()``) is one of the top-k candidate vectors, ``shards x k`` long;
* the partitioned compressed-EMA update equals the reference on many layouts (1-D to 4-D, conv
  kernels' channel pairs, two mesh axes on one dimension, ties among equal values).
"""

from __future__ import annotations

import textwrap

import pytest
from simulated_devices import run_script

SCRIPT = textwrap.dedent(
    """
    import re
    import chex, jax, jax.numpy as jnp, numpy as np, optax
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
    tx = triaccel_jax.triaccel(
        1e-2, curvature_every=1, config=triaccel_jax.TriAccelConfig(block_size=16, rho=0.05)
    )

    state = tx.init(sharded)
    moments = state[0]
    for name in ("mu", "nu"):
        for k, leaf in getattr(moments, name).items():
            assert leaf.sharding == sharded[k].sharding, (name, k, leaf.sharding)
    # The curvature stores and signals, laid end to end over the leaves, are replicated.
    for leaf in jax.tree.leaves((moments.curvature, moments.leaf_signals)):
        assert leaf.sharding == NamedSharding(mesh, P()), leaf.sharding

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
    difference = max(float(np.max(np.abs(np.asarray(p1[k]) - np.asarray(p8[k])))) for k in params)
    print(f"sharded vs one device, params after 5 steps: max abs difference {difference:.3g}")
    # The sharded gradient sums its rows in another order, and Adam's direction divides by a
    # small root where a gradient is small: within 1e-5, a thousandth of one step of 1e-2.
    chex.assert_trees_all_close(p1, p8, rtol=1e-5, atol=1e-5)
    for k in params:
        wanted = NamedSharding(mesh, specs[k])
        assert p8[k].sharding.is_equivalent_to(wanted, p8[k].ndim), (k, p8[k].sharding)
    for name in ("mu", "nu"):
        for k, leaf in getattr(s8[0], name).items():
            assert leaf.sharding.is_equivalent_to(sharded[k].sharding, leaf.ndim), (name, k)
    for leaf in jax.tree.leaves((s8[0].curvature, s8[0].leaf_signals)):
        assert leaf.sharding.is_fully_replicated, leaf.sharding

    # No whole sharded leaf is gathered: the only all-gathers are the top-k candidates, k from
    # each of the 4 shards of every leaf (k = ceil(rho * size)).
    hlo = step.lower(sharded, state, xs, ys).compile().as_text()
    gathered = sorted(
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in re.findall(r"= [a-z0-9]+\\[([0-9,]*)\\]\\{[0-9,]*\\} all-gather\\(", hlo)
    )
    candidates = sorted(2 * [4 * int(np.ceil(0.05 * v.size)) for v in params.values()])
    assert gathered == candidates, (gathered, candidates)
    print("all-gathered elements:", gathered)

    chex.assert_trees_all_close(s1, s8, rtol=1e-4, atol=1e-6)

    # The partitioned compressed-EMA update against the reference, layout by layout.
    from triaccel_jax.transforms import _compression as compression
    from triaccel_jax.transforms import _compression_sharded as compression_sharded

    layouts = [
        ((256,), P("model")),
        ((64, 256), P(None, "model")),
        ((256, 8), P("model", None)),
        ((64, 256), P("data", "model")),
        ((16, 8, 4), P(("data", "model"))),
        ((3, 3, 16, 32), P(None, None, None, "model")),  # conv kernel: channel-pair means
        ((3, 3, 16, 32), P(None, None, "model", "data")),
        ((1, 1, 16, 32), P(None, None, "model")),  # 1x1 conv: flat blocks
        ((6, 10), P("data")),  # 10 does not split 4 ways: only "data" shards it
        ((), P()),  # a scalar, replicated
    ]
    update = jax.jit(compression_sharded.update_compressed_ema)
    rng = np.random.default_rng(0)
    for shape, spec in layouts:
        for case in ("ties", "random"):
            h = rng.normal(size=shape).astype(np.float32)
            if case == "ties":  # mostly zeros and repeated values; the store starts empty
                h = np.where(rng.random(shape) < 0.8, 0.0, np.round(h)).astype(np.float32)
                store = compression.empty_store(shape, block_size=16, rho=0.05)
            else:
                old = rng.normal(size=shape).astype(np.float32)
                store = compression.compress_diagonal(jnp.asarray(old), block_size=16, rho=0.05)
            expected = compression.update_compressed_ema(store, jnp.asarray(h), 0.9)
            h_sharded = jax.device_put(h, NamedSharding(mesh, spec))
            replicated = jax.device_put(store, NamedSharding(mesh, P()))
            got = update(replicated, h_sharded, 0.9)
            np.testing.assert_array_equal(got.outlier_indices, expected.outlier_indices, err_msg=str((shape, spec, case)))
            np.testing.assert_allclose(got.outlier_values, expected.outlier_values, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(got.block_means, expected.block_means, rtol=1e-5, atol=1e-6)
            assert all(leaf.sharding.is_fully_replicated for leaf in got), (shape, spec)
    print("ok")
    """
)


@pytest.mark.slow
def test_state_follows_sharded_params_and_training_matches_one_device():
    print(run_script(SCRIPT, devices=8))


EXPLICIT_MESH_SCRIPT = textwrap.dedent(
    """
    import chex, jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import triaccel_jax

    # jax.make_mesh's default axes are Explicit (sharding in types): a sharded kernel and a
    # sharded bias go through the optimizer's update, and match the unsharded update.
    mesh = jax.make_mesh((8,), ("model",))
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    keys = jax.random.split(jax.random.key(0), 2)
    params = {"w": jax.random.normal(keys[0], (64, 32)), "b": jax.random.normal(keys[1], (32,))}
    tx = triaccel_jax.triaccel(1e-2, curvature_every=1)
    grads = jax.tree.map(lambda x: 0.1 * x, params)
    expected, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    specs = {"w": P(None, "model"), "b": P("model")}
    with jax.set_mesh(mesh):
        sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        state = tx.init(sharded)
        updates, state = jax.jit(tx.update)(jax.tree.map(lambda x: 0.1 * x, sharded), state, sharded)
    for k in params:
        assert jax.typeof(updates[k]).sharding.spec == specs[k], (k, jax.typeof(updates[k]))
    chex.assert_trees_all_close(updates, expected, rtol=1e-5, atol=1e-7)
    print("ok")
    """
)


@pytest.mark.slow
def test_params_on_an_explicit_axis_mesh_train_and_match_the_unsharded_update():
    run_script(EXPLICIT_MESH_SCRIPT, devices=8)
