"""``impl="auto"`` obeys the measured table kernels/auto_table.json (docs/design.md §4, §8)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triaccel_jax.kernels import _dispatch
from triaccel_jax.kernels import cast as cast_kernel
from triaccel_jax.kernels import fused_update as fused_kernel


@pytest.fixture
def cuda_with_table(monkeypatch, tmp_path):
    """A CUDA backend where jax_triton imports, with the auto table read from a file we write."""
    monkeypatch.setattr(_dispatch, "triton_unavailable_reason", lambda: None)
    path = tmp_path / "auto_table.json"
    monkeypatch.setattr(_dispatch, "AUTO_TABLE_PATH", path)
    _dispatch._auto_table.cache_clear()
    yield path
    _dispatch._auto_table.cache_clear()


def _table(ops):
    return {"device_kind": "NVIDIA H200", "date": "2026-11-30", "source": "test", "ops": ops}


def _entry(choice):
    return {"choice": choice, "triton_copy_fraction": 0.9, "xla_copy_fraction": 0.5}


def test_auto_follows_the_table_per_operation(cuda_with_table):
    cuda_with_table.write_text(
        json.dumps(
            _table(
                {
                    "cast/bfloat16/stochastic": _entry("triton"),
                    "cast/bfloat16/nearest": _entry("xla"),
                    "fused_update/bfloat16": _entry("triton"),
                }
            )
        )
    )
    op = _dispatch.cast_op
    assert _dispatch.resolve("auto", "cast", op(jnp.bfloat16, "stochastic")) == "triton"
    assert _dispatch.resolve("auto", "cast", op(jnp.bfloat16, "nearest")) == "reference"
    # Not listed: the reference, Triton only where a measurement showed a win.
    assert _dispatch.resolve("auto", "cast", op(jnp.float16, "nearest")) == "reference"
    assert _dispatch.resolve("auto", "fused update", "fused_update/bfloat16") == "triton"
    assert _dispatch.resolve("auto", "fused update", "fused_update/float32") == "reference"
    # Forcing an implementation ignores the table.
    assert _dispatch.resolve("triton", "cast", op(jnp.bfloat16, "nearest")) == "triton"
    assert _dispatch.resolve("reference", "cast", op(jnp.bfloat16, "stochastic")) == "reference"


def test_cast_and_fused_update_ask_the_table_for_their_own_operation(monkeypatch):
    asked = []
    monkeypatch.setattr(_dispatch, "triton_unavailable_reason", lambda: None)
    monkeypatch.setattr(_dispatch, "auto_choice", lambda op: asked.append(op) or "xla")
    x = jnp.ones(8)
    key = jax.random.key(0)
    np.testing.assert_array_equal(
        cast_kernel.cast(x, jnp.float16, rounding="stochastic", key=key),
        cast_kernel.cast_reference(x, jnp.float16, rounding="stochastic", key=key),
    )
    bf16 = jnp.zeros(8, jnp.bfloat16)
    fused_kernel.fused_update(x, bf16, bf16, x, count=1, learning_rate=0.1, key=key)
    fused_kernel.fused_update(x, jnp.zeros(8), jnp.zeros(8), x, count=1, learning_rate=0.1)
    assert asked == ["cast/float16/stochastic", "fused_update/bfloat16", "fused_update/float32"]


def test_the_checked_in_table_picks_xla_for_every_op_measured_slower():
    _dispatch._auto_table.cache_clear()
    table = json.loads(_dispatch.AUTO_TABLE_PATH.read_text())
    choices = _dispatch.load_auto_table()
    assert set(choices) == set(_dispatch.OPS)
    for op, entry in table["ops"].items():
        triton, xla = entry["triton_copy_fraction"], entry["xla_copy_fraction"]
        # null: not measured, which never picks the kernel either.
        slower = triton is None or triton < 0.8 or (xla is not None and triton < xla)
        if slower:
            assert choices[op] == "xla", op
            assert _dispatch.auto_choice(op) == "xla"
    # The H200 run of 2026-11-30: every cast below 0.85x of a copy, the fused update below XLA.
    assert table["ops"]["cast/bfloat16/nearest"]["triton_copy_fraction"] == 0.37
    assert table["ops"]["fused_update/float32"]["xla_copy_fraction"] == 1.02


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps([1, 2]), "must be a JSON object"),
        (json.dumps({"date": "x", "ops": {}}), "device_kind"),
        (json.dumps(_table({"cast/bf16/nearest": _entry("xla")})), "unknown operation"),
        (json.dumps(_table({"fused_update/float32": _entry("pallas")})), "choice"),
        (
            json.dumps(
                _table({"fused_update/float32": {**_entry("xla"), "xla_copy_fraction": -1}})
            ),
            "xla_copy_fraction",
        ),
    ],
)
def test_a_malformed_table_is_a_clear_error_naming_the_file(cuda_with_table, content, message):
    cuda_with_table.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        _dispatch.resolve("auto", "cast", "cast/bfloat16/nearest")
    assert str(cuda_with_table) in str(error.value)


def test_write_auto_table_chooses_triton_only_for_a_measured_win(tmp_path):
    path = tmp_path / "auto_table.json"
    rows = [
        {"op": "cast/bfloat16/nearest", "triton_copy_fraction": 0.95, "xla_copy_fraction": 0.97},
        {"op": "cast/bfloat16/stochastic", "triton_copy_fraction": 0.85, "xla_copy_fraction": 0.5},
        {"op": "cast/float16/nearest", "triton_copy_fraction": 0.7, "xla_copy_fraction": 0.5},
        {"op": "cast/float16/stochastic", "triton_copy_fraction": 0.9, "xla_copy_fraction": None},
    ]
    table = _dispatch.write_auto_table(path, rows, device_kind="NVIDIA H200", date="2026-12-01")
    assert table["date"] == "2026-12-01" and table["device_kind"] == "NVIDIA H200"
    assert _dispatch.load_auto_table(path) == {
        "cast/bfloat16/nearest": "xla",  # loses to XLA
        "cast/bfloat16/stochastic": "triton",
        "cast/float16/nearest": "xla",  # below 0.8x of a copy
        "cast/float16/stochastic": "xla",  # no XLA figure to beat
    }
    with pytest.raises(ValueError, match="unknown operation"):
        _dispatch.write_auto_table(path, [{"op": "cast/x/y"}], device_kind="cpu")


def test_launch_config_reads_the_tables_launch_and_refuses_an_uncompiled_one(cuda_with_table):
    from triaccel_jax.kernels import _launch

    ops = {
        "cast/float16/nearest": {**_entry("triton"), "launch": {"block": 4096, "num_warps": 8}},
        "cast/float16/stochastic": _entry("triton"),
    }
    cuda_with_table.write_text(json.dumps(_table(ops)))
    assert _dispatch.launch_config("cast/float16/nearest") == _launch.LaunchConfig(4096, 8)
    assert _dispatch.launch_config("cast/float16/nearest").elements_per_thread == 16
    assert _dispatch.launch_config("cast/float16/stochastic") == _launch.DEFAULT
    assert _dispatch.launch_config("fused_update/float32") == _launch.DEFAULT
    _dispatch._auto_table.cache_clear()
    ops["cast/float16/nearest"]["launch"] = {"block": 3000, "num_warps": 8}
    cuda_with_table.write_text(json.dumps(_table(ops)))
    with pytest.raises(ValueError, match="not one of the compiled candidates") as error:
        _dispatch.launch_config("cast/float16/nearest")
    assert str(cuda_with_table) in str(error.value)


def test_write_auto_table_records_the_measured_launch(tmp_path):
    path = tmp_path / "auto_table.json"
    row = {
        "op": "fused_update/float32",
        "triton_copy_fraction": 0.9,
        "xla_copy_fraction": 0.85,
        "launch": {"block": 2048, "num_warps": 8},
    }
    table = _dispatch.write_auto_table(path, [row], device_kind="NVIDIA H200")
    assert table["ops"]["fused_update/float32"]["launch"] == {"block": 2048, "num_warps": 8}
    with pytest.raises(ValueError, match="compiled candidates"):
        _dispatch.write_auto_table(
            path, [{**row, "launch": {"block": 100, "num_warps": 3}}], device_kind="x"
        )


def test_the_gpu_checks_quantize_rows_time_every_launch_and_fill_the_table(monkeypatch, tmp_path):
    # The bandwidth section's Triton branch for the block-wise quantize and dequantize kernels,
    # on CPU: jax_triton is a stand-in that runs the kernels under Triton's interpreter (in
    # .venv-kernels; skipped where torch or triton is missing).
    pytest.importorskip("torch", reason="the interpreter needs torch (kernels-dev extra)")
    pytest.importorskip("triton", reason="the interpreter needs triton (kernels-dev extra)")
    import importlib.util
    import pathlib
    import sys

    import kernel_bridge

    from triaccel_jax.kernels import _launch

    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", script)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    bandwidth = gpu_check._bandwidth
    fake, calls = kernel_bridge.interpreted_jax_triton()
    monkeypatch.setitem(sys.modules, "jax_triton", fake)
    monkeypatch.setattr(_dispatch, "triton_unavailable_reason", lambda: None)
    # Two candidates (a tile of 2 and of 16 blocks of 256) keep the interpreter's time short.
    candidates = (_launch.LaunchConfig(512, 4), _launch.LaunchConfig(4096, 8))
    monkeypatch.setattr(bandwidth._launch, "CANDIDATES", candidates)
    rows = bandwidth._quantize_rows(2**11, True, 1, bandwidth.Report(1e9))
    quantize_ops = [op for op in _dispatch.OPS if op.split("/")[0] in ("quantize", "dequantize")]
    assert sorted(row["op"] for row in rows) == sorted(quantize_ops)
    for row in rows:
        assert row["triton_copy_fraction"] > 0 and row["xla_copy_fraction"] > 0, row
        assert _launch.parse_launch(row["launch"], row["op"]) in candidates
    assert {call["num_warps"] for call in calls} == {4, 8}  # both candidates ran
    # The table: the quantize ops' figures and launches, every other op listed unmeasured.
    path = tmp_path / "auto_table.json"
    table = bandwidth.write_table(str(path), rows, dry_run=False, source="interpreter")
    assert list(table["ops"]) == list(_dispatch.OPS)
    for op in quantize_ops:
        assert table["ops"][op]["launch"] in [dict(c._asdict()) for c in candidates], op
    assert table["ops"]["cast/bfloat16/nearest"]["xla_copy_fraction"] is None
    assert set(_dispatch.load_auto_table(path)) == set(_dispatch.OPS)
