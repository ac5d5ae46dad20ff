"""The one way this package calls ``jax_triton.triton_call`` (jax-triton 0.3 and 0.4).

jax-triton 0.3 names the outputs' shapes and dtypes ``out_shape=``; 0.4 renamed it ``out_type=``
(and needs Python >= 3.12 and triton >= 3.7). 0.3 takes compiler options such as
``enable_fp_fusion`` as keywords, 0.4 in a ``backend_options`` mapping (where an unknown keyword
would silently become a kernel metaparameter). Which spelling a given install takes is read from
the signature of its ``triton_call``, so no version string is parsed. Both versions pass the array
arguments first, then one pointer per output, then the keyword metaparameters (``tl.constexpr``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import jax


def triton_call(
    *args: Any,
    kernel: Any,
    out_type: jax.ShapeDtypeStruct | Sequence[jax.ShapeDtypeStruct],
    grid: tuple[int, ...] | Any,
    enable_fp_fusion: bool | None = None,
    module: ModuleType | None = None,
    **kwargs: Any,
) -> Any:
    """Calls ``jax_triton.triton_call`` with the output keyword its version expects.

    Args:
      *args: the kernel's runtime arguments (arrays and scalars), in the kernel's order.
      kernel: the ``@triton.jit`` function.
      out_type: a ``jax.ShapeDtypeStruct`` or a sequence of them, one per output pointer.
      grid: the launch grid, or a function of the metaparameters returning it.
      enable_fp_fusion: the Triton compiler option (False: no contraction of ``a * b + c`` into
        an FMA, so the kernel rounds like the reference evaluated operation by operation); None
        leaves the version's default.
      module: the ``jax_triton`` module to use (tests pass a fake); None imports the real one.
      **kwargs: metaparameters and launch options (``num_warps``, ...), passed through.

    Returns:
      What ``triton_call`` returns: an array, or a list of arrays for a sequence ``out_type``.

    Raises:
      TypeError: ``triton_call`` takes neither ``out_type`` nor ``out_shape``, or has no way to
        pass ``enable_fp_fusion``.

    Example:
      >>> import types, jax, jax.numpy as jnp
      >>> from triaccel_jax.kernels._jax_triton import triton_call
      >>> def call_0_3(*args, kernel, out_shape, grid, **kw):  # jax-triton 0.3's keyword
      ...     return out_shape
      >>> fake = types.SimpleNamespace(triton_call=call_0_3)
      >>> out = jax.ShapeDtypeStruct((3,), jnp.float32)
      >>> triton_call(jnp.ones(3), kernel=None, out_type=out, grid=(1,), module=fake)
      ShapeDtypeStruct(shape=(3,), dtype=float32)
    """
    if module is None:
        module = importlib.import_module("jax_triton")
    parameters = inspect.signature(module.triton_call).parameters
    if "out_type" in parameters:  # jax-triton >= 0.4
        output_keyword = "out_type"
    elif "out_shape" in parameters:  # jax-triton 0.3
        output_keyword = "out_shape"
    else:
        raise TypeError(
            "jax_triton.triton_call takes neither `out_type` (jax-triton >= 0.4) nor `out_shape` "
            f"(0.3); its parameters are {list(parameters)}"
        )
    kwargs[output_keyword] = out_type
    if enable_fp_fusion is not None:
        if "enable_fp_fusion" in parameters:  # jax-triton 0.3
            kwargs["enable_fp_fusion"] = enable_fp_fusion
        elif "backend_options" in parameters:  # jax-triton >= 0.4
            options = dict(kwargs.pop("backend_options", None) or {})
            kwargs["backend_options"] = {**options, "enable_fp_fusion": enable_fp_fusion}
        else:
            raise TypeError(
                "jax_triton.triton_call takes neither `enable_fp_fusion` nor `backend_options`; "
                f"its parameters are {list(parameters)}"
            )
    return module.triton_call(*args, kernel=kernel, grid=grid, **kwargs)
