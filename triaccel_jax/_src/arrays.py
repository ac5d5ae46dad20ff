"""Shapes, dtypes and byte counts of pytrees, read without touching the arrays' data.

One definition, shared by the controller (compile-time arguments, the fixed bytes of a step) and
the memory report (exact bytes from dtypes).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def nbytes(leaf: Any) -> int:
    """Bytes of an array or ``jax.ShapeDtypeStruct``; 0 for anything without a shape and dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax._src import arrays
      >>> arrays.nbytes(jnp.zeros((2, 3), jnp.bfloat16)), arrays.nbytes(jax.random.key(0))
      (12, 8)
    """
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return 0
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        # Typed PRNG keys have no numpy itemsize; what they occupy is their key data.
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        return math.prod(data.shape) * data.dtype.itemsize
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def tree_nbytes(tree: Any) -> int:
    """Sum of :func:`nbytes` over the leaves of ``tree``."""
    return sum(nbytes(leaf) for leaf in jax.tree.leaves(tree))


def abstract(x: Any) -> Any:
    """``x`` as a ``jax.ShapeDtypeStruct``, so that tracing or lowering allocates nothing.

    A ``jax.Array`` keeps its sharding and weak type (a compiled step then accepts the real array);
    other arrays, NumPy scalars and ``ShapeDtypeStruct`` keep shape and dtype; anything without a
    dtype (``None``, ``optax.MaskedNode``) is returned as it is.
    """
    if isinstance(x, jax.Array):
        weak = getattr(x, "weak_type", False)  # typed PRNG keys have none
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=weak)
    if isinstance(x, np.generic):
        return jax.ShapeDtypeStruct((), x.dtype)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return x


def abstract_tree(tree: Any) -> Any:
    """:func:`abstract` on every leaf of ``tree``."""
    return jax.tree.map(abstract, tree)
