"""The controller's features combined: steps in flight, background compiles, out-of-memory
recovery, learning-rate scaling and re-planning at once, as a GPU run uses them.

Each test drives a situation where two features meet (a switch while a step is in flight, a late
out-of-memory error behind which steps are queued) and checks the invariants that must hold
whatever the order: a step's record is its own (micro-batch, rate), and a rollback restores a
consistent whole (the moments' dtypes are the policy's).
"""

from __future__ import annotations

import jax
import optax
import pytest
from controller_harness import BASE_LR
from controller_harness import FaultyController
from controller_harness import linear_probe
from controller_harness import make_controller
from controller_harness import shrink_settings

from triaccel_jax import FakeMemoryProbe
from triaccel_jax import PrecisionPolicy
from triaccel_jax._src import tree as tree_lib
from triaccel_jax.policy import _dtypes as dtypes
from triaccel_jax.precision import PlannerConfig

BIG = 10**12


def waiting_for_compiles(holder: list, kind: str):
    """A callback that, when a ``kind`` decision is delivered, waits until its background
    compile is ready (``holder[0]`` is the controller), so that the very next dispatch switches
    while a step is in flight; it records the steps it waited at."""
    seen = []

    def callback(info):
        if any(e.kind == kind for e in info.events) and holder[0].wait_for_compile():
            seen.append(info.step)

    return callback, seen


def test_a_step_delivered_after_a_switch_reports_the_micro_batch_it_ran_at():
    holder: list = []
    callback, seen = waiting_for_compiles(holder, "grow_decided")
    controller = make_controller(
        FaultyController,
        min_batch=8,
        max_batch=16,
        check_every=1,
        probe=linear_probe(),
        batch_rule="memory",
        compile_in_background=True,
        callback=callback,
    )
    holder.append(controller)
    infos = controller.run(12)
    assert seen and any(e.kind == "grow" for e in controller.events)
    for info in infos:
        # The micro-batch it ran at divides the samples it trained.
        assert info.batch_size == len(info.indices), info
        assert info.micro_batch <= info.batch_size and info.batch_size % info.micro_batch == 0


@pytest.mark.parametrize("injected", [True, False], ids=["injected", "update-scaled"])
def test_steps_queued_behind_a_late_out_of_memory_train_at_the_rate_of_their_samples(injected):
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=BASE_LR) if injected else None
    controller = make_controller(
        FaultyController,
        tx=tx or optax.sgd(BASE_LR),
        read_faults={3: 1},
        steps_in_flight=2,
        **shrink_settings(),
    )
    infos = controller.run(8)
    assert [e.kind for e in controller.events].count("oom") == 1
    for info in infos:
        assert len(info.indices) == info.batch_size
        expected = BASE_LR * info.batch_size / 64
        if injected:
            assert info.learning_rate == pytest.approx(expected) and info.update_scale == 1.0
        else:
            assert info.learning_rate is None
            assert info.update_scale * BASE_LR == pytest.approx(expected), info
    # The failed step and the two queued behind it trained 64 samples each; then 32.
    assert [i.batch_size for i in infos][:7] == [64] * 6 + [32]


@pytest.mark.slow
def test_a_rollback_past_a_policy_switch_restores_the_policy_with_the_moments():
    holder: list = []
    waited, seen = waiting_for_compiles(holder, "replan_decided")

    def fail_the_step_in_flight(info):
        waited(info)
        if len(seen) == 1 and seen[0] == info.step:
            # The next dispatch switches policy while step `info.step` is queued: make its read
            # run out of memory, so that it and what follows roll back past the switch.
            controller.injector.add("read", info.step)

    controller = make_controller(
        FaultyController,
        min_batch=4,
        max_batch=8,
        batch_size=8,
        check_every=1000,
        replan_every=4,
        precision_rule="memory",  # every leaf the budget allows: the plan moves
        planner=PlannerConfig(budget=float("inf"), min_size=0, state="bf16"),
        compile_in_background=True,
        probe=FakeMemoryProbe(BIG),
        callback=fail_the_step_in_flight,
    )
    holder.append(controller)
    controller.run(16)
    assert seen and "oom" in [e.kind for e in controller.events]
    policy = controller.policy
    moments = controller.opt_state[0].mu
    assert {controller.policy.state(p) for p in controller.policy} == {"bf16"}
    for path, leaf in jax.tree_util.tree_flatten_with_path(moments)[0]:
        key = tree_lib.path_string(path)
        assert leaf.dtype == dtypes.FORMATS[policy.state(key)].dtype, (key, leaf.dtype)


# -- found by review of the rebuilt controller ------------------------------------------------


def test_set_policy_while_a_replan_compiles_in_the_background_is_not_undone_by_it():
    controller = make_controller(
        compile_in_background=True,
        max_batch=8,
        replan_every=1000,
        precision_rule="memory",  # every leaf the budget allows: the plan moves
        first_replan=2,
        planner=PlannerConfig(min_size=1, budget=1.0),
    )
    controller.run(3)
    assert controller.compile_pending  # the planner's policy compiles in the background
    user = PrecisionPolicy.uniform(controller.params)
    controller.set_policy(user)
    controller.wait_for_compile()
    controller.run(2)
    assert controller.policy == user
    assert "replan" not in [e.kind for e in controller.events]


@pytest.mark.slow
def test_every_event_reaches_a_step_info_also_a_switch_made_at_the_first_dispatch_of_a_run():
    for window in (0, 1):
        controller = make_controller(
            compile_in_background=True,
            max_batch=16,
            batch_size=8,
            steps_in_flight=window,
            batch_rule="memory",
        )
        infos = []
        for _ in range(3):
            infos += controller.run(1)
        controller.wait_for_compile()
        for _ in range(3):
            infos += controller.run(1)
        delivered = [e for info in infos for e in info.events]
        assert any(e.kind == "grow" for e in delivered), window
        # Every event after the controller was made reaches exactly one StepInfo, in order.
        made = next(i for i, e in enumerate(controller.events) if e.step > 0 or e.kind == "grow")
        first = controller.events.index(delivered[0])
        assert delivered == controller.events[min(first, made) :], window


def test_a_background_grow_to_a_bucket_already_compiled_does_not_compile_it_again():
    controller = make_controller(
        compile_in_background=True, max_batch=16, batch_size=8, batch_rule="memory"
    )
    controller.precompile()
    controller.run(3)
    controller.wait_for_compile()
    controller.run(3)
    compiles = [e.new for e in controller.events if e.kind == "compile"]
    assert sorted(compiles) == ["1x16", "1x8"] and controller.micro_batch == 16


def test_no_policy_is_refused_while_precision_is_re_planned():
    controller = make_controller(max_batch=8, replan_every=2)
    with pytest.raises(ValueError, match="replan_every"):
        controller.set_policy(None)
    controller.run(4)  # still plans


@pytest.mark.parametrize(
    ("part", "field", "bad"),
    [
        (None, "compiled_peaks", {"x": {"notint": 1}}),
        ("bucket", "ceiling", "zz"),
        ("learning_rate", "tuned_learning_rate", "abc"),
        ("goodput", "trial", [8]),
        ("precision", "pending", {"w1": "x"}),
        (None, "loss_scale", {"scale": "x", "good_steps": 0, "skipped_steps": 0}),
    ],
)
def test_a_malformed_state_changes_nothing(part, field, bad):
    saved = make_controller(max_batch=16, batch_size=8)
    saved.run(5)
    state = saved.state_dict()
    if part is None:
        state[field] = bad
    else:
        state[part] = {**state[part], field: bad}
    controller = make_controller(max_batch=16, batch_size=8)
    before = (controller.step_count, controller.sampler.state_dict(), controller.state_dict())
    with pytest.raises(ValueError):
        controller.load_state_dict(state)
    after = (controller.step_count, controller.sampler.state_dict(), controller.state_dict())
    assert after == before
