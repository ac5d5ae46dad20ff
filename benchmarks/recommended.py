"""The README's recommended configuration, run as the README shows it, with the defaults.

The accuracy study (benchmarks/accuracy.py, docs/accuracy.md) chose Muon behind the observer
with planned precision and the goodput batch; its runs set the controller's options by hand. This
runs the code block of the README's "The recommended configuration" as a reader pastes it (the
block is read from README.md and executed), under ``triaccel_jax.Controller(loss_fn, params, tx,
data, batch_size=128)`` with every other setting at its default, for two epochs on the study's
training split (Fashion-MNIST less the 6,000 validation images, the small CNN), and compares the
test accuracy with the study's row: 91.47% ± 0.24 (5 seeds), whose 95% interval for the mean is
91.47 ± t(4) x 0.24 / sqrt(5) = [91.17, 91.77].

Usage: .venv/bin/python benchmarks/recommended.py [--seeds 0 1 2 3 4] [--quick]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re
import sys
import time

import jax
import numpy as np
import optax

import triaccel_jax
from triaccel_jax.cli import _task as task

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from accuracy.workloads import WORKLOADS
from accuracy.workloads import load_splits

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The study's row "Muon + precision + goodput batch" (docs/accuracy.md): mean, sd, seeds.
STUDY = (91.47, 0.24, 5)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def readme_configuration() -> dict:
    """The names the README's recommended-configuration block defines (``recommended``, ``tx``)."""
    section = (ROOT / "README.md").read_text().split("## The recommended configuration", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {"optax": optax, "triaccel_jax": triaccel_jax}
    exec(compile(block, "README.md", "exec"), namespace)
    return namespace


def interval(mean: float, sd: float, n: int) -> tuple[float, float]:
    half = T_975[n - 1] * sd / math.sqrt(n) if n > 1 else float("inf")
    return mean - half, mean + half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke test on a tiny subset")
    args = parser.parse_args()
    workload = WORKLOADS["fashion_cnn"]
    splits = load_splits(workload, args.quick)
    data, test = splits.train.train, splits.test  # the test set (splits.validation is not used)
    tx = readme_configuration()["tx"]
    print(
        f"{len(data['label'])} training images, {len(test['label'])} test images; tx from "
        f"README.md; jax {jax.__version__}, {jax.default_backend()}"
    )
    accuracies = []
    for seed in args.seeds:
        model = workload.model()
        loss_fn = task.make_loss(model, False, None)
        params = model.init(jax.random.key(seed), data["image"][:2])["params"]
        start = time.perf_counter()
        controller = triaccel_jax.Controller(
            loss_fn, params, tx, data, has_aux=True, seed=seed, batch_size=128
        )
        infos = controller.run(epochs=args.epochs)
        seconds = time.perf_counter() - start
        accuracy = 100 * task.evaluate(
            loss_fn, controller.params, controller.model_state, controller.policy, test
        )
        accuracies.append(accuracy)
        sizes = sorted({i.batch_size for i in infos})
        replans = sum(e.kind == "replan" for e in controller.events)
        print(
            f"seed {seed}: {accuracy:.2f}% in {seconds:.0f} s ({controller.timings['compile']:.0f} "
            f"s compiling), {controller.step_count} steps, batches {sizes}, {replans} re-plans, "
            f"policy {controller.policy.signature if controller.policy else None}",
            flush=True,
        )
    mean = float(np.mean(accuracies))
    sd = float(np.std(accuracies, ddof=1)) if len(accuracies) > 1 else float("nan")
    low, high = interval(*STUDY)
    print(
        f"README configuration with defaults: {mean:.2f}% ± {sd:.2f} ({len(accuracies)} seeds); "
        f"the study's row {STUDY[0]:.2f}% ± {STUDY[1]:.2f} ({STUDY[2]}), its 95% interval for "
        f"the mean [{low:.2f}, {high:.2f}]: {'within' if low <= mean <= high else 'OUTSIDE'}"
    )
    if len(accuracies) > 1:
        ours = interval(mean, sd, len(accuracies))
        print(f"this run's 95% interval for the mean: [{ours[0]:.2f}, {ours[1]:.2f}]")


if __name__ == "__main__":
    main()
