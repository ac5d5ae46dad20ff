"""``quantize_state`` under ``"int4"``: second moments of rank >= 2 stored factored.

The registry's factored format (``StateFormat.factored``: int4) stores a non-negative second
moment of rank >= 2 as a :class:`FactoredLeaf`, its float32 means over the last two axes, read
back as Adafactor's rank-1 reconstruction (Shazeer & Stern, 2018). These tests check the
reconstruction, the training it gives, the bytes against the registry and XLA, the converter,
and the one all-reduce a factored leaf costs under FSDP (8 simulated devices).
"""

from __future__ import annotations

import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from simulated_devices import run_script

from triaccel_jax.policy import state_format
from triaccel_jax.transforms import FactoredLeaf
from triaccel_jax.transforms import QuantizedLeaf
from triaccel_jax.transforms import compiled_state_bytes
from triaccel_jax.transforms import dequantize_state
from triaccel_jax.transforms import muon_dimension_numbers
from triaccel_jax.transforms import quantize_state
from triaccel_jax.transforms import to_quantized_state

PROMOTES = "optax's own optimizers promote inside (a float to the power of an int32 count)"


def _nu(state):
    return state.inner_state[0].nu


def _moments() -> optax.GradientTransformation:
    """An optimizer whose state is a dict of a first and a second moment (found by its keys)."""

    def init(params):
        return {
            "mu": jax.tree.map(jnp.zeros_like, params),
            "nu": jax.tree.map(jnp.zeros_like, params),
        }

    return optax.GradientTransformation(init, lambda updates, state, params=None: (updates, state))


def test_a_rank_one_non_negative_matrix_is_read_back_exactly() -> None:
    # v = a b^T with a, b >= 0 (and a stack of two of them: leading axes kept per index).
    keys = jax.random.split(jax.random.key(0), 4)
    a = jax.random.uniform(keys[0], (2, 96), minval=0.1)
    b = jax.random.uniform(keys[1], (2, 80), minval=0.1)
    nu = a[:, :, None] * b[:, None, :]
    plain = {"nu": {"w": nu}, "mu": {"w": jnp.zeros_like(nu)}}
    tx = quantize_state(_moments(), format="int4", min_size=1024)
    state = to_quantized_state(tx, plain, {"w": nu})  # any state: found by its dict key
    stored = state.inner_state["nu"]["w"]
    assert isinstance(stored, FactoredLeaf)
    assert stored.row.shape == (2, 96) and stored.col.shape == (2, 80)
    assert stored.row.dtype == stored.col.dtype == jnp.float32
    assert isinstance(state.inner_state["mu"]["w"], QuantizedLeaf)  # signed: 4-bit codes
    back = dequantize_state(state)["nu"]["w"]
    chex.assert_trees_all_close(back, nu, rtol=1e-6)
    # A general non-negative matrix is not rank 1: read back as its rank-1 fit, whose row and
    # column means are the matrix's own.
    general = jax.random.uniform(keys[2], (96, 80))
    plain = {"nu": {"w": general}, "mu": {"w": general}}
    fitted = dequantize_state(to_quantized_state(tx, plain, {"w": general}))["nu"]["w"]
    chex.assert_trees_all_close(fitted.mean(-1), general.mean(-1), rtol=1e-5)
    chex.assert_trees_all_close(fitted.mean(-2), general.mean(-2), rtol=1e-5)
    assert not np.allclose(fitted, general, rtol=1e-2)


def test_a_zero_second_moment_reads_back_as_zero() -> None:
    tx = quantize_state(_moments(), format="int4", min_size=1024)
    zeros = jnp.zeros((64, 64))
    state = tx.init({"w": zeros})
    assert isinstance(state.inner_state["nu"]["w"], FactoredLeaf)
    back = dequantize_state(state)["nu"]["w"]
    chex.assert_trees_all_equal(back, zeros)  # not 0 / 0


@pytest.mark.standard_promotion(PROMOTES)
def test_only_second_moments_of_rank_two_or_more_are_factored() -> None:
    params = {"w": jnp.ones((64, 96)), "v": jnp.ones((8192,)), "t": jnp.ones((4, 32, 64))}
    stored = quantize_state(optax.adamw(1e-3), format="int4").init(params).inner_state[0]
    assert isinstance(stored.nu["w"], FactoredLeaf)
    assert isinstance(stored.nu["t"], FactoredLeaf)
    assert stored.nu["t"].row.shape == (4, 32) and stored.nu["t"].col.shape == (4, 64)
    # 1-D second moments keep the 4-bit zero-free codes; first moments are never factored.
    assert isinstance(stored.nu["v"], QuantizedLeaf)
    assert stored.nu["v"].mapping == state_format("int4").unsigned_map
    assert all(isinstance(node, QuantizedLeaf) for node in stored.mu.values())
    # int8 has no factored format: codes everywhere.
    int8 = quantize_state(optax.adamw(1e-3), format="int8").init(params).inner_state[0]
    assert all(isinstance(node, QuantizedLeaf) for node in int8.nu.values())


@pytest.mark.standard_promotion(PROMOTES)
def test_the_factored_ema_is_adafactors_and_the_means_are_exact() -> None:
    # Adam's nu stored factored: each update's row and column means are beta2 times the stored
    # ones plus (1 - beta2) times those of g**2, exactly (means are linear).
    params = {"w": jnp.zeros((32, 48))}
    keys = jax.random.split(jax.random.key(1), 3)
    tx = quantize_state(optax.scale_by_adam(b2=0.9), format="int4", min_size=1024)
    state = tx.init(params)
    row, col = jnp.zeros(32), jnp.zeros(48)
    for key in keys:
        grads = {"w": jax.random.normal(key, (32, 48))}
        _, state = jax.jit(tx.update)(grads, state, params)
        row = 0.9 * row + 0.1 * jnp.mean(grads["w"] ** 2, -1)
        col = 0.9 * col + 0.1 * jnp.mean(grads["w"] ** 2, -2)
        stored = state.inner_state.nu["w"]
        chex.assert_trees_all_close((stored.row, stored.col), (row, col), rtol=1e-5)


def _least_squares(tx, steps=300):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (256, 64))
    target = jax.random.normal(keys[1], (64, 96)) * jnp.linspace(0.1, 3.0, 96)
    y = x @ target
    params = {"w": jnp.zeros((64, 96)), "b": jnp.zeros((96,))}

    def loss(params):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    @jax.jit
    def step(params, state):
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state = tx.init(params)
    initial = loss(params)
    for _ in range(steps):
        params, state, _ = step(params, state)
    return float(loss(params)), float(initial), state


@pytest.mark.standard_promotion(PROMOTES)
def test_adamw_with_int4_state_reaches_a_loss_near_float32s() -> None:
    fp32, initial, _ = _least_squares(optax.adamw(3e-2))
    int4, _, state = _least_squares(quantize_state(optax.adamw(3e-2), format="int4", min_size=1024))
    assert isinstance(_nu(state)["w"], FactoredLeaf)
    assert np.isfinite(int4)
    assert fp32 < 0.05 * initial  # the problem is solved at all
    assert int4 < 2.0 * fp32 + 1e-3 * initial, (int4, fp32, initial)


def _registry_bytes(params, fmt, second_moment_copies, signed_copies, min_size=4096):
    state = state_format(fmt)
    total = 0
    for leaf in jax.tree.leaves(params):
        size = leaf.size
        if size < min_size:
            total += 4 * size * (second_moment_copies + signed_copies)
            continue
        total += second_moment_copies * state.leaf_bytes(leaf.shape, 4, second_moment=True)
        total += signed_copies * state.leaf_bytes(leaf.shape, 4)
    return total


@pytest.mark.standard_promotion(PROMOTES)
def test_int4_bytes_per_parameter_are_the_registrys_and_under_the_targets() -> None:
    params = {"a": jnp.zeros((1024, 1024)), "b": jnp.zeros((512, 2048))}
    adamw = compiled_state_bytes(quantize_state(optax.adamw(1e-3), format="int4"), params)
    # mu's codes (0.5 + 4 / 128 a parameter), nu's means (4 * (rows + cols)); 16 bytes: the
    # wrapper's count and key (4 + 8) and Adam's count (4).
    assert adamw.bytes_per_parameter <= 5.0
    assert adamw.state_bytes - 16 == _registry_bytes(params, "int4", 1, 1)
    muon = optax.contrib.muon(1e-3, muon_weight_dimension_numbers=muon_dimension_numbers(params))
    measured = compiled_state_bytes(quantize_state(muon, format="int4"), params)
    assert measured.bytes_per_parameter <= 4.6
    plain = jax.eval_shape(muon.init, params)
    small = sum(
        leaf.size * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(plain)
        if leaf.size < 4096  # counts, ns_coeffs: kept as the inner keeps them
    )
    # Muon's one momentum copy per matrix (its Adam state for them is masked out), besides the
    # wrapper's count and key (12 bytes).
    assert measured.state_bytes - 12 - small == _registry_bytes(params, "int4", 0, 1)


@pytest.mark.standard_promotion(PROMOTES)
def test_a_factored_state_converts_both_ways_and_keeps_updating() -> None:
    params = {"w": jnp.zeros((64, 96))}
    grads = {"w": jax.random.normal(jax.random.key(2), (64, 96))}
    plain = optax.adamw(1e-2).init(params)
    plain = optax.adamw(1e-2).update(grads, plain, params)[1]
    tx = quantize_state(optax.adamw(1e-2), format="int4", min_size=1024)
    state = to_quantized_state(tx, plain, params)
    stored = _nu(state)["w"]
    assert isinstance(stored, FactoredLeaf)
    chex.assert_trees_all_close(stored.row, plain[0].nu["w"].mean(-1), rtol=1e-6)
    back = dequantize_state(state)
    assert back[0].nu["w"].shape == (64, 96) and back[0].nu["w"].dtype == jnp.float32
    # The round trip from the stored state is exact: the reconstruction's means are the stored.
    again = to_quantized_state(tx, back, params)
    chex.assert_trees_all_close(_nu(again)["w"], stored, rtol=1e-6)
    # It updates as the wrapper's own state, and switches format (to int8's codes).
    _, state = jax.jit(tx.update)(grads, state, params)
    assert isinstance(_nu(state)["w"], FactoredLeaf)
    int8 = to_quantized_state(quantize_state(optax.adamw(1e-2), format="int8"), state, params)
    assert isinstance(_nu(int8)["w"], QuantizedLeaf)


SHARDED = textwrap.dedent(
    """
    import re
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import triaccel_jax
    from triaccel_jax.transforms import FactoredLeaf

    jax.config.update("jax_numpy_dtype_promotion", "standard")  # optax's count promotes
    COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all",
                   "reduce-scatter")

    def collectives(compiled):
        # Each collective instruction, by its opcode (an async pair counts once, at its start).
        text = compiled.as_text()
        found = {}
        for name in COLLECTIVES:
            count = len(re.findall(r"\\s" + name + r"(-start)?\\(", text))
            if count:
                found[name] = count
        return found

    keys = jax.random.split(jax.random.key(0), 2)
    params = {"a": jax.random.normal(keys[0], (1000, 1000)),
              "b": jax.random.normal(keys[1], (1000, 968))}
    grads = jax.tree.map(lambda p: 0.01 * jnp.cos(p), params)
    tx = triaccel_jax.quantize_state(optax.adamw(1e-3), format="int4", min_size=1024)

    def two_steps(params, grads):
        state = tx.init(params)
        step = jax.jit(tx.update)
        updates, state = step(grads, state, params)
        updates, state = step(grads, state, params)
        return updates, state, step.lower(grads, state, params).compile()

    expected, _, _ = two_steps(params, grads)
    for kind in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(kind,))
        with jax.set_mesh(mesh):
            put = lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp", None)))
            updates, state, compiled = two_steps(
                jax.tree.map(put, params), jax.tree.map(put, grads))
        found = collectives(compiled)
        print(kind, found)
        # The column means reduce over the sharded rows: one all-reduce a factored leaf, or
        # fewer where XLA combines them; nothing else.
        assert set(found) <= {"all-reduce"}, (kind, found)
        assert 1 <= found.get("all-reduce", 0) <= 2, (kind, found)
        nu = state.inner_state[0].nu
        for node in nu.values():
            assert isinstance(node, FactoredLeaf)
            assert "fsdp" in tuple(node.row.sharding.spec), (kind, node.row.sharding)
            assert "fsdp" not in tuple(node.col.sharding.spec), (kind, node.col.sharding)
        for node in state.inner_state[0].mu.values():
            for array in (node.codes, node.scales):
                assert "fsdp" in tuple(array.sharding.spec), (kind, array.sharding)
        for name in params:
            # The means are summed in another order across shards: float32 rounding apart.
            np.testing.assert_allclose(updates[name], expected[name], rtol=1e-4, atol=1e-7)
    print("ok")
    """
)


@pytest.mark.slow
def test_under_fsdp_a_factored_leaf_costs_one_all_reduce_and_nothing_else() -> None:
    run_script(SHARDED, devices=8)
