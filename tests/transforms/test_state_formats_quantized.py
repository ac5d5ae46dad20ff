"""quantize_state in the registry's coded formats: "int8_dynamic" and "int4"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from triaccel_jax.policy import state_format
from triaccel_jax.transforms import FactoredLeaf
from triaccel_jax.transforms import QuantizedLeaf
from triaccel_jax.transforms import compiled_state_bytes
from triaccel_jax.transforms import dequantize_state
from triaccel_jax.transforms import quantize_state
from triaccel_jax.transforms import to_quantized_state

pytestmark = pytest.mark.standard_promotion(
    "optax's own optimizers promote inside (a float to the power of an int32 count)"
)


def _params() -> dict[str, jax.Array]:
    key = jax.random.key(0)
    return {"w": jax.random.normal(key, (64, 96)) * 0.1, "b": jnp.zeros((96,))}


def _train(tx: optax.GradientTransformation, steps: int = 20) -> tuple[dict, object]:
    params = _params()
    target = jax.random.normal(jax.random.key(1), (64, 96))

    def loss(p: dict) -> jax.Array:
        return jnp.mean((p["w"] - target) ** 2) + jnp.mean((p["b"] - 1.0) ** 2)

    state = tx.init(params)

    @jax.jit
    def step(params: dict, state: object) -> tuple[dict, object]:
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(steps):
        params, state = step(params, state)
    return params, state


# int4's second moment of "w" is factored (row and column means): on this full-rank gradient a
# rank-1 fit of nu, which steers each element's step apart from Adam's (0.42 of the distance
# moved after 20 steps, where int4 codes gave under 0.3); the loss it reaches is bounded in
# test_state_precision_factored.py.
@pytest.mark.parametrize(("name", "tolerance"), [("int8_dynamic", 0.06), ("int4", 0.5)])
def test_adamw_in_the_new_formats_trains_close_to_float32(name: str, tolerance: float) -> None:
    reference, _ = _train(optax.adamw(1e-2))
    params, state = _train(quantize_state(optax.adamw(1e-2), format=name, min_size=1024))
    stored = state.inner_state[0]
    fmt = state_format(name)
    assert isinstance(stored.mu["w"], QuantizedLeaf)
    assert stored.mu["w"].mapping == fmt.signed_map
    assert stored.nu["w"].mapping == fmt.unsigned_map
    assert isinstance(stored.nu["w"], FactoredLeaf if fmt.factored else QuantizedLeaf)
    assert stored.mu["w"].block_size == fmt.block_size
    assert not isinstance(stored.mu["b"], QuantizedLeaf)  # below min_size
    moved = np.abs(np.asarray(reference["w"] - _params()["w"])).mean()
    error = np.abs(np.asarray(params["w"] - reference["w"])).mean()
    assert np.all(np.isfinite(np.asarray(params["w"])))
    assert error < tolerance * moved


def test_an_explicit_block_size_overrides_the_formats() -> None:
    tx = quantize_state(optax.adamw(1e-2), format="int4", min_size=1024, block_size=64)
    state = tx.init(_params())
    assert state.inner_state[0].mu["w"].block_size == 64
    # Blocks along the last axis: each row of 96 in two blocks of at most 64.
    assert state.inner_state[0].mu["w"].scales.shape == (64, 2)
    default = quantize_state(optax.adamw(1e-2), min_size=1024).init(_params())
    assert default.inner_state[0].mu["w"].block_size == 256  # "int8" keeps 256


def test_int4_state_takes_fewer_bytes_than_int8() -> None:
    params = {"w": jnp.zeros((256, 256))}
    sizes = {
        name: compiled_state_bytes(quantize_state(optax.adamw(1e-3), format=name), params)
        for name in ("int8", "int8_dynamic", "int4")
    }
    assert sizes["int4"].state_bytes < sizes["int8"].state_bytes
    assert sizes["int8_dynamic"].state_bytes == pytest.approx(sizes["int8"].state_bytes, rel=0.01)
    stored = quantize_state(optax.adamw(1e-3), format="int4").init(params).inner_state[0]
    assert stored.mu["w"].codes.nbytes == 256 * 256 // 2


@pytest.mark.parametrize("name", ["int8_dynamic", "int4"])
def test_conversion_to_and_from_the_new_formats(name: str) -> None:
    params = _params()
    _, plain = _train(optax.adamw(1e-2), steps=3)
    tx = quantize_state(optax.adamw(1e-2), format=name, min_size=1024)
    state = to_quantized_state(tx, plain, params)
    assert state.inner_state[0].nu["w"].mapping == state_format(name).unsigned_map
    back = dequantize_state(state)
    assert back[0].mu["w"].shape == (64, 96)
    assert back[0].mu["w"].dtype == jnp.float32
    scale = np.abs(np.asarray(plain[0].mu["w"])).max()
    tolerance = 0.2 if name == "int4" else 0.02
    np.testing.assert_allclose(back[0].mu["w"], plain[0].mu["w"], atol=tolerance * scale)
    assert np.all(np.asarray(back[0].nu["w"]) >= 0)
    # The state updates as the wrapper's own and converts into another format.
    tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    other = to_quantized_state(quantize_state(optax.adamw(1e-2), format="int8"), state, params)
    assert other.inner_state[0].mu["w"].mapping == "linear"
