"""Your own Flax loop (linen TrainState, nnx.Optimizer) under the controller's decisions."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state

import triaccel_jax
from triaccel_jax.controller import AdaptiveBatches
from triaccel_jax.controller import BudgetMemoryProbe
from triaccel_jax.data import load_digits
from triaccel_jax.precision import step_peak_bytes
from triaccel_jax.training import value_and_grad_with_noise

pytestmark = pytest.mark.standard_promotion("Flax's layers and optax's Muon promote inside")


def recommended(learning_rate):
    """The README's recommended configuration, its one rate injected (the Adam part at 0.1x)."""
    return optax.chain(
        triaccel_jax.curvature_signals(),
        optax.contrib.muon(
            learning_rate,
            adam_learning_rate=0.1 * learning_rate,
            weight_decay=1e-4,
            adam_weight_decay=1e-4,
            muon_weight_dimension_numbers=triaccel_jax.transforms.muon_dimension_numbers,
        ),
    )


def digits():
    train, test = load_digits("train"), load_digits("test")
    flat = lambda split: (split.images.reshape(len(split.images), -1), split.labels)
    return flat(train), flat(test)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def settings():
    # A GPU-like step-time model, so that the batch moves on the noise scale on any machine.
    return dict(
        min_batch=32,
        max_batch=256,
        batch_size=32,
        check_every=5,
        probe=BudgetMemoryProbe(2**30),
        peak_bytes=lambda batch: 10_000 * batch,
        assumed_step_time=(0.010, 1e-5),
    )


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


@pytest.mark.slow
def test_a_linen_train_state_loop_trains_under_the_batch_and_rate_decisions():
    (x, y), (x_test, y_test) = digits()
    model = MLP()
    tx = optax.inject_hyperparams(recommended)(learning_rate=0.02)
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(0), x[:1])["params"], tx=tx
    )

    @jax.jit
    def train_step(state, batch):
        def loss(params, batch):
            images, labels = batch
            return cross_entropy(state.apply_fn({"params": params}, images), labels)

        value, grads, norms = value_and_grad_with_noise(loss)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": value, **norms}

    # XLA's compiled peaks of this very step, in place of the settings' stand-in figures.
    peak_bytes = step_peak_bytes(train_step, state, (x, y))
    batches = AdaptiveBatches((x, y), state.opt_state, **{**settings(), "peak_bytes": peak_bytes})
    rates = {}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):
            for batch, step in batches:
                state = state.replace(opt_state=step.apply(state.opt_state))
                state, metrics = train_step(state, batch)
                batches.report(metrics, opt_state=state.opt_state)
                rates[step.batch_size] = step.learning_rate
    said = [str(warning.message) for warning in said]
    assert any("rescales the learning rate" in message for message in said), said
    assert not any("settings.apply" in message or "cannot grow" in message for message in said)
    assert max(rates) > 32 and rates[max(rates)] > rates[32]
    # The rate the state last trained with is the one its batch was given.
    assert float(state.opt_state.hyperparams["learning_rate"]) == pytest.approx(step.learning_rate)
    # The observer's signals ride in the state, for the planner (triaccel_jax.controller.replan).
    assert set(triaccel_jax.signals(state.opt_state)) == {
        "Dense_0/bias",
        "Dense_0/kernel",
        "Dense_1/bias",
        "Dense_1/kernel",
    }
    logits = model.apply({"params": state.params}, x_test)
    assert float(jnp.mean(jnp.argmax(logits, -1) == y_test)) > 0.9


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


@pytest.mark.slow
def test_an_nnx_optimizer_loop_trains_under_the_batch_and_rate_decisions():
    (x, y), (x_test, y_test) = digits()
    model = NnxMLP(nnx.Rngs(0))
    tx = optax.inject_hyperparams(recommended)(learning_rate=0.02)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, batch):
            images, labels = batch
            return cross_entropy(nnx.merge(graphdef, params, rest)(images), labels)

        value, grads, norms = value_and_grad_with_noise(loss)(params, batch)
        optimizer.update(model, grads)
        return {"loss": value, **norms}

    batches = AdaptiveBatches((x, y), optimizer.opt_state, **settings())
    sizes = []
    with pytest.warns(UserWarning, match="rescales the learning rate"):
        for _ in range(3):
            for batch, step in batches:
                optimizer.opt_state = step.apply(optimizer.opt_state)
                metrics = train_step(model, optimizer, batch)
                batches.report(metrics)
                sizes.append(step.batch_size)
                assert float(optimizer.opt_state.hyperparams["learning_rate"]) == pytest.approx(
                    step.learning_rate
                )
    assert sizes[0] == 32 and max(sizes) > 32
    assert float(jnp.mean(jnp.argmax(model(x_test), -1) == y_test)) > 0.9
