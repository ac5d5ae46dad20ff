"""The step's curvature-weighted squared gradient norms (``noise_weights="curvature"``), from which
the Hessian-weighted noise scale ``B_noise = tr(H Sigma) / (G^T H G)`` is estimated (McCandlish et
al., 2018, appendix A): they match a hand computation from the curvature the optimizer holds
before the step (negative curvature clipped, leaves without curvature left out), recover
``B_noise`` from synthetic per-sample gradients through the goodput estimator, compose with
micro-batches, ``split=True``, loss scaling and the fused update, leave the default step
untouched, and an optimizer without curvature is refused."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax import training
from triaccel_jax.controller._noise_scale import NoiseScaleEstimate
from triaccel_jax.controller._noise_scale import observe_noise
from triaccel_jax.transforms import AdamSignalsState
from triaccel_jax.transforms import CurvatureSignalsState
from triaccel_jax.transforms import LossScaling
from triaccel_jax.transforms import TriAccelConfig
from triaccel_jax.transforms import fused_triaccel

WEIGHTED = ("curvature_grad_sq_norm", "curvature_micro_grad_sq_norm")


def linear_loss(params, batch):
    """``mean_i sum_l <x_l[i], p_l>``: sample ``i``'s gradient for leaf ``l`` is ``x_l[i]``."""
    return sum(
        jnp.mean(jnp.sum(batch[k] * params[k], axis=tuple(range(1, batch[k].ndim)))) for k in params
    )


def linear_batch(params, *, seed):
    """Eight samples' gradients for :func:`linear_loss`, standard normal."""
    keys = jax.random.split(jax.random.key(seed), len(params))
    return {
        k: jax.random.normal(key, (8, *params[k].shape))
        for k, key in zip(params, keys, strict=True)
    }


def mse(params, batch):
    prediction = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((prediction - batch["y"]) ** 2)


def is_signal_state(node):
    return isinstance(node, CurvatureSignalsState | AdamSignalsState)


def with_curvature(state, curvature):
    """``state`` with every triaccel leaf's mean curvature set to ``curvature[leaf name]``."""

    def set_state(node):
        if not is_signal_state(node):
            return node
        # The signals are vectors over the observed leaves, in the order of their paths.
        means = [curvature[path.split("/")[-1]] for path in node.leaf_paths()]
        signals = node.leaf_signals._replace(mean_curvature=jnp.asarray(means, jnp.float32))
        return node._replace(leaf_signals=signals)

    return jax.tree.map(set_state, state, is_leaf=is_signal_state)


def make_step(loss, tx, *, num_micro, split=False, loss_scaling=None, fused=None, weights=True):
    normalized = training.normalize_loss_fn(loss, has_aux=False, has_model_state=False)
    step = training.make_train_step(
        normalized,
        tx,
        policy=None,
        num_micro=num_micro,
        seed=0,
        loss_scaling=loss_scaling,
        fused=fused,
        split=split,
        noise_weights="curvature" if weights else None,
    )
    return jax.jit(step)


def run(step, params, opt_state, batch, num_micro, *, index=0, loss_scale=None):
    micro = jax.tree.map(lambda x: x.reshape(num_micro, -1, *x.shape[1:]), batch)
    loss_scale = LossScaling().init() if loss_scale is None else loss_scale
    return step(params, opt_state, None, micro, jnp.int32(index), jnp.float32(1.0), loss_scale)


def micro_batches(batch, num_micro, split):
    """The batches the step differentiates: contiguous micro-batches, or even/odd halves."""
    if split:
        return [jax.tree.map(lambda x, i=i: x[i::2], batch) for i in range(2)]
    size = len(jax.tree.leaves(batch)[0]) // num_micro
    return [
        jax.tree.map(lambda x, i=i: x[i * size : (i + 1) * size], batch) for i in range(num_micro)
    ]


def hand_norms(loss, params, batch, num_micro, split, weights):
    """``(plain big, plain micro, weighted big, weighted micro)`` in float64."""
    grads = [
        jax.tree.map(lambda g: np.asarray(g, np.float64), jax.grad(loss)(params, b))
        for b in micro_batches(batch, num_micro, split)
    ]
    big = jax.tree.map(lambda *gs: np.mean(gs, axis=0), *grads)

    def norm(tree, weighted):
        return sum(
            (weights[k] if weighted else 1.0) * float(np.sum(np.square(tree[k]))) for k in tree
        )

    return (
        norm(big, False),
        np.mean([norm(g, False) for g in grads]),
        norm(big, True),
        np.mean([norm(g, True) for g in grads]),
    )


def assert_norms(metrics, expected, rtol=1e-5):
    names = ("grad_sq_norm", "micro_grad_sq_norm", *WEIGHTED)
    for name, value in zip(names, expected, strict=True):
        chex.assert_shape(metrics[name], ())
        chex.assert_type(metrics[name], jnp.float32)
        assert np.isfinite(float(metrics[name])), name
        np.testing.assert_allclose(float(metrics[name]), value, rtol=rtol, err_msg=name)


@pytest.mark.parametrize(("num_micro", "split"), [(1, False), (2, False), (4, False), (1, True)])
def test_the_weighted_norms_match_a_hand_computation_from_a_hand_built_state(num_micro, split):
    # (a) and (e): known per-sample gradients (a linear loss), curvature set by hand, one leaf's
    # negative (as Hutchinson's can be): it is clipped at 0 and weighs nothing.
    params = {"a": jnp.zeros(4), "b": jnp.zeros((2, 3)), "c": jnp.zeros(5)}
    batch = linear_batch(params, seed=3)
    curvature = {"a": 3.0, "b": 0.5, "c": -2.0}
    tx = triaccel_jax.triaccel(0.1)
    state = with_curvature(tx.init(params), curvature)
    out = run(
        make_step(linear_loss, tx, num_micro=num_micro, split=split),
        params,
        state,
        batch,
        num_micro,
    )
    clipped = {k: max(h, 0.0) for k, h in curvature.items()}
    expected = hand_norms(linear_loss, params, batch, num_micro, split, clipped)
    assert_norms(out.metrics, expected)
    # The curvature weighs leaf by leaf: here not a multiple of the plain norms.
    assert expected[2] != pytest.approx(3.0 * expected[0], rel=1e-3)
    if num_micro == 1 and not split:
        assert float(out.metrics[WEIGHTED[0]]) == float(out.metrics[WEIGHTED[1]])
    else:
        assert float(out.metrics[WEIGHTED[1]]) > float(out.metrics[WEIGHTED[0]])


def test_leaves_left_to_another_optimizer_weigh_nothing():
    params = {"a": jnp.zeros(4), "b": jnp.zeros(3), "c": jnp.zeros(2)}
    batch = linear_batch(params, seed=4)
    tx = optax.multi_transform(
        {"tri": triaccel_jax.triaccel(0.1), "sgd": optax.sgd(0.1)},
        {"a": "tri", "b": "tri", "c": "sgd"},
    )
    state = with_curvature(tx.init(params), {"a": 2.0, "b": 5.0})
    out = run(make_step(linear_loss, tx, num_micro=2), params, state, batch, 2)
    expected = hand_norms(linear_loss, params, batch, 2, False, {"a": 2.0, "b": 5.0, "c": 0.0})
    assert_norms(out.metrics, expected)


def test_the_weighted_estimator_recovers_the_hessian_noise_scale():
    # (b): per-sample gradients G_l + sigma_l z with known |G_l|^2 and tr(Sigma_l), curvature h_l
    # unequal across the leaves, through the real step and the goodput estimator.
    dim, batch_size, num_micro = 50, 64, 4
    mean = {"a": np.full(dim, dim**-0.5), "b": np.full(dim, dim**-0.5)}  # |G_l|^2 = 1
    trace = {"a": 10.0, "b": 100.0}  # tr(Sigma_l), isotropic
    curvature = {"a": 10.0, "b": 0.1}
    b_simple = sum(trace.values()) / sum(float(np.sum(m**2)) for m in mean.values())
    b_noise = sum(curvature[k] * trace[k] for k in trace) / sum(
        curvature[k] * float(np.sum(mean[k] ** 2)) for k in mean
    )
    assert b_simple == pytest.approx(55.0) and b_noise == pytest.approx(110 / 10.1)

    params = {k: jnp.zeros(dim) for k in mean}
    tx = triaccel_jax.triaccel(0.1)
    state = with_curvature(tx.init(params), curvature)
    step = make_step(linear_loss, tx, num_micro=num_micro)
    rng = np.random.default_rng(0)
    plain, weighted, equal = NoiseScaleEstimate(), NoiseScaleEstimate(), NoiseScaleEstimate()
    common = {
        "batch": batch_size,
        "sub_batch": batch_size // num_micro,
        "horizon": 100 * batch_size,
    }
    for index in range(400):
        batch = {
            k: (mean[k] + np.sqrt(trace[k] / dim) * rng.standard_normal((batch_size, dim))).astype(
                np.float32
            )
            for k in mean
        }
        metrics = run(step, params, state, batch, num_micro, index=index).metrics
        metrics = {k: float(v) for k, v in metrics.items()}
        plain = observe_noise(
            plain,
            grad_sq_norm=metrics["grad_sq_norm"],
            sub_grad_sq_norm=metrics["micro_grad_sq_norm"],
            **common,
        )
        weighted = observe_noise(
            weighted,
            grad_sq_norm=metrics["curvature_grad_sq_norm"],
            sub_grad_sq_norm=metrics["curvature_micro_grad_sq_norm"],
            **common,
        )
        # Equal curvature everywhere (7.0) scales both norms alike: B_noise is B_simple.
        equal = observe_noise(
            equal,
            grad_sq_norm=7.0 * metrics["grad_sq_norm"],
            sub_grad_sq_norm=7.0 * metrics["micro_grad_sq_norm"],
            **common,
        )
    assert weighted.simple == pytest.approx(b_noise, rel=0.1)
    assert plain.simple == pytest.approx(b_simple, rel=0.1)
    assert equal.simple == pytest.approx(plain.simple, rel=1e-6)
    # Unequal curvature: the Hessian-weighted scale is not the simple one (here 5 times smaller).
    assert weighted.simple < plain.simple / 3


@pytest.mark.parametrize(("estimator", "fused"), [("fisher", False), ("hutchinson", True)])
def test_a_real_triaccel_step_weighs_by_the_curvature_it_held_before_the_update(estimator, fused):
    # (c): a least-squares problem, the curvature estimated every step; each step's weighted
    # norms use the state it was given (the curvature before its own update).
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(k1, (3, 2)), "b": jax.random.normal(k2, (2,))}
    batch = {"x": jax.random.normal(k3, (16, 3)), "y": jax.random.normal(k4, (16, 2))}
    form = fused_triaccel(1e-2, curvature_every=1, config=TriAccelConfig(estimator=estimator))
    tx = form.tx
    step = make_step(mse, tx, num_micro=4, fused=form if fused else None)
    state = tx.init(params)
    for index in range(3):
        kappa = {
            k: max(record["mean_curvature"], 0.0)
            for k, record in triaccel_jax.signals(state).items()
        }
        out = run(step, params, state, batch, 4, index=index)
        assert_norms(out.metrics, hand_norms(mse, params, batch, 4, False, kappa), rtol=1e-4)
        if index == 0:  # no estimate yet: the curvature, and so the weighted norms, are 0
            assert all(float(out.metrics[name]) == 0.0 for name in WEIGHTED)
        else:
            assert all(float(out.metrics[name]) > 0.0 for name in WEIGHTED)
        params, state = out.params, out.opt_state


def test_the_option_changes_nothing_else_and_the_default_step_has_no_weighted_norms():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    params = {"w": jax.random.normal(k1, (3, 2)), "b": jax.random.normal(k2, (2,))}
    batch = {"x": jax.random.normal(k3, (16, 3)), "y": jax.random.normal(k4, (16, 2))}
    tx = triaccel_jax.triaccel(1e-2, curvature_every=1)
    state = tx.init(params)
    _, state = tx.update(params, state, params)  # some curvature
    default = run(make_step(mse, tx, num_micro=2, weights=False), params, state, batch, 2)
    weighted = run(make_step(mse, tx, num_micro=2), params, state, batch, 2)
    assert not set(WEIGHTED) & set(default.metrics)
    assert set(weighted.metrics) == set(default.metrics) | set(WEIGHTED)
    plain_metrics = {k: v for k, v in weighted.metrics.items() if k not in WEIGHTED}
    chex.assert_trees_all_equal(
        (default.params, default.opt_state, default.metrics),
        (weighted.params, weighted.opt_state, plain_metrics),
    )


def test_the_weighted_norms_are_of_the_unscaled_gradients_under_loss_scaling():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(2), 4)
    params = {"w": jax.random.normal(k1, (3, 2)), "b": jax.random.normal(k2, (2,))}
    batch = {"x": jax.random.normal(k3, (16, 3)), "y": jax.random.normal(k4, (16, 2))}
    tx = triaccel_jax.triaccel(1e-2)
    state = with_curvature(tx.init(params), {"w": 2.0, "b": 0.25})
    rule = LossScaling(initial_scale=2.0**12)
    scaled = run(
        make_step(mse, tx, num_micro=2, loss_scaling=rule),
        params,
        state,
        batch,
        2,
        loss_scale=rule.init(),
    )
    assert float(scaled.metrics["loss_scale"]) == 2.0**12
    expected = hand_norms(mse, params, batch, 2, False, {"w": 2.0, "b": 0.25})
    assert_norms(scaled.metrics, expected)


@pytest.mark.standard_promotion("optax.adam raises its decay rates to an int32 count")
def test_an_optimizer_without_curvature_is_refused_clearly():
    # (d)
    params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
    batch = {"x": jnp.ones((4, 3)), "y": jnp.ones((4, 2))}
    tx = optax.adam(1e-2)
    step = make_step(mse, tx, num_micro=1)
    with pytest.raises(ValueError, match=r'noise_weights="curvature".*holds none.*optax\.adam'):
        run(step, params, tx.init(params), batch, 1)
    # Without the option the same optimizer trains as before.
    out = run(make_step(mse, tx, num_micro=1, weights=False), params, tx.init(params), batch, 1)
    assert "curvature_grad_sq_norm" not in out.metrics


def test_an_unknown_weighting_is_refused_when_the_step_is_made():
    loss = training.normalize_loss_fn(mse, has_aux=False, has_model_state=False)
    with pytest.raises(ValueError, match="noise_weights"):
        training.make_train_step(
            loss, optax.sgd(0.1), policy=None, num_micro=1, seed=0, noise_weights="fisher"
        )
