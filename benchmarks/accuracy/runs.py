"""The study's rows: each row's optimizer, precision and batch, and one measured run."""

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

# The optimizers, each trained at a fixed batch in float32 and tuned on its own.
BASE_ROWS = ("adamw", "triaccel", "muon", "triaccel_muon")
# Each optimizer again with planned precision and the goodput batch on (``_adapt``), at its base
# row's tuned hyperparameters.
ADAPT_SUFFIX = "_adapt"
ROWS = BASE_ROWS + tuple(row + ADAPT_SUFFIX for row in BASE_ROWS)
ROW_LABELS = {
    "adamw": "AdamW",
    "triaccel": "Tri-Accel (triaccel)",
    "muon": "Muon",
    "triaccel_muon": "Tri-Accel step scale over Muon",
    "adamw_adapt": "AdamW + precision + goodput batch",
    "triaccel_adapt": "Tri-Accel + precision + goodput batch",
    "muon_adapt": "Muon + precision + goodput batch",
    "triaccel_muon_adapt": "scale over Muon + precision + goodput batch",
}
# The earlier study's row names that benchmarks/improvement_trial.py still builds.
LEGACY_ROWS = {"fp32": "adamw", "curvature": "triaccel"}

DEFAULT_SHAPE = (0.5, 0.5, 2.0)  # triaccel's defaults: alpha, min_scale, max_scale
WEIGHT_DECAY = 1e-4  # AdamW's, Tri-Accel's and both parts of Muon's
BUDGET_BYTES = 2 * 2**30  # the adapt rows' fixed memory budget
# The main job's precision schedule: a first plan (without hysteresis) at step 20, then a
# re-plan every 100 steps.
FIRST_REPLAN, REPLAN_EVERY = 20, 100
CHECK_EVERY = 10  # steps between the controller's memory and batch checks


def base_row(row: str) -> str:
    """The optimizer row ``row`` runs (``"triaccel"`` for ``"triaccel_adapt"``)."""
    row = LEGACY_ROWS.get(row, row)
    base = row.removesuffix(ADAPT_SUFFIX)
    if base not in BASE_ROWS:
        raise ValueError(f"unknown row {row!r}; choose from {ROWS}")
    return base


def is_adapt(row: str) -> bool:
    """Whether ``row`` plans precision and moves its batch by goodput."""
    return row.endswith(ADAPT_SUFFIX)


@dataclasses.dataclass(frozen=True)
class Hyper:
    """A configuration's tunable hyperparameters (each row reads those of its optimizer)."""

    lr: float
    alpha: float = DEFAULT_SHAPE[0]  # Tri-Accel's step scale: exponent
    min_scale: float = DEFAULT_SHAPE[1]  # and its bounds
    max_scale: float = DEFAULT_SHAPE[2]
    bound: str = "clip"  # TriAccelConfig(bound=...): "clip" or "smooth"
    adam_ratio: float = 0.1  # Muon: the Adam part's learning rate / Muon's learning rate
    conv: str = "muon"  # Muon: conv kernels trained by "muon" (muon_dimension_numbers) or "adam"

    def describe(self, base: str, conv: bool = True) -> str:
        """The hyperparameters ``base``'s optimizer reads, in words (``conv``: whether the
        model has conv kernels, whose treatment by Muon is then one of them)."""
        text = f"lr {self.lr:.3g}"
        if base in ("muon", "triaccel_muon"):
            text += f", Adam part lr x{self.adam_ratio:g}"
            if conv:
                text += f", conv by {self.conv}"
        if base in ("triaccel", "triaccel_muon"):
            text += f", alpha {self.alpha:g}, {self.bound} [{self.min_scale:g}, {self.max_scale:g}]"
        return text


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The controller's rhythm: memory and batch checks, precision re-plans."""

    check_every: int = CHECK_EVERY
    first_replan: int = FIRST_REPLAN
    replan_every: int = REPLAN_EVERY


DEFAULT_SCHEDULE = Schedule()


def optimizer(row: str, hyper: Hyper) -> optax.GradientTransformation:
    """``row``'s optimizer at ``hyper``, its learning rate injected (the controller scales it).

    The whole optimizer is built inside ``optax.inject_hyperparams`` with ``learning_rate`` its
    one hyperparameter, so scaling the injected rate with the batch scales every part of it
    (Muon's Adam part keeps ``adam_ratio`` of it). The adapt rows of AdamW and Muon put
    :func:`triaccel_jax.curvature_signals` first in the chain: the updates are unchanged, and the
    planner and the controller get the curvature and noise signals they read; Tri-Accel's rows
    hold those signals already.
    """
    base, observe = base_row(row), is_adapt(row)
    # No config at the default bound: benchmarks/improvement_trial.py swaps in its own.
    config = None if hyper.bound == "clip" else triaccel_jax.TriAccelConfig(bound=hyper.bound)
    shape = dict(alpha=hyper.alpha, min_scale=hyper.min_scale, max_scale=hyper.max_scale)
    numbers = triaccel_jax.transforms.muon_dimension_numbers if hyper.conv == "muon" else None
    # Looked up now, not at each update: benchmarks/improvement_trial.py swaps it while the
    # controller is built.
    triaccel = triaccel_jax.triaccel

    def build(learning_rate: Any) -> optax.GradientTransformation:
        if base == "triaccel":
            return triaccel(learning_rate, weight_decay=WEIGHT_DECAY, config=config, **shape)
        if base == "adamw":
            direction = optax.adamw(learning_rate, weight_decay=WEIGHT_DECAY)
        else:
            direction = optax.contrib.muon(
                learning_rate,
                weight_decay=WEIGHT_DECAY,
                adam_weight_decay=WEIGHT_DECAY,
                adam_learning_rate=hyper.adam_ratio * learning_rate,
                muon_weight_dimension_numbers=numbers,
            )
        if base == "triaccel_muon":
            return triaccel_jax.scale_by_curvature(direction, config=config, **shape)
        if observe:
            return optax.chain(triaccel_jax.curvature_signals(), direction)
        return direction

    return optax.inject_hyperparams(build)(learning_rate=hyper.lr)


def build_controller(
    row: str,
    hyper: Hyper,
    workload: Workload,
    data: task.Data,
    seed: int,
    *,
    schedule: Schedule = DEFAULT_SCHEDULE,
) -> tuple[triaccel_jax.Controller, Callable[..., Any]]:
    """The controller and loss of ``row`` at ``hyper``: the same init and data order per seed.

    Base rows train at the workload's batch (``batch_rule="memory"`` with one bucket: no noise
    measurement, no split steps) in float32. Adapt rows re-plan precision (the controller's
    default ``precision_rule="speed"``) from step ``schedule.first_replan`` and every
    ``schedule.replan_every`` steps, and move the batch by goodput (``batch_rule="goodput"``,
    the default) between ``min(32, batch)`` and ``workload.max_batch``, with square-root
    learning-rate scaling from the workload's batch, under a fixed memory budget.
    """
    base_row(row)  # checks the name
    model = workload.model()
    loss_fn = task.make_loss(model, workload.has_state, None)
    init_kwargs = {"train": False} if workload.has_state else {}
    variables = model.init(jax.random.key(seed), data.train["image"][:2], **init_kwargs)
    params, model_state = variables["params"], variables.get("batch_stats")
    settings: dict[str, Any] = dict(
        has_aux=True,
        seed=seed,
        reference_batch=workload.batch,
        batch_size=workload.batch,
        check_every=schedule.check_every,
        # A fixed budget, not the free RAM of a shared machine, so the decisions repeat.
        probe=triaccel_jax.BudgetMemoryProbe(BUDGET_BYTES),
        # Compiles in the step that decides: deterministic, and not competing with training.
        compile_in_background=False,
    )
    if is_adapt(row):
        settings.update(
            min_batch=min(32, workload.batch),
            max_batch=workload.max_batch,
            batch_rule="goodput",
            lr_scaling="sqrt",
            replan_every=schedule.replan_every,
            first_replan=schedule.first_replan,
        )
    else:
        settings.update(
            min_batch=workload.batch,
            max_batch=workload.batch,
            batch_rule="memory",
            lr_scaling="none",
            replan_every=None,  # float32 throughout (the default plans when signals are held)
        )
    controller = triaccel_jax.Controller(
        loss_fn, params, optimizer(row, hyper), data.train, model_state=model_state, **settings
    )
    return controller, loss_fn


def analytic_memory_mib(
    controller: triaccel_jax.Controller, loss_fn: Any, data: task.Data, batch: int
) -> float:
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
    schedule: Schedule = DEFAULT_SCHEDULE,
) -> dict[str, Any]:
    """Trains one run for ``epochs`` epochs, evaluating on ``evaluate_on`` along the way.

    ``seconds`` (of the run and of each evaluation) is the wall time inside ``Controller.run``
    less the XLA compiles (or persistent-cache loads) the controller timed there: training only.
    Evaluations run outside it.
    """
    controller, loss_fn = build_controller(row, hyper, workload, data, seed, schedule=schedule)
    samples_per_epoch = len(data.train["label"])
    eval_points = [
        round(samples_per_epoch * (e + (i + 1) / evals_per_epoch))
        for e in range(epochs)
        for i in range(evals_per_epoch)
    ]
    largest = max(controller.buckets)
    evals, batches = [], []
    wall = 0.0
    for point in eval_points:
        while controller.sampler.samples_seen < point:
            # Counted at the largest bucket, so that a batch that grows inside the call cannot
            # carry it more than a step past the evaluation point.
            steps = max(1, -(-(point - controller.sampler.samples_seen) // largest))
            compiled = controller.timings["compile"]
            start = time.perf_counter()
            infos = controller.run(steps)
            wall += time.perf_counter() - start - (controller.timings["compile"] - compiled)
            batches.extend(info.batch_size for info in infos)
        accuracy = task.evaluate(
            loss_fn, controller.params, controller.model_state, controller.policy, evaluate_on
        )
        evals.append(
            {
                "step": controller.step_count,
                "samples": controller.sampler.samples_seen,
                "seconds": wall,
                "accuracy": accuracy,
            }
        )
    run_batch = max(batches)
    policy = controller.policy
    leaves = {} if policy is None else {path: policy.compute(path) for path in policy}
    kinds = [e.kind for e in controller.events]
    return {
        "row": row,
        "seed": seed,
        "hyper": dataclasses.asdict(hyper),
        "accuracy": evals[-1]["accuracy"],
        "steps": controller.step_count,
        "samples": controller.sampler.samples_seen,
        "seconds": wall,
        "compile_seconds": controller.timings["compile"],
        "run_batch": run_batch,
        "final_batch": controller.batch_size,
        "grows": kinds.count("grow"),
        "shrinks": kinds.count("shrink"),
        "memory_mib": analytic_memory_mib(controller, loss_fn, data, run_batch),
        "evals": evals,
        "final_policy": {k: str(v) for k, v in leaves.items()},
        # Re-plans run, and those that changed the policy.
        "plans": sum(controller.config.replan_due(step) for step in range(controller.step_count)),
        "replans": sum(1 for e in controller.event_records() if e.get("kind") == "replan"),
    }
