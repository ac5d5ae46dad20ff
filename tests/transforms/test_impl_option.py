"""``TriAccelConfig(impl=...)`` and ``stochastic_apply_updates(impl=...)``: the kernels' dispatch, opt-in.

``impl="reference"`` must be bit for bit what the optimizer computed before the option existed
(the pure-JAX rounding); ``impl="triton"`` where Triton cannot run is refused with a clear error.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import triaccel_jax
from triaccel_jax.kernels import _dispatch
from triaccel_jax.kernels import cast as cast_kernel

ON_CUDA = _dispatch.triton_unavailable_reason() is None
needs_no_triton = pytest.mark.skipif(ON_CUDA, reason="checks the behaviour without a CUDA backend")


def _problem():
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(keys[0], (40, 8)), "b": jax.random.normal(keys[1], (8,))}
    grads = [jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), params) for k in keys]
    return params, grads


def _run(config):
    tx = triaccel_jax.scale_by_triaccel(config=config, curvature_every=2)
    params, grads = _problem()
    state = tx.init(params)
    outs = []
    for grad in grads:
        updates, state = jax.jit(tx.update)(grad, state, params)
        outs.append(updates)
    return outs, state


@pytest.mark.slow
@pytest.mark.parametrize("state_dtype", [None, "bfloat16"])
def test_impl_reference_equals_the_pure_jax_rounding_bit_for_bit(monkeypatch, state_dtype):
    ref_updates, _ = _run(triaccel_jax.TriAccelConfig(state_dtype=state_dtype))
    # Today's optimizer wrote its moments with cast_reference; force that and compare.
    monkeypatch.setattr(
        cast_kernel,
        "cast",
        lambda x, dtype, *, impl, **kw: cast_kernel.cast_reference(x, dtype, **kw),
    )
    old_updates, old_state = _run(triaccel_jax.TriAccelConfig(state_dtype=state_dtype))
    monkeypatch.undo()
    got_updates, got_state = _run(
        triaccel_jax.TriAccelConfig(state_dtype=state_dtype, impl="reference")
    )
    for expected in (old_updates, ref_updates):
        chex.assert_trees_all_equal(got_updates, expected)
    got_state, old_state = got_state[0], old_state[0]
    moments = (got_state.mu, got_state.nu), (old_state.mu, old_state.nu)
    chex.assert_trees_all_equal_dtypes(*moments)
    chex.assert_trees_all_equal(*moments)


@pytest.mark.slow
def test_the_moment_writes_go_through_the_cast_dispatch_with_the_configs_impl(monkeypatch):
    seen = []
    original = cast_kernel.cast

    def spy(x, dtype, *, impl, **kw):
        seen.append((jnp.dtype(dtype).name, impl))
        return original(x, dtype, impl=impl, **kw)

    monkeypatch.setattr(cast_kernel, "cast", spy)
    _run(triaccel_jax.TriAccelConfig(state_dtype="bfloat16", impl="reference"))
    assert seen and set(seen) == {("bfloat16", "reference")}


def test_unknown_impl_is_refused_when_the_config_is_built():
    with pytest.raises(
        ValueError, match=r"`impl` must be one of \('auto', 'reference', 'triton'\)"
    ):
        triaccel_jax.TriAccelConfig(impl="pallas")


@needs_no_triton
@pytest.mark.parametrize("state_dtype", [None, "bfloat16"])
def test_impl_triton_without_cuda_is_refused_with_a_clear_error(state_dtype):
    config = triaccel_jax.TriAccelConfig(state_dtype=state_dtype, impl="triton")
    with pytest.raises(RuntimeError, match=r"impl='triton' for the moment write.*CUDA"):
        _run(config)
    tx = triaccel_jax.triaccel(1e-3, config=config)
    params, grads = _problem()
    with pytest.raises(RuntimeError, match="impl='triton'"):
        tx.update(grads[0], tx.init(params), params)


def test_stochastic_apply_updates_impl_reference_equals_the_default_and_triton_is_refused():
    params = {"w": jnp.ones(1000, jnp.bfloat16), "f": jnp.ones(3)}
    updates = {"w": jnp.full(1000, 1e-3), "f": jnp.full(3, 0.5)}
    key = jax.random.key(3)
    expected = triaccel_jax.stochastic_apply_updates(params, updates, key=key)
    got = triaccel_jax.stochastic_apply_updates(params, updates, key=key, impl="reference")
    chex.assert_trees_all_equal_dtypes(got, expected)
    chex.assert_trees_all_equal(got, expected)
    with pytest.raises(ValueError, match="impl"):
        triaccel_jax.stochastic_apply_updates(params, updates, key=key, impl="cuda")
    if not ON_CUDA:
        with pytest.raises(RuntimeError, match=r"impl='triton' for the master write"):
            triaccel_jax.stochastic_apply_updates(params, updates, key=key, impl="triton")


def test_impl_survives_inject_hyperparams():
    config = triaccel_jax.TriAccelConfig(impl="reference")
    tx = optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=1e-3, config=config)
    params, grads = _problem()
    state = jax.jit(tx.init)(params)
    updates, _ = jax.jit(tx.update)(grads[0], state, params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
