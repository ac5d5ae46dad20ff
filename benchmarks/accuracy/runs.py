"""The ablation rows: each row's optimizer, precision and batch, and one measured run."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import triaccel_jax
from triaccel_jax.cli import _task as task

from .workloads import Workload

ROWS = ("fp32", "curvature", "precision", "elastic", "triaccel", "bf16")
ROW_LABELS = {
    "fp32": "FP32 AdamW",
    "curvature": "+ curvature step sizes only",
    "precision": "+ planned precision only",
    "elastic": "+ elastic batch only",
    "triaccel": "Tri-Accel (all three)",
    "bf16": "static bf16 AdamW",
}
# Tri-Accel's variants of (alpha, min_scale, max_scale) tried at its best learning rate, in order.

DEFAULT_SHAPE = (0.5, 0.5, 2.0)  # triaccel's defaults: alpha, min_scale, max_scale
WEIGHT_DECAY = 1e-4
# The main job's precision schedule: a first plan (without hysteresis) at step 20, then a
# re-plan every 100 steps.
FIRST_REPLAN, REPLAN_EVERY = 20, 100


@dataclasses.dataclass(frozen=True)
class Hyper:
    """A configuration's tunable hyperparameters."""

    lr: float
    alpha: float = DEFAULT_SHAPE[0]
    min_scale: float = DEFAULT_SHAPE[1]
    max_scale: float = DEFAULT_SHAPE[2]


def build_controller(
    row: str, hyper: Hyper, workload: Workload, data: task.Data, seed: int
) -> tuple[triaccel_jax.Controller, Callable[..., Any]]:
    """The controller and loss of ``row`` at ``hyper``: the same init and data order per seed."""
    model = workload.model()
    loss_fn = task.make_loss(model, workload.has_state, None)
    init_kwargs = {"train": False} if workload.has_state else {}
    variables = model.init(jax.random.key(seed), data.train["image"][:2], **init_kwargs)
    params, model_state = variables["params"], variables.get("batch_stats")
    fixed = dict(min_batch=workload.batch, max_batch=workload.batch, lr_scaling="none")
    # A fixed budget, not the free RAM of a shared machine, so the batch decisions repeat.
    elastic = dict(
        min_batch=min(32, workload.batch),
        max_batch=workload.max_batch,
        batch_size=workload.batch,
        probe=triaccel_jax.BudgetMemoryProbe(2 * 2**30),
        lr_scaling="sqrt",
    )
    curvature = dict(alpha=hyper.alpha, min_scale=hyper.min_scale, max_scale=hyper.max_scale)
    adamw = optax.inject_hyperparams(optax.adamw)
    tri = optax.inject_hyperparams(triaccel_jax.triaccel)
    policy = None
    replan_every = None
    if row in ("fp32", "bf16"):
        tx, batching = adamw(learning_rate=hyper.lr, weight_decay=WEIGHT_DECAY), fixed
        if row == "bf16":
            policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16")
    elif row == "curvature":
        tx, batching = tri(learning_rate=hyper.lr, weight_decay=WEIGHT_DECAY, **curvature), fixed
    elif row == "precision":
        tx, batching = tri(learning_rate=hyper.lr, weight_decay=WEIGHT_DECAY, alpha=0.0), fixed
        replan_every = REPLAN_EVERY
    elif row == "elastic":
        tx, batching = adamw(learning_rate=hyper.lr, weight_decay=WEIGHT_DECAY), elastic
    elif row == "triaccel":
        tx = tri(learning_rate=hyper.lr, weight_decay=WEIGHT_DECAY, **curvature)
        batching, replan_every = elastic, REPLAN_EVERY
    else:
        raise ValueError(f"unknown row {row!r}; choose from {ROWS}")
    controller = triaccel_jax.Controller(
        loss_fn,
        params,
        tx,
        data.train,
        model_state=model_state,
        has_aux=True,
        seed=seed,
        reference_batch=workload.batch,
        check_every=10,
        policy=policy,
        replan_every=replan_every,
        first_replan=None if replan_every is None else FIRST_REPLAN,
        **batching,
    )
    return controller, loss_fn


def analytic_memory_mib(controller: Any, loss_fn: Any, data: task.Data, batch: int) -> float:
    """``memory_report``'s total (params, copies, gradients, state, residuals) of one step."""
    index = np.arange(batch) % len(data.train["label"])
    batch_arrays = {k: v[index] for k, v in data.train.items()}
    policy, model_state = controller.policy, controller.model_state

    def step_fn(params, arrays):
        return loss_fn(
            params, arrays, policy=policy, rng=jax.random.key(0), model_state=model_state
        )[0]

    report = triaccel_jax.memory_report(
        controller.params, controller.opt_state, policy, step_fn, batch_arrays, compiled=False
    )
    return report.total / 2**20


def train(
    row: str,
    hyper: Hyper,
    workload: Workload,
    data: task.Data,
    evaluate_on: dict[str, np.ndarray],
    seed: int,
    *,
    epochs: int,
    evals_per_epoch: int,
) -> dict[str, Any]:
    """Trains one run for ``epochs`` epochs, evaluating on ``evaluate_on`` along the way.

    ``seconds`` counts training only (compiles included, evaluations excluded).
    """
    controller, loss_fn = build_controller(row, hyper, workload, data, seed)
    samples_per_epoch = len(data.train["label"])
    eval_points = [
        round(samples_per_epoch * (e + (i + 1) / evals_per_epoch))
        for e in range(epochs)
        for i in range(evals_per_epoch)
    ]
    evals, batches = [], []
    train_seconds = 0.0
    for point in eval_points:
        start = time.perf_counter()
        while controller.sampler.samples_seen < point:
            info = controller.step()
            batches.append(info.batch_size)
        train_seconds += time.perf_counter() - start
        accuracy = task.evaluate(
            loss_fn, controller.params, controller.model_state, controller.policy, evaluate_on
        )
        evals.append(
            {
                "step": controller.step_count,
                "samples": controller.sampler.samples_seen,
                "seconds": train_seconds,
                # Compiles are one-off costs that the persistent cache hides from later runs.
                "compile_seconds": controller.timings["compile"],
                "accuracy": accuracy,
            }
        )
    run_batch = max(batches)
    policy = controller.policy
    leaves = {} if policy is None else {path: policy.compute(path) for path in policy}
    return {
        "row": row,
        "seed": seed,
        "hyper": dataclasses.asdict(hyper),
        "accuracy": evals[-1]["accuracy"],
        "steps": controller.step_count,
        "seconds": train_seconds,
        "run_batch": run_batch,
        "memory_mib": analytic_memory_mib(controller, loss_fn, data, run_batch),
        "evals": evals,
        "final_policy": {k: str(v) for k, v in leaves.items()},
        "replans": sum(1 for e in controller.event_records() if e.get("kind") == "replan"),
    }
