"""Real data: an MLP on scikit-learn's digits (bundled with scikit-learn, no download).

Margin: triaccel's mean test accuracy over two seeds must be at least AdamW's minus 1 point. The
test split has 360 images, so one image is 0.28 points; across five seeds AdamW's accuracy at this
setting spreads over about 1.7 points (96.1-97.8%), and triaccel measured 0.3-0.6 points above it
at every seed (``python tests/transforms/test_digits.py`` prints both). A 1-point margin absorbs
seed noise of about three images yet fails a real regression (a broken step-size scale loses
several points).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax.data import load_digits

LEARNING_RATE = 3e-3
EPOCHS = 10
BATCH = 64
SEEDS = (0, 1)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


def load_split():
    return [
        (images.reshape(len(images), -1), labels)
        for images, labels in (load_digits("train"), load_digits("test"))
    ]


def train_and_score(tx, seed, train, test):
    model = MLP()
    images, labels = train
    params = model.init(jax.random.key(seed), images[:1])
    state = tx.init(params)

    def loss(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    order_rng = np.random.default_rng(seed)
    for _ in range(EPOCHS):
        order = order_rng.permutation(len(images))
        for start in range(0, len(order) - BATCH + 1, BATCH):
            batch = order[start : start + BATCH]
            params, state = step(params, state, images[batch], labels[batch])
    predictions = model.apply(params, test[0]).argmax(-1)
    return float(np.mean(np.asarray(predictions) == test[1]))


def accuracies():
    train, test = load_split()
    adamw = [
        train_and_score(optax.adamw(LEARNING_RATE, weight_decay=1e-4), s, train, test)
        for s in SEEDS
    ]
    ours = [train_and_score(triaccel_jax.triaccel(LEARNING_RATE), s, train, test) for s in SEEDS]
    return float(np.mean(adamw)), float(np.mean(ours))


@pytest.mark.slow
@pytest.mark.standard_promotion(
    "optax promotes inside its own transforms (integer leaves, MultiSteps, injected hyperparameters)"
)
def test_triaccel_matches_adamw_on_digits():
    adamw, ours = accuracies()
    assert ours >= adamw - 0.01, (ours, adamw)
    assert ours > 0.95


if __name__ == "__main__":
    print("adamw {:.4f}  triaccel {:.4f}".format(*accuracies()))
