"""The main job's command line: its arguments, their checks, and the output folder's."""

from __future__ import annotations

import argparse
import math
import pathlib
import tempfile
from collections.abc import Sequence

from triaccel_jax.cli._runs import RUNS
from triaccel_jax.cli._task import MODELS

DATASETS = ("auto", "fashion_mnist", "digits", "cifar10", "cifar100")

# The settings that depend on the data set, where not given: two epochs of Fashion-MNIST (or
# CIFAR) at batch 128, or, on the 1,437 images of the embedded digits, enough epochs at a small
# batch that the batch grows and precision is re-planned more than once (about 1,800 steps at
# batch 32 for the fixed runs; a few seconds a run on two CPU cores).
WORKLOADS = {
    "digits": dict(epochs=40, batch_size=32, max_batch=128, replan_every=100, eval_every=100),
    "default": dict(epochs=2, batch_size=128, max_batch=256, replan_every=100, eval_every=200),
}
# Tri-Accel's optimizer-state cap, bytes per parameter of parameters plus Adam's two moments: below
# float32's 12 and above uniform int8's (about 6.1 on the small CNN), so that the plan stores the
# leaves where rounding costs least in 8 bits (on the small CNN, Dense_0/kernel: 95% of the
# parameters) and keeps the others above (docs/results.md: int8 state is within seed noise of
# float32; 4-bit state gains a few hundred KiB more there for a larger error).
STATE_CAP = 6.5
DESCRIPTION = "The main job: FP32 AdamW, static bf16 AdamW and Tri-Accel side by side on real data."


def check_output_dir(path: pathlib.Path) -> pathlib.Path:
    """Creates ``path`` and checks it is writable, before any training."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as error:
        raise SystemExit(
            f"error: output dir {path} is not writable: {error.strerror or error}"
        ) from None
    return path


def fill_workload(args: argparse.Namespace, dataset: str) -> argparse.Namespace:
    """``args`` with the data-dependent settings not given on the command line filled in for
    ``dataset`` (:data:`WORKLOADS`).

    Example::

      >>> args = parse_args(["--epochs", "3"])
      >>> filled = fill_workload(args, "digits")
      >>> filled.epochs, filled.batch_size, filled.max_batch
      (3, 32, 128)
    """
    for name, value in WORKLOADS.get(dataset, WORKLOADS["default"]).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def image_shape(text: str) -> tuple[int, int, int]:
    """``"32x32x3"`` as ``(32, 32, 3)`` (``argparse`` type of ``--image-shape``)."""
    try:
        height, width, channels = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxWxC, like 32x32x3, got {text!r}") from None
    if min(height, width, channels) < 1:
        raise argparse.ArgumentTypeError(f"every size must be >= 1, got {text!r}")
    return height, width, channels


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed, checked arguments (``argparse`` exits with a message on a bad one)."""
    parser = argparse.ArgumentParser(
        prog="python -m triaccel_jax",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default="auto",
        help="data set; auto: Fashion-MNIST if its files are found (see --data-dir), else digits",
    )
    parser.add_argument("--model", choices=MODELS, default="auto", help="model; auto: small_cnn")
    parser.add_argument(
        "--epochs", type=int, default=None, help="training epochs per run (default: see below)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="batch of the fixed runs; Tri-Accel's start and reference batch (default: see below)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="largest batch Tri-Accel may grow to (default: see below)",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate at --batch-size")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of init, data order and augmentation"
    )
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="which runs")
    parser.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="memory budget of Tri-Accel's controller; default: the device's limit, or half the free RAM on CPU",
    )
    parser.add_argument(
        "--replan-every",
        type=int,
        default=None,
        help="steps between precision re-plans (default: see below)",
    )
    parser.add_argument(
        "--first-replan",
        type=int,
        default=20,
        help="step of Tri-Accel's first precision plan (made without hysteresis), then every "
        "--replan-every steps (benchmarks/planner_budget.py: 20 steps of signals plan as 300 do)",
    )
    parser.add_argument("--check-every", type=int, default=10, help="steps between memory checks")
    parser.add_argument(
        "--state-cap",
        type=float,
        default=STATE_CAP,
        metavar="BYTES",
        help="Tri-Accel's optimizer-state cap: parameters plus Adam's two moments, in bytes per "
        "parameter (plan_state_formats' max_bytes_per_parameter). The plan stores each leaf's "
        "moments in fp32, bf16, int8 or int4, lowering first the leaves whose signals say "
        "rounding costs the least loss per byte saved. FP32 AdamW takes 12; uniform int8 about "
        "6.1 and int4 about 4.6 (the small CNN); the default keeps the largest leaves in 8 bits "
        "and the rest above; 12 or more keeps the state float32",
    )
    parser.add_argument(
        "--state-plan-step",
        type=int,
        default=20,
        help="the step at which Tri-Accel's state plan reads the run's own curvature and noise "
        "signals (until then the moments are stored in the formats their sizes give under "
        "--state-cap; a plan that differs converts them, and the run goes on from that step)",
    )
    parser.add_argument(
        "--compile-in-background",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile a grown batch's or a new policy's step on a worker thread while training "
        "goes on (Tri-Accel); default: on with an accelerator, off on a CPU, where the worker "
        "and the steps share the same cores and the compile can trail the steps for hundreds "
        "of them",
    )
    parser.add_argument(
        "--output-dir",
        type=pathlib.Path,
        default=pathlib.Path("triaccel_output"),
        help="folder for results.md, results.json and the PNG plots",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="data folder: Fashion-MNIST's IDX files are looked for in DIR and DIR/fashion-mnist "
        "before $TRIACCEL_DATA_DIR and Debian's /usr/share/datasets/fashion-mnist; CIFAR's "
        "tensorflow-datasets data_dir",
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="where Fashion-MNIST is not found, neither download it (official source, MD5s "
        "verified, into DIR/fashion-mnist: --data-dir, else $TRIACCEL_DATA_DIR, else "
        "~/.cache/triaccel_jax/data) nor, as root, install Debian's dataset-fashion-mnist; "
        "--dataset auto then uses the embedded digits",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="also measure test accuracy every N steps (for the time to FP32's accuracy; "
        "evaluations are not counted in the wall time; default: see below)",
    )
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop each run after this many steps"
    )
    parser.add_argument(
        "--train-subset", type=int, default=None, help="use only the first N training samples"
    )
    parser.add_argument(
        "--test-subset", type=int, default=None, help="use only the first N test samples"
    )
    parser.add_argument(
        "--image-shape",
        type=image_shape,
        default=None,
        metavar="HxWxC",
        help="pad images (zeros, centred) and replicate one channel to this shape, e.g. "
        "32x32x3 for Fashion-MNIST into a CIFAR ResNet-18",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    parser.add_argument(
        "--compilation-cache",
        type=pathlib.Path,
        default=None,
        metavar="DIR",
        help="JAX's persistent compilation cache folder; default: $TRIACCEL_COMPILATION_CACHE "
        "(0 or off: no cache), else $XDG_CACHE_HOME/triaccel_jax/jax (~/.cache/...)",
    )
    parser.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="compile everything afresh (no persistent compilation cache)",
    )
    parser.epilog = "Defaults that depend on the data set: " + "; ".join(
        f"{name}: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items())
        for name, settings in WORKLOADS.items()
    )
    args = parser.parse_args(argv)
    if args.check_every < 1:
        parser.error("--check-every must be >= 1")
    for name in ("max_steps", "train_subset", "test_subset", *WORKLOADS["default"]):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error("--lr must be a positive number")
    if args.budget_mib is not None and not args.budget_mib > 0:
        parser.error("--budget-mib must be positive")
    if not (args.state_cap > 0 and math.isfinite(args.state_cap)):
        parser.error("--state-cap must be a positive number of bytes per parameter")
    if args.state_plan_step < 1:
        parser.error("--state-plan-step must be >= 1")
    if args.compilation_cache is not None and args.no_compilation_cache:
        parser.error("--compilation-cache and --no-compilation-cache contradict each other")
    return args
