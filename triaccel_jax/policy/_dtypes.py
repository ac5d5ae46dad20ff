"""The floating-point formats a precision policy may choose, by short name.

Unit roundoffs are ``u = eps / 2`` (docs/design.md §3): fp32 2^-24, bf16 2^-8, fp16 2^-11, fp8-e4m3 2^-4.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax.numpy as jnp

from triaccel_jax.policy._state_format import STATE_FORMATS


class FloatFormat(NamedTuple):
    """A format's short name, JAX dtype, bytes per element, unit roundoff and largest finite."""

    name: str
    dtype: Any
    itemsize: int
    unit_roundoff: float
    max_finite: float


def _format(name: str, dtype: Any) -> FloatFormat:
    info = jnp.finfo(dtype)
    return FloatFormat(name, jnp.dtype(dtype), info.bits // 8, float(info.eps) / 2, float(info.max))


# Ordered from the most to the least precise.
FORMATS: dict[str, FloatFormat] = {
    "fp32": _format("fp32", jnp.float32),
    "bf16": _format("bf16", jnp.bfloat16),
    "fp16": _format("fp16", jnp.float16),
}
if hasattr(jnp, "float8_e4m3fn"):
    FORMATS["fp8_e4m3"] = _format("fp8_e4m3", jnp.float8_e4m3fn)

COMPUTE_NAMES = ("fp32", "bf16", "fp16", "fp8_e4m3")


def float_format(name: str) -> FloatFormat:
    """The :class:`FloatFormat` of the short name ``name`` (``"fp32"``, ``"bf16"``, ...).

    Example:
      >>> from triaccel_jax.policy import float_format
      >>> float_format("bf16").dtype, float_format("bf16").unit_roundoff
      (dtype(bfloat16), 0.00390625)

    Raises:
      KeyError: ``name`` is not a short name this JAX provides (see :func:`format_name`).
    """
    return FORMATS[name]


# fp8 values are carried in bf16 (fp8 times a per-leaf scale, rounded to bf16), since XLA has no
# general unscaled fp8 matmul: an fp8 compute copy, and an fp8 leaf's master under ``master_dtype="policy"``, are
# bf16 arrays. This is the one place that rule lives.
_CARRIED_IN = {"fp8_e4m3": "bf16"}


def carrier_name(name: str) -> str:
    """The format whose dtype holds the values of format ``name`` (``"bf16"`` for fp8).

    Example:
      >>> from triaccel_jax.policy._dtypes import carrier_name
      >>> carrier_name("fp16"), carrier_name("fp8_e4m3")
      ('fp16', 'bf16')
    """
    return _CARRIED_IN.get(name, name)


def carrier_dtype(name: str) -> jnp.dtype:
    """The dtype an array rounded to format ``name`` is stored in (bfloat16 for fp8).

    Example:
      >>> from triaccel_jax.policy import carrier_dtype
      >>> carrier_dtype("fp16"), carrier_dtype("fp8_e4m3")
      (dtype('float16'), dtype(bfloat16))
    """
    return FORMATS[carrier_name(name)].dtype


def carried_itemsize(name: str) -> int:
    """Bytes per element of a compute copy in format ``name``: 2 for fp8, carried in bf16."""
    return FORMATS[carrier_name(name)].itemsize


# The dtypes a policy keeps a leaf's own optimizer state in: the float formats of the state
# registry (the coded ones are quantize_state's, around another optimizer).
STATE_NAMES = tuple(name for name, state in STATE_FORMATS.items() if state.is_float)

_ALIASES = {
    "float32": "fp32",
    "f32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "f16": "fp16",
    "half": "fp16",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8-e4m3": "fp8_e4m3",
    "fp8": "fp8_e4m3",
    "e4m3": "fp8_e4m3",
}


def format_name(
    value: Any, *, allowed: tuple[str, ...] = COMPUTE_NAMES, what: str = "dtype"
) -> str:
    """The short name (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``) of a name or dtype.

    Raises:
      ValueError: the name is unknown, not in ``allowed``, or fp8 is missing from this JAX.
    """
    if isinstance(value, str):
        name = _ALIASES.get(value.lower(), value.lower())
    else:
        try:
            name = _ALIASES.get(jnp.dtype(value).name, jnp.dtype(value).name)
        except TypeError:
            name = repr(value)
    if name not in COMPUTE_NAMES or name not in allowed:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(allowed)}")
    if name not in FORMATS:
        raise ValueError(
            f"{what} {value!r} needs float8_e4m3fn, which this JAX/ml_dtypes does not provide"
        )
    return name
