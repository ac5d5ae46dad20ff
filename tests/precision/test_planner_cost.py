"""The planner's cost model: sum_i h_i * w_i**2 from the compressed store, and real byte savings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import triaccel_jax
from triaccel_jax.policy import _dtypes as dtypes
from triaccel_jax.precision import _leaf_cost as leaf_cost
from triaccel_jax.precision import _planner as planner
from triaccel_jax.transforms import _compression as compression

U2_6 = dtypes.FORMATS["bf16"].unit_roundoff ** 2 / 6
SHAPE = (64, 64)


def _concentrated_and_spread():
    """Two leaves with equal ``sum w**2``: one's curvature sits on its 1% largest weights."""
    rng = np.random.default_rng(0)
    size = SHAPE[0] * SHAPE[1]
    hot = rng.choice(size, 41, replace=False)  # 41 = ceil(0.01 * 4096): the store's top-k
    w_conc = np.full(size, 0.01, np.float32)
    w_conc[hot] = 1.0
    h_conc = np.full(size, 1e-3, np.float32)
    h_conc[hot] = 1.0
    sum_sq = float(np.sum(w_conc.astype(np.float64) ** 2))
    w_spread = np.full(size, np.sqrt(sum_sq / size), np.float32)
    h_spread = np.full(size, 0.05, np.float32)
    params = {"concentrated": jnp.asarray(w_conc.reshape(SHAPE))}
    params["spread"] = jnp.asarray(w_spread.reshape(SHAPE))
    curvature = {"concentrated": h_conc.reshape(SHAPE), "spread": h_spread.reshape(SHAPE)}
    return params, curvature


def _trained_signals(params, curvature):
    """Signals of a real triaccel state whose (Fisher) curvature EMA holds ``curvature``."""
    config = triaccel_jax.TriAccelConfig(block_size=64, rho=0.01)
    tx = triaccel_jax.scale_by_triaccel(config=config, curvature_every=1)
    state = tx.init(params)
    grads = jax.tree.map(lambda h: jnp.sqrt(jnp.asarray(h)), curvature)  # Fisher: h = g**2
    _, state = tx.update(grads, state, params)
    return triaccel_jax.signals(state)


def test_block_wise_cost_ranks_a_leaf_with_curvature_on_its_largest_weights():
    params, curvature = _concentrated_and_spread()
    exact = {p: float(np.sum(curvature[p] * np.square(np.asarray(params[p])))) for p in params}
    assert exact["concentrated"] > 10 * exact["spread"]  # rounding it costs far more
    signals = _trained_signals(params, curvature)
    means = {p: signals[p]["mean_curvature"] for p in params}
    sum_sq = {p: float(jnp.sum(jnp.square(params[p]))) for p in params}
    # ...yet the leaf means say the opposite.
    assert means["concentrated"] * sum_sq["concentrated"] < means["spread"] * sum_sq["spread"] / 2

    # Room for the spread leaf alone, by the true costs; the leaf-mean costs fit the
    # concentrated leaf first, and then the spread one no longer fits.
    budget = 6e-6
    assert U2_6 * exact["spread"] < budget < U2_6 * exact["concentrated"]
    policy = planner.plan_precision(signals, params, budget=budget).policy
    assert policy.compute("spread") == "bf16" and policy.compute("concentrated") == "fp32", policy
    predicted = float(policy.reasons["spread"].split("increase ")[1].split(" ")[0])
    assert predicted == pytest.approx(U2_6 * exact["spread"], rel=1e-2)

    by_means = {
        p: {k: v for k, v in r.items() if k != "curvature_store"} for p, r in signals.items()
    }
    old = planner.plan_precision(by_means, params, budget=budget).policy
    assert old.compute("concentrated") == "bf16" and old.compute("spread") == "fp32", old


@pytest.mark.parametrize(
    ("shape", "block_size", "rho"),
    [((64, 64), 64, 0.01), ((100, 7), 64, 0.05), ((37,), 8, 0.1), ((3, 3, 4, 5), 64, 0.02)],
)
def test_weighted_sum_is_that_of_the_expanded_store(shape, block_size, rho):
    keys = jax.random.split(jax.random.key(0), 2)
    h = jax.random.exponential(keys[0], shape) ** 3
    w = jax.random.normal(keys[1], shape)
    store = compression.compress_diagonal(h, block_size=block_size, rho=rho)
    expanded = compression.expand_diagonal(store, shape)
    got = float(leaf_cost.weighted_curvature_sum(store, w))
    np.testing.assert_allclose(got, float(jnp.sum(expanded * w**2)), rtol=1e-5)
    # With every entry kept exactly the sum is the exact one.
    exact = compression.compress_diagonal(h, block_size=block_size, rho=1.0)
    np.testing.assert_allclose(
        float(leaf_cost.weighted_curvature_sum(exact, w)), float(jnp.sum(h * w**2)), rtol=1e-5
    )


def test_signals_hold_the_bias_corrected_store():
    params = {"w": jnp.ones((16, 8))}
    config = triaccel_jax.TriAccelConfig(block_size=16)
    tx = triaccel_jax.scale_by_triaccel(config=config, curvature_every=1, curvature_decay=0.9)
    state = tx.init(params)
    g = jnp.arange(128.0).reshape(16, 8) / 64
    for _ in range(2):
        _, state = tx.update({"w": g}, state, params)
    record = triaccel_jax.signals(state)["w"]
    # Two equal Fisher estimates: the bias-corrected EMA is g**2 itself (block means, top-k).
    np.testing.assert_allclose(
        record["curvature_store"].block_means, jnp.mean((g**2).reshape(8, 16), axis=1), rtol=1e-5
    )
    np.testing.assert_allclose(record["curvature_store"].outlier_values[0], (127 / 64) ** 2, 1e-5)
    assert record["mean_curvature"] == pytest.approx(float(jnp.mean(g**2)), rel=1e-5)


def test_a_store_of_another_shape_is_named():
    params = {"w": jnp.ones((64, 64))}
    store = compression.compress_diagonal(jnp.ones((3, 3, 4, 5)), block_size=8, rho=0.1)
    signals = {"w": {"mean_curvature": 1.0, "curvature_store": store}}
    with pytest.raises(ValueError, match=r"signals\['w'\].*curvature_store.*\(64, 64\)"):
        planner.plan_precision(signals, params)


def _uniform(names, size=4096):
    params = {n: jnp.full((size // 64, 64), 0.1) for n in names}
    return params, {n: {"mean_curvature": 1.0, "noise_to_signal": 0.0} for n in names}


def test_fp8_is_counted_at_the_bf16_bytes_it_is_carried_in():
    params, signals = _uniform(["w"])
    # fp8 saves nothing over bf16 (both are 2 bytes an element), so it is never taken for memory.
    policy = planner.plan_precision(
        signals, params, budget=float("inf"), allowed=("bf16", "fp8_e4m3")
    ).policy
    assert policy.compute("w") == "bf16", policy
    # Alone, fp8 saves what its bf16 carrier saves: 2 bytes an element, not 3.
    policy = planner.plan_precision(
        signals, params, budget=float("inf"), allowed=("fp8_e4m3",)
    ).policy
    assert policy.compute("w") == "fp8_e4m3"
    assert policy.reasons["w"].endswith(f"saves {2 * 4096} B"), policy.reasons["w"]
