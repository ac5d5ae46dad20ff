"""benchmarks/compile_time.py --quick: every model's table prints each row's ratio to its baseline.

One run of the script (about a minute and a half on 2 CPU cores) serves every test here; the
figures themselves are not checked (they mean little at --quick's sizes), only that each row was
measured and judged against its target.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

COMPILE_ROWS = {
    "triaccel": "adamw",
    "curvature_signals + adamw": "adamw",
    "quantize_state(adamw, int8)": "adamw",
    "scale_by_curvature(muon)": "muon",
    "curvature_signals + muon (recommended)": "muon",
}
STEADY_ROWS = {"curvature_signals + adamw": 1.02, "quantize_state(adamw, int8)": 1.10}


@pytest.fixture(scope="module")
def output() -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_time.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def section(output: str, heading: str) -> dict[str, str]:
    """The rows of the table under the line starting with ``heading``, by row name."""
    blocks = output.split("\n\n")
    (block,) = [b for b in blocks if b.startswith(heading)]
    return {line.split("  ")[0].strip(): line for line in block.splitlines()[2:]}


def test_header_names_the_versions_and_the_machine(output):
    header = output.splitlines()[0]
    assert re.search(r"jax [\d.]+, optax [\d.]+, \w+, .*, \d+ cores", header), header


@pytest.mark.parametrize("model", ["mlp", "transformer", "cnn"])
def test_each_model_prints_each_transform_against_its_optax_optimizer(output, model):
    table = section(output, f"model {model}:")
    for baseline in ("adamw", "muon"):
        assert re.search(r"1\.00x\s+\(baseline\)", table[baseline]), table[baseline]
    for name, baseline in COMPILE_ROWS.items():
        # lower s, compile s, total s, HLO instructions, fusions, ratio, baseline, verdict.
        match = re.search(
            rf"([\d.]+) +([\d.]+) +([\d.]+) +(\d+) +(\d+) +([\d.]+)x\s+{re.escape(baseline)} "
            r"(met stretch|met|MISSED)$",
            table[name],
        )
        assert match, table[name]
        assert float(match.group(6)) > 0 and int(match.group(4)) > 0, table[name]
    assert "target: each ratio <= 1.5x" in output


def test_the_transformer_has_sixteen_leaves_a_block_and_a_readout(output):
    # 193 leaves at the full run's 12 blocks; --quick has 2.
    match = re.search(r"model transformer: (\d+) blocks, .* (\d+) leaves", output)
    assert match and int(match.group(2)) == 16 * int(match.group(1)) + 1, output[:2000]


def test_steady_rows_print_a_ratio_against_their_target(output):
    table = section(output, "steady step, model mlp:")
    for name, target in STEADY_ROWS.items():
        match = re.search(rf"([\d.]+)x\s+adamw (met|MISSED) \(<= {target:.2f}x\)$", table[name])
        assert match and float(match.group(1)) > 0, table[name]


def test_contributing_modules_are_run_or_skipped_with_a_line(output):
    block = next(b for b in output.split("\n\n") if b.startswith("contributed rows:"))
    for module in ("noise_cost", "state_update_cost"):
        lines = [line for line in block.splitlines() if line.startswith(f"{module}:")]
        assert lines, block
        if not (ROOT / "benchmarks" / f"{module}.py").exists():
            assert lines == [f"{module}: skipped (no benchmarks/{module}.py)"]
