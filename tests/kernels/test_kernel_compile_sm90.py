"""Every Triton kernel variant compiles for sm_90 on this machine (no GPU needed).

``triton.compile`` for a ``GPUTarget("cuda", 90, 32)`` runs Triton's whole NVIDIA pipeline on
the CPU: TTIR, TTGIR, LLVM IR, PTX, and a cubin from the ptxas inside the triton wheel. It
catches what the interpreter cannot: type errors of the compiled dialect, unsupported
conversions, and the PTX that will run (here: no approximate division or square root, and no FMA
contraction, as the kernels ask). The compiler must not see ``TRITON_INTERPRET``, which the
interpreter tests set in this process, so it runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="compiling the kernels needs triton (kernels-dev extra)")

SCRIPT = pathlib.Path(__file__).with_name("compile_sm90.py")


def test_every_kernel_variant_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile, do not reuse a cache
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300
    )
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in records if not r["ok"]]
    assert result.returncode == 0 and not failed, (failed, result.stderr[-3000:])
    assert len(records) == 19 + 2 * 6  # cast, fused update; quantize and dequantize at two sizes
    for record in records:
        # The deepest stage: a cubin (ptxas ships in the triton wheel); PTX at the very least.
        assert "ptx" in record["stages"], record
        assert "cubin" in record["stages"] and record["cubin_bytes"] > 0, record
        assert record["approximate"] == 0, record  # div_rn / sqrt_rn, as XLA computes them
        assert record["fma"] == 0, record  # enable_fp_fusion=False


def test_every_launch_candidate_compiles_for_sm90(tmp_path):
    from triaccel_jax.kernels import _launch

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--candidates"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in records if not r["ok"]]
    assert result.returncode == 0 and not failed, (failed, result.stderr[-3000:])
    # Four kernels (cast, fused update, quantize, dequantize) at every candidate but the default,
    # which the test above compiles.
    assert len(records) == 4 * (len(_launch.CANDIDATES) - 1)
    for record in records:
        assert "cubin" in record["stages"] and record["cubin_bytes"] > 0, record
        assert record["approximate"] == 0 and record["fma"] == 0, record
