"""The gradient noise scale of AdamW measured on the raw and on the preconditioned gradient.

Goodput's efficiency model and AdaScale's gain read the gradient noise scale ``B_simple =
tr(Sigma) / |G|^2``. For an Adam-like direction AdaptDL measures it on the preconditioned
gradient ``g / (sqrt(nu) + eps)`` (``noise_estimator="preconditioned"``), because that is what
the update follows. This study measures both on the same steps, so that the choice rests on a
figure: one run of the small CNN on Fashion-MNIST (the goodput study's split and AdamW), trained
through ``triaccel_jax.Controller`` with ``noise_estimator="preconditioned"`` at a fixed batch,
whose every step reports the raw norms beside the preconditioned ones; each pair is folded into
its own per-sample average (``controller._noise_scale.observe_noise``, the controller's horizon).

Printed per estimator, after the first ``--skip`` steps: the noise scale at 10%, 50% and 100% of
the run; how steady it is (the 5-95% range of the estimate ten steps later over the current
one); the width of its 95% interval relative to the estimate; and the batch goodput's cap
(``critical_multiple`` = 1 noise scale) would allow at the end.

Run from the repository root::

    .venv/bin/python benchmarks/noise_estimators.py            # one epoch at batch 32
    .venv/bin/python benchmarks/noise_estimators.py --quick    # a smoke test on 2,048 images
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import goodput as study  # the goodput study's split and settings

import triaccel_jax
from triaccel_jax.cli import _task as task
from triaccel_jax.controller._config import NOISE_HORIZON_STEPS
from triaccel_jax.controller._noise_scale import NoiseScaleEstimate
from triaccel_jax.controller._noise_scale import observe_noise

ESTIMATORS = {"raw": "", "preconditioned": "preconditioned_"}


def measure(batch: int, lr: float, images: int | None, seed: int) -> dict[str, Any]:
    """One run at ``batch``; per estimator, the noise scale and its interval after each step."""
    splits = study.load_splits(quick=False)
    train = splits.train
    if images is not None:
        train = {k: v[:images] for k, v in train.items()}
    model = triaccel_jax.models.SmallCNN(num_classes=10)
    params = model.init(jax.random.key(seed), train["image"][:2])["params"]
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=lr, weight_decay=study.WEIGHT_DECAY)
    controller = triaccel_jax.Controller(
        task.make_loss(model, False, None),
        params,
        tx,
        train,
        has_aux=True,
        seed=seed,
        min_batch=batch,
        max_batch=batch,
        batch_rule="memory",
        lr_scaling="none",
        measure_noise_scale=True,
        noise_estimator="preconditioned",
        probe=triaccel_jax.BudgetMemoryProbe(study.BUDGET_BYTES),
    )
    steps = len(train["label"]) // batch
    horizon = NOISE_HORIZON_STEPS * batch
    states = dict.fromkeys(ESTIMATORS, NoiseScaleEstimate())
    series: dict[str, dict[str, list[float | None]]] = {
        name: {"simple": [], "low": [], "high": []} for name in ESTIMATORS
    }
    for info in controller.run(steps):
        for name, prefix in ESTIMATORS.items():
            states[name] = observe_noise(
                states[name],
                grad_sq_norm=info.metrics[f"{prefix}grad_sq_norm"],
                sub_grad_sq_norm=info.metrics[f"{prefix}micro_grad_sq_norm"],
                batch=info.batch_size,
                sub_batch=info.batch_size // 2,
                horizon=horizon,
            )
            interval = states[name].interval()
            series[name]["simple"].append(states[name].simple)
            series[name]["low"].append(None if interval is None else interval[0])
            series[name]["high"].append(None if interval is None else interval[1])
    return {"batch": batch, "lr": lr, "steps": steps, "horizon": horizon, "series": series}


def summarize(run: dict[str, Any], skip: int) -> dict[str, dict[str, float]]:
    """Per estimator: the estimate at 10%, 50%, 100%, its steadiness and interval width."""
    out = {}
    for name, s in run["series"].items():
        values = np.array([np.nan if v is None else v for v in s["simple"]], dtype=float)
        low = np.array([np.nan if v is None else v for v in s["low"]], dtype=float)
        high = np.array([np.nan if v is None else v for v in s["high"]], dtype=float)
        kept = values[skip:]
        ratio = kept[10:] / kept[:-10]
        ratio = ratio[np.isfinite(ratio)]
        n = len(values)
        out[name] = {
            "at_10%": float(values[n // 10]),
            "at_50%": float(values[n // 2]),
            "final": float(values[-1]),
            "steady_5%": float(np.percentile(ratio, 5)) if ratio.size else float("nan"),
            "steady_95%": float(np.percentile(ratio, 95)) if ratio.size else float("nan"),
            "interval_width": float(np.nanmedian((high[skip:] - low[skip:]) / kept)),
        }
    return out


def markdown(run: dict[str, Any], summary: dict[str, dict[str, float]]) -> str:
    lines = [
        f"Small CNN, AdamW lr {run['lr']:g}, batch {run['batch']}, {run['steps']} steps, noise "
        f"horizon {run['horizon']} samples.",
        "",
        "| estimator | at 10% | at 50% | final | ten steps on / now (5-95%) "
        "| 95% interval width / estimate (median) |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for name, f in summary.items():
        lines.append(
            f"| {name} | {f['at_10%']:.4g} | {f['at_50%']:.4g} | {f['final']:.4g} "
            f"| {f['steady_5%']:.2f}-{f['steady_95%']:.2f} | {f['interval_width']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=4e-3, help="the goodput study's tuned rate")
    parser.add_argument("--skip", type=int, default=100, help="steps left out of the figures")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    try:
        run = measure(args.batch, args.lr, 2048 if args.quick else None, seed=0)
    except FileNotFoundError as error:
        print(f"noise_estimators.py needs Fashion-MNIST: {error}", file=sys.stderr)
        return 2
    skip = min(args.skip, run["steps"] // 4)
    summary = summarize(run, skip)
    print(markdown(run, summary))
    if args.out is not None:
        args.out.write_text(json.dumps({"run": run, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
