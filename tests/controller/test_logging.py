"""The controller's decisions go to Python's logging: every event once, at its level, and no output
where the application configured none."""

from __future__ import annotations

import logging
import subprocess
import sys

import jax.numpy as jnp
import pytest
from controller_harness import BIG
from controller_harness import FaultyController
from controller_harness import make_controller

import triaccel_jax
from triaccel_jax import FakeMemoryProbe
from triaccel_jax.controller import Event
from triaccel_jax.controller import _logging
from triaccel_jax.precision import PlannerConfig

LOGGER = "triaccel_jax.controller"


def logged_events(caplog) -> list[Event]:
    return [r.event for r in caplog.records if r.name == LOGGER and hasattr(r, "event")]


def replanning_loss(params, batch, *, policy, rng):
    cast = triaccel_jax.cast_params(params, policy)
    hidden = jnp.tanh(batch["x"] @ cast["w1"].astype(jnp.float32))
    return jnp.mean((hidden @ cast["w2"].astype(jnp.float32) - batch["y"]) ** 2)


RUNS = {
    # start, compiles, grows to the largest bucket that fits, learning-rate changes
    "grow": dict(batch_rule="memory"),
    # the same, the bigger bucket compiled on a worker thread (grow_decided, then grow)
    "background-compile": dict(batch_rule="memory", compile_in_background=True),
    # a policy change every few steps
    "replan": dict(
        loss_fn=replanning_loss,
        replan_every=3,
        precision_rule="memory",  # every leaf the budget allows: the plan moves
        planner=PlannerConfig(budget=float("inf"), min_size=0),
        probe=FakeMemoryProbe(BIG),
    ),
    # memory taken away after 10 readings: grows, then shrinks
    "shrink": dict(
        batch_rule="memory",
        probe=FakeMemoryProbe(
            lambda n: 20_000 if n < 10 else 8_000, peak_bytes=lambda b: 1_000 + 100 * b
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_every_event_is_logged_once_in_order(caplog, run):
    caplog.set_level(logging.DEBUG, logger="triaccel_jax")
    controller = make_controller(**RUNS[run])
    controller.run(20)
    if controller.wait_for_compile():  # a slow machine: let the compile finish
        controller.run(2)
    # The controller's event log and the logger's records are the same decisions, in order:
    # a decision recorded but not logged (or logged twice) fails here.
    assert logged_events(caplog) == controller.events
    kinds = {e.kind for e in controller.events}
    expected = {
        "grow": {"start", "compile", "grow", "update_scale"},
        "background-compile": {"start", "compile", "grow_decided", "grow"},
        "replan": {"start", "compile", "replan"},
        "shrink": {"start", "compile", "grow", "shrink"},
    }[run]
    assert expected <= kinds, kinds
    for record in caplog.records:
        if hasattr(record, "event"):
            event = record.event
            assert record.levelno == logging.INFO
            assert record.getMessage().startswith(f"step {event.step}: {event.kind} ")
            assert event.reason in record.getMessage()


@pytest.mark.slow
def test_an_out_of_memory_retry_is_a_warning_with_its_figures(caplog):
    caplog.set_level(logging.INFO, logger="triaccel_jax")
    # Grown by memory before step 3, whose out-of-memory error then shrinks the bucket.
    controller = make_controller(FaultyController, faults={3: 1}, patience=1, batch_rule="memory")
    controller.run(6)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.event.kind for r in warnings] == ["oom"]
    (oom,) = [e for e in controller.events if e.kind == "oom"]
    assert warnings[0].event == oom
    assert f"step 3: oom {oom.old} -> {oom.new}" in warnings[0].getMessage()
    assert f"ceiling={oom.figures['ceiling']}" in warnings[0].getMessage()
    # Everything else is INFO, and a WARNING-level logger drops it without formatting it.
    assert {r.levelno for r in caplog.records} == {logging.INFO, logging.WARNING}


def test_a_restore_is_logged(caplog):
    controller = make_controller()
    controller.run(3)
    state = controller.state_dict()
    other = make_controller()
    caplog.set_level(logging.INFO, logger="triaccel_jax")
    other.load_state_dict(state)
    logged = logged_events(caplog)
    assert logged[0].kind == "restore" and logged[0].new == 3
    assert logged == other.events[-len(logged) :]


def test_each_step_is_one_debug_record_and_info_hides_them(caplog):
    caplog.set_level(logging.DEBUG, logger="triaccel_jax")
    seen = []
    controller = make_controller(callback=seen.append)
    infos = controller.run(7)
    steps = [r for r in caplog.records if hasattr(r, "step_info")]
    assert [r.step_info for r in steps] == infos == seen  # the user's callback still runs
    assert all(r.levelno == logging.DEBUG for r in steps)
    assert steps[0].getMessage().startswith(f"step 1: batch {infos[0].batch_size} ")
    caplog.clear()
    caplog.set_level(logging.INFO, logger="triaccel_jax")
    controller.run(3)
    assert not [r for r in caplog.records if hasattr(r, "step_info")]


def test_the_library_adds_only_a_null_handler():
    package = logging.getLogger("triaccel_jax")
    assert [type(h) for h in package.handlers] == [logging.NullHandler]
    assert logging.getLogger(LOGGER).handlers == []
    assert _logging.logger.name == LOGGER
    # With no logging configured, even a WARNING prints nothing (no last-resort output).
    code = (
        "import triaccel_jax\n"
        "from triaccel_jax.controller import Event\n"
        "from triaccel_jax.controller._logging import log_event\n"
        "log_event(Event(3, 'oom', 32, 16, 'RESOURCE_EXHAUSTED', {}))\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout == "ok\n"
    assert "oom" not in result.stderr and "RESOURCE_EXHAUSTED" not in result.stderr


def test_event_levels():
    assert _logging.event_level("oom") == logging.WARNING
    for kind in (
        "start",
        "grow",
        "shrink",
        "reject",
        "replan",
        "learning_rate",
        "update_scale",
        "compile",
    ):
        assert _logging.event_level(kind) == logging.INFO
