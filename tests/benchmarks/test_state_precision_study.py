"""benchmarks/state_precision.py --quick: every state row of the study trains, is tuned and is
reported with its targets, and XLA's bytes per parameter of each row stay where they belong."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from triaccel_jax.data import fashion_mnist_not_found_message
from triaccel_jax.data import find_fashion_mnist

ROOT = pathlib.Path(__file__).resolve().parents[2]
needs_fashion_mnist = pytest.mark.skipif(
    find_fashion_mnist() is None,
    reason=fashion_mnist_not_found_message().splitlines()[0]
    + " (TRIACCEL_INSTALL_SYSTEM_DATA=1 bash tools/test.sh installs Debian's package as root)",
)


def run_quick(out: pathlib.Path, *args: str) -> None:
    """Runs ``benchmarks/state_precision.py --quick ARGS --out OUT`` on the CPU; fails with its
    output's tail when it fails."""
    command = [sys.executable, "benchmarks/state_precision.py", "--quick", *args, "--out", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
@needs_fashion_mnist
def test_quick_run_reports_every_optimizer_and_state_row(tmp_path):
    run_quick(tmp_path, "--workloads", "fashion_mlp", "--optimizers", "adamw", "muon")

    raw = json.loads((tmp_path / "state_precision.json").read_text())
    rows = {(r["optimizer"], r["state"]): r for r in raw["summary"]}
    states = ("fp32", "bf16", "int8", "int8_dynamic", "int4", "planned", "blind")
    optimizers = {"adamw": "AdamW", "muon": "Muon"}
    assert set(rows) == {(o, s) for o in optimizers for s in states}
    table = (tmp_path / "state_precision.md").read_text()
    for opt, label in optimizers.items():
        for state in states:
            assert f"| fashion_mlp | {label} | {state} |" in table, (opt, state)
        assert f"fashion_mlp {label} plan vs blind" in table
        assert f"- fashion_mlp {label} int8: int8 target:" in table
        assert f"- fashion_mlp {label} int4: int4 target:" in table
    assert "Targets:" in table
    # Bounds that a broken store would cross: the quick runs (2 seeds, a few hundred images)
    # reach about 70% (AdamW) and 50% (Muon) in fp32, and every narrow format stays within a
    # point of its fp32 row (2026-12-06); a format that loses its state falls towards 10%.
    for (opt, state), row in rows.items():
        assert row["n"] == 2 and row["mean"] >= 35.0, (opt, state, row["mean"])
        assert row["mean"] >= rows[(opt, "fp32")]["mean"] - 5.0, (opt, state, row["mean"])
        assert math.isfinite(row["step_ratio"]) and row["step_ratio"] > 0
        if state == "fp32":
            assert row["verdict"] == "reference"
        else:
            assert row["interval"] is not None
        if state in ("int8", "int8_dynamic", "int4", "planned", "blind"):
            assert " met" in row["verdict"] or "MISSED" in row["verdict"]

    # A blind run whose formats are the plan's is the planned run, copied, not trained again.
    for run in raw["runs"].values():
        if run["state"] == "blind" and "copied_from" in run:
            twin = raw["runs"][run["copied_from"]]
            assert twin["state"] == "planned" and twin["seed"] == run["seed"]
            assert twin["plan"]["formats"] == run["plan"]["formats"]
            assert twin["accuracy"] == run["accuracy"]

    # Bytes per parameter, params + state, from XLA's compiled update (deterministic: counted,
    # not timed), on the 784-128-10 MLP (101,770 parameters), blocks along each leaf's last
    # axis, as measured on 2026-12-05 (bounds about +-0.02 around them, so that a change in
    # what a format stores fails here). AdamW (two state copies): fp32 12; bf16 8.06 (the
    # small leaves stay fp32); 8-bit 6.15 (codes and a scale per row's block of the 784x128
    # kernel, either map); int4 4.67 (two codes a byte and a scale per 128 for the first
    # moment, the 784x128 second moment factored into row and column means). Muon (one copy for the matrix, Adam's
    # two for the biases): fp32 8.01, bf16 6.03, 8-bit 5.08, int4 4.59.
    expected = {
        "adamw": {"fp32": 12.0, "bf16": 8.056, "int8": 6.145, "int8_dynamic": 6.145, "int4": 4.671},
        "muon": {"fp32": 8.006, "bf16": 6.034, "int8": 5.078, "int8_dynamic": 5.078, "int4": 4.585},
    }
    cap = {"adamw": 5.0, "muon": 4.6}
    for opt, figures in expected.items():
        bpp = {state: rows[(opt, state)]["bytes_per_parameter"] for state in states}
        for state, value in figures.items():
            assert bpp[state] == pytest.approx(value, abs=0.02), (opt, state, bpp[state])
        assert bpp["int4"] < bpp["int8"] < bpp["bf16"] < bpp["fp32"]
        # The plan at the cap (unmet where the cap lies below uniform int4's bytes: then at the
        # fewest bytes it reaches), counted by the planner as XLA counts it; the signal-blind
        # assignment at the plan's bytes, never above, within one leaf's step (the largest
        # leaf's move from int8 to int4, two copies).
        planned, blind = rows[(opt, "planned")], rows[(opt, "blind")]
        assert planned["bytes_per_parameter"] <= max(cap[opt], bpp["int4"]) + 0.01
        assert planned["plan_bytes_per_parameter"] == pytest.approx(
            planned["bytes_per_parameter"], abs=0.01
        )
        assert blind["plan_bytes_per_parameter"] <= planned["plan_bytes_per_parameter"] + 1e-6
        assert blind["bytes_per_parameter"] <= planned["bytes_per_parameter"] + 0.01
        assert abs(blind["bytes_per_parameter"] - planned["bytes_per_parameter"]) <= 1.6


@pytest.mark.slow
@needs_fashion_mnist
def test_tune_only_tunes_every_row_runs_no_final_seed_and_times_the_plan(tmp_path):
    run_quick(
        tmp_path,
        "--tune-only",
        *("--workloads", "fashion_mlp", "--optimizers", "adamw", "--states", "fp32", "planned"),
    )

    raw = json.loads((tmp_path / "state_precision.json").read_text())
    phases = {(r["state"], r["phase"]) for r in raw["runs"].values()}
    assert phases == {("fp32", "tune"), ("planned", "tune")}
    assert len(raw["runs"]) == 6  # the 3-point grid, per row, at the tuning seed only
    for row in ("fashion_mlp/adamw/fp32", "fashion_mlp/adamw/planned"):
        chosen = raw["chosen"][row]
        assert len(chosen["validation"]) == 3 and chosen["lr_from"] == "own"
        best = max(chosen["validation"], key=chosen["validation"].get)
        assert chosen["lr"] == pytest.approx(float(best))
    # The planned row is timed with its tuning run's formats.
    assert set(raw["timing"]["fashion_mlp"]["seconds_per_step"]) == {"adamw/fp32", "adamw/planned"}
    assert raw["summary"] == []
    table = (tmp_path / "state_precision.md").read_text()
    for row in ("fashion_mlp/adamw/fp32", "fashion_mlp/adamw/planned"):
        assert f"- {row} (tuned, no final runs): validation " in table
