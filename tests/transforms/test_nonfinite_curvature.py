"""A non-finite curvature estimate of a leaf is dropped, counted, and cannot poison the others.

The Hutchinson estimate of ``0.5 * sum(h * p**2)`` is exactly ``h`` (``z * (h * z)`` with
``z = +-1``), so feeding ``h`` with NaN or infinite entries injects them into the estimate while the
gradients Adam sees stay clean.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import triaccel_jax

SHAPES = {"a": (8,), "b": (4, 3), "c": (5,)}
# Clean curvatures 100x apart, so the step scales differ between leaves and some are clipped.
LEVELS = {"a": 0.01, "b": 1.0, "c": 0.3}
DECAY = 0.9
ALPHA, MIN_SCALE, MAX_SCALE = 0.5, 0.25, 4.0
STEPS = 4
POISONS = (math.nan, math.inf, -math.inf)

PARAMS = {
    name: jnp.linspace(-1.0, 1.0, math.prod(shape)).reshape(shape) for name, shape in SHAPES.items()
}
GRADS = jax.tree.map(lambda p: jnp.cos(3 * p) + 0.1, PARAMS)
TX = triaccel_jax.scale_by_triaccel(
    config=triaccel_jax.TriAccelConfig(estimator="hutchinson"),
    curvature_every=1,
    curvature_decay=DECAY,
    alpha=ALPHA,
    min_scale=MIN_SCALE,
    max_scale=MAX_SCALE,
)


@jax.jit
def _step(state, h):
    def loss_fn(p):
        return sum(0.5 * jnp.sum(h[k] * p[k] ** 2) for k in p)

    return TX.update(GRADS, state, PARAMS, loss_fn=loss_fn)


def _signals(state):
    """The curvature signals' state inside ``scale_by_triaccel``'s."""
    (signals,) = triaccel_jax.transforms.find_signal_states(state)
    return signals


def _clean(name, step):
    size = math.prod(SHAPES[name])
    pattern = 1.0 + 0.5 * np.sin(np.arange(size) + step)  # positive, varies with the step
    return (LEVELS[name] * (1 + 0.2 * step) * pattern).astype(np.float32).reshape(SHAPES[name])


def _poison_spec():
    leaf = st.one_of(
        st.none(),
        st.lists(st.tuples(st.integers(0, 59), st.sampled_from(POISONS)), min_size=1, max_size=3),
    )
    return st.lists(
        st.fixed_dictionaries(dict.fromkeys(SHAPES, leaf)), min_size=STEPS, max_size=STEPS
    )


@settings(max_examples=25, deadline=None, derandomize=True)
@given(_poison_spec())
def test_non_finite_estimates_are_dropped_per_leaf(injections):
    state = TX.init(PARAMS)
    ema = dict.fromkeys(SHAPES, 0.0)  # reference EMA of each leaf's mean curvature
    kept = dict.fromkeys(SHAPES, 0)
    dropped = dict.fromkeys(SHAPES, 0)
    for step, poison in enumerate(injections):
        h = {}
        for name, shape in SHAPES.items():
            values = _clean(name, step).reshape(-1)
            for position, value in poison[name] or ():
                values[position % values.size] = value
            h[name] = jnp.asarray(values.reshape(shape))
        before = _signals(state).curvature_by_leaf()
        updates, state = _step(state, h)

        for name in SHAPES:
            if poison[name]:
                dropped[name] += 1
                # The poisoned estimate never reached the EMA: the store is bit-for-bit unchanged.
                chex.assert_trees_all_equal(before[name], _signals(state).curvature_by_leaf()[name])
            else:
                kept[name] += 1
                ema[name] = DECAY * ema[name] + (1 - DECAY) * float(np.mean(h[name]))
            signals = _signals(state).signals_by_leaf()[name]
            chex.assert_type(signals.dropped_estimates, jnp.int32)
            assert int(signals.dropped_estimates) == dropped[name], (name, step)

        # Mean curvature: the EMA of the kept estimates, bias-corrected by their number.
        kappa = {
            name: ema[name] / (1 - DECAY ** kept[name]) if kept[name] else 0.0 for name in SHAPES
        }
        reference = float(np.median(list(kappa.values())))
        for name in SHAPES:
            signals = _signals(state).signals_by_leaf()[name]
            np.testing.assert_allclose(signals.mean_curvature, kappa[name], rtol=1e-5, atol=1e-12)
            tiny = float(np.finfo(np.float32).tiny)
            expected = np.clip(
                ((reference + tiny) / (kappa[name] + tiny)) ** ALPHA, MIN_SCALE, MAX_SCALE
            )
            np.testing.assert_allclose(signals.step_scale, expected, rtol=1e-5)
            chex.assert_tree_all_finite(updates[name])


def test_an_estimate_whose_ema_overflows_is_dropped_too():
    # Finite entries near float32's maximum overflow the block sums (an overflowing HVP): the EMA
    # would hold inf for good, so the estimate is dropped like a non-finite one.
    state = TX.init(PARAMS)
    clean = {name: jnp.asarray(_clean(name, 0)) for name in SHAPES}
    _, state = _step(state, clean)
    before = _signals(state).curvature_by_leaf()["a"]
    huge = {**clean, "a": jnp.full(SHAPES["a"], 3e38, jnp.float32)}
    updates, state = _step(state, huge)
    chex.assert_trees_all_equal(before, _signals(state).curvature_by_leaf()["a"])
    assert int(_signals(state).signals_by_leaf()["a"].dropped_estimates) == 1
    assert int(_signals(state).signals_by_leaf()["b"].dropped_estimates) == 0
    chex.assert_tree_all_finite(updates)


def test_every_leaf_dropped_on_the_first_step_leaves_steps_unscaled():
    poisoned = {name: jnp.full(shape, jnp.nan) for name, shape in SHAPES.items()}
    updates, state = _step(TX.init(PARAMS), poisoned)
    for name in SHAPES:
        signals = _signals(state).signals_by_leaf()[name]
        assert float(signals.step_scale) == 1.0 and int(signals.dropped_estimates) == 1
        assert float(signals.mean_curvature) == 0.0
        # Adam's first step is sign(g), unscaled.
        np.testing.assert_allclose(updates[name], np.sign(GRADS[name]), rtol=1e-6)
