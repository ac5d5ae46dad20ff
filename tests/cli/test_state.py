"""Tri-Accel's optimizer state in the main job: planned from a probe, stored in low-bit formats,
fewer compiled bytes than FP32 AdamW's, and every run's bytes counted by format."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from triaccel_jax import transforms
from triaccel_jax.cli import _runs as runs
from triaccel_jax.cli import _state as state_lib
from triaccel_jax.cli import _task as task


@pytest.fixture(scope="module")
def digits():
    """The small CNN on 256 digits: (loss_fn, params, data)."""
    data = task.load_data("digits", data_dir=None, train_subset=256, test_subset=64)
    model, has_state = task.build_model("small_cnn", data.num_classes)
    loss_fn = task.make_loss(model, has_state, None)
    params, _ = runs.init_variables(model, has_state, data, seed=0)
    return loss_fn, params, data


def _plan(digits, *, steps: int = 3, cap: float = 6.5):
    loss_fn, params, data = digits
    return state_lib.plan_state(
        loss_fn,
        params,
        None,
        data.train,
        learning_rate=1e-3,
        batch_size=32,
        steps=steps,
        cap=cap,
        seed=0,
    )


@pytest.fixture(scope="module")
def plan(digits):
    return _plan(digits)


def test_the_plan_stores_the_largest_leaf_low_bit_under_the_cap(plan, digits):
    _, params, _ = digits
    assert plan.probe_steps == 3 and plan.probe_seconds > 0
    assert set(plan.formats) == {
        "/".join(str(k.key) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    # Dense_0/kernel holds most of the parameters: the cap cannot hold with it in fp32 or bf16.
    assert plan.formats["Dense_0/kernel"] in ("int8", "int8_dynamic", "int4")
    assert plan.meets_cap and plan.bytes_per_parameter <= 6.5 * (1 + 1e-6)
    # Leaves under quantize_state's min_size stay float32 (the planner knows it).
    assert plan.formats["Conv_0/kernel"] == "fp32" and plan.formats["Dense_1/bias"] == "fp32"


def _stored(state):
    """``{state leaf path: stored node}`` of every quantize_state leaf in ``state``."""
    is_stored = lambda n: isinstance(n, (transforms.QuantizedLeaf, transforms.Bfloat16Leaf))
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_stored)
    return {jax.tree_util.keystr(path): node for path, node in flat if is_stored(node)}


@pytest.mark.standard_promotion("optax.scale_by_adam's update")
def test_the_triaccel_rows_moments_are_stored_in_the_planned_formats(plan, digits):
    loss_fn, params, data = digits
    tx = state_lib.injected_triaccel(1e-3, plan.formats)
    state = tx.init(params)
    stored = _stored(state)
    dense = {path: node for path, node in stored.items() if "Dense_0" in path and "kernel" in path}
    # Adam's mu and nu of Dense_0/kernel, each in 8- or 4-bit codes with float32 block scales.
    assert len(dense) == 2, stored.keys()
    for node in dense.values():
        assert isinstance(node, transforms.QuantizedLeaf)
        assert node.codes.dtype in (jnp.int8, jnp.uint8) and node.scales.dtype == jnp.float32
        assert node.codes.size <= params["Dense_0"]["kernel"].size
    # No leaf the plan keeps in fp32 is converted.
    kept = [p for p, f in plan.formats.items() if f == "fp32"]
    assert not [path for path in stored if any(k.replace("/", "']['") in path for k in kept)]
    # It trains under jit, and the state keeps its types.
    batch = {k: v[:32] for k, v in data.train.items()}

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: loss_fn(p, batch, policy=None, rng=jax.random.key(0))[0])(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    new_params, new_state = step(params, state)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new_params))
    assert {p: type(n) for p, n in _stored(new_state).items()} == {
        p: type(n) for p, n in stored.items()
    }


@pytest.mark.standard_promotion("optax.adamw's update")
def test_the_triaccel_rows_compiled_state_is_below_fp32_adamws(plan, digits):
    _, params, _ = digits
    fp32 = state_lib.compiled_state_bytes(optax.adamw(1e-3, weight_decay=1e-4), params)
    planned = state_lib.compiled_state_bytes(
        state_lib.injected_triaccel(1e-3, plan.formats), params
    )
    unplanned = state_lib.compiled_state_bytes(state_lib.injected_triaccel(1e-3), params)
    assert fp32 is not None and planned is not None and unplanned is not None
    # AdamW: 8 bytes a parameter. Tri-Accel's float32 moments and its signals take more; the
    # planned moments, in 8 or 4 bits, bring it below.
    parameters = sum(x.size for x in jax.tree.leaves(params))
    assert fp32 / parameters == pytest.approx(8.0, abs=0.01)
    assert planned < 0.9 * fp32 < unplanned


def test_state_bytes_by_format_counts_every_stored_leaf():
    params = {"w": jnp.ones((128, 128)), "b": jnp.zeros(128)}
    tx = transforms.quantize_state(optax.adam(1e-3), format={"w": "int8"}, min_size=1024)
    counted = state_lib.state_bytes_by_format(tx.init(params))
    # mu and nu of w: 16,384 codes and a scale per row of 128 each (blocks along the last axis);
    # of b: float32; counts and a key: other.
    assert counted == {"int8": 2 * (16_384 + 128 * 4), "fp32": 2 * 128 * 4, "other": 16}
    bf16 = transforms.quantize_state(optax.adam(1e-3), format="bf16", min_size=1024)
    assert state_lib.state_bytes_by_format(bf16.init(params))["bf16"] == 2 * 16_384 * 2
    int4 = transforms.quantize_state(optax.sgd(0.1, momentum=0.9), format="int4", min_size=1024)
    assert set(state_lib.state_bytes_by_format(int4.init(params))) == {"int4", "fp32", "other"}


@pytest.mark.parametrize(
    ("steps", "cap", "message"),
    [(0, 6.5, "at least 1 step"), (3, 0.0, "positive number"), (3, float("nan"), "positive")],
)
def test_a_bad_probe_or_cap_is_refused_by_name(digits, steps, cap, message):
    with pytest.raises(ValueError, match=message):
        _plan(digits, steps=steps, cap=cap)


def test_the_plan_summary_names_each_format_and_the_probes_cost():
    from triaccel_jax.cli import _results as results

    formats = {"a/kernel": "int8", "b/kernel": "fp32", "c/bias": "fp32", "d/bias": "fp32"}
    plan = state_lib.StatePlan(formats, 6.5, 6.29, True, 1e-9, 20, 2.5, {})
    elastic = types.SimpleNamespace(state_plan=vars(plan))
    text = results.state_plan_summary(elastic)
    assert "cap of 6.5 B/param" in text and "20-step probe (2.50 s" in text
    assert "3 leaves fp32; a/kernel int8; 6.29 B/param planned" in text
    assert "over the cap" not in text
    plan.meets_cap = False
    assert "over the cap" in results.state_plan_summary(
        types.SimpleNamespace(state_plan=vars(plan))
    )
