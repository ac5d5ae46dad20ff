"""Tri-Accel's optimizer state in the main job: started in formats by size, planned from the
run's own signals, converted where the plan differs, stored in low-bit formats, fewer compiled
bytes than FP32 AdamW's, and every run's bytes counted by format."""

from __future__ import annotations

import types

import chex
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


def _trained_state(digits, formats="fp32", steps: int = 3):
    """Tri-Accel's state after ``steps`` steps on the digits, its moments in ``formats``."""
    loss_fn, params, data = digits
    tx = state_lib.injected_triaccel(1e-3, formats)
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch):
        grads = jax.grad(lambda p: loss_fn(p, batch, policy=None, rng=jax.random.key(0))[0])(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(steps):
        batch = {k: v[32 * i : 32 * (i + 1)] for k, v in data.train.items()}
        params, state = step(params, state, batch)
    return params, state


def _plan(digits, *, cap: float = 6.5, started_in=None):
    _, params, _ = digits
    initial = state_lib.initial_state_formats(params, learning_rate=1e-3, cap=6.5)
    trained_params, state = _trained_state(digits, initial)
    return state_lib.plan_state(
        state,
        trained_params,
        learning_rate=1e-3,
        cap=cap,
        step=3,
        started_in=initial if started_in is None else started_in,
    )


@pytest.fixture(scope="module")
def plan(digits):
    return _plan(digits)


def test_the_plan_stores_the_largest_leaf_low_bit_under_the_cap(plan, digits):
    _, params, _ = digits
    assert plan.plan_step == 3 and plan.plan_seconds > 0
    assert set(plan.formats) == {
        "/".join(str(k.key) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    # Dense_0/kernel holds most of the parameters: the cap cannot hold with it in fp32 or bf16.
    assert plan.formats["Dense_0/kernel"] in ("int8", "int8_dynamic", "int4")
    assert plan.meets_cap and plan.bytes_per_parameter <= 6.5 * (1 + 1e-6)
    # Leaves under quantize_state's min_size stay float32 (the planner knows it).
    assert plan.formats["Conv_0/kernel"] == "fp32" and plan.formats["Dense_1/bias"] == "fp32"
    # On this model the signals choose what size alone chose at the start: nothing to convert.
    assert plan.formats == plan.initial_formats and not plan.switched


def test_the_initial_formats_rank_by_size_under_the_cap(digits):
    _, params, _ = digits
    initial = state_lib.initial_state_formats(params, learning_rate=1e-3, cap=6.5)
    assert initial["Dense_0/kernel"] == "int8" and initial["Conv_0/kernel"] == "fp32"
    # A cap that holds float32 moments converts nothing; a lower one lowers more.
    assert set(state_lib.initial_state_formats(params, learning_rate=1e-3, cap=12.0).values()) == {
        "fp32"
    }
    low = state_lib.initial_state_formats(params, learning_rate=1e-3, cap=5.0)
    assert low["Dense_0/kernel"] == "int4"


@pytest.mark.standard_promotion("optax.scale_by_adam's update")
def test_a_plan_that_differs_from_the_start_says_it_switched(digits):
    everything_fp32 = {path: "fp32" for path in _plan(digits).formats}
    plan = _plan(digits, started_in=everything_fp32)
    assert plan.switched and plan.initial_formats == everything_fp32


@pytest.mark.standard_promotion("optax.scale_by_adam's update")
@pytest.mark.parametrize(
    ("start", "end"),
    [
        ("fp32", {"Dense_0/kernel": "int8"}),
        ({"Dense_0/kernel": "int8"}, {"Dense_0/kernel": "int4"}),
        ({"Dense_0/kernel": "int8"}, "fp32"),
    ],
)
def test_a_converted_state_keeps_the_moments_and_everything_else(digits, start, end):
    trained, state = _trained_state(digits, start)
    converted = state_lib.convert_state_formats(state, trained, learning_rate=1e-3, formats=end)
    # The structure the new formats' optimizer keeps, which its update takes.
    expected = jax.eval_shape(state_lib.injected_triaccel(1e-3, end).init, trained)
    assert jax.tree.structure(converted) == jax.tree.structure(expected)
    chex.assert_trees_all_equal_shapes_and_dtypes(converted, expected)

    def moments(tree):
        node = next(
            n
            for n in jax.tree.leaves(
                tree,
                is_leaf=lambda n: isinstance(
                    n, (transforms.QuantizedState, optax.ScaleByAdamState)
                ),
            )
            if isinstance(n, (transforms.QuantizedState, optax.ScaleByAdamState))
        )
        plain = (
            transforms.dequantize_state(node)
            if isinstance(node, transforms.QuantizedState)
            else node
        )
        return plain

    before, after = moments(state), moments(converted)
    # The moments read back within the coarser format's rounding; the counts exactly.
    assert int(after.count) == int(before.count) == 3
    for field in ("mu", "nu"):
        old = np.asarray(getattr(before, field)["Dense_0"]["kernel"])
        new = np.asarray(getattr(after, field)["Dense_0"]["kernel"])
        if field == "nu" and end != "fp32" and end["Dense_0/kernel"] == "int4":
            # int4 keeps a matrix's second moment factored: its row and column means, exactly.
            np.testing.assert_allclose(new.mean(-1), old.mean(-1), rtol=1e-4)
            np.testing.assert_allclose(new.mean(0), old.mean(0), rtol=1e-4)
            continue
        # Within the coarser format's rounding: a tenth of each row's largest magnitude for the
        # 4-bit map (its widest gap is 0.225 of a block's maximum), far less for 8 bits.
        scale = np.abs(old).max(axis=-1, keepdims=True)
        assert np.all(np.abs(new - old) <= 0.12 * scale + 1e-12), field
        np.testing.assert_array_equal(
            np.asarray(getattr(after, field)["Conv_0"]["kernel"]),
            np.asarray(getattr(before, field)["Conv_0"]["kernel"]),
        )
    # The observer's signals and the injected rate are kept as they are.
    chex.assert_trees_all_equal(converted.hyperparams, state.hyperparams)
    chex.assert_trees_all_equal(
        jax.tree.map(np.asarray, transforms.signals(converted))["Dense_0/kernel"]["mean_curvature"],
        jax.tree.map(np.asarray, transforms.signals(state))["Dense_0/kernel"]["mean_curvature"],
    )
    # The update takes it, under jit.
    tx = state_lib.injected_triaccel(1e-3, end)
    grads = jax.tree.map(jnp.ones_like, trained)
    updates, _ = jax.jit(tx.update)(grads, converted, trained)
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))


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


@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_cap_is_refused_by_name(digits, cap):
    _, params, _ = digits
    with pytest.raises(ValueError, match="state cap must be a positive number"):
        state_lib.initial_state_formats(params, learning_rate=1e-3, cap=cap)
    state = state_lib.injected_triaccel(1e-3).init(params)
    with pytest.raises(ValueError, match="state cap must be a positive number"):
        state_lib.plan_state(state, params, learning_rate=1e-3, cap=cap, step=0, started_in={})


def test_the_plan_summary_names_each_format_and_the_plans_cost():
    from triaccel_jax.cli import _results as results

    formats = {"a/kernel": "int8", "b/kernel": "fp32", "c/bias": "fp32", "d/bias": "fp32"}
    plan = state_lib.StatePlan(formats, formats, 6.5, 6.29, True, 1e-9, 20, 0.05, False, {})
    elastic = types.SimpleNamespace(state_plan=vars(plan))
    text = results.state_plan_summary(elastic)
    assert "cap of 6.5 B/param" in text and "signals at step 20 (0.05 s" in text
    assert "as it started (by size)" in text
    assert "3 leaves fp32; a/kernel int8; 6.29 B/param planned" in text
    assert "over the cap" not in text
    plan.meets_cap = False
    plan.switched = True
    text = results.state_plan_summary(types.SimpleNamespace(state_plan=vars(plan)))
    assert "over the cap" in text and "converted from the formats its sizes gave" in text
