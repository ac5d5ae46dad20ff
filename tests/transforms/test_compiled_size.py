"""The compiled update does not grow with the number of leaves, beyond what it writes per leaf.

XLA's compile time grows with the number of kernels it compiles (jax#4667). Every optax optimizer
compiles at least one kernel per array it writes: on XLA:CPU each per-leaf output is its own
kernel, even sliced from one flat buffer, so an optimizer's count grows with the leaves by the
number of per-leaf arrays it writes (AdamW: ``mu``, ``nu`` and the update). The curvature
signals' statistics, refresh, noise ratio and step scale run over flat buffers with segment
reductions, so each transform here grows with the leaves only by the per-leaf arrays it writes
itself (the observer's gradient EMA ``mu``) and nothing for Adam's moments, which replace the
inner optimizer's.

Counted on the compiled HLO of one update, for 8 and for 64 leaves of distinct shapes: the growth
of (transform - the optax optimizer inside it) is at most ``writes * 56 + slack``.

Fusions in the HLO are not what XLA compiles: fusions with identical computations (the leaves of
one shape) are compiled once. Large leaves keep a per-leaf path; for them the count that matters
is the number of kernels compiled (object files in XLA's dump), which must not grow with the
number of leaves of one shape: each leaf's piece of the flat state is read at an offset that XLA
learns only when the program runs, where a slice at a fixed offset is a kernel of its own.
"""

from __future__ import annotations

import math
import os
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import triaccel_jax

# optax's adamw and muon promote a Python float against their int32 count.
pytestmark = pytest.mark.standard_promotion("optax.adamw and optax.contrib.muon promote internally")

SMALL, LARGE = 8, 64
# Kernels that do not scale with the leaves (the flat buffers' sort, scatters, the cond, the
# scalar bookkeeping) may differ between two sizes of tree by a few fusions.
SLACK = 8


# Distinct shapes (XLA compiles a kernel per distinct shape, where equal shapes might share),
# all of 129 to 256 elements: the grouped top-k runs one kernel per power-of-two size class, and
# both trees span the same one.
SHAPES = [
    (rows, cols) for rows in range(2, 17) for cols in range(2, 129) if 128 < rows * cols <= 256
]


def _params(count: int) -> dict[str, jax.Array]:
    return {f"layer{i:02d}": jnp.ones(SHAPES[i]) for i in range(count)}


def fusions(tx: optax.GradientTransformation, count: int) -> int:
    """The number of fusions (XLA's kernels) in the compiled ``update`` + ``apply_updates``."""
    tx = optax.with_extra_args_support(tx)
    params = _params(count)
    state = tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    text = jax.jit(step).lower(params, state, params).compile().as_text()
    return len(re.findall(r"^\s*(?:ROOT )?%\S+ = \S+ fusion\(", text, re.MULTILINE))


def _muon() -> optax.GradientTransformation:
    return optax.contrib.muon(1e-3, adam_learning_rate=1e-3)


# name: (transform, the optax optimizer inside it, per-leaf arrays the transform adds)
CASES = {
    "curvature_signals + adamw": (
        lambda: optax.chain(triaccel_jax.curvature_signals(), optax.adamw(1e-3)),
        lambda: optax.adamw(1e-3),
        1,
    ),
    "triaccel": (lambda: triaccel_jax.triaccel(1e-3), lambda: optax.adamw(1e-3), 1),
    "scale_by_curvature(muon)": (lambda: triaccel_jax.scale_by_curvature(_muon()), _muon, 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_transforms_extra_kernels_do_not_grow_with_the_leaves(name):
    make, inner, writes = CASES[name]
    extra = {count: fusions(make(), count) - fusions(inner(), count) for count in (SMALL, LARGE)}
    growth = extra[LARGE] - extra[SMALL]
    allowed = writes * (LARGE - SMALL) + SLACK
    assert growth <= allowed, (name, extra, f"grew by {growth}, allowed {allowed}")


def test_the_count_sees_per_leaf_kernels():
    # The measure itself: optax's AdamW writes three arrays per leaf, so its count grows by at
    # least that with every leaf (a count that saw no per-leaf kernel could not fail above).
    growth = fusions(optax.adamw(1e-3), LARGE) - fusions(optax.adamw(1e-3), SMALL)
    assert growth >= 3 * (LARGE - SMALL), growth


def compiled_kernels(tx: optax.GradientTransformation, count: int, folder: str) -> int:
    """The kernels XLA compiles for one update + ``apply_updates`` over ``count`` leaves of one
    large shape (above ``GROUPED_LEAF_LIMIT``: the per-leaf path): its dump's object files."""
    tx = optax.with_extra_args_support(tx)
    params = {f"layer{i:02d}": jnp.ones((256, 160)) for i in range(count)}
    state = tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    os.makedirs(folder)
    jax.jit(step).lower(params, state, params).compile({"xla_dump_to": folder})
    return sum(".obj-file." in name for name in os.listdir(folder))


FEW, MANY = 4, 32


@pytest.mark.parametrize("name", sorted(CASES))
def test_leaves_of_one_shape_share_their_compiled_kernels(name, tmp_path):
    from triaccel_jax.transforms import _refresh

    assert _refresh.GROUPED_LEAF_LIMIT <= 256 * 160
    make, inner, _ = CASES[name]
    kernels = {
        (which, count): compiled_kernels(tx(), count, str(tmp_path / f"{which}{count}"))
        for which, tx in (("transform", make), ("inner", inner))
        for count in (FEW, MANY)
    }
    growth = (kernels["transform", MANY] - kernels["inner", MANY]) - (
        kernels["transform", FEW] - kernels["inner", FEW]
    )
    # What may grow: the leaf search over the stores' offsets, one compare-and-gather kernel
    # per halving (two searches), and a few kernels of scalar bookkeeping.
    allowed = 2 * int(math.log2(MANY // FEW)) + 4
    assert growth <= allowed, (name, kernels, f"grew by {growth}, allowed {allowed}")
    # The count reads the dump (a count of nothing would pass above): a transform compiles
    # dozens of kernels beyond the optimizer inside it. On the code before the per-leaf reads at
    # run-time offsets the growth was 93 to 121.
    assert kernels["transform", FEW] > kernels["inner", FEW] + 10, kernels
