"""Where Muon's momentum loses accuracy at 4 bits: the orthogonalisation amplifies a store's error.

Muon steps along ``orthogonalize(m)`` (Newton-Schulz iterations that push every singular value of
the momentum towards 1). A store's rounding error is spread over every direction of ``m``, and
the orthogonalisation lifts those weak directions as much as the strong ones, so a small
relative error in ``m`` becomes a large one in the update. This study measures that and what a
better 4-bit store buys, on the Fashion-MNIST MLP of ``benchmarks/state_precision.py`` (its
data, model and Muon, at the centre of Muon's rate grid), whose one leaf large enough to be
stored (``Dense_0/kernel``, 784 x 128) is the one every store here is applied to.

Part 1, one store of a trained momentum: Muon in float32 for ``--steps`` steps, then its
momentum ``m`` stored once in each format; printed per format, ``||m_hat - m|| / ||m||``, the
same of ``orthogonalize(m)`` (optax's Newton-Schulz, Muon's coefficients), and the fraction of
non-zero entries stored as 0.

Part 2, training: the same Muon with its momentum replaced after every update by what the store
gives back (the state is float32 holding the stored values: the training dynamics of the format,
not its bytes), two epochs at each of ``--seeds``, paired against float32 (mean difference in
test accuracy points and the paired 95% interval).

The stores: the library's ``"int4"`` first moment (the ``"dynamic4"`` map, blocks of 128 along
the last axis), the same in blocks of 32, the ``"dynamic4"`` map with rank-1 normalisation
(:func:`triaccel_jax.kernels.quantize.quantize_rank1`: each element over the smaller of its
row's and column's absolute maximum), a linear signed map of 15 levels with rank-1
normalisation (a candidate the library does not have: the levels ``-1, -6/7, ..., 6/7, 1``), and
the library's ``"int8"`` (the ``"linear"`` map, blocks of 256) for reference. Rounding to
nearest throughout, as ``quantize_state`` stores by default.

Usage::

  .venv/bin/python benchmarks/muon_state_error.py [--steps 400] [--seeds 0 1 2 3]
      [--stores ...] [--skip-training]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib._muon import orthogonalize_via_newton_schulz

import triaccel_jax
from triaccel_jax.kernels import quantize as quantize_lib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import state_precision as study
from accuracy.stats import paired_interval

NS_COEFFS = (3.4445, -4.775, 2.0315)  # optax.contrib.muon's defaults
LINEAR15 = np.linspace(-1.0, 1.0, 15).astype(np.float32)


def blocks(mapping: str, block_size: int) -> Callable[[jax.Array], jax.Array]:
    """The library's block store: quantize along the last axis, then read back."""

    def store(x: jax.Array) -> jax.Array:
        codes, scales = quantize_lib.quantize_blocks_reference(
            x, block_size=block_size, mapping=mapping, layout="rows"
        )
        return quantize_lib.dequantize_blocks_reference(
            codes, scales, block_size=block_size, mapping=mapping, layout="rows", shape=x.shape
        )

    return store


def rank1_table(mapping: str) -> Callable[[jax.Array], jax.Array]:
    """The library's rank-1 store with one of its table maps."""

    def store(x: jax.Array) -> jax.Array:
        q = quantize_lib.quantize_rank1(x, mapping=mapping)
        return quantize_lib.dequantize_rank1(
            q.codes, q.row_scales, q.column_scales, mapping=mapping
        )

    return store


def rank1_linear15(x: jax.Array) -> jax.Array:
    """Rank-1 normalisation with the 15-level linear signed map, rounded to nearest."""
    scale = jnp.minimum(
        jnp.max(jnp.abs(x), axis=1, keepdims=True), jnp.max(jnp.abs(x), axis=0, keepdims=True)
    )
    scale = jnp.where(scale > 0, scale, 1.0)
    levels = jnp.asarray(LINEAR15)
    index = jnp.searchsorted((levels[1:] + levels[:-1]) / 2, x / scale)
    return levels[index] * scale


STORES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "int4 (dynamic4, blocks of 128)": blocks("dynamic4", 128),
    "int4 (dynamic4, blocks of 32)": blocks("dynamic4", 32),
    "int4 (dynamic4, rank-1)": rank1_table("dynamic4"),
    "int4 (linear 15 levels, rank-1)": rank1_linear15,
    "int8 (linear, blocks of 256)": blocks("linear", 256),
}


def orthogonalized(m: jax.Array) -> np.ndarray:
    return np.asarray(orthogonalize_via_newton_schulz(m, jnp.asarray(NS_COEFFS)))


def stored_leaf(path: Any, leaf: Any) -> bool:
    """Muon's momentum of a leaf ``quantize_state`` would store (2-D, 4096 elements or more)."""
    name = jax.tree_util.keystr(path)
    return "mu" in name and getattr(leaf, "ndim", 0) == 2 and leaf.size >= 4096


def with_store(inner: optax.GradientTransformation, store: Callable) -> Any:
    """``inner`` whose stored momentum is replaced by what ``store`` gives back after each update."""

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        updates, state = inner.update(updates, state, params)
        return updates, jax.tree_util.tree_map_with_path(
            lambda path, x: store(x) if stored_leaf(path, x) else x, state
        )

    return optax.GradientTransformation(inner.init, update)


def train(
    bench: study.Workbench, tx: optax.GradientTransformation, seed: int, steps: int
) -> tuple[Any, Any]:
    """``steps`` steps from the seed's initialisation, as the state-precision study trains a row
    (the curvature observer first, which passes the gradients on unchanged, then the
    optimizer): the final parameters and optimizer state."""
    tx = optax.chain(triaccel_jax.curvature_signals(), tx)
    params = bench.init(seed)
    state = tx.init(params)

    @jax.jit
    def step(params: Any, state: Any, batch: Any) -> Any:
        def loss(p: Any) -> Any:
            return bench.loss_fn(p, batch, policy=None, rng=bench.rng)[0]

        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    for i in range(steps):
        params, state = step(params, state, bench.batch(seed, i))
    return params, state


def one_store_errors(bench: study.Workbench, lr: float, steps: int) -> dict[str, dict[str, float]]:
    _, (_, muon) = train(bench, study.direction("muon", lr), 0, steps)  # (observer, Muon)
    (m,) = [x for path, x in jax.tree_util.tree_leaves_with_path(muon) if stored_leaf(path, x)]
    exact, direction = np.asarray(m), orthogonalized(m)
    out = {}
    for name, store in STORES.items():
        back = np.asarray(store(m))
        out[name] = {
            "momentum": float(np.linalg.norm(back - exact) / np.linalg.norm(exact)),
            "orthogonalized": float(
                np.linalg.norm(orthogonalized(jnp.asarray(back)) - direction)
                / np.linalg.norm(direction)
            ),
            "zeroed": float(np.mean((back == 0) & (exact != 0))),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--stores", nargs="+", choices=list(STORES), default=list(STORES))
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke test on a tiny subset")
    args = parser.parse_args(argv)
    bench = study.Workbench("fashion_mlp", args.quick)
    lr = study.CENTRES[("fashion_mlp", "muon")]
    steps = min(args.steps, 20) if args.quick else args.steps
    print(f"Part 1: Muon's momentum of Dense_0/kernel after {steps} float32 steps, stored once")
    print("| store | momentum rel. error | orthogonalized rel. error | zeroed |")
    print("| --- | ---: | ---: | ---: |")
    for name, e in one_store_errors(bench, lr, steps).items():
        print(f"| {name} | {e['momentum']:.4f} | {e['orthogonalized']:.4f} | {e['zeroed']:.3f} |")
    if args.skip_training:
        return 0
    seeds = args.seeds[:2] if args.quick else args.seeds
    epochs = study.EPOCHS["fashion_mlp"]
    train_steps = 10 if args.quick else epochs * bench.steps_per_epoch
    accuracy: dict[str, list[float]] = {"float32": []}
    for seed in seeds:
        for name in ["float32", *args.stores]:
            tx = study.direction("muon", lr)
            tx = tx if name == "float32" else with_store(tx, STORES[name])
            params, _ = train(bench, tx, seed, train_steps)
            accuracy.setdefault(name, []).append(bench.accuracy(params, bench.test))
    print(f"\nPart 2: test accuracy, {len(seeds)} paired seeds, lr {lr:g}, {train_steps} steps")
    print("| store | accuracy % | vs float32, points [95% CI] |")
    print("| --- | ---: | --- |")
    for name, values in accuracy.items():
        if name == "float32":
            print(f"| float32 | {np.mean(values):.2f} | (reference) |")
            continue
        mean, low, high = paired_interval(values, accuracy["float32"])
        print(f"| {name} | {np.mean(values):.2f} | {mean:+.2f} [{low:+.2f}, {high:+.2f}] |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
