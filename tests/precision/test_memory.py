"""memory_report: exact bytes by component, residuals saved for backward, bad input."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_versions import exact_residuals

import triaccel_jax
from triaccel_jax.flax._precision import apply_with_policy
from triaccel_jax.precision._memory import MemoryReport
from triaccel_jax.precision._memory import compute_copy_dtype
from triaccel_jax.precision._memory import memory_report

F32, BF16 = 4, 2  # bytes per element


def _params():
    return {
        "dense": {"kernel": jnp.ones((64, 32)), "bias": jnp.zeros(32)},
        "step": jnp.zeros((), jnp.int32),  # not trainable: counted in params only
    }


def _bytes(tree):
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(tree))


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(16, name="hidden")(x))
        return nn.Dense(4, name="out")(h)


# -- params, compute copies, gradients, optimizer state -------------------------------------------


def test_exact_bytes_fp32_masters_bf16_kernel_triaccel_state():
    params = _params()
    policy = triaccel_jax.PrecisionPolicy.from_patterns(params, {"*/kernel": "bf16"})
    state = triaccel_jax.triaccel(1e-3).init(params)
    report = memory_report(params, state, policy)
    assert report.params == 64 * 32 * F32 + 32 * F32 + 4
    assert report.compute_copies == 64 * 32 * BF16  # the fp32 bias computes in its master
    assert report.gradients == 64 * 32 * F32 + 32 * F32  # the gradients of fp32 masters
    assert report.optimizer_state == _bytes(state)
    assert report.residuals is None and report.compiled is None
    assert report.total == report.params + 4096 + 8320 + report.optimizer_state

    # The moments are the param-sized part of the state: bf16 moments save exactly half of them.
    bf16_state = triaccel_jax.triaccel(
        1e-3, config=triaccel_jax.TriAccelConfig(state_dtype=jnp.bfloat16)
    ).init(params)
    saved = report.optimizer_state - memory_report(params, bf16_state, policy).optimizer_state
    assert saved == 2 * (64 * 32 + 32) * (F32 - BF16)


def test_no_policy_means_stored_dtypes_and_compute_copies_are_free():
    params = _params()
    params["dense"]["kernel"] = params["dense"]["kernel"].astype(jnp.bfloat16)
    report = memory_report(params, optax.sgd(0.1).init(params))
    assert report.params == 64 * 32 * BF16 + 32 * F32 + 4
    assert report.compute_copies == 0
    assert report.gradients == 64 * 32 * BF16 + 32 * F32
    assert report.optimizer_state == 0


def test_bf16_masters_under_a_bf16_policy_have_no_compute_copy():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), {"w": jnp.ones((8, 8))})
    policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16")
    assert memory_report(params, (), policy).compute_copies == 0


def test_shape_dtype_structs_and_typed_keys_are_counted_without_allocating():
    params = jax.eval_shape(_params)
    policy = triaccel_jax.PrecisionPolicy.from_patterns(params, {"*/kernel": "bf16"})
    state = {"key": jax.random.key(0), "count": jnp.zeros((), jnp.int32)}
    report = memory_report(params, state, policy)
    assert report.params == 64 * 32 * F32 + 32 * F32 + 4
    assert report.optimizer_state == 2 * 4 + 4  # threefry key data: 2 x uint32


# -- residuals saved for backward ------------------------------------------------------------------


def test_residuals_of_one_dense_layer_by_hand():
    model = nn.Dense(4)
    x, y = jnp.ones((8, 16)), jnp.ones((8, 4))
    variables = model.init(jax.random.key(0), x)

    def loss(v, batch):
        inputs, targets = batch
        return jnp.mean((model.apply(v, inputs) - targets) ** 2)

    report = memory_report(variables, (), None, loss, (x, y), compiled=False)
    # dL/dkernel = x^T g needs x (8x16 fp32); d(r^2) = 2 r dr needs 2r (8x4 fp32). The kernel
    # itself is not needed (x is not differentiated), the bias gradient needs nothing.
    assert report.residuals == 8 * 16 * F32 + 8 * 4 * F32


@exact_residuals
def test_residuals_exclude_params_and_compute_copies_but_count_casts_of_the_batch():
    model = _MLP()
    x = jnp.ones((3, 8))
    variables = model.init(jax.random.key(0), x)
    policy = triaccel_jax.PrecisionPolicy.from_patterns(variables, {"params/out/*": "bf16"})

    def loss(v, inputs):
        return apply_with_policy(model, v, inputs, policy=policy).astype(jnp.float32).sum()

    report = memory_report(variables, (), policy, loss, x, compiled=False)
    # Saved: x (fp32, for d hidden/kernel), tanh' (fp32), the out layer's input cast to bf16 (for
    # d out/kernel), and out/kernel's bf16 compute copy (for d h), which compute_copies holds.
    assert report.residuals == 3 * 8 * F32 + 3 * 16 * F32 + 3 * 16 * BF16
    assert report.compute_copies == (16 * 4 + 4) * BF16


@pytest.mark.standard_promotion(
    "the test multiplies a bf16 activation by an fp32 upcast copy on purpose"
)
def test_a_compute_copy_made_in_a_jitted_helper_is_not_counted_twice_but_an_upcast_is():
    params = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 4))}
    policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16")
    to_bf16 = jax.jit(lambda w: w.astype(jnp.bfloat16))
    x = jnp.ones((3, 8), jnp.bfloat16)

    def loss(p, inputs):
        h = jnp.tanh(inputs @ to_bf16(p["w1"]))
        return (h @ to_bf16(p["w2"])).astype(jnp.float32).sum()

    # x and tanh' (bf16) and h (bf16) are new; w2's bf16 copy (saved for dh) is the compute copy.
    expected = 3 * 8 * BF16 + 2 * 3 * 16 * BF16
    assert memory_report(params, (), policy, loss, x, compiled=False).residuals == expected

    def upcast_loss(p, inputs):
        h = jnp.tanh(inputs @ to_bf16(p["w1"]))
        return (h @ to_bf16(p["w2"]).astype(jnp.float32)).sum()

    # Now w2's rounded copy is cast back up to fp32 and saved (for dh): a new 16x4 fp32 array.
    report = memory_report(params, (), policy, upcast_loss, x, compiled=False)
    assert report.residuals == expected + 16 * 4 * F32


def test_compute_copies_made_by_more_than_a_cast_are_recognised():
    params = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 4))}
    policy = triaccel_jax.PrecisionPolicy.from_patterns(params, {"w1": "bf16", "w2": "fp8_e4m3"})
    x = jnp.ones((3, 8), jnp.bfloat16)

    def loss(p, inputs):
        # w1: stochastic-rounding-like (noise from a constant key); w2: a scaled copy carried in
        # bf16, as fp8 copies are. Both are made from one parameter and constants only.
        noise = jax.random.uniform(jax.random.key(0), (8, 16), minval=-1e-3, maxval=1e-3)
        w1 = (p["w1"] + noise).astype(jnp.bfloat16)
        w2 = (p["w2"] * 4.0).astype(jnp.bfloat16) * jnp.bfloat16(0.25)
        return (jnp.tanh(inputs @ w1) @ w2).astype(jnp.float32).sum()

    report = memory_report(params, (), policy, loss, x, compiled=False)
    assert report.compute_copies == (8 * 16 + 16 * 4) * BF16  # fp8 is carried in bf16
    assert report.gradients == (8 * 16 + 16 * 4) * F32  # fp32 masters, fp32 gradients
    assert report.residuals == 3 * 8 * BF16 + 2 * 3 * 16 * BF16  # x, tanh', tanh; no copies


def test_fp8_compute_copies_are_carried_in_the_dtype_cast_params_returns():
    params = {"w": jnp.ones((4, 4))}
    for name in ("fp32", "bf16", "fp16"):
        policy = triaccel_jax.PrecisionPolicy.uniform(params, name)
        copy = jax.eval_shape(lambda p, policy=policy: triaccel_jax.cast_params(p, policy), params)
        assert compute_copy_dtype(name) == copy["w"].dtype
    assert compute_copy_dtype("fp8_e4m3") == jnp.bfloat16


def test_residuals_halve_when_the_model_computes_in_bf16():
    model = _MLP()
    x = jnp.ones((3, 8))
    variables = model.init(jax.random.key(0), x)

    def report_for(compute):
        policy = triaccel_jax.PrecisionPolicy.uniform(variables, compute)

        def loss(v, inputs):
            return apply_with_policy(model, v, inputs, policy=policy).astype(jnp.float32).sum()

        return memory_report(variables, (), policy, loss, x, compiled=False)

    fp32, bf16 = report_for("fp32"), report_for("bf16")
    assert fp32.residuals == 3 * 8 * F32 + 2 * 3 * 16 * F32  # x, tanh', tanh
    assert bf16.residuals * 2 == fp32.residuals
    assert bf16.gradients == fp32.gradients  # both differentiate the fp32 masters
    assert bf16.compute_copies == fp32.params // 2 and fp32.compute_copies == 0


def test_compiled_figure_is_reported_apart_from_the_total():
    model = nn.Dense(4)
    x = jnp.ones((8, 16))
    variables = model.init(jax.random.key(0), x)
    loss = lambda v, inputs: model.apply(v, inputs).sum()
    report = memory_report(variables, (), None, loss, x)
    assert isinstance(report.compiled, int) and report.compiled > 0
    assert report.total == report.params + report.gradients + report.residuals
    assert "XLA compiled (this backend)" in str(report)


# -- the report object ----------------------------------------------------------------------------


def test_report_total_ratio_dict_and_table():
    report = MemoryReport(params=2**20, compute_copies=0, gradients=2**20, optimizer_state=2**21)
    baseline = MemoryReport(params=2**20, gradients=2**20, optimizer_state=2**21, residuals=2**22)
    assert report.total == 4 * 2**20
    assert report.ratio_to(baseline) == 0.5
    assert report.as_dict() == {
        "params": 2**20,
        "compute_copies": 0,
        "gradients": 2**20,
        "optimizer_state": 2**21,
        "residuals": None,
        "compiled": None,
        "total": 4 * 2**20,
    }
    table = report.table()
    assert "optimizer state" in table and "2.000   50.0%" in table
    assert "not measured" in table and "XLA compiled" not in table
    assert str(report) == table
    with pytest.raises(ValueError, match="total is 0"):
        report.ratio_to(MemoryReport())
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.params = 0


# -- bad input ------------------------------------------------------------------------------------


def test_a_policy_that_does_not_match_the_params_names_the_path():
    params = _params()
    policy = triaccel_jax.PrecisionPolicy.uniform({"dense": {"kernel": jnp.ones(2)}}, "bf16")
    with pytest.raises(ValueError, match=r"dense/bias"):
        memory_report(params, (), policy)


def test_step_fn_and_batch_come_together():
    params = {"w": jnp.ones(3)}
    loss = lambda p, b: jnp.sum(p["w"] * b)
    with pytest.raises(ValueError, match="both `step_fn` and `batch`"):
        memory_report(params, (), None, step_fn=loss)
    with pytest.raises(ValueError, match="both `step_fn` and `batch`"):
        memory_report(params, (), None, batch=jnp.ones(3))


def test_step_peak_bytes_is_the_compiled_steps_figure_at_each_size_compiled_once(count_compiles):
    @jax.jit
    def step(w, opt_state, batch):
        x, y = batch
        grads = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
        return w - 0.1 * grads, opt_state

    w = jnp.zeros((32, 4))
    data = (np.zeros((1000, 32), np.float32), np.zeros((1000, 4), np.float32))
    peak = triaccel_jax.precision.step_peak_bytes(step, w, {"m": jnp.zeros(4)}, data)
    with count_compiles() as compiles:
        figures = [peak(size) for size in (16, 256, 16, 256)]
    assert compiles.count == 2  # once a size
    batch_256 = (jnp.zeros((256, 32)), jnp.zeros((256, 4)))
    expected = triaccel_jax.precision.compiled_peak_bytes(
        step.lower(w, {"m": jnp.zeros(4)}, batch_256).compile()
    )
    assert figures[1] == figures[3] == expected
    # The batch's bytes alone grow by (256 - 16) rows of 36 floats.
    assert figures[1] - figures[0] >= (256 - 16) * 36 * 4
    # A plain function is jitted for the caller.
    plain = triaccel_jax.precision.step_peak_bytes(step.__wrapped__, w, {"m": jnp.zeros(4)}, data)
    assert plain(256) == expected


def test_step_peak_bytes_names_what_it_cannot_resize():
    with pytest.raises(TypeError, match="needs the step's arguments"):
        triaccel_jax.precision.step_peak_bytes(lambda b: b)
    with pytest.raises(TypeError, match="a callable"):
        triaccel_jax.precision.step_peak_bytes(3, jnp.zeros(2))
    with pytest.raises(ValueError, match=r"leading axis of samples to resize; got 1\.0"):
        triaccel_jax.precision.step_peak_bytes(lambda w, b: w, jnp.zeros(2), (jnp.zeros(3), 1.0))
