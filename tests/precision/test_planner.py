"""plan_precision on synthetic signals: ordering, budgets, range checks and hysteresis."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from triaccel_jax.policy import PrecisionPolicy
from triaccel_jax.policy import _dtypes as dtypes
from triaccel_jax.precision._planner import plan_precision

ORDER = {"fp32": 0, "fp16": 1, "bf16": 2, "fp8_e4m3": 3}  # by unit roundoff, finest first


def params_and_signals(curvatures, size=4096, nsr=0.0):
    params = {name: jnp.full((size // 64, 64), 0.1) for name in curvatures}
    signals = {
        name: {"mean_curvature": k, "noise_to_signal": nsr} for name, k in curvatures.items()
    }
    return params, signals


@pytest.mark.parametrize("budget", [1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3])
def test_sharper_leaf_never_gets_lower_precision(budget):
    params, signals = params_and_signals({"sharp": 100.0, "flat": 1.0})
    policy = plan_precision(
        signals, params, budget=budget, allowed=("bf16", "fp16", "fp8_e4m3")
    ).policy
    assert ORDER[policy.compute("sharp")] <= ORDER[policy.compute("flat")], policy


def test_noise_tolerance_relaxes_a_noisy_leaf():
    params, signals = params_and_signals({"quiet": 1.0, "noisy": 1.0})
    signals["noisy"]["noise_to_signal"] = 99.0
    # bf16 costs (2**-8)**2 / 6 * 1.0 * 4096 * 0.01 = 1.0e-4 per leaf; the noisy one counts 1/100.
    policy = plan_precision(signals, params, budget=2e-5).policy
    assert policy.compute("noisy") == "bf16" and policy.compute("quiet") == "fp32", policy


def test_zero_budget_keeps_everything_fp32():
    params, signals = params_and_signals({"a": 0.0, "b": 1e-9, "c": 1.0})
    policy = plan_precision(signals, params, budget=0.0, allowed=("bf16", "fp8_e4m3")).policy
    assert {policy.compute(p) for p in policy} == {"fp32"}
    assert {policy.state(p) for p in policy} == {"fp32"}


def test_infinite_budget_takes_cheapest_allowed_for_eligible_leaves():
    params, signals = params_and_signals({"a": 1e3, "b": 1.0})
    params["bias"] = jnp.ones(4096)
    params["tiny"] = jnp.ones((4, 4))
    for name in ("bias", "tiny"):
        signals[name] = {"mean_curvature": 1.0, "noise_to_signal": 0.0}
    policy = plan_precision(
        signals, params, budget=float("inf"), allowed=("bf16", "fp8_e4m3")
    ).policy
    # fp8 is carried in bf16: it saves nothing over bf16, so the cheapest is bf16.
    assert policy.compute("a") == policy.compute("b") == "bf16"
    assert policy.compute("bias") == "fp32" and "vector" in policy.reasons["bias"]
    assert policy.compute("tiny") == "fp32" and "min_size" in policy.reasons["tiny"]
    assert policy.state("a") == "bf16"


def test_range_check_promotes_leaf_that_overflows_fp16():
    params, signals = params_and_signals({"small": 1.0, "large": 1.0})
    params["large"] = jnp.full((64, 64), 3.0e4)
    policy = plan_precision(signals, params, budget=float("inf"), allowed=("fp16",)).policy
    assert policy.compute("small") == "fp16"
    assert policy.compute("large") == "fp32" and "fp16 out of range" in policy.reasons["large"]
    policy = plan_precision(signals, params, budget=float("inf"), allowed=("fp16", "bf16")).policy
    assert policy.compute("large") == "bf16"


def test_hysteresis_noisy_signals_change_no_leaf_more_than_once():
    params, signals = params_and_signals({f"leaf{i}": 1.0 for i in range(8)})
    # A budget right at the point where each leaf's bf16 cost sits: +-10% noise around it.
    threshold = dtypes.FORMATS["bf16"].unit_roundoff ** 2 / 6 * 1.0 * 4096 * 0.01
    rng = np.random.default_rng(0)
    plan = None
    history = []
    for _ in range(10):
        noisy = {
            p: {"mean_curvature": 1.0 * rng.uniform(0.9, 1.1), "noise_to_signal": 0.0}
            for p in signals
        }
        plan = plan_precision(noisy, params, plan, budget=4 * threshold, patience=2, margin=0.25)
        history.append({p: plan.policy.compute(p) for p in plan.policy})
    for path in signals:
        changes = sum(a[path] != b[path] for a, b in itertools.pairwise(history))
        assert changes <= 1, (path, [h[path] for h in history])


def test_patience_delays_a_move_then_allows_it():
    params, signals = params_and_signals({"w": 1.0})
    start = PrecisionPolicy.uniform(params, "fp32")
    first = plan_precision(signals, params, start, budget=1.0, patience=2)
    assert first.policy.compute("w") == "fp32" and first.pending["w"] == ("bf16", 1)
    assert "held" in first.policy.reasons["w"]
    second = plan_precision(signals, params, first, budget=1.0, patience=2)
    assert second.policy.compute("w") == "bf16" and not second.pending


def test_leaf_without_signal_stays_fp32():
    params, signals = params_and_signals({"a": 1.0})
    params["unseen"] = jnp.ones((64, 64))
    policy = plan_precision(signals, params, budget=float("inf")).policy
    assert policy.compute("unseen") == "fp32" and "no curvature signal" in policy.reasons["unseen"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget": -1.0}, "budget"),
        ({"budget": float("nan")}, "budget"),
        ({"allowed": ("bf17",)}, "unknown allowed dtype 'bf17'"),
        ({"patience": 0}, "patience"),
        ({"margin": 1.0}, "margin"),
        ({"min_size": -1}, "min_size"),
        ({"state": "fp16"}, "state"),
        ({"loss": float("inf")}, "loss"),
    ],
)
def test_bad_arguments(kwargs, message):
    params, signals = params_and_signals({"a": 1.0})
    with pytest.raises(ValueError, match=message):
        plan_precision(signals, params, **kwargs)


def test_previous_policy_for_other_params_names_the_path():
    params, signals = params_and_signals({"a": 1.0})
    other = PrecisionPolicy.uniform({"b": jnp.ones((3, 3))})
    with pytest.raises(ValueError, match="'a'"):
        plan_precision(signals, params, other)


def test_savings_needed_lowers_only_as_far_as_memory_needs_cheapest_first():
    params = {
        "flat": jnp.ones((64, 64)),  # low curvature: the cheapest to round
        "sharp": jnp.ones((64, 64)),
        "bias": jnp.ones(64),
    }
    signals = {
        "flat": {"mean_curvature": 1e-6},
        "sharp": {"mean_curvature": 1e-2},
        "bias": {"mean_curvature": 1e-6},
    }
    inf = float("inf")
    everything = plan_precision(signals, params, budget=inf).policy
    assert [everything.compute(p) for p in ("flat", "sharp", "bias")] == ["bf16", "bf16", "fp32"]
    nothing = plan_precision(signals, params, budget=inf, savings_needed=0).policy
    assert all(nothing.compute(p) == "fp32" for p in params)
    assert "memory needs only 0 B saved" in nothing.reasons["flat"]
    one_leaf = 2 * 64 * 64  # bf16 saves 2 bytes an element
    some = plan_precision(signals, params, budget=inf, savings_needed=one_leaf).policy
    assert (some.compute("flat"), some.compute("sharp")) == ("bf16", "fp32")
    both = plan_precision(signals, params, budget=inf, savings_needed=one_leaf + 1).policy
    assert (both.compute("flat"), both.compute("sharp")) == ("bf16", "bf16")
    # The accuracy budget still bounds what memory may take.
    tight = plan_precision(signals, params, budget=0.0, savings_needed=10**9).policy
    assert all(tight.compute(p) == "fp32" for p in params)
    with pytest.raises(ValueError, match="savings_needed"):
        plan_precision(signals, params, savings_needed=-1)
