"""Learning rate in samples (issue 23): an injected optax schedule advances by training progress
(samples / reference batch, or AdaScale's gain), AdaScale's gain follows the measured gradient
noise, and the progress is part of the training record (rollback) and of the saved state."""

from __future__ import annotations

import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from controller_harness import BIG
from controller_harness import FaultyController
from controller_harness import linear_probe
from controller_harness import loss_fn
from controller_harness import make_controller
from controller_harness import make_data
from controller_harness import make_params

from triaccel_jax import Controller
from triaccel_jax import FakeMemoryProbe
from triaccel_jax.controller import ControllerConfig

SCHEDULE = optax.linear_schedule(0.1, 0.01, 40)


def scheduled_sgd():
    return optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE)


def injected(opt_state, name="learning_rate") -> float:
    return float(opt_state.hyperparams[name])


def schedule_count(opt_state) -> int:
    return int(opt_state.hyperparams_states["learning_rate"].count)


def hand_gain(noise_scale, scale):
    """AdaScale's gain from the simple noise scale B = tr(Sigma) / |G|^2: (B + 1) / (B / S + 1),
    which is (tr(Sigma) + |G|^2) / (tr(Sigma) / S + |G|^2); 1 before any estimate."""
    if noise_scale is None:
        return 1.0
    if math.isinf(noise_scale):
        return scale
    return min(max((noise_scale + 1.0) / (noise_scale / scale + 1.0), 1.0), scale)


# -- (a) a schedule advances by samples ------------------------------------------------------------


def test_an_injected_schedule_advances_by_samples_when_the_batch_doubles():
    reference = 8
    controller = make_controller(
        tx=scheduled_sgd(),
        min_batch=8,
        max_batch=16,
        batch_size=8,
        reference_batch=reference,
        batch_rule="memory",
        probe=linear_probe(BIG),
        check_every=3,
        patience=1,
    )
    assert "advances by samples" in controller.events[0].reason
    data = make_data()
    samples_before, batches = 0, []
    for _ in range(10):
        params = controller.params
        info = controller.step()
        batches.append(info.batch_size)
        count = samples_before // reference  # floor(samples so far / reference), by hand
        # The step's update used schedule(count): optax stores the value it used.
        assert injected(controller.opt_state) == pytest.approx(float(SCHEDULE(count)), rel=1e-6)
        assert schedule_count(controller.opt_state) == count + 1
        assert info.update_scale == pytest.approx(math.sqrt(info.batch_size / reference))
        # The update itself, by hand: plain SGD at schedule(count) x sqrt(batch / reference).
        batch = {k: v[info.indices] for k, v in data.items()}
        grads = jax.grad(lambda p, b=batch: loss_fn(p, b, policy=None, rng=None))(params)
        rate = float(SCHEDULE(count)) * math.sqrt(info.batch_size / reference)
        expected = jax.tree.map(lambda p, g, r=rate: p - r * g, params, grads)
        chex.assert_trees_all_close(controller.params, expected, rtol=1e-5, atol=1e-7)
        samples_before += info.batch_size
        assert controller.schedule_progress == pytest.approx(samples_before / reference)
    assert batches[0] == 8 and batches[-1] == 16  # the batch doubled mid-run
    # Counted by steps, the schedule would be at 9; by samples it is past it.
    assert schedule_count(controller.opt_state) - 1 > 9


def test_a_constant_injected_rate_is_unaffected_and_a_schedule_outside_injection_is_explained():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    controller = make_controller(
        tx=tx,
        max_batch=16,
        batch_size=16,
        reference_batch=8,
        lr_scaling="sqrt",
        batch_rule="memory",
    )
    controller.run(3)
    assert injected(controller.opt_state) == pytest.approx(0.05 * math.sqrt(2))
    assert controller.schedule_progress == pytest.approx(6.0)
    # A schedule given to the optimizer itself counts optax's own steps: said, not refused.
    plain = make_controller(tx=optax.sgd(SCHEDULE), max_batch=16, batch_size=16)
    assert "the controller cannot move it" in plain.events[0].reason
    plain.run(2)


# -- (b) AdaScale's gain ---------------------------------------------------------------------------


@pytest.mark.parametrize("steps_in_flight", [0, 1])
def test_the_adascale_gain_follows_the_noise_estimates(steps_in_flight):
    reference, batch, base = 8, 64, 0.05
    scale = batch / reference
    controller = make_controller(
        tx=optax.inject_hyperparams(optax.sgd)(learning_rate=base),
        min_batch=batch,
        max_batch=batch,
        reference_batch=reference,
        lr_scaling="adascale",
        steps_in_flight=steps_in_flight,
        probe=FakeMemoryProbe(BIG),
    )
    assert controller.config.splits_steps  # the noise is measured every step
    infos = controller.run(30)
    gains = [info.learning_rate / base for info in infos]
    assert gains[0] == pytest.approx(1.0)  # nothing measured yet
    assert all(1.0 - 1e-6 <= g <= scale * (1 + 1e-6) for g in gains)
    for n in range(1, len(infos)):
        # The gain of step n comes from the estimates after step n - 1 - steps_in_flight.
        before = n - 1 - steps_in_flight
        expected = hand_gain(infos[before].noise_scale, scale) if before >= 0 else 1.0
        assert gains[n] == pytest.approx(expected, rel=0.005)
    assert max(gains) > 1.5  # this problem has gradient noise: the gain is well above 1
    # Progress counts AdaScale's scale-invariant iterations: the gains.
    assert controller.schedule_progress == pytest.approx(sum(gains), rel=1e-6)
    # Gain wobbles are not logged: only the start's rule.
    assert not [e for e in controller.events if e.kind in ("learning_rate", "update_scale")]


def _gain_run(x, y, loss):
    controller = Controller(
        loss,
        {"w": jnp.zeros(x.shape[1])},
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.01),
        (x, y),
        min_batch=64,
        max_batch=64,
        reference_batch=8,
        lr_scaling="adascale",
        probe=FakeMemoryProbe(BIG),
        seed=0,
    )
    infos = controller.run(25)
    return [info.learning_rate / 0.01 for info in infos]


def test_the_adascale_gain_is_one_without_noise_and_the_batch_ratio_with_noise_alone():
    rng = np.random.default_rng(0)
    # Noiseless: every sample is the same, so every sample's gradient is the true one.
    row = rng.normal(size=(1, 16)).astype(np.float32)
    x = np.repeat(row, 512, axis=0)
    y = np.full(512, 3.0, np.float32)
    noiseless = _gain_run(x, y, lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2))
    assert all(g == pytest.approx(1.0, abs=0.01) for g in noiseless)
    # Pure noise: a linear loss on features of mean exactly zero (each sample and its negation),
    # so the true gradient is 0 and every sample's gradient is noise.
    half = rng.normal(size=(256, 16)).astype(np.float32)
    x = np.concatenate([half, -half])
    noisy = _gain_run(x, np.zeros(512, np.float32), lambda p, b: jnp.mean(b[0] @ p["w"]))
    assert all(1.0 - 1e-6 <= g <= 8.0 * (1 + 1e-6) for g in noisy)
    assert np.mean(noisy[-10:]) > 0.9 * 8.0


def test_adascale_with_a_schedule_advances_it_by_the_gain():
    controller = make_controller(
        tx=scheduled_sgd(),
        min_batch=64,
        max_batch=64,
        reference_batch=8,
        lr_scaling="adascale",
        probe=FakeMemoryProbe(BIG),
        steps_in_flight=0,
    )
    assert "the gain r per step" in controller.events[0].reason
    progress = 0.0
    for _ in range(15):
        info = controller.step()
        count = math.floor(progress + 1e-9)
        assert injected(controller.opt_state) == pytest.approx(float(SCHEDULE(count)), rel=1e-6)
        assert 1.0 <= info.update_scale <= 8.0  # the gain multiplies the update
        progress += info.update_scale
        assert controller.schedule_progress == pytest.approx(progress)
    assert progress > 16  # the gain rose above 1


# -- (c) rollback ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["read", "dispatch"])
def test_an_out_of_memory_rollback_restores_the_progress(where):
    reference = 64
    faults = {"read_faults": {4: 1}} if where == "read" else {"faults": {4: 1}}
    controller = FaultyController(
        loss_fn,
        make_params(),
        scheduled_sgd(),
        make_data(),
        min_batch=32,
        max_batch=64,
        batch_size=64,
        reference_batch=reference,
        probe=FakeMemoryProbe(BIG),
        check_every=1000,
        steps_in_flight=2,
        # Progress in samples / reference: the rule on the batch alone, under the memory rule.
        lr_scaling="sqrt",
        batch_rule="memory",
        **faults,
    )
    infos = controller.run(8)
    assert [e.kind for e in controller.events].count("oom") == 1
    # Samples drawn before the error keep their batch; the re-runs and later steps run at 32.
    drawn_at_64 = 7 if where == "read" else 5
    assert [i.batch_size for i in infos] == [64] * drawn_at_64 + [32] * (8 - drawn_at_64)
    assert [i.micro_batch for i in infos[4:]] == [32] * 4
    # Each step trained counts once: the rolled-back dispatches' progress was undone.
    samples = sum(i.batch_size for i in infos)
    assert controller.schedule_progress == pytest.approx(samples / reference)
    # The last step's schedule value: at the samples before it.
    before_last = (samples - infos[-1].batch_size) // reference
    assert injected(controller.opt_state) == pytest.approx(float(SCHEDULE(before_last)), rel=1e-6)
    assert schedule_count(controller.opt_state) == before_last + 1


# -- (d) saved state -------------------------------------------------------------------------------


@pytest.mark.parametrize("lr_scaling", ["sqrt", "adascale"])
def test_a_resumed_run_equals_the_uninterrupted_one(lr_scaling):
    options = dict(
        tx=scheduled_sgd(),
        min_batch=8,
        max_batch=32,
        batch_size=8,
        reference_batch=8,
        lr_scaling=lr_scaling,
        batch_rule="memory",
        check_every=4,
        patience=1,
    )
    whole = make_controller(**options)
    expected = whole.run(16)

    first = make_controller(**options)
    first.run(10)  # not at a memory check (every 4 steps), which reads every queued step
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["learning_rate"]["schedule_progress"] == first.schedule_progress > 0
    resumed = make_controller(**options)
    resumed.restore(
        {"params": first.params, "opt_state": first.opt_state, "model_state": None}, saved
    )
    assert resumed.schedule_progress == first.schedule_progress
    got = resumed.run(6)

    assert [i.loss for i in got] == [i.loss for i in expected[10:]]
    assert [(i.batch_size, i.update_scale) for i in got] == [
        (i.batch_size, i.update_scale) for i in expected[10:]
    ]
    assert resumed.schedule_progress == whole.schedule_progress
    assert injected(resumed.opt_state) == injected(whole.opt_state)
    assert len({i.batch_size for i in expected}) > 1  # the batch changed on the way
    if lr_scaling == "adascale":
        assert len({i.update_scale for i in expected}) > 2  # the gain moved


@pytest.mark.parametrize(
    "bad", [-1.0, float("nan"), "abc", None, True], ids=["negative", "nan", "text", "null", "bool"]
)
def test_a_bad_saved_progress_is_refused_and_changes_nothing(bad):
    saved = make_controller(max_batch=16, batch_size=8)
    saved.run(3)
    state = saved.state_dict()
    state["learning_rate"] = {**state["learning_rate"], "schedule_progress": bad}
    controller = make_controller(max_batch=16, batch_size=8)
    before = controller.state_dict()
    with pytest.raises(ValueError, match="schedule_progress"):
        controller.load_state_dict(state)
    assert controller.state_dict() == before
    del state["learning_rate"]["schedule_progress"]
    with pytest.raises(ValueError, match="has no 'schedule_progress'"):
        controller.load_state_dict(state)
    assert controller.state_dict() == before


def test_bad_saved_recent_noise_is_refused():
    saved = make_controller(max_batch=16, batch_size=8)
    saved.run(3)
    state = saved.state_dict()
    assert [entry[0] for entry in state["goodput"]["recent_noise"]] == [1, 2]
    for bad in ([[2, 0.0, 0.0, 0.0], [1, 0.0, 0.0, 0.0]], [[1, 0.0]], "x"):
        with pytest.raises(ValueError, match="recent_noise"):
            make_controller(max_batch=16, batch_size=8).load_state_dict(
                {**state, "goodput": {**state["goodput"], "recent_noise": bad}}
            )


# -- (e) settings ----------------------------------------------------------------------------------


def test_adascale_with_a_fixed_global_batch_has_a_fixed_ratio():
    # With keep_global_batch the batch, hence S = global / reference, is fixed; the gain still
    # follows the noise. It is accepted, and its gain stays in [1, S].
    controller = make_controller(
        tx=optax.inject_hyperparams(optax.sgd)(learning_rate=0.05),
        keep_global_batch=True,
        global_batch=64,
        batch_size=16,
        reference_batch=16,
        lr_scaling="adascale",
    )
    infos = controller.run(12)
    assert {i.batch_size for i in infos} == {64}
    gains = [i.learning_rate / 0.05 for i in infos]
    assert all(1.0 - 1e-6 <= g <= 4.0 * (1 + 1e-6) for g in gains) and max(gains) > 1.01
    # The default reference batch is the global batch: S = 1, so the gain is 1.
    plain = make_controller(
        tx=optax.inject_hyperparams(optax.sgd)(learning_rate=0.05),
        keep_global_batch=True,
        global_batch=64,
        batch_size=16,
        lr_scaling="adascale",
    )
    assert all(i.learning_rate == pytest.approx(0.05) for i in plain.run(6))


def test_an_unknown_rule_is_refused_clearly():
    with pytest.raises(ValueError, match=r"`lr_scaling` must be one of \('sqrt', 'linear', "):
        ControllerConfig(lr_scaling="adam")
    with pytest.raises(ValueError, match="adascale"):
        make_controller(lr_scaling="AdaScale")
    assert ControllerConfig(lr_scaling="adascale", batch_rule="memory").splits_steps
    assert not ControllerConfig(lr_scaling="sqrt", batch_rule="memory").splits_steps
