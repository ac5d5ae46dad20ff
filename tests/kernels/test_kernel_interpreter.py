"""The Triton kernels under ``TRITON_INTERPRET=1`` on torch CPU tensors, against the references.

Needs torch and triton (the ``kernels-dev`` extra, in ``.venv-kernels``); skips elsewhere. Both
kernels draw the reference's Philox bits and round with the same exact operations, so the
comparison is bit for bit for both roundings (NaN payloads aside); the stochastic outputs are
also checked statistically, as the kernel's own property. The references are evaluated operation
by operation (``jax.disable_jit``): a jitted XLA graph may fuse ``a * b + c`` into an FMA, which
the kernel (compiled with ``enable_fp_fusion=False``) and the interpreter never do.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interpreter tests need torch (kernels-dev extra)")
triton = pytest.importorskip(
    "triton", reason="the interpreter tests need triton (kernels-dev extra)"
)

import kernel_bridge  # noqa: E402  (imports torch)
import triton.language as tl  # noqa: E402

from triaccel_jax.kernels import _cast_triton  # noqa: E402
from triaccel_jax.kernels import _fused_update_triton  # noqa: E402
from triaccel_jax.kernels import _rounding  # noqa: E402
from triaccel_jax.kernels import _triton_common as common  # noqa: E402
from triaccel_jax.kernels import cast as cast_kernel  # noqa: E402
from triaccel_jax.kernels import fused_update as fused_kernel  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        not triton.knobs.runtime.interpret,
        reason="TRITON_INTERPRET=1 must be set before triton kernels are defined",
    ),
    # The interpreter evaluates both sides of tl.where with numpy, which warns about inf - inf.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

TARGETS = [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn]


def _cast_kernel(x, dtype, rounding, key, scale, block=common.BLOCK):
    words = _rounding.seed_words(key) if rounding == "stochastic" else None
    scale = None if scale is None else jnp.asarray(scale, jnp.float32)
    arguments, meta, out_type = _cast_triton.launch_arguments(
        x, jnp.dtype(dtype), rounding=rounding, words=words, scale=scale
    )
    meta["BLOCK"] = block
    grid = (triton.cdiv(x.size, block),)
    (out,) = kernel_bridge.launch(
        _cast_triton.cast_kernel, grid, arguments, [out_type.dtype], x.size, meta
    )
    return out.view(jnp.dtype(dtype)).reshape(x.shape)


@pytest.mark.parametrize("scale", [None, 0.37], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", TARGETS, ids=lambda d: jnp.dtype(d).name)
def test_cast_kernel_matches_the_reference_bit_for_bit(dtype, rounding, scale):
    x = kernel_bridge.inputs(dtype)
    key = jax.random.key(7)
    with jax.disable_jit():
        expected = np.asarray(
            cast_kernel.cast_reference(x, dtype, rounding=rounding, key=key, scale=scale)
        )
    got = _cast_kernel(x, dtype, rounding, key, scale)
    same = kernel_bridge.same_bits(got, expected)
    if scale is not None:
        # XLA:CPU flushes float32 subnormals to zero in arithmetic (FTZ and DAZ), so x * (1 /
        # scale) is 0 there when x or the product is a float32 subnormal; the kernel (and a GPU)
        # keeps them. Only bfloat16 can hold such values; the others round them to zero anyway.
        inv_scale = np.float32(1) / np.float32(scale)
        scaled = np.asarray(x) * inv_scale
        subnormal = lambda v: (np.abs(v) < np.finfo(np.float32).tiny) & (v != 0)
        flushed = subnormal(np.asarray(x)) | subnormal(scaled)
        assert np.all(expected[flushed].astype(np.float32) == 0)
        same |= flushed
    assert same.all(), (np.asarray(x)[~same][:5], expected[~same][:5], got[~same][:5])


def test_cast_kernel_bits_do_not_depend_on_the_block_size():
    x = kernel_bridge.inputs(jnp.float16)
    key = jax.random.key(3)
    a = _cast_kernel(x, jnp.float16, "stochastic", key, None, block=256)
    b = _cast_kernel(x, jnp.float16, "stochastic", key, None, block=4096)
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (jnp.bfloat16, 1.0 + 2.0**-9),
        (jnp.float16, -(1.0 + 0.3 * 2.0**-10)),
        (jnp.float8_e4m3fn, 2.75 * 2.0**-9),
    ],
    ids=["bfloat16", "float16", "float8_e4m3fn-subnormal"],
)
def test_cast_kernel_stochastic_rounding_is_unbiased(dtype, value):
    n = 100_000
    x = jnp.full((n,), value, jnp.float32)
    y = _cast_kernel(x, dtype, "stochastic", jax.random.key(11), None, block=16384)
    values = y.astype(np.float64)
    assert np.unique(values).size == 2
    errors = values - float(np.float32(value))
    assert abs(errors.mean()) < 4 * errors.std() / np.sqrt(n)


def test_kernel_random_bits_are_the_reference_philox():
    @triton.jit
    def bits_kernel(words_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        r0, r1, r2, r3 = tl.randint4x(common.load_seed(words_ptr), offsets)
        tl.store(out_ptr + offsets, r0.to(tl.int32, bitcast=True), mask=mask)
        tl.store(out_ptr + n + offsets, r1.to(tl.int32, bitcast=True), mask=mask)
        tl.store(out_ptr + 2 * n + offsets, r2.to(tl.int32, bitcast=True), mask=mask)
        tl.store(out_ptr + 3 * n + offsets, r3.to(tl.int32, bitcast=True), mask=mask)

    words = _rounding.seed_words(jax.random.key(42))
    n = 1500
    words_i32 = jax.lax.bitcast_convert_type(words, jnp.int32)
    out = torch.empty(4 * n, dtype=torch.int32)
    bits_kernel[(2,)](kernel_bridge.to_torch(words_i32), out, n, BLOCK=1024)
    got = out.numpy().view(np.uint32).reshape(4, n)
    expected = np.stack([np.asarray(s) for s in _rounding.random_streams(words, (n,))])
    np.testing.assert_array_equal(got, expected)


FUSED_CASES = [
    # grad, moments, master, compute, rounding, compute_scale
    (jnp.float32, jnp.float32, jnp.float32, jnp.bfloat16, "nearest", None),
    (jnp.float32, jnp.float32, jnp.float32, jnp.float32, "nearest", None),
    (jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.bfloat16, "stochastic", None),
    (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, "nearest", 0.01),
    (jnp.float32, jnp.bfloat16, jnp.bfloat16, jnp.float8_e4m3fn, "stochastic", 0.004),
    (jnp.bfloat16, jnp.float32, jnp.float16, jnp.float16, "stochastic", None),
]


@pytest.mark.parametrize(
    ("grad_dtype", "moment_dtype", "master_dtype", "compute_dtype", "rounding", "compute_scale"),
    FUSED_CASES,
    ids=[
        "fp32-state-bf16-copy",
        "fp32-state-fp32-copy",
        "bf16-grad-bf16-moments-bf16-copy-sr",
        "fp16-grad-bf16-moments-fp8-copy-scaled",
        "bf16-moments-bf16-master-fp8-copy-sr-scaled",
        "fp16-master-sr-fp16-copy-sr",
    ],
)
def test_fused_kernel_matches_the_reference_bit_for_bit(
    grad_dtype, moment_dtype, master_dtype, compute_dtype, rounding, compute_scale
):
    grad, mu, nu, master = kernel_bridge.fused_inputs(grad_dtype, moment_dtype, master_dtype)
    kwargs = dict(
        count=jnp.int32(5),
        learning_rate=jnp.float32(3e-3),
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        weight_decay=1e-2,
    )
    key = jax.random.key(9)
    compute_dtype, needs_bits = fused_kernel.validate(
        grad,
        mu,
        nu,
        master,
        1.25,
        compute_dtype=compute_dtype,
        rounding=rounding,
        key=key,
        compute_scale=compute_scale,
    )
    with jax.disable_jit():
        expected = fused_kernel.fused_update_reference(
            grad,
            mu,
            nu,
            master,
            1.25,
            compute_dtype=compute_dtype,
            rounding=rounding,
            key=key,
            compute_scale=compute_scale,
            **kwargs,
        )
    s = fused_kernel.scalars(step_scale=1.25, compute_scale=compute_scale, **kwargs)
    words = _rounding.seed_words(key) if needs_bits else None
    arguments, meta, out_types = _fused_update_triton.launch_arguments(
        grad, mu, nu, master, s, words, compute_dtype=compute_dtype, rounding=rounding
    )
    got = kernel_bridge.launch(
        _fused_update_triton.fused_update_kernel,
        common.grid(kernel_bridge.N),
        arguments,
        [t.dtype for t in out_types],
        kernel_bridge.N,
        meta,
    )
    for name, e, g in zip(fused_kernel.FusedUpdate._fields, expected, got, strict=True):
        e = np.asarray(e)
        g = g.view(e.dtype)
        assert e.dtype == g.dtype, name
        same = kernel_bridge.same_bits(g, e)
        assert same.all(), (name, np.nonzero(~same)[0][:5], e[~same][:5], g[~same][:5])


def test_cast_kernel_handles_any_shape_through_the_flat_index():
    x = jax.random.normal(jax.random.key(1), (7, 3, 5))
    key = jax.random.key(2)
    with jax.disable_jit():
        expected = np.asarray(
            cast_kernel.cast_reference(x, jnp.bfloat16, rounding="stochastic", key=key)
        )
    got = _cast_kernel(x, jnp.bfloat16, "stochastic", key, None)
    assert got.shape == (7, 3, 5)
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


def test_no_warnings_leak_from_the_reference():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cast_kernel.cast_reference(
            jnp.ones(4), jnp.float16, rounding="stochastic", key=jax.random.key(0)
        )


@pytest.fixture
def fake_cuda(monkeypatch):
    from triaccel_jax.kernels import _dispatch

    module, calls = kernel_bridge.interpreted_jax_triton()
    monkeypatch.setitem(__import__("sys").modules, "jax_triton", module)
    monkeypatch.setattr(_dispatch, "_cuda_backend", lambda: True)
    # A GPU where every measured op went to Triton: `auto` obeys the table (test_kernel_auto_table).
    monkeypatch.setattr(_dispatch, "auto_choice", lambda op: "triton")
    _dispatch._jax_triton_import_error.cache_clear()
    yield calls
    _dispatch._jax_triton_import_error.cache_clear()


def test_cast_through_jax_triton(fake_cuda):
    x = kernel_bridge.inputs(jnp.float8_e4m3fn)[:2000].reshape(40, 50)
    key = jax.random.key(4)
    from triaccel_jax.kernels import _dispatch

    assert _dispatch.resolve("auto", "cast") == "triton"
    for dtype in TARGETS:
        got = jax.jit(
            lambda x, dtype=dtype: cast_kernel.cast(
                x, dtype, rounding="stochastic", key=key, scale=2.0, impl="auto"
            )
        )(x)
        with jax.disable_jit():
            expected = cast_kernel.cast_reference(
                x, dtype, rounding="stochastic", key=key, scale=2.0
            )
        assert got.dtype == dtype and got.shape == x.shape
        subnormal = np.abs(np.asarray(x)) < 2 * np.finfo(np.float32).tiny  # XLA:CPU flushes them
        same = kernel_bridge.same_bits(np.asarray(got), np.asarray(expected)) | subnormal
        assert same.all()
    assert fake_cuda[0]["backend_options"] == {"enable_fp_fusion": False}
    # Gradients flow through the Triton path too (the straight-through VJP).
    grad = jax.grad(lambda x: jnp.sum(cast_kernel.cast(x, jnp.bfloat16).astype(jnp.float32)))(x)
    np.testing.assert_array_equal(grad, np.ones(x.shape, np.float32))


def test_fused_update_through_jax_triton(fake_cuda):
    grad, mu, nu, master = (
        a.reshape(30, 100)
        for a in kernel_bridge.fused_inputs(jnp.bfloat16, jnp.bfloat16, jnp.float32)
    )
    kwargs = dict(
        compute_dtype=jnp.float8_e4m3fn,
        rounding="stochastic",
        key=jax.random.key(1),
        compute_scale=0.01,
    )
    # count and learning_rate are traced arguments: as jit-time constants XLA would fold the
    # bias corrections on the host (std::pow), an ulp away from its compiled pow.
    step = lambda count, lr, *a: fused_kernel.fused_update(
        *a, 0.8, count=count, learning_rate=lr, impl="triton", **kwargs
    )
    count, lr = jnp.int32(3), jnp.float32(1e-3)
    got = jax.jit(step)(count, lr, grad, mu, nu, master)
    with jax.disable_jit():
        expected = fused_kernel.fused_update_reference(
            grad, mu, nu, master, 0.8, count=count, learning_rate=lr, **kwargs
        )
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape == (30, 100)
        assert kernel_bridge.same_bits(np.asarray(g), np.asarray(e)).all()
