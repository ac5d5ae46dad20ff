"""Argument checks shared by the factories.

Every check accepts traced values silently: under ``optax.inject_hyperparams`` the numeric
hyperparameters arrive as arrays inside ``jit``, where they cannot be inspected, and they were
already checked when the state was initialised outside ``jit``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from typing import overload

import jax
import jax.numpy as jnp
import numpy as np


def _concrete_float(value: Any) -> float | None:
    """Returns ``value`` as a Python float, or None when it cannot be inspected (traced)."""
    if isinstance(value, jax.core.Tracer):
        return None
    array = np.asarray(value)
    if array.shape != ():
        raise ValueError(f"expected a scalar, got an array of shape {array.shape}")
    return float(array)


def check_in_range(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``value`` lies in the given interval."""
    if callable(value):  # a schedule: checked by the caller on its own values, if at all
        return
    try:
        number = _concrete_float(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"`{name}` must be a real scalar, got {value!r}: {error}") from None
    if number is None:
        return
    above = number >= low if low_inclusive else number > low
    below = number <= high if high_inclusive else number < high
    if not math.isfinite(number) or not (above and below):
        left = "[" if low_inclusive else "("
        right = "]" if high_inclusive else ")"
        hint = ""
        dtype = getattr(value, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            # optax.inject_hyperparams stores hyperparameters in the params' dtype by default,
            # where b2 = 0.999 rounds to 1 in bfloat16.
            hint = (
                f" ({name} was rounded to {dtype}: under optax.inject_hyperparams with "
                "low-precision params pass hyperparam_dtype=jnp.float32)"
            )
        raise ValueError(f"`{name}` must be in {left}{low}, {high}{right}, got {value!r}{hint}")


def check_not_above(low_name: str, low: Any, high_name: str, high: Any) -> None:
    """Raises ``ValueError`` when both values are concrete and ``low > high``."""
    low_value, high_value = _concrete_float(low), _concrete_float(high)
    if low_value is not None and high_value is not None and low_value > high_value:
        raise ValueError(
            f"`{high_name}` must be >= `{low_name}`, got {high_name}={high!r} < {low_name}={low!r}"
        )


def check_learning_rate(value: Any) -> None:
    """Raises ``ValueError`` for a negative or non-finite constant learning rate."""
    if callable(value):
        return
    try:
        number = _concrete_float(value) if not isinstance(value, str) else math.nan
    except (TypeError, ValueError):  # None, an array, another object
        number = math.nan
    if number is not None and not (math.isfinite(number) and number >= 0):
        raise ValueError(
            f"`learning_rate` must be a finite number >= 0 or a schedule, got {value!r}"
        )


@overload
def check_integer(
    name: str,
    value: jax.core.Tracer,
    minimum: int,
    *,
    strict: bool = ...,
    description: str | None = ...,
) -> jax.core.Tracer: ...


@overload
def check_integer(
    name: str,
    value: Any,
    minimum: int,
    *,
    strict: bool = ...,
    description: str | None = ...,
) -> int: ...


def check_integer(
    name: str,
    value: Any,
    minimum: int,
    *,
    strict: bool = False,
    description: str | None = None,
) -> int | jax.core.Tracer:
    """Returns ``value`` as an ``int``, or raises ``ValueError`` naming ``name``.

    Args:
      name: the argument's name, for the message.
      value: what the caller passed.
      minimum: the smallest allowed value.
      strict: accept only Python and NumPy integers (not ``2.0``): for counts that index or
        size arrays, where a float is a caller's mistake rather than a number.
      description: what the value must be, for the message (default
        ``"an integer >= {minimum}"``).

    Returns:
      ``value`` as an ``int`` (a traced value is returned as it is: it cannot be inspected).

    Example:
      >>> from triaccel_jax._src import validation
      >>> validation.check_integer("steps", 3.0, 0)
      3
      >>> validation.check_integer("steps", 3.0, 0, strict=True)
      Traceback (most recent call last):
      ...
      ValueError: `steps` must be an integer >= 0, got 3.0
    """
    if isinstance(value, jax.core.Tracer):
        return value
    wanted = description or f"an integer >= {minimum}"
    problem = ValueError(f"`{name}` must be {wanted}, got {value!r}")
    if isinstance(value, bool) or (strict and not isinstance(value, int | np.integer)):
        raise problem
    try:
        number = float(np.asarray(value))
    except (TypeError, ValueError):
        number = math.nan
    if not number.is_integer() or number < minimum:
        raise problem
    return int(number)


def real_scalar(name: str, value: Any, description: str = "a real number") -> float:
    """``value`` as a float, or ``TypeError`` saying it must be ``description``.

    Python, NumPy and concrete JAX scalars (a float32 loss times a fraction, say) are numbers;
    booleans, strings, complex numbers and arrays are not. Range checks are the caller's.

    Example:
      >>> import numpy as np
      >>> from triaccel_jax._src import validation
      >>> validation.real_scalar("budget", np.float32(0.5))
      0.5
    """
    problem = TypeError(f"`{name}` must be {description}, got {value!r}")
    if isinstance(value, bool | str | bytes) or np.ndim(value) != 0:
        raise problem
    kind = np.asarray(value).dtype
    if not (np.issubdtype(kind, np.floating) or np.issubdtype(kind, np.integer)):
        raise problem
    return float(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """Returns ``value`` if it is one of ``choices``, else raises ``ValueError`` listing them."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}")
    return value


def check_callable(name: str, value: Any) -> Callable[..., Any]:
    """Returns ``value`` if callable, else raises ``TypeError`` naming ``name``."""
    if not callable(value):
        raise TypeError(f"`{name}` must be callable, got {type(value).__name__}")
    return value
