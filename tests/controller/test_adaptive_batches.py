"""AdaptiveBatches: the controller's batch and learning-rate decisions in a loop of your own."""

import collections
import math
import warnings

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from controller_harness import VirtualClock

from triaccel_jax.controller import AdaptiveBatches
from triaccel_jax.controller import BudgetMemoryProbe
from triaccel_jax.controller import ElasticSampler
from triaccel_jax.controller import FaultSite
from triaccel_jax.controller import OutOfMemoryError
from triaccel_jax.controller import simulated_out_of_memory
from triaccel_jax.controller._learning_rate import adascale_gain
from triaccel_jax.controller._learning_rate import round_gain
from triaccel_jax.precision import step_peak_bytes
from triaccel_jax.training import value_and_grad_with_noise

PROBE = BudgetMemoryProbe(2**30)


def regression(num=512, noise=0.5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num, 8)).astype(np.float32)
    y = (x @ rng.normal(size=8) + noise * rng.normal(size=num)).astype(np.float32)
    ids = np.arange(num)

    def loss(w, batch):
        inputs, targets, _ = batch
        return jnp.mean((inputs @ w - targets) ** 2)

    return (x, y, ids), loss


def make_step(loss, tx):
    @jax.jit
    def step(w, opt_state, batch):
        value, grads, norms = value_and_grad_with_noise(loss)(w, batch)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, {"loss": value, **norms}

    return step


def train(batches, step, w, opt_state, *, epochs=1, fail=lambda settings: False):
    """Trains ``epochs``; returns the state and the ids of the samples each step trained."""
    trained = []
    for _ in range(epochs):
        for batch, settings in batches:
            if fail(settings):
                batches.report(error=simulated_out_of_memory(FaultSite("dispatch", 0, 0, 1)))
                continue
            opt_state = settings.apply(opt_state)
            w, opt_state, metrics = step(w, opt_state, batch)
            batches.report(metrics)
            trained.append(np.asarray(batch[2]))
    return w, opt_state, trained


def test_each_epoch_trains_every_sample_once_at_the_decided_sizes():
    data, loss = regression(num=200)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9)
    w = jnp.zeros(8)
    batches = AdaptiveBatches(data, tx.init(w), min_batch=16, max_batch=16, probe=PROBE)
    _, _, trained = train(batches, make_step(loss, tx), w, tx.init(w), epochs=3)
    ids = np.concatenate(trained)
    # 600 samples in 16s: 38 steps (the last of each epoch takes its rest from the next one).
    assert len(trained) == math.ceil(600 / 16) and {len(t) for t in trained} == {16}
    counts = collections.Counter(ids[:600].tolist())
    assert set(counts.values()) == {3} and len(counts) == 200
    assert batches.epoch == 3 and batches.step_count == len(trained)


def test_an_iterable_of_batches_is_cut_to_the_decided_size_and_each_pass_is_an_epoch():
    data, loss = regression(num=300)
    # A pipeline's batches of 50, served as a list (re-iterable: one pass an epoch).
    stream = [tuple(leaf[i : i + 50] for leaf in data) for i in range(0, 300, 50)]
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9)
    w = jnp.zeros(8)
    batches = AdaptiveBatches(
        stream, tx.init(w), min_batch=32, max_batch=32, num_examples=300, probe=PROBE
    )
    _, _, trained = train(batches, make_step(loss, tx), w, tx.init(w), epochs=2)
    assert {len(t) for t in trained} == {32}
    ids = np.concatenate(trained)
    # 600 samples in 32s: 18 steps; 24 samples wait at the end, none repeated or dropped.
    assert len(ids) == 576 and collections.Counter(ids.tolist()).most_common(1)[0][1] == 2
    assert sorted(ids[:288].tolist()) == list(range(288))
    assert batches.epoch == 2


def test_a_one_shot_iterator_is_refused_at_its_second_epoch_naming_the_fix():
    data, loss = regression(num=96)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    w = jnp.zeros(8)
    one_shot = (tuple(leaf[i : i + 32] for leaf in data) for i in range(0, 96, 32))
    batches = AdaptiveBatches(
        one_shot, tx.init(w), min_batch=32, max_batch=32, num_examples=96, probe=PROBE
    )
    _, _, trained = train(batches, make_step(loss, tx), w, tx.init(w))
    assert len(trained) == 3  # the first epoch trains every sample
    with pytest.raises(TypeError, match=r"one-shot iterator.*epoch 2 would be empty.*__iter__"):
        train(batches, make_step(loss, tx), w, tx.init(w))


def test_reports_without_the_noise_norms_are_said_once_where_goodput_would_move():
    data, loss = regression(num=128)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    w = jnp.zeros(8)
    step = make_step(loss, tx)

    def loss_only(*args):
        w, opt_state, metrics = step(*args)
        return w, opt_state, {"loss": metrics["loss"]}

    batches = AdaptiveBatches(data, tx.init(w), min_batch=16, max_batch=64, probe=PROBE)
    with pytest.warns(UserWarning, match="no noise norms") as said:
        train(batches, loss_only, w, tx.init(w))
    assert len([w for w in said if "noise norms" in str(w.message)]) == 1  # once, not a step
    # Nothing to say with the norms reported, nor where goodput does not move the batch.
    for settings, report in (({}, step), ({"batch_rule": "memory"}, loss_only)):
        batches = AdaptiveBatches(
            data, tx.init(w), min_batch=16, max_batch=64, probe=PROBE, **settings
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*noise norms")
            train(batches, report, w, tx.init(w))


def test_a_rate_that_is_not_injected_is_rescaled_by_the_update_scale_and_it_says_who_applies_it():
    data, _ = regression(num=128)
    tx = optax.sgd(0.05)  # no inject_hyperparams: settings.apply cannot write the rate
    batches = AdaptiveBatches(
        data,
        tx.init(jnp.zeros(8)),
        min_batch=32,
        max_batch=32,
        reference_batch=16,
        lr_scaling="sqrt",
        probe=PROBE,
    )
    with pytest.warns(UserWarning, match=r"nothing multiplies it for you.*settings\.update_scale"):
        _, settings = next(iter(batches))
    assert settings.learning_rate is None and settings.update_scale != 1.0


def test_a_batch_that_cannot_grow_for_want_of_memory_figures_is_said_once():
    data, loss = regression(num=256)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    w = jnp.zeros(8)
    # The default probe on a CPU: no memory figures at all.
    batches = AdaptiveBatches(data, tx.init(w), min_batch=16, max_batch=64, check_every=2)
    with pytest.warns(
        UserWarning, match=r"cannot grow the batch beyond 16.*step_peak_bytes\(train_step"
    ) as said:
        train(batches, make_step(loss, tx), w, tx.init(w))
    assert len([w for w in said if "cannot grow" in str(w.message)]) == 1
    assert batches.batch_size == 16
    # With a peak for the sizes there is nothing to say.
    batches = AdaptiveBatches(
        data, tx.init(w), min_batch=16, max_batch=64, probe=PROBE, peak_bytes=lambda b: 100 * b
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cannot grow")
        train(batches, make_step(loss, tx), w, tx.init(w))


def test_the_jitted_steps_compiled_peaks_let_the_batch_grow_on_a_cpu_with_the_default_probe():
    data, loss = regression(num=512)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    w = jnp.zeros(8)
    step = make_step(loss, tx)
    batches = AdaptiveBatches(
        data,
        tx.init(w),
        min_batch=16,
        max_batch=64,
        check_every=2,
        batch_rule="memory",
        lr_scaling="none",
        peak_bytes=step_peak_bytes(step, w, tx.init(w), data),  # the whole data set as example
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cannot grow")
        _, _, trained = train(batches, step, w, tx.init(w))
    assert [len(ids) for ids in trained][:2] == [16, 16]
    assert batches.batch_size == 64
    assert any(e.kind == "grow" and e.new == 64 for e in batches.events)


def test_a_forgotten_settings_apply_is_said_once_from_the_state_reported():
    data, loss = regression(num=256)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    w = jnp.zeros(8)
    step = make_step(loss, tx)

    def run(apply):
        batches = AdaptiveBatches(
            data,
            tx.init(w),
            batch_size=32,
            reference_batch=16,
            batch_rule="memory",
            lr_scaling="sqrt",
            probe=PROBE,
        )
        params, opt_state = w, tx.init(w)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for batch, settings in batches:
                if apply:
                    opt_state = settings.apply(opt_state)
                params, opt_state, metrics = step(params, opt_state, batch)
                batches.report(metrics, opt_state=opt_state)
        return [str(w.message) for w in said if "settings.apply" in str(w.message)]

    forgot = run(apply=False)
    assert len(forgot) == 1
    assert "learning_rate=0.05, not the 0.0707107" in forgot[0]
    assert run(apply=True) == []


def test_data_that_would_be_read_as_something_else_is_refused_naming_the_fix():
    (x, y, _), _ = regression(num=64)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    state = tx.init(jnp.zeros(8))
    with pytest.raises(TypeError, match=r"list of arrays .*\(64, 8\), \(64,\).*tuple \(x, y\)"):
        AdaptiveBatches([x, y], state, num_examples=64, probe=PROBE)

    def batches_of(n):
        yield (x[:n], y[:n])

    with pytest.raises(TypeError, match=r"generator function.*__iter__"):
        AdaptiveBatches(batches_of, state, num_examples=64, probe=PROBE)
    # A list of batches (the last one shorter) and the tuple itself are taken.
    AdaptiveBatches([x[:40], x[40:]], state, num_examples=64, probe=PROBE)
    AdaptiveBatches((x, y), state, probe=PROBE)


def test_an_iterable_needs_the_data_set_size_and_a_non_iterable_is_refused():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9)
    with pytest.raises(ValueError, match="num_examples"):
        AdaptiveBatches([np.zeros((4, 1))], tx.init(jnp.zeros(1)), probe=PROBE)
    with pytest.raises(TypeError, match="iterable of batches"):
        AdaptiveBatches(3, tx.init(jnp.zeros(1)), probe=PROBE)


def test_goodput_grows_the_batch_and_the_settings_carry_the_rate_for_it():
    data, loss = regression(num=4096, noise=2.0)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
    w = jnp.zeros(8)
    batches = AdaptiveBatches(
        data,
        tx.init(w),
        min_batch=8,
        max_batch=256,
        check_every=5,
        patience=1,
        probe=PROBE,
        peak_bytes=lambda batch: 1000 * batch,
        assumed_step_time=(0.010, 1e-5),  # a GPU-like device: the statistics decide
    )
    step = make_step(loss, tx)
    opt_state = tx.init(w)
    seen = []
    with pytest.warns(UserWarning, match="rescales the learning rate"):
        for batch, settings in batches:
            opt_state = settings.apply(opt_state)
            # The rate written is the one the step trains with.
            assert float(opt_state.hyperparams["learning_rate"]) == pytest.approx(
                settings.learning_rate
            )
            w, opt_state, metrics = step(w, opt_state, batch)
            batches.report(metrics)
            seen.append((settings.batch_size, settings.learning_rate))
    sizes = [s for s, _ in seen]
    assert sizes[0] == 8 and max(sizes) > 8
    assert any(e.kind == "grow" for e in batches.events)
    # Under goodput the default rule is the square root of AdaScale's gain, from the noise
    # estimates before the step, never below the tuned rate.
    assert all(rate >= 0.01 * (1 - 1e-6) for _, rate in seen)
    big = [rate for size, rate in seen if size > 8]
    assert max(big) > 0.01 and max(big) <= 0.01 * math.sqrt(max(sizes) / 8) * (1 + 1e-6)
    assert batches.noise_scale is not None and batches.noise_scale > 8


def test_the_rate_follows_the_gain_the_controllers_rule_gives():
    data, loss = regression(num=1024, noise=1.0)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
    w = jnp.zeros(8)
    batches = AdaptiveBatches(
        data, tx.init(w), min_batch=64, max_batch=64, reference_batch=16, probe=PROBE
    )
    step, opt_state = make_step(loss, tx), tx.init(w)
    rates = []
    noise = None
    for batch, settings in batches:
        # The gain of a step comes from the estimates after the step before it.
        expected = 0.01 * math.sqrt(round_gain(adascale_gain(4.0, noise), 4.0))
        assert settings.learning_rate == pytest.approx(expected)
        rates.append(settings.learning_rate)
        opt_state = settings.apply(opt_state)
        w, opt_state, metrics = step(w, opt_state, batch)
        batches.report(metrics)
        noise = batches._goodput.noise_before(settings.step + 1)
    assert rates[0] == pytest.approx(0.01) and max(rates) > 0.012


def test_out_of_memory_moves_below_and_the_same_samples_come_again():
    data, loss = regression(num=256)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9)
    w = jnp.zeros(8)
    batches = AdaptiveBatches(
        data, tx.init(w), min_batch=16, max_batch=64, batch_size=64, probe=PROBE
    )
    _, _, trained = train(
        batches,
        make_step(loss, tx),
        w,
        tx.init(w),
        fail=lambda settings: settings.batch_size >= 64,
    )
    assert {len(t) for t in trained} == {32}
    assert sorted(np.concatenate(trained).tolist()) == list(range(256))
    oom = [e for e in batches.events if e.kind == "oom"]
    assert len(oom) == 1 and (oom[0].old, oom[0].new) == (64, 32)


def test_a_steps_seconds_are_read_from_the_given_clock():
    # Each step takes 0.5 s on a virtual clock (between the yield and the report): the step
    # times goodput keeps are exactly those, whatever the machine's own clock says.
    data, loss = regression(num=256)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    w = jnp.zeros(8)
    clock = VirtualClock()
    batches = AdaptiveBatches(
        data, tx.init(w), min_batch=16, max_batch=16, probe=PROBE, check_every=4, clock=clock
    )
    step, opt_state = make_step(loss, tx), tx.init(w)
    for batch, settings in batches:
        w, opt_state, metrics = step(w, settings.apply(opt_state), batch)
        clock.take(0.5)
        batches.report(metrics)
    ((*key, steps, seconds, squares, _),) = batches.state_dict()["goodput"]["step_times"]
    assert key == [16, 1, "your step"] and steps > 0
    assert (seconds, squares) == (0.5 * steps, 0.25 * steps)


def test_out_of_memory_at_the_smallest_batch_raises_and_other_errors_pass_through():
    data, _ = regression(num=64)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9)
    batches = AdaptiveBatches(data, tx.init(jnp.zeros(8)), min_batch=16, max_batch=16, probe=PROBE)
    iterator = iter(batches)
    next(iterator)
    with pytest.raises(OutOfMemoryError):
        batches.report(error=simulated_out_of_memory(FaultSite("dispatch", 0, 16, 1)))
    next(iterator)
    with pytest.raises(KeyError, match="mine"):
        batches.report(error=KeyError("mine"))


def test_a_batch_must_be_reported_once_before_the_next():
    data, _ = regression(num=64)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9)
    batches = AdaptiveBatches(data, tx.init(jnp.zeros(8)), min_batch=16, max_batch=16, probe=PROBE)
    with pytest.raises(RuntimeError, match="no batch waiting"):
        batches.report({"loss": 1.0})
    iterator = iter(batches)
    next(iterator)
    with pytest.raises(RuntimeError, match="was not reported"):
        next(iterator)
    with pytest.raises(RuntimeError, match="between a batch and its report"):
        batches.state_dict()


def test_half_a_pair_of_norms_is_refused_by_name():
    data, _ = regression(num=64)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9)
    batches = AdaptiveBatches(data, tx.init(jnp.zeros(8)), min_batch=16, max_batch=16, probe=PROBE)
    next(iter(batches))
    with pytest.raises(ValueError, match="micro_grad_sq_norm"):
        batches.report({"grad_sq_norm": 1.0})


def test_the_controllers_own_loop_settings_are_refused_with_what_to_do():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9)
    state = tx.init(jnp.zeros(1))
    with pytest.raises(ValueError, match=r"replan_every.*triaccel_jax\.controller\.replan"):
        AdaptiveBatches(np.zeros((8, 1), np.float32), state, replan_every=10)
    with pytest.raises(
        TypeError, match=r"AdaptiveBatches got unexpected.*did you mean 'max_batch'"
    ):
        AdaptiveBatches(np.zeros((8, 1), np.float32), state, max_bacth=10)


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(
    events=st.lists(st.sampled_from(["step", "oom", "save"]), min_size=4, max_size=30),
)
def test_any_sequence_of_steps_failures_and_restarts_trains_each_sample_once_an_epoch(events):
    """Steps, out-of-memory failures and restarts from a saved state, in any order: the samples
    trained are each epoch's permutation, none lost or repeated, the same as without them."""
    data, _ = regression(num=96)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9)
    state = tx.init(jnp.zeros(8))

    def fresh():
        return AdaptiveBatches(
            data, state, min_batch=8, max_batch=32, batch_size=32, probe=PROBE, check_every=3
        )

    batches, iterator, trained, saved = fresh(), None, [], None
    for event in events:
        if event == "save":
            saved = batches.state_dict()
            batches = fresh()
            batches.load_state_dict(saved)
            iterator = None
            continue
        if iterator is None:
            iterator = iter(batches)
        taken = next(iterator, None)
        if taken is None:
            iterator = iter(batches)
            taken = next(iterator, None)
        batch, settings = taken
        if event == "oom" and settings.batch_size > 8:
            batches.report(error=simulated_out_of_memory(FaultSite("dispatch", 0, 0, 1)))
            continue
        if event == "oom":
            event = "step"  # the smallest batch would raise: train it instead
        batches.report({"loss": 1.0})
        trained.extend(np.asarray(batch[2]).tolist())
    # The samples trained are a prefix of the epochs' permutations, as the sampler serves them.
    sampler = ElasticSampler(96, seed=0)  # the loader's default seed
    order = np.concatenate([sampler.order(e) for e in range(4)]).tolist()
    assert trained == order[: len(trained)]
