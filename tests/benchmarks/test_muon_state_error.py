"""benchmarks/muon_state_error.py: its stores are the library's, and --quick end to end."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from triaccel_jax import transforms
from triaccel_jax.data import fashion_mnist_not_found_message
from triaccel_jax.data import find_fashion_mnist

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import muon_state_error  # noqa: E402


@pytest.mark.parametrize(
    ("store", "fmt"),
    [("int4 (dynamic4, blocks of 128)", "int4"), ("int8 (linear, blocks of 256)", "int8")],
)
def test_the_block_stores_give_back_what_quantize_state_stores(store, fmt):
    # A momentum of rows whose scales span two decades, stored by quantize_state over SGD with
    # momentum (its trace is a signed first moment) and by the study's store.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 256)) * np.logspace(-2, 0, 64)[:, None]
    params = {"w": jnp.zeros((64, 256))}
    tx = transforms.quantize_state(optax.sgd(1.0, momentum=0.9), format=fmt, min_size=1024)
    state = tx.init(params)
    _, state = tx.update({"w": jnp.asarray(x, jnp.float32)}, state, params)
    kept = np.asarray(transforms.dequantize_state(state.inner_state)[0].trace["w"])
    np.testing.assert_array_equal(
        np.asarray(muon_state_error.STORES[store](jnp.asarray(x, jnp.float32))), kept
    )


def test_the_linear_rank1_store_rounds_to_its_levels_over_each_elements_scale():
    x = jnp.asarray([[1.0, -0.5, 0.05], [2.0, 0.3, -4.0]], jnp.float32)
    back = np.asarray(muon_state_error.rank1_linear15(x))
    # Scales: the smaller of the row's and the column's maximum magnitude.
    scale = np.minimum(np.array([[1.0], [4.0]]), np.array([[2.0, 0.5, 4.0]]))
    levels = np.linspace(-1.0, 1.0, 15)
    expected = levels[np.abs(np.asarray(x)[..., None] / scale[..., None] - levels).argmin(-1)]
    np.testing.assert_allclose(back, expected * scale, rtol=1e-6)
    # A stored leaf is Muon's 2-D momentum of 4096 elements or more, nothing else.
    path = jax.tree_util.tree_flatten_with_path({"mu": {"w": jnp.zeros((64, 64))}})[0][0][0]
    assert muon_state_error.stored_leaf(path, jnp.zeros((64, 64)))
    assert not muon_state_error.stored_leaf(path, jnp.zeros((8, 8)))


@pytest.mark.slow
@pytest.mark.skipif(
    find_fashion_mnist() is None, reason=fashion_mnist_not_found_message().splitlines()[0]
)
def test_quick_mode_prints_every_store_with_figures_in_bounds():
    command = [sys.executable, "benchmarks/muon_state_error.py", "--quick"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        match = re.match(r"\| (int\S+ \([^)]*\)) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", line)
        if match:
            rows[match.group(1)] = [float(v) for v in match.groups()[1:]]
    assert set(rows) == set(muon_state_error.STORES)
    # 8 bits err far less than 4 in the momentum (2026-12-06: 0.006 against 0.09-0.14), and the
    # orthogonalised update errs more than the momentum it comes from, in every store.
    int8 = rows["int8 (linear, blocks of 256)"]
    for name, (momentum, orthogonalized, zeroed) in rows.items():
        assert orthogonalized > momentum > 0, name
        assert zeroed < 0.2, name
        if name.startswith("int4"):
            assert 0.05 < momentum < 0.3 and momentum > 5 * int8[0], name
    training = done.stdout.split("Part 2")[1]
    figures = {n: float(v) for n, v in re.findall(r"^\| (.+?) \| ([\d.]+) \| ", training, re.M)}
    assert set(figures) == {"float32", *muon_state_error.STORES}
    assert figures["float32"] > 30.0 and all(v > 25.0 for v in figures.values()), figures
