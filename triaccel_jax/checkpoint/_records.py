"""What a checkpoint records about its arrays, and how restore problems are named.

Each array's shape, dtype and CRC-32 go in the checkpoint's JSON item (orbax and tensorstore do
not checksum array data); at restore they tell a template that does not match from damaged files,
and :func:`verify_records` checks the restored arrays against them.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

logger = logging.getLogger("triaccel_jax.checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or not one of triaccel_jax's."""


def abstract(tree: Any) -> Any:
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, tree)


def host_array(x: Any) -> np.ndarray | None:
    """``x`` as a numpy array when this process holds all of it; None for other leaves."""
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:  # each process holds only its shards: nothing to check
            return None
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)
    if isinstance(x, np.ndarray | np.generic):
        return np.asarray(x)
    return None


def crc32(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8))


def array_shape(x: Any) -> jax.ShapeDtypeStruct | None:
    """Shape and dtype of ``x`` as :func:`host_array` would give them, without copying it."""
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
            return None
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.eval_shape(jax.random.key_data, x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if isinstance(x, np.ndarray | np.generic):
        return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    return None


def array_records(tree: Any, *, checksums: bool = True) -> dict[str, dict[str, Any]]:
    """Shape, dtype and (with ``checksums``) CRC-32 of every array leaf of ``tree``, by path.

    Without ``checksums`` no array is copied to the host: the record is its shape and dtype.
    """
    records = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if checksums:
            array = host_array(leaf)
            if array is not None:
                records[jax.tree_util.keystr(path)] = {
                    "shape": list(array.shape),
                    "dtype": str(array.dtype),
                    "crc32": crc32(array),
                }
        elif (shape := array_shape(leaf)) is not None:
            records[jax.tree_util.keystr(path)] = {
                "shape": list(shape.shape),
                "dtype": str(shape.dtype),
            }
    return records


def template_mismatch(template: Any, records: Mapping[str, Any]) -> str | None:
    """How ``template``'s array leaves differ from the saved ``records``; None if they agree."""
    leaves = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(template)[0]:
        if isinstance(leaf, jax.Array | np.ndarray | jax.ShapeDtypeStruct):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # recorded as key data
                leaf = jax.eval_shape(jax.random.key_data, leaf)
            leaves[jax.tree_util.keystr(path)] = leaf
    missing = sorted(set(records) - set(leaves))
    extra = sorted(set(leaves) - set(records))
    if missing or extra:
        return (
            f"the template lacks saved leaves {missing[:5]} and has leaves the checkpoint lacks "
            f"{extra[:5]}"
        )
    for name, leaf in leaves.items():
        saved = (tuple(records[name]["shape"]), records[name]["dtype"])
        if (tuple(leaf.shape), str(leaf.dtype)) != saved:
            return (
                f"leaf {name} is {leaf.dtype}{list(leaf.shape)} in the template but "
                f"{saved[1]}{list(saved[0])} in the checkpoint"
            )
    return None


def root_cause(error: BaseException) -> str:
    """The innermost chained exception, in one line without tensorstore's spec dump."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = inner
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    for noise in (" [tensorstore_spec", " See full TensorStore details"):
        text = text.split(noise)[0]
    return f"{type(error).__name__}: {text[:300]}"


def metadata_problem(error: BaseException) -> str:
    """What is wrong with a JSON item orbax failed to read, from the exceptions it chained."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        chain.append(link)
        link = link.__cause__ or link.__context__
    if any(isinstance(e, json.JSONDecodeError | UnicodeDecodeError) for e in chain):
        return (
            f"its JSON item is not valid JSON ({root_cause(chain[0])}); the file is corrupted "
            "or is not a triaccel_jax checkpoint's"
        )
    if any(isinstance(e, FileNotFoundError) for e in chain):
        return (
            "it has no JSON item (no metadata item); it is incomplete or was not written by "
            "triaccel_jax"
        )
    return f"its JSON item cannot be read: {root_cause(chain[0])}"


def verify_records(where: str, state: Any, records: Mapping[str, Any]) -> None:
    """Raises if a restored array differs from the CRC-32 recorded when it was saved."""
    if records and not any("crc32" in r for r in records.values()):
        logger.warning("%s was saved with verify=False: its arrays are not checked", where)
        return
    corrupted = []
    for name, record in array_records(state).items():
        saved = records.get(name)
        # A leaf restored with another shape or dtype (orbax casts to the template) cannot
        # be compared; one saved on another process's devices has no record.
        if (
            saved is not None
            and "crc32" in saved
            and all(saved[key] == record[key] for key in ("shape", "dtype"))
            and saved["crc32"] != record["crc32"]
        ):
            corrupted.append(name)
    if corrupted:
        raise CheckpointError(
            f"{where} is corrupted: the data of {', '.join(corrupted[:5])} "
            f"({len(corrupted)} of {len(records)} arrays) differ from the checksums written "
            "when it was saved"
        )
