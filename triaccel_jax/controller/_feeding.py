"""``BatchFeeder``: the controller's data, checked once, served as device batches (docs/design.md §5).

The controller draws sample indices from its sampler; the feeder turns them into a batch of
shape ``(micro-batches, micro-batch, ...)`` on the devices, sharded over the mesh's data axis
when there is a mesh (each process then fetches only the rows its own devices hold), and places
the training state (params, optimizer state) where compiled steps expect it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from triaccel_jax._src import validation


def strong(x: Any) -> Any:
    """``x`` as a committed, non-weakly-typed jax array, so compiled steps accept it every time."""
    if isinstance(x, jax.Array):
        return jax.lax.convert_element_type(x, x.dtype) if getattr(x, "weak_type", False) else x
    return jnp.asarray(np.asarray(x))


def _check_arrays(data: Any, num_examples: int | None) -> tuple[Any, int]:
    """``data`` (a pytree of arrays, samples on the leading axis) on the host, and its size."""
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise ValueError("`data` holds no arrays")
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"every array in `data` needs the samples on its leading axis, of one size; got "
            f"leading sizes {sorted(map(str, sizes))}"
        )
    (size,) = sizes
    assert size is not None  # refused above
    if size == 0:
        raise ValueError("`data` holds no samples")
    if num_examples is not None and num_examples != size:
        raise ValueError(f"`num_examples` ({num_examples}) does not match the data ({size})")
    return jax.tree.map(np.asarray, data), size


class BatchFeeder:
    """Serves the samples at given indices as a device batch, and places state on the mesh.

    Args:
      data: a pytree of arrays with the samples on the leading axis, or a callable
        ``indices -> batch`` (then ``num_examples`` is required).
      num_examples: the data set size when ``data`` is a callable.
      mesh: a ``jax.sharding.Mesh`` to shard batches over, or None (one device).
      data_axis: the mesh axis batches are split over.

    Attributes:
      num_examples: the data set size.
      sample_spec: the shapes and dtypes of the data, with a leading axis of 0.
      multiple: the data-parallel width (the size of ``data_axis``; 1 without a mesh).

    Example:
      >>> import numpy as np
      >>> from triaccel_jax.controller._feeding import BatchFeeder
      >>> feeder = BatchFeeder({"x": np.arange(10.0)[:, None]}, None, None, "data")
      >>> feeder.num_examples, feeder.device_batch(np.array([3, 1, 4, 1]), 2, 2)["x"].shape
      (10, (2, 2, 1))
    """

    def __init__(
        self, data: Any, num_examples: int | None, mesh: jax.sharding.Mesh | None, data_axis: str
    ) -> None:
        self._mesh, self._data_axis = mesh, data_axis
        self.multiple = 1
        if mesh is not None:
            if data_axis not in mesh.shape:
                raise ValueError(
                    f"`data_axis` {data_axis!r} is not an axis of the mesh {dict(mesh.shape)}"
                )
            self.multiple = int(mesh.shape[data_axis])
        self._fetch: Callable[[np.ndarray], Any]
        if callable(data):
            if num_examples is None:
                raise ValueError("`num_examples` is required when `data` is a callable")
            self.num_examples = validation.check_integer("num_examples", num_examples, 1)
            one = data(np.arange(1))  # the shapes of one sample
            self.sample_spec = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((0, *np.shape(x)[1:]), np.asarray(x).dtype), one
            )
            self._fetch = self._checked(data)
        else:
            host, self.num_examples = _check_arrays(data, num_examples)
            self.sample_spec = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((0, *x.shape[1:]), x.dtype), host
            )
            self._fetch = lambda idx: jax.tree.map(lambda x: x[idx], host)

    def _checked(self, data: Callable[[np.ndarray], Any]) -> Callable[[np.ndarray], Any]:
        """``data`` with each reply checked against the first sample's structure and shapes, so
        that a callable returning the wrong rows fails naming the leaf, not in a reshape."""
        expected: Any = jax.tree.structure(self.sample_spec)  # a PyTreeDef (no stubs)

        def fetch(indices: np.ndarray) -> Any:
            batch = data(indices)
            got: Any = jax.tree.structure(batch)
            if got != expected:
                raise ValueError(
                    f"`data({len(indices)} indices)` returned a tree of structure "
                    f"{jax.tree.structure(batch)}, but its first sample had {expected}"
                )
            pairs = jax.tree_util.tree_flatten_with_path(batch)[0]
            for (path, leaf), spec in zip(pairs, jax.tree.leaves(self.sample_spec), strict=True):
                shape = np.shape(leaf)
                if shape[:1] != (len(indices),) or shape[1:] != spec.shape[1:]:
                    raise ValueError(
                        f"`data` returned leaf {jax.tree_util.keystr(path)!r} of shape {shape} for "
                        f"{len(indices)} indices; expected {(len(indices), *spec.shape[1:])} (one "
                        "row per index, each shaped as the first sample's)"
                    )
            return batch

        return fetch

    def sharding(self) -> NamedSharding | None:
        """The sharding of a ``(micro-batches, micro-batch, ...)`` batch: split on the batch axis."""
        if self._mesh is None:
            return None
        return NamedSharding(self._mesh, PartitionSpec(None, self._data_axis))

    def abstract_batch(self, num_micro: int, micro: int) -> Any:
        """The batch's shapes, dtypes and sharding, for compiling a step without data."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (num_micro, micro, *x.shape[1:]), x.dtype, sharding=self.sharding()
            ),
            self.sample_spec,
        )

    def host_batch(self, indices: np.ndarray) -> Any:
        """The samples at ``indices``, as the data holds them (on the host for arrays)."""
        return self._fetch(indices)

    def device_batch(self, indices: np.ndarray, num_micro: int, micro: int) -> Any:
        """The samples at ``indices`` as ``num_micro`` micro-batches of ``micro`` on the devices."""
        grid = indices.reshape(num_micro, micro)
        sharding = self.sharding()
        if sharding is None:
            return jax.tree.map(
                lambda x: jnp.asarray(x.reshape(num_micro, micro, *x.shape[1:])),
                self._fetch(indices),
            )
        # Each process fetches only the rows its devices hold (every process knows the global
        # indices, because all run the same sampler).
        specs, treedef = jax.tree.flatten(self.sample_spec)
        fetched: dict[tuple, list[Any]] = {}

        def rows(index: tuple, position: int) -> np.ndarray:
            part_indices = grid[index[:2]]
            key = (index[0].start, index[0].stop, index[1].start, index[1].stop)
            if key not in fetched:
                fetched[key] = jax.tree.leaves(self._fetch(part_indices.reshape(-1)))
            part = np.asarray(fetched[key][position])
            return part.reshape(*part_indices.shape, *part.shape[1:])

        arrays = [
            jax.make_array_from_callback(
                (num_micro, micro, *spec.shape[1:]), sharding, functools.partial(rows, position=i)
            )
            for i, spec in enumerate(specs)
        ]
        return jax.tree.unflatten(treedef, arrays)

    def place(self, tree: Any) -> Any:
        """``tree`` as strong jax arrays, replicated on the mesh unless already on it."""
        if tree is None:
            return None
        if self._mesh is None:
            return jax.tree.map(strong, tree)
        replicated = NamedSharding(self._mesh, PartitionSpec())

        def place(x):
            x = strong(x)
            if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self._mesh:
                return x
            return jax.device_put(x, replicated)

        return jax.tree.map(place, tree)
