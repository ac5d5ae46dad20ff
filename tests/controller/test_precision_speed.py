"""Precision by measured speed and memory (precision_rule="speed", the default).

A lower precision is kept only where memory needs it or where its steps measured faster: the
tests make one policy's steps slow on purpose (a host callback that sleeps inside the step) and
check which policy the controller keeps, and that a memory cap is met by lowering precision
before the batch shrinks.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest
from controller_harness import BIG
from controller_harness import linear_probe
from controller_harness import loss_fn as plain_loss
from controller_harness import make_params

import triaccel_jax
from triaccel_jax import FakeMemoryProbe
from triaccel_jax import PrecisionPolicy
from triaccel_jax.controller import ControllerConfig
from triaccel_jax.controller._precision_schedule import PrecisionSchedule
from triaccel_jax.controller._precision_speed import PolicyTrial
from triaccel_jax.controller._precision_speed import judge_trial
from triaccel_jax.controller._precision_speed import savings_needed
from triaccel_jax.controller._replan import decide_replan
from triaccel_jax.policy import PrecisionPlan
from triaccel_jax.precision import PlannerConfig

EVERYTHING = PlannerConfig(budget=float("inf"), min_size=0)


def _lowered(policy) -> bool:
    return policy is not None and any(policy.compute(path) != "fp32" for path in policy)


def _slow_when(lowered: bool, seconds: float = 0.03):
    """A loss whose steps sleep ``seconds`` when the policy lowers a leaf (``lowered``) or when
    it does not: the policy is known when the step is traced, so the sleep is compiled in."""

    def loss(params, batch, *, policy, rng):
        value = plain_loss(params, batch, policy=policy, rng=rng)
        if _lowered(policy) == lowered:
            jax.debug.callback(lambda: time.sleep(seconds))
        return value

    return loss


def _settings(**overrides):
    settings = dict(
        min_batch=16,
        max_batch=16,
        probe=linear_probe(limit=BIG),
        replan_every=20,
        first_replan=5,
        planner=EVERYTHING,
        speed_trials=True,  # on a CPU trials are off by default
    )
    settings.update(overrides)
    return settings


@pytest.mark.slow
def test_the_default_rule_is_speed_and_a_cpu_makes_no_speed_trials(make_controller):
    assert ControllerConfig().precision_rule == "speed"
    controller = make_controller(loss_fn=_slow_when(lowered=False), **_settings(speed_trials=None))
    controller.run(30)
    assert not [e for e in controller.events if e.kind in ("precision_trial", "replan")]
    assert not _lowered(controller.policy)
    with pytest.raises(ValueError, match="precision_rule"):
        ControllerConfig(precision_rule="fastest")


@pytest.mark.slow
def test_a_lower_precision_measured_slower_goes_back_to_fp32_and_is_not_tried_again(
    make_controller,
):
    controller = make_controller(loss_fn=_slow_when(lowered=True), **_settings())
    controller.run(60)
    trials = [e for e in controller.events if e.kind == "precision_trial"]
    assert len(trials) == 1, "a lower precision measured slower is not tried again"
    (trial,) = trials
    assert trial.figures["trial_samples_per_second"] < trial.figures["previous_samples_per_second"]
    assert not _lowered(controller.policy)
    # Two switches: to the trial's policy, and back to the one before it.
    trial_switch, back = [e for e in controller.events if e.kind == "replan"]
    assert trial_switch.figures["speed_trial"] is True
    assert (trial_switch.old, trial_switch.new) == (back.new, back.old)
    assert back.step == trial.step


@pytest.mark.slow
def test_a_lower_precision_measured_faster_is_kept(make_controller):
    # The goodput margin does not judge a speed trial: a huge one changes nothing here.
    controller = make_controller(loss_fn=_slow_when(lowered=False), **_settings(goodput_margin=1e6))
    controller.run(40)
    (trial,) = [e for e in controller.events if e.kind == "precision_trial"]
    assert trial.figures["speedup"] > 0.05
    assert trial.new == trial.old  # the trial policy is kept
    assert _lowered(controller.policy)


@pytest.mark.slow
def test_a_faster_lower_precision_short_of_the_speed_trial_margin_is_not_kept(make_controller):
    controller = make_controller(
        loss_fn=_slow_when(lowered=False), **_settings(speed_trial_margin=1e6)
    )
    controller.run(40)
    (trial,) = [e for e in controller.events if e.kind == "precision_trial"]
    assert trial.figures["speedup"] > 0.05  # faster, but not by the margin asked for
    assert trial.new != trial.old  # back to the policy before the trial
    assert not _lowered(controller.policy)
    with pytest.raises(ValueError, match="speed_trial_margin"):
        ControllerConfig(speed_trial_margin=-0.1)


@pytest.mark.slow
def test_the_memory_rule_lowers_wherever_the_budget_allows(make_controller):
    controller = make_controller(
        loss_fn=_slow_when(lowered=True), precision_rule="memory", **_settings()
    )
    controller.run(40)
    assert _lowered(controller.policy)
    assert not [e for e in controller.events if e.kind == "precision_trial"]


@pytest.mark.slow
def test_a_memory_cap_is_met_by_lowering_precision_before_the_batch_shrinks(make_controller):
    holder = {}

    def peak(batch):
        # The step's memory halves when w1 computes in bf16: fp32 at batch 64 is over the
        # high-water mark (95% of 10_000), bf16 fits.
        lowered = _lowered(holder["controller"].policy)
        return 2_000 + (60 if lowered else 130) * batch

    probe = FakeMemoryProbe(10_000, peak_bytes=peak)
    # Every step's lowered policy is slower: memory, not speed, must be why it is taken.
    controller = make_controller(
        loss_fn=_slow_when(lowered=True, seconds=0.001),
        **_settings(min_batch=16, max_batch=64, batch_size=64, probe=probe, batch_rule="memory"),
    )
    holder["controller"] = controller
    infos = controller.run(30)
    kinds = [e.kind for e in controller.events]
    assert "shrink" not in kinds
    (replan,) = [e for e in controller.events if e.kind == "replan"]
    assert replan.reason.startswith("memory needs")
    assert replan.figures["savings_needed_bytes"] > 0
    assert _lowered(controller.policy)
    assert {info.batch_size for info in infos} == {64}


@pytest.mark.slow
def test_a_scheduled_replan_lowers_only_what_memory_needs_and_says_so(make_controller):
    holder = {}

    def peak(batch):
        lowered = _lowered(holder["controller"].policy)
        return 2_000 + (60 if lowered else 100) * batch

    # fp32 at 64: 8_400 B, over the target (85% of 9_000) but under the high-water mark, so no
    # shrink is indicated; the scheduled re-plan (no speed trial on a CPU) lowers for memory.
    probe = FakeMemoryProbe(9_000, peak_bytes=peak)
    controller = make_controller(
        **_settings(min_batch=64, max_batch=64, batch_size=64, probe=probe, speed_trials=None)
    )
    holder["controller"] = controller
    controller.run(10)
    (replan,) = [e for e in controller.events if e.kind == "replan"]
    assert replan.step == 5 and replan.reason.startswith("memory needs")
    assert replan.figures["savings_needed_bytes"] == 8_400 - int(0.85 * 9_000)
    assert _lowered(controller.policy)


@pytest.mark.slow
def test_without_a_way_to_lower_precision_the_batch_shrinks(make_controller):
    probe = FakeMemoryProbe(10_000, peak_bytes=lambda batch: 2_000 + 130 * batch)
    controller = make_controller(
        **_settings(
            min_batch=16,
            max_batch=64,
            batch_size=64,
            probe=probe,
            batch_rule="memory",
            planner=PlannerConfig(budget=0.0),
        )
    )
    controller.run(10)
    assert "shrink" in [e.kind for e in controller.events]
    assert not _lowered(controller.policy)


def test_judge_trial_keeps_only_a_faster_policy():
    trial = PolicyTrial(None, "fp32", "bf16", 32, 1)
    assert not judge_trial(trial, 100.0, 0.05).keep  # no timed step yet
    trial = trial.add(320, 1.0).add(320, 1.0)  # 320 samples/s
    assert trial.rate == pytest.approx(320.0)
    assert judge_trial(trial, 300.0, 0.05).keep  # 6.7% faster
    assert not judge_trial(trial, 310.0, 0.05).keep  # 3.2%: within the margin
    assert not judge_trial(trial, None, 0.05).keep  # nothing to compare with


def test_savings_needed_counts_what_the_policy_already_saves():
    params = make_params()  # w1: 8 x 32, w2: 32
    fp32 = PrecisionPolicy.uniform(params)
    bf16 = PrecisionPolicy.uniform(params, "bf16")
    assert savings_needed(fp32, params, peak_bytes=1_000, limit_bytes=1_000, target=0.8) == 200
    # bf16 already saves 2 bytes x 288 elements: the need against fp32 includes them.
    assert savings_needed(bf16, params, peak_bytes=1_000, limit_bytes=1_000, target=0.8) == 776
    assert savings_needed(fp32, params, peak_bytes=None, limit_bytes=1_000, target=0.8) == 0
    assert savings_needed(fp32, params, peak_bytes=500, limit_bytes=1_000, target=0.8) == 0
    assert jnp.size(params["w1"]) + jnp.size(params["w2"]) == 288


def _decide(**overrides):
    """The re-plan decision from all-fp32 on the harness's params (the budget lets one leaf
    go to bf16), at micro-batch 16 against a limit of 1000 B (target 80%)."""
    params = make_params()
    start = PrecisionPlan(PrecisionPolicy.uniform(params), {})
    settings = dict(
        loss=1.0,
        planner=EVERYTHING,
        precision_rule="speed",
        first=True,
        for_memory=False,
        tries_for_speed=True,
        micro=16,
        num_micro=1,
        peak_bytes=500,
        limit_bytes=1_000,
        target=0.8,
        throughput={(16, 1, start.policy.signature): 100.0, (32, 1, "other"): 5.0},
    )
    settings.update(overrides)
    return start, decide_replan(triaccel_jax.triaccel(0.1).init(params), params, start, **settings)


def test_a_replan_decision_says_why_and_puts_on_trial_only_what_may_prove_faster():
    # Memory fits and lower precision may still prove faster: the budget's plan, on trial.
    start, trial = _decide()
    assert trial.changed and trial.figures["speed_trial"] is True
    assert trial.reason.startswith("the accuracy budget allows lower precision")
    assert trial.figures["samples_per_second"] == {start.policy.signature: 100.0}  # this batch's
    # A lower precision measured slower this run, and memory fits: nothing to lower.
    _, kept = _decide(tries_for_speed=False)
    assert not kept.changed and kept.plan.policy == start.policy and kept.reason == ""
    # Over the target (1000 B against 800): lowered for memory, no trial, the bytes said.
    for overrides in ({"tries_for_speed": False}, {"for_memory": True}):
        _, memory = _decide(peak_bytes=1_000, **overrides)
        assert memory.changed and "speed_trial" not in memory.figures
        assert memory.reason == "memory needs 200 B saved at micro-batch 16"
    # The memory rule lowers what the budget allows, and times nothing.
    _, lowered = _decide(precision_rule="memory")
    assert lowered.changed and lowered.reason == "the planner chose another policy"
    assert set(lowered.figures) == {"precision_rule", "leaves_by_dtype", "loss"}


def test_a_replan_for_memory_skips_the_hysteresis_a_scheduled_one_waits_for():
    over = dict(tries_for_speed=False, peak_bytes=1_000, first=False)
    _, scheduled = _decide(**over)
    assert not scheduled.changed and scheduled.plan.pending  # a streak starts
    _, for_memory = _decide(for_memory=True, **over)
    assert for_memory.changed and not for_memory.plan.pending


def test_the_schedule_defers_a_replan_behind_a_compile_and_holds_it_for_a_trials_verdict():
    params = make_params()
    fp32, bf16 = PrecisionPolicy.uniform(params), PrecisionPolicy.uniform(params, "bf16")
    schedule = PrecisionSchedule(speed_trials=True)
    schedule.set_policy(fp32)
    assert schedule.start_replan(20, compiling=True, for_memory=False) is None
    assert schedule.waiting  # it runs once the compile is taken, as the re-plan due at 20
    assert schedule.start_replan(25, compiling=True, for_memory=True) is None
    assert schedule.start_replan(30, compiling=False, for_memory=False) == 20
    assert not schedule.waiting
    schedule.switch(PrecisionPlan(bf16, {}), trial_at=(16, 1))
    assert schedule.policy == bf16
    assert (schedule.trial.signature, schedule.trial.previous_signature) == (
        bf16.signature,
        fp32.signature,
    )
    assert schedule.start_replan(40, compiling=False, for_memory=False) is None
    assert schedule.start_replan(41, compiling=False, for_memory=True) == 41  # memory won't wait
    schedule.switch(PrecisionPlan(fp32, {}))
    assert schedule.policy == fp32 and schedule.trial is not None  # judged (and dropped) later
