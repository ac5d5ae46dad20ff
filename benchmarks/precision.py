"""Tri-Accel's planned precision against FP32 AdamW: training memory and test accuracy.

Two measurements, each side by side in one run (issue 3's targets):

1. **Memory** (``memory_report``, docs/design.md §7: exact bytes from dtypes, residuals from the jaxpr at
   their real dtypes, device independent) of one training step of the small CNN and ResNet-20 on
   Fashion-MNIST-shaped batches: FP32 AdamW against the policy the planner chooses after a short
   warm-up on real data (fp32 masters; and with ``master_dtype="policy"``). Target <= 0.70x.
2. **Accuracy**: the small CNN trained on real Fashion-MNIST (digits when it is not installed)
   for the same steps, batches and seeds with FP32 AdamW and with Tri-Accel (triaccel +
   planner re-planning every ``--replan-every`` steps + compute in the planned precision through
   the Linen interceptor). Target: Tri-Accel within 0.5 points of FP32 AdamW, or better.

Run from the repository root (the project installed, e.g. by ``bash tools/test.sh``)::

    .venv/bin/python benchmarks/precision.py            # about 10 minutes on 2 CPU cores
    .venv/bin/python benchmarks/precision.py --quick    # a smoke test
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import triaccel_jax
import triaccel_jax.flax
from triaccel_jax.controller import replan
from triaccel_jax.data import find_fashion_mnist
from triaccel_jax.data import load_digits
from triaccel_jax.data import load_fashion_mnist
from triaccel_jax.models import ResNet20
from triaccel_jax.models import SmallCNN
from triaccel_jax.precision import PlannerConfig

MEMORY_TARGET = 0.70
ACCURACY_MARGIN = 0.005


def load_data(quick: bool):
    if find_fashion_mnist() is not None:
        train, test = load_fashion_mnist("train"), load_fashion_mnist("test")
        name = "fashion_mnist"
    else:
        train, test = load_digits("train"), load_digits("test")
        name = "digits"
    if quick:
        train = type(train)(train.images[:2048], train.labels[:2048])
        test = type(test)(test.images[:1000], test.labels[:1000])
    return name, train, test


class Run:
    """One model's training pieces: variables, loss and a step for a given policy."""

    def __init__(self, model: nn.Module, sample: np.ndarray, seed: int):
        self.model = model
        self.has_batch_stats = isinstance(model, ResNet20)
        variables = model.init(jax.random.key(seed), sample[:2], train=False)
        self.params = variables["params"]
        self.batch_stats = variables.get("batch_stats", {})

    def logits(self, params, batch_stats, images, policy=None, train=True):
        variables = {"params": params}
        if self.has_batch_stats:
            variables["batch_stats"] = batch_stats
        kwargs = {"train": train}
        if self.has_batch_stats and train:
            kwargs["mutable"] = ["batch_stats"]
        out = triaccel_jax.flax.apply_with_policy(
            self.model, variables, images, policy=policy, **kwargs
        )
        logits, updates = out if isinstance(out, tuple) else (out, {})
        return logits.astype(jnp.float32), updates.get("batch_stats", batch_stats)

    def loss_fn(self, policy=None):
        def loss(params, batch, batch_stats=None):
            stats = self.batch_stats if batch_stats is None else batch_stats
            logits, new_stats = self.logits(params, stats, batch[0], policy)
            value = optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()
            return value, new_stats

        return loss


def train_steps(run, tx, data, steps, batch_size, seed, *, planned, replan_every, budget):
    """Trains ``run.params`` for ``steps``; returns params, batch stats, state, policy, losses."""
    params, stats = run.params, run.batch_stats
    policy = triaccel_jax.PrecisionPolicy.uniform(params, "fp32") if planned else None
    plan = policy  # a bare policy: no hysteresis streaks yet
    state = tx.init(params)
    compiled = {}

    def make_step(policy):
        loss = run.loss_fn(policy)

        @jax.jit
        def step(params, stats, state, images, labels):
            (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(
                params, (images, labels), stats
            )
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), stats, state, value

        return step

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(data.images))
    cursor, losses, switches = 0, [], 0
    for t in range(steps):
        if cursor + batch_size > len(order):
            order, cursor = rng.permutation(len(data.images)), 0
        batch = order[cursor : cursor + batch_size]
        cursor += batch_size
        if planned and t > 0 and t % replan_every == 0:
            result = replan(
                state, params, plan, loss=float(losses[-1]), planner=PlannerConfig(budget=budget)
            )
            state, plan, switches = result.opt_state, result.plan, switches + result.changed
            policy = plan.policy
        key = policy if planned else None
        if key not in compiled:
            compiled[key] = make_step(policy)
        params, stats, state, value = compiled[key](
            params, stats, state, data.images[batch], data.labels[batch]
        )
        losses.append(value)
    return params, stats, state, policy, [float(x) for x in jax.device_get(losses)], switches


def accuracy(run, params, stats, policy, test, batch_size=1000):
    @jax.jit
    def predict(params, stats, images):
        return run.logits(params, stats, images, policy, train=False)[0].argmax(-1)

    correct = 0
    for start in range(0, len(test.images), batch_size):
        images = test.images[start : start + batch_size]
        correct += int(
            (
                np.asarray(predict(params, stats, images))
                == test.labels[start : start + batch_size]
            ).sum()
        )
    return correct / len(test.images)


def measure_memory(name, make_model, data, args):
    shape = (args.batch_size, 28, 28, 1)
    rng = np.random.default_rng(args.seed)
    pick = rng.permutation(len(data.images))[: args.batch_size]
    images = data.images[pick]
    if images.shape[1:] != shape[1:]:  # digits: pad 8x8 to Fashion-MNIST's 28x28
        images = np.pad(images, ((0, 0), (10, 10), (10, 10), (0, 0)))
    batch = (jnp.asarray(images), jnp.asarray(data.labels[pick]))
    run = Run(make_model(), batch[0], args.seed)

    adamw = optax.adamw(1e-3)
    fp32 = triaccel_jax.memory_report(
        run.params, adamw.init(run.params), None, lambda p, b: run.loss_fn()(p, b)[0], batch
    )
    # Signals from a short warm-up of triaccel on these batches, then the planner's policy.
    warm = (images, data.labels[pick])
    tx = triaccel_jax.triaccel(1e-3)
    padded = type(data)(*warm)
    params, _, state, _, losses, _ = train_steps(
        run,
        tx,
        padded,
        args.warmup,
        args.batch_size,
        args.seed,
        planned=False,
        replan_every=args.replan_every,
        budget=args.budget,
    )
    result = replan(state, params, None, loss=losses[-1], planner=PlannerConfig(budget=args.budget))
    policy, state = result.plan.policy, result.opt_state
    planned_loss = lambda p, b: run.loss_fn(policy)(p, b)[0]
    planned = triaccel_jax.memory_report(params, state, policy, planned_loss, batch)
    masters = triaccel_jax.master_params(params, policy, "policy")
    policy_masters = triaccel_jax.memory_report(masters, state, policy, planned_loss, batch)
    counts = result.leaves_by_dtype
    print(f"\n== memory: {name}, batch {shape} ==")
    print(f"planned policy: {counts} (budget {args.budget} x loss {losses[-1]:.3f})")
    header = f"{'run':<34}{'params':>9}{'copies':>9}{'grads':>9}{'state':>9}{'resid.':>9}{'total MiB':>11}{'/fp32':>8}"
    print(header)
    print("-" * len(header))
    mib = 2.0**20
    results = {}
    for label, report in (
        ("FP32 AdamW", fp32),
        ("Tri-Accel planned (fp32 masters)", planned),
        ("Tri-Accel planned (policy masters)", policy_masters),
    ):
        ratio = report.ratio_to(fp32)
        results[label] = ratio
        print(
            f"{label:<34}{report.params / mib:>9.3f}{report.compute_copies / mib:>9.3f}"
            f"{report.gradients / mib:>9.3f}{report.optimizer_state / mib:>9.3f}"
            f"{report.residuals / mib:>9.3f}{report.total / mib:>11.3f}{ratio:>8.3f}"
        )
    verdict = "PASS" if results["Tri-Accel planned (fp32 masters)"] <= MEMORY_TARGET else "FAIL"
    print(f"target: planned (fp32 masters) <= {MEMORY_TARGET}x FP32 AdamW: {verdict}")
    print(
        f"XLA compiled bytes on {jax.default_backend()} (not device independent): "
        f"fp32 {fp32.compiled}, planned {planned.compiled}"
    )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="training steps per accuracy run")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--seed", type=int, default=0, help="seed of the memory measurement")
    parser.add_argument("--warmup", type=int, default=20, help="steps before planning (memory)")
    parser.add_argument("--replan-every", type=int, default=100)
    parser.add_argument("--budget", type=float, default=1e-3, help="planner budget, x loss")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny run to check the script")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds, args.warmup, args.replan_every = 40, [0], 3, 20

    name, train, test = load_data(args.quick)
    print("Tri-Accel precision benchmark")
    print(
        f"  {platform.platform()}, python {platform.python_version()}, jax {jax.__version__}, "
        f"backend {jax.default_backend()} ({jax.devices()[0].device_kind})"
    )
    print(f"  data: {name}, {len(train.images)} train / {len(test.images)} test images")
    failures = 0
    if not args.skip_memory:
        for model_name, make in (("small_cnn", SmallCNN), ("resnet20", ResNet20)):
            ratios = measure_memory(model_name, make, train, args)
            failures += ratios["Tri-Accel planned (fp32 masters)"] > MEMORY_TARGET

    if not args.skip_accuracy:
        print(
            f"\n== accuracy: small_cnn on {name}, {args.steps} steps of {args.batch_size}, "
            f"seeds {args.seeds} =="
        )
        rows = {"FP32 AdamW": [], "Tri-Accel (planned)": []}
        for seed in args.seeds:
            for label in rows:
                planned = label != "FP32 AdamW"
                run = Run(SmallCNN(), train.images[:2], seed)
                tx = (
                    triaccel_jax.triaccel(args.learning_rate)
                    if planned
                    else optax.adamw(args.learning_rate, weight_decay=1e-4)
                )
                start = time.perf_counter()
                params, stats, _, policy, losses, switches = train_steps(
                    run,
                    tx,
                    train,
                    args.steps,
                    args.batch_size,
                    seed,
                    planned=planned,
                    replan_every=args.replan_every,
                    budget=args.budget,
                )
                acc = accuracy(run, params, stats, policy, test)
                rows[label].append(acc)
                extra = f", policy {policy!r}, {switches} switches" if planned else ""
                print(
                    f"  seed {seed} {label:<20} test acc {acc:.4f}, final loss "
                    f"{np.mean(losses[-20:]):.4f}, {time.perf_counter() - start:.0f} s{extra}"
                )
        base, ours = np.mean(rows["FP32 AdamW"]), np.mean(rows["Tri-Accel (planned)"])
        verdict = "PASS" if ours >= base - ACCURACY_MARGIN else "FAIL"
        print(
            f"mean test accuracy: FP32 AdamW {base:.4f} (spread {np.ptp(rows['FP32 AdamW']):.4f}), "
            f"Tri-Accel {ours:.4f} (spread {np.ptp(rows['Tri-Accel (planned)']):.4f}); "
            f"difference {100 * (ours - base):+.2f} points; target >= -0.5 points: {verdict}"
        )
        failures += verdict == "FAIL"
    print(f"\n{failures} target(s) missed" if failures else "\nall targets met")
    return 0  # a report: the figures, not the exit code, are the result


if __name__ == "__main__":
    sys.exit(main())
