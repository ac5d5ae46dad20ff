"""Memory: ``peak_bytes_in_use`` of one ResNet-18 training step, fp32 / static bf16 / planned."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from gpu_sections import _common as common

GPU_CHECK = pathlib.Path(__file__).resolve().parents[1] / "gpu_check.py"


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
    tx = triaccel_jax.triaccel(1e-3, config=triaccel_jax.TriAccelConfig(state_dtype=state_dtype))
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
        for _ in range(20):  # as the main job's first plan (--first-replan 20)
            params, batch_stats, opt_state, warm_loss = warm(
                params, batch_stats, opt_state, x[:8], y[:8]
            )
        policy = triaccel_jax.plan_precision(
            triaccel_jax.signals(opt_state), params, loss=float(warm_loss)
        ).policy  # the planner's default budget
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
    common.echo(f"\n== memory of one training step (triaccel_jax.triaccel), batch {batch_size}")
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
            str(GPU_CHECK),
            "--memory-child",
            config,
            "--batch-size",
            str(batch_size),
        ] + (["--dry-run"] if dry_run else [])
        try:
            result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        except subprocess.TimeoutExpired:
            common.echo(f"{config}: the step ran past 300 s")
            continue
        lines = [line for line in result.stdout.splitlines() if line.startswith("MEMORY ")]
        if result.returncode != 0 or not lines:
            common.echo(f"{config}: the step failed:\n{result.stderr[-2000:]}")
            continue
        records.append(json.loads(lines[-1][len("MEMORY ") :]))
    mib = lambda b: f"{'n/a':>9}" if b is None else f"{b / 2**20:9.1f}"
    common.echo(
        f"{'config':<12} {'peak MiB':>9} {'temp MiB':>9} {'args MiB':>9} {'params+state':>12} "
        f"{'step ms':>8}  model"
    )
    for r in records:
        common.echo(
            f"{r['config']:<12} {mib(r['peak_bytes_in_use'])} {mib(r['compiled_temp_bytes'])} "
            f"{mib(r['compiled_argument_bytes'])} {mib(r['params_and_state_bytes']):>12} "
            f"{r['step_ms_median_of_last_3']:8.2f}  {r['model']}, {r['params']:,} params"
        )
    for r in records:
        if r.get("policy"):
            common.echo(f"planned policy: {r['policy']}")
    if len(records) >= 2 and all(r["peak_bytes_in_use"] for r in records):
        for r in records[1:]:
            ratio = r["peak_bytes_in_use"] / records[0]["peak_bytes_in_use"]
            common.echo(f"{r['config']} / fp32 peak_bytes_in_use: {ratio:.3f}")
    elif records:
        common.echo(
            "(peak_bytes_in_use is not reported by this backend: on CPU memory_stats() is None)"
        )


# --- 5. end to end ------------------------------------------------------------------------------
