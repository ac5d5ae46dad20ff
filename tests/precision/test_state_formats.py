"""plan_state_formats: each leaf's optimizer-state format from curvature, noise and memory."""

import math
import warnings

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax import policy
from triaccel_jax.precision import plan_state_formats
from triaccel_jax.transforms import compiled_state_bytes

PARAMS = {name: jnp.ones((64, 128)) for name in ("a", "b", "c", "d")} | {"bias": jnp.zeros(128)}


ORDER = ["fp32", "bf16", "int8", "int4"]
# Uniform int8 and int4 state for PARAMS' (64, 128) leaves, AdamW (mu signed, nu a second
# moment), per parameter: blocks along the last axis, one int8 scale a row, 4-bit codes with one
# scale per 128, int4's nu factored (4 * (64 + 128) bytes a leaf).
INT8 = 4 + 2 * (1 + 4 / 128)
INT4 = 4 + (0.5 + 4 / 128) + 4 * (64 + 128) / (64 * 128)


def registry_bytes(params, formats, state_copies=2, second_moments=1):
    """Parameters plus state per parameter, summed from the registry's leaf bytes."""
    total = own = state = 0
    for path, leaf in params.items():
        fmt = policy.state_format(formats[path])
        itemsize = np.dtype(leaf.dtype).itemsize
        total += leaf.size
        own += leaf.size * itemsize
        state += (state_copies - second_moments) * fmt.leaf_bytes(leaf.shape, itemsize)
        state += second_moments * fmt.leaf_bytes(leaf.shape, itemsize, second_moment=True)
    return (own + state) / total


def signals(curvatures, noise=None):
    noise = noise or {}
    return {
        path: {"mean_curvature": kappa, "noise_to_signal": noise.get(path, 0.0)}
        for path, kappa in curvatures.items()
    }


def test_sharper_leaves_keep_more_bits_and_noisy_ones_take_fewer():
    sig = signals({"a": 1e-6, "b": 1e-2, "c": 1.0, "d": 1.0, "bias": 1.0}, noise={"d": 1e3})
    plan = plan_state_formats(sig, PARAMS, learning_rate=1e-3, budget=2e-9, min_size=1024)
    rank = {path: ORDER.index(fmt) for path, fmt in plan.formats.items()}
    assert rank["a"] >= rank["b"] >= rank["c"]  # flatter: fewer bits
    assert rank["d"] > rank["c"]  # same curvature, noisier gradients: fewer bits
    assert plan.formats["bias"] == "fp32" and "min_size" in plan.reasons["bias"]
    assert plan.predicted_increase <= plan.allowance
    assert len(set(plan.formats.values())) >= 3


def test_the_budget_bounds_what_is_lowered():
    sig = signals(dict.fromkeys(PARAMS, 1.0))
    keep = plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=0.0)
    assert set(keep.formats.values()) == {"fp32"} and keep.bytes_per_parameter == 12.0
    every = plan_state_formats(sig, PARAMS, learning_rate=1e-2, budget=math.inf, min_size=0)
    assert set(every.formats.values()) == {"int4"}
    assert every.bytes_per_parameter == pytest.approx(registry_bytes(PARAMS, every.formats))
    # The fewest bytes of the formats offered: int8 where int4 is not.
    eight = plan_state_formats(
        sig, PARAMS, learning_rate=1e-2, budget=math.inf, min_size=0, formats=("bf16", "int8")
    )
    assert set(eight.formats.values()) == {"int8"}
    assert eight.bytes_per_parameter == pytest.approx(4 + 2 * (1 + 4 / 128))
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
        sig, PARAMS, learning_rate=1e-2, max_bytes_per_parameter=9.0, min_size=1024
    )
    assert plan.bytes_per_parameter <= 9.0
    assert plan.predicted_increase > plan.allowance == 0.0  # the cap's cost, reported
    lowered = [p for p, f in plan.formats.items() if f != "fp32"]
    assert lowered and all("for memory" in plan.reasons[p] for p in lowered)
    # Least increase per byte saved first: the sharpest leaf keeps at least the flattest's bits.
    assert ORDER.index(plan.formats["d"]) <= ORDER.index(plan.formats["a"])
    # A cap that three leaves' bf16 meet (12 -> 10 B/param needs 65,792 bytes; two leaves save
    # 65,536): the three flattest go to bf16, in order, and the sharpest keeps float32.
    ten = plan_state_formats(
        sig, PARAMS, learning_rate=1e-2, max_bytes_per_parameter=10.0, min_size=1024
    )
    assert ten.formats == {"a": "bf16", "b": "bf16", "c": "bf16", "d": "fp32", "bias": "fp32"}
    assert ten.bytes_per_parameter == pytest.approx(12 - 3 * 2 * 2 * 8192 / (4 * 8192 + 128))


@pytest.mark.standard_promotion("optax's adamw promotes its step count inside")
def test_the_plans_bytes_are_xlas_compiled_figures_of_the_state_it_plans():
    # The registry's count of each leaf (blocks along the last axis, int4's factored second
    # moment) is what quantize_state stores; the last plan below is uniform int4 on leaves of
    # rows shorter than a block.
    params = {name: jnp.ones((32, 256)) for name in ("a", "b", "c", "d")} | {"bias": jnp.zeros(8)}
    sig = signals({"a": 1e-6, "b": 1e-2, "c": 1.0, "d": 1.0, "bias": 1.0})
    for copies, inner in ((2, optax.adamw(1e-3)), (1, optax.sgd(1e-3, momentum=0.9))):
        plan = plan_state_formats(
            sig,
            params,
            learning_rate=1e-3,
            budget=2e-9,
            state_copies=copies,
            min_size=1024,
            formats=("bf16", "int8"),
        )
        assert len(set(plan.formats.values())) == 3, plan.formats
        tx = triaccel_jax.quantize_state(inner, format=plan.formats, min_size=1024)
        measured = compiled_state_bytes(tx, params).bytes_per_parameter
        # AdamW's and the wrapper's counts and keys are a few bytes beside the moments.
        assert measured == pytest.approx(plan.bytes_per_parameter, abs=1e-3)
    short_rows = {name: jnp.ones((64, 96)) for name in ("a", "b")}
    plan = plan_state_formats(
        signals({"a": 1.0, "b": 1.0}),
        short_rows,
        learning_rate=1e-3,
        budget=math.inf,
        min_size=1024,
    )
    assert set(plan.formats.values()) == {"int4"}
    tx = triaccel_jax.quantize_state(optax.adamw(1e-3), format=plan.formats, min_size=1024)
    measured = compiled_state_bytes(tx, short_rows)
    # Exactly, beside Adam's and the wrapper's counts and the wrapper's key (4 + 4 + 8 bytes).
    assert measured.state_bytes == sum(plan.state_bytes.values()) + 16


def test_bad_input_is_refused_by_name():
    sig = signals(dict.fromkeys(PARAMS, 1.0))
    with pytest.raises(ValueError, match="learning_rate"):
        plan_state_formats(sig, PARAMS, learning_rate=0.0)
    with pytest.raises(ValueError, match=r"unknown state formats \['int3'\].*int8_dynamic"):
        plan_state_formats(sig, PARAMS, learning_rate=1e-3, formats=("int3",))
    with pytest.raises(ValueError, match="rank_by"):
        plan_state_formats(sig, PARAMS, learning_rate=1e-3, rank_by="curvature")
    with pytest.raises(ValueError, match="max_bytes_per_parameter"):
        plan_state_formats(sig, PARAMS, learning_rate=1e-3, rank_by="size")
    with pytest.raises(ValueError, match="budget"):
        plan_state_formats(
            sig, PARAMS, learning_rate=1e-3, rank_by="size", budget=0.0, max_bytes_per_parameter=8
        )
    with pytest.raises(ValueError, match="second_moments"):
        plan_state_formats(sig, PARAMS, learning_rate=1e-3, state_copies=1, second_moments=2)
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
        floor = registry_bytes(PARAMS, dict.fromkeys(PARAMS, "int4"))
        assert floor - 1e-9 <= plan.bytes_per_parameter <= 12.0
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
    assert {f for p, f in loose.formats.items() if p != "a"} == {"int4"}


@pytest.mark.standard_promotion("optax's adamw promotes its step count inside")
def test_bfloat16_parameters_are_priced_at_their_own_state_bytes():
    # AdamW keeps bf16 parameters' moments in bf16: "bf16" saves nothing there, int8 saves half.
    params = {name: jnp.ones((32, 256), jnp.bfloat16) for name in ("a", "b")}
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
    every = plan_state_formats(
        sig, params, learning_rate=1e-2, budget=math.inf, min_size=0, formats=("bf16", "int8")
    )
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
    # int4 for every leaf but the float32 bias is about 4.63 bytes per parameter at the least: a
    # cap of 4.5 cannot hold. The plan said nothing and returned what it reached.
    sig = signals(dict.fromkeys(PARAMS, 1.0))
    with pytest.warns(UserWarning, match=r"cannot meet max_bytes_per_parameter=4.5.*4\.6"):
        plan = plan_state_formats(
            sig, PARAMS, learning_rate=1e-2, max_bytes_per_parameter=4.5, min_size=1024
        )
    assert plan.meets_cap is False
    assert plan.bytes_per_parameter > 4.5
    assert set(plan.formats.values()) == {"int4", "fp32"}  # lowered as far as it goes
    assert plan.formats["bias"] == "fp32"
    # A cap met, and no cap: meets_cap holds and nothing is warned.
    met = plan_state_formats(
        sig, PARAMS, learning_rate=1e-2, max_bytes_per_parameter=9.0, min_size=1024
    )
    assert met.meets_cap is True and met.bytes_per_parameter <= 9.0
    assert plan_state_formats(sig, PARAMS, learning_rate=1e-2).meets_cap is True


# -- a plan that binds: a cap between uniform int4's bytes and uniform int8's ------------------


def cannot_raise_any_leaf(plan, params, sig, cap, formats=ORDER):
    """No leaf whose rounding costs loss could take a more precise format and the plan still
    fit: the plan meets the cap within one leaf's step."""
    total = sum(leaf.size for leaf in params.values())
    for path, name in plan.formats.items():
        if not sig[path]["mean_curvature"] > 0:
            continue  # raising it removes no predicted increase
        for other in formats:
            if (
                policy.state_format(other).error_variance
                >= policy.state_format(name).error_variance
            ):
                continue
            trial = dict(plan.formats, **{path: other})
            more = registry_bytes(params, trial) - registry_bytes(params, plan.formats)
            assert plan.bytes_per_parameter + more > cap, (path, name, other, more * total)


def test_a_cap_between_int4_and_int8_mixes_formats_and_binds_within_a_leafs_step():
    # The old plan chose int8 for every eligible leaf whatever the signals.
    sig = signals({"a": 1e-3, "b": 1e-1, "c": 10.0, "d": 1e3, "bias": 1.0})
    cap = (INT4 + INT8) / 2
    plan = plan_state_formats(sig, PARAMS, learning_rate=1e-2, max_bytes_per_parameter=cap)
    assert plan.meets_cap and plan.bytes_per_parameter <= cap
    assert {plan.formats[p] for p in "abcd"} == {"int4", "int8"}
    # The sharpest keep more bits than the flattest.
    assert ORDER.index(plan.formats["d"]) < ORDER.index(plan.formats["a"])
    assert plan.formats["bias"] == "fp32" and "min_size" in plan.reasons["bias"]
    cannot_raise_any_leaf(plan, PARAMS, sig, cap)
    # The cap's cost is reported; no budget applied.
    assert plan.predicted_increase > 0 and plan.allowance == 0.0
    assert all("for memory" in plan.reasons[p] for p in "abcd")


def test_a_sharper_leaf_keeps_more_bits_than_an_identical_flatter_one():
    params = {"flat": jnp.ones((64, 128)), "sharp": jnp.ones((64, 128))}
    for kappa in (1e-4, 1.0, 1e2):
        sig = signals({"flat": kappa, "sharp": 10 * kappa})
        plan = plan_state_formats(
            sig, params, learning_rate=1e-2, max_bytes_per_parameter=(INT4 + INT8) / 2, min_size=0
        )
        assert plan.formats == {"flat": "int4", "sharp": "int8"}
        # Equal curvature, noisier gradients: the noisy one takes fewer bits.
        noisy = plan_state_formats(
            signals({"flat": kappa, "sharp": kappa}, noise={"flat": 100.0}),
            params,
            learning_rate=1e-2,
            max_bytes_per_parameter=(INT4 + INT8) / 2,
            min_size=0,
        )
        assert noisy.formats == {"flat": "int4", "sharp": "int8"}


def test_a_cap_below_the_floor_is_unmet_said_and_warned():
    sig = signals(dict.fromkeys(PARAMS, 1.0))
    floor = registry_bytes(PARAMS, dict.fromkeys(PARAMS, "int4"))
    with pytest.warns(UserWarning, match="cannot meet max_bytes_per_parameter"):
        plan = plan_state_formats(
            sig, PARAMS, learning_rate=1e-2, max_bytes_per_parameter=floor - 0.01, min_size=0
        )
    assert not plan.meets_cap
    assert plan.bytes_per_parameter == pytest.approx(floor)
    assert set(plan.formats.values()) == {"int4"}
    # At the floor itself the cap is met (its own figure passed back holds).
    at = plan_state_formats(
        sig,
        PARAMS,
        learning_rate=1e-2,
        max_bytes_per_parameter=plan.bytes_per_parameter,
        min_size=0,
    )
    assert at.meets_cap and at.formats == plan.formats


@pytest.mark.parametrize(("copies", "second"), [(2, None), (2, 1), (1, None), (1, 0), (3, 2)])
def test_the_plans_bytes_are_the_registrys_leaf_bytes(copies, second):
    sig = signals({"a": 1e-6, "b": 1e-2, "c": 1.0, "d": 10.0, "bias": 1.0})
    seconds = second if second is not None else (1 if copies >= 2 else 0)
    for cap in (None, 5.0, 7.0, 9.0):
        plan = plan_state_formats(
            sig,
            PARAMS,
            learning_rate=1e-2,
            budget=None if cap else 1e-8,
            state_copies=copies,
            second_moments=second,
            max_bytes_per_parameter=cap,
            min_size=1024,
        )
        expected = registry_bytes(PARAMS, plan.formats, copies, seconds)
        assert plan.bytes_per_parameter == pytest.approx(expected, rel=1e-12)
        for path, leaf in PARAMS.items():
            fmt = policy.state_format(plan.formats[path])
            assert plan.state_bytes[path] == (copies - seconds) * fmt.leaf_bytes(
                leaf.shape, 4
            ) + seconds * fmt.leaf_bytes(leaf.shape, 4, second_moment=True)
    # Muon-like (one signed copy): int4 is codes, no factored second moment.
    muon = plan_state_formats(
        sig, PARAMS, learning_rate=1e-2, budget=math.inf, state_copies=1, min_size=0
    )
    assert muon.bytes_per_parameter == pytest.approx(4 + 0.5 + 4 / 128)


def test_int8_dynamic_is_offered_only_when_asked():
    sig = signals(dict.fromkeys(PARAMS, 1.0))
    plan = plan_state_formats(sig, PARAMS, learning_rate=1e-2, max_bytes_per_parameter=6.2)
    assert "int8_dynamic" not in plan.formats.values()
    asked = plan_state_formats(
        sig, PARAMS, learning_rate=1e-2, budget=math.inf, formats=("int8_dynamic",), min_size=0
    )
    assert set(asked.formats.values()) == {"int8_dynamic"}
    # Beside int8 it stores as many bytes with more error on Gaussian blocks: never a step.
    both = plan_state_formats(
        sig,
        PARAMS,
        learning_rate=1e-2,
        budget=math.inf,
        formats=("int8", "int8_dynamic"),
        min_size=0,
    )
    assert set(both.formats.values()) == {"int8"}


def test_plans_are_deterministic_whatever_the_order_of_the_leaves():
    sig = signals({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0, "bias": 1.0})  # ties everywhere
    reordered = {path: PARAMS[path] for path in reversed(PARAMS)}
    for cap, rank_by in ((5.3, "signals"), (5.3, "size"), (7.7, "signals"), (7.7, "size")):
        plans = [
            plan_state_formats(
                sig, params, learning_rate=1e-2, max_bytes_per_parameter=cap, rank_by=rank_by
            )
            for params in (PARAMS, PARAMS, reordered)
        ]
        assert plans[0] == plans[1]
        assert plans[0].formats == plans[2].formats
        assert plans[0].bytes_per_parameter == plans[2].bytes_per_parameter


def test_the_signal_blind_assignment_is_uniform_where_a_uniform_format_meets_the_cap():
    sig = signals({"a": 1e-6, "b": 1e-2, "c": 1.0, "d": 1e3, "bias": 1.0})
    for name in ("int8", "int4", "bf16"):
        blind = plan_state_formats(
            sig,
            PARAMS,
            learning_rate=1e-2,
            max_bytes_per_parameter=(registry_bytes(PARAMS, dict.fromkeys(PARAMS, name))),
            min_size=0,
            rank_by="size",
        )
        assert set(blind.formats.values()) == {name}, (name, blind.formats)
        assert all("signal-blind" in r for r in blind.reasons.values())
    # Between two uniform formats, the largest leaves take the fewer bits, sharp or not; the
    # plan at the same bytes keeps the sharp one's.
    params = {"big": jnp.ones((256, 128)), "flat": jnp.ones((128, 128))}
    params["middle"] = params["flat"]
    sig = signals({"big": 1.0, "flat": 1e-6, "middle": 5e-3})
    plan = plan_state_formats(sig, params, learning_rate=1e-2, max_bytes_per_parameter=5.4)
    assert plan.formats == {"big": "int8", "flat": "int4", "middle": "int4"}
    blind = plan_state_formats(
        sig,
        params,
        learning_rate=1e-2,
        max_bytes_per_parameter=plan.bytes_per_parameter,
        rank_by="size",
    )
    assert blind.formats == {"big": "int4", "flat": "int8", "middle": "int8"}
    assert blind.bytes_per_parameter <= plan.bytes_per_parameter
    assert plan.predicted_increase < blind.predicted_increase / 100


def floor_bytes(params):
    """The fewest bytes per parameter: each leaf in the format that stores it in the fewest."""
    best = {}
    for path in params:
        best[path] = min(ORDER, key=lambda name: registry_bytes({path: params[path]}, {path: name}))
    return registry_bytes(params, best)


@st.composite
def leaves_and_signals(draw):
    count = draw(st.integers(1, 6))
    params, sig = {}, {}
    for i in range(count):
        rows = draw(st.integers(1, 48))
        cols = draw(st.sampled_from([1, 7, 64, 100, 128, 256, 300]))
        params[f"l{i}"] = jnp.zeros((rows, cols))
        sig[f"l{i}"] = {
            "mean_curvature": draw(st.one_of(st.just(0.0), st.floats(1e-8, 1e4))),
            "noise_to_signal": draw(st.one_of(st.just(0.0), st.floats(0.0, 1e4))),
        }
    return params, sig


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(case=leaves_and_signals(), fraction=st.floats(-0.1, 1.1))
def test_any_feasible_cap_is_met_and_the_plan_never_predicts_more_than_the_blind_one(
    case, fraction
):
    params, sig = case
    floor = floor_bytes(params)
    cap = floor + fraction * (12.0 - floor)
    feasible = cap >= floor
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_state_formats(
            sig, params, learning_rate=1e-2, max_bytes_per_parameter=cap, min_size=0
        )
        blind = plan_state_formats(
            sig, params, learning_rate=1e-2, max_bytes_per_parameter=cap, min_size=0, rank_by="size"
        )
    assert plan.meets_cap == feasible == blind.meets_cap
    assert bool(caught) == (not feasible)
    assert plan.bytes_per_parameter == pytest.approx(registry_bytes(params, plan.formats))
    if feasible:
        assert plan.bytes_per_parameter <= cap * (1 + 1e-12)
        assert blind.bytes_per_parameter <= cap * (1 + 1e-12)
        assert plan.predicted_increase <= blind.predicted_increase
        cannot_raise_any_leaf(plan, params, sig, cap)
