"""The observer ``curvature_signals``: the signals of ``scale_by_triaccel`` beside any optimizer.

The harness (tests/harness.py) runs the common checks on it chained with adamw and Muon; here,
what is its own: the updates pass through bit for bit, its figures are ``scale_by_triaccel``'s
for the same gradients, it composes with SGD and optax's wrappers, and the planner, the state
conversion and the controller read it.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from controller_harness import make_controller

import triaccel_jax
from triaccel_jax.precision import PlannerConfig
from triaccel_jax.transforms import convert_state
from triaccel_jax.transforms import mean_curvatures

_OPTAX_PROMOTES = "optax's own optimizers promote inside (a float to the power of an int32 count)"

# Leaves of different curvature and different gradient noise.
_SCALES = {"a": 3.0, "b": 0.3, "c": 1.0}


def make_params(integer=True):
    """Three float leaves, and an integer one (which optax's own optimizers do not take)."""
    keys = jax.random.split(jax.random.key(1), 3)
    params = {
        "a": jax.random.normal(keys[0], (16, 8)),
        "b": jax.random.normal(keys[1], (40,)),
        "c": jax.random.normal(keys[2], (4, 4, 2, 3)),
    }
    return {**params, "step": jnp.int32(0)} if integer else params


def noisy_grads(seed, params):
    """Gradients of a quadratic with per-leaf noise: known curvature, non-zero noise."""
    keys = jax.random.split(jax.random.key(100 + seed), 3)
    grads = {}
    for key, name in zip(keys, ("a", "b", "c"), strict=True):
        noise = jax.random.normal(key, params[name].shape)
        grads[name] = _SCALES[name] * (params[name] + 0.5 * noise)
    if "step" in params:
        grads["step"] = jnp.int32(0)
    return grads


def run(tx, steps=6, integer=True, **extra):
    params = make_params(integer)
    state = tx.init(params)
    outputs = []
    for seed in range(steps):
        updates, state = tx.update(noisy_grads(seed, params), state, params, **extra)
        outputs.append(updates)
    return outputs, state


@pytest.mark.slow
@pytest.mark.standard_promotion(_OPTAX_PROMOTES)
def test_updates_pass_through_bit_for_bit():
    observed, state = run(
        optax.chain(triaccel_jax.curvature_signals(), optax.adamw(1e-2)), integer=False
    )
    alone, _ = run(optax.adamw(1e-2), integer=False)
    chex.assert_trees_all_equal(observed, alone)
    assert set(triaccel_jax.signals(state)) == {"a", "b", "c"}


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["fisher", "hutchinson"])
def test_figures_are_scale_by_triaccels_for_the_same_gradients(estimator):
    config = triaccel_jax.TriAccelConfig(estimator=estimator, block_size=8, rho=0.05)
    loss = lambda p: sum(0.5 * _SCALES[k] * jnp.sum(p[k] ** 2) for k in _SCALES)
    kw = {"config": config, "curvature_every": 2, "curvature_decay": 0.9, "seed": 3}
    _, observed = run(triaccel_jax.curvature_signals(0.8, 0.99, **kw), steps=7, loss_fn=loss)
    _, reference = run(
        triaccel_jax.scale_by_triaccel(0.8, 0.99, alpha=0.0, **kw), steps=7, loss_fn=loss
    )
    ours, theirs = triaccel_jax.signals(observed), triaccel_jax.signals(reference)
    for path in ("a", "b", "c"):
        for name in ("mean_curvature", "max_curvature", "trace", "noise_to_signal"):
            np.testing.assert_allclose(ours[path][name], theirs[path][name], rtol=1e-5)
        chex.assert_trees_all_close(ours[path]["curvature_store"], theirs[path]["curvature_store"])
        assert ours[path]["step_scale"] == 1.0
    # Hutchinson's estimate of this quadratic is exact: the per-leaf curvature.
    if estimator == "hutchinson":
        assert ours["a"]["mean_curvature"] == pytest.approx(_SCALES["a"], rel=1e-5)
    assert ours["a"]["noise_to_signal"] > 0.0


@pytest.mark.slow
@pytest.mark.standard_promotion(_OPTAX_PROMOTES)
def test_composes_with_sgd_and_optax_wrappers():
    sgd = optax.sgd(0.1, momentum=0.9)
    observed, state = run(optax.chain(triaccel_jax.curvature_signals(), sgd), integer=False)
    chex.assert_trees_all_equal(observed, run(sgd, integer=False)[0])
    for tx in (
        optax.inject_hyperparams(triaccel_jax.curvature_signals, hyperparam_dtype=jnp.float32)(
            b1=0.9, curvature_every=1
        ),
        optax.MultiSteps(
            optax.chain(triaccel_jax.curvature_signals(), optax.adam(1e-2)), every_k_schedule=2
        ),
        optax.masked(triaccel_jax.curvature_signals(), {"a": True, "b": False, "c": True}),
    ):
        _, state = run(tx, steps=4, integer=False)
        assert triaccel_jax.signals(state)["a"]["mean_curvature"] > 0.0


def test_an_injected_decay_is_traced_without_recompiling(count_compiles):
    tx = optax.inject_hyperparams(triaccel_jax.curvature_signals, hyperparam_dtype=jnp.float32)(
        curvature_decay=0.9
    )
    params = make_params()
    update = jax.jit(lambda g, s: tx.update(g, s, params))
    _, state = update(noisy_grads(0, params), tx.init(params))
    state.hyperparams["curvature_decay"] = jnp.asarray(0.5, jnp.float32)
    with count_compiles() as counter:
        update(noisy_grads(1, params), state)
    assert counter.count == 0


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="b1"):
        triaccel_jax.curvature_signals(b1=1.0)
    with pytest.raises(ValueError, match="curvature_every"):
        triaccel_jax.curvature_signals(curvature_every=0)
    with pytest.raises(TypeError, match="config"):
        triaccel_jax.curvature_signals(config={"estimator": "fisher"})
    tx = triaccel_jax.curvature_signals(config=triaccel_jax.TriAccelConfig(estimator="hutchinson"))
    params = make_params()
    with pytest.raises(ValueError, match="loss_fn"):
        tx.update(noisy_grads(0, params), tx.init(params), params)
    with pytest.raises(ValueError, match="tree structure"):
        tx.update({"a": params["a"]}, tx.init(params), params, loss_fn=lambda p: 0.0)


def test_signals_refuse_a_state_without_signals_and_say_what_to_chain():
    with pytest.raises(ValueError, match="curvature_signals"):
        triaccel_jax.signals(optax.adamw(1e-3).init(make_params()))


@pytest.mark.standard_promotion(_OPTAX_PROMOTES)
def test_convert_state_recasts_the_observers_ema_and_leaves_adams_moments():
    params = make_params(integer=False)
    tx = optax.chain(triaccel_jax.curvature_signals(), optax.adam(1e-3))
    state = tx.init(params)
    policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16", "bf16")
    converted = convert_state(state, policy)
    assert converted[0].mu["a"].dtype == jnp.bfloat16
    assert converted[1][0].mu["a"].dtype == jnp.float32  # adam's own state is adam's
    assert triaccel_jax.signals(converted)["a"]["state_dtype"] == "bfloat16"


@pytest.mark.slow
def test_mean_curvatures_and_the_planner_read_the_observer():
    params = make_params()
    _, state = run(triaccel_jax.curvature_signals())
    kappa = jax.jit(mean_curvatures)(state, params)
    assert kappa["step"] is None
    # The Fisher of the sharpest leaf is the largest.
    assert float(kappa["a"]) > float(kappa["c"]) > float(kappa["b"]) > 0.0
    plan = triaccel_jax.plan_precision(
        triaccel_jax.signals(state), params, budget=float("inf"), min_size=0
    )
    assert plan.policy.compute("a") == plan.policy.compute("c") == "bf16"


@pytest.mark.slow
@pytest.mark.standard_promotion(_OPTAX_PROMOTES)
def test_the_controller_plans_precision_over_adamw_from_the_observer():
    tx = optax.chain(triaccel_jax.curvature_signals(curvature_every=2), optax.adamw(1e-2))
    controller = make_controller(
        tx=tx,
        replan_every=3,
        precision_rule="memory",
        planner=PlannerConfig(budget=float("inf"), min_size=0),
        probe=triaccel_jax.FakeMemoryProbe(10**12),
    )
    infos = controller.run(10)
    assert controller.policy.compute("w1") == "bf16"
    assert triaccel_jax.signals(controller.opt_state)["w1"]["state_dtype"] == "bfloat16"
    assert np.isfinite([i.loss for i in infos]).all()


@pytest.mark.standard_promotion(_OPTAX_PROMOTES)
def test_the_hessian_noise_scale_runs_from_the_observer():
    config = triaccel_jax.TriAccelConfig(estimator="fisher")
    tx = optax.chain(triaccel_jax.curvature_signals(config=config), optax.adamw(1e-2))
    controller = make_controller(tx=tx, noise_estimator="hessian", batch_size=16, check_every=2)
    infos = controller.run(6)
    assert any(i.noise_scale is not None and np.isfinite(i.noise_scale) for i in infos)
