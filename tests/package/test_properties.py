"""Property tests (hypothesis): the optimizer, the planner, the casts and the policy's JSON.

Random pytrees (nested dicts, lists and tuples; scalars, 0-sized dimensions; float32, bfloat16,
float16 and int32 leaves; ``None`` leaves; an integer parameter's gradient sometimes float32, as
after a cast) go through ``triaccel``, ``plan_precision``, ``cast_params`` and the policy's JSON
round trip. Every property runs a fixed number of examples with ``derandomize=True``, so CI
sees the same examples on every run (and no example database is written):

* ``test_triaccel_on_random_trees`` (100, plus one explicit example whose first moment cancels
  to exactly 0): random tree structures, run eagerly (``disable_jit``; a jitted run would
  compile once per structure), fp32 moments with curvature every 10 steps or every step;
* ``test_triaccel_jit_agrees_with_eager`` (100): trees from ``TEMPLATES`` (so ``jit`` compiles
  each once per optimizer), fp32 moments jitted and eager, and bf16 moments with a Fisher
  estimate every step, jitted only (eager bf16 writes run Philox op by op, ~0.1 s per leaf);
* ``test_plan_precision`` (300), ``test_cast_params`` (300), ``test_policy_json_round_trip``
  (300).

Arrays hold at most 18 elements. The file takes about 35 s in one process on 2 busy CPU cores
(mostly the compiles of ``TEMPLATES`` and the eager steps).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import triaccel_jax
from triaccel_jax import LeafPrecision
from triaccel_jax import PrecisionPolicy
from triaccel_jax.policy import PrecisionPlan

PROPERTY = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The optimizer's two properties step it eagerly (each example's every primitive dispatched op
# by op), 0.15 s an example on 2 busy cores: 100 examples each keep CI within its minutes.
OPTIMIZER_PROPERTY = settings(PROPERTY, max_examples=100)

HAS_FP8 = hasattr(jnp, "float8_e4m3fn")
COMPUTE = ("fp32", "bf16", "fp16", *(("fp8_e4m3",) if HAS_FP8 else ()))
STATE = ("fp32", "bf16")
JAX_DTYPE = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
FP16_MAX = float(jnp.finfo(jnp.float16).max)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A leaf's shape and dtype (not a pytree node, so ``jax.tree.map`` stops at it)."""

    shape: tuple[int, ...]
    dtype: Any


# -- oracles, written independently of triaccel_jax._src --------------------------------------


def trainable(x: Any) -> bool:
    """What the optimizer acts on: a non-empty real floating-point array."""
    return jnp.issubdtype(x.dtype, jnp.floating) and x.size > 0


def path_string(path: tuple[Any, ...]) -> str:
    names = []
    for entry in path:
        for attribute in ("key", "idx", "name"):
            if hasattr(entry, attribute):
                names.append(str(getattr(entry, attribute)))
                break
    return "/".join(names)


def with_paths(tree: Any) -> list[tuple[str, Any]]:
    return [(path_string(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def trainable_leaves(tree: Any) -> dict[str, Any]:
    return {path: x for path, x in with_paths(tree) if trainable(x)}


def as_f64(x: Any) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


# -- strategies -----------------------------------------------------------------------------

SHAPES = ((), (1,), (3,), (0,), (2, 3), (0, 2), (2, 1, 2))
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32)
KEYS = ("a", "b", "kernel", "bias")

leaf_specs = st.one_of(st.none(), st.builds(Leaf, st.sampled_from(SHAPES), st.sampled_from(DTYPES)))


def spec_trees(leaves: st.SearchStrategy[Any] = leaf_specs, max_leaves: int = 5):
    """Nested dicts, lists and tuples of ``Leaf`` specs and ``None`` (empty containers too).

    The root is never ``None``: optax reads ``params=None`` as "no params passed".
    """
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(st.sampled_from(KEYS), children, max_size=3),
        ),
        max_leaves=max_leaves,
    ).filter(lambda tree: tree is not None)


def draw_array(draw: Any, leaf: Leaf, bound: float = 1e6) -> jax.Array:
    size = math.prod(leaf.shape)
    if jnp.issubdtype(leaf.dtype, jnp.integer):
        values = draw(st.lists(st.integers(-100, 100), min_size=size, max_size=size))
        return jnp.asarray(np.asarray(values, np.int32).reshape(leaf.shape))
    if leaf.dtype == jnp.float16:
        bound = min(bound, 6e4)  # inside float16's range
    floats = st.floats(-bound, bound, width=32)
    values = draw(st.lists(floats, min_size=size, max_size=size))
    return jnp.asarray(np.asarray(values, np.float32).reshape(leaf.shape)).astype(leaf.dtype)


def draw_tree(draw: Any, spec: Any, bound: float = 1e6) -> Any:
    return jax.tree.map(lambda leaf: draw_array(draw, leaf, bound), spec)


def draw_grads(draw: Any, spec: Any, cast_int_grads: bool) -> Any:
    """Gradients shaped like the params; an integer parameter's may come as float32."""

    def grad_spec(leaf):
        if cast_int_grads and jnp.issubdtype(leaf.dtype, jnp.integer) and draw(st.booleans()):
            return Leaf(leaf.shape, jnp.float32)
        return leaf

    return draw_tree(draw, jax.tree.map(grad_spec, spec))


@st.composite
def optimizer_examples(
    draw: Any, specs: st.SearchStrategy[Any], cast_int_grads: bool = True
) -> tuple[Any, Any, Any]:
    """``(params, first gradients, second gradients)``."""
    spec = draw(specs)
    grads = [draw_grads(draw, spec, cast_int_grads) for _ in range(2)]
    return draw_tree(draw, spec), *grads


# -- (a) triaccel: structure, pass-through, finiteness, stable state, jit == eager -------------

OPTIMIZERS = {
    "fp32": triaccel_jax.triaccel(0.1),  # curvature on the first update, not the second
    "fp32-every-step": triaccel_jax.triaccel(0.1, curvature_every=1),
    "bf16-every-step": triaccel_jax.triaccel(
        0.1, config=triaccel_jax.TriAccelConfig(state_dtype=jnp.bfloat16), curvature_every=1
    ),
}
JITTED = {name: jax.jit(tx.update) for name, tx in OPTIMIZERS.items()}


def two_updates(name: str, params: Any, g1: Any, g2: Any, *, jit: bool) -> tuple[Any, ...]:
    tx = OPTIMIZERS[name]
    update = JITTED[name] if jit else tx.update
    state = tx.init(params)
    u1, s1 = update(g1, state, params)
    u2, s2 = update(g2, s1, params)
    return state, u1, s1, u2, s2


def check_update(updates: Any, grads: Any, params: Any) -> None:
    """Same structure, shapes and dtypes as the gradients; pass-through leaves unchanged."""
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, grads)
    param_leaves = jax.tree.leaves(params)
    for u, g, p in zip(jax.tree.leaves(updates), jax.tree.leaves(grads), param_leaves, strict=True):
        if trainable(p) and trainable(g):
            chex.assert_tree_all_finite(u)
        else:  # "Integer, boolean and empty leaves pass through"
            np.testing.assert_array_equal(u, g)


def check_states(*states: Any) -> None:
    """Same tree structure, shapes and dtypes from init on; every float leaf finite."""
    chex.assert_trees_all_equal_shapes_and_dtypes(*states)
    for state in states:
        chex.assert_tree_all_finite(state)


# b1 * mu + (1 - b1) * g cancels exactly in float32 for g = 10 then -9: m_hat = 0 while v_hat > 0.
CANCELLING = tuple(
    {"w": jnp.float32(g), "v": jnp.ones((2,), jnp.float32)} for g in (0.0, 10.0, -9.0)
)


@OPTIMIZER_PROPERTY
@given(
    example=optimizer_examples(spec_trees()),
    name=st.sampled_from(["fp32", "fp32-every-step"]),
)
@pytest.mark.standard_promotion(
    "optax promotes inside its own transforms (integer leaves, MultiSteps, injected hyperparameters)"
)
@example(example=CANCELLING, name="fp32-every-step")
def test_triaccel_on_random_trees(example, name):
    params, g1, g2 = example
    with jax.disable_jit():
        state, u1, s1, u2, s2 = two_updates(name, params, g1, g2, jit=False)
    check_update(u1, g1, params)
    check_update(u2, g2, params)
    check_states(state, s1, s2)
    assert set(triaccel_jax.signals(s2)) == set(trainable_leaves(params))


F32, BF16, F16, I32 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32
TEMPLATES = (
    {"w": Leaf((2, 3), F32), "b": Leaf((3,), F32)},
    [Leaf((), BF16), (Leaf((0, 2), F32), None), {"n": Leaf((), I32)}],
    {"a": (Leaf((3,), F16), Leaf((2, 1, 2), F32)), "b": [Leaf((0,), BF16), Leaf((1,), I32)]},
    (Leaf((1,), F32), {"kernel": Leaf((2, 3), BF16), "bias": None, "empty": {}}, []),
    {"step": Leaf((), I32), "empty": Leaf((0, 3), F32), "none": None},
)


def assert_close(jitted: Any, eager: Any, what: str) -> None:
    chex.assert_trees_all_equal_dtypes(jitted, eager)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager), strict=True):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_array_equal(a, b, err_msg=what)
            continue
        # XLA fuses a jitted update (a * b + c may become an FMA), so the two agree to rounding;
        # the step scale and the moments of a narrow gradient are only as close as its dtype.
        rtol = 1e-4 if a.dtype == jnp.float32 else 2 * float(jnp.finfo(a.dtype).eps)
        np.testing.assert_allclose(as_f64(a), as_f64(b), rtol=rtol, atol=1e-6, err_msg=what)


def assert_close_updates(jitted: Any, eager: Any, grads: Any, params: Any) -> None:
    """Updates agree to rounding in the gradient's dtype of the terms they sum.

    The update ``-lr * (s * direction + weight_decay * param)`` is written in the gradient's
    dtype, and XLA may keep a jitted intermediate wider than the eager one: the two may differ by
    an ulp of each term (``|s * direction| <= 2 * 3`` here, ``weight_decay * |param|``), which is
    much more than an ulp of the sum when the terms cancel.
    """
    chex.assert_trees_all_equal_dtypes(jitted, eager, grads)
    leaves = zip(*(jax.tree.leaves(t) for t in (jitted, eager, grads, params)), strict=True)
    for a, b, g, p in leaves:
        if not (trainable(g) and trainable(p)):
            np.testing.assert_array_equal(a, b)
            continue
        eps = float(jnp.finfo(a.dtype).eps)
        tolerance = 4 * eps * 0.1 * (2 * 3 + 1e-4 * np.abs(as_f64(p)))
        assert np.all(np.abs(as_f64(a) - as_f64(b)) <= tolerance), (a, b)


@OPTIMIZER_PROPERTY
@given(
    # integer gradients only: each template then compiles once per optimizer
    example=optimizer_examples(st.sampled_from(TEMPLATES), cast_int_grads=False),
    name=st.sampled_from(["fp32", "bf16-every-step"]),
)
@pytest.mark.standard_promotion(
    "optax promotes inside its own transforms (integer leaves, MultiSteps, injected hyperparameters)"
)
def test_triaccel_jit_agrees_with_eager(example, name):
    params, g1, g2 = example
    state, u1, s1, u2, s2 = two_updates(name, params, g1, g2, jit=True)
    check_update(u1, g1, params)
    check_update(u2, g2, params)
    check_states(state, s1, s2)
    if name == "bf16-every-step":
        # Eager stochastic rounding runs Philox op by op (~0.1 s a leaf and moment); the bf16
        # path's jit/eager agreement is the cast kernel's (tests/kernels).
        chex.assert_type(jax.tree.leaves(s2[0].mu), jnp.bfloat16)
        return
    with jax.disable_jit():
        _, e1, es1, e2, es2 = two_updates(name, params, g1, g2, jit=False)
    for jitted, eager, grads in ((u1, e1, g1), (u2, e2, g2)):
        assert_close_updates(jitted, eager, grads, params)
    # gradients go up to 1e6: moments and curvature are compared relative to their scale
    scale = max([1.0, *(float(np.max(np.abs(as_f64(g)), initial=0)) for g in jax.tree.leaves(g1))])
    scale = max(
        [scale, *(float(np.max(np.abs(as_f64(g)), initial=0)) for g in jax.tree.leaves(g2))]
    )
    for jitted, eager in ((s1, es1), (s2, es2)):
        jitted, eager = comparable(jitted[0], scale), comparable(eager[0], scale)
        for field in jitted:
            assert_close(jitted[field], eager[field], field)


def comparable(
    state: triaccel_jax.transforms.CurvatureSignalsState | triaccel_jax.transforms.AdamSignalsState,
    scale: float,
) -> dict[str, Any]:
    """What jit and eager must agree on, scaled to about 1.

    The curvature store's outlier indices may differ where magnitudes tie to rounding, and the
    noise-to-signal ratio where ``m_hat`` cancels to about 0: neither is compared.
    """
    signals = jax.tree.leaves(
        state.leaf_signals, is_leaf=lambda x: isinstance(x, triaccel_jax.transforms.LeafSignals)
    )
    return {
        "count": state.count,
        "curvature_count": state.curvature_count,
        "mu": jax.tree.map(lambda x: x / scale, state.mu),
        "nu": jax.tree.map(lambda x: x / scale**2, state.nu),
        "mean_curvature": [s.mean_curvature / scale**2 for s in signals],
        "max_curvature": [s.max_curvature / scale**2 for s in signals],
        "trace": [s.trace / scale**2 for s in signals],
        "step_scale": [s.step_scale for s in signals],
    }


# -- (b) plan_precision --------------------------------------------------------------------------

PLAN_SHAPES = ((), (4,), (0, 4), (2, 3), (4, 4), (3, 3, 2), (1, 8))
plan_leaf_specs = st.one_of(
    st.none(), st.builds(Leaf, st.sampled_from(PLAN_SHAPES), st.sampled_from(DTYPES))
)


def unit_roundoff(name: str) -> float:
    dtype = jnp.float8_e4m3fn if name == "fp8_e4m3" else JAX_DTYPE[name]
    return float(jnp.finfo(dtype).eps) / 2


def itemsize(name: str) -> int:
    """Bytes per element of a compute copy: fp8 values are carried in bf16."""
    return {"fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3": 2}[name]


@st.composite
def plan_examples(draw: Any) -> tuple[Any, dict[str, Any], PrecisionPolicy | None, dict]:
    spec = draw(spec_trees(plan_leaf_specs, max_leaves=6))
    params = draw_tree(draw, spec, bound=1e5)  # up to 1e5: fp16 is sometimes out of range
    leaves = trainable_leaves(params)
    figures = st.floats(0, 1e6)
    signals = {}
    for path in leaves:
        if draw(st.integers(0, 4)):  # most leaves have a signal
            signals[path] = {"mean_curvature": draw(figures), "noise_to_signal": draw(figures)}
    if draw(st.booleans()):
        signals["not/a/leaf"] = {"mean_curvature": 1.0, "noise_to_signal": 0.0}
    kwargs = {
        "budget": draw(st.sampled_from([0.0, math.inf]) | st.floats(0, 1e3)),
        "loss": draw(st.none() | st.sampled_from([0.0]) | st.floats(0, 1e3)),
        "min_size": draw(st.integers(0, 12)),
        "allowed": tuple(draw(st.lists(st.sampled_from(COMPUTE), unique=True, max_size=4))),
        "state": draw(st.sampled_from(["auto", "fp32", "bf16"])),
    }
    previous = None
    if draw(st.booleans()):
        compute, state = st.sampled_from(COMPUTE), st.sampled_from(STATE)
        previous = PrecisionPlan(
            PrecisionPolicy(
                tuple((path, LeafPrecision(draw(compute), draw(state))) for path in leaves)
            ),
            pending={
                path: (draw(compute), draw(st.integers(1, 3)))
                for path in leaves
                if draw(st.booleans())
            },
        )
        kwargs["patience"] = draw(st.integers(1, 3))
        kwargs["margin"] = draw(st.floats(0, 0.9))
    return params, signals, previous, kwargs


@PROPERTY
@given(example=plan_examples())
def test_plan_precision(example):
    params, signals, previous, kwargs = example
    paths = set(trainable_leaves(params))
    if paths and set(signals) - paths and not set(signals) & paths:
        # Signals only for leaves the params lack: another model's, refused rather than
        # planning nothing.
        with pytest.raises(ValueError, match="no trainable leaf for"):
            triaccel_jax.plan_precision(signals, params, previous, **kwargs)
        return
    plan = triaccel_jax.plan_precision(signals, params, previous, **kwargs)
    policy = plan.policy
    leaves = trainable_leaves(params)
    assert set(policy) == set(leaves) == set(policy.reasons)
    allowed = {"fp32", *kwargs["allowed"]}
    patience = kwargs.get("patience", 2)
    cost, cheapest = {}, {}
    for path, x in leaves.items():
        compute, state = policy[path]
        values = as_f64(x)
        max_abs = float(np.max(np.abs(values)))
        if path in plan.pending:  # held by hysteresis
            proposed, streak = plan.pending[path]
            assert compute == previous.policy.compute(path) and proposed != compute
            assert 1 <= streak < patience
        else:
            assert compute in allowed, (path, compute, allowed)
            if compute == "fp16":
                assert max_abs * 4 <= FP16_MAX, (path, max_abs)
        expected_state = kwargs["state"]
        if expected_state == "auto":  # bf16 moments for leaves computing below fp32
            expected_state = "fp32" if compute == "fp32" else "bf16"
        assert state == expected_state
        if x.ndim <= 1 or x.size < kwargs["min_size"] or path not in signals:
            # vectors, small leaves and leaves without a signal stay fp32, hysteresis or not
            assert compute == "fp32", (path, policy.reasons[path])
            continue
        record = signals[path]
        sensitivity = max(record["mean_curvature"] * float(np.sum(values**2)), 1e-30) / (
            1 + min(record["noise_to_signal"], 1e3)
        )
        cost[path] = 0.0 if compute == "fp32" else unit_roundoff(compute) ** 2 / 6 * sensitivity
        in_range = [n for n in allowed if n != "fp16" or max_abs * 4 <= FP16_MAX]
        cheapest[path] = min(in_range, key=lambda n: (itemsize(n), unit_roundoff(n)))
    if kwargs["budget"] == 0 and (previous is None or patience == 1):
        assert {policy.compute(path) for path in policy} <= {"fp32"}, policy.table()
    if previous is None:
        assert not plan.pending
        loss = kwargs["loss"]
        if math.isinf(kwargs["budget"]):  # "inf lets every eligible leaf take the cheapest"
            assert {p: policy.compute(p) for p in cheapest} == cheapest, policy.table()
        else:
            allowance = kwargs["budget"] * (1.0 if loss is None else loss)
            assert sum(cost.values()) <= allowance * (1 + 1e-5), policy.table()


# -- (c) cast_params -----------------------------------------------------------------------------


@st.composite
def cast_examples(draw: Any) -> tuple[Any, PrecisionPolicy, str, int]:
    params = draw_tree(draw, draw(spec_trees()), bound=1e4)
    compute, state = st.sampled_from(COMPUTE), st.sampled_from(STATE)
    policy = PrecisionPolicy(
        tuple(
            (path, LeafPrecision(draw(compute), draw(state))) for path in trainable_leaves(params)
        )
    )
    return (
        params,
        policy,
        draw(st.sampled_from(["nearest", "stochastic"])),
        draw(st.integers(0, 2**31 - 1)),
    )


def rounding_bound(x: np.ndarray, source: Any, name: str, stochastic: bool) -> np.ndarray:
    """The largest error of rounding ``x`` (float64) to the format ``name``, per element."""
    if name == "fp32" or (name in JAX_DTYPE and jnp.dtype(source) == JAX_DTYPE[name]):
        return np.zeros_like(x)  # widening to fp32, or already in the format: exact
    ulps = 2.0 if stochastic else 1.0  # stochastic: within one ulp; nearest: half an ulp
    if name != "fp8_e4m3":
        info = jnp.finfo(JAX_DTYPE[name])
        # relative half ulp for normal numbers; half the subnormal spacing below them
        return ulps * (float(info.eps) / 2 * np.abs(x) + float(info.smallest_subnormal) / 2)
    # fp8: x / scale rounded to e4m3 (3 mantissa bits), scale = max|x| / 448; then the scale and
    # the product are rounded to bfloat16 (2**-8 each).
    info = jnp.finfo(jnp.float8_e4m3fn)
    scale = float(np.max(np.abs(x))) / float(info.max) or 1.0
    relative = ulps * float(info.eps) / 2 + 2 * 2.0**-8 + 2.0**-20
    return relative * np.abs(x) + ulps * float(info.smallest_subnormal) / 2 * scale * 1.01


@PROPERTY
@given(example=cast_examples())
def test_cast_params(example):
    params, policy, rounding, seed = example
    key = jax.random.key(seed) if rounding == "stochastic" else None
    compute = triaccel_jax.cast_params(params, policy, rounding=rounding, key=key)
    assert jax.tree.structure(compute) == jax.tree.structure(params)
    for (path, x), y in zip(with_paths(params), jax.tree.leaves(compute), strict=True):
        assert y.shape == x.shape
        if not trainable(x):
            assert y is x  # "others unchanged"
            continue
        name = policy.compute(path)
        assert y.dtype == (jnp.bfloat16 if name == "fp8_e4m3" else JAX_DTYPE[name])  # fp8 in bf16
        values = as_f64(x)
        error = np.abs(as_f64(y) - values)
        bound = rounding_bound(values, x.dtype, name, rounding == "stochastic")
        assert np.all(error <= bound), (path, x.dtype, name, values, as_f64(y), bound)


# -- (d) the policy's JSON -----------------------------------------------------------------------

ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
paths = st.text(max_size=12)


@PROPERTY
@given(
    leaves=st.dictionaries(
        paths,
        st.tuples(st.sampled_from([*COMPUTE, *ALIASES]), st.sampled_from([*STATE, "bfloat16"])),
        max_size=6,
    ),
    reasons=st.dictionaries(paths, st.text(max_size=30), max_size=6),
    as_bytes=st.booleans(),
)
def test_policy_json_round_trip(leaves, reasons, as_bytes):
    policy = PrecisionPolicy(
        tuple((path, LeafPrecision(*value)) for path, value in leaves.items()), reasons
    )
    assert dict(policy.leaves) == {
        path: LeafPrecision(ALIASES.get(c, c), ALIASES.get(s, s)) for path, (c, s) in leaves.items()
    }
    text = policy.to_json()
    back = PrecisionPolicy.from_json(text.encode() if as_bytes else text)
    assert back == policy and hash(back) == hash(policy) and back.signature == policy.signature
    assert back.leaves == policy.leaves
    assert back.reasons == reasons
    assert back.to_json() == text
