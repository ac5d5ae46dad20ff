"""Background compiles (issue 14): growing the batch never stalls training on a compile.

The bigger bucket's step compiles on a worker thread; a compile hook that waits on an Event the
test releases makes the compile slow deterministically, so the steps that run meanwhile are
counted, not timed.
"""

from __future__ import annotations

import threading

from test_controller import linear_probe
from test_controller import make_controller

from triaccel_jax import Controller

STEPS_WHILE_COMPILING = 5


class GatedCompileController(Controller):
    """Its background compiles wait until ``gate`` is set (synchronous ones do not)."""

    def __init__(self, *args, **kwargs):
        self.gate = threading.Event()
        super().__init__(*args, **kwargs)

    def _build_step(self, step, abstract_args):
        if threading.current_thread() is not threading.main_thread():
            assert self.gate.wait(timeout=60), "the test never released the compile"
        return super()._build_step(step, abstract_args)


SETTINGS = {"min_batch": 8, "max_batch": 16, "check_every": 1, "probe": linear_probe()}


def run_until_grown(controller, max_steps=200):
    steps_while_compiling = 0
    for _ in range(max_steps):
        controller.step()
        kinds = [e.kind for e in controller.events]
        if "grow_decided" in kinds and "grow" not in kinds:
            steps_while_compiling += 1
            if steps_while_compiling == STEPS_WHILE_COMPILING:
                controller.gate.set()
                controller._background.job.future.result()  # ready: the next step switches
        if "grow" in kinds:
            return
    raise AssertionError(f"no grow in {max_steps} steps: {controller.event_records()}")


def test_steps_run_between_the_grow_decision_and_the_switch(count_compiles):
    controller = make_controller(GatedCompileController, **SETTINGS, compile_in_background=True)
    with count_compiles():
        run_until_grown(controller)
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
