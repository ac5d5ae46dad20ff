"""Applying a policy: compute copies, masters, stochastic updates and state conversion."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax

PARAMS = {
    "conv": jax.random.normal(jax.random.key(0), (3, 3, 4, 8)),
    "dense": {"kernel": jax.random.normal(jax.random.key(1), (32, 10)), "bias": jnp.zeros(10)},
    "step": jnp.array(3, jnp.int32),
}
POLICY = triaccel_jax.PrecisionPolicy.from_patterns(
    PARAMS, {"conv": ("bf16", "bf16"), "dense/kernel": ("fp8_e4m3", "bf16")}
)


def test_cast_params_follows_policy_and_keeps_other_leaves():
    compute = triaccel_jax.cast_params(PARAMS, POLICY)
    assert compute["conv"].dtype == jnp.bfloat16
    assert compute["dense"]["bias"].dtype == jnp.float32
    assert compute["step"] is PARAMS["step"]
    np.testing.assert_array_equal(compute["conv"], PARAMS["conv"].astype(jnp.bfloat16))


def test_fp8_compute_copy_lies_on_the_scaled_fp8_grid():
    kernel = PARAMS["dense"]["kernel"]
    compute = triaccel_jax.cast_params(PARAMS, POLICY)["dense"]["kernel"]
    assert compute.dtype == jnp.bfloat16  # fp8 values are carried in bf16
    scale = float(jnp.max(jnp.abs(kernel))) / 448.0
    on_grid = (compute.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn)
    np.testing.assert_allclose(
        on_grid.astype(jnp.float32) * scale, compute.astype(jnp.float32), rtol=1e-2
    )
    error = jnp.abs(compute.astype(jnp.float32) - kernel)
    assert float(jnp.max(error / (jnp.abs(kernel) + scale))) <= 2.0**-3  # fp8 e4m3: 3 mantissa bits


def test_gradients_flow_through_the_cast_to_fp32_masters():
    def loss(params):
        compute = triaccel_jax.cast_params(params, POLICY)
        return jnp.sum(compute["conv"].astype(jnp.float32) ** 2) + jnp.sum(
            compute["dense"]["kernel"].astype(jnp.float32)
        )

    grads = jax.grad(loss, allow_int=True)(PARAMS)
    assert grads["conv"].dtype == jnp.float32
    np.testing.assert_allclose(
        grads["conv"], 2 * PARAMS["conv"].astype(jnp.bfloat16).astype(jnp.float32), rtol=1e-6
    )
    assert grads["dense"]["kernel"].dtype == jnp.float32


def test_stochastic_cast_needs_key_and_is_unbiased():
    params = {"w": jnp.full((50_000,), 1.0 + 2.0**-9)}
    policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16")
    with pytest.raises(ValueError, match="key"):
        triaccel_jax.cast_params(params, policy, rounding="stochastic")
    rounded = triaccel_jax.cast_params(params, policy, rounding="stochastic", key=jax.random.key(0))
    assert abs(float(rounded["w"].astype(jnp.float32).mean()) - (1.0 + 2.0**-9)) < 2e-4


def test_cast_params_rejects_a_policy_for_other_params():
    other = triaccel_jax.PrecisionPolicy.uniform({"x": jnp.ones(2)}, "bf16")
    with pytest.raises(ValueError, match="conv"):
        triaccel_jax.cast_params(PARAMS, other)


def test_master_params():
    fp32 = triaccel_jax.master_params(PARAMS, POLICY)
    assert fp32["conv"].dtype == jnp.float32
    low = triaccel_jax.master_params(PARAMS, POLICY, "policy")
    chex.assert_type(
        [low["conv"], low["dense"]["kernel"], low["dense"]["bias"], low["step"]],
        [jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.int32],  # the kernel: never an fp8 master
    )
    with pytest.raises(ValueError, match="master_dtype"):
        triaccel_jax.master_params(PARAMS, POLICY, "fp16")


def test_policy_masters_train_with_stochastic_updates():
    # Updates of 1e-3 are a quarter of a bf16 ulp at 1.0: nearest rounding never moves the master.
    params = {"w": jnp.ones(20_000, jnp.bfloat16), "n": None}
    updates = {"w": jnp.full(20_000, 1e-3, jnp.float32), "n": None}
    nearest, stochastic = params, params
    for step in range(10):
        nearest = triaccel_jax.stochastic_apply_updates(nearest, updates)
        stochastic = triaccel_jax.stochastic_apply_updates(
            stochastic, updates, key=jax.random.key(step)
        )
    assert float(nearest["w"].astype(jnp.float32).mean()) == 1.0
    assert abs(float(stochastic["w"].astype(jnp.float32).mean()) - 1.01) < 1e-3
    assert stochastic["w"].dtype == jnp.bfloat16 and stochastic["n"] is None


@pytest.mark.slow
def test_triaccel_state_dtypes_follow_the_policy():
    tx = triaccel_jax.triaccel(1e-2, config=triaccel_jax.TriAccelConfig(state_dtype=POLICY))
    state = tx.init(PARAMS)
    chex.assert_type(
        [state[0].mu["conv"], state[0].nu["dense"]["kernel"], state[0].mu["dense"]["bias"]],
        [jnp.bfloat16, jnp.bfloat16, jnp.float32],
    )
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    _, new_state = jax.jit(tx.update)(grads, state, PARAMS)
    chex.assert_trees_all_equal_dtypes(new_state, state)
    partial = triaccel_jax.PrecisionPolicy.uniform({"conv": PARAMS["conv"]}, "bf16")
    with pytest.raises(ValueError, match="dense/bias"):
        triaccel_jax.triaccel(1e-2, config=triaccel_jax.TriAccelConfig(state_dtype=partial)).init(
            PARAMS
        )


@pytest.mark.slow
def test_convert_state_recasts_moments_and_keeps_everything_else():
    tx = optax.chain(optax.clip(1.0), triaccel_jax.triaccel(1e-2))
    state = tx.init(PARAMS)
    grads = jax.tree.map(lambda p: jnp.cos(p.astype(jnp.float32)), PARAMS)
    for _ in range(3):
        _, state = tx.update(grads, state, PARAMS)
    converted = triaccel_jax.transforms.convert_state(state, POLICY)
    before, after = state[1][0], converted[1][0]
    assert after.mu["conv"].dtype == jnp.bfloat16 and after.mu["dense"]["bias"].dtype == jnp.float32
    # Moments within the new dtype's rounding (half a bf16 ulp, relative), nothing else touched.
    np.testing.assert_allclose(
        after.nu["conv"].astype(jnp.float32), before.nu["conv"], rtol=2.0**-8
    )
    np.testing.assert_array_equal(after.mu["dense"]["bias"], before.mu["dense"]["bias"])
    for field in ("count", "curvature_count", "curvature", "leaf_signals", "rounding_key"):
        chex.assert_trees_all_equal(getattr(before, field), getattr(after, field))
    # The converted state keeps training with the policy's optimizer.
    policy_tx = optax.chain(
        optax.clip(1.0),
        triaccel_jax.triaccel(1e-2, config=triaccel_jax.TriAccelConfig(state_dtype=POLICY)),
    )
    _, resumed = jax.jit(policy_tx.update)(grads, converted, PARAMS)
    assert resumed[1][0].mu["conv"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="no entry for leaf"):
        triaccel_jax.transforms.convert_state(
            state, triaccel_jax.PrecisionPolicy.uniform({"conv": PARAMS["conv"]})
        )
