"""Bandwidth: each kernel against XLA and a device copy; the launch candidates; the auto table.

For every cast (target x rounding) and the fused update (float32 and bfloat16 moments), the
operation's bytes moved per second are measured three ways: a device copy of the same float32
array (the practical ceiling), the pure-JAX reference compiled by XLA, and, where the Triton
kernels can run, the Triton kernel at every launch configuration of
:data:`triaccel_jax.kernels._launch.CANDIDATES` (block size and warps: elements per thread, hence
vector width and loads in flight). The fastest candidate is timed again with the full number of
rounds. Each operation's row (both fractions of the copy, the winning launch) goes to
:func:`triaccel_jax.kernels._dispatch.write_auto_table`, which chooses ``"triton"`` only where the
kernel reaches 0.8x of the copy and at least XLA's figure; that table is what ``impl="auto"``
reads.

The fused update is also timed against the same update unfused (three jitted stages, each a
round trip through memory, as an optax chain runs it).

The block-wise 8-bit quantizer (:mod:`triaccel_jax.kernels.quantize`: both maps x both roundings)
and its dequantizer (both maps) are measured the same way, in blocks of
:data:`QUANTIZE_BLOCK_SIZE` elements, so the table holds a row for every operation in
:data:`triaccel_jax.kernels._dispatch.OPS`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gpu_sections import _common as common
from triaccel_jax.kernels import _adam as adam_lib
from triaccel_jax.kernels import _dispatch
from triaccel_jax.kernels import _launch
from triaccel_jax.kernels import _rounding
from triaccel_jax.kernels import cast as cast_kernel
from triaccel_jax.kernels import fused_update as fused_kernel
from triaccel_jax.kernels import quantize as quantize_lib

# Candidates are screened with fewer rounds; the winner is timed with the full count.
_SCREEN_ROUNDS = 2
# Elements per quantization block: quantize_state's default (Dettmers et al. use 2048). It sets
# the kernels' tile (one block a row); the bytes moved hardly depend on it (a scale per block).
QUANTIZE_BLOCK_SIZE = 256


class Report:
    """Prints one figure per line as a fraction of the device copy's bytes per second."""

    def __init__(self, ceiling: float) -> None:
        self.ceiling = ceiling

    def __call__(self, label: str, seconds: float, bytes_moved: int) -> float:
        rate = bytes_moved / seconds
        common.echo(
            f"{label:<44} {seconds * 1e3:8.3f} ms {rate / 1e9:9.1f} GB/s  "
            f"{rate / self.ceiling:.2f}x of copy"
        )
        return rate / self.ceiling


def fastest_launch(
    make: Callable[[_launch.LaunchConfig], Callable[..., Any]],
    args: tuple,
    iterations: int,
) -> tuple[_launch.LaunchConfig, float]:
    """The candidate launch whose function ``make(launch)`` runs ``args`` fastest, and its time.

    Every candidate is screened with :data:`_SCREEN_ROUNDS` rounds; the winner is timed again
    with the default rounds, so its figure is as careful as XLA's.
    """
    screened = {
        launch: common.timed(make(launch), *args, iterations=iterations, rounds=_SCREEN_ROUNDS)
        for launch in _launch.CANDIDATES
    }
    best = min(screened, key=screened.get)
    return best, common.timed(make(best), *args, iterations=iterations)


def _launch_row(launch: _launch.LaunchConfig) -> dict[str, int]:
    return {"block": launch.block, "num_warps": launch.num_warps}


def _cast_rows(n: int, triton: bool, iterations: int, report: Report) -> list[dict[str, Any]]:
    x = jax.random.normal(jax.random.key(0), (n,))
    key = jax.random.key(1)
    words = _rounding.seed_words(key)
    rows = []
    for dtype in common.TARGETS:
        for rounding in ("nearest", "stochastic"):
            reference = jax.jit(
                functools.partial(
                    cast_kernel.cast_reference, dtype=dtype, rounding=rounding, key=key
                )
            )

            def make(launch, dtype=dtype, rounding=rounding):
                from triaccel_jax.kernels import _cast_triton  # imports triton and jax_triton

                stochastic = rounding == "stochastic"
                return jax.jit(
                    functools.partial(
                        _cast_triton.cast,
                        dtype=dtype,
                        rounding=rounding,
                        words=words if stochastic else None,
                        scale=None,
                        launch=launch,
                    )
                )

            rows.append(
                _row(
                    _dispatch.cast_op(dtype, rounding),
                    f"cast f32->{common.name(dtype)} {rounding}",
                    reference,
                    make if triton else None,
                    (x,),
                    n * (4 + jnp.dtype(dtype).itemsize),
                    iterations,
                    report,
                )
            )
    return rows


def _fused_rows(n: int, triton: bool, iterations: int, report: Report) -> list[dict[str, Any]]:
    common.echo("\n== fused update: Triton, XLA's fusion of the reference, and unfused")
    key = jax.random.key(1)
    rows = []
    for moment_dtype in (jnp.float32, jnp.bfloat16):
        grad, mu, nu, master = common.fused_inputs(n, jnp.float32, moment_dtype, jnp.float32)
        kwargs = dict(
            count=jnp.int32(5),
            learning_rate=jnp.float32(1e-3),
            compute_dtype=jnp.bfloat16,
            key=key,
            **common.HYPER,
        )
        m = jnp.dtype(moment_dtype).itemsize
        bytes_moved = n * (4 + 2 * m + 4) + n * (2 * m + 4 + 2)
        args = (grad, mu, nu, master, 1.0)
        reference = jax.jit(functools.partial(fused_kernel.fused_update_reference, **kwargs))
        row = _row(
            _dispatch.fused_update_op(moment_dtype),
            f"fused update (moments {common.name(moment_dtype)})",
            reference,
            functools.partial(_fused_with_launch, kwargs=kwargs) if triton else None,
            args,
            bytes_moved,
            iterations,
            report,
        )
        unfused = _unfused_pipeline(moment_dtype, **kwargs)
        report(
            "  unfused: three jitted stages",
            common.timed(unfused, grad, mu, nu, master, iterations=iterations),
            bytes_moved,
        )
        rows.append(row)
    return rows


def _quantize_rows(n: int, triton: bool, iterations: int, report: Report) -> list[dict[str, Any]]:
    """Rows for the block-wise quantize (map x rounding) and dequantize (map) operations."""
    common.echo(f"\n== block-wise 8-bit quantize and dequantize, blocks of {QUANTIZE_BLOCK_SIZE}")
    block_size = QUANTIZE_BLOCK_SIZE
    scale_bytes = 4 * quantize_lib.num_blocks(n, block_size)
    normal = jax.random.normal(jax.random.key(0), (n,))
    # Signed values for the linear map (a first moment), non-negative for sqrt (a second moment).
    inputs = {"linear": normal, "sqrt": normal * normal}
    key = jax.random.key(1)
    words = _rounding.seed_words(key)
    rows = []
    for mapping in quantize_lib.MAPS:
        x = inputs[mapping]
        bytes_moved = n * (4 + 1) + scale_bytes  # float32 in; one byte a code and the scales out
        for rounding in ("nearest", "stochastic"):
            reference = jax.jit(
                functools.partial(
                    quantize_lib.quantize_blocks_reference,
                    block_size=block_size,
                    mapping=mapping,
                    rounding=rounding,
                    key=key,
                )
            )
            stochastic = rounding == "stochastic"

            def make(launch, mapping=mapping, stochastic=stochastic):
                from triaccel_jax.kernels import _quantize_triton  # imports triton, jax_triton

                return jax.jit(
                    functools.partial(
                        _quantize_triton.quantize,
                        block_size=block_size,
                        mapping=mapping,
                        words=words if stochastic else None,
                        launch=launch,
                    )
                )

            rows.append(
                _row(
                    _dispatch.quantize_op(mapping, rounding),
                    f"quantize {mapping} {rounding}",
                    reference,
                    make if triton else None,
                    (x,),
                    bytes_moved,
                    iterations,
                    report,
                )
            )
        codes, scales = jax.jit(
            functools.partial(
                quantize_lib.quantize_blocks_reference, block_size=block_size, mapping=mapping
            )
        )(x)
        reference = jax.jit(
            functools.partial(
                quantize_lib.dequantize_blocks_reference, block_size=block_size, mapping=mapping
            )
        )

        def make_dequantize(launch, mapping=mapping):
            from triaccel_jax.kernels import _quantize_triton  # imports triton, jax_triton

            return jax.jit(
                functools.partial(
                    _quantize_triton.dequantize,
                    block_size=block_size,
                    mapping=mapping,
                    launch=launch,
                )
            )

        rows.append(
            _row(
                _dispatch.dequantize_op(mapping),
                f"dequantize {mapping} (to float32)",
                reference,
                make_dequantize if triton else None,
                (codes, scales),
                n * (1 + 4) + scale_bytes,  # codes and scales in, float32 out
                iterations,
                report,
            )
        )
    return rows


def _row(
    op: str,
    label: str,
    reference: Callable[..., Any],
    make: Callable[[_launch.LaunchConfig], Callable[..., Any]] | None,
    args: tuple,
    bytes_moved: int,
    iterations: int,
    report: Report,
) -> dict[str, Any]:
    """One operation's auto-table row: XLA's figure, and with ``make`` (Triton can run) the
    fastest launch candidate's figure and launch."""
    xla = report(
        f"{label}, XLA", common.timed(reference, *args, iterations=iterations), bytes_moved
    )
    row: dict[str, Any] = {"op": op, "xla_copy_fraction": xla}
    if make is not None:
        launch, seconds = fastest_launch(make, args, iterations)
        row["triton_copy_fraction"] = report(
            f"  Triton, block {launch.block} x {launch.num_warps} warps", seconds, bytes_moved
        )
        row["launch"] = _launch_row(launch)
    return row


def _fused_with_launch(launch: _launch.LaunchConfig, kwargs: dict[str, Any]) -> Callable:
    """The fused update's Triton path at ``launch`` (the dispatch would read the table's)."""
    from triaccel_jax.kernels import _fused_update_triton  # imports triton and jax_triton

    words = _rounding.seed_words(kwargs["key"])

    @jax.jit
    def run(grad, mu, nu, master, step_scale):
        s = fused_kernel.scalars(
            count=kwargs["count"],
            learning_rate=kwargs["learning_rate"],
            b1=kwargs["b1"],
            b2=kwargs["b2"],
            eps=kwargs["eps"],
            weight_decay=kwargs["weight_decay"],
            step_scale=step_scale,
            compute_scale=None,
        )
        return _fused_update_triton.fused_update(
            grad,
            mu,
            nu,
            master,
            s,
            words,
            compute_dtype=kwargs["compute_dtype"],
            rounding="nearest",
            launch=launch,
        )

    return run


def bandwidth(n: int, impl: str, iterations: int) -> list[dict[str, Any]]:
    """Prints every figure; returns one auto-table row per operation.

    Args:
      n: float32 elements per array.
      impl: ``"triton"`` measures the Triton kernels too; ``"reference"`` (a dry run) only XLA.
      iterations: queued calls per timed round.

    Returns:
      Rows for :func:`triaccel_jax.kernels._dispatch.write_auto_table`; without Triton their
      ``triton_copy_fraction`` is missing, so the table chooses XLA.
    """
    common.echo(f"\n== bandwidth, n={n} elements ({n * 4 / 2**20:.0f} MiB per float32 array)")
    x = jax.random.normal(jax.random.key(0), (n,))
    copy_s = common.timed(jax.jit(jnp.copy), x, iterations=iterations)
    ceiling = 2 * 4 * n / copy_s
    common.echo(
        f"{'device copy (jnp.copy)':<44} {copy_s * 1e3:8.3f} ms {ceiling / 1e9:9.1f} GB/s  1.00x"
    )
    report = Report(ceiling)
    triton = impl == "triton"
    rows = _cast_rows(n, triton, iterations, report) + _fused_rows(n, triton, iterations, report)
    rows += _quantize_rows(n, triton, iterations, report)
    common.echo("\n== what impl='auto' chooses from these figures (>= 0.8x copy and >= XLA)")
    for row in rows:
        t, x_ = row.get("triton_copy_fraction"), row["xla_copy_fraction"]
        wins = t is not None and t >= max(0.8, x_)
        t_text = "n/a" if t is None else f"{t:.2f}x"
        common.echo(
            f"{row['op']:<32} Triton {t_text:>6}  XLA {x_:.2f}x  -> {'triton' if wins else 'xla'}"
        )
    return rows


def write_table(
    path: str, rows: list[dict[str, Any]], *, dry_run: bool, source: str
) -> dict[str, Any]:
    """Writes the auto table for this device (``kernels/auto_table.json``'s format); returns it.

    Every operation of :data:`triaccel_jax.kernels._dispatch.OPS` gets an entry: one without a
    row gets null figures (``"xla"``), and a warning is printed.
    """
    kind = jax.devices()[0].device_kind
    note = "DRY RUN: tiny sizes, no Triton figures; " if dry_run else ""
    # An operation this section does not measure (one added to the dispatch since) still gets a
    # row, with no figures: "xla", as the table's reader treats it, and visibly unmeasured.
    measured = {row["op"] for row in rows}
    unmeasured = [op for op in _dispatch.OPS if op not in measured]
    if unmeasured:
        common.echo(f"WARNING: no figures for {unmeasured}: written as 'xla', unmeasured")
        rows = [*rows, *({"op": op} for op in unmeasured)]
    # In the dispatch's order, whatever order the sections measured in (an unknown op last: the
    # writer refuses it by name).
    rows = sorted(rows, key=lambda row: _order(row["op"]))
    table = _dispatch.write_auto_table(path, rows, device_kind=kind, source=note + source)
    chosen = sorted(op for op, row in table["ops"].items() if row["choice"] == "triton")
    common.echo(f"auto table written to {path}: triton for {chosen or 'no operation'}")
    return table


def _order(op: str) -> int:
    return _dispatch.OPS.index(op) if op in _dispatch.OPS else len(_dispatch.OPS)


def _unfused_pipeline(
    moment_dtype, *, count, learning_rate, compute_dtype, key, b1, b2, eps, weight_decay
):
    """The update as an optax chain runs it: separate steps, each through memory."""
    s = fused_kernel.scalars(
        count=count,
        learning_rate=learning_rate,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        step_scale=1.0,
        compute_scale=None,
    )

    @jax.jit
    def moments(grad, mu, nu):
        mu_f, nu_f, _, _, direction = adam_lib.adam_moments(grad, mu, nu, s)
        k_mu, k_nu = jax.random.split(key)
        return (
            cast_kernel.cast_reference(mu_f, moment_dtype, rounding="stochastic", key=k_mu),
            cast_kernel.cast_reference(nu_f, moment_dtype, rounding="stochastic", key=k_nu),
            direction,
        )

    @jax.jit
    def master_step(master, direction):
        return master - s.learning_rate * (direction + s.weight_decay * master)

    compute_cast = jax.jit(lambda master: cast_kernel.cast_reference(master, compute_dtype))

    def run(grad, mu, nu, master):
        mu, nu, direction = moments(grad, mu, nu)
        master = master_step(master, direction)
        return mu, nu, master, compute_cast(master)

    return run
