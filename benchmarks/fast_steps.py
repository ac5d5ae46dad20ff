"""Fast steps on the real clock: the goodput batch moves where the noise pays, and only there.

A loop of your own with :class:`triaccel_jax.controller.AdaptiveBatches` at its defaults (the
goodput batch, the square root of AdaScale's gain for the learning rate, decisions every 10
steps on this machine's measured step times) over a linear regression: 8,192 samples of 32
standard normal features, targets ``x @ w`` plus label noise, SGD with momentum 0.9 under
``optax.inject_hyperparams`` (rate 0.01, tuned at the starting batch 16), buckets 16 to 1,024,
memory figures from :func:`triaccel_jax.precision.step_peak_bytes` under the default probe. A
step takes well under a millisecond here, so host jitter is large against it.

Two twins per seed, run in turns (noisy, then noiseless, seed after seed, so that a slow spell
of the machine falls on both):

* **noisy**: label noise of standard deviation 3: the gradient noise scale is in the hundreds,
  and a larger batch makes more progress per second;
* **noiseless**: no label noise: the noise scale is near zero, and no batch beats the start.

Figures per run: the median batch over the last 100 of ``--steps`` steps, the step of the first
move, the moves and direction changes, and the median step time. Then the cost: the same loop
at a fixed batch of 64 with and without AdaptiveBatches, in turns (:func:`cost`). Target: the
median over seeds of the noisy runs' median batch is at least 4x the noiseless runs'. It is a report,
not a test: it exits 0 whatever the figures ("met" or "MISSED" is printed), 1 only where a run
fails. ``--quick`` runs 150 steps on one seed, a smoke test whose figures mean little.

Usage, from the repository root::

    python benchmarks/fast_steps.py [--quick] [--seeds 0 1 2 3 4] [--steps 600] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import optax

from triaccel_jax.controller import AdaptiveBatches
from triaccel_jax.precision import step_peak_bytes
from triaccel_jax.training import value_and_grad_with_noise

NUM_EXAMPLES = 8192
FEATURES = 32
LABEL_NOISE = {"noisy": 3.0, "noiseless": 0.0}
TARGET_RATIO = 4.0
LAST = 100  # the steps the final batch is read over


def make_data(label_noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(NUM_EXAMPLES, FEATURES)).astype(np.float32)
    w = rng.normal(size=FEATURES).astype(np.float32)
    y = x @ w + label_noise * rng.normal(size=NUM_EXAMPLES).astype(np.float32)
    return x, y.astype(np.float32)


def loss(w: jax.Array, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    inputs, targets = batch
    return jnp.mean((inputs @ w - targets) ** 2)


TX = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01, momentum=0.9)


@jax.jit
def train_step(w: jax.Array, opt_state: Any, batch: tuple[jax.Array, jax.Array]):
    value, grads, norms = value_and_grad_with_noise(loss)(w, batch)
    updates, opt_state = TX.update(grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state, {"loss": value, **norms}


def run(twin: str, seed: int, steps: int) -> dict[str, Any]:
    """One run of ``steps`` steps; its batch at each step and its decisions."""
    x, y = make_data(LABEL_NOISE[twin], seed)
    w = jnp.zeros(FEATURES)
    opt_state = TX.init(w)
    batches = AdaptiveBatches(
        (x, y),
        opt_state,
        min_batch=16,
        max_batch=1024,
        batch_size=16,
        seed=seed,
        peak_bytes=step_peak_bytes(train_step, w, opt_state, (x, y)),
    )
    sizes: list[int] = []
    seconds: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rate's rescaling is said once; it is in events
        while len(sizes) < steps:
            for batch, settings in batches:
                start = time.perf_counter()
                opt_state = settings.apply(opt_state)
                w, opt_state, metrics = train_step(w, opt_state, batch)
                batches.report(metrics, opt_state=opt_state)
                seconds.append(time.perf_counter() - start)
                sizes.append(settings.batch_size)
                if len(sizes) == steps:
                    break
    moves = [(a, b) for a, b in itertools.pairwise(sizes) if a != b]
    changes = sum(1 for (a, b), (c, d) in itertools.pairwise(moves) if (b > a) != (d > c))
    first = next((i + 1 for i, (a, b) in enumerate(itertools.pairwise(sizes)) if a != b), None)
    return {
        "twin": twin,
        "seed": seed,
        "sizes": sizes,
        "final_batch": statistics.median(sizes[-LAST:]),
        "first_move": first,
        "moves": len(moves),
        "direction_changes": changes,
        "median_step_ms": 1e3 * statistics.median(seconds),
        "noise_scale": batches.noise_scale,
        "decisions": [
            f"step {e.step}: {e.kind} {e.old} -> {e.new}: {e.reason}"
            for e in batches.events
            if e.kind in ("grow", "shrink")
        ],
    }


def cost(rounds: int, steps: int, batch_size: int = 64) -> dict[str, float]:
    """A step of your loop under AdaptiveBatches over the same loop without it, at one batch.

    Both loops train the noisy regression at ``batch_size`` for ``steps`` steps a round, taking
    turns for ``rounds`` rounds (the first one rotating). The plain loop slices a permutation's
    batches out of the arrays and syncs once a round; under AdaptiveBatches (min = max = the
    batch, so nothing moves) each step is yielded, applied and reported, and ``report`` reads
    the step's metrics: it waits for each step, where the plain loop queues them. Returns the
    median over rounds of the ratio of the two rounds' times, and each loop's median step time.
    """
    x, y = make_data(LABEL_NOISE["noisy"], 0)
    w0 = jnp.zeros(FEATURES)
    rng = np.random.default_rng(0)

    def plain() -> float:
        w, opt_state = w0, TX.init(w0)
        order = rng.permutation(NUM_EXAMPLES)
        start = time.perf_counter()
        for i in range(steps):
            rows = order[(i * batch_size) % NUM_EXAMPLES :][:batch_size]
            w, opt_state, _ = train_step(w, opt_state, (x[rows], y[rows]))
        jax.block_until_ready(w)
        return time.perf_counter() - start

    def adaptive() -> float:
        w, opt_state = w0, TX.init(w0)
        batches = AdaptiveBatches(
            (x, y), opt_state, min_batch=batch_size, max_batch=batch_size, batch_size=batch_size
        )
        start, done = time.perf_counter(), 0
        while done < steps:
            for batch, settings in batches:
                opt_state = settings.apply(opt_state)
                w, opt_state, metrics = train_step(w, opt_state, batch)
                batches.report(metrics)
                done += 1
                if done == steps:
                    break
        jax.block_until_ready(w)
        return time.perf_counter() - start

    loops = {"plain": plain, "adaptive": adaptive}
    for loop in loops.values():
        loop()  # compiled and warm
    times: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            times[name].append(loops[name]())
    ratios = [a / p for a, p in zip(times["adaptive"], times["plain"], strict=True)]
    return {
        "ratio": statistics.median(ratios),
        "plain_step_ms": 1e3 * statistics.median(times["plain"]) / steps,
        "adaptive_step_ms": 1e3 * statistics.median(times["adaptive"]) / steps,
        "batch": batch_size,
        "rounds": rounds,
        "steps": steps,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    final = {
        twin: statistics.median(r["final_batch"] for r in runs if r["twin"] == twin)
        for twin in LABEL_NOISE
    }
    ratio = final["noisy"] / final["noiseless"]
    return {
        "median_final_batch": final,
        "ratio": ratio,
        "target": TARGET_RATIO,
        "verdict": "met" if ratio >= TARGET_RATIO else "MISSED",
        "most_direction_changes": max(r["direction_changes"] for r in runs),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"`{report['command']}`, {report['machine']}, jax {report['jax']}, {report['started']}",
        "",
        "| twin | seed | median batch, last 100 steps | first move at step | moves | direction "
        "changes | median step ms | noise scale |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["runs"]:
        noise = "—" if r["noise_scale"] is None else f"{r['noise_scale']:.4g}"
        lines.append(
            f"| {r['twin']} | {r['seed']} | {r['final_batch']:g} | {r['first_move'] or '—'} | "
            f"{r['moves']} | {r['direction_changes']} | {r['median_step_ms']:.3f} | {noise} |"
        )
    s, c = report["summary"], report["cost"]
    lines += [
        "",
        f"Median over seeds of the final batch: noisy {s['median_final_batch']['noisy']:g}, "
        f"noiseless {s['median_final_batch']['noiseless']:g}: ratio {s['ratio']:.2f} "
        f"(target >= {s['target']:g}x): **{s['verdict']}**. Most direction changes in a run: "
        f"{s['most_direction_changes']}.",
        "",
        f"Cost, at a fixed batch of {c['batch']} ({c['rounds']} rounds of {c['steps']} steps, "
        f"taking turns): a step under AdaptiveBatches {c['adaptive_step_ms']:.3f} ms against "
        f"{c['plain_step_ms']:.3f} ms in the same loop without it: **{c['ratio']:.2f}x** "
        "(median of the rounds' ratios; report() waits for each step, the plain loop queues "
        "them).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="150 steps, one seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0-4")
    parser.add_argument("--steps", type=int, default=None, help="default 600 (150 quick)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    seeds = args.seeds or ([0] if args.quick else list(range(5)))
    steps = args.steps or (150 if args.quick else 600)
    if steps <= LAST and not args.quick:
        parser.error(f"--steps must exceed {LAST}: the final batch is read over the last {LAST}")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    runs = []
    for seed in seeds:
        for twin in LABEL_NOISE:
            runs.append(run(twin, seed, steps))
            print(
                f"{twin} seed {seed}: final batch {runs[-1]['final_batch']:g}, first move at "
                f"{runs[-1]['first_move']}",
                flush=True,
            )
    report = {
        "command": "benchmarks/fast_steps.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "started": started,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {jax.default_backend()}",
        "jax": jax.__version__,
        "steps": steps,
        "runs": runs,
    }
    report["summary"] = summarize(runs)
    report["cost"] = cost(rounds=3 if args.quick else 15, steps=50 if args.quick else 200)
    text = markdown(report)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fast_steps.json").write_text(json.dumps(report, indent=1))
        (args.out / "fast_steps.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
