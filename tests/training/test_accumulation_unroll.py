"""The accumulation loop is unrolled where a loop would be slow: a split step's two halves
always, a few micro-batches on a CPU (XLA:CPU runs a convolution's gradient inside a loop body an
order of magnitude slower; benchmarks/goodput.py measured it). Checked on the lowered program,
not by timing: an unrolled accumulation has no ``while`` loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from triaccel_jax import training


def _loss(params, batch, *, policy, rng):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _lowered_text(num_micro: int, split: bool) -> str:
    params = {"w": jnp.ones((4, 1))}
    tx = optax.sgd(0.1)
    loss = training.normalize_loss_fn(_loss, has_aux=False, has_model_state=False)
    step = training.make_train_step(loss, tx, policy=None, num_micro=num_micro, seed=0, split=split)
    size = 8
    batch = {
        "x": np.ones((num_micro, size, 4), np.float32),
        "y": np.ones((num_micro, size, 1), np.float32),
    }
    lowered = jax.jit(step).lower(params, tx.init(params), None, batch, 0, 1.0, None)
    return lowered.as_text()


@pytest.mark.parametrize(
    ("num_micro", "split"), [(1, True), (2, False), (8, False)], ids=["split", "2", "8"]
)
def test_a_few_micro_batches_accumulate_without_a_loop_on_cpu(num_micro, split):
    assert jax.default_backend() == "cpu"
    assert "stablehlo.while" not in _lowered_text(num_micro, split)


def test_many_micro_batches_still_accumulate_in_a_loop():
    # Beyond the limit the loop stays: compile time grows with every unrolled micro-batch.
    assert "stablehlo.while" in _lowered_text(16, False)
