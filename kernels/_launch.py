"""Launch parameters of the Triton kernels: elements per program and warps, from a small table.

The kernels are memory-bound elementwise passes, so what decides their bandwidth is how many
bytes each thread moves per load (vector width) and how many loads are in flight per SM
(docs/design.md §8). Both follow from two numbers: ``block``, the elements one program handles,
and ``num_warps``; a thread handles ``block / (32 * num_warps)`` elements, which Triton issues as
vector loads of up to 16 bytes. The untuned H200 run used 1024 elements and 4 warps (8 per
thread) and reached 0.34x to 0.84x of a device copy.

:data:`CANDIDATES` are the configurations a GPU run measures (every one is compiled for sm_90
by ``tests/kernels/compile_sm90.py --candidates``, so a choice never fails to build); the
winner of each operation is recorded in ``kernels/auto_table.json`` as ``"launch"``
and read back by :func:`triaccel_jax.kernels._dispatch.launch_config`. This module imports no
triton.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

WARP_SIZE = 32  # threads per warp on NVIDIA GPUs


class LaunchConfig(NamedTuple):
    """How a kernel is launched: ``block`` elements per program, ``num_warps`` warps each.

    Attributes:
      block: elements per program (a power of two; one program per ``block`` elements).
      num_warps: warps per program (a power of two).
    """

    block: int
    num_warps: int

    @property
    def elements_per_thread(self) -> int:
        """Elements each thread loads and stores: ``block / (32 * num_warps)``."""
        return self.block // (WARP_SIZE * self.num_warps)


DEFAULT = LaunchConfig(block=1024, num_warps=4)

# From 4 to 32 elements a thread (16 to 128 bytes of float32): wide enough for 128-bit vector
# accesses, with enough programs in flight to cover HBM latency on a 132-SM H100/H200.
CANDIDATES = (
    DEFAULT,
    LaunchConfig(block=512, num_warps=4),
    LaunchConfig(block=2048, num_warps=4),
    LaunchConfig(block=4096, num_warps=4),
    LaunchConfig(block=2048, num_warps=8),
    LaunchConfig(block=4096, num_warps=8),
    LaunchConfig(block=8192, num_warps=8),
)


def parse_launch(value: Any, where: str) -> LaunchConfig:
    """The :class:`LaunchConfig` that a table's ``{"block": b, "num_warps": w}`` describes.

    Args:
      value: the decoded JSON object.
      where: the file and operation, named in errors.

    Returns:
      The launch configuration; it is one of :data:`CANDIDATES`.

    Raises:
      ValueError: not such an object, or a configuration outside :data:`CANDIDATES` (which are
        the only ones known to compile).

    Example:
      >>> parse_launch({"block": 2048, "num_warps": 8}, "table").elements_per_thread
      8
    """
    if not isinstance(value, dict) or set(value) != {"block", "num_warps"}:
        raise ValueError(
            f"{where}: 'launch' must be {{'block': int, 'num_warps': int}}, got {value!r}"
        )
    config = LaunchConfig(value["block"], value["num_warps"])
    if config not in CANDIDATES:
        raise ValueError(
            f"{where}: launch {dict(config._asdict())} is not one of the compiled candidates "
            f"{[dict(c._asdict()) for c in CANDIDATES]}"
        )
    return config
