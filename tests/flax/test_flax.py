"""Flax: triaccel_jax.flax.TrainState (extra arguments, policy, batch stats) and nnx.Optimizer."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import triaccel_jax
from triaccel_jax.flax import TrainState
from triaccel_jax.models import ResNet20


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(32)(x))
        return nn.Dense(1)(x)


def setup(tx, policy=None):
    model = MLP()
    x = jax.random.normal(jax.random.key(1), (16, 8))
    y = jnp.sin(x.sum(-1, keepdims=True))
    params = model.init(jax.random.key(0), x)["params"]
    if callable(policy):
        policy = policy(params)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx, policy=policy)
    return state, x, y


@pytest.mark.slow
def test_apply_gradients_forwards_the_loss_to_hutchinson():
    tx = triaccel_jax.triaccel(
        0.05, config=triaccel_jax.TriAccelConfig(estimator="hutchinson"), curvature_every=1
    )
    state, x, y = setup(tx)

    def loss(params):
        return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    grads = jax.grad(loss)(state.params)
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g, loss_fn=loss))(state, grads)
    # The same step by hand through optax.
    updates, _ = tx.update(grads, tx.init(state.params), state.params, loss_fn=loss)
    expected = optax.apply_updates(state.params, updates)
    chex.assert_trees_all_close(new.params, expected, rtol=1e-5, atol=1e-7)  # jit against eager
    assert int(new.step) == 1
    curvature = triaccel_jax.signals(new.opt_state)
    assert all(s["max_curvature"] > 0 for s in curvature.values())
    # Without the loss, Hutchinson says how to pass it.
    with pytest.raises(ValueError, match="loss_fn"):
        state.apply_gradients(grads=grads)


def test_field_keywords_are_replaced_as_in_flax():
    state, _, _ = setup(optax.sgd(0.1))
    stats = {"mean": jnp.ones(3)}
    new = state.apply_gradients(grads=jax.tree.map(jnp.zeros_like, state.params), batch_stats=stats)
    assert new.batch_stats is stats
    with pytest.raises(TypeError, match="`params`"):
        state.apply_gradients(grads=state.params, params=state.params)


def test_grads_of_another_structure_are_rejected():
    state, _, _ = setup(optax.sgd(0.1))
    with pytest.raises(ValueError, match="structure of `params`"):
        state.apply_gradients(grads={"Dense_0": state.params["Dense_0"]})


@pytest.mark.slow
@pytest.mark.standard_promotion("Flax's avg_pool, normalisation and Dense promote internally")
def test_policy_keeps_a_compute_copy_and_updates_in_master_precision():
    def policy(params):
        return triaccel_jax.PrecisionPolicy.from_patterns(params, {"*/kernel": "bf16"})

    state, x, y = setup(triaccel_jax.triaccel(0.05), policy)
    assert state.compute_params["Dense_0"]["kernel"].dtype == jnp.bfloat16
    assert state.compute_params["Dense_0"]["bias"].dtype == jnp.float32
    assert state.params["Dense_0"]["kernel"].dtype == jnp.float32

    @jax.jit
    def step(state):
        def loss(compute):
            return jnp.mean((state.apply_fn({"params": compute}, x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(state.forward_params)
        return state.apply_gradients(grads=grads), value

    losses = []
    for _ in range(50):
        state, value = step(state)
        losses.append(float(value))
    assert losses[-1] < 0.5 * losses[0]
    assert state.params["Dense_0"]["kernel"].dtype == jnp.float32
    np.testing.assert_array_equal(
        state.compute_params["Dense_0"]["kernel"],
        state.params["Dense_0"]["kernel"].astype(jnp.bfloat16),
    )
    # The moments follow the policy's state dtype (fp32 here: from_patterns' default).
    assert triaccel_jax.signals(state.opt_state)["Dense_0/kernel"]["state_dtype"] == "float32"


def test_with_policy_converts_the_state_and_rebuilds_the_copy():
    state, _, _ = setup(triaccel_jax.triaccel(0.05))
    assert state.compute_params is None and state.forward_params is state.params
    policy = triaccel_jax.PrecisionPolicy.uniform(state.params, "bf16", "bf16")
    converted = state.with_policy(policy)
    signals = triaccel_jax.signals(converted.opt_state)
    assert {s["state_dtype"] for s in signals.values()} == {"bfloat16"}
    assert converted.compute_params["Dense_1"]["kernel"].dtype == jnp.bfloat16
    assert converted.with_policy(None).compute_params is None
    with pytest.raises(TypeError, match="PrecisionPolicy"):
        TrainState.create(apply_fn=None, params=state.params, tx=optax.sgd(1.0), policy="bf16")


@pytest.mark.slow
def test_batch_stats_train_with_resnet20():
    model = ResNet20(num_classes=10)
    images = jax.random.normal(jax.random.key(0), (4, 32, 32, 3))
    labels = jnp.arange(4) % 10
    variables = model.init(jax.random.key(1), images, train=False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=triaccel_jax.triaccel(1e-3),
        batch_stats=variables["batch_stats"],
    )

    @jax.jit
    def step(state):
        def loss(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                images,
                train=True,
                mutable=["batch_stats"],
            )
            value = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return value, updates["batch_stats"]

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=stats), value

    new, value = step(state)
    assert np.isfinite(float(value))
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state.batch_stats, new.batch_stats)
    assert all(jax.tree.leaves(changed))


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


@pytest.mark.slow
def test_nnx_optimizer_with_extra_arguments_and_signals():
    model = NNXModel(nnx.Rngs(0))
    tx = triaccel_jax.triaccel(
        0.05, config=triaccel_jax.TriAccelConfig(estimator="hutchinson"), curvature_every=1
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (16, 8))
    y = jnp.sin(x.sum(-1, keepdims=True))

    def loss(model):
        return jnp.mean((model(x) - y) ** 2)

    @nnx.jit
    def step(model, optimizer):
        value, grads = nnx.value_and_grad(loss)(model)
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)

        def loss_of_params(p):  # the params the optimizer sees, as Hutchinson needs
            return loss(nnx.merge(graphdef, p, rest))

        optimizer.update(model, grads, loss_fn=loss_of_params)
        return value

    losses = [float(step(model, optimizer)) for _ in range(60)]
    assert losses[-1] < 0.5 * losses[0]
    signals = triaccel_jax.signals(optimizer.opt_state)
    # nnx paths end in the Variable's ``value``, as nnx's own state paths do.
    assert set(signals) == {
        "hidden/bias/value",
        "hidden/kernel/value",
        "out/bias/value",
        "out/kernel/value",
    }
    assert all(s["max_curvature"] > 0 for s in signals.values())


class TinyBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        from triaccel_jax.models import BatchNorm

        x = nn.Dense(16)(x)
        x = BatchNorm(use_running_average=not train)(x)
        return nn.Dense(1)(nn.relu(x))


@pytest.mark.slow
def test_controller_trains_a_train_state_with_batch_stats():
    model = TinyBN()
    x = np.random.default_rng(0).normal(size=(256, 8)).astype(np.float32)
    data = {"x": x, "y": np.sin(x.sum(-1, keepdims=True)).astype(np.float32)}
    variables = model.init(jax.random.key(0), x[:2], train=False)
    policy = triaccel_jax.PrecisionPolicy.from_patterns(variables["params"], {"*/kernel": "bf16"})
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=triaccel_jax.triaccel(1e-2),
        batch_stats=variables["batch_stats"],
        policy=policy,
    )

    def loss_fn(params, batch, *, policy, rng, model_state):
        compute = triaccel_jax.cast_params(params, policy)
        out, updates = triaccel_jax.flax.apply_with_policy(
            model,
            {"params": compute, "batch_stats": model_state},
            batch["x"],
            train=True,
            mutable=["batch_stats"],
            policy=policy,
        )
        loss = jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)
        return loss, {"model_state": updates["batch_stats"]}

    controller = triaccel_jax.flax.from_train_state(
        loss_fn, state, data, has_aux=True, min_batch=32, max_batch=32,
        probe=triaccel_jax.FakeMemoryProbe(10**9),
    )  # fmt: skip
    assert controller.policy == policy
    infos = controller.run(20)
    assert infos[-1].loss < infos[0].loss
    trained = triaccel_jax.flax.to_train_state(controller, state)
    assert isinstance(trained, TrainState) and int(trained.step) == 20
    assert trained.policy == policy
    assert trained.compute_params["Dense_0"]["kernel"].dtype == jnp.bfloat16
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state.batch_stats, trained.batch_stats)
    assert all(jax.tree.leaves(moved))
    with pytest.raises(TypeError, match="from_train_state takes params"):
        triaccel_jax.flax.from_train_state(loss_fn, state, data, params=state.params)
    other = TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match="the state's params have the structure"):
        triaccel_jax.flax.to_train_state(controller, other)


@pytest.mark.slow
def test_a_keyword_that_is_neither_a_field_nor_an_extra_argument_is_a_type_error():
    state, x, y = setup(triaccel_jax.triaccel(0.05))
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    # batch_stat for batch_stats: neither a field nor an extra argument any transform takes.
    with pytest.raises(TypeError, match="batch_stat") as info:
        state.apply_gradients(grads=zeros, batch_stat={"mean": jnp.ones(3)})
    assert "extra_arg_names" in str(info.value)  # says how to declare one
    # optax's own names for the loss and its value are forwarded without declaring them.
    loss = lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)
    for name, value in [("loss_fn", loss), ("value_fn", loss), ("obj_fn", loss), ("value", 1.0)]:
        assert int(state.apply_gradients(grads=zeros, **{name: value}).step) == 1


def test_extra_arguments_declared_at_create_reach_the_transform():
    received = []

    def update(updates, state, params=None, *, temperature=None, **extra):
        received.append(temperature)
        return jax.tree.map(lambda u: -temperature * u, updates), state

    tx = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    params = {"w": jnp.ones(2)}
    state = TrainState.create(apply_fn=None, params=params, tx=tx, extra_arg_names=("temperature",))
    new = state.apply_gradients(grads={"w": jnp.ones(2)}, temperature=0.5)
    assert received == [0.5]
    np.testing.assert_allclose(new.params["w"], [0.5, 0.5])
    # The declaration is kept across steps (it is static, like the policy).
    assert new.apply_gradients(grads={"w": jnp.ones(2)}, temperature=0.25).step == 2
    with pytest.raises(TypeError, match="temprature"):
        new.apply_gradients(grads={"w": jnp.ones(2)}, temprature=0.25)
    with pytest.raises(TypeError, match="extra_arg_names"):
        TrainState.create(apply_fn=None, params=params, tx=tx, extra_arg_names="temperature")
    with pytest.raises(ValueError, match="batch_stats"):
        TrainState.create(apply_fn=None, params=params, tx=tx, extra_arg_names=("batch_stats",))
