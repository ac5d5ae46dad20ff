"""Calibrating the planner's budget: leaves dropped and memory at a common batch, per budget.

Trains a model with ``triaccel`` in float32 for a few hundred steps (the curvature and noise
signals need to settle), then plans from those same signals at each budget of a grid and reports,
per budget, how many leaves (and what share of the parameters) leave float32 and the step's
``memory_report`` at a common batch, beside static bf16 AdamW and FP32 AdamW at that batch. The
planned policy's optimizer state is the triaccel state converted to the policy (bf16 moments for
bf16 leaves under ``state="auto"``), as the controller would hold it.

The default budget of :func:`triaccel_jax.plan_precision` is the smallest budget on the grid at
which the planned step takes no more memory than static bf16 at the common batch on the
workloads measured here (docs/design.md §3); whether that costs accuracy is what
``benchmarks/accuracy.py`` (the "planned precision only" row) measures.

Usage::

    python benchmarks/planner_budget.py                       # small CNN and ResNet-20, Fashion-MNIST
    python benchmarks/planner_budget.py --quick               # digits, a few steps (the test suite)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import jax
import numpy as np
import optax

from triaccel_jax._src import tree
from triaccel_jax.cli import _task as task
from triaccel_jax.controller import Controller
from triaccel_jax.controller import replan
from triaccel_jax.policy import PrecisionPolicy
from triaccel_jax.precision import PlannerConfig
from triaccel_jax.precision import memory_report
from triaccel_jax.transforms import triaccel

BUDGETS = (0.0, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)


def _step_memory(loss_fn, params, opt_state, model_state, policy, batch) -> int:
    def step_fn(p, b):
        return loss_fn(p, b, policy=policy, rng=jax.random.key(0), model_state=model_state)[0]

    return memory_report(params, opt_state, policy, step_fn, batch, compiled=False).total


def measure(
    model_name: str,
    dataset: str,
    steps: int,
    batch: int,
    memory_batch: int,
    train_subset: int | None,
    image_shape: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    """Trains ``model_name`` with triaccel for ``steps`` steps, then plans at every budget.

    Memory is ``memory_report`` of one step at ``memory_batch`` (analytic: shapes and dtypes).
    """
    data = task.load_data(
        dataset, data_dir=None, train_subset=train_subset, test_subset=256, image_shape=image_shape
    )
    model, has_state = task.build_model(model_name, data.num_classes)
    loss_fn = task.make_loss(model, has_state, data.channel_stats)
    init_kwargs = {"train": False} if has_state else {}
    variables = model.init(jax.random.key(0), data.train["image"][:2], **init_kwargs)
    params, model_state = variables["params"], variables.get("batch_stats")
    controller = Controller(
        loss_fn,
        params,
        triaccel(1e-3, weight_decay=1e-4),
        data.train,
        model_state=model_state,
        has_aux=True,
        min_batch=batch,
        max_batch=batch,
        probe=None,
        seed=0,
    )
    start = time.perf_counter()
    infos = controller.run(steps)
    seconds = time.perf_counter() - start
    loss = float(np.mean([i.loss for i in infos[-10:]]))
    params, opt_state, model_state = controller.params, controller.opt_state, controller.model_state
    index = np.arange(memory_batch) % len(data.train["label"])
    sample = {k: v[index] for k, v in data.train.items()}

    fp32_bytes = _step_memory(
        loss_fn, params, optax.adamw(1e-3).init(params), model_state, None, sample
    )
    bf16 = PrecisionPolicy.uniform(params, "bf16")
    bf16_bytes = _step_memory(
        loss_fn, params, optax.adamw(1e-3).init(params), model_state, bf16, sample
    )
    leaves = {path: int(np.size(x)) for path, x in _paths(params)}
    rows = []
    start_policy = PrecisionPolicy.uniform(params)
    for budget in BUDGETS:
        # patience=1: one plan from settled signals, as a re-plan after the streak has passed.
        result = replan(
            opt_state,
            params,
            start_policy,
            loss=loss,
            planner=PlannerConfig(budget=budget, patience=1),
        )
        policy = result.plan.policy
        dropped = [p for p in policy if policy.compute(p) != "fp32"]
        total = _step_memory(loss_fn, params, result.opt_state, model_state, policy, sample)
        rows.append(
            {
                "budget": budget,
                "leaves_dropped": len(dropped),
                "leaves": len(leaves),
                "params_dropped": sum(leaves[p] for p in dropped) / sum(leaves.values()),
                "bytes": total,
                "vs_fp32": total / fp32_bytes,
                "vs_bf16": total / bf16_bytes,
            }
        )
    return {
        "model": model_name,
        "dataset": dataset,
        "steps": steps,
        "batch": batch,
        "memory_batch": memory_batch,
        "train_seconds": seconds,
        "loss": loss,
        "fp32_bytes": fp32_bytes,
        "bf16_bytes": bf16_bytes,
        "rows": rows,
    }


def _paths(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [(tree.path_string(path), leaf) for path, leaf in flat]


def format_table(result: dict[str, Any]) -> str:
    """A markdown table of one workload's budgets."""
    head = (
        f"{result['model']} on {result['dataset']}, {result['steps']} steps at batch "
        f"{result['batch']} (loss {result['loss']:.3f}); memory_report at batch "
        f"{result['memory_batch']}: "
        f"FP32 AdamW {result['fp32_bytes'] / 2**20:.2f} MiB, static bf16 AdamW "
        f"{result['bf16_bytes'] / 2**20:.2f} MiB ({result['bf16_bytes'] / result['fp32_bytes']:.3f}x)"
    )
    lines = [
        head,
        "",
        "| budget (x loss) | leaves in bf16 | params in bf16 | MiB | vs FP32 | vs static bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['budget']:g} | {r['leaves_dropped']}/{r['leaves']} | "
            f"{100 * r['params_dropped']:.1f}% | {r['bytes'] / 2**20:.2f} | "
            f"{r['vs_fp32']:.3f}x | {r['vs_bf16']:.3f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="digits, small CNN, 20 steps")
    parser.add_argument("--models", nargs="+", default=["small_cnn", "resnet20"])
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=128, help="training batch")
    parser.add_argument("--memory-batch", type=int, default=128, help="batch memory is taken at")
    parser.add_argument(
        "--image-shape", type=int, nargs=3, default=None, help="e.g. 32 32 3 (ResNet-18's input)"
    )
    parser.add_argument("--train-subset", type=int, default=20000)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.dataset, args.steps, args.batch = ["small_cnn"], "digits", 20, 32
        args.memory_batch = 32
    for name in args.models:
        shape = None if args.image_shape is None else tuple(args.image_shape)
        result = measure(
            name, args.dataset, args.steps, args.batch, args.memory_batch, args.train_subset, shape
        )
        print(format_table(result), end="\n\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
