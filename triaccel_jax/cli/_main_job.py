"""The main job: FP32 AdamW, static bf16 AdamW and Tri-Accel side by side on real data.

``python -m triaccel_jax`` (or the ``triaccel`` console script) trains one model three times on
the same data and seed, each run through a :class:`triaccel_jax.Controller`:

* ``fp32``: ``optax.adamw`` in float32 at a fixed batch;
* ``bf16``: ``optax.adamw`` with every layer computing in bfloat16 (fp32 masters and state) at
  the same fixed batch: static mixed precision;
* ``triaccel``: ``triaccel_jax.triaccel`` (curvature step sizes), the planner re-planning each
  leaf's precision every ``--replan-every`` steps, and the batch following the memory budget
  (buckets up to ``--max-batch``, square-root learning-rate scaling).

It prints a table (wall time, steps, memory by ``memory_report`` and by XLA's compiled analysis,
test accuracy) and writes it with PNG plots and a JSON record to ``--output-dir``. Each run's
memory is given twice, each labelled with its batch: at the largest batch the run trained at
(what it really needed), and at the common batch ``--batch-size`` (the like-for-like comparison
the "vs FP32" ratio is taken at).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from triaccel_jax.controller import _controller as controller_lib
from triaccel_jax.controller import _memory_probe as memory_probe
from triaccel_jax.flax import _precision as flax_precision
from triaccel_jax.precision import _casting as precision
from triaccel_jax.precision import _memory as memory
from triaccel_jax.precision import _policy as policy_lib
from triaccel_jax.transforms import _alias as alias

MODELS = ("auto", "small_cnn", "resnet20", "resnet18", "efficientnet_b0")
DATASETS = ("auto", "fashion_mnist", "digits", "cifar10", "cifar100")
RUNS = ("fp32", "bf16", "triaccel")
RUN_LABELS = {"fp32": "FP32 AdamW", "bf16": "static bf16 AdamW", "triaccel": "Tri-Accel"}


@dataclasses.dataclass
class Data:
    name: str
    train: dict[str, np.ndarray]
    test: dict[str, np.ndarray]
    num_classes: int
    channel_stats: tuple[Any, Any] | None  # CIFAR: (mean, std); crop, flip and normalise


@dataclasses.dataclass
class RunResult:
    """One run's figures.

    ``run_batch`` is the largest batch the run trained at; ``common_batch`` the batch every run's
    memory is also measured at (``--batch-size``). The ``*_mib`` figures are ``memory_report``'s
    total and XLA's compiled figure of one step under the run's final policy at that batch.
    """

    name: str
    seconds: float
    steps: int
    final_batch: int
    run_batch: int
    run_batch_memory_mib: float
    run_batch_compiled_mib: float | None
    common_batch: int
    common_batch_memory_mib: float
    common_batch_compiled_mib: float | None
    accuracy: float
    history: list[dict[str, float]]
    epoch_accuracy: list[float]
    evals: list[dict[str, float]]
    events: list[dict[str, Any]]
    policies: list[dict[str, Any]]  # {"step": the first step it ran, "leaves": {path: dtype}}

    @property
    def memory_mib(self) -> float:
        """``memory_report``'s total at the common batch, the figure runs are compared by."""
        return self.common_batch_memory_mib


# -- data and models ------------------------------------------------------------------------------


def load_data(
    name: str, *, data_dir: str | None, train_subset: int | None, test_subset: int | None
):
    """The data set ``name`` ("auto": Fashion-MNIST if installed, else digits)."""
    from triaccel_jax import data as data_lib

    if name == "auto":
        name = "fashion_mnist" if data_lib.FASHION_MNIST_DIR.exists() else "digits"
    if name == "fashion_mnist":
        train, test = data_lib.load_fashion_mnist("train"), data_lib.load_fashion_mnist("test")
        classes, stats = 10, None
    elif name == "digits":
        train, test = data_lib.load_digits("train"), data_lib.load_digits("test")
        classes, stats = 10, None
    else:
        train = data_lib.load_cifar(name, "train", data_dir=data_dir)
        test = data_lib.load_cifar(name, "test", data_dir=data_dir)
        classes = 10 if name == "cifar10" else 100
        stats = (
            (data_lib.CIFAR10_MEAN, data_lib.CIFAR10_STD)
            if name == "cifar10"
            else (data_lib.CIFAR100_MEAN, data_lib.CIFAR100_STD)
        )

    def as_dict(split, limit):
        images, labels = split.images, split.labels
        if limit is not None:
            images, labels = images[:limit], labels[:limit]
        return {"image": np.asarray(images, np.float32), "label": np.asarray(labels, np.int32)}

    return Data(name, as_dict(train, train_subset), as_dict(test, test_subset), classes, stats)


def build_model(name: str, num_classes: int) -> tuple[Any, bool]:
    """The Linen model and whether it takes ``train=`` (and has batch statistics)."""
    from triaccel_jax import models

    if name in ("auto", "small_cnn"):
        return models.SmallCNN(num_classes=num_classes), False
    if name == "resnet20":
        return models.ResNet20(num_classes=num_classes), True
    if name == "resnet18":
        return models.ResNet18(num_classes=num_classes), True
    if name == "efficientnet_b0":
        return models.EfficientNetB0(num_classes=num_classes, stem_stride=1), True
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


def make_loss(
    model: Any, has_state: bool, channel_stats: tuple[Any, Any] | None
) -> Callable[..., Any]:
    """The controller's loss: cross-entropy, with accuracy as a metric.

    With ``channel_stats`` (CIFAR), training images get the standard random crop and flip, and
    all images are normalised per channel.
    """
    from triaccel_jax import data as data_lib

    def logits_of(params, images, policy, model_state, rng, train):
        if channel_stats is not None:
            images = data_lib.normalize(images, *channel_stats)
        variables = {"params": params if policy is None else precision.cast_params(params, policy)}
        kwargs: dict[str, Any] = {"rngs": {"dropout": rng}} if train else {}
        if has_state:
            variables["batch_stats"] = model_state
            kwargs["train"] = train
            if train:
                kwargs["mutable"] = ["batch_stats"]
        if policy is None:
            out = model.apply(variables, images, **kwargs)
        else:
            out = flax_precision.apply_with_policy(
                model, variables, images, policy=policy, **kwargs
            )
        logits, updates = out if isinstance(out, tuple) else (out, {})
        return logits.astype(jnp.float32), updates.get("batch_stats", model_state)

    def loss_fn(params, batch, *, policy, rng, model_state=None):
        images = batch["image"]
        if channel_stats is not None:
            images = data_lib.random_crop_flip(jax.random.fold_in(rng, 1), images)
        logits, new_state = logits_of(params, images, policy, model_state, rng, True)
        labels = batch["label"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        aux = {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}
        if has_state:
            aux["model_state"] = new_state
        return loss, aux

    loss_fn.logits_of = logits_of  # type: ignore[attr-defined]
    return loss_fn


@functools.lru_cache(maxsize=8)
def _predictor(loss_fn: Callable[..., Any], policy: Any) -> Callable[..., jax.Array]:
    """The jitted eval-mode prediction for ``(loss_fn, policy)``, made once, not per evaluation."""

    @jax.jit
    def predict(params, model_state, images):
        logits, _ = loss_fn.logits_of(params, images, policy, model_state, None, False)
        return jnp.argmax(logits, -1)

    return predict


def evaluate(loss_fn, params, model_state, policy, test: dict[str, np.ndarray]) -> float:
    """Test accuracy (eval mode: running BatchNorm statistics, no augmentation)."""
    predict = _predictor(loss_fn, policy)
    correct, size = 0, len(test["label"])
    for start in range(0, size, 1000):
        images = test["image"][start : start + 1000]
        correct += int(
            (
                np.asarray(predict(params, model_state, images))
                == test["label"][start : start + 1000]
            ).sum()
        )
    return correct / size


# -- one run -------------------------------------------------------------------------------------


def train_run(run: str, data: Data, args: argparse.Namespace, progress: Any) -> RunResult:
    model, has_state = build_model(args.model, data.num_classes)
    loss_fn = make_loss(model, has_state, data.channel_stats)
    sample = data.train["image"][:2]
    init_kwargs = {"train": False} if has_state else {}
    variables = model.init(jax.random.key(args.seed), sample, **init_kwargs)
    params, model_state = variables["params"], variables.get("batch_stats")

    common: dict[str, Any] = {
        "model_state": model_state,
        "has_aux": True,
        "seed": args.seed,
        "reference_batch": args.batch_size,
        "check_every": args.check_every,
    }
    if run == "triaccel":
        tx = optax.inject_hyperparams(alias.triaccel)(learning_rate=args.lr, weight_decay=1e-4)
        budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
        probe = (
            memory_probe.default_memory_probe()
            if budget is None
            else memory_probe.BudgetMemoryProbe(budget)
        )
        kwargs = dict(
            min_batch=min(32, args.batch_size),
            max_batch=max(args.max_batch, args.batch_size),
            batch_size=args.batch_size,
            probe=probe,
            replan_every=args.replan_every,
            lr_scaling="sqrt",
        )
    else:
        tx = optax.adamw(args.lr, weight_decay=1e-4)
        policy = policy_lib.PrecisionPolicy.uniform(params, "bf16") if run == "bf16" else None
        kwargs = dict(
            min_batch=args.batch_size,
            max_batch=args.batch_size,
            # The batch is fixed (min = max); the probe only supplies the recorded figures.
            probe=memory_probe.default_memory_probe(),
            policy=policy,
            lr_scaling="none",
        )
    controller = controller_lib.Controller(loss_fn, params, tx, data.train, **common, **kwargs)

    history: list[dict[str, float]] = []
    epoch_accuracy: list[float] = []
    evals: list[dict[str, float]] = []

    def record_eval() -> float:
        accuracy = evaluate(
            loss_fn, controller.params, controller.model_state, controller.policy, data.test
        )
        evals.append(
            {
                "step": controller.step_count,
                "samples": controller.sampler.samples_seen,
                "accuracy": accuracy,
            }
        )
        return accuracy

    policies: list[dict[str, Any]] = []
    start = time.perf_counter()
    max_steps = args.max_steps if args.max_steps is not None else math.inf
    for epoch in range(args.epochs):
        while controller.sampler.epoch <= epoch and controller.step_count < max_steps:
            info = controller.step()
            history.append(
                {
                    "step": info.step,
                    "samples": controller.sampler.samples_seen,
                    "loss": info.loss,
                    "batch": info.batch_size,
                    "peak_mib": math.nan if info.peak_bytes is None else info.peak_bytes / 2**20,
                    "limit_mib": math.nan if info.limit_bytes is None else info.limit_bytes / 2**20,
                }
            )
            if run == "triaccel" and (not policies or any(e.kind == "replan" for e in info.events)):
                leaves = {path: controller.policy.compute(path) for path in controller.policy}
                policies.append({"step": info.step - 1, "leaves": leaves})
            if args.eval_every and controller.step_count % args.eval_every == 0:
                record_eval()
            progress.update(info.batch_size)
            progress.set_postfix(
                run=run,
                loss=f"{info.loss:.3f}",
                batch=info.batch_size,
                mem=f"{(info.peak_bytes or 0) / 2**20:.0f}MiB",
            )
        # The end of each epoch is evaluated too (once, if --eval-every just did).
        last = evals[-1] if evals else None
        if last is not None and last["step"] == controller.step_count:
            epoch_accuracy.append(last["accuracy"])
        else:
            epoch_accuracy.append(record_eval())
        if controller.step_count >= max_steps:
            break
    seconds = time.perf_counter() - start

    # Memory of one step under the run's final policy, at the largest batch the run trained at
    # and at the common batch: a run that grew its batch needs more than the common figure says.
    run_batch = max((h["batch"] for h in history), default=args.batch_size)
    run_report = step_memory(loss_fn, controller, data, run_batch)
    if run_batch == args.batch_size:
        common = run_report
    else:
        common = step_memory(loss_fn, controller, data, args.batch_size)
    return RunResult(
        name=run,
        seconds=seconds,
        steps=controller.step_count,
        final_batch=controller.batch_size,
        run_batch=run_batch,
        run_batch_memory_mib=run_report.total / 2**20,
        run_batch_compiled_mib=_mib(run_report.compiled),
        common_batch=args.batch_size,
        common_batch_memory_mib=common.total / 2**20,
        common_batch_compiled_mib=_mib(common.compiled),
        accuracy=epoch_accuracy[-1],
        history=history,
        epoch_accuracy=epoch_accuracy,
        evals=evals,
        events=[_jsonable(r) for r in controller.event_records()],
        policies=policies,
    )


def step_memory(
    loss_fn: Callable[..., Any], controller: Any, data: Data, batch_size: int
) -> memory.MemoryReport:
    """``memory_report`` of one training step at ``batch_size`` under the controller's policy.

    The batch is the first ``batch_size`` training samples (repeated if the set is smaller:
    only shapes and dtypes matter).
    """
    size = len(data.train["label"])
    index = np.arange(batch_size) % size
    batch = {k: v[index] for k, v in data.train.items()}
    policy = controller.policy

    def step_fn(p, b):
        return loss_fn(
            p, b, policy=policy, rng=jax.random.key(0), model_state=controller.model_state
        )[0]

    return memory.memory_report(controller.params, controller.opt_state, policy, step_fn, batch)


def _mib(value: int | None) -> float | None:
    return None if value is None else value / 2**20


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(record, default=str))


# -- report --------------------------------------------------------------------------------------


RESULT_COLUMNS = (
    "run",
    "wall s",
    "steps",
    "final batch",
    "trained at batch",
    "memory_report MiB at trained batch",
    "compiled MiB at trained batch",
    "common batch",
    "memory_report MiB at common batch",
    "vs FP32 at common batch",
    "compiled MiB at common batch",
    "test accuracy",
)


def results_table(results: Sequence[RunResult]) -> str:
    """The side-by-side table, in Markdown.

    Memory is given at two batches, each in its own labelled columns: the largest batch the run
    trained at, and the common batch of all runs, where the "vs FP32" ratio is taken (the FP32
    run's figure at the same batch), so that a run that grew its batch is not credited with the
    memory of a smaller one.
    """
    base = next((r for r in results if r.name == "fp32"), None)
    lines = [
        "| " + " | ".join(RESULT_COLUMNS) + " |",
        "| --- |" + " ---: |" * (len(RESULT_COLUMNS) - 1),
    ]

    def mib(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for r in results:
        comparable = base is not None and base.common_batch == r.common_batch
        ratio = (
            f"{r.common_batch_memory_mib / base.common_batch_memory_mib:.3f}x"
            if comparable
            else "-"
        )
        cells = (
            RUN_LABELS[r.name],
            f"{r.seconds:.1f}",
            str(r.steps),
            str(r.final_batch),
            str(r.run_batch),
            mib(r.run_batch_memory_mib, 2),
            mib(r.run_batch_compiled_mib, 1),
            str(r.common_batch),
            mib(r.common_batch_memory_mib, 2),
            ratio,
            mib(r.common_batch_compiled_mib, 1),
            f"{100 * r.accuracy:.2f}%",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m triaccel_jax",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default="auto",
        help="data set; auto: Fashion-MNIST if Debian's package is installed, else digits",
    )
    parser.add_argument("--model", choices=MODELS, default="auto", help="model; auto: small_cnn")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs per run")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="batch of the fixed runs; Tri-Accel's start and reference batch",
    )
    parser.add_argument(
        "--max-batch", type=int, default=256, help="largest batch Tri-Accel may grow to"
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
        "--replan-every", type=int, default=100, help="steps between precision re-plans"
    )
    parser.add_argument("--check-every", type=int, default=10, help="steps between memory checks")
    parser.add_argument(
        "--output-dir",
        type=pathlib.Path,
        default=pathlib.Path("triaccel_output"),
        help="folder for results.md, results.json and the PNG plots",
    )
    parser.add_argument("--data-dir", default=None, help="tensorflow-datasets data_dir for CIFAR")
    parser.add_argument(
        "--eval-every", type=int, default=None, help="also measure test accuracy every N steps"
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
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "max_batch", "replan_every", "check_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_steps", "train_subset", "test_subset", "eval_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error("--lr must be a positive number")
    if args.budget_mib is not None and not args.budget_mib > 0:
        parser.error("--budget-mib must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the comparison; returns the exit status."""
    args = parse_args(argv)
    output = check_output_dir(args.output_dir)
    try:
        data = load_data(
            args.dataset,
            data_dir=args.data_dir,
            train_subset=args.train_subset,
            test_subset=args.test_subset,
        )
    except (FileNotFoundError, ImportError) as error:
        print(f"error: data set {args.dataset!r} is not available: {error}", file=sys.stderr)
        return 2
    model_name = "small_cnn" if args.model == "auto" else args.model
    args.model = model_name
    print(
        f"triaccel_jax main job: {model_name} on {data.name} ({len(data.train['label'])} train / "
        f"{len(data.test['label'])} test), {args.epochs} epochs, seed {args.seed}, runs "
        f"{', '.join(args.runs)}; {jax.device_count()} x {jax.devices()[0].platform}"
    )
    from tqdm.auto import tqdm

    total = len(data.train["label"]) * args.epochs * len(args.runs)
    results = []
    with tqdm(total=total, unit="img", disable=args.no_progress, dynamic_ncols=True) as progress:
        for run in args.runs:
            results.append(train_run(run, data, args, progress))
    table = results_table(results)
    print("\n" + table)

    from triaccel_jax.cli import _plots as plots

    written = plots.write_plots(results, output)
    (output / "results.md").write_text(table + "\n")
    record = {
        "args": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "dataset": data.name,
        "platform": jax.devices()[0].platform,
        "results": [dataclasses.asdict(r) for r in results],
    }
    (output / "results.json").write_text(json.dumps(record, indent=1, default=str))
    print(
        f"\nwrote {output / 'results.md'}, {output / 'results.json'}, "
        + ", ".join(str(p) for p in written)
    )
    return 0
