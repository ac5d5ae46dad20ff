"""Choosing a kernel's implementation at trace time: ``"auto" | "reference" | "triton"``.

``"auto"`` picks, per operation, what a GPU measurement showed to be faster (docs/design.md §4, §8):
the Triton kernel only where the default JAX backend is a CUDA GPU, ``jax_triton`` imports, and
the measured table ``auto_table.json`` (beside this module) says ``"triton"`` for that operation;
the pure-JAX reference, which XLA compiles and fuses (``"xla"`` in the table), everywhere else,
including for operations the table does not list. The table is written by
``benchmarks/gpu_check.py`` through :func:`write_auto_table` and read once per process.

The check runs when a function is traced, never at import time, so ``import triaccel_jax`` never
imports triton or jax_triton; and on a CPU backend it does not even try to import them.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import json
import math
import pathlib
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from triaccel_jax.kernels import _launch

IMPLS = ("auto", "reference", "triton")
CHOICES = ("triton", "xla")
AUTO_TABLE_PATH = pathlib.Path(__file__).with_name("auto_table.json")
CAST_TARGETS = ("bfloat16", "float16", "float8_e4m3fn")
ROUNDINGS = ("nearest", "stochastic")
MOMENT_DTYPES = ("float32", "bfloat16")


def cast_op(dtype: Any, rounding: str) -> str:
    """The table's name for a cast: ``"cast/<target dtype>/<rounding>"``.

    Example:
      >>> import jax.numpy as jnp
      >>> cast_op(jnp.bfloat16, "stochastic")
      'cast/bfloat16/stochastic'
    """
    return f"cast/{jnp.dtype(dtype).name}/{rounding}"


def fused_update_op(moment_dtype: Any) -> str:
    """The table's name for the fused update with moments in ``moment_dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> fused_update_op(jnp.float32)
      'fused_update/float32'
    """
    return f"fused_update/{jnp.dtype(moment_dtype).name}"


QUANTIZE_MAPS = ("linear", "sqrt")


def quantize_op(mapping: str, rounding: str) -> str:
    """The table's name for block-wise quantization: ``"quantize/<map>/<rounding>"``.

    Example:
      >>> quantize_op("sqrt", "stochastic")
      'quantize/sqrt/stochastic'
    """
    return f"quantize/{mapping}/{rounding}"


def dequantize_op(mapping: str) -> str:
    """The table's name for block-wise dequantization: ``"dequantize/<map>"``.

    Example:
      >>> dequantize_op("linear")
      'dequantize/linear'
    """
    return f"dequantize/{mapping}"


OPS = (
    tuple(cast_op(t, r) for t in CAST_TARGETS for r in ROUNDINGS)
    + tuple(fused_update_op(m) for m in MOMENT_DTYPES)
    + tuple(quantize_op(m, r) for m in QUANTIZE_MAPS for r in ROUNDINGS)
    + tuple(dequantize_op(m) for m in QUANTIZE_MAPS)
)


def _fraction(path: pathlib.Path, op: str, name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{path}: {op}.{name} must be a finite number or null, got {value!r}")
    if value < 0:
        raise ValueError(f"{path}: {op}.{name} must be >= 0, got {value!r}")
    return float(value)


def parse_auto_table(table: Any, path: pathlib.Path | str) -> dict[str, str]:
    """Checks a decoded auto table; returns its ``{op: "triton" | "xla"}`` choices.

    Args:
      table: the decoded JSON object: ``device_kind`` and ``date`` (strings) and ``ops``, a map
        from names in :data:`OPS` to ``{"choice": "triton" | "xla", "triton_copy_fraction":
        float | null, "xla_copy_fraction": float | null}``, with an optional ``"launch":
        {"block": int, "num_warps": int}`` (one of the compiled launch candidates).
      path: where it came from, named in every error.

    Returns:
      The choice of each listed operation.

    Raises:
      ValueError: a missing or mistyped field, an unknown operation or choice.
    """
    path = pathlib.Path(path)
    if not isinstance(table, dict):
        raise ValueError(
            f"{path}: the auto table must be a JSON object, got {type(table).__name__}"
        )
    for field in ("device_kind", "date"):
        if not isinstance(table.get(field), str):
            raise ValueError(f"{path}: field {field!r} must be a string, got {table.get(field)!r}")
    ops = table.get("ops")
    if not isinstance(ops, dict):
        raise ValueError(f"{path}: field 'ops' must be an object mapping operations to entries")
    choices = {}
    for op, entry in ops.items():
        if op not in OPS:
            raise ValueError(f"{path}: unknown operation {op!r}; known: {OPS}")
        if not isinstance(entry, dict) or entry.get("choice") not in CHOICES:
            raise ValueError(f"{path}: {op} needs a 'choice' in {CHOICES}, got {entry!r}")
        for name in ("triton_copy_fraction", "xla_copy_fraction"):
            _fraction(path, op, name, entry.get(name))
        if entry.get("launch") is not None:
            _launch.parse_launch(entry["launch"], f"{path}: {op}")
        choices[op] = entry["choice"]
    return choices


def _read_table(path: pathlib.Path) -> dict[str, Any]:
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: the auto table is not valid JSON: {error}") from None
    parse_auto_table(table, path)
    return table


def load_auto_table(path: pathlib.Path | str = AUTO_TABLE_PATH) -> dict[str, str]:
    """Reads and checks the auto table at ``path``; returns ``{op: "triton" | "xla"}``.

    Raises:
      ValueError: the file is not valid JSON or not a valid table (the message names the file).
      OSError: the file cannot be read.
    """
    path = pathlib.Path(path)
    return parse_auto_table(_read_table(path), path)


@functools.cache
def _auto_table() -> dict[str, Any]:
    """The checked-in table's ops, read once per process (a missing file lists no operation)."""
    if not AUTO_TABLE_PATH.exists():
        return {}
    return _read_table(AUTO_TABLE_PATH)["ops"]


def auto_choice(op: str) -> str:
    """What ``impl="auto"`` uses for ``op`` where Triton can run: ``"triton"`` or ``"xla"``.

    An operation the table does not list gets ``"xla"`` (the reference): Triton is used only
    where a measurement showed it faster.
    """
    return _auto_table().get(op, {}).get("choice", "xla")


def launch_config(op: str) -> _launch.LaunchConfig:
    """How the Triton kernel for ``op`` is launched: the table's measured ``"launch"``, if any.

    Returns:
      The table entry's ``launch`` (one of :data:`triaccel_jax.kernels._launch.CANDIDATES`), or
      :data:`triaccel_jax.kernels._launch.DEFAULT` (1024 elements, 4 warps) without one.
    """
    launch = _auto_table().get(op, {}).get("launch")
    if launch is None:
        return _launch.DEFAULT
    return _launch.parse_launch(launch, f"{AUTO_TABLE_PATH}: {op}")


def write_auto_table(
    path: pathlib.Path | str,
    rows: Iterable[Mapping[str, Any]],
    *,
    device_kind: str,
    date: str | None = None,
    source: str = "",
) -> dict[str, Any]:
    """Writes an auto table from measured rows, choosing per op what the figures justify.

    A row ``{"op", "triton_copy_fraction", "xla_copy_fraction"}`` (fractions of a measured device
    copy's bytes per second; optionally ``"launch": {"block", "num_warps"}``, the fastest of
    :data:`triaccel_jax.kernels._launch.CANDIDATES` that the Triton figure was measured with) gets ``"triton"`` when the Triton kernel reaches at least
    ``min_copy_fraction`` of the copy (0.8 unless the row says otherwise) and at least XLA's
    figure for the same op; ``"xla"`` otherwise (also when a figure is missing).

    Args:
      path: the file to write (``kernels/auto_table.json`` to change what ``auto``
        does).
      rows: one mapping per measured operation; ``op`` must be in :data:`OPS`.
      device_kind: ``jax.devices()[0].device_kind`` of the measuring device.
      date: ISO date of the measurement (today, UTC, by default).
      source: how the figures were measured (script, sizes, versions).

    Returns:
      The table written (it passes :func:`parse_auto_table`).

    Example:
      >>> import json, tempfile, pathlib
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "auto_table.json"
      >>> rows = [
      ...     {
      ...         "op": "fused_update/bfloat16",
      ...         "triton_copy_fraction": 0.85,
      ...         "xla_copy_fraction": 0.51,
      ...     }
      ... ]
      >>> write_auto_table(path, rows, device_kind="NVIDIA H200")["ops"]["fused_update/bfloat16"]
      {'choice': 'triton', 'triton_copy_fraction': 0.85, 'xla_copy_fraction': 0.51}
      >>> load_auto_table(path)
      {'fused_update/bfloat16': 'triton'}
    """
    path = pathlib.Path(path)
    ops: dict[str, dict[str, Any]] = {}
    for row in rows:
        op = row["op"]
        triton = _fraction(path, op, "triton_copy_fraction", row.get("triton_copy_fraction"))
        xla = _fraction(path, op, "xla_copy_fraction", row.get("xla_copy_fraction"))
        floor = row.get("min_copy_fraction", 0.8)
        wins = triton is not None and xla is not None and triton >= max(floor, xla)
        ops[op] = {
            "choice": "triton" if wins else "xla",
            "triton_copy_fraction": triton,
            "xla_copy_fraction": xla,
        }
        if row.get("launch") is not None:  # the fastest candidate, measured: _launch.CANDIDATES
            ops[op]["launch"] = dict(_launch.parse_launch(row["launch"], f"{path}: {op}")._asdict())
    table = {
        "device_kind": device_kind,
        "date": date or datetime.datetime.now(datetime.UTC).date().isoformat(),
        "source": source,
        "ops": ops,
    }
    parse_auto_table(table, path)  # never write a table the reader would refuse
    path.write_text(json.dumps(table, indent=2) + "\n")
    return table


def _cuda_backend() -> bool:
    """True when JAX's default backend is an NVIDIA GPU (CUDA, not ROCm)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        version = jax.devices()[0].client.platform_version
    except Exception:  # a backend without the attribute: judge by the platform name alone
        return True
    return "rocm" not in str(version).lower()


@functools.cache
def _jax_triton_import_error() -> str | None:
    """Why ``jax_triton`` cannot be imported, or None when it can (tried once per process)."""
    try:
        importlib.import_module("jax_triton")
    except Exception as error:  # jax_triton raises ValueError, not ImportError, without GPU jaxlib
        return f"{type(error).__name__}: {error}"
    return None


def triton_unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run here, or None when they can.

    Returns:
      None on a CUDA backend where ``jax_triton`` imports; else a sentence saying what is missing.
    """
    if not _cuda_backend():
        return (
            f"JAX's default backend is {jax.default_backend()!r}; the Triton kernels need a CUDA "
            "GPU backend (install jax[cuda12] on a machine with an NVIDIA GPU)"
        )
    error = _jax_triton_import_error()
    if error is not None:
        return f"jax_triton cannot be imported ({error}); install the `gpu` extra (jax-triton)"
    return None


def resolve(impl: str, kernel: str, op: str | None = None) -> str:
    """Resolves ``impl`` to ``"reference"`` or ``"triton"`` for the kernel named ``kernel``.

    Args:
      impl: ``"auto"``, ``"reference"`` or ``"triton"``.
      kernel: the kernel's name, for error messages.
      op: the operation's name in the auto table (:func:`cast_op`, :func:`fused_update_op`,
        :func:`quantize_op`, :func:`dequantize_op`);
        None: ``kernel``, which no table lists, so ``"auto"`` gives the reference.

    Returns:
      ``"triton"`` or ``"reference"``.

    Raises:
      ValueError: ``impl`` is not one of :data:`IMPLS`.
      RuntimeError: ``impl="triton"`` where the Triton kernels cannot run.
    """
    if impl not in IMPLS:
        raise ValueError(f"`impl` must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return "reference"
    reason = triton_unavailable_reason()
    if impl == "triton" and reason is not None:
        raise RuntimeError(f"impl='triton' for the {kernel} kernel is not available here: {reason}")
    if impl == "triton":
        return "triton"
    if reason is not None:
        return "reference"
    return "triton" if auto_choice(kernel if op is None else op) == "triton" else "reference"
