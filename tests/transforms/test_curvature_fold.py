"""The curvature refresh keeps an estimate exactly when the earlier, longer rule did.

The refresh once checked every element of the estimate for finiteness besides the new store;
it now reads two small max-abs reductions of the new store (fewer kernels to compile). Here the
fold is compared, store and decision, with the earlier rule written out, on estimates holding
NaN, infinities and finite values that overflow a block sum, for the block and the
channel-pair layouts.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms import _refresh as refresh_lib

DECAY = 0.9
BIG = float(np.finfo(np.float32).max)
# (flat position, value) written into an otherwise clean estimate.
INJECTIONS = {
    "clean": [],
    "nan": [(3, math.nan)],
    "inf": [(0, math.inf)],
    "minus_inf": [(17, -math.inf)],
    "inf_and_minus_inf_in_one_block": [(0, math.inf), (1, -math.inf)],
    "finite_but_the_block_sum_overflows": [(4, BIG), (5, BIG)],
    "largest_finite_alone": [(9, BIG)],
}
LAYOUTS = {
    "blocks": ((6, 5), 4, 0.1),
    "one_element_blocks_all_kept": ((7,), 1, 1.0),
    "conv_channel_pairs": ((3, 3, 2, 2), 4, 0.2),
}


def _earlier_rule(store, diagonal):
    """The fold's decision as it was written before: every element of the estimate finite, and
    every floating-point entry of the candidate store finite."""
    candidate = compression.update_compressed_ema(store, diagonal, DECAY)
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(candidate)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    keep = jnp.all(jnp.isfinite(diagonal)) & jnp.all(jnp.stack(checks))
    return keep, jax.tree.map(lambda new, old: jnp.where(keep, new, old), candidate, store)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=list(LAYOUTS))
@pytest.mark.parametrize("injection", INJECTIONS.values(), ids=list(INJECTIONS))
def test_fold_keeps_and_stores_what_the_earlier_rule_did(layout, injection):
    shape, block_size, rho = layout
    size = math.prod(shape)
    rng = np.random.default_rng(size)
    store = compression.compress_diagonal(
        jnp.asarray(rng.uniform(0.1, 2.0, shape), jnp.float32), block_size=block_size, rho=rho
    )
    estimate = rng.uniform(0.0, 3.0, size).astype(np.float32)
    for position, value in injection:
        estimate[position % size] = value
    estimate = jnp.asarray(estimate.reshape(shape))
    expected_keep, expected_store = jax.jit(_earlier_rule)(store, estimate)

    dropped = jnp.asarray(1, jnp.int32)
    signal = refresh_lib.LeafSignals(*([jnp.zeros((), jnp.float32)] * 5), dropped)
    folded = jax.jit(lambda s, h, g: refresh_lib._fold(s, h, g, shape, jnp.int32(3), DECAY))(
        store, estimate, signal
    )

    if any(not math.isfinite(value) for _, value in injection):
        assert not expected_keep
    # The same program but for the check: a sum may round differently in the last place.
    chex.assert_trees_all_close(folded.store, expected_store, rtol=1e-6, atol=0.0)
    np.testing.assert_array_equal(folded.store.outlier_indices, expected_store.outlier_indices)
    np.testing.assert_array_equal(folded.dropped, dropped if expected_keep else dropped + 1)


def test_an_overflowing_block_sum_is_dropped_and_a_large_finite_entry_kept():
    """Both sides of the edge the rule must get right, on the block layout."""
    shape, block_size, rho = LAYOUTS["blocks"]
    store = compression.empty_store(shape, block_size=block_size, rho=rho)
    for injection, kept in (
        (INJECTIONS["finite_but_the_block_sum_overflows"], False),
        (INJECTIONS["largest_finite_alone"], True),
    ):
        estimate = np.ones(math.prod(shape), np.float32)
        for position, value in injection:
            estimate[position] = value
        estimate = jnp.asarray(estimate.reshape(shape))
        expected_keep, _ = jax.jit(_earlier_rule)(store, estimate)
        assert bool(expected_keep) is kept
        signal = refresh_lib.LeafSignals(
            *([jnp.zeros((), jnp.float32)] * 5), jnp.zeros((), jnp.int32)
        )
        folded = refresh_lib._fold(store, estimate, signal, shape, jnp.int32(1), DECAY)
        assert int(folded.dropped) == (0 if kept else 1)
