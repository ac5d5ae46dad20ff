"""Steps in flight (issue 14): the device never waits for the host between steps.

``Controller.run`` dispatches step ``n + 1`` before reading step ``n``'s metrics; an
out-of-memory error that surfaces when a result is read (as it may under async dispatch) re-runs
the failed step and every step queued after it on their same samples.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from controller_harness import FaultyController
from controller_harness import make_controller
from controller_harness import without_step_times

import triaccel_jax

NUM_STEPS = 20
SETTINGS = {
    "min_batch": 8,
    "max_batch": 64,
    "batch_size": 64,
    "check_every": 1000,
    "probe": triaccel_jax.BudgetMemoryProbe(2**40),
}


def reads_with_nothing_queued(monkeypatch, controller) -> list[int]:
    """Runs ``NUM_STEPS``; for each ``jax.device_get``, how many steps were queued behind it."""
    queued_behind = []
    original = jax.device_get

    def counting_device_get(tree):
        queued_behind.append(max(len(controller._in_flight.pending) - 1, 0))
        return original(tree)

    monkeypatch.setattr(jax, "device_get", counting_device_get)
    infos = controller.run(NUM_STEPS)
    monkeypatch.undo()
    assert [info.step for info in infos] == list(range(1, NUM_STEPS + 1))
    return [q for q in queued_behind if q == 0]


@pytest.mark.slow
def test_the_steady_state_loop_reads_no_step_while_the_device_has_nothing_queued(monkeypatch):
    in_flight = make_controller(**SETTINGS)
    blocking = reads_with_nothing_queued(monkeypatch, in_flight)
    assert len(blocking) <= 1  # only the flush at the end of run()
    synchronous = make_controller(**SETTINGS, steps_in_flight=0)
    assert len(reads_with_nothing_queued(monkeypatch, synchronous)) == NUM_STEPS


@pytest.mark.slow
def test_callbacks_see_every_step_in_order_and_the_state_matches_a_synchronous_run():
    seen = []
    in_flight = make_controller(**SETTINGS, callback=seen.append)
    infos = in_flight.run(NUM_STEPS)
    assert seen == infos and [i.step for i in infos] == list(range(1, NUM_STEPS + 1))
    synchronous = make_controller(**SETTINGS)
    sync_infos = [synchronous.step() for _ in range(NUM_STEPS)]
    np.testing.assert_allclose([i.loss for i in infos], [i.loss for i in sync_infos], rtol=1e-6)
    for a, b in zip(
        jax.tree.leaves(in_flight.params), jax.tree.leaves(synchronous.params), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert without_step_times(in_flight.state_dict()) == without_step_times(
        synchronous.state_dict()
    )


FAULTS = {3: 1, 7: 2}


def ooms(controller):
    return [(e.step, e.old, e.new) for e in controller.events if e.kind == "oom"]


def assert_trained_the_sampler_stream(controller, infos) -> None:
    seen = np.concatenate(controller.seen)
    sampler = controller.sampler
    served = np.concatenate([sampler.order(e) for e in range(sampler.epoch + 1)])
    assert len(seen) == sampler.samples_seen == sum(i.batch_size for i in infos)
    np.testing.assert_array_equal(seen, served[: len(seen)])


@pytest.mark.slow
def test_an_out_of_memory_error_at_dispatch_in_flight_matches_a_synchronous_run():
    controller = make_controller(FaultyController, **SETTINGS, faults=FAULTS)
    infos = controller.run(NUM_STEPS)
    reference = make_controller(FaultyController, **SETTINGS, faults=FAULTS)
    expected = [reference.step() for _ in range(NUM_STEPS)]
    assert [i.step for i in infos] == list(range(1, NUM_STEPS + 1))
    assert [i.batch_size for i in infos] == [i.batch_size for i in expected]
    assert ooms(controller) == ooms(reference) == [(3, 64, 32), (7, 32, 16), (7, 16, 8)]
    assert_trained_the_sampler_stream(controller, infos)
    np.testing.assert_allclose([i.loss for i in infos], [i.loss for i in expected], rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(controller.params), jax.tree.leaves(reference.params), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_an_out_of_memory_error_at_read_reruns_the_queued_steps_on_their_samples():
    """Async dispatch: the failure surfaces a step late, after the next step was dispatched."""
    events = []
    controller = make_controller(
        FaultyController,
        **SETTINGS,
        read_faults=FAULTS,
        callback=lambda info: events.extend(info.events),
    )
    infos = controller.run(NUM_STEPS)
    assert [i.step for i in infos] == list(range(1, NUM_STEPS + 1))
    assert ooms(controller) == [(3, 64, 32), (7, 32, 16), (7, 16, 8)]
    assert_trained_the_sampler_stream(controller, infos)
    # Every event from the first step on reaches a StepInfo once, in order.
    assert events == controller.events[1:]
    assert all(np.isfinite(i.loss) for i in infos)
    # The step queued behind the failed one had drawn a full batch: it trains it as 2 x 32.
    assert [i.batch_size for i in infos[:5]] == [64] * 5 and infos[4].micro_batch == 32
