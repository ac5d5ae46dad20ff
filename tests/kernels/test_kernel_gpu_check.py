"""``benchmarks/gpu_check.py`` imports, parses its arguments and runs its CPU-safe dry run."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from triaccel_jax.kernels import _dispatch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments(gpu_check):
    args = gpu_check.parse_args([])
    assert (args.parity_size, args.bandwidth_log2, args.iterations) == (2**20 + 123, 27, 20)
    assert args.batch_size == 128 and not args.dry_run and args.memory_child is None
    dry = gpu_check.parse_args(["--dry-run", "--parity-size", "10"])
    assert dry.dry_run and dry.parity_size == 10 and dry.bandwidth_log2 == 14
    assert args.sections == ["cast-parity", "fused-parity", "bandwidth", "memory"]
    assert gpu_check.parse_args(["--sections", "bandwidth"]).sections == ["bandwidth"]
    assert args.auto_table is None  # the table is written only when asked


def test_ulp_distance(gpu_check):
    from gpu_sections._common import ulp_distance  # importable once gpu_check is loaded

    a = np.array([1.0, -1.0, 0.0, np.nan, 2.0], np.float32)
    b = np.nextafter(a, np.float32(np.inf))
    b[3] = np.nan
    equal, worst = ulp_distance(a, b)
    assert equal == 0.2 and worst == 1.0
    assert ulp_distance(a, a) == (1.0, 0.0)
    c = a.copy()
    c[3] = 1.0
    assert ulp_distance(a, c)[1] == np.inf
    # Across zero: -0 and +0 count as equal; the smallest subnormals of either sign are 2 apart.
    z = np.array([-0.0, np.float32(2.0**-149)], np.float32)
    assert ulp_distance(z, np.array([0.0, -(2.0**-149)], np.float32)) == (0.5, 2.0)


@pytest.mark.skipif(
    _dispatch.triton_unavailable_reason() is None, reason="on a CUDA machine the script really runs"
)
def test_without_cuda_it_exits_2_unless_dry_run(gpu_check, capsys):
    assert gpu_check.main(["--skip-memory"]) == 2
    assert "--dry-run" in capsys.readouterr().out


@pytest.mark.slow
def test_dry_run(gpu_check, capsys):
    argv = ["--dry-run", "--skip-memory", "--parity-size", "64", "--bandwidth-log2", "8"]
    assert gpu_check.main([*argv, "--iterations", "1"]) == 0
    out = capsys.readouterr().out
    assert "parity: 18 passed, 0 failed" in out
    assert "device copy" in out and "unfused: three jitted stages" in out
