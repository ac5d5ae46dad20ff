"""GPU check of the Triton kernels: parity, bandwidth, fused against unfused, memory of a step.

For a machine with an NVIDIA GPU (written for an H200), ``jax[cuda12]`` and the ``gpu`` extra
(jax-triton). One run, a few minutes (well under 8 on an H200), prints every figure:

1. **Parity** through jax-triton against the pure-JAX references, for every cast target x
   rounding x (un)scaled, and for the fused update in six dtype configurations. The reference is
   evaluated operation by operation (``jax.disable_jit``), which is what the kernels compute
   (IEEE ``div.rn``/``sqrt.rn``, no FMA contraction, the same Philox bits): the cast's on the
   GPU, the fused update's on the CPU, because XLA:GPU divides float32 with the approximate
   ``div.full.f32`` (the run of 2026-11-30 on an H200 saw the master 96 to 256 ulps away from
   that GPU reference where the update nearly cancels it, and prints that distance too). The cast
   must match bit for bit; the fused update within 2 float32 ulps and 1 ulp of a narrow dtype.
   Inputs avoid float32 subnormals, which XLA may flush to zero.
2. **Bandwidth**: each kernel's bytes moved per second against a measured device copy
   (``jnp.copy`` of a large array: the practical ceiling, about 4.3 TB/s on an H200), beside the
   same cast's reference compiled by XLA (what ``impl="auto"`` chooses the kernel over). Calls are
   queued and waited for once per round, so the figure is the kernel's time, not the dispatch's.
3. **Fused against unfused**: the fused update kernel, the same reference jitted (XLA fuses what
   it can), and an unfused pipeline (moments and direction, master update, compute cast as three
   separately jitted steps, each a round trip through memory, as an optax chain does).
4. **Memory**: ``peak_bytes_in_use`` of one training step of a ResNet-18 (the CIFAR variant,
   ``ResNet(stage_sizes=(2, 2, 2, 2), num_filters=64)``) on 32x32x3 images with
   ``triaccel_jax.triaccel``: float32 (model and optimizer state), static bfloat16 (bfloat16
   compute, bfloat16 moments, float32 masters) and the planner's policy. Each configuration runs
   in its own process, because the peak is a process-wide high-water mark, with XLA's autotuner
   off (its scratch buffers would set the peak); the compiled memory analysis is printed beside it.

5. **End to end** (issue 14): the main job three times, each run in its own process, ResNet-18
   on 32x32x3 images (CIFAR-10 when its archive and tensorflow-datasets are present, else
   Fashion-MNIST padded to 32x32 and replicated to three channels): FP32 AdamW and static bf16
   AdamW at batch 128, Tri-Accel (planner, batch growing into free memory up to 512). Prints
   steady-state samples/s, compile seconds, ``peak_bytes_in_use`` at the batch each run trained
   at and at 128, the wall time to FP32's final accuracy with and without compiles, the final
   accuracy, and issue 14's targets as ratios ("met"/"missed"). See
   :mod:`triaccel_jax.cli._end_to_end`. Budget on an H200: one epoch of 30,000 images per run,
   each fixed run's process stopped after 55 s and Tri-Accel's after 120 s (at most 4 minutes).

Usage::

    python benchmarks/gpu_check.py              # on the GPU machine
    python benchmarks/gpu_check.py --dry-run    # anywhere: tiny sizes, reference kernels only
    python benchmarks/gpu_check.py --quick      # --dry-run, and a tiny end-to-end section (CPU)
    python benchmarks/gpu_check.py --sections fused-parity bandwidth   # some checks only

Exit status: 0 when every parity check passed (and every end-to-end run finished), 1 when one
failed, 2 when the Triton kernels cannot run here (no CUDA backend or no jax_triton) and
``--dry-run`` (or ``--quick``) was not given. Missed targets are reported, not failures.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from triaccel_jax.kernels import _adam as adam_lib
from triaccel_jax.kernels import _dispatch
from triaccel_jax.kernels import cast as cast_lib
from triaccel_jax.kernels import fused_update as fused_lib

TARGETS = (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
FUSED_CASES = (
    # grad, moments, master, compute, rounding, compute_scale
    (jnp.float32, jnp.float32, jnp.float32, jnp.bfloat16, "nearest", None),
    (jnp.float32, jnp.float32, jnp.float32, jnp.float32, "nearest", None),
    (jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.bfloat16, "stochastic", None),
    (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, "nearest", 0.01),
    (jnp.float32, jnp.bfloat16, jnp.bfloat16, jnp.float8_e4m3fn, "stochastic", 0.004),
    (jnp.bfloat16, jnp.float32, jnp.float16, jnp.float16, "stochastic", None),
)
HYPER = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2)
# The end-to-end section runs when named (tools/device_check.sh gives it a step of its own) or,
# without --sections, with --quick.
DEFAULT_SECTIONS = ("cast-parity", "fused-parity", "bandwidth", "memory")
SECTIONS = (*DEFAULT_SECTIONS, "end-to-end")


# --- helpers -------------------------------------------------------------------------------------


def _name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def _ordered(a: np.ndarray) -> np.ndarray:
    """Raw bits as integers ordered like the values (sign-magnitude to two's complement)."""
    raw = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).astype(np.int64)
    sign = np.int64(1) << (8 * a.dtype.itemsize - 1)
    return np.where(raw & sign, -(raw & (sign - 1)), raw)


def ulp_distance(got: Any, expected: Any) -> tuple[float, float]:
    """(fraction of bit-identical elements, largest distance in ulps); NaN matches NaN only."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, expected.dtype)
    nan_g = np.isnan(got.astype(np.float32))
    nan_e = np.isnan(expected.astype(np.float32))
    distance = np.abs(_ordered(got) - _ordered(expected)).astype(np.float64)
    distance = np.where(nan_g & nan_e, 0.0, distance)
    distance = np.where(nan_g != nan_e, np.inf, distance)
    return float(np.mean(distance == 0)), float(distance.max(initial=0.0))


def timed(f: Callable[..., Any], *args: Any, iterations: int, rounds: int = 5) -> float:
    """Seconds per call of ``f(*args)``: the median over ``rounds`` of ``iterations`` queued calls.

    The calls of a round are dispatched back to back and waited for once, so the device stays
    busy and the figure is the kernel's time, not the host's dispatch latency (blocking on each
    call of a 0.1 ms kernel measures mostly the round trip).
    """
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iterations):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iterations)
    return statistics.median(times)


def _cast_inputs(n: int, seed: int = 0) -> jax.Array:
    """Normal float32 values from 2**-126 to 2**130 in magnitude (no float32 subnormals), and
    inf, -inf, NaN, +-0 and values beyond every target's range."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    exponents = jax.random.uniform(k1, (n,), minval=-125.0, maxval=127.0)
    signs = jnp.where(jax.random.bernoulli(k2, 0.5, (n,)), 1.0, -1.0)
    x = (signs * 2.0**exponents).astype(jnp.float32)
    # A third of the values where the narrow formats are dense, to exercise their rounding.
    x = x.at[: n // 3].set(x[: n // 3] / 2.0 ** jnp.round(exponents[: n // 3]) * 3.0)
    special = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0, 1e30, -7e4, 500.0], jnp.float32)
    return x.at[: special.size].set(special)


def _fused_inputs(n: int, grad_dtype, moment_dtype, master_dtype, seed: int = 5):
    keys = jax.random.split(jax.random.key(seed), 4)
    grad = jax.random.normal(keys[0], (n,)) * jnp.exp(jax.random.normal(keys[1], (n,)))
    mu = grad * 0.3 + jax.random.normal(keys[2], (n,)) * 0.1
    nu = grad**2 * 0.5 + 1e-6
    master = jax.random.normal(keys[3], (n,))
    return (
        grad.astype(grad_dtype),
        mu.astype(moment_dtype),
        nu.astype(moment_dtype),
        master.astype(master_dtype),
    )


def _print(*args: Any) -> None:
    print(*args, flush=True)


# --- 1. parity -----------------------------------------------------------------------------------


def cast_parity(n: int, impl: str) -> list[bool]:
    _print(f"\n== parity: cast through impl={impl!r} vs cast_reference (op by op), n={n}")
    _print(f"{'target':<14} {'rounding':<11} {'scale':<6} {'bit-equal':>10} {'max ulp':>8}  result")
    x = _cast_inputs(n)
    key = jax.random.key(7)
    results = []
    for dtype in TARGETS:
        for rounding in ("nearest", "stochastic"):
            for scale in (None, 0.37):
                run = jax.jit(
                    functools.partial(
                        cast_lib.cast,
                        dtype=dtype,
                        rounding=rounding,
                        key=key,
                        scale=scale,
                        impl=impl,
                    )
                )
                got = run(x)
                with jax.disable_jit():
                    expected = cast_lib.cast_reference(
                        x, dtype, rounding=rounding, key=key, scale=scale
                    )
                equal, worst = ulp_distance(got, expected)
                ok = worst == 0
                results.append(ok)
                _print(
                    f"{_name(dtype):<14} {rounding:<11} {scale or '-'!s:<6} {equal:>10.6f} "
                    f"{worst:>8g}  {'ok' if ok else 'FAIL'}"
                )
    return results


def _op_by_op_on_cpu(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``f(*args, **kwargs)`` evaluated operation by operation on the CPU.

    XLA:GPU lowers float32 division to ``div.full.f32`` (approximate, up to 2 ulps), so the
    reference evaluated on the GPU is not the IEEE truth the kernel computes (``div_rn``,
    ``sqrt_rn``); XLA:CPU's division and square root are IEEE round-to-nearest.
    """
    cpu = jax.devices("cpu")[0]
    to_cpu = lambda a: jax.device_put(a, cpu) if isinstance(a, jax.Array) else a
    args, kwargs = jax.tree.map(to_cpu, (args, kwargs))
    with jax.default_device(cpu), jax.disable_jit():
        return f(*args, **kwargs)


def fused_parity(n: int, impl: str) -> list[bool]:
    _print(
        f"\n== parity: fused_update through impl={impl!r} vs the reference "
        f"(op by op on the CPU), n={n}"
    )
    _print("(per output: fraction bit-equal / max ulps; allowed: 2 ulps float32, 1 ulp narrow)")
    results = []
    count, learning_rate = jnp.int32(5), jnp.float32(3e-3)
    for grad_dtype, moment_dtype, master_dtype, compute_dtype, rounding, scale in FUSED_CASES:
        grad, mu, nu, master = _fused_inputs(n, grad_dtype, moment_dtype, master_dtype)
        kwargs = dict(
            compute_dtype=compute_dtype,
            rounding=rounding,
            key=jax.random.key(9),
            compute_scale=scale,
            **HYPER,
        )

        # count and learning_rate are traced: as jit-time constants XLA would fold the bias
        # corrections on the host, possibly an ulp away from its compiled pow.
        def run(count, learning_rate, *arrays, kwargs=kwargs):
            return fused_lib.fused_update(
                *arrays, count=count, learning_rate=learning_rate, impl=impl, **kwargs
            )

        arguments = (count, learning_rate, grad, mu, nu, master, 1.25)
        if impl == "reference":
            # Dry run: reference against itself, both op by op (a jitted XLA:CPU graph contracts
            # a * b + c into FMAs, which is a difference of XLA's, not of the kernel's).
            with jax.disable_jit():
                got = run(*arguments)
        else:
            got = jax.jit(run)(*arguments)
        reference_args = (grad, mu, nu, master, 1.25)
        reference_kwargs = dict(count=count, learning_rate=learning_rate, **kwargs)
        expected = _op_by_op_on_cpu(
            fused_lib.fused_update_reference, *reference_args, **reference_kwargs
        )
        cells, ok = [], True
        for g, e in zip(got, expected, strict=True):
            equal, worst = ulp_distance(g, e)
            ok &= worst <= (2 if e.dtype == jnp.float32 else 1)
            cells.append(f"{_name(e.dtype)} {equal:.6f}/{worst:g}")
        results.append(ok)
        label = (
            f"grad={_name(grad_dtype)} moments={_name(moment_dtype)} master={_name(master_dtype)} "
            f"compute={_name(compute_dtype)} {rounding}"
        )
        _print(
            f"{label}\n    mu {cells[0]} | nu {cells[1]} | master {cells[2]} | "
            f"compute {cells[3]}  {'ok' if ok else 'FAIL'}"
        )
        if impl != "reference":
            # For the record: the same reference op by op on this device (XLA's own kernels).
            with jax.disable_jit():
                on_device = fused_lib.fused_update_reference(*reference_args, **reference_kwargs)
            worst = max(ulp_distance(g, e)[1] for g, e in zip(got, on_device, strict=True))
            _print(
                f"    (vs the reference op by op on {jax.default_backend()}: max {worst:g} ulps)"
            )
    return results


# --- 2. and 3. bandwidth, fused against unfused ---------------------------------------------------


def bandwidth(n: int, impl: str, iterations: int) -> None:
    _print(f"\n== bandwidth, n={n} elements ({n * 4 / 2**20:.0f} MiB per float32 array)")
    x = jax.random.normal(jax.random.key(0), (n,))
    copy_s = timed(jax.jit(jnp.copy), x, iterations=iterations)
    ceiling = 2 * 4 * n / copy_s
    _print(
        f"{'device copy (jnp.copy)':<44} {copy_s * 1e3:8.3f} ms {ceiling / 1e9:9.1f} GB/s  1.00x"
    )

    def report(label: str, seconds: float, bytes_moved: int) -> None:
        rate = bytes_moved / seconds
        _print(
            f"{label:<44} {seconds * 1e3:8.3f} ms {rate / 1e9:9.1f} GB/s  "
            f"{rate / ceiling:.2f}x of copy"
        )

    key = jax.random.key(1)
    for dtype in TARGETS:
        for rounding in ("nearest", "stochastic"):
            f = jax.jit(
                functools.partial(cast_lib.cast, dtype=dtype, rounding=rounding, key=key, impl=impl)
            )
            bytes_moved = n * (4 + jnp.dtype(dtype).itemsize)
            seconds = timed(f, x, iterations=iterations)
            report(f"cast f32->{_name(dtype)} {rounding}", seconds, bytes_moved)
            # The same cast as XLA compiles the reference: what impl="auto" is choosing against.
            reference = jax.jit(
                functools.partial(cast_lib.cast_reference, dtype=dtype, rounding=rounding, key=key)
            )
            report(
                "  reference, jitted (XLA)", timed(reference, x, iterations=iterations), bytes_moved
            )

    _print("\n== fused update against the same update unfused")
    for moment_dtype in (jnp.float32, jnp.bfloat16):
        grad, mu, nu, master = _fused_inputs(n, jnp.float32, moment_dtype, jnp.float32)
        kwargs = dict(
            count=jnp.int32(5),
            learning_rate=jnp.float32(1e-3),
            compute_dtype=jnp.bfloat16,
            key=key,
            **HYPER,
        )
        m = jnp.dtype(moment_dtype).itemsize
        bytes_moved = n * (4 + 2 * m + 4) + n * (2 * m + 4 + 2)
        fused = jax.jit(functools.partial(fused_lib.fused_update, impl=impl, **kwargs))
        report(
            f"fused kernel (moments {_name(moment_dtype)})",
            timed(fused, grad, mu, nu, master, 1.0, iterations=iterations),
            bytes_moved,
        )
        reference = jax.jit(functools.partial(fused_lib.fused_update_reference, **kwargs))
        report(
            "  reference, jitted (XLA fusion)",
            timed(reference, grad, mu, nu, master, 1.0, iterations=iterations),
            bytes_moved,
        )
        unfused = _unfused_pipeline(moment_dtype, **kwargs)
        report(
            "  unfused: three jitted stages",
            timed(unfused, grad, mu, nu, master, iterations=iterations),
            bytes_moved,
        )


def _unfused_pipeline(
    moment_dtype, *, count, learning_rate, compute_dtype, key, b1, b2, eps, weight_decay
):
    """The update as an optax chain runs it: separate steps, each through memory."""
    s = fused_lib.scalars(
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
            cast_lib.cast_reference(mu_f, moment_dtype, rounding="stochastic", key=k_mu),
            cast_lib.cast_reference(nu_f, moment_dtype, rounding="stochastic", key=k_nu),
            direction,
        )

    @jax.jit
    def master_step(master, direction):
        return master - s.learning_rate * (direction + s.weight_decay * master)

    compute_cast = jax.jit(lambda master: cast_lib.cast_reference(master, compute_dtype))

    def run(grad, mu, nu, master):
        mu, nu, direction = moments(grad, mu, nu)
        master = master_step(master, direction)
        return mu, nu, master, compute_cast(master)

    return run


# --- 4. memory of a training step ----------------------------------------------------------------


def _resnet18(dtype):
    import triaccel_jax.models as models

    if hasattr(models, "ResNet18"):
        return models.ResNet18(num_classes=10, dtype=dtype), "ResNet18"
    from triaccel_jax.models._resnet import ResNet

    # The CIFAR variant of ResNet-18 (3x3 stem, no max-pool), as ResNet's docstring configures it.
    return ResNet(stage_sizes=(2, 2, 2, 2), num_filters=64, num_classes=10, dtype=dtype), (
        "ResNet(stage_sizes=(2, 2, 2, 2), num_filters=64)"
    )


def memory_child(config: str, batch_size: int, dry_run: bool) -> None:
    """One configuration's training step in this (fresh) process; prints one JSON line."""
    import optax

    import triaccel_jax
    import triaccel_jax.flax
    from triaccel_jax.models import ResNet20

    compute_dtype, state_dtype = {
        "fp32": (None, None),
        "static-bf16": (jnp.bfloat16, jnp.bfloat16),
        "planned": (None, None),  # fp32 masters; the planned policy casts through the interceptor
    }[config]
    if dry_run:
        model, model_name = ResNet20(num_classes=10, dtype=compute_dtype), "ResNet20 (dry run)"
    else:
        model, model_name = _resnet18(compute_dtype)
    x = jax.random.normal(jax.random.key(0), (batch_size, 32, 32, 3))
    y = jax.random.randint(jax.random.key(1), (batch_size,), 0, 10)
    variables = model.init(jax.random.key(2), x[:1], train=False)
    params, batch_stats = variables["params"], variables["batch_stats"]
    tx = triaccel_jax.triaccel(1e-3, state_dtype=state_dtype)
    opt_state = tx.init(params)

    def make_step(policy, donate):
        def loss_fn(params, batch_stats, x, y):
            variables = {"params": params, "batch_stats": batch_stats}
            kwargs = {"train": True, "mutable": ["batch_stats"]}
            if policy is None:
                logits, updates = model.apply(variables, x, **kwargs)
            else:
                logits, updates = triaccel_jax.flax.apply_with_policy(
                    model, variables, x, policy=policy, **kwargs
                )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
            return loss.mean(), updates["batch_stats"]

        @functools.partial(jax.jit, donate_argnums=(0, 1, 2) if donate else ())
        def step(params, batch_stats, opt_state, x, y):
            (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, batch_stats, x, y
            )
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), batch_stats, opt_state, loss

        return step

    policy = None
    if config == "planned":
        # Signals from a few fp32 steps on a small slice (kept small so that they do not set the
        # process's peak), then the planner's policy and the state converted to it.
        warm = make_step(None, donate=False)
        for _ in range(5):
            params, batch_stats, opt_state, warm_loss = warm(
                params, batch_stats, opt_state, x[:8], y[:8]
            )
        policy = triaccel_jax.plan_precision(
            triaccel_jax.signals(opt_state), params, budget=1e-3, loss=float(warm_loss)
        ).policy
        opt_state = triaccel_jax.transforms.convert_state(opt_state, policy)
    step = make_step(policy, donate=True)

    compiled = step.lower(params, batch_stats, opt_state, x, y).compile()
    analysis = compiled.memory_analysis()
    state = (params, batch_stats, opt_state)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        *state, loss = step(*state, x, y)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    device = jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        stats = {}
    leaves = jax.tree.leaves((params, opt_state))
    record = {
        "config": config,
        "model": model_name,
        "batch_size": batch_size,
        "params": int(sum(p.size for p in jax.tree.leaves(params))),
        "params_and_state_bytes": int(sum(a.nbytes for a in leaves if hasattr(a, "nbytes"))),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "bytes_limit": stats.get("bytes_limit"),
        "compiled_temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
        "compiled_argument_bytes": getattr(analysis, "argument_size_in_bytes", None),
        "compiled_output_bytes": getattr(analysis, "output_size_in_bytes", None),
        "compiled_alias_bytes": getattr(analysis, "alias_size_in_bytes", None),
        "step_ms_median_of_last_3": statistics.median(times[1:]) * 1e3,
        "loss": float(loss),
        "policy": repr(policy) if policy is not None else None,
    }
    print("MEMORY " + json.dumps(record), flush=True)


def memory(batch_size: int, dry_run: bool) -> None:
    _print(f"\n== memory of one training step (triaccel_jax.triaccel), batch {batch_size}")
    # Autotuning off: XLA:GPU's autotuner allocates scratch buffers while compiling, which the
    # process-wide peak_bytes_in_use would count (on an H200 it set the float32 figure: 3274 MiB
    # against a compiled 811 MiB). The kernels are then cuDNN's heuristic choices, so the step
    # times printed here are not tuned ones.
    flags = os.environ.get("XLA_FLAGS", "")
    env = {
        **os.environ,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_FLAGS": f"{flags} --xla_gpu_autotune_level=0".strip(),
    }
    records = []
    for config in ("fp32", "static-bf16", "planned"):
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--memory-child",
            config,
            "--batch-size",
            str(batch_size),
        ] + (["--dry-run"] if dry_run else [])
        try:
            result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        except subprocess.TimeoutExpired:
            _print(f"{config}: the step ran past 300 s")
            continue
        lines = [line for line in result.stdout.splitlines() if line.startswith("MEMORY ")]
        if result.returncode != 0 or not lines:
            _print(f"{config}: the step failed:\n{result.stderr[-2000:]}")
            continue
        records.append(json.loads(lines[-1][len("MEMORY ") :]))
    mib = lambda b: f"{'n/a':>9}" if b is None else f"{b / 2**20:9.1f}"
    _print(
        f"{'config':<12} {'peak MiB':>9} {'temp MiB':>9} {'args MiB':>9} {'params+state':>12} "
        f"{'step ms':>8}  model"
    )
    for r in records:
        _print(
            f"{r['config']:<12} {mib(r['peak_bytes_in_use'])} {mib(r['compiled_temp_bytes'])} "
            f"{mib(r['compiled_argument_bytes'])} {mib(r['params_and_state_bytes']):>12} "
            f"{r['step_ms_median_of_last_3']:8.2f}  {r['model']}, {r['params']:,} params"
        )
    for r in records:
        if r.get("policy"):
            _print(f"planned policy: {r['policy']}")
    if len(records) >= 2 and all(r["peak_bytes_in_use"] for r in records):
        for r in records[1:]:
            ratio = r["peak_bytes_in_use"] / records[0]["peak_bytes_in_use"]
            _print(f"{r['config']} / fp32 peak_bytes_in_use: {ratio:.3f}")
    elif records:
        _print("(peak_bytes_in_use is not reported by this backend: on CPU memory_stats() is None)")


# --- 5. end to end ------------------------------------------------------------------------------


def _end_to_end_dataset() -> str:
    """CIFAR-10 when its archive (or prepared set) and tensorflow-datasets are here, else the
    main job's ``auto`` (Fashion-MNIST if installed, else digits)."""
    import importlib.util

    data_dir = pathlib.Path(os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets").expanduser()
    present = (data_dir / "cifar10").exists() or (
        data_dir / "downloads" / "manual" / "cifar-10-binary.tar.gz"
    ).exists()
    return "cifar10" if present and importlib.util.find_spec("tensorflow_datasets") else "auto"


def end_to_end(quick: bool, output: str | None) -> bool:
    """The end-to-end section; False if a run failed."""
    from triaccel_jax.cli import _end_to_end as e2e

    if quick:
        settings = e2e.QUICK
    else:
        # One epoch of 30,000 images (234 steps at batch 128). FP32 and bf16 compile one step,
        # Tri-Accel one per batch bucket (128 to 512) and policy: 55 + 55 + 120 s at most, so the
        # section fits the 240 s that tools/device_check.sh gives it.
        settings = e2e.Settings(
            dataset=_end_to_end_dataset(),
            train_subset=30_000,
            eval_every=39,
            max_batch=512,
            timeout_s=55.0,
            triaccel_timeout_s=120.0,
        )
    _print(
        f"\n== end to end: {settings.model} on {settings.dataset} as {settings.image_shape}, "
        f"batch {settings.batch_size} (Tri-Accel up to {settings.max_batch}), one process per run"
    )
    folder = pathlib.Path(output or tempfile.mkdtemp(prefix="gpu_check_e2e_"))
    return e2e.end_to_end(settings, folder, echo=_print)


# --- main ----------------------------------------------------------------------------------------


def _versions() -> str:
    found = []
    for package in ("jax", "jaxlib", "jax-triton", "triton"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} -")
    return ", ".join(found)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny sizes and the reference implementation: runs anywhere (CPU)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="--dry-run, and the end-to-end section with a tiny model, data and steps (CPU)",
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        help="folder for the end-to-end runs' output (default: a new temporary folder)",
    )
    parser.add_argument(
        "--parity-size",
        type=int,
        default=None,
        help="elements per parity check (default 2**20 + 123; dry run 4099)",
    )
    parser.add_argument(
        "--bandwidth-log2",
        type=int,
        default=None,
        help="log2 of the elements per bandwidth array (default 28; dry run 14)",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="timed calls per figure (default 20; dry run 2)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="images per training step for the memory figures (default 128)",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=None,
        help="which checks to run (default: all but end-to-end; with --quick, all)",
    )
    parser.add_argument(
        "--skip-memory",
        action="store_true",
        help="skip the memory figures (same as leaving `memory` out of --sections)",
    )
    parser.add_argument(
        "--memory-child", choices=("fp32", "static-bf16", "planned"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    args.dry_run = dry = args.dry_run or args.quick
    if args.sections is None:
        args.sections = list(SECTIONS if args.quick else DEFAULT_SECTIONS)
    if args.parity_size is None:
        args.parity_size = 4099 if dry else 2**20 + 123
    if args.bandwidth_log2 is None:
        args.bandwidth_log2 = 14 if dry else 28
    if args.iterations is None:
        args.iterations = 2 if dry else 20
    if args.batch_size is None:
        args.batch_size = 8 if dry else 128
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child, args.batch_size, args.dry_run)
        return 0
    start = time.perf_counter()
    reason = _dispatch.triton_unavailable_reason()
    _print(f"devices: {jax.devices()}; {_versions()}")
    if reason is not None and not args.dry_run:
        _print(f"the Triton kernels cannot run here: {reason}\n(use --dry-run to check the script)")
        return 2
    impl = "reference" if args.dry_run else "triton"
    if args.dry_run:
        _print("dry run: reference implementation, tiny sizes; the figures mean nothing")
    else:
        _print(f"impl='auto' resolves to {_dispatch.resolve('auto', 'cast')!r} here")
    sections = set(args.sections) - ({"memory"} if args.skip_memory else set())
    results = []
    if "cast-parity" in sections:
        results += cast_parity(args.parity_size, impl)
    if "fused-parity" in sections:
        results += fused_parity(args.parity_size, impl)
    if "bandwidth" in sections:
        bandwidth(2**args.bandwidth_log2, impl, args.iterations)
    if "memory" in sections:
        memory(args.batch_size, args.dry_run)
    if "end-to-end" in sections:
        results.append(end_to_end(args.quick, args.output_dir))
    failed = results.count(False)
    _print(
        f"\nparity: {len(results) - failed} passed, {failed} failed; "
        f"total {time.perf_counter() - start:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
