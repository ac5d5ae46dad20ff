"""The fused update's reference against one step of ``triaccel_jax.triaccel`` on one leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax.kernels import fused_update as fused_kernel

HYPER = dict(b1=0.9, b2=0.99, eps=1e-8)


def _problem(n=300, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    params = {"w": jax.random.normal(keys[0], (n,))}
    grads = [
        {"w": jax.random.normal(jax.random.fold_in(keys[1], t), (n,)) * (1 + t)} for t in range(3)
    ]
    return params, grads


def _triaccel_steps(learning_rate, weight_decay, state_dtype=None):
    """Three jitted triaccel steps on one leaf, with what each step read and wrote."""
    params, grads = _problem()
    tx = triaccel_jax.triaccel(
        learning_rate,
        weight_decay=weight_decay,
        config=triaccel_jax.TriAccelConfig(state_dtype=state_dtype),
        **HYPER,
    )
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, new_state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state

    records = []
    for g in grads:
        new_params, new_state = step(params, state, g)
        records.append((params, state, g, new_params, new_state))
        params, state = new_params, new_state
    return records


def _inner(state):
    return state[0]  # triaccel's first state is its curvature signals' (Adam's moments)


@pytest.mark.parametrize(
    "learning_rate", [1e-2, optax.linear_schedule(1e-2, 1e-3, 3)], ids=["constant", "schedule"]
)
def test_float32_equals_triaccel(learning_rate):
    weight_decay = 1e-2

    @jax.jit
    def fused(grad, mu, nu, master, step_scale, count):
        lr = learning_rate(count - 1) if callable(learning_rate) else learning_rate
        return fused_kernel.fused_update_reference(
            grad,
            mu,
            nu,
            master,
            step_scale,
            count=count,
            learning_rate=lr,
            weight_decay=weight_decay,
            compute_dtype=jnp.bfloat16,
            **HYPER,
        )

    for params, state, g, new_params, new_state in _triaccel_steps(learning_rate, weight_decay):
        old, new = _inner(state), _inner(new_state)
        out = fused(
            g["w"],
            old.mu["w"],
            old.nu["w"],
            params["w"],
            new.signals_by_leaf()["w"].step_scale,
            new.count,
        )
        # Same operations on the same float32 values: equal up to XLA's choice of fusing a * b + c
        # into an FMA (at most an ulp or two), usually to the bit.
        np.testing.assert_allclose(out.mu, new.mu["w"], rtol=3e-7, atol=0)
        np.testing.assert_allclose(out.nu, new.nu["w"], rtol=3e-7, atol=0)
        np.testing.assert_allclose(out.master, new_params["w"], rtol=3e-7, atol=1e-9)
        assert out.compute.dtype == jnp.bfloat16
        np.testing.assert_array_equal(out.compute, out.master.astype(jnp.bfloat16))


@pytest.mark.slow
def test_bfloat16_moments_round_stochastically_around_triaccel():
    records = _triaccel_steps(1e-2, 1e-2, state_dtype=jnp.bfloat16)
    for params, state, g, new_params, new_state in records:
        old, new = _inner(state), _inner(new_state)
        out = fused_kernel.fused_update_reference(
            g["w"],
            old.mu["w"],
            old.nu["w"],
            params["w"],
            new.signals_by_leaf()["w"].step_scale,
            count=new.count,
            learning_rate=1e-2,
            weight_decay=1e-2,
            key=jax.random.key(0),
            **HYPER,
        )
        # The float32 moment both compute; each side rounds it stochastically (different bits),
        # so both results are one of its two bfloat16 neighbours: at most one bf16 ulp apart.
        g32 = g["w"].astype(jnp.float32)
        mu32 = HYPER["b1"] * old.mu["w"].astype(jnp.float32) + (1 - HYPER["b1"]) * g32
        nu32 = HYPER["b2"] * old.nu["w"].astype(jnp.float32) + (1 - HYPER["b2"]) * g32 * g32
        for ours, theirs, exact in ((out.mu, new.mu["w"], mu32), (out.nu, new.nu["w"], nu32)):
            ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
            ulp = np.spacing(np.abs(np.asarray(exact)).astype(np.float32)) * 2.0**16
            assert np.all(np.abs(ours - theirs) <= ulp * 1.0001)
            assert np.all(np.abs(ours - np.asarray(exact)) <= ulp)
        assert out.mu.dtype == out.nu.dtype == jnp.bfloat16
        # Both take the direction from the float32 moments before they are rounded for storage.
        np.testing.assert_allclose(out.master, new_params["w"], rtol=3e-7, atol=1e-9)


def test_bfloat16_moments_keep_small_increments():
    # nu grows by (1 - b2) * g**2 = 1e-3 per step from 1.0: below half a bf16 ulp at 1.0, so
    # round-to-nearest would keep it at exactly 1.0; stochastic rounding tracks the float32 EMA.
    n = 4096
    nu = jnp.ones(n, jnp.bfloat16)
    mu = jnp.zeros(n, jnp.bfloat16)
    master = jnp.ones(n)
    grad = jnp.full(n, jnp.sqrt(2.0))
    step = jax.jit(
        lambda mu, nu, master, t: fused_kernel.fused_update_reference(
            grad,
            mu,
            nu,
            master,
            count=t,
            learning_rate=0.0,
            b2=0.999,
            key=jax.random.fold_in(jax.random.key(0), t),
        )
    )
    for t in range(1, 21):
        mu, nu, master, _ = step(mu, nu, master, t)
    exact = 2.0 - 0.999**20
    assert abs(float(jnp.mean(nu.astype(jnp.float32))) - exact) < 2e-3


@pytest.mark.parametrize("master_dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_master_is_unbiased(master_dtype):
    # A learning-rate step far below the master's ulp: stochastic rounding moves the master by
    # the right amount on average, round-to-nearest would not move it at all.
    n = 100_000
    master = jnp.ones(n, master_dtype)
    out = fused_kernel.fused_update_reference(
        jnp.ones(n),
        jnp.zeros(n),
        jnp.zeros(n),
        master,
        count=1,
        learning_rate=1e-4,
        weight_decay=0.0,
        compute_dtype=master_dtype,
        key=jax.random.key(1),
    )
    assert out.master.dtype == master_dtype
    values = np.asarray(out.master, np.float64)
    exact = np.float64(np.float32(1.0) - np.float32(1e-4) * np.float32(1.0 / (1.0 + 1e-8 / 1.0)))
    errors = values - exact
    assert abs(errors.mean()) < 4 * errors.std() / np.sqrt(n)
    np.testing.assert_array_equal(out.compute, out.master)


def test_compute_copy_dtypes_and_scale():
    grad, mu, nu, master = (jnp.linspace(-1.0, 1.0, 64),) * 2 + (
        jnp.ones(64) * 0.01,
        jnp.linspace(-500, 500, 64),
    )
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn):
        for rounding in ("nearest", "stochastic"):
            out = fused_kernel.fused_update_reference(
                grad,
                mu,
                nu,
                master,
                count=2,
                learning_rate=1e-3,
                compute_dtype=dtype,
                rounding=rounding,
                key=jax.random.key(2),
                compute_scale=4.0,
            )
            assert out.compute.dtype == dtype
            assert out.master.dtype == jnp.float32
            np.testing.assert_allclose(
                np.asarray(out.compute, np.float32) * 4.0,
                out.master,
                rtol=2.0**-3,
                atol=2.0**-9 * 4,
            )


def test_errors():
    x = jnp.ones(4)
    kwargs = dict(count=1, learning_rate=0.1)
    with pytest.raises(ValueError, match="mu"):
        fused_kernel.fused_update_reference(x, x.astype(jnp.float16), x, x, **kwargs)
    with pytest.raises(ValueError, match="master"):
        fused_kernel.fused_update_reference(x, x, x, x.astype(jnp.float8_e4m3fn), **kwargs)
    with pytest.raises(ValueError, match="one shape"):
        fused_kernel.fused_update_reference(x, x, x, jnp.ones(5), **kwargs)
    with pytest.raises(ValueError, match="key"):
        fused_kernel.fused_update_reference(x, x.astype(jnp.bfloat16), x, x, **kwargs)
    with pytest.raises(ValueError, match="key"):
        fused_kernel.fused_update_reference(x, x, x, x, rounding="stochastic", **kwargs)
    with pytest.raises(ValueError, match=r"step_scale.*scalar"):
        fused_kernel.fused_update_reference(x, x, x, x, jnp.ones(4), **kwargs)
    with pytest.raises(ValueError, match="float8_e5m2"):
        fused_kernel.fused_update_reference(x, x, x, x, compute_dtype=jnp.float8_e5m2, **kwargs)
    with pytest.raises(ValueError, match="rounding"):
        fused_kernel.fused_update_reference(x, x, x, x, rounding="odd", **kwargs)


def test_optimizer_and_reference_call_the_one_moment_update(monkeypatch):
    # One implementation of Adam's moments: scale_by_triaccel and the fused update's reference
    # both go through kernels._adam.adam_moments, which the optimizer reads as the package's
    # public triaccel_jax.kernels.adam_moments (replacing it changes what both compute).
    from triaccel_jax import kernels
    from triaccel_jax.kernels import _adam

    calls = []
    original = _adam.adam_moments
    assert kernels.adam_moments is original

    def recording(grad, mu, nu, s):
        calls.append(grad.shape)
        return original(grad, mu, nu, s)

    monkeypatch.setattr(_adam, "adam_moments", recording)
    monkeypatch.setattr(kernels, "adam_moments", recording)
    params, grads = _problem(n=8)
    tx = triaccel_jax.transforms.scale_by_triaccel(**HYPER)
    tx.update(grads[0], tx.init(params), params)
    assert calls == [(8,)]
    fused_kernel.fused_update_reference(
        grads[0]["w"], jnp.zeros(8), jnp.zeros(8), params["w"], count=1, learning_rate=0.1
    )
    assert calls == [(8,), (8,)]


def test_direction_is_the_shared_moment_update_times_the_step_scale():
    from triaccel_jax.kernels import _adam

    params, grads = _problem(n=64)
    tx = triaccel_jax.transforms.scale_by_triaccel(**HYPER)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in grads:
        updates, new_state = update(g, state, params)
        old, new = state[0], new_state[0]  # the curvature signals keep Adam's moments
        s = _adam.adam_scalars(count=new.count, **HYPER)
        moments = jax.jit(_adam.adam_moments)(g["w"], old.mu["w"], old.nu["w"], s)
        scale = new.signals_by_leaf()["w"].step_scale
        np.testing.assert_allclose(updates["w"], scale * moments.direction, rtol=3e-7, atol=0)
        np.testing.assert_array_equal(new.mu["w"], moments.mu)
        np.testing.assert_array_equal(new.nu["w"], moments.nu)
        state = new_state
