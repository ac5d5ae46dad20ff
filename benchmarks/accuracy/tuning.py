"""Tuning on the validation split, with the same number of trials for AdamW and Tri-Accel."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .runs import Hyper
from .runs import train
from .workloads import Splits
from .workloads import Workload

TRIACCEL_VARIANTS = ((1.0, 0.25, 4.0), (0.25, 0.5, 2.0), (0.5, 0.25, 4.0), (1.0, 0.5, 2.0))

TUNING_SEED = 1000  # tuning trials train at a seed that is not an evaluation seed


def log_grid(low: float, high: float, count: int) -> list[float]:
    """``count`` log-spaced values from ``low`` to ``high`` (``low`` alone for one)."""
    if count == 1:
        return [low]
    return [float(low * (high / low) ** (i / (count - 1))) for i in range(count)]


def tuning_trials(trials: int, lr_range: tuple[float, float]) -> tuple[list[Hyper], int, int]:
    """AdamW's trials, and how Tri-Accel splits the same number into learning rates and variants.

    Returns:
      ``(adamw_trials, triaccel_learning_rates, triaccel_variants)``: AdamW's ``trials``
      log-spaced learning rates; Tri-Accel first tries ``triaccel_learning_rates`` log-spaced
      learning rates over the same range at its default alpha and clip, then the first
      ``triaccel_variants`` of :data:`TRIACCEL_VARIANTS` at the best of them.
    """
    if trials < 2:
        raise ValueError(f"`trials` must be >= 2, got {trials}")
    variants = min(trials // 3, len(TRIACCEL_VARIANTS))
    adamw = [Hyper(lr) for lr in log_grid(*lr_range, trials)]
    return adamw, trials - variants, variants


def tune(
    workload: Workload, splits: Splits, trials: int, epochs: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Chooses AdamW's and Tri-Accel's hyperparameters on the validation split."""
    adamw_trials, lr_count, variant_count = tuning_trials(trials, workload.lr_range)
    records: dict[str, list[dict[str, Any]]] = {"fp32": [], "triaccel": []}

    def trial(row: str, hyper: Hyper) -> float:
        result = train(
            row,
            hyper,
            workload,
            splits.train,
            splits.validation,
            TUNING_SEED,
            epochs=epochs,
            evals_per_epoch=1,
        )
        records[row].append({"hyper": dataclasses.asdict(hyper), "validation": result["accuracy"]})
        log(f"  tune {row:>8} {hyper}: validation {100 * result['accuracy']:.2f}%")
        return result["accuracy"]

    best_adamw = max(adamw_trials, key=lambda h: trial("fp32", h))
    lr_trials = [Hyper(lr) for lr in log_grid(*workload.lr_range, lr_count)]
    scored = [(trial("triaccel", h), i, h) for i, h in enumerate(lr_trials)]
    for alpha, low, high in TRIACCEL_VARIANTS[:variant_count]:
        best_lr = max(scored, key=lambda s: (s[0], -s[1]))[2].lr
        hyper = Hyper(best_lr, alpha, low, high)
        scored.append((trial("triaccel", hyper), len(scored), hyper))
    # Ties go to the earlier trial (the default shape first).
    best_tri = max(scored, key=lambda s: (s[0], -s[1]))[2]
    return {"fp32": best_adamw, "triaccel": best_tri, "trials": records}
