"""The Controller on one device: buckets, OOM recovery, compiles, learning rate, state, bad input."""

from __future__ import annotations

import itertools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from controller_harness import BIG
from controller_harness import NUM_EXAMPLES
from controller_harness import FaultyController
from controller_harness import linear_probe
from controller_harness import loss_fn
from controller_harness import make_controller
from controller_harness import make_data
from controller_harness import make_params

import triaccel_jax
from triaccel_jax import Controller
from triaccel_jax import FakeMemoryProbe
from triaccel_jax.precision import PlannerConfig


def raising(error: BaseException):
    """A fault injector raising ``error`` at every dispatch, where XLA's runtime errors surface."""

    def inject(site):
        if site.where == "dispatch":
            raise error

    return inject


def changes(controller: Controller) -> list[tuple[int, str, int, int]]:
    return [
        (e.step, e.kind, e.old, e.new)
        for e in controller.events
        if e.kind in ("grow", "shrink", "oom", "replan")
    ]


# -- buckets under the fake probe ------------------------------------------------------------------


@pytest.mark.slow
def test_grows_to_the_largest_bucket_that_fits():
    controller = make_controller(batch_rule="memory")
    controller.run(12)
    # peak(b) = 1000 + 100 b under 85% of 20000 -> b <= 160 -> bucket 128 (256 would be 26600).
    assert controller.batch_size == 128
    assert controller.events[-1].kind in ("learning_rate", "update_scale", "compile", "grow")
    assert [c[1] for c in changes(controller)] == ["grow"] * len(changes(controller))


@pytest.mark.slow
def test_shrinks_when_memory_is_taken_away():
    # After 10 readings someone else takes 60% of the device.
    probe = FakeMemoryProbe(
        lambda n: 20_000 if n < 10 else 8_000, peak_bytes=lambda b: 1_000 + 100 * b
    )
    controller = make_controller(probe=probe, batch_rule="memory")
    controller.run(20)
    kinds = [c[1] for c in changes(controller)]
    assert "grow" in kinds and kinds[-1] == "shrink"
    # 1000 + 100 b <= 0.85 * 8000 -> b <= 58 -> 32.
    assert controller.batch_size == 32


@pytest.mark.slow
@pytest.mark.parametrize(
    ("limit", "start"),
    [
        (int((1_000 + 100 * 64) / 0.95), 64),  # the peak at 64 sits on the high-water mark
        (int((1_000 + 100 * 128) / 0.85), 64),  # bucket 128 sits on the growth threshold
    ],
    ids=["high-water", "growth-threshold"],
)
def test_noisy_readings_change_the_bucket_at_most_twice_in_100_checks(limit, start):
    probe = linear_probe(limit=limit, noise=0.05, seed=3)
    controller = make_controller(probe=probe, batch_size=start, max_batch=256, batch_rule="memory")
    controller.run(101)  # a check before every step but the first
    assert probe.readings == 100
    assert len([c for c in changes(controller) if c[1] in ("grow", "shrink")]) <= 2


@pytest.mark.slow
def test_cpu_budget_keeps_the_chosen_bucket_under_the_budget():
    # Budget between the compiled peaks of two buckets: the controller must settle on the
    # largest bucket whose compiled peak is within the budget, and never run a larger one.
    # The memory rule in both: it compiles the plain step (goodput's splits a step in halves).
    probe_controller = make_controller(
        probe=FakeMemoryProbe(BIG), max_batch=256, batch_rule="memory"
    )
    peaks = probe_controller.precompile()
    budget = int(peaks[64] / 0.85) + 1  # 64 fits under the target, 128 does not
    assert peaks[128] > 0.95 * budget
    controller = make_controller(
        probe=triaccel_jax.BudgetMemoryProbe(budget),
        max_batch=256,
        patience=1,
        batch_rule="memory",
    )
    # Every bucket compiled ahead, so the decision reads compiled peaks, not a one-point
    # extrapolation: the curvature refresh's batch-independent temporaries (the flat buffers of
    # a model this small are most of its peak) make one point overestimate the per-sample bytes.
    controller.precompile()
    infos = controller.run(10)
    assert controller.batch_size == 64
    for info in infos:
        assert peaks[info.micro_batch] <= budget


@pytest.mark.slow
def test_decisions_are_logged_with_their_figures():
    controller = make_controller(batch_rule="memory")
    controller.run(6)
    grow = next(e for e in controller.events if e.kind == "grow")
    assert grow.figures["limit_bytes"] == 20_000 and grow.figures["peak_bytes"] > 0
    assert "predicted" in grow.reason
    records = controller.event_records()
    assert {"step", "kind", "old", "new", "reason"} <= set(records[0])
    assert any("figure_limit_bytes" in r for r in records)


# -- out of memory -------------------------------------------------------------------------------


@pytest.mark.slow
def test_out_of_memory_loses_no_sample_and_training_continues():
    faults = {3: 1, 40: 2, 90: 1}  # at step 40 the retry runs out of memory too
    controller = make_controller(FaultyController, faults=faults, patience=1, batch_rule="memory")
    infos = controller.run(120)
    assert all(np.isfinite(i.loss) for i in infos)
    seen = np.concatenate(controller.seen)
    sampler = controller.sampler
    served = np.concatenate([sampler.order(e) for e in range(sampler.epoch + 1)])
    # Exactly the sampler's stream, in order: nothing lost, nothing repeated.
    np.testing.assert_array_equal(seen, served[: len(seen)])
    assert len(seen) == sampler.samples_seen
    assert len(seen) > 2 * NUM_EXAMPLES  # several epochs, with different batch sizes
    # StepInfo counts the samples each step trained, retried steps included.
    assert sum(i.batch_size for i in infos) == sampler.samples_seen
    ooms = [(e.step, e.old, e.new) for e in controller.events if e.kind == "oom"]
    assert [step for step, _, _ in ooms] == [3, 40, 40, 90]
    for step, old, new in ooms:
        assert new == old // 2
        # An OOMed bucket is a ceiling: never run again.
        assert all(i.micro_batch < old for i in infos[step:])


@pytest.mark.slow
def test_out_of_memory_at_the_smallest_bucket_says_what_was_tried():
    controller = make_controller(FaultyController, faults={0: 3}, batch_size=32)
    with pytest.raises(triaccel_jax.OutOfMemoryError, match=r"1x32, 2x16, 4x8") as info:
        controller.step()
    assert "smallest batch bucket 8" in str(info.value)
    assert controller.step_count == 0


def test_an_error_that_is_not_out_of_memory_propagates_unchanged():
    controller = make_controller(
        faults=raising(jax.errors.JaxRuntimeError("INTERNAL: something else broke"))
    )
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
        controller.step()
    assert not [e for e in controller.events if e.kind == "oom"]


@pytest.mark.slow
def test_keep_global_batch_makes_an_oom_retry_the_same_update():
    common = dict(
        keep_global_batch=True, global_batch=64, batch_size=64, probe=FakeMemoryProbe(BIG)
    )
    clean = make_controller(**common)
    clean.run(30)
    faulty = make_controller(FaultyController, faults={5: 1}, **common)
    infos = faulty.run(30)
    assert [i.micro_batch for i in infos[4:7]] == [64, 32, 32]
    assert {i.batch_size for i in infos} == {64}  # the optimisation is unchanged
    # Accumulating 2 x 32 instead of 1 x 64 reorders float sums only: measured max relative
    # difference 7e-6 (absolute 6e-8) after 30 steps; asserted at rtol 1e-4.
    for a, b in zip(jax.tree.leaves(clean.params), jax.tree.leaves(faulty.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_accumulated_micro_batches_give_the_big_batch_gradient():
    from triaccel_jax import training as train_step
    from triaccel_jax.transforms._loss_scaling import LossScaling

    data = make_data(64)
    params = make_params()
    normalized = train_step.normalize_loss_fn(loss_fn, has_aux=False, has_model_state=False)
    tx = optax.sgd(1.0)
    args = (params, tx.init(params), None)
    one = train_step.make_train_step(normalized, tx, policy=None, num_micro=1, seed=0)
    four = train_step.make_train_step(normalized, tx, policy=None, num_micro=4, seed=0)
    as_one = jax.tree.map(lambda x: x.reshape(1, 64, *x.shape[1:]), data)
    as_four = jax.tree.map(lambda x: x.reshape(4, 16, *x.shape[1:]), data)
    scale = LossScaling().init()
    a = jax.jit(one)(*args, as_one, 0, 1.0, scale)
    b = jax.jit(four)(*args, as_four, 0, 1.0, scale)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.metrics["loss"], b.metrics["loss"], rtol=1e-5)


# -- compiles and learning rate ----------------------------------------------------------------


@pytest.mark.slow
def test_one_compile_per_distinct_bucket_and_policy(count_compiles):
    faults = {8: 1}
    with count_compiles():
        controller = make_controller(
            FaultyController,
            faults=faults,
            replan_every=5,
            precision_rule="memory",  # every leaf the budget allows: the plan moves
            planner=PlannerConfig(budget=float("inf"), min_size=0),
            patience=1,
            batch_rule="memory",  # grows at once, so that step 8's error has a bucket below
        )
        controller.run(25)
    visited = {(e.new, e.figures["policy"]) for e in controller.events if e.kind == "compile"}
    replans = [e for e in controller.events if e.kind == "replan"]
    assert replans, "the planner should have moved a leaf to bf16"
    assert (
        controller.compile_count
        == len(visited)
        == len([e for e in controller.events if e.kind == "compile"])
    )
    assert count_compiles.of("controller_step") == controller.compile_count


@pytest.mark.slow
def test_learning_rate_scaling_goes_through_inject_hyperparams_without_recompiling(
    count_compiles,
):
    tx = optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=1e-2)
    controller = make_controller(tx=tx, lr_scaling="sqrt", reference_batch=8, batch_rule="memory")
    with count_compiles():
        infos = controller.run(8)
    assert controller.batch_size == 128
    lr = float(optax.tree_utils.tree_get(controller.opt_state, "learning_rate"))
    assert lr == pytest.approx(1e-2 * np.sqrt(128 / 8), rel=1e-6)
    # Compiles: one step per bucket visited; none for the learning-rate changes.
    assert count_compiles.of("controller_step") == len({i.micro_batch for i in infos})
    changes = [e for e in controller.events if e.kind == "learning_rate"]
    assert changes[-1].figures["factor"] == pytest.approx(4.0)
    assert changes[-1].new == pytest.approx(lr, rel=1e-6)


def test_learning_rate_events_give_the_rate_itself_and_the_first_says_the_rule():
    tx = optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=1e-2)
    controller = make_controller(tx=tx, lr_scaling="sqrt", reference_batch=8, batch_rule="memory")
    start = controller.events[0]
    assert start.kind == "start"
    assert "learning rate 0.01, tuned at the reference batch 8, scaled by the sqrt rule" in (
        start.reason
    )
    assert start.figures["lr_rule"] == "sqrt" and start.figures["reference_batch"] == 8
    assert start.figures["tuned_learning_rate"] == pytest.approx(1e-2)
    controller.run(4)
    changes = [e for e in controller.events if e.kind == "learning_rate"]
    assert changes
    previous = 1e-2
    for event in changes:
        batch = event.figures["batch"]
        assert event.old == pytest.approx(previous)
        assert event.new == pytest.approx(1e-2 * np.sqrt(batch / 8), rel=1e-6)
        assert event.figures["factor"] == pytest.approx(np.sqrt(batch / 8))
        previous = event.new


def test_a_rate_the_controller_cannot_write_is_reported_as_an_update_scale():
    schedule = optax.linear_schedule(1e-2, 1e-3, 100)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    controller = make_controller(tx=tx, reference_batch=8, lr_scaling="linear", batch_rule="memory")
    assert "the update is multiplied by (batch / 8)" in controller.events[0].reason
    controller.run(3)
    scales = [e for e in controller.events if e.kind == "update_scale"]
    assert scales and not [e for e in controller.events if e.kind == "learning_rate"]
    assert scales[-1].new == pytest.approx(controller.batch_size / 8)


# -- the loss function's forms -----------------------------------------------------------------


def optax_style_loss(params, batch):
    # The inputs in the params' dtype, as a model under a bf16 policy computes.
    hidden = jnp.tanh(batch["x"].astype(params["w1"].dtype) @ params["w1"])
    return jnp.mean(
        ((hidden.astype(params["w2"].dtype) @ params["w2"]).astype(jnp.float32) - batch["y"]) ** 2
    )


@pytest.mark.slow
@pytest.mark.parametrize("replan_every", [None, 2])
def test_an_optax_style_loss_trains_and_gets_the_compute_copy(replan_every):
    controller = make_controller(
        loss_fn=optax_style_loss, replan_every=replan_every, max_batch=16, batch_size=16
    )
    reference = make_controller(max_batch=16, batch_size=16, replan_every=replan_every)
    if replan_every is not None:
        # A bf16 policy: the optax-style loss must see bf16 params, as a policy-aware loss would.
        policy = triaccel_jax.PrecisionPolicy.uniform(controller.params, "bf16")
        controller.set_policy(policy)

        def policy_loss(params, batch, *, policy, rng):
            return optax_style_loss(triaccel_jax.cast_params(params, policy), batch)

        reference = make_controller(
            loss_fn=policy_loss, max_batch=16, batch_size=16, replan_every=replan_every
        )
        reference.set_policy(policy)
    infos = controller.run(4)
    expected = reference.run(4)
    assert [i.loss for i in infos] == pytest.approx([i.loss for i in expected], rel=1e-6)


@pytest.mark.parametrize(
    ("loss", "problem"),
    [
        (lambda params: 0.0, r"1 positional argument"),
        (lambda params, batch, *, weights: 0.0, r"requires 'weights'"),
        (lambda params, batch, scale: 0.0, r"requires 'scale'"),
    ],
)
def test_a_loss_of_another_form_fails_at_construction_listing_the_accepted_forms(loss, problem):
    with pytest.raises(TypeError, match=problem) as error:
        make_controller(loss_fn=loss)
    message = str(error.value)
    assert "loss_fn(params, batch)  (optax's form)" in message
    assert "loss_fn(params, batch, *, policy, rng)" in message


def test_a_loss_without_model_state_is_refused_when_the_controller_holds_one():
    with pytest.raises(TypeError, match=r"holds a model_state, and it takes no model_state="):
        make_controller(loss_fn=optax_style_loss, model_state={"count": jnp.zeros(())})


def test_keyword_forms_get_only_what_they_take():
    seen = []

    def rng_only(params, batch, *, rng):
        seen.append(rng)
        return optax_style_loss(params, batch)

    def everything(params, batch, **kwargs):
        seen.append(sorted(kwargs))
        return optax_style_loss(params, batch)

    make_controller(loss_fn=rng_only).run(1)
    assert seen and all(isinstance(x, jax.Array) for x in seen)
    seen.clear()
    make_controller(loss_fn=everything).run(1)
    assert seen and all(x == ["policy", "rng"] for x in seen)


def test_learning_rate_scaling_without_injection_scales_the_update():
    # At batch 16 against reference 8 with linear scaling, one SGD step moves twice as far.
    data = make_data()
    first = {k: v[:16] for k, v in data.items()}
    params = make_params()
    controller = Controller(
        loss_fn,
        params,
        optax.sgd(0.1),
        data,
        min_batch=16,
        max_batch=16,
        reference_batch=8,
        lr_scaling="linear",
        probe=FakeMemoryProbe(BIG),
        seed=0,
    )
    indices = controller.sampler.order(0)[:16]
    controller.step()
    batch = {k: v[indices] for k, v in data.items()}
    del first
    grads = jax.grad(lambda p: loss_fn(p, batch, policy=None, rng=None))(params)
    expected = jax.tree.map(lambda p, g: p - 0.2 * g, params, grads)
    for a, b in zip(jax.tree.leaves(controller.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_scheduled_learning_rate_is_left_to_its_schedule_and_the_update_scaled():
    schedule = optax.linear_schedule(1e-2, 1e-3, 100)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    controller = make_controller(
        tx=tx, reference_batch=8, lr_scaling="linear", patience=1, batch_rule="memory"
    )
    before = controller.params
    indices = controller.sampler.order(0)
    controller.run(2)  # step 0 at batch 8; the check before step 1 grows the bucket
    assert controller.batch_size > 8
    factor = controller.batch_size / 8
    data = make_data()
    batch = {k: v[indices[8 : 8 + controller.batch_size]] for k, v in data.items()}
    del before
    # Replay: the params after step 0, then one SGD step at schedule(1) * factor.
    replay = make_controller(
        tx=optax.sgd(schedule(0)),
        probe=FakeMemoryProbe(BIG),
        lr_scaling="none",
        batch_rule="memory",
    )
    replay.run(1)
    grads = jax.grad(lambda p: loss_fn(p, batch, policy=None, rng=None))(replay.params)
    expected = jax.tree.map(lambda p, g: p - schedule(1) * factor * g, replay.params, grads)
    for a, b in zip(jax.tree.leaves(controller.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert float(optax.tree_utils.tree_get(controller.opt_state.hyperparams, "learning_rate")) == (
        pytest.approx(float(schedule(1)))
    )


@pytest.mark.slow
def test_keep_global_batch_holds_the_effective_batch_constant():
    controller = make_controller(keep_global_batch=True, global_batch=256, batch_size=8)
    infos = controller.run(6)
    assert [i.batch_size for i in infos] == [256] * 6
    assert infos[0].micro_batch == 8 and infos[-1].micro_batch == 128
    assert controller.sampler.samples_seen == 6 * 256
    assert not [e for e in controller.events if e.kind == "learning_rate"]


# -- precision, model state, callback -------------------------------------------------------------


@pytest.mark.slow
def test_replanning_converts_the_state_and_passes_the_policy_to_the_loss():
    seen_policies = []

    def recording_loss(params, batch, *, policy, rng):
        seen_policies.append(policy)
        cast = triaccel_jax.cast_params(params, policy)
        hidden = jnp.tanh(batch["x"] @ cast["w1"].astype(jnp.float32))
        return jnp.mean((hidden @ cast["w2"].astype(jnp.float32) - batch["y"]) ** 2)

    controller = make_controller(
        loss_fn=recording_loss,
        replan_every=3,
        precision_rule="memory",  # every leaf the budget allows: the plan moves
        planner=PlannerConfig(budget=float("inf"), min_size=0),
        probe=FakeMemoryProbe(BIG),
    )
    controller.run(10)
    assert controller.policy.compute("w1") == "bf16"
    assert any(p is not None and p.compute("w1") == "bf16" for p in seen_policies)
    signals = triaccel_jax.signals(controller.opt_state)
    assert signals["w1"]["state_dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("batch_rule", "calls"),
    # The default (goodput) measures the noise scale on half of a step's one micro-batch beside
    # the step itself: the model state is updated once, by the whole micro-batch, either way.
    [("memory", [1, 1, 2]), ("goodput", [1, 1, 2])],
)
def test_model_state_flows_through_micro_batches_and_aux_metrics_are_averaged(batch_rule, calls):
    def counting_loss(params, batch, *, policy, rng, model_state):
        loss = loss_fn(params, batch, policy=policy, rng=rng)
        return loss, {
            "model_state": model_state + 1,
            "mean_id": jnp.mean(batch["id"].astype(jnp.float32)),
        }

    controller = make_controller(
        FaultyController,
        faults={2: 1},
        loss_fn=counting_loss,
        has_aux=True,
        model_state=jnp.int32(0),
        batch_size=32,
        probe=FakeMemoryProbe(BIG),
        check_every=100,
        batch_rule=batch_rule,
    )
    states = [int(controller.model_state)]
    infos = []
    for _ in range(3):
        infos.append(controller.step())
        states.append(int(controller.model_state))
    # Steps 0 and 1: one micro-batch each; step 2 retried as 2 x 16 after the fault.
    assert [b - a for a, b in itertools.pairwise(states)] == calls
    assert infos[2].micro_batch == 16
    ids = controller.sampler.order(0)[64:96]
    assert infos[2].metrics["mean_id"] == pytest.approx(ids.mean(), rel=1e-6)


def test_hutchinson_gets_the_loss_as_an_extra_argument():
    tx = triaccel_jax.triaccel(
        1e-2, config=triaccel_jax.TriAccelConfig(estimator="hutchinson"), curvature_every=1
    )
    controller = make_controller(tx=tx, probe=FakeMemoryProbe(BIG))
    controller.run(3)
    signals = triaccel_jax.signals(controller.opt_state)
    # Hutchinson without the loss raises; with it, the estimates are non-zero.
    assert all(s["max_curvature"] > 0 and s["trace"] != 0 for s in signals.values())


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["masked", "multi_transform"])
def test_hutchinson_under_optax_masked_trains_through_the_controller(wrapper):
    # optax hands the inner transform its own leaves only (MaskedNode for the others): the
    # controller's loss must still take them, and the estimate is the Hessian diagonal of the
    # loss of the whole params on the trained leaves.
    hutchinson = triaccel_jax.triaccel(
        1e-2, config=triaccel_jax.TriAccelConfig(estimator="hutchinson"), curvature_every=1
    )
    if wrapper == "masked":
        tx = optax.chain(
            optax.masked(hutchinson, {"w1": True, "w2": False}),
            optax.masked(optax.sgd(1e-2), {"w1": False, "w2": True}),
        )
    else:
        tx = optax.multi_transform(
            {"curvature": hutchinson, "plain": optax.sgd(1e-2)}, {"w1": "curvature", "w2": "plain"}
        )
    controller = make_controller(
        tx=tx, min_batch=32, max_batch=32, batch_rule="memory", probe=FakeMemoryProbe(BIG)
    )
    infos = controller.run(3)

    # The same steps by hand, the loss given over the whole params.
    data = make_data()
    params, state = make_params(), tx.init(make_params())
    for info in infos:
        batch = {k: v[info.indices] for k, v in data.items()}

        def loss_of(p, batch=batch):
            return loss_fn(p, batch, policy=None, rng=None)

        grads = jax.grad(loss_of)(params)
        whole = params
        updates, state = tx.update(
            grads,
            state,
            params,
            loss_fn=lambda p, whole=whole, loss_of=loss_of: loss_of(
                triaccel_jax.transforms.unmask(p, whole)
            ),
        )
        params = optax.apply_updates(params, updates)
    chex.assert_trees_all_close(controller.params, params, rtol=1e-5, atol=1e-6)
    signals = triaccel_jax.signals(controller.opt_state)
    assert set(signals) == {"w1"} and signals["w1"]["max_curvature"] > 0


def test_callback_gets_every_step():
    infos = []
    controller = make_controller(callback=infos.append)
    returned = controller.run(4)
    assert infos == returned and [i.step for i in infos] == [1, 2, 3, 4]
    assert all(i.limit_bytes == 20_000 for i in infos[1:])


def test_data_as_a_callable_with_num_examples():
    data = make_data()
    calls = []

    def fetch(indices):
        calls.append(len(indices))
        return {k: v[indices] for k, v in data.items()}

    controller = Controller(
        loss_fn,
        make_params(),
        triaccel_jax.triaccel(1e-2),
        fetch,
        num_examples=NUM_EXAMPLES,
        min_batch=16,
        max_batch=16,
        probe=FakeMemoryProbe(BIG),
    )
    controller.run(2)
    assert calls[-2:] == [16, 16]


# -- state ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_state_round_trip_gives_the_same_next_decisions_and_losses():
    def probe():
        return FakeMemoryProbe(
            lambda n: 20_000 if n < 12 else 9_000, peak_bytes=lambda b: 1_000 + 100 * b
        )

    # The memory rule: goodput's decisions follow measured step times, which a resumed run
    # measures again (throughput is not saved), so only memory's are repeated step for step.
    kwargs = dict(
        replan_every=4,
        precision_rule="memory",  # every leaf the budget allows: the plan moves
        planner=PlannerConfig(budget=float("inf"), min_size=0),
        batch_rule="memory",
    )
    reference = make_controller(probe=probe(), **kwargs)
    reference.run(8)
    saved = json.loads(json.dumps(reference.state_dict()))
    params, opt_state = reference.params, reference.opt_state
    readings = reference.probe.readings
    expected = reference.run(20)

    resumed_probe = probe()
    resumed_probe.readings = readings
    resumed = make_controller(probe=resumed_probe, **kwargs)
    resumed.restore({"params": params, "opt_state": opt_state, "model_state": None}, saved)
    got = resumed.run(20)
    assert [i.loss for i in got] == [i.loss for i in expected]
    assert [(i.batch_size, i.micro_batch) for i in got] == [
        (i.batch_size, i.micro_batch) for i in expected
    ]
    decisions = lambda c: [x for x in changes(c) if x[0] >= 8]
    assert decisions(resumed) == decisions(reference) and decisions(reference)
    assert resumed.policy == reference.policy


def test_load_state_dict_rejects_foreign_states():
    controller = make_controller()
    state = controller.state_dict()
    with pytest.raises(ValueError, match="not a controller state"):
        controller.load_state_dict({"format": "pickle"})
    with pytest.raises(ValueError, match="seed"):
        make_controller(seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="buckets"):
        make_controller(max_batch=64).load_state_dict(state)


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"min_batch": 64, "max_batch": 16}, ValueError, "min_batch.*max_batch"),
        ({"min_batch": 0}, ValueError, "min_batch"),
        ({"max_batch": -8}, ValueError, "max_batch"),
        ({"target": 0.0}, ValueError, "target"),
        ({"target": 1.0}, ValueError, "target"),
        ({"target": 1.5}, ValueError, "target"),
        ({"high_water": 0.5}, ValueError, "high_water"),
        ({"patience": 0}, ValueError, "patience"),
        ({"check_every": 0}, ValueError, "check_every"),
        ({"replan_every": 0}, ValueError, "replan_every"),
        ({"batch_size": 24}, ValueError, "batch_size.*buckets"),
        ({"lr_scaling": "cubic"}, ValueError, "lr_scaling"),
        ({"reference_batch": 0}, ValueError, "reference_batch"),
        ({"global_batch": 64}, ValueError, "keep_global_batch"),
        ({"keep_global_batch": True, "global_batch": 20}, ValueError, "global_batch"),
        ({"probe": object()}, TypeError, "probe"),
        ({"callback": 3}, TypeError, "callback"),
        ({"tx": "adam"}, TypeError, "tx"),
        ({"replan_every": 5, "tx": optax.adam(1e-3)}, ValueError, "no triaccel state"),
    ],
)
def test_bad_configuration_is_rejected(overrides, error, message):
    with pytest.raises(error, match=message):
        make_controller(**overrides)


@pytest.mark.parametrize(
    ("bad_loss", "has_aux", "message"),
    [
        (lambda p, b, **_: (loss_fn(p, b, **_), 1.0), False, "tuple of 2.*has_aux=True"),
        (lambda p, b, **_: loss_fn(p, b, **_), True, r"must return \(loss, aux\)"),
        (lambda p, b, **_: (loss_fn(p, b, **_), [1.0]), True, "aux must be a dict"),
        (lambda p, b, **_: b["x"] @ p["w1"], False, "scalar float loss"),
        (
            lambda p, b, **_: (loss_fn(p, b, **_), {"m": b["x"]}),
            True,
            "metric 'm' must be a scalar",
        ),
    ],
)
def test_a_loss_with_the_wrong_structure_is_rejected(bad_loss, has_aux, message):
    with pytest.raises(TypeError, match=message):
        make_controller(loss_fn=bad_loss, has_aux=has_aux)


def test_bad_data_is_rejected():
    params, tx = make_params(), triaccel_jax.triaccel(1e-2)
    with pytest.raises(ValueError, match="leading"):
        Controller(loss_fn, params, tx, {"x": np.zeros((10, 8)), "y": np.zeros(9)})
    with pytest.raises(ValueError, match="num_examples"):
        Controller(loss_fn, params, tx, lambda idx: None)
    with pytest.raises(ValueError, match="no arrays"):
        Controller(loss_fn, params, tx, {})


@pytest.mark.slow
def test_the_first_replan_moves_leaves_at_once_and_first_replan_sets_when():
    options = {
        "planner": PlannerConfig(budget=float("inf"), min_size=0),
        "max_batch": 8,
        "precision_rule": "memory",  # every leaf the budget allows: the plan moves
    }
    default = make_controller(replan_every=5, **options)
    default.run(12)
    # The first plan is made without hysteresis (there is no earlier plan to flip back to):
    # the policy changes at step 5, not after a second agreeing plan at step 10.
    assert [e.step for e in default.events if e.kind == "replan"] == [5]
    early = make_controller(replan_every=5, first_replan=2, **options)
    early.run(12)
    assert [e.step for e in early.events if e.kind == "replan"] == [2]
    assert early.policy == default.policy
    with pytest.raises(ValueError, match="first_replan"):
        make_controller(replan_every=None, first_replan=2)  # precision is not planned


@pytest.mark.slow
@pytest.mark.parametrize("replan_every", [None, 5])
def test_set_policy_converts_the_moments_whether_or_not_precision_is_replanned(replan_every):
    # set_policy's docstring promises converted moments; it held only with replan_every set.
    controller = make_controller(replan_every=replan_every, max_batch=8)
    policy = triaccel_jax.PrecisionPolicy.uniform(controller.params, "bf16", "bf16")
    controller.set_policy(policy)
    moments = controller.opt_state[0].mu
    assert {str(m.dtype) for m in jax.tree.leaves(moments)} == {"bfloat16"}
    controller.run(3)
    assert {str(m.dtype) for m in jax.tree.leaves(controller.opt_state[0].mu)} == {"bfloat16"}


@pytest.mark.slow
def test_resuming_with_opt_state_and_load_state_dict_does_not_compound_the_rate():
    # The documented recipe: a new controller given the step's params and opt_state= (which
    # holds the batch-scaled rate), then load_state_dict. The tuned rate comes from the record.
    tx = optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=1e-2)
    options = dict(
        lr_scaling="sqrt", reference_batch=8, probe=FakeMemoryProbe(BIG), batch_rule="memory"
    )
    reference = make_controller(tx=tx, **options)
    reference.run(4)
    assert reference.batch_size > 8  # the rate is scaled
    saved = json.loads(json.dumps(reference.state_dict()))
    params, opt_state = reference.params, reference.opt_state
    rate = float(optax.tree_utils.tree_get(opt_state, "learning_rate"))
    expected = reference.run(3)

    resumed = make_controller(tx=tx, params=params, opt_state=opt_state, **options)
    resumed.load_state_dict(saved)
    assert float(optax.tree_utils.tree_get(resumed.opt_state, "learning_rate")) == (
        pytest.approx(rate)
    )
    got = resumed.run(3)
    assert [i.loss for i in got] == pytest.approx([i.loss for i in expected], rel=1e-6)


def test_a_train_state_resumed_with_load_state_dict_counts_its_steps_once():
    from flax.training import train_state

    from triaccel_jax.flax import from_train_state
    from triaccel_jax.flax import to_train_state

    tx = triaccel_jax.triaccel(1e-2)
    reference = make_controller(tx=tx, max_batch=8)
    reference.run(12)
    state = train_state.TrainState(
        step=12,
        apply_fn=None,
        params=reference.params,
        tx=tx,
        opt_state=reference.opt_state,
    )
    resumed = from_train_state(
        loss_fn, state, make_data(), min_batch=8, max_batch=8, probe=FakeMemoryProbe(BIG)
    )
    assert resumed.step_count == 12  # the controller counts on from the state's step
    resumed.load_state_dict(reference.state_dict())
    assert int(to_train_state(resumed, state).step) == 12
    resumed.run(3)
    assert int(to_train_state(resumed, state).step) == resumed.step_count == 15
