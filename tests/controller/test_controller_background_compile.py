"""Background compiles (issue 14): growing the batch never stalls training on a compile.

The bigger bucket's step compiles on a worker thread; a compile hook that waits on an Event the
test releases makes the compile slow deterministically, so the steps that run meanwhile are
counted, not timed.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import pytest
from controller_harness import linear_probe
from controller_harness import make_controller

from triaccel_jax.controller import _compiling as compiling
from triaccel_jax.precision import PlannerConfig

STEPS_WHILE_COMPILING = 5


@pytest.fixture
def gate(monkeypatch):
    """Background compiles wait until the returned event is set (synchronous ones do not)."""
    released = threading.Event()
    build = compiling.build

    def gated_build(step, abstract_args):
        if threading.current_thread() is not threading.main_thread():
            assert released.wait(timeout=60), "the test never released the compile"
        return build(step, abstract_args)

    monkeypatch.setattr(compiling, "build", gated_build)
    return released


# The memory rule: the probe's room for 16 decides the grow (goodput would time the buckets).
SETTINGS = {
    "min_batch": 8,
    "max_batch": 16,
    "check_every": 1,
    "probe": linear_probe(),
    "batch_rule": "memory",
}


def run_until_grown(controller, gate, max_steps=200):
    steps_while_compiling = 0
    for _ in range(max_steps):
        controller.step()
        kinds = [e.kind for e in controller.events]
        if "grow_decided" in kinds and "grow" not in kinds:
            steps_while_compiling += 1
            if steps_while_compiling == STEPS_WHILE_COMPILING:
                gate.set()
                controller.wait_for_compile()  # ready: the next step switches
        if "grow" in kinds:
            return
    raise AssertionError(f"no grow in {max_steps} steps: {controller.event_records()}")


@pytest.mark.slow
def test_steps_run_between_the_grow_decision_and_the_switch(count_compiles, gate):
    controller = make_controller(**SETTINGS, compile_in_background=True)
    with count_compiles():
        run_until_grown(controller, gate)
        controller.run(3)
    events = [(e.step, e.kind, e.old, e.new) for e in controller.events]
    decided = next(e for e in events if e[1] == "grow_decided")
    compiled = next(e for e in events if e[1] == "compile" and e[3] == "1x16")
    switched = next(e for e in events if e[1] == "grow")
    assert decided[2:] == switched[2:] == (8, 16)
    # Training went on at 8 while 16 compiled; the switch came at the first step after.
    assert switched[0] - decided[0] >= STEPS_WHILE_COMPILING
    assert decided[0] < compiled[0] <= switched[0] == decided[0] + STEPS_WHILE_COMPILING
    background = [e.figures["background"] for e in controller.events if e.kind == "compile"]
    assert background == [False, True]
    assert controller.micro_batch == 16

    synchronous = make_controller(**SETTINGS)
    with count_compiles() as sync_count:
        synchronous.run(switched[0] + 4)
    assert synchronous.micro_batch == 16
    assert controller.compile_count == synchronous.compile_count == 2
    assert count_compiles.of("controller_step") == sync_count.of("controller_step")


REPLAN_SETTINGS = {
    "min_batch": 8,
    "max_batch": 8,
    "replan_every": 5,
    "planner": PlannerConfig(budget=float("inf"), min_size=0),
    "precision_rule": "memory",  # every leaf the budget allows: the plan moves
}


@pytest.mark.slow
def test_steps_run_between_the_replan_decision_and_the_switch(count_compiles, gate):
    controller = make_controller(**REPLAN_SETTINGS, compile_in_background=True)
    with count_compiles():
        decided = []
        while not decided and controller.step_count < 30:
            controller.step()  # until a re-plan is decided and its step compiling
            decided = [e for e in controller.events if e.kind == "replan_decided"]
        assert len(decided) == 1 and not [e for e in controller.events if e.kind == "replan"]
        old_policy = controller.policy
        new_signature = decided[0].new
        assert new_signature != old_policy.signature
        for _ in range(STEPS_WHILE_COMPILING - 1):
            controller.step()  # training goes on under the old policy
            assert controller.policy == old_policy
        gate.set()
        controller.wait_for_compile()
        controller.step()  # the first step after the compile is ready switches
        controller.run(3)
    switched = [e for e in controller.events if e.kind == "replan"]
    assert [(e.step, e.old, e.new) for e in switched] == [
        (decided[0].step + STEPS_WHILE_COMPILING, old_policy.signature, new_signature)
    ]
    assert controller.policy.signature == new_signature
    # The moments were converted from the state as trained meanwhile, to the new policy's dtypes.
    state_dtypes = {leaf.dtype for leaf in jax.tree.leaves(controller.opt_state)}
    assert jnp.dtype(jnp.bfloat16) in state_dtypes
    background = [e.figures["background"] for e in controller.events if e.kind == "compile"]
    assert background == [False, True]

    synchronous = make_controller(**REPLAN_SETTINGS)
    with count_compiles() as sync_count:
        synchronous.run(controller.step_count)
    assert [e.new for e in synchronous.events if e.kind == "replan"] == [new_signature]
    assert controller.compile_count == synchronous.compile_count == 2
    assert count_compiles.of("controller_step") == sync_count.of("controller_step")


@pytest.mark.slow
def test_a_replan_to_a_policy_already_compiled_switches_at_once():
    controller = make_controller(**REPLAN_SETTINGS, compile_in_background=True)
    first = controller.policy
    while not controller.compile_pending and controller.step_count < 30:
        controller.step()  # until a re-plan is decided and compiling (not gated here)
    controller.wait_for_compile()
    controller.step()
    assert controller.policy != first and not controller.compile_pending
    # Back to a policy whose step is cached: no background compile, the switch is immediate.
    controller.set_policy(first)
    result_events = len(controller.events)
    controller.run(10)  # the planner moves to the cached new policy again
    kinds = [e.kind for e in controller.events[result_events:]]
    assert "replan" in kinds and "replan_decided" not in kinds and "compile" not in kinds


@pytest.mark.slow
def test_a_replan_due_while_a_grow_compiles_runs_when_the_compile_is_done(gate):
    controller = make_controller(
        **SETTINGS,
        replan_every=3,
        precision_rule="memory",  # every leaf the budget allows: the plan moves
        planner=PlannerConfig(budget=float("inf"), min_size=0),
        compile_in_background=True,
    )
    while not controller.compile_pending and controller.step_count < 30:
        controller.step()  # until a grow is decided and its compile waits on the gate
    decided_at = controller.step_count
    controller.run(STEPS_WHILE_COMPILING)  # a re-plan comes due meanwhile: it waits
    kinds = [e.kind for e in controller.events]
    assert "replan_decided" not in kinds and "replan" not in kinds
    gate.set()
    controller.wait_for_compile()
    controller.step()  # the grow switches, then the waiting re-plan runs
    at_switch = [(e.kind, e.step) for e in controller.events if e.step == controller.step_count - 1]
    assert ("grow", decided_at + STEPS_WHILE_COMPILING) in at_switch
    assert ("replan_decided", decided_at + STEPS_WHILE_COMPILING) in at_switch
    controller.wait_for_compile()
    controller.step()
    # Being the first plan, it moved the leaves at once (no hysteresis), however late it ran.
    assert [e.kind for e in controller.events].count("replan") == 1
    assert not controller.compile_pending
