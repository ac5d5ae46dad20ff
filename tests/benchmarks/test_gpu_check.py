"""benchmarks/gpu_check.py runs end to end on CPU in its reduced mode, and reports what it should."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from triaccel_jax.cli import _end_to_end as e2e
from triaccel_jax.kernels import _dispatch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bandwidth_section():
    """benchmarks/gpu_sections/_bandwidth.py, importable once gpu_check.py is loaded by path."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._bandwidth


def _assert_every_op_measured_by_xla(path):
    """The table at ``path`` lists every dispatched op, each with an XLA figure and "xla"."""
    ops = json.loads(path.read_text())["ops"]
    assert list(ops) == list(_dispatch.OPS)  # every op, in the dispatch's order
    for op, entry in ops.items():
        assert entry["choice"] == "xla" and entry["triton_copy_fraction"] is None, (op, entry)
        assert entry["xla_copy_fraction"] > 0, (op, entry)  # measured, not filled in
    assert _dispatch.load_auto_table(path) == dict.fromkeys(_dispatch.OPS, "xla")


@pytest.mark.slow
def test_quick_mode_runs_end_to_end_on_cpu(tmp_path):
    # The bandwidth and memory sections' --dry-run is the same code with tiny sizes, checked by
    # hand; the parity and end-to-end sections are what a first use on the GPU machine exercises.
    command = [sys.executable, "benchmarks/gpu_check.py", "--quick", "--output-dir", str(tmp_path)]
    command += ["--sections", "cast-parity", "bandwidth", "end-to-end"]
    command += ["--auto-table", str(tmp_path / "auto_table.json")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=400)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "== end to end" in out and re.search(r"parity: \d+ passed, 0 failed", out)
    for label in e2e.LABELS.values():
        row = re.search(
            rf"^{re.escape(label)} +(\d+) +([\d.]+) +(\d+) .*%  memory_report$", out, re.M
        )
        assert row, out
        assert int(row.group(1)) > 0  # samples/s
    # Tri-Accel grew its batch into free memory; the fixed runs kept theirs.
    # Goodput moves only once a bucket's step times are known: a dry run may end at 16 or 32.
    assert re.search(r"^Tri-Accel: \d+ steps, final batch (16|32),", out, re.M), out
    assert re.search(r"^FP32 AdamW: \d+ steps, final batch 16,", out, re.M), out
    targets = out[out.index("targets (ratios):") :].splitlines()[1:6]
    assert all(re.search(r"\(target <= [\d.]+\) (met|missed)$", t) for t in targets), targets
    # Without Triton figures the table the bandwidth section writes chooses XLA for every op,
    # and the dispatch reads it back.
    # Every op has its own XLA figure, the block-wise quantize and dequantize ones included.
    _assert_every_op_measured_by_xla(tmp_path / "auto_table.json")
    # Each run wrote its own results in its own folder (one process per run).
    assert all((tmp_path / run / "results.json").exists() for run in e2e.RUNS)


@pytest.mark.slow
def test_the_dry_run_bandwidth_section_measures_every_dispatched_op(tmp_path):
    # What a GPU session regenerates kernels/auto_table.json with, in its reduced mode: a row
    # measured for each op that impl="auto" dispatches (the quantize and dequantize ones too),
    # so the regenerated table passes test_kernel_auto_table.py's check of every op.
    path = tmp_path / "auto_table.json"
    command = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--sections", "bandwidth"]
    command += ["--bandwidth-log2", "12", "--iterations", "1", "--auto-table", str(path)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "WARNING" not in out, out
    for op in _dispatch.OPS:  # the summary of what impl="auto" chooses names every op
        assert re.search(rf"^{re.escape(op)} +Triton +n/a +XLA [\d.]+x +-> xla$", out, re.M), op
    _assert_every_op_measured_by_xla(path)


def test_write_table_lists_an_unmeasured_op_as_xla_with_null_figures(
    bandwidth_section, tmp_path, capsys
):
    path = tmp_path / "auto_table.json"
    row = {"op": "fused_update/float32", "xla_copy_fraction": 0.9}
    table = bandwidth_section.write_table(str(path), [row], dry_run=True, source="test")
    assert list(table["ops"]) == list(_dispatch.OPS)
    assert table["ops"]["fused_update/float32"]["xla_copy_fraction"] == 0.9
    assert table["ops"]["dequantize/sqrt"] == {
        "choice": "xla",
        "triton_copy_fraction": None,
        "xla_copy_fraction": None,
    }
    assert "WARNING: no figures for" in capsys.readouterr().out
    assert _dispatch.load_auto_table(path) == dict.fromkeys(_dispatch.OPS, "xla")


def test_a_failed_run_fails_the_section(tmp_path):
    lines = []
    settings = e2e.Settings(dataset="no_such_data_set", model="small_cnn", timeout_s=120)
    assert not e2e.end_to_end(settings, tmp_path, runs=("fp32",), echo=lines.append)
    assert lines[0].startswith("FAIL fp32: exit 2") and "invalid choice" in lines[0]


def _record(accuracy, evals, memory, peak=None, batch=128):
    return {
        "accuracy": accuracy,
        "evals": [{"accuracy": a, "seconds": s, "compile_seconds": c} for a, s, c in evals],
        "samples_per_second": 1000.0,
        "compile_seconds": evals[-1][2],
        "run_batch": batch,
        "run_batch_memory_mib": memory * batch / 128,
        "common_batch_memory_mib": memory,
        "peak_bytes_in_use_mib": None if peak is None else peak * batch / 128,
        "common_batch_peak_bytes_in_use_mib": peak,
    }


def test_the_targets_are_ratios_met_or_missed():
    runs = {
        "fp32": _record(0.9, [(0.5, 5.0, 2.0), (0.9, 10.0, 2.0)], 100.0, peak=200.0),
        "bf16": _record(0.91, [(0.9, 8.0, 3.0)], 55.0, peak=110.0),
        "triaccel": _record(
            0.92, [(0.85, 4.0, 2.0), (0.95, 7.0, 2.0)], 50.0, peak=100.0, batch=512
        ),
    }
    lines = e2e.report(runs)
    assert lines[0] == "target: FP32's final test accuracy 90.00%"
    text = "\n".join(lines)
    # Tri-Accel reached 90% at 7 s (5 s without compiles); FP32 at 10 s; bf16 at 8 s.
    assert re.search(r"^Tri-Accel .* 7\.0 +5\.0 +92\.00%  peak_bytes_in_use$", text, re.M), text
    assert "Tri-Accel / FP32 time to FP32's accuracy: 0.700 (target <= 0.9) met" in text
    assert "Tri-Accel / static bf16 time to FP32's accuracy: 0.875 (target <= 1) met" in text
    assert "stretch: Tri-Accel / FP32 time to FP32's accuracy: 0.700 (target <= 0.5) missed" in text
    # Memory at the common batch, from peak_bytes_in_use where the device reports it.
    assert "static bf16 / FP32 peak_bytes_in_use at the common batch: 0.550" in text
    assert "Tri-Accel / static bf16 peak_bytes_in_use at the common batch: 0.909" in text
    # A run that never reaches the target has no time, and its ratio is missed.
    runs["triaccel"]["evals"] = [{"accuracy": 0.5, "seconds": 1.0, "compile_seconds": 0.5}]
    text = "\n".join(e2e.report(runs))
    assert "Tri-Accel / FP32 time to FP32's accuracy: n/a (target <= 0.9) missed" in text
