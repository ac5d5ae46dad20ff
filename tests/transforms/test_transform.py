"""scale_by_triaccel and triaccel: pass-through leaves, state dtypes, step-size scales, errors."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax


def test_non_float_none_masked_and_empty_leaves_pass_through():
    params = {
        "w": jnp.ones((2, 2)),
        "step": jnp.array(7, jnp.int32),
        "flag": jnp.array(True),
        "none": None,
        "masked": optax.MaskedNode(),
        "empty": jnp.zeros((0, 3)),
    }
    grads = {**params, "w": jnp.full((2, 2), 0.5), "step": jnp.array(1, jnp.int32)}
    tx = triaccel_jax.triaccel(0.1)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert updates["step"].dtype == jnp.int32 and int(updates["step"]) == 1
    assert updates["flag"].dtype == jnp.bool_
    assert updates["none"] is None and isinstance(updates["masked"], optax.MaskedNode)
    assert updates["empty"].shape == (0, 3)
    assert float(jnp.abs(updates["w"]).max()) > 0
    assert set(triaccel_jax.signals(state)) == {"w"}


def test_empty_pytree():
    tx = triaccel_jax.triaccel(0.1)
    state = tx.init({})
    updates, _ = tx.update({}, state, {})
    assert updates == {}


def test_state_holds_arrays_with_int32_counters():
    tx = triaccel_jax.scale_by_triaccel(
        config=triaccel_jax.TriAccelConfig(state_dtype=jnp.bfloat16)
    )
    state = tx.init({"w": jnp.ones((4, 4))})
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
    (state,) = triaccel_jax.transforms.find_signal_states(state)
    chex.assert_type([state.count, state.curvature_count], jnp.int32)
    chex.assert_type([state.mu["w"], state.nu["w"]], jnp.bfloat16)


def test_counters_saturate():
    tx = triaccel_jax.scale_by_triaccel()
    params = {"w": jnp.ones(3)}
    signals, scale = tx.init(params)
    top = jnp.iinfo(jnp.int32).max
    signals = signals._replace(
        count=jnp.asarray(top, jnp.int32), curvature_count=jnp.asarray(top, jnp.int32)
    )
    updates, (signals, _) = tx.update(params, (signals, scale), params)
    assert int(signals.count) == top and int(signals.curvature_count) == top
    chex.assert_tree_all_finite(updates)


def test_first_update_is_adam_times_step_scale():
    params = {"flat": jnp.ones(8), "sharp": jnp.ones(8)}
    grads = {"flat": jnp.full(8, 0.1), "sharp": jnp.full(8, 1.0)}
    tx = triaccel_jax.scale_by_triaccel(eps=0.0, alpha=0.5, min_scale=0.1, max_scale=10.0)
    updates, state = tx.update(grads, tx.init(params), params)
    # Fisher curvature: 0.01 and 1.0, median 0.505; s = sqrt(0.505 / kappa); Adam's first step is
    # sign(g) exactly.
    np.testing.assert_allclose(updates["flat"], np.sqrt(0.505 / 0.01), rtol=1e-4)
    np.testing.assert_allclose(updates["sharp"], np.sqrt(0.505 / 1.0), rtol=1e-4)
    signals = triaccel_jax.signals(state)
    np.testing.assert_allclose(signals["sharp"]["mean_curvature"], 1.0, rtol=1e-5)
    np.testing.assert_allclose(signals["flat"]["trace"], 0.08, rtol=1e-5)
    np.testing.assert_allclose(signals["flat"]["noise_to_signal"], 0.0, atol=1e-5)


def test_step_scale_is_clipped():
    params = {"a": jnp.ones(4), "b": jnp.ones(4), "c": jnp.ones(4)}
    grads = {"a": jnp.full(4, 1e-3), "b": jnp.full(4, 1.0), "c": jnp.full(4, 1e3)}
    tx = triaccel_jax.scale_by_triaccel()
    _, state = tx.update(grads, tx.init(params), params)
    scales = {k: v["step_scale"] for k, v in triaccel_jax.signals(state).items()}
    assert scales == pytest.approx({"a": 2.0, "b": 1.0, "c": 0.5})


@pytest.mark.slow
@pytest.mark.standard_promotion(
    "optax promotes inside its own transforms (integer leaves, MultiSteps, injected hyperparameters)"
)
def test_alpha_zero_is_adamw():
    params = {"w": jax.random.normal(jax.random.key(0), (5, 3)), "b": jnp.zeros(3)}
    grads = jax.tree.map(lambda p: jnp.cos(p) + 0.1, params)
    ours = triaccel_jax.triaccel(1e-2, alpha=0.0, weight_decay=1e-2, eps=1e-8)
    adamw = optax.adamw(1e-2, weight_decay=1e-2, eps=1e-8)
    s1, s2 = ours.init(params), adamw.init(params)
    for _ in range(5):
        u1, s1 = ours.update(grads, s1, params)
        u2, s2 = adamw.update(grads, s2, params)
        chex.assert_trees_all_close(u1, u2, rtol=1e-5, atol=1e-8)


@pytest.mark.slow
def test_bf16_state_keeps_small_increments_with_stochastic_rounding():
    # nu grows by (1 - b2) * g**2 = 1e-3 per step from 1.0: below half a bf16 ulp at 1.0
    # (2**-8), so round-to-nearest would keep nu at exactly 1.0 forever.
    params = {"w": jnp.ones(4096)}
    tx = triaccel_jax.scale_by_triaccel(
        b2=0.999, config=triaccel_jax.TriAccelConfig(state_dtype=jnp.bfloat16)
    )
    signals, scale = tx.init(params)
    signals = signals._replace(
        nu={"w": jnp.ones(4096, jnp.bfloat16)}, count=jnp.asarray(10**6, jnp.int32)
    )
    state = (signals, scale)
    grads = {"w": jnp.full(4096, jnp.sqrt(2.0))}  # nu -> 0.999 + 0.002 = 1.001 per step
    step = jax.jit(lambda s: tx.update(grads, s, params)[1])
    for _ in range(20):
        state = step(state)
    exact = 2.0 - 0.999**20
    nu = state[0].nu["w"]
    mean = float(jnp.mean(nu.astype(jnp.float32)))
    assert nu.dtype == jnp.bfloat16
    assert abs(mean - exact) < 2e-3, (mean, exact)  # round-to-nearest would give 1.0


def test_update_is_deterministic_for_a_seed():
    params = {"w": jnp.linspace(-1.0, 1.0, 64)}
    grads = {"w": jnp.sin(jnp.arange(64.0))}
    results = []
    for _ in range(2):
        tx = triaccel_jax.scale_by_triaccel(
            config=triaccel_jax.TriAccelConfig(state_dtype=jnp.bfloat16), seed=5
        )
        _, state = tx.update(grads, tx.init(params), params)
        results.append(state[0].mu["w"])
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.slow
def test_learning_rate_schedule():
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    tx = triaccel_jax.triaccel(schedule, weight_decay=0.0)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    magnitudes = []
    for _ in range(11):
        updates, state = tx.update({"w": jnp.ones(3)}, state, params)
        magnitudes.append(float(jnp.abs(updates["w"]).max()))
    assert magnitudes[0] == pytest.approx(1.0, rel=1e-4) and magnitudes[-1] == 0.0


def test_hutchinson_without_loss_fn_says_how_to_pass_it():
    tx = triaccel_jax.triaccel(0.1, config=triaccel_jax.TriAccelConfig(estimator="hutchinson"))
    params = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"loss_fn=.*Flax"):
        tx.update(params, tx.init(params), params)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"learning_rate": -0.1}, "learning_rate"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"learning_rate": float("inf")}, "learning_rate"),
        ({"b1": 1.0}, r"b1.*\[0.0, 1.0\)"),
        ({"b1": -0.1}, "b1"),
        ({"b2": 1.5}, r"b2.*\[0.0, 1.0\)"),
        ({"curvature_every": 0}, r"curvature_every.*an integer >= 1, got 0"),
        ({"curvature_every": 2.5}, r"curvature_every.*an integer >= 1, got 2.5"),
        ({"curvature_every": True}, r"curvature_every.*an integer >= 1, got True"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"eps": -1e-8}, "eps"),
        ({"curvature_decay": 1.0}, "curvature_decay"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": 2.0, "max_scale": 1.0}, "max_scale.*min_scale"),
    ],
    ids=lambda value: str(value) if isinstance(value, dict) else "",
)
def test_bad_input_names_the_argument(kwargs, names):
    kwargs = {"learning_rate": 0.1, **kwargs}
    with pytest.raises(ValueError, match=names):
        triaccel_jax.triaccel(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"estimator": "newton"}, r"estimator.*fisher.*hutchinson"),
        ({"state_dtype": jnp.float16}, r"state_dtype.*bfloat16"),
    ],
    ids=["estimator", "state_dtype"],
)
def test_bad_config_option_names_the_argument(kwargs, names):
    with pytest.raises(ValueError, match=names):
        triaccel_jax.TriAccelConfig(**kwargs)


@pytest.mark.parametrize("keyword", ["estimator", "state_dtype"])
def test_config_options_are_not_keywords_of_the_optimizer(keyword):
    # One way to say each thing: config=TriAccelConfig(estimator=..., state_dtype=...).
    value = {"estimator": "fisher", "state_dtype": jnp.bfloat16}[keyword]
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        triaccel_jax.triaccel(0.1, **{keyword: value})
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        triaccel_jax.scale_by_triaccel(**{keyword: value})


def test_shape_options_in_config_work_when_injected():
    # inject_hyperparams traces every number it is given; the store's layout and the probes sit
    # in config, which it passes through untouched.
    factory = optax.inject_hyperparams(triaccel_jax.triaccel)
    config = triaccel_jax.TriAccelConfig(
        block_size=8, rho=0.25, num_samples=2, estimator="hutchinson"
    )
    tx = factory(learning_rate=0.1, config=config)
    params = {"w": jnp.arange(16.0)}
    state = jax.jit(tx.init)(params)
    store = state.inner_state[0].curvature_by_leaf()["w"]
    chex.assert_shape([store.block_means, store.outlier_values], [(2,), (4,)])
    loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    update = jax.jit(lambda g, s: tx.update(g, s, params, loss_fn=loss_fn))
    updates, state = update(params, state)
    np.testing.assert_allclose(triaccel_jax.signals(state)["w"]["mean_curvature"], 2.0, rtol=1e-5)
    chex.assert_shape(updates["w"], (16,))


def test_float_gradient_of_integer_parameter_passes_through():
    params = {"w": jnp.ones(3), "step": jnp.array(2, jnp.int32)}
    tx = triaccel_jax.scale_by_triaccel()
    grads = {"w": jnp.ones(3), "step": jnp.asarray(0.5)}  # e.g. a cast that made it float
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert float(updates["step"]) == 0.5
    assert isinstance(state[0].mu["step"], optax.MaskedNode)


def test_state_can_be_donated_at_every_step():
    # A state holding one buffer twice cannot be donated ("donate the same buffer twice").
    params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    tx = triaccel_jax.triaccel(0.1, curvature_every=3)
    step = jax.jit(lambda p, s: tx.update(p, s, p)[1], donate_argnums=1)
    state = tx.init(params)
    for _ in range(5):
        ids = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
        assert len(ids) == len(set(ids))
        state = step(params, state)
