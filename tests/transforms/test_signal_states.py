"""The two transforms that keep curvature signals, and their two states.

The observer (``curvature_signals``, and inside ``scale_by_curvature``) keeps
``CurvatureSignalsState``, whose ``nu`` is one float32 per observed leaf; the signals beside
Adam's direction (inside ``scale_by_triaccel`` and ``triaccel``) keep ``AdamSignalsState``,
whose ``nu`` is Adam's, element-wise. Everything that reads signals finds either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax.transforms import AdamSignalsState
from triaccel_jax.transforms import CurvatureSignalsState
from triaccel_jax.transforms import convert_state
from triaccel_jax.transforms import find_signal_states

_OPTAX_PROMOTES = "optax's own optimizers promote inside (a float to the power of an int32 count)"


def make_params(integer=True):
    """Two float leaves of different shapes, and an integer one, which no signals observe (and
    optax's own optimizers do not take)."""
    keys = jax.random.split(jax.random.key(3), 2)
    params = {
        "kernel": jax.random.normal(keys[0], (6, 4)),
        "bias": jax.random.normal(keys[1], (4,)),
    }
    return {**params, "step": jnp.int32(0)} if integer else params


def grads_of(params):
    grads = {"kernel": jnp.full((6, 4), 0.5), "bias": jnp.arange(4, dtype=jnp.float32)}
    return {**grads, "step": jnp.int32(0)} if "step" in params else grads


OBSERVERS = {
    "curvature_signals": lambda: optax.chain(triaccel_jax.curvature_signals(), optax.sgd(0.1)),
    "scale_by_curvature": lambda: triaccel_jax.scale_by_curvature(optax.sgd(0.1)),
}
ADAMS = {
    "triaccel": lambda: triaccel_jax.triaccel(1e-2),
    "scale_by_triaccel": lambda: triaccel_jax.scale_by_triaccel(),
    # The dtype given: optax's inject_hyperparams would find the params' highest dtype by
    # promoting float32 with int32, which strict promotion refuses.
    "injected": lambda: optax.inject_hyperparams(
        triaccel_jax.triaccel, hyperparam_dtype=jnp.float32
    )(learning_rate=1e-2),
}


def stepped(make, integer=True):
    """The one signals state of ``make()`` after two updates."""
    tx, params = make(), make_params(integer)
    state = tx.init(params)
    for _ in range(2):
        _, state = tx.update(grads_of(params), state, params)
    (found,) = find_signal_states(state)
    return found


@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_the_observer_keeps_its_own_state_with_one_second_moment_per_leaf(name):
    state = stepped(OBSERVERS[name], integer=False)
    assert type(state) is CurvatureSignalsState
    # One entry per observed leaf (the two float leaves), in the params' leaf order.
    assert state.leaf_paths() == ["bias", "kernel"]
    assert state.nu.shape == (2,) and state.nu.dtype == jnp.float32
    assert state.mu["kernel"].shape == (6, 4)
    # The EMA of each leaf's mean(g**2) after two steps: (1 - b2**2) * mean(g**2).
    mean_squares = np.array([np.mean(np.arange(4.0) ** 2), 0.25])
    np.testing.assert_allclose(state.nu, (1 - 0.999**2) * mean_squares, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(ADAMS))
def test_the_signals_beside_adam_keep_adams_element_wise_second_moment(name):
    state = stepped(ADAMS[name])
    assert type(state) is AdamSignalsState
    assert state.nu["kernel"].shape == (6, 4) and state.nu["bias"].shape == (4,)
    assert isinstance(state.nu["step"], optax.MaskedNode)
    np.testing.assert_allclose(state.nu["bias"], (1 - 0.999**2) * np.arange(4.0) ** 2, rtol=1e-4)


@pytest.mark.standard_promotion(_OPTAX_PROMOTES)
def test_find_signal_states_finds_both_kinds_in_one_state_in_tree_order():
    params = make_params()
    tx = optax.multi_transform(
        {
            "adam": triaccel_jax.triaccel(1e-2),
            "observed": optax.chain(triaccel_jax.curvature_signals(), optax.adamw(1e-2)),
        },
        {"kernel": "adam", "bias": "observed", "step": "adam"},
    )
    state = tx.init(params)
    found = find_signal_states(state)
    assert [type(s) for s in found] == [AdamSignalsState, CurvatureSignalsState]
    # signals() reads both: every trained leaf once, from the state that observes it.
    _, state = tx.update(grads_of(params), state, params)
    assert sorted(triaccel_jax.signals(state)) == ["bias", "kernel"]


def test_the_observer_alone_reports_a_step_scale_of_one_and_the_scaled_one_its_own():
    observed = triaccel_jax.signals(stepped(OBSERVERS["curvature_signals"], integer=False))
    scaled = triaccel_jax.signals(stepped(OBSERVERS["scale_by_curvature"], integer=False))
    assert [observed[k]["step_scale"] for k in ("bias", "kernel")] == [1.0, 1.0]
    # Fisher means 3.5 and 0.25, median 1.875: sqrt(1.875 / kappa), within [0.5, 2].
    expected = [np.sqrt(1.875 / 3.5), np.sqrt(1.875 / 0.25)]
    np.testing.assert_allclose(
        [scaled[k]["step_scale"] for k in ("bias", "kernel")], np.minimum(expected, 2.0), rtol=1e-5
    )


def test_convert_state_recasts_adams_second_moment_and_leaves_the_observers_vector():
    policy = triaccel_jax.PrecisionPolicy.uniform(make_params(integer=False), "bf16", "bf16")
    adam = convert_state(stepped(ADAMS["triaccel"]), policy)
    observer = convert_state(stepped(OBSERVERS["curvature_signals"], integer=False), policy)
    assert adam.nu["kernel"].dtype == jnp.bfloat16
    assert observer.mu["kernel"].dtype == jnp.bfloat16
    assert observer.nu.dtype == jnp.float32 and observer.nu.shape == (2,)
