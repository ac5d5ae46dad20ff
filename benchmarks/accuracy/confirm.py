"""Confirming a default on the validation split before the library changes it.

The tuning trials are one run each, at one tuning seed; an option that beats the defaults there
by a fraction of a point may have done so by the seed's luck. Before the library's defaults
change, the option :func:`report.picked_scale_options` picks for a row is run against the
defaults again, on the validation split only (never the test set), at more tuning seeds, each at
the learning rate the defaults were best at on that workload (where the option itself was
tried). The change is confirmed when the paired 95% interval of ``option - defaults`` over every
(workload, tuning seed) pair lies above 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from .report import DEFAULT_OPTIONS
from .report import SCALE_OPTIONS
from .report import picked_scale_options
from .report import scale_options
from .runs import Hyper
from .runs import train
from .stats import paired_interval
from .tuning import TUNING_SEED
from .workloads import WORKLOADS
from .workloads import load_splits

# Tuning seeds beyond the study's own (TUNING_SEED): never evaluation seeds (0-4).
CONFIRM_SEEDS = (1001, 1002, 1003, 1004)


def default_hyper(result: dict[str, Any], row: str) -> Hyper:
    """``row``'s best tuning trial at the default step-scale options on ``result``'s workload
    (the options were tried at its learning rate)."""
    at_defaults = [
        (t["validation"], -i, Hyper(**t["hyper"]))
        for i, t in enumerate(result["tuning"][row])
        if scale_options(t["hyper"]) == DEFAULT_OPTIONS
    ]
    if not at_defaults:
        raise ValueError(f"{result['workload']}: {row} has no tuning trial at the defaults")
    return max(at_defaults, key=lambda item: item[:2])[2]


def validation_of(result: dict[str, Any], row: str, hyper: Hyper) -> float | None:
    """The study's own tuning trial of ``row`` at ``hyper`` (tuning seed), or None."""
    wanted = dataclasses.asdict(hyper)
    return next((t["validation"] for t in result["tuning"][row] if t["hyper"] == wanted), None)


def decide(pairs: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """The verdict from ``(option, defaults)`` validation accuracies paired by workload and
    seed: confirmed when the paired 95% interval of the difference lies above 0."""
    mean, low, high = paired_interval([p[0] for p in pairs], [p[1] for p in pairs])
    return {"pairs": len(pairs), "mean": mean, "low": low, "high": high, "confirmed": low > 0}


def confirm(
    results: list[dict[str, Any]],
    row: str,
    log: Callable[[str], None],
    *,
    seeds: Sequence[int] = CONFIRM_SEEDS,
) -> dict[str, Any] | None:
    """Runs the option the study picks for ``row`` against the defaults on the validation
    split at ``seeds`` (plus the study's tuning seed, already run), over every workload.

    Returns:
      None when the study keeps the defaults; else the option, the per-run accuracies and
      :func:`decide`'s verdict.
    """
    option = picked_scale_options(results, row)
    if option == DEFAULT_OPTIONS:
        return None
    pairs, records = [], []
    for result in results:
        workload = WORKLOADS[result["workload"]]
        splits = load_splits(workload, quick=False)
        base = default_hyper(result, row)
        picked = dataclasses.replace(base, **dict(zip(SCALE_OPTIONS, option, strict=True)))
        for seed in (TUNING_SEED, *seeds):
            accuracies = []
            for hyper in (picked, base):
                accuracy = validation_of(result, row, hyper) if seed == TUNING_SEED else None
                if accuracy is None:
                    accuracy = train(
                        row,
                        hyper,
                        workload,
                        splits.train,
                        splits.validation,
                        seed,
                        epochs=result["epochs"],
                        evals_per_epoch=1,
                    )["accuracy"]
                accuracies.append(accuracy)
            log(
                f"  confirm {result['workload']} {row} seed {seed}: option "
                f"{100 * accuracies[0]:.2f}%, defaults {100 * accuracies[1]:.2f}%"
            )
            pairs.append((accuracies[0], accuracies[1]))
            records.append(
                {"workload": result["workload"], "seed": seed, "option": accuracies[0],
                 "defaults": accuracies[1]}
            )  # fmt: skip
    return {"row": row, "option": list(option), "runs": records, **decide(pairs)}
