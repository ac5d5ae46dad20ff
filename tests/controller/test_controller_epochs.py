"""Controller.run by epochs, with an evaluation hook."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax


def make(num=100, **settings):
    x = np.random.default_rng(0).normal(size=(num, 2)).astype(np.float32)
    options = dict(min_batch=16, max_batch=16, probe=triaccel_jax.BudgetMemoryProbe(2**30))
    options.update(settings)
    controller = triaccel_jax.Controller(
        lambda p, b: jnp.mean((b @ p - 1.0) ** 2), jnp.zeros(2), optax.sgd(0.05), x, **options
    )
    return controller, x


def test_epochs_run_to_the_end_of_that_many_epochs_and_evaluate_at_each():
    controller, x = make()
    calls = []

    def evaluate(params, model_state):
        calls.append(np.asarray(params))
        return {"loss": jnp.mean((x @ params - 1.0) ** 2)}

    infos = controller.run(epochs=3, evaluate=evaluate)
    # 300 samples in batches of 16: 19 steps, the last taking 4 samples of the 4th epoch.
    assert len(infos) == 19 and sum(i.batch_size for i in infos) == 304
    evaluated = [e for e in controller.events if e.kind == "evaluate"]
    assert [e.figures["epoch"] for e in evaluated] == [1, 2, 3]
    assert [e.figures["samples"] for e in evaluated] == [112, 208, 304]
    # Each evaluation saw the params after every step before it, not before a step in flight.
    np.testing.assert_allclose(calls[-1], np.asarray(controller.params))
    assert float(evaluated[-1].figures["loss"]) < float(evaluated[0].figures["loss"])
    # From mid-epoch, one epoch runs to the end of the current one.
    more = controller.run(epochs=1)
    assert sum(i.batch_size for i in more) >= 400 - 304 and sum(i.batch_size for i in more) < 112


def test_evaluate_every_adds_evaluations_between_the_epochs_ends():
    controller, _ = make()
    controller.run(12, evaluate=lambda params, _: {"norm": jnp.sum(params**2)}, evaluate_every=5)
    steps = [e.step for e in controller.events if e.kind == "evaluate"]
    # After steps 5 and 10, and at the end of epoch 1 (step 7: 112 samples).
    assert steps == [5, 7, 10]


def test_bad_arguments_are_refused_by_name():
    controller, _ = make()
    with pytest.raises(TypeError, match="num_steps or epochs"):
        controller.run()
    with pytest.raises(TypeError, match="num_steps or epochs"):
        controller.run(3, epochs=1)
    with pytest.raises(ValueError, match="evaluate_every"):
        controller.run(3, evaluate_every=2)
    with pytest.raises(TypeError, match="mapping of metrics"):
        controller.run(epochs=1, evaluate=lambda params, _: 3.0)
