"""One-shot error of the block-wise quantizer's maps on blocks that span many magnitudes.

The workload: a 1024x256 first moment whose columns' scales spread 100x (log-uniform
over two decades, so each block of 256, one row, holds every scale), and its second moment (the
squares, spanning four decades). Each map quantizes it once (blocks of 256 for 8 bits, of 128
for 4 bits, as Li et al. 2023 use; rank-1 normalisation for the 4-bit second moment), with
rounding to nearest, and the table reports:

* ``rel. norm error``: ``||dequantized - x|| / ||x||``;
* ``mean rel. error``: the mean over the non-zero entries of ``|dequantized - x| / |x|`` (first
  moments only: the zero-free maps store a second moment's smallest entries as their lowest
  level by design, which this mean would count as errors of many times the value);
* ``zeroed``: the fraction of non-zero entries stored as 0;
* ``update error``: Adam's direction ``m / (sqrt(v) + 1e-8)`` with this moment dequantized and
  the other exact, ``||u_hat - u|| / ||u||`` (a second moment stored as 0 makes it ``m / eps``);
* ``bytes/elem``: codes and scales (:func:`triaccel_jax.kernels.quantize.stored_bytes`).

A second table times the search for the 8-bit dynamic maps' nearest codes on the same values
over their row's maximum: the branchless binary search (``count_at_most``, eight dependent
gathers) against the decade-and-cell guess settled by two gathers (what ``codes`` does), each
jitted, interleaved over ``--rounds`` rounds, medians; the codes are checked equal first.

Usage::

  .venv/bin/python benchmarks/quantize_maps.py [--rows 1024] [--columns 256] [--seed 0] [--rounds 21]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from triaccel_jax.kernels import _quantize_maps
from triaccel_jax.kernels import quantize as quantize_lib


def workload(rows: int, columns: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A first moment whose columns' scales spread 100x, and its square (a second moment)."""
    key_values, key_scales = jax.random.split(jax.random.key(seed))
    scales = 10.0 ** jax.random.uniform(key_scales, (columns,), minval=-2.0, maxval=0.0)
    m = jax.random.normal(key_values, (rows, columns)) * scales[None, :]
    return np.asarray(m, np.float32), np.asarray(m * m, np.float32)


EPS = 1e-8


def _update(m: np.ndarray, v: np.ndarray) -> np.ndarray:
    return m.astype(np.float64) / (np.sqrt(np.asarray(v, np.float64)) + EPS)


def errors(
    x: np.ndarray, back: np.ndarray, m: np.ndarray, v: np.ndarray
) -> tuple[float, float, float, float]:
    """Relative norm error, mean relative error (first moments), zeroed fraction, and the
    relative error of Adam's direction with ``x`` (``m`` or ``v``) replaced by ``back``."""
    x64, back64 = x.astype(np.float64), np.asarray(back, np.float64)
    nonzero = x64 != 0
    relative = np.abs(back64 - x64)[nonzero] / np.abs(x64[nonzero])
    exact = _update(m, v)
    approximate = _update(back64, v) if x is m else _update(m, back64)
    return (
        float(np.linalg.norm(back64 - x64) / np.linalg.norm(x64)),
        float(relative.mean()) if x is m else float("nan"),
        float(np.mean(back64[nonzero] == 0)),
        float(np.linalg.norm(approximate - exact) / np.linalg.norm(exact)),
    )


def rows_of(m: np.ndarray, v: np.ndarray) -> list[tuple[str, str, int | str, tuple, float]]:
    """One row per (moment, map): its errors and bytes per element."""
    out = []
    for moment, x, maps in (
        ("m (signed)", m, ("linear", "dynamic", "dynamic4")),
        ("v (non-negative)", v, ("linear", "sqrt", "dynamic_unsigned", "linear4_unsigned")),
    ):
        for mapping in maps:
            block = 128 if quantize_lib.MAP_BITS[mapping] == 4 else 256
            quantized = quantize_lib.quantize_blocks(
                jnp.asarray(x), block_size=block, mapping=mapping
            )
            back = quantize_lib.dequantize_blocks(
                quantized.codes,
                quantized.scales,
                block_size=block,
                mapping=mapping,
                shape=x.shape,
            )
            nbytes = quantize_lib.stored_bytes(x.shape, block_size=block, mapping=mapping) / x.size
            out.append((moment, mapping, block, errors(x, back, m, v), nbytes))
        if moment.startswith("v"):
            rank1 = quantize_lib.quantize_rank1(jnp.asarray(x), mapping="linear4_unsigned")
            back = quantize_lib.dequantize_rank1(rank1.codes, rank1.row_scales, rank1.column_scales)
            nbytes = (rank1.codes.size + 4 * (x.shape[0] + x.shape[1])) / x.size
            out.append((moment, "linear4_unsigned", "rank-1", errors(x, back, m, v), nbytes))
    return out


def search_seconds(m: np.ndarray, v: np.ndarray, rounds: int) -> list[tuple[str, float, float]]:
    """Per dynamic map: median seconds of the binary search and of the decade-and-cell codes."""
    out = []
    for mapping, x in (("dynamic", m), ("dynamic_unsigned", v)):
        t = jnp.asarray(x / np.max(np.abs(x), axis=-1, keepdims=True))
        searches = {
            "binary search": jax.jit(
                lambda t, mapping=mapping: _quantize_maps.count_at_most(
                    _quantize_maps.MIDPOINTS[mapping], t
                )
            ),
            "decade and cell": jax.jit(
                lambda t, mapping=mapping: _quantize_maps.codes(mapping, t, None)
            ),
        }
        first = [np.asarray(search(t)) for search in searches.values()]
        np.testing.assert_array_equal(*first)  # the same codes
        seconds: dict[str, list[float]] = {name: [] for name in searches}
        for _ in range(rounds):
            for name, search in searches.items():
                start = time.perf_counter()
                jax.block_until_ready(search(t))
                seconds[name].append(time.perf_counter() - start)
        out.append(
            (
                mapping,
                statistics.median(seconds["binary search"]),
                statistics.median(seconds["decade and cell"]),
            )
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--columns", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds of each search")
    args = parser.parse_args(argv)
    m, v = workload(args.rows, args.columns, args.seed)
    print(f"{args.rows}x{args.columns}, column scales log-uniform over 10**-2 .. 1, nearest")
    print(
        f"{'moment':<17} {'map':<17} {'blocks':>6} {'rel. norm error':>16} "
        f"{'mean rel. error':>16} {'zeroed':>8} {'update error':>13} {'bytes/elem':>10}"
    )
    for moment, mapping, block, (norm, mean, zeroed, update), nbytes in rows_of(m, v):
        mean_text = "-" if np.isnan(mean) else f"{mean:.4f}"
        print(
            f"{moment:<17} {mapping:<17} {block!s:>6} {norm:>16.4f} {mean_text:>16} "
            f"{zeroed:>8.1%} {update:>13.4g} {nbytes:>10.3f}"
        )
    print(
        f"\nnearest codes of the {args.rows}x{args.columns} values, medians of {args.rounds} rounds"
    )
    print(f"{'map':<17} {'binary search ms':>17} {'decade and cell ms':>19} {'ratio':>7}")
    for mapping, searched, guessed in search_seconds(m, v, args.rounds):
        print(
            f"{mapping:<17} {searched * 1e3:>17.3f} {guessed * 1e3:>19.3f} "
            f"{guessed / searched:>6.2f}x"
        )


if __name__ == "__main__":
    main()
