"""benchmarks/accuracy.py: its statistics on hand-made numbers, and its --quick mode end to end."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax

ROOT = pathlib.Path(__file__).resolve().parents[2]


# The study's parts are the package benchmarks/accuracy/ (benchmarks/ is not a package).
sys.path.insert(0, str(ROOT / "benchmarks"))
from accuracy import runs  # noqa: E402
from accuracy import stats  # noqa: E402
from accuracy import tuning  # noqa: E402


def test_paired_interval_on_hand_made_numbers():
    # Differences 1, 2, 3: mean 2, sample sd 1, t(0.975, 2 dof) = 4.302653;
    # half width = 4.302653 / sqrt(3) = 2.484138.
    mean, low, high = stats.paired_interval([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert mean == pytest.approx(2.0)
    assert low == pytest.approx(2.0 - 2.484138, abs=1e-5)
    assert high == pytest.approx(2.0 + 2.484138, abs=1e-5)


def test_paired_interval_pairs_by_seed():
    # The seeds differ by a lot but each pair by 0.1 +- 0.1: an unpaired interval would be
    # about +-25 wide, the paired one is 4.302653 * 0.1 / sqrt(3) = 0.248414 on each side.
    a, b = [10.1, 20.2, 30.0], [10.0, 20.0, 30.0]
    mean, low, high = stats.paired_interval(a, b)
    assert mean == pytest.approx(0.1)
    assert (high - low) / 2 == pytest.approx(0.248414, abs=1e-5)
    # Five pairs: t(0.975, 4 dof) = 2.776445.
    diffs = np.array([0.5, 1.0, -0.2, 0.3, 0.9])
    mean, low, high = stats.paired_interval(list(diffs), [0.0] * 5)
    assert (high - low) / 2 == pytest.approx(2.776445 * diffs.std(ddof=1) / math.sqrt(5), 1e-5)
    # One pair says nothing about the spread.
    assert stats.paired_interval([1.0], [0.0]) == (1.0, -math.inf, math.inf)
    with pytest.raises(ValueError):
        stats.paired_interval([1.0, 2.0], [1.0])


def test_mean_std_is_the_sample_standard_deviation():
    assert stats.mean_std([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, math.sqrt(5 / 3)))
    assert stats.mean_std([0.7]) == (0.7, 0.0)


def test_first_reaching_reads_the_first_evaluation_at_the_target():
    evals = [{"step": s, "accuracy": a} for s, a in ((10, 0.5), (20, 0.8), (30, 0.79), (40, 0.9))]
    assert stats.first_reaching(evals, 0.8)["step"] == 20
    assert stats.first_reaching(evals, 0.95) is None


def test_both_optimizers_get_the_same_number_of_tuning_trials():
    for trials in (2, 3, 4, 6, 9):
        adamw, learning_rates, variants = tuning.tuning_trials(trials, (1e-3, 1e-2))
        assert len(adamw) == learning_rates + variants == trials
        assert adamw[0].lr == pytest.approx(1e-3) and adamw[-1].lr == pytest.approx(1e-2)
    assert tuning.log_grid(1e-3, 1e-1, 3) == pytest.approx([1e-3, 1e-2, 1e-1])


@pytest.mark.standard_promotion("optax.adamw's bias correction mixes its int32 count with floats")
def test_the_precision_row_updates_as_adamw():
    # The "planned precision only" row runs triaccel with alpha=0 so that the planner has
    # curvature signals to read; its step scale is then 1 and its update AdamW's.
    params = {"w": jnp.linspace(-1.0, 1.0, 96).reshape(8, 12), "b": jnp.zeros(12)}
    adamw = optax.adamw(3e-3, weight_decay=1e-4)
    flat = triaccel_jax.triaccel(3e-3, weight_decay=1e-4, alpha=0.0, curvature_every=1)
    states = adamw.init(params), flat.init(params)
    for step in range(5):
        key = jax.random.fold_in(jax.random.key(0), step)
        grads = {k: jax.random.normal(key, p.shape) * (1 + p) for k, p in params.items()}
        expected, adamw_state = adamw.update(grads, states[0], params)
        got, flat_state = flat.update(grads, states[1], params)
        states = adamw_state, flat_state
        for leaf in expected:
            np.testing.assert_allclose(got[leaf], expected[leaf], rtol=1e-5, atol=1e-9)


def test_quick_mode_writes_the_table_and_the_raw_numbers(tmp_path):
    command = [sys.executable, "benchmarks/accuracy.py", "--quick", "--out", str(tmp_path)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    raw = json.loads((tmp_path / "accuracy.json").read_text())
    (workload,) = raw["workloads"]
    assert workload["workload"] == "digits_mlp"
    assert set(workload["runs"]) == set(runs.ROWS)
    for row, row_runs in workload["runs"].items():
        assert [r["seed"] for r in row_runs] == [0, 1], row
        for run in row_runs:
            assert 0.0 <= run["accuracy"] <= 1.0 and run["memory_mib"] > 0
            assert run["evals"][-1]["accuracy"] == run["accuracy"]
    # The same number of tuning trials for both optimizers.
    assert len(workload["tuning"]["fp32"]) == len(workload["tuning"]["triaccel"]) == 2
    # The elastic rows grew their batch; the fixed ones did not.
    assert {r["run_batch"] for r in workload["runs"]["fp32"]} == {workload["batch"]}
    assert max(r["run_batch"] for r in workload["runs"]["elastic"]) > workload["batch"]

    table = (tmp_path / "accuracy.md").read_text()
    start = table.index("| configuration | test accuracy")
    lines = table[start:].split("\n\n")[0].splitlines()
    body = lines[2:]
    assert all(len(line.split(" | ")) == len(lines[0].split(" | ")) for line in body)
    # The tuning trials are listed too, one line per trial.
    assert table.count("| AdamW | ") == table.count("| Tri-Accel | ") == 2
    assert [line.split(" | ")[0][2:] for line in body] == [
        runs.ROW_LABELS[row] for row in runs.ROWS
    ]
    # The table's paired difference is the one recomputed from the raw numbers.
    fp32 = [r["accuracy"] for r in workload["runs"]["fp32"]]
    tri = [r["accuracy"] for r in workload["runs"]["triaccel"]]
    mean, low, high = (100 * x for x in stats.paired_interval(tri, fp32))
    assert f"{mean:+.2f} [{low:+.2f}, {high:+.2f}]" in body[runs.ROWS.index("triaccel")]
