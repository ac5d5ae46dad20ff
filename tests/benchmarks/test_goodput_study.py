"""benchmarks/goodput.py: its figures to the target on hand-made curves, and --quick end to end."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import triaccel_jax
from triaccel_jax.data import fashion_mnist_not_found_message
from triaccel_jax.data import find_fashion_mnist

ROOT = pathlib.Path(__file__).resolve().parents[2]

# benchmarks/ is not a package: the study is imported from its folder.
sys.path.insert(0, str(ROOT / "benchmarks"))
import goodput  # noqa: E402


def curve(seed, points, *, validation=0.8):
    """A run of ``points`` ``(step, samples, seconds, accuracy)``."""
    evals = [{"step": st, "samples": sa, "seconds": se, "accuracy": a} for st, sa, se, a in points]
    return {
        "seed": seed,
        "accuracy": evals[-1]["accuracy"],
        "validation": validation,
        "evals": evals,
    }


def test_to_target_reads_the_first_evaluation_at_or_above_the_target():
    run = curve(0, [(10, 320, 1.0, 0.70), (20, 640, 2.0, 0.80), (30, 960, 3.5, 0.79)])
    assert goodput.to_target(run["evals"], 0.80) == {"steps": 20, "samples": 640, "seconds": 2.0}
    assert goodput.to_target(run["evals"], 0.75) == {"steps": 20, "samples": 640, "seconds": 2.0}
    assert goodput.to_target(run["evals"], 0.70) == {"steps": 10, "samples": 320, "seconds": 1.0}
    assert goodput.to_target(run["evals"], 0.81) is None


def test_target_figures_pair_by_seed_and_take_medians_with_bootstrap_intervals():
    # One target for every seed: 0.847. The reference reaches it at its last evaluation.
    reference = [
        curve(0, [(100, 3200, 10.0, 0.80), (200, 6400, 20.0, 0.85)]),
        curve(1, [(100, 3200, 12.0, 0.84), (200, 6400, 24.0, 0.90)]),
    ]
    # Seed 0 reaches it at step 50 (ratio 0.25 in steps, 0.5 in samples, 0.9 in seconds);
    # seed 1 at step 150 (0.75, 1.0, 1.25).
    row = [
        curve(0, [(50, 3200, 18.0, 0.86), (100, 6400, 36.0, 0.87)]),
        curve(1, [(100, 3200, 15.0, 0.84), (150, 6400, 30.0, 0.898)]),
    ]
    figures = goodput.target_figures(row, reference, 0.847)
    assert figures["reached"] == figures["n"] == 2
    assert figures["steps"] == pytest.approx(100.0)  # median of 50 and 150
    assert figures["samples"] == pytest.approx(4800.0)
    assert figures["seconds"] == pytest.approx(24.0)
    # The median of the log ratios, as a ratio: the geometric mean of two.
    assert figures["steps_ratio"] == pytest.approx(math.sqrt(0.25 * 0.75))
    assert figures["seconds_ratio"] == pytest.approx(math.sqrt(0.9 * 1.25))
    low, high = figures["steps_interval"]
    assert low == pytest.approx(0.25) and high == pytest.approx(0.75)
    # Against itself: every ratio is 1, with a zero-width interval.
    self_figures = goodput.target_figures(reference, reference, 0.847)
    assert self_figures["steps_ratio"] == self_figures["seconds_ratio"] == pytest.approx(1.0)
    assert self_figures["steps_interval"] == pytest.approx([1.0, 1.0])


def test_a_seed_not_reached_counts_as_an_infinite_ratio():
    reference = [curve(s, [(100, 3200, 10.0, 0.80), (200, 6400, 20.0, 0.85)]) for s in range(3)]
    reached = curve(0, [(40, 3200, 5.0, 0.86)])
    missing = [curve(s, [(40, 3200, 5.0, 0.70)]) for s in (1, 2)]
    # One seed of three reached: the median ratio is infinite, reported as not reached.
    figures = goodput.target_figures([reached, *missing], reference, 0.847)
    assert figures["reached"] == 1
    assert figures["steps"] == 40  # the median over the seeds that reached it
    assert figures["steps_ratio"] is None
    # Two of three reached: the median ratio is the larger finite one, its upper bound infinite.
    figures = goodput.target_figures(
        [reached, curve(1, [(80, 6400, 6.0, 0.90)]), missing[1]], reference, 0.847
    )
    assert figures["reached"] == 2
    assert figures["steps_ratio"] == pytest.approx(80 / 200)
    assert figures["seconds_ratio"] == pytest.approx(6.0 / 20.0)
    assert figures["steps_interval"][1] is None


def test_direction_changes_count_turns_and_the_grid_widens_past_a_best_edge():
    assert goodput.direction_changes([32, 32, 64, 128, 128]) == 0
    assert goodput.direction_changes([32, 64, 32]) == 1
    assert goodput.direction_changes([32, 64, 32, 64, 128, 64]) == 3
    grid = [1e-3, 2e-3, 4e-3]
    assert goodput.widened(grid, [0.80, 0.85, 0.90]) == pytest.approx(8e-3)
    assert goodput.widened(grid, [0.90, 0.85, 0.80]) == pytest.approx(5e-4)
    assert goodput.widened(grid, [0.80, 0.90, 0.85]) is None


def test_summary_reads_the_targets_met_or_missed():
    rows = goodput.make_rows([32, 64])
    # static64 is the reference. goodput_gpu_like reaches the target in 0.5x the steps; goodput
    # in 1.5x the time.
    ends = [0.85, 0.86, 0.84]
    static32 = [
        curve(s, [(100, 1, 5.0, 0.80), (200, 2, 10.0, e + 0.01)], validation=0.80)
        for s, e in enumerate(ends)
    ]
    static64 = [
        curve(s, [(50, 1, 5.0, 0.80), (100, 2, 10.0, 0.86)], validation=0.82)
        for s, e in enumerate(ends)
    ]
    gpu_like = [curve(s, [(50, 2, 7.0, 0.86), (60, 2, 8.0, 0.862)]) for s in range(3)]
    measured = [curve(s, [(100, 2, 15.0, 0.859)]) for s in range(3)]
    for name, runs in (
        ("static32", static32),
        ("static64", static64),
        ("goodput_gpu_like", gpu_like),
        ("goodput", measured),
    ):
        for run in runs:
            run.update(
                steps=run["evals"][-1]["step"],
                seconds=1.0,
                max_batch=64,
                final_batch=64,
                moves=0 if name.startswith("static") else 2,
                direction_changes=0 if name != "goodput" else 2,
                samples_per_second=1000.0,
                throughput={"32x1": 1100.0, "64x1": 1500.0},
            )
    report = {
        "rows": [dataclasses.asdict(r) for r in rows],
        "runs": {
            "static32": static32,
            "static64": static64,
            "goodput": measured,
            "goodput_gpu_like": gpu_like,
        },
        "chosen": {r.name: 1e-3 for r in rows},
        "best_static": "static64",
        "target": 0.855,
        "protocol": {"optimizer": "adamw"},
    }
    summary = goodput.summarize(report)
    assert summary["best_static"] == "static64"
    assert set(summary["rows"]) == {"static32", "static64", "goodput", "goodput_gpu_like"}
    assert summary["rows"]["goodput_gpu_like"]["target"]["steps_ratio"] == pytest.approx(0.5)
    assert summary["rows"]["goodput"]["target"]["seconds_ratio"] == pytest.approx(1.5)
    assert summary["rows"]["goodput"]["diff"] == pytest.approx([-0.001, -0.001, -0.001])
    # The static rows' throughput figures against their steps' samples per second: +10%, +50%.
    assert summary["rows"]["static64"]["throughput_error"] == pytest.approx(0.5)
    met = {(t["row"], t["figure"]): t["met"] for t in summary["targets"]}
    assert met == {
        ("goodput_gpu_like", "steps"): True,  # 0.5 <= 0.6
        ("goodput", "seconds"): False,  # 1.5 > 1.0
        ("goodput", "accuracy"): True,  # -0.1 points in every seed
        ("goodput", "direction_changes"): False,  # 2 turns
        ("goodput_gpu_like", "accuracy"): True,  # +0.2 points in every seed
        ("goodput_gpu_like", "direction_changes"): True,
        ("static", "throughput"): False,  # 50% off
    }
    # Over Muon the steps bound is 0.7.
    muon = goodput.summarize({**report, "protocol": {"optimizer": "muon"}})
    (steps,) = [t for t in muon["targets"] if t["figure"] == "steps"]
    assert "<= 0.7" in steps["what"] and steps["met"]


@pytest.mark.standard_promotion("optax's muon promotes its count inside")
def test_the_muon_rows_train_the_recommended_configuration_with_an_injected_rate():
    tx = goodput.make_optimizer("muon", 0.016)
    params = {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros(4)}
    state = tx.init(params)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.016)
    updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    # Muon orthogonalises the kernel's update (all its singular values near one, so the update
    # is far from the raw gradient's rank-one direction); Adam's part moves the bias.
    assert set(triaccel_jax.signals(state)) == {"bias", "kernel"}
    assert float(jnp.abs(updates["bias"]).max()) > 0
    assert goodput.DEFAULT_GRIDS["muon"][0] < 0.016 < goodput.DEFAULT_GRIDS["muon"][-1]


def test_the_rows_are_the_static_batches_then_the_elastic_ones():
    names = [r.name for r in goodput.make_rows([32, 64, 128])]
    assert names == [
        "static32",
        "static64",
        "static128",
        "memory",
        "goodput",
        "goodput_gpu_like",
    ]


@pytest.mark.slow
@pytest.mark.skipif(
    find_fashion_mnist() is None,
    reason=fashion_mnist_not_found_message().splitlines()[0]
    + " (TRIACCEL_INSTALL_SYSTEM_DATA=1 bash tools/test.sh installs Debian's package as root)",
)
def test_quick_mode_writes_the_table_the_raw_numbers_and_the_plot(tmp_path):
    command = [sys.executable, "benchmarks/goodput.py", "--quick", "--out", str(tmp_path)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    raw = json.loads((tmp_path / "goodput.json").read_text())
    names = [r["name"] for r in raw["rows"]]
    assert names == [r.name for r in goodput.make_rows([32, 64, 128])]
    assert set(raw["runs"]) == set(names)
    for name, runs in raw["runs"].items():
        assert [r["seed"] for r in runs] == [0], name
        for run in runs:
            assert 0.0 <= run["accuracy"] <= 1.0 and 0.0 <= run["validation"] <= 1.0
            assert run["evals"][-1]["accuracy"] == run["accuracy"]
            for key in ("steps", "samples", "seconds", "compile_seconds"):
                assert math.isfinite(run[key]) and run[key] >= 0, (name, key)
            assert run["samples"] >= raw["protocol"]["train_images"]
            assert run["seed"] not in raw["protocol"]["tuning_seeds"]
            if name.startswith("static"):
                assert run["max_batch"] == int(name.removeprefix("static"))
            else:
                history = run["history"]
                assert len(history["samples"]) == len(history["batch"]) == run["steps"]
        # Every row's learning rate is chosen on validation from the same grid, widened past a
        # best point at an edge.
        assert {str(lr) for lr in raw["protocol"]["grid"]} <= set(raw["tuning"][name])
        assert str(raw["chosen"][name]) in raw["tuning"][name]
    summary = raw["summary"]
    for name, row in summary["rows"].items():
        assert all(math.isfinite(row[k]) for k in ("mean", "sd", "validation", "seconds")), name
        assert math.isfinite(row["diff"][0])
    assert summary["best_static"] in {"static32", "static64", "static128"}
    assert summary["targets"] and all(isinstance(t["met"], bool) for t in summary["targets"])

    table = (tmp_path / "goodput.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| row | lr |"))
    body = table[table.index(header) :].split("\n\n")[0].splitlines()[2:]
    assert [line.split(" | ")[0][2:] for line in body] == [r["label"] for r in raw["rows"]]
    assert all(line.count("|") == header.count("|") for line in body)
    assert ("met" in done.stdout) or ("missed" in done.stdout)
    assert (tmp_path / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
