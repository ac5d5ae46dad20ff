"""``transforms.fused_apply``: the optimizer's one-pass path (moments, master, compute copy).

The fused form is explicit (``fused_triaccel`` of ``triaccel``'s arguments). The truth is the
optax path, ``fused.tx.update`` then ``optax.apply_updates`` (and ``cast_params`` for the compute
copy): with float32 state the fused path must agree bit for bit, including the curvature
refreshes, a learning-rate schedule, a weight-decay mask and leaves that are not trained; with
bfloat16 moments within their stochastic rounding.
"""

from __future__ import annotations

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax.kernels import _dispatch
from triaccel_jax.transforms import fused_apply
from triaccel_jax.transforms import fused_triaccel
from triaccel_jax.transforms import unfused_reason
from triaccel_jax.transforms import uses_triton

ON_CUDA = _dispatch.triton_unavailable_reason() is None
needs_no_triton = pytest.mark.skipif(ON_CUDA, reason="checks the behaviour without a CUDA backend")


def _params():
    keys = jax.random.split(jax.random.key(0), 3)
    return {
        "dense": {"kernel": jax.random.normal(keys[0], (7, 5)), "bias": jnp.zeros(5)},
        "scale": jax.random.normal(keys[1], (5,)),
        "steps": jnp.array(3, jnp.int32),
    }


def _loss(params, x):
    hidden = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    return jnp.mean((hidden * params["scale"]).sum(-1) ** 2)


def _grads(params, step):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), step), (16, 7))
    grads = jax.grad(_loss)({**params, "steps": 0.0}, x)
    # The integer leaf gets an integer "gradient", which the optimizer passes through.
    return {**grads, "steps": jnp.ones((), jnp.int32)}


def _train(form, steps, *, fused, factor=1.0, policy=None):
    tx = form.tx
    params, state = _params(), None
    state = tx.init(params)
    extra = {"loss_fn": lambda p: _loss({**p, "steps": 0.0}, jnp.ones((16, 7)))}

    @jax.jit
    def step(params, state, grads):
        if fused:
            out = fused_apply(
                form,
                grads,
                state,
                params,
                learning_rate_factor=factor,
                compute_policy=policy,
                **extra,
            )
            return out.params, out.opt_state, out.compute
        updates, state = tx.update(grads, state, params, **extra)
        updates = jax.tree.map(lambda u: u * factor if u.dtype != jnp.int32 else u, updates)
        params = optax.apply_updates(params, updates)
        compute = None if policy is None else triaccel_jax.cast_params(params, policy)
        return params, state, compute

    compute = None
    for t in range(steps):
        params, state, compute = step(params, state, _grads(params, t))
    return params, state, compute


def _is_signals(x):
    return isinstance(x, triaccel_jax.transforms.LeafSignals)


def _is_kernel(path, _):
    return path[-1].key == "kernel"


OPTIMIZERS = {
    "constant rate": lambda: fused_triaccel(0.05, curvature_every=3),
    "schedule and mask": lambda: fused_triaccel(
        optax.linear_schedule(0.05, 0.005, 20),
        weight_decay=0.1,
        mask=lambda tree: jax.tree_util.tree_map_with_path(_is_kernel, tree),
        curvature_every=2,
    ),
    "hutchinson": lambda: fused_triaccel(
        0.02, config=triaccel_jax.TriAccelConfig(estimator="hutchinson"), curvature_every=4
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_float32_state_agrees_with_the_optax_update_bit_for_bit(name):
    form = OPTIMIZERS[name]()
    assert unfused_reason(form) is None
    expected_params, expected_state, _ = _train(form, 25, fused=False)
    params, state, _ = _train(form, 25, fused=True)
    chex.assert_trees_all_equal_structs(state, expected_state)
    chex.assert_trees_all_equal(params, expected_params)
    # The moments, the curvature store and the step scales are bit-identical; the noise figure,
    # a mean that XLA may reduce in another order inside the fused graph, to an ulp.
    signals, expected_signals = state[0].leaf_signals, expected_state[0].leaf_signals
    chex.assert_trees_all_equal(state[1:], expected_state[1:])
    chex.assert_trees_all_equal(
        state[0]._replace(leaf_signals=None), expected_state[0]._replace(leaf_signals=None)
    )
    chex.assert_trees_all_close(signals, expected_signals, rtol=1e-6)
    chex.assert_trees_all_equal(
        jax.tree.map(lambda s: s.step_scale, signals, is_leaf=_is_signals),
        jax.tree.map(lambda s: s.step_scale, expected_signals, is_leaf=_is_signals),
    )
    # It really trained: 25 steps moved every float leaf and the signals were refreshed.
    assert not np.allclose(params["dense"]["kernel"], _params()["dense"]["kernel"])
    assert int(params["steps"]) == 3 + 25
    assert float(triaccel_jax.signals(state)["dense/kernel"]["mean_curvature"]) > 0


@pytest.mark.slow
def test_bfloat16_moments_stay_within_their_stochastic_rounding_of_the_optax_path():
    tx = fused_triaccel(
        0.05, config=triaccel_jax.TriAccelConfig(state_dtype=jnp.bfloat16), curvature_every=3
    )
    expected_params, expected_state, _ = _train(tx, 1, fused=False)
    params, state, _ = _train(tx, 1, fused=True)
    chex.assert_trees_all_equal_dtypes(state, expected_state)
    bf16_ulp = 2.0**-7
    for got, want in zip(
        jax.tree.leaves((state[0].mu, state[0].nu)),
        jax.tree.leaves((expected_state[0].mu, expected_state[0].nu)),
        strict=True,
    ):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_array_less(np.abs(got - want), bf16_ulp * np.abs(want) + 1e-30)
    chex.assert_trees_all_close(params, expected_params, rtol=1e-2, atol=1e-4)
    # Over many steps the two paths train alike (the rounding is unbiased in both).
    long_expected, _, _ = _train(tx, 40, fused=False)
    long_params, _, _ = _train(tx, 40, fused=True)
    chex.assert_trees_all_close(long_params, long_expected, rtol=0.05, atol=0.02)


def test_the_compute_copy_is_the_cast_of_the_new_params_in_every_format():
    params = _params()
    policy = triaccel_jax.PrecisionPolicy.from_patterns(
        params, {"dense/kernel": "bf16", "dense/bias": "fp16", "scale": "fp8_e4m3"}
    )
    tx = fused_triaccel(0.05)
    params, _, compute = _train(tx, 3, fused=True, policy=policy)
    chex.assert_trees_all_equal(compute, triaccel_jax.cast_params(params, policy))
    assert compute["dense"]["kernel"].dtype == jnp.bfloat16
    assert compute["dense"]["bias"].dtype == jnp.float16
    assert params["dense"]["kernel"].dtype == jnp.float32  # the masters stay float32


@pytest.mark.slow
def test_the_learning_rate_factor_scales_the_step_as_it_scales_the_update():
    tx = fused_triaccel(0.05, curvature_every=3)
    expected, _, _ = _train(tx, 10, fused=False, factor=1.7)
    got, _, _ = _train(tx, 10, fused=True, factor=1.7)
    chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
    unscaled, _, _ = _train(tx, 10, fused=True)
    assert not np.allclose(got["dense"]["kernel"], unscaled["dense"]["kernel"])


def test_per_block_step_scales_take_the_unfused_path_with_the_same_result():
    form = fused_triaccel(1e-2, config=triaccel_jax.TriAccelConfig(scale="block"))
    assert "per-block step scales" in unfused_reason(form)
    params = _params()
    state = form.tx.init(params)
    grads = _grads(params, 0)
    out = fused_apply(form, grads, state, params)
    updates, expected_state = form.tx.update(grads, state, params)
    chex.assert_trees_all_equal(out.params, optax.apply_updates(params, updates))
    chex.assert_trees_all_equal(out.opt_state, expected_state)
    assert out.compute is None


def test_anything_but_a_fused_form_or_its_state_is_refused_by_name():
    params = _params()
    form = fused_triaccel(1e-2)
    with pytest.raises(TypeError, match="fused_triaccel"):
        fused_apply(triaccel_jax.triaccel(1e-2), _grads(params, 0), form.tx.init(params), params)
    with pytest.raises(TypeError, match="fused_triaccel"):
        unfused_reason(triaccel_jax.triaccel(1e-2))
    adam_state = optax.adam(1e-2).init(params)
    with pytest.raises(ValueError, match=r"not a state of `fused\.tx`"):
        fused_apply(form, _grads(params, 0), adam_state, params)
    with pytest.raises(TypeError, match="unexpected keyword"):
        fused_triaccel(1e-2, momentum=0.9)


def test_a_policy_that_does_not_cover_the_params_is_refused():
    form = fused_triaccel(0.05)
    params = _params()
    policy = triaccel_jax.PrecisionPolicy.uniform({"other": jnp.ones(2)}, "bf16")
    with pytest.raises(ValueError, match="policy"):
        fused_apply(form, _grads(params, 0), form.tx.init(params), params, compute_policy=policy)


@needs_no_triton
def test_without_cuda_the_fused_path_never_picks_triton_and_a_forced_triton_is_refused():
    form = fused_triaccel(0.05)
    params = _params()
    assert not uses_triton(form, form.tx.init(params))
    forced = fused_triaccel(0.05, config=triaccel_jax.TriAccelConfig(impl="triton"))
    with pytest.raises(RuntimeError, match="impl='triton'"):
        fused_apply(forced, _grads(params, 0), forced.tx.init(params), params)


def test_the_fused_path_calls_the_fused_update_kernel_once_per_trained_leaf(monkeypatch):
    from triaccel_jax.kernels import fused_update as fused_kernel

    calls = []
    real = fused_kernel.fused_update

    def counting(*args, **kwargs):
        calls.append(kwargs["impl"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_kernel, "fused_update", counting)
    form = fused_triaccel(0.05, config=triaccel_jax.TriAccelConfig(impl="reference"))
    params = _params()
    fused_apply(form, _grads(params, 0), form.tx.init(params), params)
    assert calls == ["reference"] * 3  # kernel, bias, scale; the integer leaf is not trained


# --- the controller ------------------------------------------------------------------------


def _controller(tx, **settings):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 7)).astype(np.float32)
    y = np.tanh(x @ rng.normal(size=(7,))).astype(np.float32)

    def loss(params, batch, *, policy, rng):
        del policy, rng
        inputs, targets = batch
        hidden = jnp.tanh(inputs @ params["dense"]["kernel"] + params["dense"]["bias"])
        return jnp.mean(((hidden * params["scale"]).sum(-1) - targets) ** 2)

    params = {key: value for key, value in _params().items() if key != "steps"}
    return triaccel_jax.Controller(
        loss,
        params,
        tx,
        (x, y),
        probe=triaccel_jax.BudgetMemoryProbe(2**30),
        **{"min_batch": 32, "max_batch": 32, **settings},
    )


@pytest.mark.slow
def test_the_controller_trains_the_same_through_the_fused_step():
    form = fused_triaccel(0.02, curvature_every=3)
    plain, fused = _controller(form.tx), _controller(form.tx, fused_update=form)
    plain.run(30)
    fused.run(30)
    # One compiled graph each: XLA may contract a different multiply-add into an FMA, so the
    # two agree to float32 rounding (standalone, outside the controller, they are bit-identical).
    chex.assert_trees_all_close(fused.params, plain.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(fused.opt_state, plain.opt_state, rtol=1e-5, atol=1e-6)
    assert fused.step_count == plain.step_count == 30
    assert not np.allclose(fused.params["scale"], _params()["scale"])


def test_the_controller_refuses_a_fused_form_it_cannot_fuse():
    form = fused_triaccel(1e-2, config=triaccel_jax.TriAccelConfig(scale="block"))
    with pytest.raises(ValueError, match="fused_update cannot fuse the optimizer: per-block"):
        _controller(form.tx, fused_update=form)
    for wrong in (True, triaccel_jax.triaccel(1e-2)):
        with pytest.raises(ValueError, match="fused_update"):
            triaccel_jax.controller.ControllerConfig(fused_update=wrong)


# --- the Flax train state ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.standard_promotion("Flax's Dense mixes a bfloat16 kernel with float32 inputs")
def test_the_flax_train_state_takes_the_fused_path_it_is_given(monkeypatch):
    import flax.linen as flax_linen  # the test extra installs Flax

    from triaccel_jax import transforms as fused_lib
    from triaccel_jax.flax import TrainState

    class MLP(flax_linen.Module):
        @flax_linen.compact
        def __call__(self, x):
            return flax_linen.Dense(1)(flax_linen.tanh(flax_linen.Dense(16)(x)))

    model = MLP()
    x = jax.random.normal(jax.random.key(1), (16, 8))
    y = jnp.sin(x.sum(-1, keepdims=True))
    params = model.init(jax.random.key(0), x)["params"]
    policy = triaccel_jax.PrecisionPolicy.from_patterns(params, {"*/kernel": "bf16"})

    form = fused_triaccel(0.05)

    def train(steps, fused=None):
        state = TrainState.create(
            apply_fn=model.apply, params=params, tx=form.tx, policy=policy, fused=fused
        )

        @jax.jit
        def step(state):
            def loss(compute):
                return jnp.mean((state.apply_fn({"params": compute}, x) - y) ** 2)

            return state.apply_gradients(grads=jax.grad(loss)(state.forward_params))

        for _ in range(steps):
            state = step(state)
        return state

    expected = train(20)
    calls = []
    real = fused_lib.fused_apply

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_lib, "fused_apply", counting)
    assert not calls
    got = train(20, fused=form)
    assert calls  # traced through the fused path
    chex.assert_trees_all_equal(got.params, expected.params)
    chex.assert_trees_all_equal(got.compute_params, expected.compute_params)
    chex.assert_trees_all_close(got.opt_state, expected.opt_state, rtol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: triaccel_jax.scale_by_triaccel(),
        lambda: triaccel_jax.curvature_signals(),
        lambda: triaccel_jax.scale_by_curvature(optax.scale_by_adam()),
        lambda: triaccel_jax.triaccel(1e-3),
    ],
    ids=["scale_by_triaccel", "curvature_signals", "scale_by_curvature", "triaccel"],
)
def test_no_factory_sets_attributes_on_its_functions(make):
    # The fused path reads triaccel's hyperparameters from its explicit fused form
    # (fused_triaccel), never from an attribute attached to a function.
    for function in make():
        if inspect.isfunction(function):
            assert not vars(function), sorted(vars(function))
