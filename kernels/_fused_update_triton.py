"""The fused update kernel in Triton, and its call from JAX through jax-triton.

Imported lazily by :func:`triaccel_jax.kernels.fused_update.fused_update` on the Triton path. One
program reads a block of the gradient, both moments and the master once, and writes the new
moments, the new master and the compute copy once: about 30 bytes per element at float32 state
with a bfloat16 copy, against roughly three times that for the same update as separate XLA
operations that do not fuse across the casts. One Philox evaluation per element gives the four
random streams (mu, nu, master, copy), as in the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from triaccel_jax.kernels import _jax_triton
from triaccel_jax.kernels import _launch
from triaccel_jax.kernels import _triton_common as common
from triaccel_jax.kernels import fused_update as fused_update_lib


@triton.jit
def fused_update_kernel(
    grad_ptr,
    mu_ptr,
    nu_ptr,
    master_ptr,
    scalars_ptr,
    words_ptr,
    n,
    new_mu_ptr,
    new_nu_ptr,
    new_master_ptr,
    compute_ptr,
    MU_FORMAT: tl.constexpr,
    NU_FORMAT: tl.constexpr,
    MASTER_FORMAT: tl.constexpr,
    COMPUTE_FORMAT: tl.constexpr,
    COMPUTE_STOCHASTIC: tl.constexpr,
    NEEDS_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One AdamW step with a per-leaf step scale for ``n`` elements (see ``fused_update``).

    Args:
      grad_ptr, mu_ptr, nu_ptr, master_ptr: the inputs (any float dtype; computed in float32).
      scalars_ptr: the float32 :class:`fused_update.Scalars`, in their field order.
      words_ptr: two int32, the Philox key words, read when ``NEEDS_BITS``.
      n: number of elements (< 2**31).
      new_mu_ptr, new_nu_ptr, new_master_ptr, compute_ptr: the outputs.
      MU_FORMAT, NU_FORMAT, MASTER_FORMAT, COMPUTE_FORMAT: the outputs' format codes (0 float32,
        stored as computed; others rounded, stochastically except the compute copy).
      COMPUTE_STOCHASTIC: stochastic rounding of the compute copy.
      NEEDS_BITS: draw random bits (some output is stochastically rounded).
      BLOCK: elements per program.
    """
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    learning_rate = tl.load(scalars_ptr + 0)
    b1 = tl.load(scalars_ptr + 1)
    one_minus_b1 = tl.load(scalars_ptr + 2)
    b2 = tl.load(scalars_ptr + 3)
    one_minus_b2 = tl.load(scalars_ptr + 4)
    inv_bias_correction1 = tl.load(scalars_ptr + 5)
    inv_bias_correction2 = tl.load(scalars_ptr + 6)
    eps = tl.load(scalars_ptr + 7)
    weight_decay = tl.load(scalars_ptr + 8)
    step_scale = tl.load(scalars_ptr + 9)
    inv_compute_scale = tl.load(scalars_ptr + 10)

    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    mu = tl.load(mu_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    nu = tl.load(nu_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    master = tl.load(master_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if NEEDS_BITS:
        bits_mu, bits_nu, bits_master, bits_compute = tl.randint4x(
            common.load_seed(words_ptr), offsets
        )
    else:
        bits_mu = offsets.to(tl.uint32)  # unused
        bits_nu, bits_master, bits_compute = bits_mu, bits_mu, bits_mu

    # The same float32 operations, in the same order, as fused_update.reference.
    mu = b1 * mu + one_minus_b1 * g
    nu = b2 * nu + one_minus_b2 * (g * g)
    m_hat = mu * inv_bias_correction1
    v_hat = nu * inv_bias_correction2
    direction = step_scale * tl.div_rn(m_hat, tl.sqrt_rn(v_hat) + eps)
    master = master - learning_rate * (direction + weight_decay * master)

    common.store_rounded(new_mu_ptr, offsets, mask, mu, bits_mu, MU_FORMAT, True)
    common.store_rounded(new_nu_ptr, offsets, mask, nu, bits_nu, NU_FORMAT, True)
    stored = common.store_rounded(
        new_master_ptr, offsets, mask, master, bits_master, MASTER_FORMAT, True
    )
    common.store_rounded(
        compute_ptr,
        offsets,
        mask,
        stored * inv_compute_scale,
        bits_compute,
        COMPUTE_FORMAT,
        COMPUTE_STOCHASTIC,
    )


def launch_arguments(
    grad: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    master: jax.Array,
    s: fused_update_lib.Scalars,
    words: jax.Array | None,
    *,
    compute_dtype: jnp.dtype,
    rounding: str,
    launch: _launch.LaunchConfig = _launch.DEFAULT,
) -> tuple[tuple, dict, tuple]:
    """The kernel's runtime arguments, metaparameters and output types (shared with the tests).

    Narrow outputs are declared in :func:`_triton_common.storage_dtype` (raw bits).
    """
    n = grad.size
    words_arr = (
        jnp.zeros(2, jnp.int32)
        if words is None
        else jax.lax.bitcast_convert_type(words.astype(jnp.uint32), jnp.int32)
    )
    scalars_arr = jnp.stack([jnp.asarray(value, jnp.float32) for value in s])
    flat = (a.reshape(-1) for a in (grad, mu, nu, master))
    arguments = (*flat, scalars_arr, words_arr, n)
    metaparameters = {
        "MU_FORMAT": common.format_code(mu.dtype),
        "NU_FORMAT": common.format_code(nu.dtype),
        "MASTER_FORMAT": common.format_code(master.dtype),
        "COMPUTE_FORMAT": common.format_code(compute_dtype),
        "COMPUTE_STOCHASTIC": rounding == "stochastic",
        "NEEDS_BITS": words is not None,
        "BLOCK": launch.block,
    }
    out_types = tuple(
        jax.ShapeDtypeStruct((n,), common.storage_dtype(dtype))
        for dtype in (mu.dtype, nu.dtype, master.dtype, jnp.dtype(compute_dtype))
    )
    return arguments, metaparameters, out_types


def fused_update(
    grad: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    master: jax.Array,
    s: fused_update_lib.Scalars,
    words: jax.Array | None,
    *,
    compute_dtype: jnp.dtype,
    rounding: str,
    launch: _launch.LaunchConfig = _launch.DEFAULT,
) -> fused_update_lib.FusedUpdate:
    """:func:`fused_update.fused_update`'s Triton path on validated arguments.

    Args:
      grad: the gradient.
      mu: the first moment.
      nu: the second moment.
      master: the master weights.
      s: the update's float32 scalars.
      words: the Philox key words (uint32[2]) when something is stochastically rounded.
      compute_dtype: dtype of the compute copy.
      rounding: rounding of the compute copy.
      launch: elements per program and warps (:data:`_launch.CANDIDATES`).

    Returns:
      The :class:`fused_update.FusedUpdate`, shaped like ``master``.
    """
    arguments, metaparameters, out_types = launch_arguments(
        grad,
        mu,
        nu,
        master,
        s,
        words,
        compute_dtype=compute_dtype,
        rounding=rounding,
        launch=launch,
    )
    outputs = _jax_triton.triton_call(
        *arguments,
        kernel=fused_update_kernel,
        out_type=out_types,
        grid=common.grid(grad.size, launch.block),
        num_warps=launch.num_warps,
        enable_fp_fusion=False,  # round like the reference: no a * b + c contracted to an FMA
        **metaparameters,
    )
    dtypes = (mu.dtype, nu.dtype, master.dtype, compute_dtype)
    return fused_update_lib.FusedUpdate(
        *(
            common.from_storage(out, dtype).reshape(master.shape)
            for out, dtype in zip(outputs, dtypes, strict=True)
        )
    )
