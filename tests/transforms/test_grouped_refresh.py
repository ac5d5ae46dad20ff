"""The curvature refresh over flat buffers equals the per-leaf path it replaces.

The per-leaf path (one compressed-EMA update, summary and noise ratio per leaf) is the tested
reference: it still runs for leaves that may be sharded. The grouped path lays the leaves end to
end and must give the same stores (outlier indices exactly, values and means to float32 rounding)
and the same signals.
"""

from __future__ import annotations

import math

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import settings

import triaccel_jax
from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms import _compression_sharded as compression_sharded
from triaccel_jax.transforms import _refresh as refresh_lib
from triaccel_jax.transforms import _segments as segments_lib
from triaccel_jax.transforms._compression_grouped import CurvatureStores
from triaccel_jax.transforms._compression_grouped import StoreGroup

# Flat vectors, matrices, 3-D leaves, conv kernels stored per channel pair, 1x1 convs (flat
# blocks), scalars.
SHAPE = st.one_of(
    st.tuples(st.integers(1, 70)),
    st.tuples(st.integers(1, 9), st.integers(1, 9)),
    st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 5)),
    st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.integers(1, 4)),
    st.just(()),
)


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(SHAPE, min_size=1, max_size=6),
    block_size=st.integers(1, 9),
    rho=st.sampled_from([0.05, 0.3, 1.0]),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_grouped_update_is_the_per_leaf_reference(shapes, block_size, rho, ties, seed):
    rng = np.random.default_rng(seed)
    estimates, stores = [], []
    for shape in shapes:
        h = rng.normal(size=shape).astype(np.float32)
        old = rng.normal(size=shape).astype(np.float32)
        if ties:  # mostly zeros and repeated values: the tie-breaking is by the lower index
            h = np.where(rng.random(shape) < 0.7, 0.0, np.round(h)).astype(np.float32)
            old = np.round(old).astype(np.float32)
        estimates.append(jnp.asarray(h))
        stores.append(
            compression.compress_diagonal(jnp.asarray(old), block_size=block_size, rho=rho)
        )
    flat = CurvatureStores.of(stores)
    group = StoreGroup([tuple(s) for s in shapes], flat)
    h_flat = group.segments.concat(estimates)
    updated = jax.jit(lambda f, h: group.update(f, h, 0.9))(flat, h_flat)
    summary = group.summarize(updated)
    for i, (shape, store, h) in enumerate(zip(shapes, stores, estimates, strict=True)):
        expected = compression.update_compressed_ema(store, h, 0.9)
        got = updated.leaves()[i]
        np.testing.assert_array_equal(
            got.outlier_indices, expected.outlier_indices, err_msg=str(shape)
        )
        np.testing.assert_allclose(
            got.outlier_values, expected.outlier_values, rtol=1e-6, atol=1e-7
        )
        np.testing.assert_allclose(got.block_means, expected.block_means, rtol=1e-5, atol=1e-6)
        want = compression.summarize_diagonal(expected, shape)
        np.testing.assert_allclose(
            [summary.mean[i], summary.max_abs[i], summary.trace[i]], want, rtol=1e-5, atol=1e-6
        )
    assert bool(jnp.all(group.finite(updated)))


def test_a_non_finite_estimate_is_found_and_left_out_for_its_leaf_only():
    shapes = [(6,), (3, 3, 2, 2), (5, 4)]
    stores = [compression.empty_store(s, block_size=4, rho=0.2) for s in shapes]
    flat = CurvatureStores.of(stores)
    group = StoreGroup(shapes, flat)
    estimates = [jnp.ones(s) for s in shapes]
    estimates[1] = estimates[1].at[0, 0, 1, 1].set(jnp.nan)
    candidate = group.update(flat, group.segments.concat(estimates), 0.5)
    keep = group.finite(candidate)
    assert keep.tolist() == [True, False, True]
    kept = group.select(keep, candidate, flat).leaves()
    chex.assert_trees_all_equal(kept[1], stores[1])
    np.testing.assert_allclose(kept[0].block_means, 0.5)
    np.testing.assert_allclose(kept[2].block_means, 0.5)


def test_segments_locate_and_reduce_every_leaf():
    shapes = [(3,), (1,), (2, 2), (5,)]
    segments = segments_lib.Segments(shapes)
    assert segments.ids().tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3]
    assert segments.local(segments.ids()).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 1, 2, 3, 4]
    leaves = [jnp.arange(math.prod(s), dtype=jnp.float32).reshape(s) for s in shapes]
    np.testing.assert_allclose(segments.mean(segments.concat(leaves)), [1.0, 0.0, 1.5, 2.0])
    for got, leaf in zip(segments.split(segments.concat(leaves)), leaves, strict=True):
        chex.assert_trees_all_equal(got, leaf)
    with pytest.raises(ValueError, match="needs an element"):
        segments_lib.Segments([(3,), (0,)])


# Each transform, with both estimators; the per-leaf path is forced by declaring no leaf whole.
TRANSFORMS = {
    "observer, fisher": lambda: optax.chain(
        triaccel_jax.curvature_signals(curvature_every=2), optax.sgd(0.1)
    ),
    "observer, hutchinson": lambda: optax.chain(
        triaccel_jax.curvature_signals(
            curvature_every=2, config=triaccel_jax.TriAccelConfig(estimator="hutchinson")
        ),
        optax.sgd(0.1),
    ),
    "triaccel, fisher": lambda: triaccel_jax.triaccel(
        0.05, curvature_every=1, config=triaccel_jax.TriAccelConfig(block_size=4, rho=0.2)
    ),
    "triaccel, block scale": lambda: triaccel_jax.triaccel(
        0.05, curvature_every=1, config=triaccel_jax.TriAccelConfig(block_size=4, scale="block")
    ),
}


def _train(make, steps=6):
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "conv": jax.random.normal(keys[0], (3, 3, 2, 4)) * 0.3,
        "dense": jax.random.normal(keys[1], (8, 5)) * 0.3,
        "bias": jnp.zeros(5),
        # At or above GROUPED_LEAF_LIMIT: folded leaf by leaf beside the others, laid together.
        "wide": jax.random.normal(keys[3], (260, 128)) * 0.01,
        "count": jnp.int32(0),
    }
    x = jax.random.normal(keys[2], (16, 8))

    def loss(p):
        hidden = jnp.tanh(x @ p["dense"] + p["bias"])
        return jnp.mean(hidden**2) + jnp.sum(p["conv"] ** 2) * 0.1 + jnp.sum(jnp.sin(p["wide"]))

    tx = make()
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        # The integer leaf's "gradient" is an integer zero: untrained, it passes through.
        grads = {**jax.grad(loss, allow_int=True)(params), "count": jnp.int32(0)}
        updates, state = tx.update(grads, state, params, loss_fn=loss)
        return optax.apply_updates(params, updates), state

    for _ in range(steps):
        params, state = step(params, state)
    return params, state


@pytest.mark.standard_promotion("optax.sgd promotes its learning rate against the updates")
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_the_grouped_transform_trains_as_the_per_leaf_path(name, monkeypatch):
    # Three small leaves beside a large one would all keep the per-leaf path by default
    # (GROUPED_MIN_LEAVES): lowered, so that the small ones are laid out flat beside it.
    monkeypatch.setattr(refresh_lib, "GROUPED_MIN_LEAVES", 2)
    grouped = _train(TRANSFORMS[name])
    monkeypatch.setattr(compression_sharded, "is_known_whole", lambda x: False)
    per_leaf = _train(TRANSFORMS[name])
    chex.assert_trees_all_close(grouped, per_leaf, rtol=2e-5, atol=1e-6)
    (state,) = triaccel_jax.transforms.find_signal_states(grouped[1])
    assert int(state.curvature_count) >= 3
    assert sorted(state.leaf_paths()) == ["bias", "conv", "dense", "wide"]
    assert 260 * 128 >= refresh_lib.GROUPED_LEAF_LIMIT > 8 * 5


def test_a_few_small_leaves_beside_large_ones_keep_the_per_leaf_path():
    small, large = jnp.zeros((4, 8)), jnp.zeros((refresh_lib.GROUPED_LEAF_LIMIT,))
    few = refresh_lib.GROUPED_MIN_LEAVES - 1
    assert refresh_lib.grouped([small] * few) == [True] * few
    assert refresh_lib.grouped([small] * few + [large]) == [False] * (few + 1)
    many = refresh_lib.GROUPED_MIN_LEAVES
    assert refresh_lib.grouped([large] + [small] * many) == [False] + [True] * many
