"""TriAccelConfig(scale="block"): one curvature step scale per block of the compressed store."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax

BLOCK = triaccel_jax.TriAccelConfig(scale="block", block_size=2)


def _numpy_block_scales(curvatures, block_size, alpha, low, high):
    """Reference: per-leaf lists of element-wise scales from full curvature diagonals (1-D)."""
    leaf_means = [float(np.mean(c)) for c in curvatures]
    ref = float(np.median(leaf_means))
    out = []
    for c in curvatures:
        scale = np.empty_like(c)
        for start in range(0, c.size, block_size):
            block = c[start : start + block_size]
            scale[start : start + block_size] = np.clip((ref / block.mean()) ** alpha, low, high)
        out.append(scale)
    return out


def test_default_is_leaf_and_unknown_scale_is_refused():
    assert triaccel_jax.TriAccelConfig().scale == "leaf"
    with pytest.raises(ValueError, match="scale"):
        triaccel_jax.TriAccelConfig(scale="element")


def test_first_update_matches_a_numpy_reference_with_a_short_last_block():
    # Three leaves (odd sizes: the last block of "a" and "c" is one element long). Adam's first
    # step with eps=0 is sign(g), so the update is exactly the element's block scale.
    grads = {
        "a": jnp.array([0.1, -0.3, 2.0, 1.0, -0.05]),
        "b": jnp.array([1.0, 1.0, -1.0, 1.0]),
        "c": jnp.array([0.2, 0.2, 0.02]),
    }
    params = jax.tree.map(jnp.ones_like, grads)
    tx = triaccel_jax.scale_by_triaccel(
        eps=0.0, alpha=0.5, min_scale=0.2, max_scale=5.0, config=BLOCK
    )
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    names = sorted(grads)
    expected = _numpy_block_scales(
        [np.square(np.asarray(grads[k])) for k in names], 2, 0.5, 0.2, 5.0
    )
    for name, scale in zip(names, expected, strict=True):
        np.testing.assert_allclose(updates[name], np.sign(grads[name]) * scale, rtol=1e-5)
    # The per-leaf signal is unchanged by the option.
    leaf = triaccel_jax.scale_by_triaccel(eps=0.0, alpha=0.5, min_scale=0.2, max_scale=5.0)
    _, leaf_state = leaf.update(grads, leaf.init(params), params)
    ours, theirs = triaccel_jax.signals(state), triaccel_jax.signals(leaf_state)
    for name in names:
        assert ours[name]["step_scale"] == pytest.approx(theirs[name]["step_scale"])


def test_later_steps_use_the_bias_corrected_ema_of_each_block():
    # curvature_every=1, three steps of different gradients: each block's curvature is the
    # bias-corrected EMA of its mean g**2, the reference the median of the leaves' corrected means.
    # A store read without the bias correction would be off by 1 / (1 - decay**k) here.
    decay, b1, b2 = 0.9, 0.9, 0.999
    rng = np.random.default_rng(0)
    steps = [
        {"a": rng.normal(size=6).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
        for _ in range(3)
    ]
    params = {"a": jnp.zeros(6), "b": jnp.zeros(4)}
    # Only "a" is the sharp leaf; "c" adds a third leaf so the median is a single leaf mean.
    params["c"] = jnp.zeros(2)
    for g in steps:
        g["c"] = np.full(2, 0.3, np.float32)
    tx = triaccel_jax.scale_by_triaccel(
        b1=b1,
        b2=b2,
        eps=1e-8,
        curvature_every=1,
        curvature_decay=decay,
        alpha=0.75,
        min_scale=0.3,
        max_scale=3.0,
        config=BLOCK,
    )
    state = tx.init(params)
    update = jax.jit(tx.update)
    names = ("a", "b", "c")
    m = {k: np.zeros_like(np.asarray(params[k])) for k in names}
    v = {k: np.zeros_like(m[k]) for k in names}
    ema = {k: np.zeros_like(m[k]) for k in names}
    for t, g in enumerate(steps, start=1):
        updates, state = update({k: jnp.asarray(x) for k, x in g.items()}, state, params)
        curvatures = []
        for k in names:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            # A full-diagonal EMA: its block means are exactly the EMA of the block means.
            ema[k] = decay * ema[k] + (1 - decay) * g[k] ** 2
            curvatures.append(ema[k] / (1 - decay**t))
        scales = _numpy_block_scales(curvatures, 2, 0.75, 0.3, 3.0)
        for k, scale in zip(names, scales, strict=True):
            direction = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + 1e-8)
            np.testing.assert_allclose(updates[k], scale * direction, rtol=2e-5, atol=1e-7)


@pytest.mark.slow
def test_uniform_curvature_within_each_leaf_is_the_leaf_scale():
    # |g| constant over each leaf: every block mean equals its leaf mean, so both options agree.
    key = jax.random.key(1)
    params = {"w": jnp.zeros((4, 8)), "v": jnp.zeros(16), "u": jnp.zeros(7)}
    leaf = triaccel_jax.triaccel(1e-2, curvature_every=2, weight_decay=1e-3)
    block = triaccel_jax.triaccel(1e-2, curvature_every=2, weight_decay=1e-3, config=BLOCK)
    s_leaf, s_block = leaf.init(params), block.init(params)
    for step in range(6):
        signs = jax.tree.map(
            lambda p, k: jnp.sign(jax.random.normal(k, p.shape)) + 0.0,
            params,
            {
                "w": jax.random.fold_in(key, 3 * step),
                "v": jax.random.fold_in(key, 3 * step + 1),
                "u": jax.random.fold_in(key, 3 * step + 2),
            },
        )
        sizes = {"w": 0.01 * (step + 1), "v": 1.0, "u": 30.0 / (step + 1)}
        grads = {k: signs[k] * sizes[k] for k in params}
        u_leaf, s_leaf = leaf.update(grads, s_leaf, params)
        u_block, s_block = block.update(grads, s_block, params)
        chex.assert_trees_all_close(u_block, u_leaf, rtol=1e-5, atol=1e-9)
        params = optax.apply_updates(params, u_leaf)


def test_conv_kernel_is_scaled_per_channel_pair():
    # A (3, 3, 2, 2) kernel's store holds one mean per (in, out) pair: each pair gets its own
    # scale, constant over the 3x3 taps. The bias "b" sets the median with the kernel's mean.
    pair_grad = np.array([[0.1, 1.0], [2.0, 0.5]], np.float32)
    kernel_grad = np.broadcast_to(pair_grad, (3, 3, 2, 2)).copy()
    kernel_grad[0, 0] *= 3.0  # within a pair the taps differ; only the pair's mean counts
    grads = {"kernel": jnp.asarray(kernel_grad), "bias": jnp.full(4, 0.7)}
    params = jax.tree.map(jnp.zeros_like, grads)
    tx = triaccel_jax.scale_by_triaccel(
        eps=0.0, alpha=0.5, min_scale=0.1, max_scale=10.0, config=BLOCK
    )
    updates, _ = tx.update(grads, tx.init(params), params)
    pair_mean = np.mean(np.square(kernel_grad), axis=(0, 1))
    bias_mean = 0.49  # the bias has 4 elements and block_size 2: two equal blocks
    ref = float(np.median([pair_mean.mean(), bias_mean]))
    expected = np.sqrt(ref / pair_mean)
    np.testing.assert_allclose(
        updates["kernel"], np.broadcast_to(expected, (3, 3, 2, 2)), rtol=1e-5
    )
    np.testing.assert_allclose(updates["bias"], np.full(4, np.sqrt(ref / bias_mean)), rtol=1e-5)


@pytest.mark.standard_promotion(
    "optax promotes inside its own transforms (injected hyperparameters, adamw)"
)
def test_alpha_zero_is_adamw_and_hyperparameters_are_injectable():
    params = {"w": jax.random.normal(jax.random.key(0), (5, 3)), "b": jnp.zeros(3)}
    grads = jax.tree.map(lambda p: jnp.cos(3 * p) + 0.1, params)
    ours = optax.inject_hyperparams(triaccel_jax.triaccel)(
        learning_rate=1e-2, alpha=0.0, weight_decay=1e-2, config=BLOCK
    )
    adamw = optax.adamw(1e-2, weight_decay=1e-2, eps=1e-8)
    s1, s2 = jax.jit(ours.init)(params), adamw.init(params)
    update = jax.jit(ours.update)
    for _ in range(4):
        u1, s1 = update(grads, s1, params)
        u2, s2 = adamw.update(grads, s2, params)
        chex.assert_trees_all_close(u1, u2, rtol=1e-5, atol=1e-8)
    # Turning alpha up in the state changes the next update without a new trace.
    s1.hyperparams["alpha"] = jnp.asarray(1.0)
    u1, _ = update(grads, s1, params)
    u2, _ = adamw.update(grads, s2, params)
    assert not np.allclose(u1["w"], u2["w"], rtol=1e-3)


def test_empty_and_untrained_leaves_pass_through():
    params = {"w": jnp.ones(5), "empty": jnp.zeros((0, 3)), "step": jnp.array(3, jnp.int32)}
    grads = {"w": jnp.full(5, 0.5), "empty": jnp.zeros((0, 3)), "step": jnp.array(1, jnp.int32)}
    tx = triaccel_jax.triaccel(0.1, config=BLOCK)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    chex.assert_shape(updates["empty"], (0, 3))
    chex.assert_type(updates["step"], jnp.int32)
    chex.assert_tree_all_finite(updates["w"])
