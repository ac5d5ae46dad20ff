"""Every triaccel variant in ``harness.VARIANTS`` through the common optimizer checks.

Two checks of a single update (its dtype, masked leaves) are a ``chex.TestCase`` run both jitted
and eagerly with ``chex.variants``; the rest are pytest functions (they use the ``count_compiles``
fixture, compare jit with eager themselves, or train for many steps, jitted as users run them).
"""

from __future__ import annotations

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized
from harness import NAMED_VARIANTS
from harness import VARIANTS

import triaccel_jax

variants = pytest.mark.parametrize("variant", [variant.param() for variant in VARIANTS])


def make_params():
    keys = jax.random.split(jax.random.key(0), 3)
    return {
        "conv": jax.random.normal(keys[0], (3, 3, 2, 4)),
        "dense": {
            "kernel": jax.random.normal(keys[1], (8, 3)),
            "bias": jnp.zeros((3,)),
        },
    }


# Per-leaf curvatures differ by 100x so the step-size scales differ between leaves.
_CURVATURE = {"conv": 10.0, "dense": {"kernel": 1.0, "bias": 0.1}}


def loss_fn(params):
    targets = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    quadratic = jax.tree.map(
        lambda p, t, c: 0.5 * c * jnp.sum((p - t) ** 2), params, targets, _CURVATURE
    )
    coupling = jnp.sum(jnp.tanh(params["dense"]["kernel"] @ params["dense"]["bias"]))
    return sum(jax.tree.leaves(quadratic)) + 0.1 * coupling


def run(tx, variant, params, steps, loss=loss_fn, jit=True):
    state = tx.init(params)

    def step(params, state):
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params, **variant.extra_args(loss))
        return optax.apply_updates(params, updates), state

    step = jax.jit(step) if jit else step
    for _ in range(steps):
        params, state = step(params, state)
    return params, state


@variants
def test_jit_matches_eager(variant):
    tx = variant.make(1e-2)
    eager, _ = run(tx, variant, make_params(), 2, jit=False)
    jitted, _ = run(tx, variant, make_params(), 2, jit=True)
    chex.assert_trees_all_close(eager, jitted, rtol=1e-5, atol=1e-6)


@variants
def test_the_transform_is_only_its_init_and_update(variant):
    # Nothing rides on attributes set on the functions: what a transform holds is its fields.
    tx = variant.make(1e-2)
    assert len(tx) == 2
    for function in tx:
        assert callable(function)
        if inspect.isfunction(function):
            assert not vars(function), f"attributes set on a function: {sorted(vars(function))}"


@variants
def test_state_types_stable_through_cond(variant):
    tx = variant.make(1e-2)
    params = make_params()
    state = tx.init(params)
    grads = jax.grad(loss_fn)(params)

    @jax.jit
    def maybe_update(pred, state):
        def update(state):
            return tx.update(grads, state, params, **variant.extra_args(loss_fn))[1]

        return jax.lax.cond(pred, update, lambda state: state, state)

    for pred in (True, False, True):
        new_state = maybe_update(pred, state)
        chex.assert_trees_all_equal_shapes_and_dtypes(state, new_state)
        state = new_state
    (signal_state,) = triaccel_jax.transforms.find_signal_states(state)
    assert int(signal_state.count) == 2


@variants
def test_the_signals_state_holds_the_second_moment_its_type_says(variant):
    params = make_params()
    (signals,) = triaccel_jax.transforms.find_signal_states(variant.make(1e-2).init(params))
    if isinstance(signals, triaccel_jax.transforms.AdamSignalsState):
        # Adam's, element-wise: shaped like the params.
        chex.assert_trees_all_equal_shapes(signals.nu, params)
    else:
        # The observer's: one float32 mean per observed leaf.
        assert type(signals) is triaccel_jax.transforms.CurvatureSignalsState
        assert signals.nu.shape == (len(jax.tree.leaves(params)),)
        assert signals.nu.dtype == jnp.float32


@variants
def test_no_recompilation_on_second_call(variant, count_compiles):
    tx = variant.make(1e-2)
    params = make_params()
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params, **variant.extra_args(loss_fn))
        return optax.apply_updates(params, updates), state

    params, state = step(params, state)  # compiles once
    with count_compiles() as counter:
        for _ in range(3):
            params, state = step(params, state)
        jax.block_until_ready(params)
    assert counter.count == 0


@variants
def test_abstract_init_matches_concrete(variant):
    tx = variant.make(1e-2)
    params = make_params()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    chex.assert_trees_all_equal_shapes_and_dtypes(tx.init(abstract), tx.init(params))
    chex.assert_trees_all_equal_shapes_and_dtypes(jax.eval_shape(tx.init, params), tx.init(params))


@variants
def test_composes_with_clipping_chain(variant):
    tx = optax.chain(optax.clip_by_global_norm(1.0), variant.make(1e-1))
    params, state = run(tx, variant, make_params(), 150)
    assert float(loss_fn(params)) < 0.1 * float(loss_fn(make_params()))
    assert set(triaccel_jax.signals(state)) == {"conv", "dense/bias", "dense/kernel"}


def _zero_learning_rates(state):
    """Every injected learning rate set to 0, the inner one too where a variant is injected."""

    def is_injected(node):
        return isinstance(node, optax.InjectStatefulHyperparamsState)

    def zero(node):
        if not is_injected(node):
            return node
        return node._replace(
            hyperparams={**node.hyperparams, "learning_rate": jnp.zeros((), jnp.float32)},
            inner_state=_zero_learning_rates(node.inner_state),
        )

    return jax.tree.map(zero, state, is_leaf=is_injected)


@variants
def test_inject_hyperparams_changes_learning_rate_without_retracing(variant, count_compiles):
    factory = optax.inject_hyperparams(lambda learning_rate: variant.make(learning_rate))
    tx = factory(learning_rate=0.1)
    params = make_params()
    state = tx.init(params)
    grads = jax.grad(loss_fn)(params)
    update = jax.jit(lambda g, s, p: tx.update(g, s, p, **variant.extra_args(loss_fn)))
    updates, _ = update(grads, state, params)
    assert any(float(jnp.max(jnp.abs(u))) > 0 for u in jax.tree.leaves(updates))
    state = _zero_learning_rates(state)
    with count_compiles() as counter:
        zero_updates, new_state = update(grads, state, params)
    assert counter.count == 0
    chex.assert_trees_all_equal(zero_updates, jax.tree.map(jnp.zeros_like, zero_updates))
    assert "conv" in triaccel_jax.signals(new_state)


@pytest.mark.standard_promotion(
    "optax promotes inside its own transforms (integer leaves, MultiSteps, injected hyperparameters)"
)
@variants
def test_multisteps_accumulates(variant):
    tx = optax.MultiSteps(variant.make(1e-1), every_k_schedule=2)
    params = make_params()
    state = tx.init(params)
    grads = jax.grad(loss_fn)(params)
    update = jax.jit(lambda g, s: tx.update(g, s, params, **variant.extra_args(loss_fn)))
    first, state = update(grads, state)
    chex.assert_trees_all_equal(first, jax.tree.map(jnp.zeros_like, first))
    second, state = update(grads, state)
    assert all(float(jnp.max(jnp.abs(u))) > 0 for u in jax.tree.leaves(second))
    assert triaccel_jax.signals(state)["conv"]["step_scale"] > 0


@variants
def test_apply_if_finite_skips_nan_step(variant):
    tx = optax.apply_if_finite(variant.make(1e-1), max_consecutive_errors=5)
    params = make_params()
    state = tx.init(params)
    update = jax.jit(lambda g, s: tx.update(g, s, params, **variant.extra_args(loss_fn)))
    grads = jax.grad(loss_fn)(params)
    _, state = update(grads, state)
    bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
    updates, bad_state = update(bad, state)
    assert int(bad_state.notfinite_count) == 1
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
    chex.assert_trees_all_equal(state.inner_state, bad_state.inner_state)


def _merge_masked(masked, full):
    """Fills a masked params tree's MaskedNodes back in from ``full``."""
    return jax.tree.map(
        lambda m, f: f if isinstance(m, optax.MaskedNode) else m,
        masked,
        full,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )


# 60 tests of a second or two each: the full suite's (the fast tier runs the checks above on
# harness.FAST_VARIANTS).
@pytest.mark.slow
class TestOneUpdateWithAndWithoutJit(chex.TestCase):
    """One update of every variant, run by ``self.variant``: jitted, then eagerly."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*NAMED_VARIANTS)
    @pytest.mark.standard_promotion(
        "optax promotes inside its own transforms (integer leaves, MultiSteps, injected "
        "hyperparameters)"
    )
    def test_update_dtype_is_gradient_dtype(self, variant):
        tx = variant.make(1e-2)
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), make_params())
        state = tx.init(params)
        grads = jax.tree.map(jnp.ones_like, params)
        updates, new_state = self.variant(variant.update_fn(tx, loss_fn))(grads, state, params)
        chex.assert_trees_all_equal_dtypes(updates, grads)
        chex.assert_type(jax.tree.leaves(updates), jnp.bfloat16)
        chex.assert_trees_all_equal_shapes_and_dtypes(state, new_state)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*NAMED_VARIANTS)
    def test_masked_leaves_pass_through(self, variant):
        with variant.promotion():
            self._masked_leaves_pass_through(variant)

    def _masked_leaves_pass_through(self, variant):
        params = make_params()
        mask = {"conv": True, "dense": {"kernel": True, "bias": False}}
        tx = optax.masked(variant.make(1e-1), mask)
        state = tx.init(params)
        grads = jax.grad(loss_fn)(params)
        masked_loss = lambda masked: loss_fn(_merge_masked(masked, params))
        updates, state = self.variant(variant.update_fn(tx, masked_loss))(grads, state, params)
        chex.assert_trees_all_equal(updates["dense"]["bias"], grads["dense"]["bias"])
        assert not np.allclose(updates["conv"], grads["conv"])
        assert set(triaccel_jax.signals(state)) == {"conv", "dense/kernel"}


# Eager only: the masked leaves' path under jit is test_masked_leaves_pass_through's.
@variants
def test_partition_with_sgd(variant):
    params = make_params()
    labels = {"conv": "tri", "dense": {"kernel": "tri", "bias": "sgd"}}
    tx = optax.partition({"tri": variant.make(1e-1), "sgd": optax.sgd(1e-1)}, labels)
    extra = variant.extra_args(lambda masked: loss_fn(_merge_masked(masked, params)))
    state = tx.init(params)
    grads = jax.grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params, **extra)
    np.testing.assert_allclose(updates["dense"]["bias"], -0.1 * grads["dense"]["bias"], rtol=1e-6)
    assert set(triaccel_jax.signals(state)) == {"conv", "dense/kernel"}


@variants
def test_converges_on_quadratic(variant):
    params, _ = run(variant.make(5e-2), variant, make_params(), 300)
    assert float(loss_fn(params)) < 1e-3 * float(loss_fn(make_params())) + 1e-2


def rosenbrock(params):
    x, y = params["x"], params["y"]
    return jnp.sum((1 - x) ** 2 + 100 * (y - x**2) ** 2)


@variants
def test_converges_on_rosenbrock(variant):
    params = {"x": jnp.array([-1.2, 0.0]), "y": jnp.array([1.0, 0.5])}
    final, _ = run(variant.make(2e-2, weight_decay=0.0), variant, params, 2000, loss=rosenbrock)
    np.testing.assert_allclose(final["x"], 1.0, atol=0.05)
    np.testing.assert_allclose(final["y"], 1.0, atol=0.1)


@variants
def test_trains_under_the_controller_across_a_bucket_change(variant):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    data = (x, (x @ rng.normal(size=(8, 3))).astype(np.float32))

    def batch_loss(params, batch, *, policy, rng):
        inputs, targets = batch
        return jnp.mean(
            (inputs @ params["dense"]["kernel"] + params["dense"]["bias"] - targets) ** 2
        )

    params = {"dense": make_params()["dense"]}
    probe = triaccel_jax.FakeMemoryProbe(10_000, peak_bytes=lambda b: 100 + 50 * b)
    controller = triaccel_jax.Controller(
        batch_loss, params, variant.make(5e-2), data, min_batch=16, max_batch=128,
        probe=probe, check_every=5, batch_rule="memory",  # memory grows it to 128 at once
    )  # fmt: skip
    infos = controller.run(60)
    assert {i.batch_size for i in infos} == {16, 128}
    losses = [i.loss for i in infos]
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < variant.controller_loss_drop * np.mean(losses[:5])
