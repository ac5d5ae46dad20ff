"""The launch table: a measured ``launch`` in kernels/auto_table.json sets block and warps.

Under the Triton interpreter (``.venv-kernels``), through the same stand-in for jax_triton as
``test_kernel_interpreter.py`` (``kernel_bridge.interpreted_jax_triton``): every launch candidate
gives the reference's bits, and the table's choice reaches the launch (grid and ``num_warps``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch", reason="the interpreter tests need torch (kernels-dev extra)")
pytest.importorskip("triton", reason="the interpreter tests need triton (kernels-dev extra)")

import kernel_bridge

from triaccel_jax.kernels import _dispatch
from triaccel_jax.kernels import _launch
from triaccel_jax.kernels import cast as cast_kernel
from triaccel_jax.kernels import fused_update as fused_kernel


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA backend whose jax_triton runs the kernels under the interpreter (records calls)."""
    module, calls = kernel_bridge.interpreted_jax_triton()
    monkeypatch.setitem(__import__("sys").modules, "jax_triton", module)
    monkeypatch.setattr(_dispatch, "triton_unavailable_reason", lambda: None)
    return calls


def _table_with(monkeypatch, op, launch):
    entry = {"choice": "triton", "launch": dict(launch._asdict())}
    monkeypatch.setattr(_dispatch, "_auto_table", lambda: {op: entry})
    monkeypatch.setattr(_dispatch, "auto_choice", lambda name: "triton")


@pytest.mark.parametrize("launch", _launch.CANDIDATES, ids=lambda c: f"{c.block}x{c.num_warps}")
def test_every_cast_launch_candidate_gives_the_reference_bits(fake_cuda, monkeypatch, launch):
    _table_with(monkeypatch, "cast/bfloat16/stochastic", launch)
    x = kernel_bridge.inputs(jnp.bfloat16)[:1500]  # not a multiple of any block: the tail is masked
    key = jax.random.key(5)
    got = jax.jit(lambda x: cast_kernel.cast(x, jnp.bfloat16, rounding="stochastic", key=key))(x)
    with jax.disable_jit():
        expected = cast_kernel.cast_reference(x, jnp.bfloat16, rounding="stochastic", key=key)
    assert kernel_bridge.same_bits(np.asarray(got), np.asarray(expected)).all()
    assert fake_cuda[-1]["num_warps"] == launch.num_warps
    assert fake_cuda[-1]["grid"] == (-(-1500 // launch.block),)


def test_the_fused_update_takes_its_launch_from_the_table(fake_cuda, monkeypatch):
    launch = _launch.LaunchConfig(block=2048, num_warps=8)
    _table_with(monkeypatch, "fused_update/bfloat16", launch)
    grad, mu, nu, master = kernel_bridge.fused_inputs(jnp.float32, jnp.bfloat16, jnp.float32)
    kwargs = dict(compute_dtype=jnp.bfloat16, key=jax.random.key(2))
    count, lr = jnp.int32(2), jnp.float32(1e-3)
    step = lambda count, lr, *a: fused_kernel.fused_update(
        *a, count=count, learning_rate=lr, **kwargs
    )
    got = jax.jit(step)(count, lr, grad, mu, nu, master)
    with jax.disable_jit():
        expected = fused_kernel.fused_update_reference(
            grad, mu, nu, master, count=count, learning_rate=lr, **kwargs
        )
    for g, e in zip(got, expected, strict=True):
        assert kernel_bridge.same_bits(np.asarray(g), np.asarray(e)).all()
    assert fake_cuda[-1]["num_warps"] == 8
    assert fake_cuda[-1]["grid"] == (-(-grad.size // 2048),)
