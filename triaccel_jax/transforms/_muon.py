"""Which leaves ``optax.contrib.muon`` orthogonalizes, and how: kernels of any rank as matrices.

``optax.contrib.muon`` orthogonalizes 2-D leaves and leaves the rest to Adam. A convolution
kernel is a matrix too once its receptive field is folded into the input axis (Jordan et al.'s
Muon reshapes conv filters the same way); optax takes that reshape as
``muon_weight_dimension_numbers``, a tree of ``optax.contrib.MuonDimensionNumbers``.
:func:`muon_dimension_numbers` builds it for Flax's layout (features last), so that the recipe
``optax.contrib.muon(lr, muon_weight_dimension_numbers=muon_dimension_numbers)`` trains every
kernel with Muon and the biases, norms and scalars with Adam. Muon itself stays optax's.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from triaccel_jax._src import tree as tree_lib


def muon_dimension_numbers(params: Any) -> Any:
    """Muon's dimension numbers for Flax-layout kernels: every kernel of rank >= 2 as a matrix.

    A leaf of rank 2 ``(in, out)`` is the matrix itself; a leaf of rank ``r >= 3`` (a Flax
    convolution kernel ``(*window, in, out)``) is the matrix ``(prod(window) * in, out)``: its
    reduction axes are all but the last. Leaves of rank 0 or 1 (biases, norm scales) and
    non-float leaves get None, which ``optax.contrib.muon`` trains with Adam.

    Args:
      params: the params tree (or any tree of its structure with arrays or
        ``jax.ShapeDtypeStruct`` leaves).

    Returns:
      A tree of params' structure holding an ``optax.contrib.MuonDimensionNumbers`` or None per
      leaf, for ``optax.contrib.muon(..., muon_weight_dimension_numbers=...)`` (pass this
      function itself: optax calls it with the params).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from triaccel_jax.transforms import muon_dimension_numbers
      >>> params = {"conv": jnp.ones((3, 3, 2, 4)), "dense": jnp.ones((8, 3)), "bias": jnp.ones(3)}
      >>> numbers = muon_dimension_numbers(params)
      >>> numbers["conv"], numbers["bias"]
      (MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=3), None)
      >>> tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=muon_dimension_numbers)

    References:
      Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural networks";
      ``optax.contrib.muon`` and ``optax.contrib.MuonDimensionNumbers``.
    """

    def numbers(leaf: Any) -> optax.contrib.MuonDimensionNumbers | None:
        rank = len(getattr(leaf, "shape", ()))
        if rank < 2 or not tree_lib.is_trainable(leaf):
            return None
        if rank == 2:
            return optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)
        return optax.contrib.MuonDimensionNumbers(
            reduction_axis=tuple(range(rank - 1)), output_axis=rank - 1
        )

    return jax.tree.map(numbers, params)
