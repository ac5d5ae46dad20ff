"""The controller's learning-rate factor: it follows the batch after an out-of-memory shrink, and
a controller -> train state -> controller round trip keeps the effective rate."""

from __future__ import annotations

import chex
import jax
import numpy as np
import optax
import pytest
from controller_harness import BASE_LR
from controller_harness import BIG
from controller_harness import FaultyController
from controller_harness import loss_fn
from controller_harness import make_data
from controller_harness import make_params
from controller_harness import shrink_settings

from triaccel_jax import FakeMemoryProbe
from triaccel_jax.flax import TrainState


def injected_lr(opt_state) -> float:
    return float(optax.tree_utils.tree_get(opt_state, "learning_rate"))


def sgd_step(params, ids, lr):
    """One plain SGD step on the samples ``ids`` at rate ``lr``."""
    data = make_data()
    batch = {k: v[ids] for k, v in data.items()}
    grads = jax.grad(lambda p: loss_fn(p, batch, policy=None, rng=None))(params)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


@pytest.mark.parametrize("injected", [True, False], ids=["injected", "update-scaled"])
def test_after_an_out_of_memory_shrink_the_rate_follows_the_smaller_batch(injected):
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=BASE_LR) if injected else None
    controller = FaultyController(
        loss_fn,
        make_params(),
        tx or optax.sgd(BASE_LR),
        make_data(),
        faults={2: 1},
        **shrink_settings(),
    )
    controller.run(2)
    before_retry = controller.params
    info = controller.step()  # step 2: 64 samples, re-run as 2 x 32 after the injected OOM
    assert info.batch_size == 64 and info.micro_batch == 32
    # The retried step trains 64 samples, at the rate of 64.
    retried_ids = np.concatenate(controller.seen[2:])
    assert len(retried_ids) == 64
    chex.assert_trees_all_close(
        controller.params, sgd_step(before_retry, retried_ids, BASE_LR), rtol=1e-5, atol=1e-7
    )
    # From the next step on, the batch is 32: half the rate (linear scaling), logged as an event.
    # Logged as the rate itself where the state holds it, else as the update's factor.
    rates = [e for e in controller.events if e.kind in ("learning_rate", "update_scale")]
    expected = (
        ("learning_rate", 3, BASE_LR, BASE_LR / 2) if injected else ("update_scale", 3, 1.0, 0.5)
    )
    assert [(e.kind, e.step, e.old, e.new) for e in rates] == [pytest.approx(expected)]
    if injected:
        assert injected_lr(controller.opt_state) == pytest.approx(BASE_LR / 2)
    after_retry = controller.params
    info = controller.step()
    assert info.batch_size == 32
    chex.assert_trees_all_close(
        controller.params,
        sgd_step(after_retry, controller.seen[-1], BASE_LR / 2),
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.parametrize("flax_state", ["triaccel", "flax"])
def test_a_train_state_round_trip_keeps_the_effective_rate(flax_state):
    from flax.training import train_state

    from triaccel_jax.flax import from_train_state
    from triaccel_jax.flax import to_train_state

    cls = TrainState if flax_state == "triaccel" else train_state.TrainState
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=BASE_LR)
    state = cls.create(apply_fn=None, params=make_params(), tx=tx)
    # Batch 64 against a reference of 16 with linear scaling: 4x the tuned rate.
    options = dict(
        min_batch=64,
        max_batch=64,
        reference_batch=16,
        lr_scaling="linear",
        probe=FakeMemoryProbe(BIG),
    )
    first = from_train_state(loss_fn, state, make_data(), **options)
    assert injected_lr(first.opt_state) == pytest.approx(4 * BASE_LR)
    first.run(2)
    handed_back = to_train_state(first, state)
    # The state handed back holds the tuned (reference-batch) rate, not the scaled one, so
    # whoever trains it next applies their own scaling once.
    assert injected_lr(handed_back.opt_state) == pytest.approx(BASE_LR)
    for _ in range(2):  # a second round trip compounds nothing either
        again = from_train_state(loss_fn, handed_back, make_data(), **options)
        assert injected_lr(again.opt_state) == pytest.approx(4 * BASE_LR)
        handed_back = to_train_state(again, handed_back)
    before = again.params
    again.step()
    ids = again.sampler.order(0)[:64]
    chex.assert_trees_all_close(
        again.params, sgd_step(before, ids, 4 * BASE_LR), rtol=1e-5, atol=1e-7
    )
    assert int(to_train_state(again, state).step) == 3


@pytest.mark.standard_promotion("optax.adamw raises its decay rates to an int32 count")
def test_weight_decay_follows_the_batch_so_that_the_decay_per_sample_is_kept():
    # Power Lines (Bergsma et al., 2025): AdamW's timescale B / (lr x wd x D) is best fixed in
    # epochs, so lr x wd grows in proportion to the batch. With the square-root rule the rate
    # doubles at 4x the reference batch and the decay doubles too: lr x wd x 4.
    from triaccel_jax.controller._learning_rate import LearningRateScaling

    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=1e-4)
    state = tx.init({"w": np.zeros(3, np.float32)})
    scaling = LearningRateScaling(state, "learning_rate", "sqrt", 8, "weight_decay")
    moved = scaling.follow(state, 32).opt_state
    lr, wd = (float(moved.hyperparams[k]) for k in ("learning_rate", "weight_decay"))
    assert lr == pytest.approx(2e-3) and wd == pytest.approx(2e-4)
    assert lr * wd == pytest.approx(4 * 1e-3 * 1e-4)
    # Saved, and handed back at the tuned values.
    assert scaling.state_dict()["tuned_weight_decay"] == pytest.approx(1e-4)
    tuned = scaling.tuned(moved)
    assert float(tuned.hyperparams["weight_decay"]) == pytest.approx(1e-4)
    # Through the controller: a batch grown by memory takes its decay along.
    controller = FaultyController(
        loss_fn,
        make_params(),
        optax.inject_hyperparams(optax.adamw)(learning_rate=BASE_LR, weight_decay=1e-2),
        make_data(),
        min_batch=8,
        max_batch=32,
        batch_size=32,
        reference_batch=8,
        probe=FakeMemoryProbe(BIG),
        batch_rule="memory",
        lr_scaling="sqrt",
        weight_decay_hyperparam="weight_decay",
    )
    controller.run(2)
    held = controller.opt_state.hyperparams
    assert float(held["weight_decay"]) == pytest.approx(2e-2)
    assert float(held["learning_rate"]) == pytest.approx(2 * BASE_LR)
    # A name the state does not hold as an injected constant is refused by name.
    with pytest.raises(ValueError, match="weight_decay_hyperparam='decay'"):
        FaultyController(
            loss_fn,
            make_params(),
            optax.inject_hyperparams(optax.adamw)(learning_rate=BASE_LR),
            make_data(),
            probe=FakeMemoryProbe(BIG),
            batch_rule="memory",
            weight_decay_hyperparam="decay",
        )


def test_the_first_rescaling_of_the_tuned_rate_is_warned_about_once():
    # Reference 16, grown 16 -> 64 by memory, then an out-of-memory error shrinks it to 32: the
    # rate is rescaled twice, one warning says so with the rule and the figures, and the event
    # log keeps both.
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=BASE_LR)
    controller = FaultyController(
        loss_fn,
        make_params(),
        tx,
        make_data(),
        faults={6: 1},
        **{
            **shrink_settings(),
            "min_batch": 16,
            "batch_size": 16,
            "reference_batch": 16,
            "check_every": 2,
        },
        batch_rule="memory",
        patience=1,
    )
    with pytest.warns(UserWarning, match="rescales the learning rate") as caught:
        controller.run(10)
    said = [w for w in caught if "rescales the learning rate" in str(w.message)]
    assert len(said) == 1
    message = str(said[0].message)
    assert "reference_batch=16" in message and "linear rule" in message
    assert said[0].filename == __file__  # the user's call, not a line of the library
    assert [e.kind for e in controller.events].count("learning_rate") == 2
