"""signals(): found anywhere in an optimizer state, keyed by leaf path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax.transforms import LeafSignals

PARAMS = {"encoder": {"layers": [{"kernel": jnp.ones((3, 2))}, {"kernel": jnp.ones((2, 2))}]}}
GRADS = jax.tree.map(lambda p: p * 0.5, PARAMS)
PATHS = {"encoder/layers/0/kernel", "encoder/layers/1/kernel"}


@pytest.mark.parametrize(
    "make",
    [
        lambda: triaccel_jax.triaccel(0.1),
        lambda: optax.chain(optax.clip(1.0), triaccel_jax.scale_by_triaccel(), optax.sgd(0.1)),
        lambda: optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=0.1),
        lambda: optax.MultiSteps(triaccel_jax.triaccel(0.1), every_k_schedule=1),
        lambda: optax.masked(triaccel_jax.triaccel(0.1), lambda p: jax.tree.map(lambda _: True, p)),
    ],
    ids=["alias", "chain", "inject_hyperparams", "MultiSteps", "masked"],
)
@pytest.mark.standard_promotion(
    "optax promotes inside its own transforms (integer leaves, MultiSteps, injected hyperparameters)"
)
def test_signals_found_in_wrapped_states(make):
    tx = make()
    state = tx.init(PARAMS)
    _, state = tx.update(GRADS, state, PARAMS)
    found = triaccel_jax.signals(state)
    assert set(found) == PATHS
    record = found["encoder/layers/0/kernel"]
    fields = LeafSignals._fields
    assert set(record) == {*fields, "state_dtype", "curvature_store"}
    assert {"mean_curvature", "max_curvature", "trace", "noise_to_signal", "step_scale"} <= set(
        record
    )
    assert record["mean_curvature"] == pytest.approx(0.25, rel=1e-5)
    assert record["trace"] == pytest.approx(1.5, rel=1e-5)
    assert record["state_dtype"] == "float32"
    # Python numbers of the state's kinds: floats for the figures, ints for the counters.
    for name in fields:
        kind = int if name == "dropped_estimates" else float
        assert type(record[name]) is kind, (name, record[name])
    store = record["curvature_store"]
    assert isinstance(store, triaccel_jax.transforms.CompressedDiagonal)
    # One estimate of g**2 = 0.25 everywhere, bias-corrected: the store holds 0.25.
    np.testing.assert_allclose(store.block_means, 0.25, rtol=1e-5)
    np.testing.assert_allclose(store.outlier_values, 0.25, rtol=1e-5)


def test_signals_inside_jit_are_traced_scalars():
    tx = triaccel_jax.triaccel(0.1, config=triaccel_jax.TriAccelConfig(state_dtype=jnp.bfloat16))
    state = tx.init(PARAMS)

    @jax.jit
    def curvature(state):
        _, state = tx.update(GRADS, state, PARAMS)
        return triaccel_jax.signals(state)["encoder/layers/1/kernel"]["mean_curvature"]

    assert float(curvature(state)) == pytest.approx(0.25, rel=1e-5)
    assert triaccel_jax.signals(state)["encoder/layers/1/kernel"]["state_dtype"] == "bfloat16"


def test_signals_can_be_returned_from_jit():
    # The whole record comes back from jit (no string in it there), with the eager figures.
    tx = triaccel_jax.triaccel(0.1)
    _, state = tx.update(GRADS, tx.init(PARAMS), PARAMS)
    inside = jax.jit(triaccel_jax.signals)(state)
    outside = triaccel_jax.signals(state)
    assert set(inside) == set(outside)
    for key, record in outside.items():
        assert set(inside[key]) == set(record) - {"state_dtype"}
        for name in triaccel_jax.transforms.LeafSignals._fields:
            np.testing.assert_allclose(inside[key][name], record[name], rtol=1e-6)


def test_signals_without_triaccel_state_is_an_error():
    state = optax.adam(0.1).init(PARAMS)
    with pytest.raises(ValueError, match="no triaccel state"):
        triaccel_jax.signals(state)


def test_signals_of_two_states_for_one_leaf_is_an_error():
    tx = optax.chain(triaccel_jax.scale_by_triaccel(), triaccel_jax.scale_by_triaccel())
    with pytest.raises(ValueError, match="two states hold"):
        triaccel_jax.signals(tx.init(PARAMS))
