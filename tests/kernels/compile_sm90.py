"""Compiles every Triton kernel variant for an sm_90 (H100/H200) target on this machine, no GPU.

Run as a script (``python tests/kernels/compile_sm90.py [--candidates]``) WITHOUT
``TRITON_INTERPRET`` (``--candidates``: the widest variant of each kernel at every launch
candidate of ``triaccel_jax.kernels._launch``, instead of every variant at the default): it
prints one JSON line per variant with the stages the compiler produced (``ttir``, ``ttgir``,
``llir``, ``ptx`` and, with the ptxas that ships in the triton wheel, ``cubin``) and exits 1 if
any variant fails. ``test_kernel_compile_sm90.py`` runs it in a subprocess.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import traceback

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: the interpreter replaces the compiler")

import jax.numpy as jnp
import triton
from triton.backends.compiler import GPUTarget

from triaccel_jax.kernels import _cast_triton
from triaccel_jax.kernels import _fused_update_triton
from triaccel_jax.kernels import _launch
from triaccel_jax.kernels import _quantize_triton
from triaccel_jax.kernels import _triton_common as common

# sm_90 (H100/H200). The third field is the warp size: 32 on NVIDIA GPUs, as Triton's CUDA driver
# reports it (the NVIDIA backend generates code for 32-thread warps whatever this field says).
TARGET = GPUTarget("cuda", 90, 32)
TRITON_TYPES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "uint16": "u16",
    "uint8": "u8",
}
TARGETS = ("bfloat16", "float16", "float8_e4m3fn")


def _ptr(dtype: str) -> str:
    """An input pointer type."""
    return "*" + TRITON_TYPES[jnp.dtype(dtype).name]


def _out(dtype: str) -> str:
    """An output pointer type, as the jax-triton call declares it (narrow formats as raw bits)."""
    return _ptr(common.storage_dtype(dtype))


def cast_variants():
    for dtype, stochastic, has_scale in itertools.product(TARGETS, (False, True), (False, True)):
        yield (
            f"cast[{dtype},{'stochastic' if stochastic else 'nearest'},{'scaled' if has_scale else 'unscaled'}]",
            _cast_triton.cast_kernel,
            {
                "x_ptr": "*fp32",
                "inv_scale_ptr": "*fp32",
                "words_ptr": "*i32",
                "n": "i32",
                "out_ptr": _out(dtype),
            },
            {
                "FORMAT": common.format_code(dtype),
                "STOCHASTIC": stochastic,
                "HAS_SCALE": has_scale,
                "BLOCK": common.BLOCK,
            },
        )
    yield (
        "cast[bfloat16 input -> float8_e4m3fn,stochastic,scaled]",
        _cast_triton.cast_kernel,
        {
            "x_ptr": "*bf16",
            "inv_scale_ptr": "*fp32",
            "words_ptr": "*i32",
            "n": "i32",
            "out_ptr": _out("float8_e4m3fn"),
        },
        {"FORMAT": 3, "STOCHASTIC": True, "HAS_SCALE": True, "BLOCK": common.BLOCK},
    )


FUSED = [
    # grad, moments, master, compute, stochastic compute copy
    ("float32", "float32", "float32", "bfloat16", False),
    ("float32", "float32", "float32", "float32", False),
    ("bfloat16", "bfloat16", "float32", "bfloat16", True),
    ("float16", "bfloat16", "float32", "float8_e4m3fn", False),
    ("float32", "bfloat16", "bfloat16", "float8_e4m3fn", True),
    ("bfloat16", "float32", "float16", "float16", True),
]


def fused_variants():
    for grad, moments, master, compute, stochastic in FUSED:
        needs_bits = moments != "float32" or master != "float32" or stochastic
        yield (
            f"fused_update[grad={grad},moments={moments},master={master},compute={compute},"
            f"{'stochastic' if stochastic else 'nearest'}]",
            _fused_update_triton.fused_update_kernel,
            {
                "grad_ptr": _ptr(grad),
                "mu_ptr": _ptr(moments),
                "nu_ptr": _ptr(moments),
                "master_ptr": _ptr(master),
                "scalars_ptr": "*fp32",
                "words_ptr": "*i32",
                "n": "i32",
                "new_mu_ptr": _out(moments),
                "new_nu_ptr": _out(moments),
                "new_master_ptr": _out(master),
                "compute_ptr": _out(compute),
            },
            {
                "MU_FORMAT": common.format_code(moments),
                "NU_FORMAT": common.format_code(moments),
                "MASTER_FORMAT": common.format_code(master),
                "COMPUTE_FORMAT": common.format_code(compute),
                "COMPUTE_STOCHASTIC": stochastic,
                "NEEDS_BITS": needs_bits,
                "BLOCK": common.BLOCK,
            },
        )


def quantize_variants(launch=_launch.DEFAULT, block_size=256):
    """The block-wise quantize kernel for both maps and roundings, and the dequantize kernel for
    both maps, at ``block_size`` (a tile of ``launch.block`` elements)."""
    width, rows = _quantize_triton.tile(block_size, launch)
    for mapping, stochastic in itertools.product(("linear", "sqrt"), (False, True)):
        yield (
            f"quantize[{mapping},{'stochastic' if stochastic else 'nearest'},block={block_size}]",
            _quantize_triton.quantize_kernel,
            {
                "x_ptr": "*fp32",
                "words_ptr": "*i32",
                "n": "i32",
                "blocks": "i32",
                "codes_ptr": "*i8" if mapping == "linear" else "*u8",
                "scales_ptr": "*fp32",
            },
            {
                "BLOCK_SIZE": block_size,
                "WIDTH": width,
                "ROWS": rows,
                "SQRT": mapping == "sqrt",
                "STOCHASTIC": stochastic,
            },
        )
    for mapping in ("linear", "sqrt"):
        yield (
            f"dequantize[{mapping},block={block_size}]",
            _quantize_triton.dequantize_kernel,
            {
                "codes_ptr": "*i8" if mapping == "linear" else "*u8",
                "scales_ptr": "*fp32",
                "n": "i32",
                "blocks": "i32",
                "out_ptr": "*fp32",
            },
            {"BLOCK_SIZE": block_size, "WIDTH": width, "ROWS": rows, "SQRT": mapping == "sqrt"},
        )


def candidate_variants():
    """The widest variant of each kernel (bf16 stochastic, scaled; bf16 moments, fp8 copy) at
    every launch candidate of ``_launch.CANDIDATES`` other than the default, which the variants
    above already compile: the GPU run may pick any of them."""
    widest = {
        "cast": next(v for v in cast_variants() if v[0].startswith("cast[bfloat16,stochastic,sc")),
        "fused": list(fused_variants())[4],
    }
    for launch in _launch.CANDIDATES:
        if launch == _launch.DEFAULT:
            continue
        for name, kernel, signature, constexprs in widest.values():
            yield (
                f"{name}@block={launch.block},num_warps={launch.num_warps}",
                kernel,
                signature,
                {**constexprs, "BLOCK": launch.block},
                launch.num_warps,
            )
        # The block-wise quantizer's widest variant (sqrt map, stochastic) and its dequantize,
        # whose tile follows the launch's elements per program.
        quantize = list(quantize_variants(launch))
        for name, kernel, signature, constexprs in (quantize[3], quantize[5]):
            yield (
                f"{name}@block={launch.block},num_warps={launch.num_warps}",
                kernel,
                signature,
                constexprs,
                launch.num_warps,
            )


def compile_variant(kernel, signature: dict, constexprs: dict, num_warps: int = common.NUM_WARPS):
    """``triton.compile`` for sm_90 with the options the jax-triton calls use."""
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": num_warps, "enable_fp_fusion": False}
    return triton.compile(source, target=TARGET, options=options)


def main(argv: list[str]) -> int:
    """Compiles the kernel variants, or with ``--candidates`` the launch candidates."""
    if "--candidates" in argv:
        variants = candidate_variants()
    else:
        variants = (
            (*variant, common.NUM_WARPS)
            for variant in itertools.chain(
                cast_variants(),
                fused_variants(),
                quantize_variants(),
                quantize_variants(block_size=100),  # a block size that is not a power of two
            )
        )
    failures = 0
    for name, kernel, signature, constexprs, num_warps in variants:
        start = time.perf_counter()
        record = {"variant": name}
        try:
            compiled = compile_variant(kernel, signature, constexprs, num_warps)
        except Exception:
            failures += 1
            record.update(ok=False, error=traceback.format_exc(limit=3))
        else:
            ptx = compiled.asm.get("ptx", "")
            record.update(
                ok=True,
                stages=[k for k in ("ttir", "ttgir", "llir", "ptx", "cubin") if k in compiled.asm],
                cubin_bytes=len(compiled.asm.get("cubin", b"")),
                fma=ptx.count("fma.rn.f32"),
                approximate=ptx.count(".approx.f32"),
            )
        record["seconds"] = round(time.perf_counter() - start, 2)
        print(json.dumps(record), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
