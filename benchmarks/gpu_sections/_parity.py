"""Parity: the Triton kernels against their pure-JAX references, bit for bit (casts) or within ulps."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gpu_sections import _common as common
from triaccel_jax.kernels import cast as cast_kernel
from triaccel_jax.kernels import fused_update as fused_kernel


def cast_parity(n: int, impl: str) -> list[bool]:
    common.echo(f"\n== parity: cast through impl={impl!r} vs cast_reference (op by op), n={n}")
    common.echo(
        f"{'target':<14} {'rounding':<11} {'scale':<6} {'bit-equal':>10} {'max ulp':>8}  result"
    )
    x = common.cast_inputs(n)
    key = jax.random.key(7)
    results = []
    for dtype in common.TARGETS:
        for rounding in ("nearest", "stochastic"):
            for scale in (None, 0.37):
                run = jax.jit(
                    functools.partial(
                        cast_kernel.cast,
                        dtype=dtype,
                        rounding=rounding,
                        key=key,
                        scale=scale,
                        impl=impl,
                    )
                )
                got = run(x)
                with jax.disable_jit():
                    expected = cast_kernel.cast_reference(
                        x, dtype, rounding=rounding, key=key, scale=scale
                    )
                equal, worst = common.ulp_distance(got, expected)
                ok = worst == 0
                results.append(ok)
                common.echo(
                    f"{common.name(dtype):<14} {rounding:<11} {scale or '-'!s:<6} {equal:>10.6f} "
                    f"{worst:>8g}  {'ok' if ok else 'FAIL'}"
                )
    return results


def _op_by_op_on_cpu(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``f(*args, **kwargs)`` evaluated operation by operation on the CPU.

    XLA:GPU lowers float32 division to ``div.full.f32`` (approximate, up to 2 ulps), so the
    reference evaluated on the GPU is not the IEEE truth the kernel computes (``div_rn``,
    ``sqrt_rn``); XLA:CPU's division and square root are IEEE round-to-nearest.
    """
    cpu = jax.devices("cpu")[0]
    to_cpu = lambda a: jax.device_put(a, cpu) if isinstance(a, jax.Array) else a
    args, kwargs = jax.tree.map(to_cpu, (args, kwargs))
    with jax.default_device(cpu), jax.disable_jit():
        return f(*args, **kwargs)


def fused_parity(n: int, impl: str) -> list[bool]:
    common.echo(
        f"\n== parity: fused_update through impl={impl!r} vs the reference "
        f"(op by op on the CPU), n={n}"
    )
    common.echo(
        "(per output: fraction bit-equal / max ulps; allowed: 2 ulps float32, 1 ulp narrow)"
    )
    results = []
    count, learning_rate = jnp.int32(5), jnp.float32(3e-3)
    for (
        grad_dtype,
        moment_dtype,
        master_dtype,
        compute_dtype,
        rounding,
        scale,
    ) in common.FUSED_CASES:
        grad, mu, nu, master = common.fused_inputs(n, grad_dtype, moment_dtype, master_dtype)
        kwargs = dict(
            compute_dtype=compute_dtype,
            rounding=rounding,
            key=jax.random.key(9),
            compute_scale=scale,
            **common.HYPER,
        )

        # count and learning_rate are traced: as jit-time constants XLA would fold the bias
        # corrections on the host, possibly an ulp away from its compiled pow.
        def run(count, learning_rate, *arrays, kwargs=kwargs):
            return fused_kernel.fused_update(
                *arrays, count=count, learning_rate=learning_rate, impl=impl, **kwargs
            )

        arguments = (count, learning_rate, grad, mu, nu, master, 1.25)
        if impl == "reference":
            # Dry run: reference against itself, both op by op (a jitted XLA:CPU graph contracts
            # a * b + c into FMAs, which is a difference of XLA's, not of the kernel's).
            with jax.disable_jit():
                got = run(*arguments)
        else:
            got = jax.jit(run)(*arguments)
        reference_args = (grad, mu, nu, master, 1.25)
        reference_kwargs = dict(count=count, learning_rate=learning_rate, **kwargs)
        expected = _op_by_op_on_cpu(
            fused_kernel.fused_update_reference, *reference_args, **reference_kwargs
        )
        cells, ok = [], True
        for g, e in zip(got, expected, strict=True):
            equal, worst = common.ulp_distance(g, e)
            ok &= worst <= (2 if e.dtype == jnp.float32 else 1)
            cells.append(f"{common.name(e.dtype)} {equal:.6f}/{worst:g}")
        results.append(ok)
        label = (
            f"grad={common.name(grad_dtype)} moments={common.name(moment_dtype)} master={common.name(master_dtype)} "
            f"compute={common.name(compute_dtype)} {rounding}"
        )
        common.echo(
            f"{label}\n    mu {cells[0]} | nu {cells[1]} | master {cells[2]} | "
            f"compute {cells[3]}  {'ok' if ok else 'FAIL'}"
        )
        if impl != "reference":
            # For the record: the same reference op by op on this device (XLA's own kernels).
            with jax.disable_jit():
                on_device = fused_kernel.fused_update_reference(*reference_args, **reference_kwargs)
            worst = max(common.ulp_distance(g, e)[1] for g, e in zip(got, on_device, strict=True))
            common.echo(
                f"    (vs the reference op by op on {jax.default_backend()}: max {worst:g} ulps)"
            )
    return results


# --- 2. and 3. bandwidth, fused against unfused ---------------------------------------------------
