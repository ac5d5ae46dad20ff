"""benchmarks/accuracy.py: its statistics on hand-made numbers, its rows' optimizers, and its
--quick mode end to end."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax.controller import _learning_rate as learning_rate

ROOT = pathlib.Path(__file__).resolve().parents[2]


# The study's parts are the package benchmarks/accuracy/ (benchmarks/ is not a package).
sys.path.insert(0, str(ROOT / "benchmarks"))
from accuracy import report  # noqa: E402
from accuracy import runs  # noqa: E402
from accuracy import stats  # noqa: E402
from accuracy import tuning  # noqa: E402
from accuracy import workloads  # noqa: E402


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


def _run(seed, points):
    """A run whose evaluations are ``points`` of (step, seconds, accuracy)."""
    evals = [{"step": s, "seconds": t, "accuracy": a} for s, t, a in points]
    return {"seed": seed, "accuracy": evals[-1]["accuracy"], "evals": evals}


def test_figures_to_the_reference_are_paired_by_seed():
    # AdamW reaches its final accuracy (0.8, 0.9, 0.85) at steps 100, 80 and 100: seed 1 first
    # reaches it before its end, and the ratio is taken to that step.
    reference = [
        _run(0, [(50, 5.0, 0.7), (100, 10.0, 0.8)]),
        _run(1, [(40, 4.0, 0.85), (80, 8.0, 0.9), (100, 10.0, 0.9)]),
        _run(2, [(50, 5.0, 0.8), (100, 10.0, 0.85)]),
    ]
    row = [
        _run(2, [(30, 6.0, 0.85), (60, 12.0, 0.86)]),  # reaches 0.85 at step 30: ratio 0.3
        _run(0, [(50, 2.0, 0.81), (100, 4.0, 0.82)]),  # reaches 0.8 at step 50: ratio 0.5
        _run(1, [(50, 2.0, 0.8), (100, 4.0, 0.89)]),  # never reaches 0.9: infinite ratio
    ]
    out = stats.to_reference(row, reference)
    assert out["reached"] == 2 and out["n"] == 3
    assert out["step"] == pytest.approx(40.0)  # median of 30 and 50 (the seeds reaching)
    assert out["step_ratio"] == pytest.approx(0.5)  # median of 0.3, 0.5 and inf
    assert out["seconds_ratio"] == pytest.approx(0.6)  # median of 6 / 10, 2 / 10 and inf
    # A margin lowers every seed's target; most seeds not reaching make the median infinite.
    assert stats.to_reference(row, reference, margin=0.02)["reached"] == 3
    assert stats.to_reference(row[2:], reference)["step_ratio"] is None
    assert stats.median_or_none([]) is None


def test_every_optimizer_gets_the_same_number_of_tuning_trials():
    cnn, mlp = workloads.WORKLOADS["fashion_cnn"], workloads.WORKLOADS["fashion_mlp"]
    for trials in (2, 3, 4, 6, 9, 12):
        adamw, learning_rates, options = tuning.tuning_trials(trials, (1e-3, 1e-2))
        assert len(adamw) == learning_rates + options == trials
        assert adamw[0].lr == pytest.approx(1e-3) and adamw[-1].lr == pytest.approx(1e-2)
        for workload in (cnn, mlp):
            for base in runs.BASE_ROWS:
                lrs, opts = tuning.plan(base, workload, trials)
                assert len(lrs) + len(opts) == trials, (base, workload.name, trials)
    # Six trials: AdamW six rates; the others four rates and two of their own options.
    lrs, opts = tuning.plan("adamw", cnn, 6)
    assert lrs == pytest.approx(tuning.log_grid(*cnn.lr_range, 6)) and opts == []
    lrs, opts = tuning.plan("triaccel", cnn, 6)
    assert lrs == pytest.approx(tuning.log_grid(*cnn.lr_range, 4))
    assert opts == [{"bound": "smooth"}, {"alpha": 1.0, "min_scale": 0.25, "max_scale": 4.0}]
    lrs, opts = tuning.plan("muon", cnn, 6)
    assert lrs == pytest.approx(tuning.log_grid(*cnn.muon_lr_range, 4))
    assert opts == [{"conv": "adam"}, {"adam_ratio": 0.3}]
    # The MLP has no conv kernels: Muon's conv option is not one of its trials.
    assert all("conv" not in o for o in tuning.row_options("muon", mlp))
    assert tuning.log_grid(1e-3, 1e-1, 3) == pytest.approx([1e-3, 1e-2, 1e-1])


def test_rows_and_their_optimizers():
    assert runs.ROWS[: len(runs.BASE_ROWS)] == runs.BASE_ROWS
    assert set(runs.ROW_LABELS) == set(runs.ROWS)
    assert [runs.base_row(r) for r in runs.ROWS] == list(runs.BASE_ROWS) * 2
    assert runs.base_row("fp32") == "adamw" and runs.base_row("curvature") == "triaccel"
    with pytest.raises(ValueError):
        runs.base_row("sgd_adapt")
    params = {
        "Conv_0": {"kernel": jnp.ones((3, 3, 1, 4)), "bias": jnp.zeros(4)},
        "Dense_0": {"kernel": jnp.ones((8, 3)), "bias": jnp.zeros(3)},
    }
    hyper = runs.Hyper(1e-2)
    for row in runs.ROWS:
        state = runs.optimizer(row, hyper).init(params)
        # One injected learning rate: the one the controller scales with the batch.
        found = learning_rate.find_hyperparam(state, "learning_rate")
        assert found is not None and found.value == pytest.approx(1e-2), row
        assert not found.scheduled, row
        # The rows that plan precision (and Tri-Accel's) hold the curvature signals.
        if runs.is_adapt(row) or "triaccel" in row:
            assert set(triaccel_jax.signals(state)) == {
                "Conv_0/kernel",
                "Conv_0/bias",
                "Dense_0/kernel",
                "Dense_0/bias",
            }, row


def _grads(params, step):
    key = jax.random.fold_in(jax.random.key(0), step)
    return {
        name: {
            k: jax.random.normal(jax.random.fold_in(key, i), p.shape)
            for i, (k, p) in enumerate(leaves.items())
        }
        for name, leaves in params.items()
    }


@pytest.mark.slow
@pytest.mark.standard_promotion("optax's adamw and muon mix their int32 counts with floats")
def test_the_adapt_rows_update_as_their_base_rows():
    # The observer the adapt rows of AdamW and Muon put first leaves the updates untouched, and
    # Tri-Accel's step scale at alpha=0 is exactly 1: the direction's own update.
    params = {
        "Conv_0": {"kernel": jnp.linspace(-1.0, 1.0, 36).reshape(3, 3, 1, 4), "bias": jnp.zeros(4)},
        "Dense_0": {"kernel": jnp.linspace(-1.0, 1.0, 24).reshape(8, 3), "bias": jnp.zeros(3)},
    }
    pairs = (
        ("adamw_adapt", runs.Hyper(3e-3), "adamw", runs.Hyper(3e-3)),
        ("muon_adapt", runs.Hyper(2e-2), "muon", runs.Hyper(2e-2)),
        ("triaccel_muon", runs.Hyper(2e-2, alpha=0.0), "muon", runs.Hyper(2e-2)),
    )
    for row, row_hyper, base, base_hyper in pairs:
        txs = runs.optimizer(row, row_hyper), runs.optimizer(base, base_hyper)
        states = [tx.init(params) for tx in txs]
        for step in range(4):
            grads = _grads(params, step)
            (got, states[0]), (expected, states[1]) = (
                tx.update(grads, state, params) for tx, state in zip(txs, states, strict=True)
            )
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9, err_msg=row)


@pytest.mark.standard_promotion("optax's muon mixes its int32 count with floats")
def test_muon_trains_conv_kernels_by_muon_or_by_adam_as_tuned():
    # conv="muon": the kernel's update is Muon's on the folded (3 * 3 * 2, 4) matrix; conv="adam":
    # Adam's, whose first update is a multiple of -adam_lr * sign(g) (adam_lr = 0.1 * lr here).
    params = {"Conv_0": {"kernel": jnp.zeros((3, 3, 2, 4))}}
    grads = {"Conv_0": {"kernel": jax.random.normal(jax.random.key(1), (3, 3, 2, 4))}}
    matrix = optax.contrib.muon(1e-2, weight_decay=runs.WEIGHT_DECAY)
    folded = {"w": grads["Conv_0"]["kernel"].reshape(18, 4)}
    zeros = {"w": jnp.zeros((18, 4))}
    expected_muon, _ = matrix.update(folded, matrix.init(zeros), zeros)
    for conv in ("muon", "adam"):
        tx = runs.optimizer("muon", runs.Hyper(1e-2, conv=conv, adam_ratio=0.1))
        update, _ = tx.update(grads, tx.init(params), params)
        kernel = np.asarray(update["Conv_0"]["kernel"])
        if conv == "adam":
            # Adam's first step (Nesterov, as optax's muon runs it) is a fixed multiple of
            # -adam_lr * sign(g): one magnitude for every element.
            sign = np.sign(np.asarray(grads["Conv_0"]["kernel"]))
            np.testing.assert_array_equal(np.sign(kernel), -sign)
            np.testing.assert_allclose(np.abs(kernel), np.abs(kernel).flat[0], rtol=1e-5)
            assert 1e-3 <= np.abs(kernel).flat[0] < 2e-3
        else:
            expected = np.asarray(expected_muon["w"]).reshape(3, 3, 2, 4)
            np.testing.assert_allclose(kernel, expected, rtol=1e-4, atol=1e-8)


@pytest.mark.slow
def test_quick_mode_writes_the_table_and_the_raw_numbers(tmp_path):
    command = [sys.executable, "benchmarks/accuracy.py", "--quick", "--out", str(tmp_path)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    raw = json.loads((tmp_path / "accuracy.json").read_text())
    (workload,) = raw["workloads"]
    assert workload["workload"] == "fashion_mlp"
    assert list(workload["runs"]) == list(runs.ROWS)
    # Bounds a broken optimizer would cross: the quick runs reach 0.59-0.75 on ten classes
    # (2026-12-06), each row's mean within 0.04 of AdamW's; one that stops learning stays near 0.1.
    mean = {row: np.mean([r["accuracy"] for r in rs]) for row, rs in workload["runs"].items()}
    for row, row_runs in workload["runs"].items():
        assert [r["seed"] for r in row_runs] == [0, 1], row
        assert mean[row] >= max(0.45, mean["adamw"] - 0.15), (row, mean)
        for run in row_runs:
            assert 0.35 <= run["accuracy"] <= 1.0 and run["memory_mib"] > 0, (row, run["accuracy"])
            assert run["evals"][-1]["accuracy"] == run["accuracy"]
            assert run["hyper"] == workload["chosen"][runs.base_row(row)], row
    # The same number of tuning trials for every optimizer, all four tuned.
    assert list(workload["tuning"]) == list(runs.BASE_ROWS)
    assert {len(trials) for trials in workload["tuning"].values()} == {3}
    # The adapt rows run the goodput batch (never below the reference batch: a quick run is too
    # short for its step times to be known, so it need not move) and re-plan; the base rows do
    # neither.
    for base in runs.BASE_ROWS:
        assert {r["run_batch"] for r in workload["runs"][base]} == {workload["batch"]}
        assert {r["plans"] for r in workload["runs"][base]} == {0}
        adapt = workload["runs"][base + runs.ADAPT_SUFFIX]
        assert min(r["run_batch"] for r in adapt) >= workload["batch"], base
        assert min(r["plans"] for r in adapt) >= 1, base

    table = (tmp_path / "accuracy.md").read_text()
    start = table.index("| configuration | hyperparameters | test accuracy")
    lines = table[start:].split("\n\n")[0].splitlines()
    header, body = lines[0], lines[2:]
    for column in (
        "vs AdamW, points (paired 95% CI)",
        "steps to AdamW's final (seeds reaching)",
        "wall s to it",
        "x AdamW",
        "largest batch",
        "re-plans",
    ):
        assert column in header
    assert all(len(line.split(" | ")) == len(header.split(" | ")) for line in body)
    assert [line.split(" | ")[0][2:] for line in body] == [runs.ROW_LABELS[r] for r in runs.ROWS]
    # The tuning trials are listed too, one line per trial.
    for base in runs.BASE_ROWS:
        assert table.count(f"| {runs.ROW_LABELS[base]} | ") == 3 + 1, base  # 3 trials, 1 row
    # The table's paired difference is the one recomputed from the raw numbers.
    adamw = [r["accuracy"] for r in workload["runs"]["adamw"]]
    tri = [r["accuracy"] for r in workload["runs"]["triaccel"]]
    mean, low, high = (100 * x for x in stats.paired_interval(tri, adamw))
    interval = f"{mean:+.2f} [{low:+.2f}, {high:+.2f}]"
    assert interval in body[runs.ROWS.index("triaccel")]
    # The ablation: the step scale over each direction, with its interval; then the targets.
    assert f"| triaccel − adamw | {interval} |" in table
    muon = [r["accuracy"] for r in workload["runs"]["muon"]]
    over_muon = [r["accuracy"] for r in workload["runs"]["triaccel_muon"]]
    mean, low, high = (100 * x for x in stats.paired_interval(over_muon, muon))
    assert f"| triaccel_muon − muon | {mean:+.2f} [{low:+.2f}, {high:+.2f}] |" in table
    targets = table[table.index("Targets (issue 24):") :]
    assert targets.count("**met**") + targets.count("**missed**") == 2
    assert "adds over its direction alone" in targets and "0.7x its steps" in targets
    summary = workload["summary"]
    assert [t["met"] for t in summary["targets"]][-1] is True  # two seeds: finite intervals
    assert not summary["targets"][0]["binding"]  # the first target binds on the small CNN
    assert {c["row"] for c in summary["targets"][0]["candidates"]} == set(runs.ROWS) - set(
        report.NOT_SHIPPED
    )
    assert "Picked on the validation split" in table
    # Re-rendered from two studies' files (run one after the other), the wall times add up.
    again = tmp_path / "again"
    json_path = str(tmp_path / "accuracy.json")
    command = [sys.executable, "benchmarks/accuracy.py", "--from-json", json_path, json_path]
    done = subprocess.run(
        [*command, "--out", str(again)], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    total = f"Total wall time of the study: {2 * raw['seconds'] / 60:.1f} min."
    assert total in (again / "accuracy.md").read_text()


def _trial(lr, validation, **options):
    hyper = {**dataclasses.asdict(runs.Hyper(lr=lr)), **options}
    return {"hyper": hyper, "validation": validation}


def _tuned(workload, trials, chosen):
    return {"workload": workload, "tuning": trials, "chosen": chosen}


def test_the_validation_split_picks_the_scale_options_and_the_best_configuration():
    smooth = {"bound": "smooth"}
    wide = {"alpha": 1.0, "min_scale": 0.25, "max_scale": 4.0}
    a = _tuned(
        "a",
        {
            "adamw": [_trial(1e-3, 0.80), _trial(3e-3, 0.85)],
            "triaccel": [
                _trial(1e-3, 0.84),
                _trial(3e-3, 0.86),
                _trial(3e-3, 0.87, **smooth),  # +1 point over the defaults at 3e-3
                _trial(3e-3, 0.83, **wide),  # -3 points
            ],
        },
        {"adamw": _trial(3e-3, 0)["hyper"], "triaccel": _trial(3e-3, 0, **smooth)["hyper"]},
    )
    b = _tuned(
        "b",
        {
            "adamw": [_trial(1e-3, 0.86)],
            "triaccel": [_trial(1e-3, 0.88), _trial(1e-3, 0.875, **smooth)],  # -0.5 points
        },
        {"adamw": _trial(1e-3, 0)["hyper"], "triaccel": _trial(1e-3, 0)["hyper"]},
    )
    default = (0.5, 0.5, 2.0, "clip")
    gains = report.scale_option_gains([a, b], "triaccel")
    assert gains[default] == 0.0
    assert gains[(0.5, 0.5, 2.0, "smooth")] == pytest.approx((0.01 - 0.005) / 2)
    assert gains[(1.0, 0.25, 4.0, "clip")] == pytest.approx(-0.03)
    assert report.picked_scale_options([a, b], "triaccel") == (0.5, 0.5, 2.0, "smooth")
    # On b alone the smooth bound loses: the defaults stay.
    assert report.picked_scale_options([b], "triaccel") == default
    # Chosen trials' validation, averaged over workloads: Tri-Accel (0.87 + 0.88) / 2, AdamW
    # (0.85 + 0.86) / 2.
    ranking = report.validation_ranking([a, b])
    assert [row for row, _ in ranking] == ["triaccel", "adamw"]
    assert ranking[0][1] == pytest.approx(0.875) and ranking[1][1] == pytest.approx(0.855)
    assert "picked: alpha 0.5, smooth [0.5, 2]" in report.defaults_text([a, b])


def test_a_picked_option_is_confirmed_on_validation_at_more_tuning_seeds(monkeypatch):
    from accuracy import confirm

    wide = {"alpha": 1.0, "min_scale": 0.25, "max_scale": 4.0}
    study = _tuned(
        "fashion_mlp",
        {
            "triaccel": [
                _trial(1e-3, 0.84),
                _trial(3e-3, 0.86),
                _trial(3e-3, 0.87, **wide),  # the option the study picks, at 3e-3
            ]
        },
        {"triaccel": _trial(3e-3, 0, **wide)["hyper"]},
    )
    study["epochs"] = 3
    assert confirm.default_hyper(study, "triaccel").lr == 3e-3
    trained = []

    def fake_train(row, hyper, workload, data, evaluate_on, seed, *, epochs, evals_per_epoch):
        trained.append((row, hyper.alpha, hyper.lr, seed, epochs))
        # The option is ahead by 1 point at every seed, give or take 0.2.
        return {"accuracy": 0.80 + (0.01 if hyper.alpha == 1.0 else 0.0) + 0.002 * (seed % 2)}

    monkeypatch.setattr(confirm, "train", fake_train)
    splits = workloads.Splits(train=SimpleNamespace(test=None), test=None)
    monkeypatch.setattr(confirm, "load_splits", lambda workload, quick: splits)
    verdict = confirm.confirm([study], "triaccel", lambda _: None, seeds=(1001, 1002))
    # The tuning seed's pair is the study's own (not trained again); the others train both.
    assert sorted(trained) == sorted(
        ("triaccel", alpha, 3e-3, seed, 3) for alpha in (1.0, 0.5) for seed in (1001, 1002)
    )
    assert verdict["pairs"] == 3 and verdict["option"] == [1.0, 0.25, 4.0, "clip"]
    assert verdict["mean"] == pytest.approx(0.01) and verdict["confirmed"]
    # Differences that straddle 0 are not a confirmation; the defaults need none.
    assert not confirm.decide([(0.9, 0.89), (0.88, 0.89), (0.9, 0.9)])["confirmed"]
    keep = _tuned("fashion_mlp", {"triaccel": [_trial(1e-3, 0.9)]}, {})
    assert confirm.confirm([keep], "triaccel", lambda _: None) is None
