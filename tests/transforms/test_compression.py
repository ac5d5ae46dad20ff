"""The compressed curvature store: exact block means, exact top-k, exact summaries."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import triaccel_jax
from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms import _compression_sharded as compression_sharded


def test_block_means_and_top_k_are_exact_for_flat_leaf():
    h = jax.random.normal(jax.random.key(1), (10, 7))  # 70 elements: a short last block
    store = triaccel_jax.transforms.compress_diagonal(h, block_size=16, rho=0.05)
    flat = np.asarray(h).reshape(-1)
    # ceil(70 / 16) = 5 blocks of equal length 14.
    expected_means = [flat[i : i + 14].mean() for i in range(0, 70, 14)]
    np.testing.assert_allclose(store.block_means, expected_means, rtol=1e-6)
    k = math.ceil(0.05 * 70)
    assert store.outlier_indices.shape == (k,) == store.outlier_values.shape
    expected_indices = np.argsort(-np.abs(flat))[:k]
    assert set(np.asarray(store.outlier_indices).tolist()) == set(expected_indices.tolist())
    np.testing.assert_array_equal(store.outlier_values, flat[np.asarray(store.outlier_indices)])


def test_conv_kernel_is_averaged_per_channel_pair():
    h = jax.random.uniform(jax.random.key(2), (3, 3, 4, 5))
    store = triaccel_jax.transforms.compress_diagonal(h, block_size=64, rho=0.01)
    assert store.block_means.shape == (4, 5)
    np.testing.assert_allclose(store.block_means, np.asarray(h).mean(axis=(0, 1)), rtol=1e-6)


def test_one_by_one_conv_uses_flat_blocks():
    assert not compression.uses_channel_pairs((1, 1, 16, 32))
    store = triaccel_jax.transforms.compress_diagonal(
        jnp.ones((1, 1, 16, 32)), block_size=64, rho=0.01
    )
    assert store.block_means.shape == (8,)


@pytest.mark.parametrize(("size", "rho", "k"), [(100, 0.07, 7), (1, 0.01, 1), (10, 1.0, 10)])
def test_number_of_outliers(size, rho, k):
    assert compression.num_outliers(size, rho) == k


def test_expand_keeps_outliers_and_block_means_elsewhere():
    h = jnp.array([1.0, 3.0, 0.0, 8.0, 2.0, 2.0])
    store = triaccel_jax.transforms.compress_diagonal(
        h, block_size=4, rho=0.2
    )  # 2 blocks of 3, k = 2
    full = triaccel_jax.transforms.expand_diagonal(store, (6,))
    np.testing.assert_allclose(full, [4 / 3, 3.0, 4 / 3, 8.0, 4.0, 4.0], rtol=1e-6)


@pytest.mark.parametrize("shape", [(70,), (3, 3, 4, 5), (5, 13)])
def test_summary_is_exact(shape):
    h = jax.random.normal(jax.random.key(3), shape)
    store = triaccel_jax.transforms.compress_diagonal(h, block_size=8, rho=0.02)
    summary = compression.summarize_diagonal(store, shape)
    np.testing.assert_allclose(summary.trace, jnp.sum(h), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(summary.mean, jnp.mean(h), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(summary.max_abs, jnp.max(jnp.abs(h)), rtol=1e-6)


def test_ema_of_block_means_is_exact_and_outliers_follow_ema():
    shape = (40,)
    first = jax.random.uniform(jax.random.key(4), shape)
    second = jax.random.uniform(jax.random.key(5), shape)
    store = compression.empty_store(shape, block_size=8, rho=0.1)
    store = compression.update_compressed_ema(store, first, 0.9)
    store = compression.update_compressed_ema(store, second, 0.9)
    exact_ema = 0.9 * 0.1 * first + 0.1 * second
    expected_means = np.asarray(exact_ema).reshape(5, 8).mean(axis=1)  # 5 blocks of 8
    np.testing.assert_allclose(store.block_means, expected_means, rtol=1e-6)
    # The largest EMA entry is kept, and its value is the exact EMA when it was an outlier before.
    top = int(np.argmax(exact_ema))
    assert top in np.asarray(store.outlier_indices).tolist()
    chex.assert_type([store.block_means, store.outlier_indices], [jnp.float32, jnp.int32])


@pytest.mark.parametrize("shape", [(70,), (3, 3, 4, 5), (5, 13)])
def test_partitioned_update_is_the_reference_on_one_device(shape):
    # Unpartitioned (one device), the custom-partitioned update runs the reference itself.
    old = jax.random.normal(jax.random.key(6), shape)
    h = jax.random.normal(jax.random.key(7), shape)
    store = triaccel_jax.transforms.compress_diagonal(old, block_size=8, rho=0.1)
    expected = jax.jit(compression.update_compressed_ema)(store, h, 0.9)
    got = jax.jit(compression_sharded.update_compressed_ema)(store, h, 0.9)
    chex.assert_trees_all_equal(got, expected)


def test_partitioned_update_under_vmap_is_the_batched_reference():
    # custom_partitioning has no batching rule of its own: an ensemble of optimizers still works.
    stores = jax.vmap(
        lambda x: triaccel_jax.transforms.compress_diagonal(x, block_size=4, rho=0.2)
    )(jax.random.normal(jax.random.key(8), (3, 6, 4)))
    h = jax.random.normal(jax.random.key(9), (3, 6, 4))
    got = jax.vmap(compression_sharded.update_compressed_ema, in_axes=(0, 0, None))(stores, h, 0.5)
    for i in range(3):
        store_i = jax.tree.map(lambda x, i=i: x[i], stores)
        expected = compression.update_compressed_ema(store_i, h[i], 0.5)
        chex.assert_trees_all_equal(jax.tree.map(lambda x, i=i: x[i], got), expected)
