"""Tuning on the validation split, with the same number of trials for every optimizer.

Each optimizer (each base row) gets ``trials`` trials, all scored by the final validation
accuracy of one run at :data:`TUNING_SEED`:

* AdamW: ``trials`` log-spaced learning rates over the workload's ``lr_range``;
* every other optimizer: ``trials - options`` log-spaced learning rates over its range
  (``lr_range`` for Tri-Accel, ``muon_lr_range`` for the Muon rows) at its default options,
  then its first ``options = trials // 3`` own options (:func:`row_options`) at the best of
  those rates. Ties go to the earlier trial (the defaults first).

Tri-Accel's step scale over Muon starts from Muon's chosen options (its Adam part's rate and how
it trains conv kernels), so Muon is tuned before it; its own options are Tri-Accel's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from .runs import BASE_ROWS
from .runs import DEFAULT_SCHEDULE
from .runs import Hyper
from .runs import Schedule
from .runs import train
from .workloads import Splits
from .workloads import Workload

# The earlier study's Tri-Accel variants of (alpha, min_scale, max_scale), in order
# (benchmarks/improvement_trial.py reads them).
TRIACCEL_VARIANTS = ((1.0, 0.25, 4.0), (0.25, 0.5, 2.0), (0.5, 0.25, 4.0), (1.0, 0.5, 2.0))
# Tri-Accel's own options (over Adam's direction and over Muon's), tried in order at the best
# learning rate: the smooth bound at the defaults, then a stronger, wider scale with each bound.
TRIACCEL_OPTIONS: tuple[dict[str, Any], ...] = (
    {"bound": "smooth"},
    {"alpha": 1.0, "min_scale": 0.25, "max_scale": 4.0},
    {"alpha": 1.0, "min_scale": 0.25, "max_scale": 4.0, "bound": "smooth"},
    {"alpha": 0.25},
)
# Muon's own options: conv kernels to Adam (optax's default labelling) instead of Muon through
# triaccel_jax.transforms.muon_dimension_numbers (only where the model has conv kernels), and
# its Adam part's learning rate.
MUON_OPTIONS: tuple[dict[str, Any], ...] = (
    {"conv": "adam"},
    {"adam_ratio": 0.3},
    {"adam_ratio": 0.03},
)

TUNING_SEED = 1000  # tuning trials train at a seed that is not an evaluation seed


def log_grid(low: float, high: float, count: int) -> list[float]:
    """``count`` log-spaced values from ``low`` to ``high`` (``low`` alone for one)."""
    if count == 1:
        return [low]
    return [float(low * (high / low) ** (i / (count - 1))) for i in range(count)]


def tuning_trials(trials: int, lr_range: tuple[float, float]) -> tuple[list[Hyper], int, int]:
    """AdamW's trials, and how another optimizer splits the same number into learning rates
    and options.

    Returns:
      ``(adamw_trials, learning_rates, options)``: AdamW's ``trials`` log-spaced learning
      rates; another optimizer first tries ``learning_rates`` log-spaced learning rates over its
      range at its default options, then ``options`` of its own options at the best of them.
    """
    if trials < 2:
        raise ValueError(f"`trials` must be >= 2, got {trials}")
    options = trials // 3
    adamw = [Hyper(lr) for lr in log_grid(*lr_range, trials)]
    return adamw, trials - options, options


def row_options(base: str, workload: Workload) -> tuple[dict[str, Any], ...]:
    """``base``'s own options (overrides of its hyperparameters), in the order they are tried."""
    if base == "adamw":
        return ()
    if base == "muon":
        return tuple(o for o in MUON_OPTIONS if workload.has_conv or "conv" not in o)
    return TRIACCEL_OPTIONS


def plan(base: str, workload: Workload, trials: int) -> tuple[list[float], list[dict[str, Any]]]:
    """``base``'s learning rates and options for ``trials`` trials (as many in all as AdamW's).

    An optimizer with fewer options than :func:`tuning_trials` gives it tries more learning
    rates instead.

    Raises:
      ValueError: ``trials`` < 2.
    """
    adamw, _, option_count = tuning_trials(trials, workload.lr_range)
    if base == "adamw":
        return [h.lr for h in adamw], []
    options = row_options(base, workload)[:option_count]
    lr_range = workload.lr_range if base == "triaccel" else workload.muon_lr_range
    return log_grid(*lr_range, trials - len(options)), list(options)


def best(scored: Sequence[tuple[float, int, Hyper]]) -> Hyper:
    """The trial of highest validation accuracy; ties go to the earlier trial."""
    return max(scored, key=lambda s: (s[0], -s[1]))[2]


def tune(
    workload: Workload,
    splits: Splits,
    trials: int,
    epochs: int,
    log: Callable[[str], None],
    *,
    rows: Sequence[str] = BASE_ROWS,
    schedule: Schedule = DEFAULT_SCHEDULE,
) -> dict[str, Any]:
    """Chooses each base row's hyperparameters on the validation split.

    Returns:
      ``{row: Hyper for each of rows, "trials": {row: [{"hyper", "validation"}, ...]}}``.
    """
    records: dict[str, list[dict[str, Any]]] = {}
    chosen: dict[str, Any] = {}
    # Tri-Accel over Muon starts from Muon's options: Muon first.
    order = sorted(rows, key=lambda r: BASE_ROWS.index(r))
    for row in order:
        records[row] = []

        def trial(hyper: Hyper, row: str = row) -> float:
            result = train(
                row,
                hyper,
                workload,
                splits.train,
                splits.validation,
                TUNING_SEED,
                epochs=epochs,
                evals_per_epoch=1,
                schedule=schedule,
            )
            records[row].append(
                {"hyper": dataclasses.asdict(hyper), "validation": result["accuracy"]}
            )
            log(
                f"  tune {row:>13} {hyper.describe(row, workload.has_conv)}: "
                f"validation {100 * result['accuracy']:.2f}%"
            )
            return result["accuracy"]

        start = Hyper(0.0)
        if row == "triaccel_muon" and "muon" in chosen:
            start = dataclasses.replace(
                start, adam_ratio=chosen["muon"].adam_ratio, conv=chosen["muon"].conv
            )
        learning_rates, options = plan(row, workload, trials)
        scored: list[tuple[float, int, Hyper]] = []
        for lr in learning_rates:
            hyper = dataclasses.replace(start, lr=lr)
            scored.append((trial(hyper), len(scored), hyper))
        best_lr = best(scored).lr
        for option in options:
            hyper = dataclasses.replace(start, lr=best_lr, **option)
            scored.append((trial(hyper), len(scored), hyper))
        chosen[row] = best(scored)
        log(f"  {row}: chose {chosen[row].describe(row, workload.has_conv)}")
    return {**chosen, "trials": records}
