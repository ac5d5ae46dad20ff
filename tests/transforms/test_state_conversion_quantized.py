"""to_quantized_state and dequantize_state: an optimizer state from float32 to quantized and back.

A running job switches its state's format; a float32 checkpoint restores into a quantized state.
The conversion keeps the inner's counts and injected hyperparameters, matches the state by leaf
path, and names the first leaf that does not match.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import triaccel_jax
from triaccel_jax.transforms import Bfloat16Leaf
from triaccel_jax.transforms import CenteredState
from triaccel_jax.transforms import QuantizedLeaf
from triaccel_jax.transforms import QuantizedState
from triaccel_jax.transforms import dequantize_state
from triaccel_jax.transforms import quantize_state
from triaccel_jax.transforms import to_quantized_state

pytestmark = pytest.mark.standard_promotion(
    "optax's own optimizers promote inside (a float to the power of an int32 count)"
)

OPTIONS = {"block_size": 64, "min_size": 100}


def make_params():
    keys = jax.random.split(jax.random.key(0), 2)
    return {
        "dense": {"kernel": jax.random.normal(keys[0], (40, 30)) * 0.1, "bias": jnp.zeros(30)},
        "out": jax.random.normal(keys[1], (30, 5)) * 0.1,
    }


def grads_at(params, step):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1000 + step), len(leaves))
    return treedef.unflatten(
        [jax.random.normal(k, p.shape) for k, p in zip(keys, leaves, strict=True)]
    )


def train(tx, params, state, steps, start=0):
    update = jax.jit(tx.update)
    last = None
    for step in range(start, start + steps):
        last, state = update(grads_at(params, step), state, params)
        params = optax.apply_updates(params, last)
    return params, state, last


def relative_error(a, b):
    return float(optax.tree.norm(jax.tree.map(jnp.subtract, a, b)) / optax.tree.norm(b))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "bf16", "fp32"])
def test_converting_the_inners_initial_state_is_init(fmt):
    params = make_params()
    tx = quantize_state(optax.adamw(1e-2), format=fmt, **OPTIONS)
    converted = to_quantized_state(tx, optax.adamw(1e-2).init(params), params)
    chex.assert_trees_all_equal(converted, tx.init(params))
    assert jax.tree.structure(converted) == jax.tree.structure(tx.init(params))


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_a_float32_run_switches_to_a_quantized_state_and_trains_on_alike(fmt):
    # An AdamW run in float32 for 10 steps, its state converted, then 10 more steps under the
    # quantized wrapper: the updates follow the float32 run's within the state's rounding.
    params = make_params()
    plain = optax.adamw(1e-2)
    params, fp32_state, _ = train(plain, params, plain.init(params), 10)
    tx = quantize_state(optax.adamw(1e-2), format=fmt, **OPTIONS)
    state = to_quantized_state(tx, fp32_state, params)
    assert isinstance(state, QuantizedState)
    stored = state.inner_state[0].mu["dense"]["kernel"]
    assert isinstance(stored, QuantizedLeaf if fmt == "int8" else Bfloat16Leaf)
    assert int(state.inner_state[0].count) == 10  # the inner's count, for its bias correction
    # The converted moments are the float32 run's up to rounding.
    back = dequantize_state(state)
    assert jax.tree.structure(back) == jax.tree.structure(fp32_state)
    assert relative_error(back[0].mu, fp32_state[0].mu) < (0.01 if fmt == "int8" else 0.004)
    assert relative_error(back[0].nu, fp32_state[0].nu) < (0.01 if fmt == "int8" else 0.004)
    _, _, reference = train(plain, params, fp32_state, 10, start=10)
    _, _, quantized = train(tx, params, state, 10, start=10)
    assert relative_error(quantized, reference) < (0.05 if fmt == "int8" else 0.02)


@pytest.mark.slow
def test_a_float32_checkpoint_restores_into_a_quantized_state(tmp_path):
    # Saved by the project's checkpointer from a float32 run and restored into the quantized
    # wrapper's state; a state read back as plain containers (dicts where optax has
    # NamedTuples) converts too, matched by path.
    params = make_params()
    plain = optax.adamw(1e-2)
    params, fp32_state, _ = train(plain, params, plain.init(params), 5)
    with triaccel_jax.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(5, {"params": params, "opt_state": fp32_state})
        template = jax.tree.map(jnp.zeros_like, {"params": params, "opt_state": fp32_state})
        restored, _ = checkpointer.restore(template)
    tx = quantize_state(optax.adamw(1e-2), **OPTIONS)
    state = to_quantized_state(tx, restored["opt_state"], restored["params"])
    chex.assert_trees_all_equal(state, to_quantized_state(tx, fp32_state, params))
    as_containers = {
        "0": {"count": fp32_state[0].count, "mu": fp32_state[0].mu, "nu": fp32_state[0].nu},
        "1": {},
        "2": {},
    }
    chex.assert_trees_all_equal(to_quantized_state(tx, as_containers, params), state)
    _, _, reference = train(plain, params, fp32_state, 5, start=5)
    _, _, quantized = train(tx, params, state, 5, start=5)
    assert relative_error(quantized, reference) < 0.05


def test_a_quantized_state_switches_format_and_back_to_float32():
    params = make_params()
    int8 = quantize_state(optax.adamw(1e-2), **OPTIONS)
    params, state, _ = train(int8, params, int8.init(params), 5)
    bf16 = quantize_state(optax.adamw(1e-2), format="bf16", **OPTIONS)
    switched = to_quantized_state(bf16, state, params)
    assert isinstance(switched.inner_state[0].nu["out"], Bfloat16Leaf)
    assert int(switched.count) == 5  # the wrapper's own count goes on
    # The values are the int8 state's (bf16 holds them to 2**-9).
    chex.assert_trees_all_close(
        dequantize_state(switched), dequantize_state(state), rtol=2**-8, atol=0
    )
    # And back to the inner's own: optax's AdamW trains on from it.
    plain = dequantize_state(state)
    updates, _ = optax.adamw(1e-2).update(grads_at(params, 5), plain, params)
    expected, _ = int8.update(grads_at(params, 5), state, params)
    assert relative_error(updates, expected) < 1e-6


def test_the_count_and_injected_hyperparameters_are_kept():
    params = make_params()
    inject = optax.inject_hyperparams(optax.adamw)
    plain = inject(learning_rate=1e-2, weight_decay=0.1)
    _, fp32_state, _ = train(plain, params, plain.init(params), 3)
    fp32_state.hyperparams["learning_rate"] = jnp.asarray(3e-3)  # set by a schedule, say
    tx = quantize_state(inject(learning_rate=1e-2, weight_decay=0.1), **OPTIONS)
    state = to_quantized_state(tx, fp32_state, params)
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(3e-3)
    assert int(state.inner_state.count) == 3
    assert int(state.inner_state.inner_state[0].count) == 3
    assert isinstance(state.inner_state.inner_state[0].mu["out"], QuantizedLeaf)


def test_a_centered_state_converts_both_ways():
    params = make_params()
    plain = optax.rmsprop(1e-3, centered=True)
    _, fp32_state, _ = train(plain, params, plain.init(params), 5)
    tx = quantize_state(optax.rmsprop(1e-3, centered=True), **OPTIONS)
    state = to_quantized_state(tx, fp32_state, params)
    assert isinstance(state.inner_state[0], CenteredState)
    back = dequantize_state(state)
    assert isinstance(back[0], optax.ScaleByRStdDevState)
    variance = jax.tree.map(lambda m, n: n - m * m, back[0].mu, back[0].nu)
    assert all(bool(jnp.all(v >= 0)) for v in jax.tree.leaves(variance))
    assert relative_error(back[0].nu, fp32_state[0].nu) < 0.02


def test_a_state_that_does_not_match_is_refused_naming_the_first_path():
    params = make_params()
    tx = quantize_state(optax.adamw(1e-2), **OPTIONS)
    state = optax.adamw(1e-2).init(params)
    # Another optimizer's state: Lion's has no nu.
    with pytest.raises(ValueError, match=r"no leaf '0/nu/dense/bias'"):
        to_quantized_state(tx, optax.lion(1e-3).init(params), params)
    # Another model's: a leaf of another shape.
    other = jax.tree.map(lambda x: x, state)
    other[0].mu["out"] = jnp.zeros((30, 6))
    with pytest.raises(ValueError, match=r"'0/mu/out' is float32\[30, 6\].*float32\[30, 5\]"):
        to_quantized_state(tx, other, params)
    # A leaf left over.
    extra = {"0": {**state[0]._asdict(), "nu_max": state[0].nu}, "1": {}, "2": {}}
    with pytest.raises(ValueError, match="'0/nu_max/dense/bias'"):
        to_quantized_state(tx, extra, params)
    # Not the wrapper quantize_state returned.
    with pytest.raises(TypeError, match="quantize_state returned"):
        to_quantized_state(optax.adamw(1e-2), state, params)
    with pytest.raises(TypeError, match="quantize_state returned"):
        to_quantized_state(optax.chain(tx), state, params)
