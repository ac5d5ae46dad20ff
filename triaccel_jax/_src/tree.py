"""Pytree helpers: which leaves the optimizer acts on, and readable leaf paths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def is_trainable(leaf: Any) -> bool:
    """Whether the optimizer acts on ``leaf``: a non-empty real floating-point array.

    Integer, boolean and empty leaves pass through every triaccel transform untouched; ``None``
    and ``optax.MaskedNode`` are empty pytree nodes and never reach a leaf function at all.
    Works on arrays and on ``jax.ShapeDtypeStruct``.
    """
    dtype = getattr(leaf, "dtype", None)
    return (
        dtype is not None
        and jnp.issubdtype(dtype, jnp.floating)
        and all(dim > 0 for dim in getattr(leaf, "shape", ()))
    )


def trainable_mask(tree: Any) -> Any:
    """A tree of bools, True where :func:`is_trainable`; usable as an ``optax.masked`` mask."""
    return jax.tree.map(is_trainable, tree)


def _key_name(entry: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def path_string(path: Sequence[Any]) -> str:
    """A leaf path as ``"a/b/0/kernel"``: dict keys, attribute names and indices joined by '/'."""
    return "/".join(_key_name(entry) for entry in path)
