"""The jax-triton compatibility function, against fake jax_triton modules of both versions."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest

from triaccel_jax.kernels import _jax_triton

OUT = jax.ShapeDtypeStruct((8,), jnp.float32)


def _fake_module(triton_call):
    calls = []

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return "result"

    recording.__signature__ = __import__("inspect").signature(triton_call)
    return types.SimpleNamespace(triton_call=recording), calls


def _v03(*args, kernel, out_shape, grid, num_warps=None, enable_fp_fusion=True, **metaparams):
    """jax-triton 0.3's keywords."""


def _v04(*args, kernel, out_type=None, grid, num_warps=None, backend_options=None, **kwargs):
    """jax-triton 0.4's keywords."""


def test_jax_triton_0_3_gets_out_shape_and_enable_fp_fusion():
    module, calls = _fake_module(_v03)
    x = jnp.ones(8)
    result = _jax_triton.triton_call(
        x, 8, kernel="k", out_type=OUT, grid=(1,), enable_fp_fusion=False, module=module, BLOCK=4
    )
    assert result == "result"
    ((args, kwargs),) = calls
    assert args[0] is x and args[1] == 8
    assert kwargs == {
        "kernel": "k",
        "grid": (1,),
        "out_shape": OUT,
        "enable_fp_fusion": False,
        "BLOCK": 4,
    }


def test_jax_triton_0_4_gets_out_type_and_backend_options():
    module, calls = _fake_module(_v04)
    _jax_triton.triton_call(
        jnp.ones(8),
        kernel="k",
        out_type=[OUT, OUT],
        grid=(2,),
        num_warps=4,
        enable_fp_fusion=False,
        backend_options={"num_stages": 2},
        module=module,
        BLOCK=4,
    )
    ((_, kwargs),) = calls
    assert kwargs["out_type"] == [OUT, OUT] and "out_shape" not in kwargs
    assert kwargs["backend_options"] == {"num_stages": 2, "enable_fp_fusion": False}
    assert kwargs["num_warps"] == 4 and kwargs["BLOCK"] == 4
    assert "enable_fp_fusion" not in kwargs  # it would become a kernel metaparameter


def test_default_fp_fusion_is_not_passed():
    for signature in (_v03, _v04):
        module, calls = _fake_module(signature)
        _jax_triton.triton_call(kernel="k", out_type=OUT, grid=(1,), module=module)
        ((_, kwargs),) = calls
        assert "enable_fp_fusion" not in kwargs and "backend_options" not in kwargs


def test_unknown_signature_is_a_clear_type_error():
    def other(*args, kernel, shapes, grid):
        """Neither version."""

    module, _ = _fake_module(other)
    with pytest.raises(TypeError, match=r"out_type.*out_shape"):
        _jax_triton.triton_call(kernel="k", out_type=OUT, grid=(1,), module=module)

    def no_options(*args, kernel, out_type, grid):
        """A version without compiler options."""

    module, _ = _fake_module(no_options)
    with pytest.raises(TypeError, match="enable_fp_fusion"):
        _jax_triton.triton_call(
            kernel="k", out_type=OUT, grid=(1,), enable_fp_fusion=False, module=module
        )
