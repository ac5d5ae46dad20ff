"""plan_state_formats: each leaf's optimizer-state format from curvature, noise and memory."""

import math

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax.precision import plan_state_formats
from triaccel_jax.transforms import compiled_state_bytes

PARAMS = {name: jnp.ones((64, 128)) for name in ("a", "b", "c", "d")} | {"bias": jnp.zeros(128)}


def signals(curvatures, noise=None):
    noise = noise or {}
    return {
        path: {"mean_curvature": kappa, "noise_to_signal": noise.get(path, 0.0)}
        for path, kappa in curvatures.items()
    }


def test_sharper_leaves_keep_more_bits_and_noisy_ones_take_fewer():
    sig = signals({"a": 1e-6, "b": 1e-2, "c": 1.0, "d": 1.0, "bias": 1.0}, noise={"d": 1e3})
    plan = plan_state_formats(sig, PARAMS, learning_rate=1e-3, budget=2e-9, min_size=1024)
    order = ["fp32", "bf16", "int8"]
    rank = {path: order.index(fmt) for path, fmt in plan.formats.items()}
    assert rank["a"] >= rank["b"] >= rank["c"]  # flatter: fewer bits
    assert rank["d"] > rank["c"]  # same curvature, noisier gradients: fewer bits
    assert plan.formats["bias"] == "fp32" and "min_size" in plan.reasons["bias"]
    assert plan.predicted_increase <= plan.allowance
    assert set(plan.formats.values()) == {"fp32", "bf16", "int8"}


def test_the_budget_bounds_what_is_lowered():
    sig = signals(dict.fromkeys(PARAMS, 1.0))
    keep = plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=0.0)
    assert set(keep.formats.values()) == {"fp32"} and keep.bytes_per_parameter == 12.0
    every = plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=math.inf, min_size=0)
    assert set(every.formats.values()) == {"int8"}
    assert every.bytes_per_parameter == pytest.approx(4 + 2 * (1 + 4 / 256))
    # Relative to the loss: the same plan as the absolute budget budget * loss.
    relative = plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=1e-3, loss=0.5)
    absolute = plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=5e-4)
    assert relative.formats == absolute.formats
    # bf16 only, when int8 is not allowed.
    bf16 = plan_state_formats(
        sig, PARAMS, learning_rate=1e-2, budget=math.inf, formats=("bf16",), min_size=0
    )
    assert set(bf16.formats.values()) == {"bf16"}


def test_a_memory_cap_lowers_until_it_holds_and_reports_the_increase():
    sig = signals({"a": 1.0, "b": 2.0, "c": 4.0, "d": 8.0, "bias": 1.0})
    plan = plan_state_formats(
        sig, PARAMS, learning_rate=1e-2, budget=0.0, max_bytes_per_parameter=9.0, min_size=1024
    )
    assert plan.bytes_per_parameter <= 9.0
    assert plan.predicted_increase > plan.allowance == 0.0  # memory first, the excess reported
    lowered = [p for p, f in plan.formats.items() if f != "fp32"]
    assert lowered and all("for memory" in plan.reasons[p] for p in lowered)
    # Least increase per byte saved first: the sharpest leaf keeps at least the flattest's bits.
    order = ["fp32", "bf16", "int8"]
    assert order.index(plan.formats["d"]) <= order.index(plan.formats["a"])
    # A cap that three leaves' bf16 meet (12 -> 10 B/param needs 65,792 bytes; two leaves save
    # 65,536): the three flattest go to bf16, in order, and the sharpest keeps float32.
    ten = plan_state_formats(
        sig, PARAMS, learning_rate=1e-2, budget=0.0, max_bytes_per_parameter=10.0, min_size=1024
    )
    assert ten.formats == {"a": "bf16", "b": "bf16", "c": "bf16", "d": "fp32", "bias": "fp32"}
    assert ten.bytes_per_parameter == pytest.approx(12 - 3 * 2 * 2 * 8192 / (4 * 8192 + 128))


@pytest.mark.standard_promotion("optax's adamw promotes its step count inside")
def test_the_plans_bytes_are_xlas_compiled_figures_of_the_state_it_plans():
    sig = signals({"a": 1e-6, "b": 1e-2, "c": 1.0, "d": 1.0, "bias": 1.0})
    for copies, inner in ((2, optax.adamw(1e-3)), (1, optax.sgd(1e-3, momentum=0.9))):
        plan = plan_state_formats(
            sig, PARAMS, learning_rate=1e-3, budget=2e-9, state_copies=copies, min_size=1024
        )
        tx = triaccel_jax.quantize_state(inner, format=plan.formats, min_size=1024)
        measured = compiled_state_bytes(tx, PARAMS).bytes_per_parameter
        # AdamW's and the wrapper's counts and keys are a few bytes beside the moments.
        assert measured == pytest.approx(plan.bytes_per_parameter, abs=1e-3)


def test_bad_input_is_refused_by_name():
    sig = signals(dict.fromkeys(PARAMS, 1.0))
    with pytest.raises(ValueError, match="learning_rate"):
        plan_state_formats(sig, PARAMS, learning_rate=0.0)
    with pytest.raises(ValueError, match="unknown state formats"):
        plan_state_formats(sig, PARAMS, learning_rate=1e-3, formats=("int4",))
    with pytest.raises(ValueError, match="shares no leaf"):
        plan_state_formats({"other": {"mean_curvature": 1.0}}, PARAMS, learning_rate=1e-3)
    with pytest.raises(ValueError, match="max_bytes_per_parameter"):
        plan_state_formats(sig, PARAMS, learning_rate=1e-3, max_bytes_per_parameter=-1.0)
    with pytest.raises(TypeError, match="signals"):
        plan_state_formats([1, 2], PARAMS, learning_rate=1e-3)


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(
    curvatures=st.lists(st.floats(0.0, 1e3), min_size=5, max_size=5),
    noise=st.lists(st.floats(0.0, 1e4), min_size=5, max_size=5),
    budgets=st.lists(st.floats(0.0, 1e-3), min_size=2, max_size=2),
    rate=st.floats(1e-5, 1.0),
)
def test_any_signals_stay_within_the_budget_and_a_larger_budget_never_costs_bytes(
    curvatures, noise, budgets, rate
):
    paths = sorted(PARAMS)
    sig = signals(dict(zip(paths, curvatures, strict=True)), dict(zip(paths, noise, strict=True)))
    small, large = sorted(budgets)
    tight = plan_state_formats(sig, PARAMS, learning_rate=rate, budget=small, min_size=0)
    loose = plan_state_formats(sig, PARAMS, learning_rate=rate, budget=large, min_size=0)
    for plan in (tight, loose):
        assert plan.predicted_increase <= plan.allowance * (1 + 1e-9)
        assert 4 + 2 * (1 + 4 / 256) - 1e-9 <= plan.bytes_per_parameter <= 12.0
    assert loose.bytes_per_parameter <= tight.bytes_per_parameter + 1e-9


# -- signals and parameters the planner cannot price alike -------------------------------------


@pytest.mark.parametrize(
    "bad",
    [{"mean_curvature": math.nan}, {"mean_curvature": math.inf}, {"noise_to_signal": math.nan}],
)
def test_a_leaf_with_signals_that_are_not_finite_keeps_its_state_and_spends_nothing(bad):
    # A NaN increase would make every later comparison with the budget false: every leaf lowered.
    sig = signals(dict.fromkeys(PARAMS, 1.0))
    sig["a"] = {**sig["a"], **bad}
    plan = plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=0.0, min_size=0)
    assert set(plan.formats.values()) == {"fp32"}
    assert "not finite" in plan.reasons["a"]
    assert plan.predicted_increase == 0.0
    # With room for every other leaf, those are lowered and the unpriced one is not.
    loose = plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=math.inf, min_size=0)
    assert loose.formats["a"] == "fp32" and math.isfinite(loose.predicted_increase)
    assert {f for p, f in loose.formats.items() if p != "a"} == {"int8"}


@pytest.mark.standard_promotion("optax's adamw promotes its step count inside")
def test_bfloat16_parameters_are_priced_at_their_own_state_bytes():
    # AdamW keeps bf16 parameters' moments in bf16: "bf16" saves nothing there, int8 saves half.
    params = {name: jnp.ones((64, 128), jnp.bfloat16) for name in ("a", "b")}
    sig = signals({"a": 1.0, "b": 1.0})
    keep = plan_state_formats(sig, params, learning_rate=1e-2, budget=0.0, min_size=0)
    assert keep.bytes_per_parameter == pytest.approx(6.0)
    assert keep.bytes_per_parameter == pytest.approx(
        compiled_state_bytes(optax.adamw(1e-3), params).bytes_per_parameter, abs=1e-3
    )
    with pytest.warns(UserWarning, match="cannot meet"):  # bf16 is no move: the cap is unmet
        capped = plan_state_formats(
            sig,
            params,
            learning_rate=1e-2,
            budget=0.0,
            formats=("bf16",),
            max_bytes_per_parameter=5,
        )
    assert set(capped.formats.values()) == {"fp32"} and capped.predicted_increase == 0.0
    assert not capped.meets_cap
    every = plan_state_formats(sig, params, learning_rate=1e-2, budget=math.inf, min_size=0)
    assert set(every.formats.values()) == {"int8"}
    tx = triaccel_jax.quantize_state(optax.adamw(1e-3), format=every.formats, min_size=0)
    measured = compiled_state_bytes(tx, params).bytes_per_parameter
    assert measured == pytest.approx(every.bytes_per_parameter, abs=1e-3)


def test_numpy_and_jax_scalars_are_numbers():
    sig = signals(dict.fromkeys(PARAMS, 1.0))
    expected = plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=1e-6, min_size=0)
    for budget in (np.float32(1e-6), jnp.float32(1e-6), np.float64(1e-6)):
        plan = plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=budget, min_size=0)
        assert plan.formats == expected.formats
    assert plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=np.int64(0)).formats == (
        dict.fromkeys(PARAMS, "fp32")
    )
    with pytest.raises(ValueError, match="budget"):
        plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=math.nan)


def test_a_cap_the_plan_cannot_meet_is_said_in_the_plan_and_warned():
    # int8 for every leaf is 4 + 2 * (1 + 4 / 256) = 6.03 bytes per parameter at the least: a
    # cap of 5 cannot hold. The plan said nothing and returned 6.03.
    sig = signals(dict.fromkeys(PARAMS, 1.0))
    with pytest.warns(UserWarning, match=r"cannot meet max_bytes_per_parameter=5.*6\.0"):
        plan = plan_state_formats(
            sig, PARAMS, learning_rate=1e-2, max_bytes_per_parameter=5.0, min_size=1024
        )
    assert plan.meets_cap is False
    assert plan.bytes_per_parameter > 5.0
    assert set(plan.formats.values()) - {"fp32"} == {"int8"}  # lowered as far as it goes
    # A cap met, and no cap: meets_cap holds and nothing is warned.
    met = plan_state_formats(
        sig, PARAMS, learning_rate=1e-2, max_bytes_per_parameter=9.0, min_size=1024
    )
    assert met.meets_cap is True and met.bytes_per_parameter <= 9.0
    assert plan_state_formats(sig, PARAMS, learning_rate=1e-2).meets_cap is True
