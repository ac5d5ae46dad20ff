"""The compressed curvature EMA update on a sharded leaf, without gathering the leaf (docs/design.md §3).

:func:`triaccel_jax.transforms._compression.update_compressed_ema` is the reference: it flattens the
leaf, cuts it into blocks and takes a top-``k`` over all of it. On a leaf sharded over a mesh
(FSDP-style), XLA's partitioner can do neither locally: it all-gathers the whole leaf onto every
device for the reshape and for ``TopK``, whose sort dimension it does not partition.

:func:`update_compressed_ema` computes the same store with a custom partitioning
(``jax.experimental.custom_partitioning``): XLA hands it the leaf's actual sharding, and each
device then works on its own shard only.

* Block means: each shard adds its elements into the (small, replicated) vector of block sums at
  their global block ids, or sums a conv kernel's spatial dims into its slice of the channel-pair
  means; a ``psum`` over the mesh axes that shard the leaf completes the sums.
* Top-``k`` by magnitude, exact: each shard keeps its own top ``min(k, shard size)`` with global
  flat indices; the candidates (``k`` per shard, not the leaf) are all-gathered, put in global
  index order, and the final ``top_k`` picks ``k``. Every global top-``k`` entry is in its shard's
  top ``k``, and both stages break ties by the lower flat index, as ``lax.top_k`` on the flat leaf
  does, so indices and values equal the reference's.

Without a mesh, on one device, or inside a fully manual ``shard_map``, the reference itself runs.
A leaf whose sharded dimensions do not divide evenly is replicated first (correct, but gathered).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.custom_batching
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from triaccel_jax.transforms import _compression as compression


def update_compressed_ema(
    store: compression.CompressedDiagonal, h: jax.Array, decay: jax.typing.ArrayLike
) -> compression.CompressedDiagonal:
    """:func:`compression.update_compressed_ema`, partitioned shard by shard when ``h`` is sharded.

    Args:
      store: the current EMA (replicated on the leaf's mesh, as ``scale_by_triaccel.init`` places
        it).
      h: the new diagonal estimate, shaped (and sharded) like the leaf.
      decay: the EMA decay in [0, 1).

    Returns:
      The updated store, equal to the reference's (block means up to float32 summation order;
      outlier indices and values exactly), replicated.
    """
    decay = jnp.asarray(decay, jnp.float32)
    update: Callable[..., Any] = _partitioned_update
    explicit = _explicit_axes(h)
    if explicit:
        # Under sharding in types (jax.make_mesh's default Explicit axes) the leaf's type carries
        # its sharding, and the reshape and top-k refuse a sharded dimension; custom
        # partitioning does not see through it. The leaf is gathered (replicated) for the
        # update, as for unevenly sharded leaves: correct, at the cost of one gather every
        # curvature step. Auto-axis meshes keep the shard-by-shard update.
        h = jax.sharding.reshard(h, NamedSharding(jax.typeof(h).sharding.mesh, P()))
        update = _reference
    means, indices, values = update(
        h.astype(jnp.float32), store.block_means, store.outlier_indices, store.outlier_values, decay
    )
    return compression.CompressedDiagonal(means, indices, values)


def is_known_whole(x: jax.Array) -> bool:
    """Whether ``x`` is known, when traced, to be whole on every device that holds it.

    True on a single-device backend, for a concrete array that is fully replicated, and for an
    array whose type carries its sharding (Explicit mesh axes) and shards no dimension. A traced
    array on several devices whose sharding XLA decides later (Auto axes) may be sharded: False,
    so that its caller keeps it on the partitioned per-leaf path, which never gathers it.
    """
    if jax.device_count() == 1:
        return True
    if not isinstance(x, jax.core.Tracer):
        sharding = getattr(x, "sharding", None)
        return sharding is not None and sharding.is_fully_replicated
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
        return False
    if any(kind != jax.sharding.AxisType.Explicit for kind in mesh.axis_types):
        return False
    spec = getattr(sharding, "spec", None)
    return spec is not None and all(entry is None for entry in tuple(spec))


def _explicit_axes(x: jax.Array) -> tuple[str, ...]:
    """The mesh axes of ``x``'s type that are Explicit (sharding in types); empty otherwise."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
        return ()
    explicit = jax.sharding.AxisType.Explicit
    return tuple(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == explicit
    )


def _reference(h, block_means, outlier_indices, outlier_values, decay):
    store = compression.CompressedDiagonal(block_means, outlier_indices, outlier_values)
    return tuple(compression.update_compressed_ema(store, h, decay))


def _rule(mesh, operand_types, result_types) -> str:
    """Shardy rule ``'<leaf dims>, <means dims>, k, k, -> <means dims>, k, k'`` from the shapes.

    The store's factors appear in no dimension of the leaf, so Shardy keeps the store replicated
    whatever the leaf's sharding.
    """
    del mesh, result_types
    ranks = [len(jax_type.shape) for jax_type in operand_types]
    leaf = " ".join(f"l{i}" for i in range(ranks[0]))
    means = " ".join(f"m{i}" for i in range(ranks[1]))
    return f"{leaf}, {means}, k, k, -> {means}, k, k"


def _infer_replicated(mesh, arg_shapes, result_shape):
    return tuple(NamedSharding(mesh, P()) for _ in range(3))


def _partition(mesh, arg_shapes, result_shape):
    leaf = arg_shapes[0]
    replicated = NamedSharding(mesh, P())
    spec = _full_spec(leaf.sharding.spec, len(leaf.shape))
    if not _divides_evenly(mesh, leaf.shape, spec):
        spec = (None,) * len(leaf.shape)
    leaf_sharding = NamedSharding(mesh, P(*spec))
    lower = functools.partial(
        _update_shard, mesh_shape=dict(mesh.shape), spec=spec, shape=leaf.shape
    )
    arg_shardings = (leaf_sharding, replicated, replicated, replicated, replicated)
    return mesh, lower, (replicated, replicated, replicated), arg_shardings


def _full_spec(spec: Any, ndim: int) -> tuple[tuple[str, ...] | None, ...]:
    """One entry per dimension: None or the tuple of mesh axes sharding it."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(
        None if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        for entry in entries
    )


def _divides_evenly(mesh, shape, spec) -> bool:
    return all(
        axes is None or size % math.prod(mesh.shape[a] for a in axes) == 0
        for size, axes in zip(shape, spec, strict=True)
    )


def _update_shard(
    h, block_means, outlier_indices, outlier_values, decay, *, mesh_shape, spec, shape
):
    """The update on one shard ``h`` of a leaf of global ``shape`` (collectives over ``spec``)."""
    local = h.shape
    axes = tuple(a for entry in spec if entry is not None for a in entry)
    offsets = []
    for size, entry in zip(local, spec, strict=True):
        position = jnp.int32(0)
        for a in entry or ():
            position = position * mesh_shape[a] + lax.axis_index(a)
        offsets.append(position * size)

    # The global flat index of every local element (row-major, as the reference flattens).
    flat = jnp.zeros(local, jnp.int32)
    for d, offset in enumerate(offsets):
        coordinate = lax.broadcasted_iota(jnp.int32, local, d) + offset
        flat = flat * shape[d] + coordinate

    # This shard's part of the expanded store: its block means, with the outliers that fall in it.
    if compression.uses_channel_pairs(shape):
        pairs = lax.dynamic_slice(block_means, (offsets[2], offsets[3]), local[2:])
        expanded = jnp.broadcast_to(pairs, local)
    else:
        length, _ = compression.block_counts(math.prod(shape), block_means.size)
        expanded = block_means[flat // length]
    coordinates = jnp.unravel_index(outlier_indices, shape)
    inside = jnp.ones(outlier_indices.shape, bool)
    local_flat = jnp.zeros(outlier_indices.shape, jnp.int32)
    for c, size, offset in zip(coordinates, local, offsets, strict=True):
        inside &= (c >= offset) & (c < offset + size)
        local_flat = local_flat * size + (c - offset)
    drop = math.prod(local)  # out of range: the scatter drops it
    expanded = (
        expanded.reshape(-1)
        .at[jnp.where(inside, local_flat, drop)]
        .set(outlier_values, mode="drop")
        .reshape(local)
    )
    blended = decay * expanded + (1 - decay) * h

    # Block sums of h: local partial sums, completed over the axes that shard the leaf.
    if compression.uses_channel_pairs(shape):
        partial = jnp.zeros(block_means.shape, jnp.float32)
        partial = lax.dynamic_update_slice(
            partial, jnp.sum(h, axis=(0, 1)), (offsets[2], offsets[3])
        )
        counts = shape[0] * shape[1]
    else:
        length, counts = compression.block_counts(math.prod(shape), block_means.size)
        partial = (
            jnp.zeros(block_means.shape, jnp.float32)
            .at[(flat // length).reshape(-1)]
            .add(h.reshape(-1))
        )
    sums = lax.psum(partial, axes) if axes else partial
    means = decay * block_means + (1 - decay) * (sums / counts)

    # Exact top-k: each shard's own top k with global indices, then the top k of the candidates.
    k = outlier_values.size
    candidates = min(k, blended.size)
    _, positions = lax.top_k(jnp.abs(blended.reshape(-1)), candidates)
    values = blended.reshape(-1)[positions]
    indices = flat.reshape(-1)[positions]
    if axes:
        values = lax.all_gather(values, axes, tiled=True)
        indices = lax.all_gather(indices, axes, tiled=True)
        order = jnp.argsort(indices)  # ties then go to the lower flat index, as in the reference
        values, indices = values[order], indices[order]
    _, best = lax.top_k(jnp.abs(values), k)
    return means.astype(jnp.float32), indices[best], values[best]


# The reference is what runs wherever XLA does not partition (one device, no mesh, manual axes).
_partitioned = custom_partitioning(_reference)
_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer_replicated,
    sharding_rule=_rule,
)


@jax.custom_batching.custom_vmap
def _partitioned_update(h, block_means, outlier_indices, outlier_values, decay):
    return _partitioned(h, block_means, outlier_indices, outlier_values, decay)


@_partitioned_update.def_vmap
def _partitioned_update_vmap(axis_size, in_batched, *args):
    # custom_partitioning has no batching rule; a vmapped update (an ensemble of optimizers, say)
    # runs the batched reference instead.
    del axis_size
    in_axes = tuple(0 if batched else None for batched in in_batched)
    return jax.vmap(_reference, in_axes=in_axes)(*args), (True, True, True)
