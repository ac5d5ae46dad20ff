"""A short demo: an MLP on scikit-learn's digits, trained with AdamW and with triaccel.

It is what ``python -m triaccel_jax`` runs: real data that needs no download, a few seconds on a
CPU, and the per-epoch losses and test accuracies of both optimizers side by side.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
import optax

from triaccel_jax._src.alias import triaccel
from triaccel_jax._src.signals import signals
from triaccel_jax.data import load_digits


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


def _load_digits(seed: int):
    try:
        splits = [load_digits(split, seed=seed) for split in ("train", "test")]
    except ImportError as error:
        raise SystemExit(str(error)) from None
    return [(images.reshape(len(images), -1), labels) for images, labels in splits]


def _train(name, tx, train, test, *, epochs, batch_size, seed):
    model = _MLP()
    images, labels = train
    params = model.init(jax.random.key(seed), images[:1])
    state = tx.init(params)

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    rng = np.random.default_rng(seed)
    history = []
    start = time.perf_counter()
    for epoch in range(epochs):
        order = rng.permutation(len(images))
        losses = []
        for first in range(0, len(order) - batch_size + 1, batch_size):
            batch = order[first : first + batch_size]
            params, state, loss = step(params, state, images[batch], labels[batch])
            losses.append(loss)
        accuracy = float(np.mean(np.asarray(model.apply(params, test[0]).argmax(-1)) == test[1]))
        history.append((float(np.mean(jax.device_get(losses))), accuracy))
        print(
            f"  {name:<9} epoch {epoch + 1:>2}: train loss {history[-1][0]:.4f}, test acc {accuracy:.4f}"
        )
    return history, time.perf_counter() - start, state


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m triaccel_jax",
        description="Train an MLP on scikit-learn's digits with AdamW and with triaccel.",
    )
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per step")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="for both optimizers")
    parser.add_argument("--seed", type=int, default=0, help="seed of init, data order and split")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be >= 1")

    train, test = _load_digits(args.seed)
    print(
        f"digits: {len(train[0])} train / {len(test[0])} test images, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}"
    )
    settings = dict(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed)
    results = {}
    for name, tx in (
        ("adamw", optax.adamw(args.learning_rate, weight_decay=1e-4)),
        ("triaccel", triaccel(args.learning_rate, weight_decay=1e-4)),
    ):
        results[name] = _train(name, tx, train, test, **settings)

    print(f"\n{'optimizer':<10}{'final loss':>12}{'test acc':>10}{'seconds':>9}")
    for name, (history, seconds, _) in results.items():
        print(f"{name:<10}{history[-1][0]:>12.4f}{history[-1][1]:>10.4f}{seconds:>9.1f}")
    print("\ntriaccel per-leaf signals (curvature EMA, gradient noise, step-size scale):")
    for path, record in signals(results["triaccel"][2]).items():
        print(
            f"  {path:<22} kappa {record['mean_curvature']:.3e}  nsr "
            f"{record['noise_to_signal']:8.2f}  step scale {record['step_scale']:.3f}"
        )
    return 0
