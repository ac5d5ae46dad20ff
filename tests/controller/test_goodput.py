"""Goodput through the controller: the gradient noise scale from the step's two squared norms,
efficiency, and the batch it moves to."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from controller_harness import VirtualClock
from controller_harness import linear_probe
from controller_harness import make_controller
from controller_harness import slower_per_sample
from controller_harness import take_time

import triaccel_jax
from triaccel_jax import training
from triaccel_jax.controller import ControllerConfig
from triaccel_jax.controller._goodput import efficiency
from triaccel_jax.controller._goodput_tracker import GoodputTracker
from triaccel_jax.controller._noise_scale import NoiseScaleEstimate
from triaccel_jax.controller._noise_scale import observe_noise
from triaccel_jax.transforms import LossScaling


def test_the_noise_scale_recovers_a_known_gradient_distribution():
    # Per-sample gradients g_i = G + noise with covariance Sigma: B_simple = tr(Sigma) / |G|^2.
    rng = np.random.default_rng(0)
    dim, batch, micro = 20, 64, 8
    mean = rng.normal(size=dim)
    scales = rng.uniform(0.5, 3.0, size=dim)
    expected = float(np.sum(scales**2) / np.sum(mean**2))
    state = NoiseScaleEstimate()
    for _ in range(2000):
        samples = mean + scales * rng.normal(size=(batch, dim))
        micro_means = samples.reshape(batch // micro, micro, dim).mean(axis=1)
        state = observe_noise(
            state,
            grad_sq_norm=float(np.sum(samples.mean(axis=0) ** 2)),
            sub_grad_sq_norm=float(np.mean(np.sum(micro_means**2, axis=1))),
            batch=batch,
            sub_batch=micro,
            horizon=100 * batch,
        )
    assert state.simple == pytest.approx(expected, rel=0.1)
    low, high = state.interval()
    assert low < state.simple < high


def test_an_all_noise_gradient_has_an_infinite_noise_scale_and_full_efficiency():
    # |g_B|^2 = tr/B and |g_b|^2 = tr/b exactly: |G|^2 = 0.
    state = observe_noise(
        NoiseScaleEstimate(),
        grad_sq_norm=1.0,
        sub_grad_sq_norm=4.0,
        batch=32,
        sub_batch=8,
        horizon=1000,
    )
    assert state.simple == math.inf and efficiency(1024, state.simple, 8) == 1.0


def test_efficiency_halves_at_the_noise_scale_and_is_one_at_the_reference():
    assert efficiency(8, 100.0, 8) == 1.0
    assert efficiency(100, 100.0, 0) == pytest.approx(0.5)
    assert efficiency(16, 100.0, 8) > efficiency(32, 100.0, 8) > efficiency(64, 100.0, 8)


def test_the_training_steps_norms_give_the_noise_scale_of_linear_regression():
    # Least squares at a fixed w: per-sample gradient 2 (x.w - y) x; its mean and covariance are
    # computed exactly over the data set, and sampling without replacement from it is close to
    # the i.i.d. model for a batch far below the data set's size.
    rng = np.random.default_rng(1)
    n, dim, batch, num_micro = 8192, 6, 64, 4
    x = rng.normal(size=(n, dim)).astype(np.float32)
    y = (x @ rng.normal(size=dim) + rng.normal(size=n)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=dim) * 0.3, jnp.float32)
    per_sample = 2.0 * ((x @ np.asarray(w)) - y)[:, None] * x
    expected = float(np.sum(per_sample.var(axis=0)) / np.sum(per_sample.mean(axis=0) ** 2))

    def loss(params, batch):
        inputs, targets = batch
        return jnp.mean((inputs @ params - targets) ** 2)

    normalized = training.normalize_loss_fn(loss, has_aux=False, has_model_state=False)
    tx = optax.sgd(0.0)  # the params stay at w: every step measures the same distribution
    step = jax.jit(
        training.make_train_step(normalized, tx, policy=None, num_micro=num_micro, seed=0)
    )
    opt_state, loss_scale = tx.init(w), LossScaling().init()
    state = NoiseScaleEstimate()
    micro = batch // num_micro
    for i in range(600):
        rows = rng.choice(n, size=batch, replace=False)
        data = (x[rows].reshape(num_micro, micro, dim), y[rows].reshape(num_micro, micro))
        out = step(w, opt_state, None, data, np.int32(i), np.float32(1.0), loss_scale)
        state = observe_noise(
            state,
            grad_sq_norm=float(out.metrics["grad_sq_norm"]),
            sub_grad_sq_norm=float(out.metrics["micro_grad_sq_norm"]),
            batch=batch,
            sub_batch=micro,
            horizon=100 * batch,
        )
    assert state.simple == pytest.approx(expected, rel=0.25)


def test_the_controller_measures_the_noise_scale_and_throughput_and_saves_them():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(512, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + rng.normal(size=512)).astype(np.float32)

    def loss(params, batch):
        inputs, targets = batch
        return jnp.mean((inputs @ params - targets) ** 2)

    def make(params):
        return triaccel_jax.Controller(
            loss,
            params,
            optax.sgd(0.01),
            (x, y),
            min_batch=16,
            max_batch=64,
            keep_global_batch=True,
            global_batch=64,
            batch_size=16,  # 4 micro-batches of 16 per step of 64
            check_every=1000,
            probe=triaccel_jax.FakeMemoryProbe(10**12),
        )

    controller = make(jnp.zeros(4))
    infos = controller.run(30)
    assert all(info.noise_scale is not None for info in infos)
    assert controller.noise_scale == infos[-1].noise_scale > 0
    (key,) = controller.throughput
    assert key[:2] == (16, 4) and controller.throughput[key] > 0
    resumed = make(controller.params)  # sgd: the params are the whole training state
    resumed.load_state_dict(json.loads(json.dumps(controller.state_dict())))
    assert resumed.noise_scale == controller.noise_scale
    assert resumed.throughput == controller.throughput  # the sums are saved
    # The next step's estimate continues from the saved one in both.
    assert resumed.step().noise_scale == controller.step().noise_scale


def test_a_split_step_updates_as_the_whole_batch_and_measures_its_halves():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 32, 5)).astype(np.float32)
    y = rng.normal(size=(1, 32)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=5), jnp.float32)

    def loss(params, batch):
        inputs, targets = batch
        return jnp.mean((inputs @ params - targets) ** 2)

    normalized = training.normalize_loss_fn(loss, has_aux=False, has_model_state=False)
    tx = optax.sgd(0.1)
    outs = {}
    for split in (False, True):
        step = training.make_train_step(
            normalized, tx, policy=None, num_micro=1, seed=0, split=split
        )
        outs[split] = jax.jit(step)(
            w, tx.init(w), None, (x, y), np.int32(0), np.float32(1.0), LossScaling().init()
        )
    np.testing.assert_allclose(outs[True].params, outs[False].params, rtol=1e-6)
    whole = jax.grad(loss)(w, (x[0], y[0]))
    # The halves are the even-numbered samples and the odd-numbered ones.
    halves = [jax.grad(loss)(w, (x[0, i::2], y[0, i::2])) for i in (0, 1)]
    metrics = outs[True].metrics
    assert float(metrics["grad_sq_norm"]) == pytest.approx(float(jnp.sum(whole**2)), rel=1e-5)
    expected = np.mean([float(jnp.sum(h**2)) for h in halves])
    assert float(metrics["micro_grad_sq_norm"]) == pytest.approx(expected, rel=1e-5)
    assert outs[False].metrics["micro_grad_sq_norm"] == outs[False].metrics["grad_sq_norm"]
    with pytest.raises(ValueError, match="even number of samples on every shard, got 31 samples"):
        jax.jit(step)(
            w,
            tx.init(w),
            None,
            (x[:, :31], y[:, :31]),
            np.int32(0),
            np.float32(1.0),
            LossScaling().init(),
        )


def test_measure_noise_scale_splits_even_micro_batches_and_runs_odd_ones_whole():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(256, 3)).astype(np.float32)
    y = (x @ np.array([1.0, 2.0, -1.0], np.float32) + rng.normal(size=256)).astype(np.float32)

    def loss(params, batch):
        inputs, targets = batch
        return jnp.mean((inputs @ params - targets) ** 2)

    def make(**settings):
        return triaccel_jax.Controller(
            loss,
            jnp.zeros(3),
            optax.sgd(0.05),
            (x, y),
            probe=triaccel_jax.FakeMemoryProbe(10**12),
            check_every=1000,
            **settings,
        )

    # The memory rule measures nothing from a step of one micro-batch unless asked to.
    plain = make(min_batch=32, max_batch=32, batch_rule="memory")
    measured = make(min_batch=32, max_batch=32, batch_rule="memory", measure_noise_scale=True)
    default = make(min_batch=32, max_batch=32)  # goodput measures the noise scale every step
    plain_infos, measured_infos = plain.run(20), measured.run(20)
    default_infos = default.run(20)
    assert all(i.noise_scale is None for i in plain_infos)
    assert all(i.noise_scale is not None for i in measured_infos)
    assert [i.noise_scale for i in default_infos] == [i.noise_scale for i in measured_infos]
    assert measured.noise_scale is not None and measured.noise_scale > 0
    # The same updates: the halves' mean is the batch mean.
    np.testing.assert_allclose(measured.params, plain.params, rtol=1e-5)
    np.testing.assert_allclose(default.params, plain.params, rtol=1e-5)
    # An odd micro-batch cannot be halved: it is not refused, it runs whole, without an
    # estimate, and trains as the memory rule's plain step does; an even one splits.
    for settings in (dict(measure_noise_scale=True, batch_rule="memory"), dict()):
        odd = make(min_batch=1, max_batch=4, batch_size=1, **settings)
        odd_plain = make(min_batch=1, max_batch=4, batch_size=1, batch_rule="memory")
        assert odd.buckets == (1, 2, 4)
        odd_infos = odd.run(10)
        odd_plain.run(10)
        assert [i.micro_batch for i in odd_infos] == [1] * 10
        assert all(i.noise_scale is None for i in odd_infos) and odd.noise_scale is None
        np.testing.assert_allclose(odd.params, odd_plain.params, rtol=1e-6)
        even = make(min_batch=1, max_batch=4, batch_size=2, **settings)
        assert all(i.noise_scale is not None for i in even.run(10))


BUCKETS = (16, 32, 64, 128, 256)


def noisy_regression(target_noise, *, seed=5, seconds_per_sample=0.0, clock=None):
    """Linear regression data ``(x, y)`` with noisy targets and its loss; with
    ``seconds_per_sample`` each step takes time in proportion to its samples, on ``clock`` (a
    :class:`VirtualClock`) or in a real sleep without one."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(4096, 8)).astype(np.float32)
    y = (x @ rng.normal(size=8) + target_noise * rng.normal(size=4096)).astype(np.float32)

    def loss(params, batch):
        inputs, targets = batch
        if seconds_per_sample:
            take_time(seconds_per_sample * inputs.shape[0], clock)
        return jnp.mean((inputs @ params - targets) ** 2)

    return (x, y), loss


def goodput_controller(probe, *, target_noise=0.5, **settings):
    data, loss = noisy_regression(target_noise)

    defaults = dict(
        min_batch=8,
        max_batch=512,
        batch_size=8,
        check_every=5,
        patience=1,
        batch_rule="goodput",
        # A GPU-like device (10 ms a step and 10 us a sample): the statistics decide.
        assumed_step_time=(0.010, 1e-5),
    )
    return triaccel_jax.Controller(
        loss, jnp.zeros(8), optax.sgd(0.02), data, probe=probe, **{**defaults, **settings}
    )


def test_goodput_grows_with_the_noise_scale_within_the_critical_batch_and_under_memory():
    # Noisy targets: near the optimum the gradient is mostly noise and the noise scale rises.
    controller = goodput_controller(triaccel_jax.FakeMemoryProbe(10**12), target_noise=3.0)
    infos = controller.run(150)
    moves = [e for e in controller.events if e.kind in ("grow", "shrink")]
    assert moves and moves[0].kind == "grow"
    for event in moves:
        assert event.figures["noise_scale"] is not None
        assert event.new <= max(8, event.figures["noise_scale"]), event  # the critical batch
        low, high = event.figures["noise_interval"]
        assert low <= event.figures["noise_scale"] <= high
    # Growth follows the noise scale, which rises as the fit improves.
    assert infos[-1].noise_scale > infos[20].noise_scale
    assert controller.batch_size >= 64
    # Memory stays the cap: 1000 + 100 b under 85% of 10000 fits b <= 75, so at most 64.
    capped = goodput_controller(
        triaccel_jax.FakeMemoryProbe(10_000, peak_bytes=lambda b: 1_000 + 100 * b),
        target_noise=3.0,
    )
    capped_infos = capped.run(150)
    assert max(i.micro_batch for i in capped_infos) == capped.batch_size == 64


@pytest.mark.slow
def test_with_a_fixed_global_batch_the_default_rule_moves_only_the_micro_batch_by_memory():
    config = triaccel_jax.controller.ControllerConfig(
        keep_global_batch=True, min_batch=8, max_batch=64
    )
    assert config.batch_rule == "goodput"  # the default, not refused
    assert not config.moves_by_goodput and not config.splits_steps
    # 1000 + 100 b under 85% of 20000: micro-batches up to 160 fit, so 128 of the batch of 256.
    controller = make_controller(keep_global_batch=True, global_batch=256, batch_size=8)
    assert controller.config.batch_rule == "goodput"
    infos = controller.run(8)
    assert {i.batch_size for i in infos} == {256}  # the batch is fixed
    assert infos[0].micro_batch == 8 and controller.micro_batch == infos[-1].micro_batch == 128
    grows = [e for e in controller.events if e.kind == "grow"]
    assert grows and all("goodput" not in e.figures and "predicted" in e.reason for e in grows)
    # Steps of several micro-batches measure the noise scale without a split.
    assert all(i.noise_scale is not None for i in infos)
    # Memory stays the cap: 1000 + 100 b under 85% of 8000 fits b <= 58, so 32.
    capped = make_controller(
        keep_global_batch=True, global_batch=256, batch_size=8, probe=linear_probe(limit=8_000)
    )
    capped_infos = capped.run(8)
    assert {i.batch_size for i in capped_infos} == {256} and capped.micro_batch == 32


# Samples per second fall with the batch, by a wide margin.
@pytest.mark.slow
def test_by_default_a_batch_measured_slower_is_tried_once_and_left():
    assert triaccel_jax.controller.ControllerConfig().batch_rule == "goodput"
    clock = VirtualClock()
    slower_per_sample_as_the_batch_grows = slower_per_sample(3e-4, clock)
    # Buckets 8, 16, 32, all within memory (1000 + 100 b under 85% of 20000).
    default = make_controller(
        loss_fn=slower_per_sample_as_the_batch_grows, max_batch=32, steps_in_flight=0, clock=clock
    )
    assert default.config.batch_rule == "goodput"
    infos = default.run(200)
    # Goodput measures 8, tries the next bucket once (an unmeasured bucket is hoped as fast per
    # sample), measures it slower and goes back; the one beyond it is never tried.
    assert default.batch_size == infos[-1].micro_batch == 8
    assert max(i.micro_batch for i in infos) == 16
    moves = [(e.kind, e.old, e.new) for e in default.events if e.kind in ("grow", "shrink")]
    assert moves == [("grow", 8, 16), ("shrink", 16, 8)]
    explore, back = (e for e in default.events if e.kind in ("grow", "shrink"))
    assert explore.figures["decision"] == "explore" and back.figures["decision"] == "revert"
    rates = {key[0]: rate for key, rate in default.throughput.items()}
    # Each step runs the loss on its two halves (the noise scale's sub-batches): exactly
    # 2 x 3e-4 (b/2)^2 seconds, so b / (1.5e-4 b^2) samples a second.
    assert rates[8] == pytest.approx(1 / (1.5e-4 * 8))
    assert rates[16] == pytest.approx(1 / (1.5e-4 * 16))
    # The memory rule grows to the largest bucket memory allows, however slow it runs.
    memory = make_controller(
        loss_fn=slower_per_sample_as_the_batch_grows, max_batch=32, batch_rule="memory"
    )
    memory.run(6)
    assert memory.batch_size == 32


def test_noiseless_targets_keep_the_batch_small_and_noisy_targets_grow_it():
    # Noiseless targets: per-sample gradients shrink with the true one as the fit improves, so
    # the noise scale stays near the dimension and no large batch is worth its samples. Noisy
    # targets: near the optimum the gradient is mostly noise, the noise scale rises, and
    # goodput (on a GPU-like step-time model: the statistics decide) grows the batch.
    noiseless = goodput_controller(triaccel_jax.FakeMemoryProbe(10**12), target_noise=0.0)
    noisy = goodput_controller(triaccel_jax.FakeMemoryProbe(10**12), target_noise=3.0)
    quiet_infos, noisy_infos = noiseless.run(150), noisy.run(150)
    assert max(i.micro_batch for i in quiet_infos) <= 32
    assert noisy.batch_size >= 128
    assert noisy_infos[-1].noise_scale > 10 * quiet_infos[-1].noise_scale


def test_a_run_that_starts_on_an_odd_bucket_moves_up_to_measure_the_noise_scale():
    # Bucket 1 cannot be split in two halves, so no step there measures the noise scale; without
    # a measurement goodput never moves. The controller goes to the next bucket to measure it,
    # and says why.
    controller = goodput_controller(triaccel_jax.FakeMemoryProbe(10**12), min_batch=1, batch_size=1)
    assert controller.batch_size == 1
    infos = controller.run(60)
    first = next(e for e in controller.events if e.kind == "grow")
    assert (first.old, first.new) == (1, 2)
    assert "cannot measure the noise scale" in first.reason
    assert any(i.noise_scale is not None for i in infos)
    assert controller.batch_size > 1


def test_goodput_without_a_noise_scale_leaves_an_unmeasurable_bucket_for_the_next():
    def tracker():
        return GoodputTracker(horizon=1000, lag=1, reference=1, margin=0.05, critical_multiple=1.0)

    keys = {b: (b, 1, "none") for b in (1, 2, 4)}
    unmeasurable, _ = tracker().decide(1, (1, 2, 4), keys, measurable=False)
    assert unmeasurable.batch == 2 and "cannot measure the noise scale" in unmeasurable.reason
    # The largest allowed bucket has nowhere to go; a measurable one waits for its estimate.
    assert tracker().decide(1, (1,), {1: keys[1]}, measurable=False)[0].batch == 1
    assert tracker().decide(2, (1, 2, 4), keys, measurable=True)[0].batch == 2


def test_a_throughput_flat_in_the_batch_keeps_the_reference_batch_however_large_the_noise():
    # With the same samples per second at every batch, goodput is the efficiency alone, highest
    # at the reference batch: the batch must stay there even though the noise scale's cap would
    # allow 32 (a rule that decided on the cap alone grew it to the cap).
    flat = goodput_controller(
        triaccel_jax.FakeMemoryProbe(10**12), target_noise=3.0, assumed_step_time=(0.0, 1e-4)
    )
    infos = flat.run(150)
    assert flat.noise_scale is not None and flat.noise_scale > 32
    assert {i.batch_size for i in infos} == {8}


def test_goodput_decides_on_a_sample_clock():
    # Decisions every 100 samples: at 32 a step, the fourth step's check is the first due; the
    # clock is counted in samples, so a batch twice the size is decided on twice as often in
    # steps, and it is saved with the rest of the tracker.
    tracker = GoodputTracker(
        horizon=10_000,
        lag=0,
        reference=32,
        margin=0.05,
        critical_multiple=1.0,
        assumed_step_time=(0.010, 1e-5),
        every=100,
    )
    keys = {b: (b, 1, "none") for b in (32, 64, 128)}
    reasons = []
    for step in range(4):
        tracker.observe_noise(step, (9.0, 17.0), batch=32, micro=16)
        reasons.append(tracker.decide(32, [32, 64, 128], keys, measurable=True)[0].reason)
    assert all("decides every 100 samples" in r for r in reasons[:3])
    assert "decides every" not in reasons[3]
    assert tracker.state_dict()["clock"] == [128, 128]
    with pytest.raises(ValueError, match="`every`"):
        GoodputTracker(horizon=1, lag=0, reference=1, margin=0.0, critical_multiple=1.0, every=0)
    with pytest.raises(ValueError, match="goodput_every"):
        ControllerConfig(goodput_every=0.0)


def test_goodput_scales_the_rate_and_the_schedule_by_the_gain_its_model_assumes():
    # Goodput's efficiency model says a step of B samples makes AdaScale's gain r in progress,
    # not B / B0: by default the rate follows sqrt(r) (Adam-like optimizers, AdaptDL) and a
    # schedule advances by r; a rule that ignores the gain is taken with a warning.
    import warnings

    assert ControllerConfig().learning_rate_rule == "sqrt_adascale"
    assert ControllerConfig(batch_rule="memory").learning_rate_rule == "sqrt"
    with pytest.warns(UserWarning, match="does not scale the learning rate by that gain") as said:
        ControllerConfig(lr_scaling="sqrt")
    assert said[0].filename == __file__  # the user's line, not the library's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ControllerConfig(lr_scaling="adascale")
        ControllerConfig(batch_rule="memory", lr_scaling="sqrt")
    data, loss = noisy_regression(3.0)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.02)
    controller = triaccel_jax.Controller(
        loss,
        jnp.zeros(8),
        tx,
        data,
        probe=triaccel_jax.FakeMemoryProbe(10**12),
        min_batch=32,
        max_batch=32,
        reference_batch=8,
    )
    infos = controller.run(40)
    # S = 4; with noisy targets the gain is between 1 and 4, and the schedule counts it.
    gains = [(i.learning_rate / 0.02) ** 2 for i in infos]
    assert gains[0] == pytest.approx(1.0)  # no noise measured before the first step
    assert 1.2 < gains[-1] < 4.0
    assert controller.schedule_progress == pytest.approx(sum(gains), rel=1e-3)
    assert controller.schedule_progress < 40 * 32 / 8


def test_with_samples_per_second_flat_in_the_batch_the_measured_batch_stays_at_the_reference():
    # Each step takes time in proportion to its samples (on a virtual clock: exactly, whatever
    # the machine is doing): samples per second are the same at every batch, so goodput is the
    # efficiency alone, highest at the reference batch 8. Measured throughput may try 16 once,
    # but must come back and not wander (a rule extrapolating from biased and stale per-step
    # rates went 8 -> 16 -> 32 -> 16 and stayed at 16).
    clock = VirtualClock()
    data, loss = noisy_regression(3.0, seed=0, seconds_per_sample=2e-4, clock=clock)
    controller = triaccel_jax.Controller(
        loss,
        jnp.zeros(8),
        optax.sgd(0.01),
        data,
        probe=triaccel_jax.FakeMemoryProbe(10**12),
        min_batch=8,
        max_batch=128,
        batch_size=8,
        check_every=5,
        steps_in_flight=0,
        clock=clock,
    )
    infos = controller.run(200)
    batches = [i.batch_size for i in infos]
    assert controller.batch_size == 8 and max(batches) <= 16, batches
    turns = [e for e in controller.events if e.kind in ("grow", "shrink")]
    assert len(turns) <= 2, turns
