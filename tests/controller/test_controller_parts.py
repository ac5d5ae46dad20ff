"""The controller's parts, each alone: config, feeding, compile cache, learning rate, buckets,
out-of-memory retry, each part's saved state and re-plan."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from controller_harness import VirtualClock
from controller_harness import take_time

import triaccel_jax
from triaccel_jax.controller import ControllerConfig
from triaccel_jax.controller import OutOfMemoryError
from triaccel_jax.controller import replan
from triaccel_jax.controller._bucket_tracker import BucketTracker
from triaccel_jax.controller._compiling import StepCompiler
from triaccel_jax.controller._controller import LossScaleRecord
from triaccel_jax.controller._feeding import BatchFeeder
from triaccel_jax.controller._goodput_tracker import GoodputTracker
from triaccel_jax.controller._learning_rate import LearningRateScaling
from triaccel_jax.controller._learning_rate import lr_factor
from triaccel_jax.controller._out_of_memory import retry_after_out_of_memory
from triaccel_jax.controller._precision_schedule import PrecisionSchedule
from triaccel_jax.controller._state_record import decode
from triaccel_jax.controller._state_record import encode
from triaccel_jax.controller._state_record import from_state_dict
from triaccel_jax.controller._state_record import to_state_dict
from triaccel_jax.policy import PrecisionPlan
from triaccel_jax.policy import PrecisionPolicy
from triaccel_jax.precision import PlannerConfig
from triaccel_jax.transforms import LossScaleState

# -- config ----------------------------------------------------------------------------------------


def test_config_is_frozen_and_its_settings_are_typed():
    config = ControllerConfig(planner=PlannerConfig(budget=0.1))
    assert config.planner.budget == 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.planner.budget = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.min_batch = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"`planner` must be a triaccel_jax.precision.Planner"):
        ControllerConfig(planner={"budget": 0.1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"loss_scaling=LossScaling\(...\)"):
        ControllerConfig(loss_scaling={"initial_scale": 2.0})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"target": 0.0}, "`target` must be in"),
        ({"high_water": 0.5}, "`high_water` must be in"),
        ({"patience": 0}, "`patience` must be an integer >= 1"),
        ({"check_every": 1.5}, "`check_every` must be an integer >= 1"),
        ({"replan_every": 0}, "`replan_every`"),
        ({"lr_scaling": "cubic"}, "`lr_scaling` must be one of"),
        ({"global_batch": 64}, "only used with keep_global_batch"),
    ],
)
def test_config_rejects_bad_settings_naming_them(settings, message):
    with pytest.raises(ValueError, match=message):
        ControllerConfig(**settings)


def test_layout_on_a_data_parallel_width():
    layout = ControllerConfig(min_batch=10, max_batch=100).layout(multiple=8)
    assert layout.buckets == (16, 32, 64) and layout.start == 16
    assert layout.global_batch is None and layout.reference_batch == 16
    kept = ControllerConfig(min_batch=16, max_batch=64, keep_global_batch=True, batch_size=32)
    assert kept.layout(1) == (((16, 32, 64)), 32, 64, 64)
    with pytest.raises(ValueError, match="not one of the buckets"):
        ControllerConfig(batch_size=24).layout(1)


def test_controller_takes_a_config_or_keywords_but_not_both():
    params = {"w": jnp.zeros(4)}
    data = np.ones((64, 4), np.float32)
    loss = lambda p, b, *, policy, rng: jnp.mean((b @ p["w"]) ** 2)
    probe = triaccel_jax.BudgetMemoryProbe(2**30)
    config = ControllerConfig(min_batch=8, max_batch=16, seed=3)
    controller = triaccel_jax.Controller(
        loss, params, optax.sgd(0.1), data, probe=probe, config=config
    )
    # The settings in force: replan_every="auto" resolved (sgd holds no signals: not planned).
    assert controller.config == dataclasses.replace(config, replan_every=None)
    assert controller.buckets == (8, 16)
    with pytest.raises(TypeError, match="not both"):
        triaccel_jax.Controller(loss, params, optax.sgd(0.1), data, config=config, min_batch=8)
    # A mistyped keyword is named with the nearest valid one, and every valid one is listed.
    with pytest.raises(TypeError) as error:
        triaccel_jax.Controller(loss, params, optax.sgd(0.1), data, min_batchs=8)
    message = str(error.value)
    assert "'min_batchs' (did you mean 'min_batch'?)" in message
    assert all(field.name in message for field in dataclasses.fields(ControllerConfig))


# -- feeding ---------------------------------------------------------------------------------------


def test_feeder_serves_the_samples_at_the_indices_as_micro_batches():
    data = {"x": np.arange(20.0).reshape(10, 2), "y": np.arange(10)}
    feeder = BatchFeeder(data, None, None, "data")
    batch = feeder.device_batch(np.array([7, 2, 9, 0]), 2, 2)
    np.testing.assert_array_equal(batch["y"], [[7, 2], [9, 0]])
    np.testing.assert_array_equal(batch["x"][1, 0], [18.0, 19.0])
    assert feeder.abstract_batch(2, 2)["x"].shape == (2, 2, 2)
    fetched = BatchFeeder(lambda idx: {"y": np.asarray(idx) * 10}, 5, None, "data")
    np.testing.assert_array_equal(fetched.device_batch(np.array([1, 3]), 1, 2)["y"], [[10, 30]])


def test_feeder_rejects_bad_data_and_places_state_as_strong_arrays():
    with pytest.raises(ValueError, match="does not match the data"):
        BatchFeeder(np.zeros((4, 2)), 5, None, "data")
    with pytest.raises(ValueError, match="holds no samples"):
        BatchFeeder(np.zeros((0, 2)), None, None, "data")
    placed = BatchFeeder(np.zeros((4, 2)), None, None, "data").place({"a": jnp.asarray(1.0)})
    assert isinstance(placed["a"], jax.Array) and not placed["a"].weak_type


# -- compile cache ---------------------------------------------------------------------------------


def test_compile_cache_keeps_steps_and_peaks_per_policy():
    arg = (jax.ShapeDtypeStruct((8,), jnp.float32),)
    cache = StepCompiler(lambda key, opt_state: (lambda x: x + 1, arg))
    executable, new = cache.compiled((8, 1, None))
    assert new is not None and new.executable is executable
    assert cache.compiled((8, 1, None)) == (executable, None) and (16, 1, None) not in cache
    np.testing.assert_array_equal(executable(jnp.zeros(8)), np.ones(8))
    cache.record_peak("abc", 8, 1000)
    cache.record_peak("abc", 16, 1800)
    assert cache.peaks("abc") == {8: 1000, 16: 1800} and cache.peaks("other") == {}
    again = StepCompiler(lambda key, opt_state: (lambda x: x, arg))
    again.load_peaks_record(json.loads(json.dumps(cache.peaks_record())))
    assert again.peaks("abc") == cache.peaks("abc") and len(again) == 0


# -- learning rate ---------------------------------------------------------------------------------


def test_learning_rate_written_into_the_injected_state_and_handed_back_tuned():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = tx.init({"w": jnp.zeros(2)})
    scaling = LearningRateScaling(state, "learning_rate", "sqrt", 16)
    change = scaling.follow(state, 64)
    assert (change.old, change.new) == (1.0, 2.0) and scaling.update_multiplier() == 1.0
    assert float(change.opt_state.hyperparams["learning_rate"]) == pytest.approx(0.2)
    assert float(scaling.tuned(change.opt_state).hyperparams["learning_rate"]) == pytest.approx(0.1)


def test_a_scheduled_or_absent_rate_scales_the_update_instead():
    scheduled = optax.inject_hyperparams(optax.sgd)(
        learning_rate=optax.linear_schedule(1.0, 0.0, 9)
    )
    state = scheduled.init({"w": jnp.zeros(2)})
    scaling = LearningRateScaling(state, "learning_rate", "linear", 8)
    assert scaling.base_lr is None
    assert scaling.follow(state, 32).opt_state is state and scaling.update_multiplier() == 4.0
    assert lr_factor(8, 32, "sqrt") == 0.5


# -- buckets and the out-of-memory retry -----------------------------------------------------------


def test_bucket_tracker_prefers_measured_peaks_and_refuses_a_compiled_peak_over_high_water():
    tracker = BucketTracker((8, 16, 32), 8, target=0.8, high_water=0.9, patience=1)
    compiled = {8: 500, 16: 950}
    assert tracker.known_peaks(compiled) == compiled
    decision = tracker.check(None, 1000, compiled_peaks=compiled, fixed_bytes=0)
    assert decision.kind == "keep" and tracker.limit == 1000
    assert "over the high-water mark 90%" in tracker.over_high_water(16, compiled)
    assert tracker.over_high_water(8, compiled) is None
    tracker.check(300, 1000, compiled_peaks=compiled, fixed_bytes=0)
    assert tracker.known_peaks(compiled) == {8: 300} and tracker.fixed_bytes({}, {}) == 0


def test_out_of_memory_retry_shrinks_then_raises_at_the_smallest_bucket():
    tracker = BucketTracker((8, 16, 32), 16, target=0.8, high_water=0.9, patience=2)
    tracker.check(100, 100_000, compiled_peaks={}, fixed_bytes=0)
    assert tracker.state_dict()["grow_streak"] == 1
    tracker.move_to(32)
    decision = tracker.retry_after_out_of_memory(32, step=4, tried=["1x32"], error=MemoryError("x"))
    assert (decision.bucket, decision.ceiling, tracker.micro) == (16, 32, 16)
    assert tracker.state_dict()["grow_streak"] == 0 and "32 is now a ceiling" in decision.reason
    with pytest.raises(OutOfMemoryError, match=r"step 7 .* bucket 8 \(tried micro-batches 1x8"):
        retry_after_out_of_memory(8, (8, 16), 16, step=7, tried=["1x8"], error=MemoryError("y"))


def test_out_of_memory_is_charged_to_the_bucket_the_step_ran_at():
    # A background grow moved the tracker to 16 while a step that ran at 8 was in flight; that
    # step's failure bans 8 (and what is above), not 16 alone, and retries below 8.
    tracker = BucketTracker((4, 8, 16), 16, target=0.8, high_water=0.9, patience=1)
    decision = tracker.retry_after_out_of_memory(8, step=3, tried=["1x8"], error=MemoryError("x"))
    assert (decision.bucket, decision.ceiling, tracker.micro, tracker.ceiling) == (4, 8, 4, 8)
    # The same step's failure seen twice (its late read, then the next dispatch at 8) shrinks
    # once: the second charge is to 8 again, not to the bucket the first moved to.
    again = tracker.retry_after_out_of_memory(8, step=3, tried=["1x8"], error=MemoryError("x"))
    assert (again.bucket, again.ceiling, tracker.micro, tracker.ceiling) == (4, 8, 4, 8)


# -- saved state -----------------------------------------------------------------------------------

IDENTITY = {"seed": 0, "buckets": [8, 16], "keep_global_batch": False}


def _through_json(state):
    return json.loads(json.dumps(state))


def test_each_part_saves_its_own_state_and_reads_it_back():
    tracker = BucketTracker((8, 16, 32), 8, target=0.8, high_water=0.9, patience=3)
    tracker.check(300, 1000, compiled_peaks={}, fixed_bytes=0)  # a grow streak, a measured peak
    again = BucketTracker((8, 16, 32), 16, target=0.8, high_water=0.9, patience=3)
    again.load_state_dict(_through_json(tracker.state_dict()))
    assert again.state_dict() == tracker.state_dict()
    assert (again.micro, again.limit, again.known_peaks({})) == (8, 1000, {8: 300})

    options = dict(horizon=1000, lag=1, reference=8, margin=0.05, critical_multiple=1.0)
    goodput = GoodputTracker(**options)
    for step in range(3):
        goodput.observe_noise(step, (3.0 + step, 9.0), batch=32, micro=8)
    for _ in range(30):
        goodput.observe_throughput((8, 1, "none"), seconds=0.01)
    keys = {b: (b, 1, "none") for b in (8, 16)}
    move, figures = goodput.decide(8, [8, 16], keys, measurable=True)
    assert move.batch == 16 and move.kind == figures["decision"] == "explore"  # a trial, saved
    restored = GoodputTracker(**options)
    restored.load_state_dict(_through_json(goodput.state_dict()))
    assert restored.state_dict() == goodput.state_dict()
    assert restored.state_dict()["trial"] == [8, 16]
    assert restored.noise_scale == goodput.noise_scale
    assert restored.throughput == goodput.throughput
    assert restored.noise_before(3) == goodput.noise_before(3)

    policy = PrecisionPolicy.uniform({"w": jnp.ones((4, 4))}, "bf16")
    schedule = PrecisionSchedule(speed_trials=False)
    schedule.set_plan(PrecisionPlan(policy, {"w": ("fp32", 1)}))
    other = PrecisionSchedule(speed_trials=False)
    other.load_state_dict(_through_json(schedule.state_dict()))
    assert other.plan == schedule.plan

    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = tx.init({"w": jnp.zeros(2)})
    scaling = LearningRateScaling(state, "learning_rate", "linear", 16)
    scaling.for_step(state, 32)
    scaling.advance(32)
    resumed = LearningRateScaling(state, "learning_rate", "linear", 16)
    resumed.load_state_dict(_through_json(scaling.state_dict()))
    assert resumed.progress == 2.0 and resumed.base_lr == pytest.approx(0.1)


def test_a_part_refuses_a_malformed_state_naming_the_field_and_keeps_its_own():
    tracker = BucketTracker((8, 16), 8, target=0.8, high_water=0.9, patience=1)
    before = tracker.state_dict()
    with pytest.raises(ValueError, match="micro_batch 32 is not a bucket"):
        tracker.load_state_dict({**before, "micro_batch": 32})
    with pytest.raises(ValueError, match="has no 'limit_bytes'"):
        tracker.load_state_dict({k: v for k, v in before.items() if k != "limit_bytes"})
    assert tracker.state_dict() == before
    goodput = GoodputTracker(horizon=1000, lag=1, reference=8, margin=0.0, critical_multiple=1.0)
    with pytest.raises(ValueError, match="trial"):
        goodput.load_state_dict({**goodput.state_dict(), "trial": [8]})
    with pytest.raises(ValueError, match="step_times"):
        goodput.load_state_dict({**goodput.state_dict(), "step_times": [[8, 1, "none", 2]]})
    assert goodput.state_dict()["trial"] is None


def test_the_loss_scale_keeps_its_dtypes_through_json():
    scale = LossScaleState(jnp.float32(1024.0), jnp.int32(3), jnp.int32(1))
    document = _through_json(encode(LossScaleRecord.of(scale)))
    assert document == {"scale": 1024.0, "good_steps": 3, "skipped_steps": 1}
    back = decode(LossScaleRecord, document, "loss_scale").loss_scale_state()
    assert jax.tree.map(lambda x: (x.dtype, x.item()), back) == jax.tree.map(
        lambda x: (x.dtype, x.item()), scale
    )


def test_the_envelope_refuses_another_configuration_and_another_version():
    state = to_state_dict({"step": 5}, IDENTITY)
    assert from_state_dict(_through_json(state), IDENTITY)["step"] == 5
    with pytest.raises(ValueError, match="saved with seed=0, this controller has seed=1"):
        from_state_dict(state, {**IDENTITY, "seed": 1})
    with pytest.raises(ValueError, match="version 1 is not supported"):
        from_state_dict({**state, "version": 1}, IDENTITY)


# -- re-plan ---------------------------------------------------------------------------------------


def test_replan_converts_the_state_only_when_the_policy_changes_and_keeps_the_streaks():
    params = {"w": jnp.ones((64, 64))}
    tx = triaccel_jax.triaccel(0.1)
    opt_state = tx.init(params)
    _, opt_state = tx.update(params, opt_state, params)  # some curvature to plan from
    start = PrecisionPolicy.uniform(params)
    options = PlannerConfig(budget=float("inf"), patience=2)
    first = replan(opt_state, params, start, planner=options)
    assert not first.changed and first.opt_state is opt_state
    assert first.plan.pending == {"w": ("bf16", 1)} and first.leaves_by_dtype == {"fp32": 1}
    second = replan(opt_state, params, first.plan, planner=options)
    assert second.changed and second.plan.policy.compute("w") == "bf16"
    assert isinstance(second.plan, PrecisionPlan) and not second.plan.pending
    assert second.leaves_by_dtype == {"bf16": 1} and second.opt_state is not opt_state


def test_precision_is_planned_by_default_over_an_optimizer_holding_the_signals():
    params = {"w": jnp.zeros(4)}
    data = np.ones((64, 4), np.float32)
    loss = lambda p, b, *, policy, rng: jnp.mean((b @ p["w"]) ** 2)
    probe = triaccel_jax.BudgetMemoryProbe(2**30)
    observed = optax.chain(triaccel_jax.curvature_signals(), optax.sgd(0.1))

    def planning(tx, **settings):
        controller = triaccel_jax.Controller(
            loss, params, tx, data, probe=probe, min_batch=8, max_batch=8, **settings
        )
        config = controller.config
        return config.replan_every, config.first_replan, controller.policy is not None

    # The recommended chain (the observer first) is planned every 100 steps from step 20.
    assert planning(observed) == (100, 20, True)
    assert planning(observed, first_replan=5) == (100, 5, True)
    # No signals to plan from, or a policy given (the user's choice): not planned.
    assert planning(optax.sgd(0.1)) == (None, None, False)
    fp32 = triaccel_jax.PrecisionPolicy.uniform(params)
    assert planning(observed, policy=fp32)[:2] == (None, None)
    with pytest.raises(ValueError, match=r"first_replan.*no signals"):
        planning(optax.sgd(0.1), first_replan=5)
    with pytest.raises(ValueError, match="'auto' or None"):
        ControllerConfig(replan_every="sometimes")


@pytest.mark.standard_promotion("optax's adamw promotes its step count inside")
def test_the_controller_reports_parameters_and_state_in_bytes_per_parameter():
    params = {"w": jnp.zeros((64, 128))}
    data = np.ones((64, 64), np.float32)
    loss = lambda p, b, *, policy, rng: jnp.mean((b @ p["w"]) ** 2)

    def held(tx):
        controller = triaccel_jax.Controller(
            loss, params, tx, data, probe=triaccel_jax.BudgetMemoryProbe(2**30), max_batch=16
        )
        controller.run(2)
        return controller.bytes_per_parameter

    assert held(optax.adamw(1e-3)) == pytest.approx(12.0, abs=1e-2)
    eight_bit = triaccel_jax.quantize_state(optax.adamw(1e-3), min_size=1024)
    # Codes, and a scale per block along the last axis: one per row of 128.
    assert held(eight_bit) == pytest.approx(4 + 2 * (1 + 4 / 128), abs=1e-2)


def test_a_replans_seconds_are_no_steps_seconds(monkeypatch):
    # Goodput's throughput comes from the steps' seconds: a re-plan (a second here) inside one
    # step's time would be an outlier that keeps the throughput from ever being known.
    import time

    from triaccel_jax.controller import _controller

    planned = _controller.replan_lib.replan

    def slow_replan(*args, **kwargs):
        time.sleep(1.0)
        return planned(*args, **kwargs)

    monkeypatch.setattr(_controller.replan_lib, "replan", slow_replan)
    params = {"w": jnp.zeros(4)}
    observed = optax.chain(triaccel_jax.curvature_signals(), optax.sgd(0.1))
    controller = triaccel_jax.Controller(
        lambda p, b, *, policy, rng: jnp.mean((b @ p["w"]) ** 2),
        params,
        observed,
        np.ones((64, 4), np.float32),
        probe=triaccel_jax.BudgetMemoryProbe(2**30),
        min_batch=8,
        max_batch=8,
        replan_every=5,
    )
    infos = controller.run(12)
    assert controller.timings["control"] >= 2.0  # two re-plans ran
    assert max(info.seconds for info in infos[1:]) < 0.5


def test_every_time_the_controller_measures_is_read_from_its_clock():
    # Each step takes 0.25 s on a virtual clock, and nothing else moves it: every figure the
    # controller times is then exact. A part still reading time.perf_counter would show here
    # (a compile's or the controller's own seconds above 0, a step's seconds off 0.25).
    clock = VirtualClock()

    def loss(params, batch, *, policy, rng):
        take_time(0.25, clock)
        return jnp.mean((batch @ params["w"]) ** 2)

    controller = triaccel_jax.Controller(
        loss,
        {"w": jnp.zeros(4)},
        optax.sgd(0.1),
        np.ones((64, 4), np.float32),
        probe=triaccel_jax.BudgetMemoryProbe(2**30),
        min_batch=8,
        max_batch=8,
        steps_in_flight=0,
        batch_rule="memory",  # a step whole, not in halves: the loss (and its 0.25 s) runs once
        lr_scaling="none",
        clock=clock,
    )
    infos = controller.run(24)
    assert [info.seconds for info in infos] == [0.25] * 24 and clock.now == 24 * 0.25
    timings = controller.timings
    assert (timings["compile"], timings["data"], timings["control"]) == (0.0, 0.0, 0.0)
    assert 0.0 < timings["step"] <= clock.now  # a callback may run between dispatch and read
    assert set(controller.throughput.values()) == {8 / 0.25}
    with pytest.raises(TypeError, match="clock"):
        triaccel_jax.Controller(
            loss, {"w": jnp.zeros(4)}, optax.sgd(0.1), np.ones((64, 4), np.float32), clock=1.0
        )
