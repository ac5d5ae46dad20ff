"""``quantize_state``: any optimizer's state in bfloat16 or 8-bit blocks, and what it composes with.

The shared checks (jit against eager, cond, no recompilation, masked, MultiSteps, apply_if_finite,
inject_hyperparams, the controller) run on the harness variant ``int8-state-adamw``; these tests
cover the state's layout, the numbers, the compositions the harness does not (the wrapper over
an injected optimizer, orbax, Muon), the compiled bytes and the errors.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax.controller._learning_rate import find_hyperparam
from triaccel_jax.controller._learning_rate import set_hyperparam
from triaccel_jax.transforms import Bfloat16Leaf
from triaccel_jax.transforms import QuantizedLeaf
from triaccel_jax.transforms import QuantizedState
from triaccel_jax.transforms import compiled_state_bytes
from triaccel_jax.transforms import quantize_state

pytestmark = pytest.mark.standard_promotion(
    "optax's own optimizers promote inside (a float to the power of an int32 count)"
)


def make_params(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return {
        "dense": {
            "kernel": jax.random.normal(keys[0], (40, 30)) * 0.1,
            "bias": jnp.zeros((30,)),
        },
        "out": jax.random.normal(keys[1], (30, 5)) * 0.1,
    }


def grads_like(params, seed):
    keys = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params)))
    leaves, treedef = jax.tree.flatten(params)
    grads = [
        jax.random.normal(k, p.shape) * jnp.exp(jax.random.normal(k, p.shape))
        for k, p in zip(keys, leaves, strict=True)
    ]
    return treedef.unflatten(grads)


def run(tx, params, steps, seed=0):
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(steps):
        updates, state = update(grads_like(params, seed + step), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


# -- the state's layout --------------------------------------------------------------------------


def test_adamw_moments_are_stored_as_codes_and_the_rest_as_the_inner_keeps_it():
    params = make_params()
    state = quantize_state(optax.adamw(1e-2), block_size=64, min_size=100).init(params)
    assert isinstance(state, QuantizedState)
    adam = state.inner_state[0]
    for moment, mapping, dtype in (("mu", "linear", jnp.int8), ("nu", "sqrt", jnp.uint8)):
        kernel = getattr(adam, moment)["dense"]["kernel"]
        assert isinstance(kernel, QuantizedLeaf)
        assert (kernel.mapping, kernel.dtype) == (mapping, "float32")
        chex.assert_shape(kernel.codes, (40, 30))
        chex.assert_type(kernel.codes, dtype)
        # Blocks along the last axis: one per row of 30 (shorter than the block of 64), so the
        # scales split along the rows as a sharded kernel does.
        assert kernel.layout == "rows"
        chex.assert_shape(kernel.scales, (40, 1))
        # The 30-element bias is under min_size: the inner's float32.
        chex.assert_type(getattr(adam, moment)["dense"]["bias"], jnp.float32)
    chex.assert_type(adam.count, jnp.int32)
    chex.assert_shape(state.key, (2,))
    chex.assert_type(state.key, jnp.uint32)


@pytest.mark.parametrize(
    "inner", [optax.contrib.prodigy(), optax.contrib.dadapt_adamw()], ids=["prodigy", "dadapt"]
)
def test_optax_contribs_second_moments_take_the_zero_free_map(inner):
    # Prodigy's and D-Adaptation's Adam keep their second moment as `exp_avg_sq`: on the linear
    # map its small entries round to 0 and the update divides by epsilon alone.
    state = quantize_state(inner, min_size=100).init(make_params())
    stored = state.inner_state
    assert stored.exp_avg_sq["dense"]["kernel"].mapping == "sqrt"
    assert stored.exp_avg["dense"]["kernel"].mapping == "linear"


@pytest.mark.parametrize(
    "names",
    [("nu",), ["nu"], (n for n in ["nu"]), iter(["nu"])],
    ids=["tuple", "list", "gen", "iter"],
)
def test_second_moments_may_be_any_iterable_of_names(names):
    state = quantize_state(optax.adam(1e-3), min_size=100, second_moments=names).init(make_params())
    assert state.inner_state[0].nu["dense"]["kernel"].mapping == "sqrt"


def test_numpy_integers_are_ints_and_a_seed_out_of_range_is_named_when_built():
    params = make_params()
    state = quantize_state(optax.adam(1e-3), min_size=np.int64(100), seed=np.int32(3)).init(params)
    assert isinstance(state.inner_state[0].mu["dense"]["kernel"], QuantizedLeaf)
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            quantize_state(optax.adam(1e-3), seed=seed)


def test_bf16_and_fp32_formats():
    params = make_params()
    state = quantize_state(optax.adamw(1e-2), format="bf16", min_size=100).init(params)
    mu = state.inner_state[0].mu["dense"]["kernel"]
    assert isinstance(mu, Bfloat16Leaf) and mu.value.dtype == jnp.bfloat16 and mu.dtype == "float32"
    fp32 = quantize_state(optax.adamw(1e-2), format="fp32", min_size=100).init(params)
    chex.assert_trees_all_equal(fp32.inner_state, optax.adamw(1e-2).init(params))


def test_the_state_keeps_its_shapes_and_dtypes_and_the_step_compiles_once(count_compiles):
    tx = quantize_state(optax.adamw(1e-2), block_size=64, min_size=100)
    params = make_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    _, new_state = update(grads_like(params, 0), state, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(state, new_state)
    assert jax.tree.structure(state) == jax.tree.structure(new_state)
    with count_compiles() as counter:
        for step in range(1, 4):
            _, new_state = update(grads_like(params, step), new_state, params)
        jax.block_until_ready(new_state)
    assert counter.count == 0
    assert int(new_state.count) == 4


# -- the numbers ---------------------------------------------------------------------------------


def test_the_first_update_is_adamws_and_fp32_state_is_adamw_exactly():
    params = make_params()
    grads = grads_like(params, 0)
    reference, _ = optax.adamw(1e-2).update(grads, optax.adamw(1e-2).init(params), params)
    tx = quantize_state(optax.adamw(1e-2), block_size=64, min_size=100)
    first, _ = tx.update(grads, tx.init(params), params)
    chex.assert_trees_all_close(first, reference, rtol=1e-6, atol=0)
    fp32, _ = run(quantize_state(optax.adamw(1e-2), format="fp32"), params, 5)
    plain, _ = run(optax.adamw(1e-2), params, 5)
    chex.assert_trees_all_equal(fp32, plain)


@pytest.mark.parametrize(
    ("fmt", "rounding"), [("bf16", "stochastic"), ("int8", "nearest"), ("int8", "stochastic")]
)
def test_moments_stay_close_to_float32_adamws(fmt, rounding):
    params = make_params()
    _, plain = run(optax.adamw(1e-2), params, 20)
    tx = quantize_state(optax.adamw(1e-2), format=fmt, rounding=rounding, min_size=100)
    _, stored = run(tx, params, 20)
    for moment in ("mu", "nu"):
        exact = getattr(plain[0], moment)["dense"]["kernel"]
        node = getattr(stored.inner_state[0], moment)["dense"]["kernel"]
        if fmt == "bf16":
            value = node.value.astype(jnp.float32)
        else:
            value = triaccel_jax.kernels.quantize.dequantize_blocks(
                node.codes, node.scales, block_size=256, mapping=node.mapping, layout=node.layout
            )
        # Relative to the moment's scale: 20 steps of re-quantization each step.
        scale = float(jnp.max(jnp.abs(exact)))
        assert float(jnp.max(jnp.abs(value - exact))) < (0.03 if fmt == "int8" else 0.01) * scale


def test_the_same_seed_gives_the_same_state_and_another_seed_another():
    params = make_params()

    def stochastic(seed):
        return quantize_state(optax.adamw(1e-2), rounding="stochastic", min_size=100, seed=seed)

    a = run(stochastic(1), params, 3)[1]
    b = run(stochastic(1), params, 3)[1]
    c = run(stochastic(2), params, 3)[1]
    chex.assert_trees_all_equal(a, b)
    codes_a, codes_c = (np.asarray(s.inner_state[0].mu["dense"]["kernel"].codes) for s in (a, c))
    assert np.any(codes_a != codes_c)


def _classification_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 20)).astype(np.float32)
    teacher = rng.normal(size=(20, 4)).astype(np.float32)
    y = np.argmax(np.tanh(x @ teacher) + 0.3 * rng.normal(size=(512, 4)), axis=1)
    return jnp.asarray(x), jnp.asarray(y)


def _mlp_loss(params, x, y):
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _train(tx, steps=300):
    x, y = _classification_data()
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        "w1": jax.random.normal(keys[0], (20, 256)) * 0.2,
        "b1": jnp.zeros(256),
        "w2": jax.random.normal(keys[1], (256, 4)) * 0.05,
        "b2": jnp.zeros(4),
    }
    state = tx.init(params)

    @jax.jit
    def step(params, state, i):
        batch = jax.random.choice(jax.random.fold_in(jax.random.key(1), i), 512, (64,))
        loss, grads = jax.value_and_grad(_mlp_loss)(params, x[batch], y[batch])
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    for i in range(steps):
        params, state, _ = step(params, state, i)
    return float(_mlp_loss(params, x, y))


def test_8bit_adamw_trains_a_small_model_as_well_as_float32_adamw():
    fp32 = _train(optax.adamw(3e-3))
    int8 = _train(quantize_state(optax.adamw(3e-3), block_size=64, min_size=256))
    bf16 = _train(quantize_state(optax.adamw(3e-3), format="bf16", min_size=256))
    first = _mlp_loss(
        {"w1": jnp.zeros((20, 256)), "b1": jnp.zeros(256), "w2": jnp.zeros((256, 4)),
         "b2": jnp.zeros(4)},
        *_classification_data(),
    )  # fmt: skip
    assert fp32 < 0.5 * float(first)  # it trained
    assert int8 <= fp32 * 1.05 + 0.01, (int8, fp32)
    assert bf16 <= fp32 * 1.05 + 0.01, (bf16, fp32)


def test_muon_momentum_is_stored_and_muon_still_trains():
    tx = quantize_state(
        optax.contrib.muon(0.02, adam_learning_rate=3e-3), block_size=64, min_size=256
    )
    params = {
        "w1": jnp.zeros((20, 256)),
        "b1": jnp.zeros(256),
        "w2": jnp.zeros((256, 4)),
        "b2": jnp.zeros(4),
    }
    is_stored = lambda node: isinstance(node, QuantizedLeaf)
    stored = [n for n in jax.tree.leaves(tx.init(params), is_leaf=is_stored) if is_stored(n)]
    # Muon's momentum of both matrices, and Adam's moments (the fallback) of the 256 biases; the
    # 4 biases are under min_size.
    assert sorted((n.codes.shape, n.mapping) for n in stored) == [
        ((20, 256), "linear"),
        ((256,), "linear"),
        ((256,), "sqrt"),
        ((256, 4), "linear"),
    ]
    # 100 steps take both from 1.39 to 0.17. Trained on to 300, both fit the training set (0.007
    # in float32, 0.021 with the 8-bit momentum): there the quantized momentum's noise floor shows.
    fp32 = _train(optax.contrib.muon(0.02, adam_learning_rate=3e-3), steps=100)
    int8 = _train(tx, steps=100)
    assert int8 <= fp32 * 1.05 + 0.01, (int8, fp32)


# -- the update, group by group -----------------------------------------------------------------


def _plain_update(tx_options, inner, grads, state, params):
    """What quantize_state's update computes, written out plainly: every stored leaf loaded, the
    inner update, every leaf stored again (stochastically with its own key: the wrapper's key
    folded with the step, then with the leaf's index)."""
    quantize = triaccel_jax.kernels.quantize
    is_stored = lambda n: isinstance(n, QuantizedLeaf | Bfloat16Leaf)
    nodes, treedef = jax.tree_util.tree_flatten(state.inner_state, is_leaf=is_stored)
    block_size = tx_options.get("block_size", 256)
    stochastic = tx_options.get("rounding") == "stochastic"

    def load(node):
        if isinstance(node, QuantizedLeaf):
            return quantize.dequantize_blocks(
                node.codes,
                node.scales,
                block_size=block_size,
                mapping=node.mapping,
                layout=node.layout,
            )
        return node.value.astype(jnp.float32) if isinstance(node, Bfloat16Leaf) else node

    # The inner update traced and evaluated as traced, as quantize_state evaluates it: eagerly,
    # jnp.power takes a concrete exponent (optax's bias correction's count) as an integer power.
    loaded = treedef.unflatten([load(n) for n in nodes])
    closed, shapes = jax.make_jaxpr(inner.update, return_shape=True)(grads, loaded, params)
    flat = jax.core.eval_jaxpr(
        closed.jaxpr, closed.consts, *jax.tree.leaves((grads, loaded, params))
    )
    updates, new = jax.tree.unflatten(jax.tree.structure(shapes), flat)
    step = quantize.fold_in(state.key, state.count)
    stored = []
    for index, (old, value) in enumerate(zip(nodes, jax.tree.leaves(new), strict=True)):
        key = quantize.fold_in(step, index) if stochastic else None
        rounding = "stochastic" if stochastic else "nearest"
        if isinstance(old, QuantizedLeaf):
            codes, scales = quantize.quantize_blocks(
                value,
                block_size=block_size,
                mapping=old.mapping,
                rounding=rounding,
                key=key,
                layout=old.layout,
            )
            stored.append(
                QuantizedLeaf(codes, scales, old.mapping, old.dtype, block_size, None, old.layout)
            )
        elif isinstance(old, Bfloat16Leaf):
            bits = quantize.random_bits(key, value.shape) if stochastic else None
            narrow = (
                triaccel_jax.kernels.cast.round_stochastic(value, jnp.bfloat16, bits)
                if stochastic
                else value.astype(jnp.bfloat16)
            )
            stored.append(Bfloat16Leaf(narrow, old.dtype))
        else:
            stored.append(value)
    return updates, treedef.unflatten(stored)


def _global_moment_norm():
    # An inner that reads all of its moments together: the squared norm of every new moment
    # scales the updates, so every stored leaf is in one group.
    def init(params):
        return {"m": jax.tree.map(jnp.zeros_like, params)}

    def update(updates, state, params=None):
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["m"], updates)
        norm = sum(jnp.sum(x * x) for x in jax.tree.leaves(m))
        return jax.tree.map(lambda x: x / (1.0 + norm), m), {"m": m}

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.adamw(1e-2),
        lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
        lambda: optax.lion(1e-3),
        _global_moment_norm,
    ],
    ids=["adamw", "clipped-adam", "lion", "global-moment-norm"],
)
@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_the_update_group_by_group_is_the_plain_update_bit_for_bit(make, rounding, fmt):
    options = {"format": fmt, "rounding": rounding, "block_size": 64, "min_size": 100}
    tx = quantize_state(make(), **options)
    params = make_params()
    state = tx.init(params)
    with jax.disable_jit():  # one operation at a time in both: the same arithmetic
        for step in range(3):
            grads = grads_like(params, step)
            expected = _plain_update(options, make(), grads, state, params)
            updates, state = tx.update(grads, state, params)
            chex.assert_trees_all_equal(updates, expected[0])
            chex.assert_trees_all_equal(state.inner_state, expected[1])


def test_a_leaf_the_inner_returns_unchanged_is_kept_as_stored():
    # Stored again, a stochastically rounded leaf would move by a level at every step.
    def init(params):
        return {"frozen": jax.tree.map(jnp.ones_like, params)}

    inner = optax.GradientTransformation(init, lambda updates, state, params=None: (updates, state))
    tx = quantize_state(inner, rounding="stochastic", block_size=64, min_size=100)
    params = make_params()
    state = tx.init(params)
    _, new = jax.jit(tx.update)(grads_like(params, 0), state, params)
    chex.assert_trees_all_equal(new.inner_state, state.inner_state)


def test_an_inner_update_with_side_effects_runs_them_in_order():
    printed = []

    def update(updates, state, params=None):
        jax.debug.callback(lambda: printed.append("before"))
        new = jax.tree.map(lambda m, g: 0.9 * m + g, state, updates)
        jax.debug.callback(lambda: printed.append("after"))
        return new, new

    inner = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)
    tx = quantize_state(inner, block_size=64, min_size=100)
    params = make_params()
    updates, _ = jax.jit(tx.update)(grads_like(params, 0), tx.init(params), params)
    jax.effects_barrier()
    assert printed == ["before", "after"]
    expected = _plain_update(
        {"block_size": 64}, inner, grads_like(params, 0), tx.init(params), params
    )
    chex.assert_trees_all_close(updates, expected[0], rtol=1e-6)


def _update_peak_bytes(tx, params):
    """XLA's predicted peak of the jitted update with the state donated, as a training step
    runs it: temp + argument + output - alias bytes."""
    abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    state = jax.eval_shape(tx.init, abstract)
    compiled = jax.jit(tx.update, donate_argnums=1).lower(abstract, state, abstract).compile()
    return triaccel_jax.precision.compiled_peak_bytes(compiled)


@pytest.mark.parametrize(
    ("fmt", "rounding"), [("int8", "nearest"), ("int8", "stochastic"), ("bf16", "stochastic")]
)
def test_the_updates_compiled_peak_is_at_most_float32_adamws(fmt, rounding):
    # Loaded all at once, the four leaves' moments lived in float32 together beside the stored
    # ones, and the int8 update's peak was 1.09x fp32 AdamW's; group by group, one leaf's at a
    # time (0.75x).
    params = {f"w{i}": jnp.zeros((512, 512)) for i in range(4)}
    fp32 = _update_peak_bytes(optax.adamw(1e-3), params)
    stored = _update_peak_bytes(
        quantize_state(optax.adamw(1e-3), format=fmt, rounding=rounding), params
    )
    assert stored <= fp32, (stored / fp32, fmt, rounding)


# -- compositions --------------------------------------------------------------------------------


def test_an_injected_learning_rate_stays_findable_and_settable_inside_the_wrapper():
    params = make_params()
    grads = grads_like(params, 0)
    inner = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)
    tx = quantize_state(inner, min_size=100)
    state = tx.init(params)
    found = find_hyperparam(state, "learning_rate")
    assert found is not None and found.value == pytest.approx(1e-2)
    assert state.inner_state.hyperparams["learning_rate"].dtype == jnp.float32  # not converted
    zero = set_hyperparam(state, "learning_rate", 0.0)
    updates, new_state = jax.jit(tx.update)(grads, zero, params)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
    assert find_hyperparam(new_state, "learning_rate").value == 0.0


def test_inject_hyperparams_over_a_factory_that_builds_the_wrapper():
    params = make_params()
    factory = optax.inject_hyperparams(
        lambda learning_rate: quantize_state(optax.adamw(learning_rate), min_size=100)
    )
    tx = factory(learning_rate=1e-2)
    state = tx.init(params)
    assert find_hyperparam(state, "learning_rate").value == pytest.approx(1e-2)
    _, state = jax.jit(tx.update)(grads_like(params, 0), state, params)
    assert isinstance(state.inner_state, QuantizedState)
    scaled, _ = jax.jit(tx.update)(
        grads_like(params, 0), set_hyperparam(state, "learning_rate", 0.0), params
    )
    chex.assert_trees_all_equal(scaled, jax.tree.map(jnp.zeros_like, scaled))


def test_extra_arguments_reach_the_inner_optimizer():
    seen = []

    def update(updates, state, params=None, *, value_fn):
        seen.append(value_fn)
        return updates, state

    inner = optax.GradientTransformationExtraArgs(lambda params: (), update)
    tx = quantize_state(inner)
    tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}), value_fn="loss")
    assert seen == ["loss"]


def test_multisteps_accumulates_over_the_wrapper():
    params = make_params()
    tx = optax.MultiSteps(quantize_state(optax.adamw(1e-2), min_size=100), every_k_schedule=2)
    state = tx.init(params)
    update = jax.jit(tx.update)
    first, state = update(grads_like(params, 0), state, params)
    chex.assert_trees_all_equal(first, jax.tree.map(jnp.zeros_like, first))
    second, state = update(grads_like(params, 1), state, params)
    assert all(float(jnp.max(jnp.abs(u))) > 0 for u in jax.tree.leaves(second))
    assert int(state.inner_opt_state.count) == 1


def test_the_curvature_signals_state_is_never_converted():
    params = make_params()
    tx = quantize_state(
        optax.chain(triaccel_jax.curvature_signals(), optax.adamw(1e-2)), min_size=100
    )
    _, state = run(tx, params, 3)
    assert set(triaccel_jax.signals(state)) == {"dense/bias", "dense/kernel", "out"}
    assert isinstance(state.inner_state[1][0].mu["dense"]["kernel"], QuantizedLeaf)


def test_bfloat16_params_keep_bfloat16_updates_and_state():
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), make_params())
    tx = quantize_state(optax.adamw(1e-2), min_size=100)
    state = tx.init(params)
    assert state.inner_state[0].mu["dense"]["kernel"].dtype == "bfloat16"
    grads = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads_like(params, 0))
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    chex.assert_trees_all_equal_dtypes(updates, grads)
    chex.assert_trees_all_equal_shapes_and_dtypes(state, new_state)


def test_a_checkpoint_round_trip_of_the_quantized_state_is_exact(tmp_path):
    params = make_params()
    tx = quantize_state(optax.adamw(1e-2), block_size=64, min_size=100)
    params, state = run(tx, params, 3)
    with triaccel_jax.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(3, {"params": params, "opt_state": state})
        template = jax.tree.map(jnp.zeros_like, {"params": params, "opt_state": state})
        restored, _ = checkpointer.restore(template)
    chex.assert_trees_all_equal(restored["opt_state"], state)
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(state)
    # Training on from the restored state is training on from the saved one.
    grads = grads_like(params, 9)
    chex.assert_trees_all_equal(
        tx.update(grads, restored["opt_state"], params), tx.update(grads, state, params)
    )


def test_the_controller_trains_with_an_8bit_state_as_with_float32():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype(np.float32)
    data = (x, (x @ rng.normal(size=(64, 8))).astype(np.float32))

    def loss(params, batch, *, policy, rng):
        inputs, targets = batch
        return jnp.mean((inputs @ params["kernel"] - targets) ** 2)

    def train(tx):
        controller = triaccel_jax.Controller(
            loss, {"kernel": jnp.zeros((64, 8))}, tx, data,
            min_batch=32, max_batch=32, probe=triaccel_jax.BudgetMemoryProbe(2**30),
        )  # fmt: skip
        losses = [info.loss for info in controller.run(60)]
        return np.mean(losses[:5]), np.mean(losses[-5:])

    start, fp32 = train(optax.adamw(3e-2))
    _, int8 = train(quantize_state(optax.adamw(3e-2), block_size=64, min_size=256))
    assert fp32 < 0.2 * start  # 60.5 to 6.7
    assert int8 <= 1.05 * fp32, (int8, fp32)


# -- per-leaf formats ----------------------------------------------------------------------------


def test_a_mapping_chooses_the_format_per_parameter():
    params = make_params()
    tx = quantize_state(
        optax.adamw(1e-2), format={"dense/kernel": "int8", "out": "bf16"}, min_size=100
    )
    adam = tx.init(params).inner_state[0]
    assert isinstance(adam.mu["dense"]["kernel"], QuantizedLeaf)
    assert isinstance(adam.nu["out"], Bfloat16Leaf)
    assert adam.mu["dense"]["bias"].dtype == jnp.float32  # no entry: as the inner keeps it


def test_a_callable_chooses_the_format_per_state_leaf():
    asked = []

    def choose(path, leaf):
        asked.append(path)
        return "int8" if path.endswith("mu/out") else None

    params = make_params()
    adam = quantize_state(optax.adamw(1e-2), format=choose, min_size=100).init(params)
    adam = adam.inner_state[0]
    assert isinstance(adam.mu["out"], QuantizedLeaf)
    assert adam.nu["out"].dtype == jnp.float32
    # Asked about the leaves it could store only: not the count, not the small biases.
    assert asked == ["0/mu/dense/kernel", "0/mu/out", "0/nu/dense/kernel", "0/nu/out"]


# -- compiled bytes ------------------------------------------------------------------------------


def _cnn_sized_params():
    # The small CNN's leaves (triaccel_jax.models.SmallCNN on 28x28x1 inputs, 421,642 params).
    shapes = {
        "Conv_0": {"kernel": (3, 3, 1, 32), "bias": (32,)},
        "Conv_1": {"kernel": (3, 3, 32, 64), "bias": (64,)},
        "Dense_0": {"kernel": (3136, 128), "bias": (128,)},
        "Dense_1": {"kernel": (128, 10), "bias": (10,)},
    }
    return jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32),
        shapes,
        is_leaf=lambda node: isinstance(node, tuple),
    )


@pytest.mark.parametrize(
    ("name", "make", "fp32", "bf16", "int8"),
    [
        ("adamw", lambda: optax.adamw(1e-3), 12.0, 8.02, 6.09),
        (
            "muon",
            lambda: optax.contrib.muon(
                0.02,
                adam_learning_rate=1e-3,
                muon_weight_dimension_numbers=triaccel_jax.transforms.muon_dimension_numbers,
            ),
            8.0,
            6.01,
            5.05,
        ),
    ],
)
def test_compiled_bytes_per_parameter_drop_with_the_state_format(name, make, fp32, bf16, int8):
    params = _cnn_sized_params()
    measured = {
        fmt: compiled_state_bytes(quantize_state(make(), format=fmt), params)
        for fmt in ("fp32", "bf16", "int8")
    }
    assert measured["fp32"].parameters == 421_642
    for fmt, expected in (("fp32", fp32), ("bf16", bf16), ("int8", int8)):
        assert measured[fmt].bytes_per_parameter == pytest.approx(expected, abs=0.01), (name, fmt)
    # XLA's figure is the arithmetic of the state's dtypes: no hidden copy, no padding.
    state = jax.eval_shape(quantize_state(make(), format="int8").init, params)
    exact = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
    assert measured["int8"].state_bytes == exact


@pytest.mark.parametrize(("block_size", "min_size"), [(256, 4096), (2048, 256), (64, 0)])
def test_the_compiled_bytes_are_the_registrys_count_of_each_leaf(block_size, min_size):
    # What the planner prices (policy.StateFormat.leaf_bytes: blocks along the last axis, the
    # scales of short rows included) is what XLA compiles, whatever the block and minimum size.
    params = _cnn_sized_params()
    tx = quantize_state(optax.adamw(1e-3), block_size=block_size, min_size=min_size)
    int8 = triaccel_jax.policy.state_format("int8")
    expected = 0
    for leaf in jax.tree.leaves(params):
        if leaf.size >= min_size:
            expected += int8.leaf_bytes(leaf.shape, 4, block_size=block_size)
            expected += int8.leaf_bytes(leaf.shape, 4, second_moment=True, block_size=block_size)
        else:
            expected += 2 * 4 * leaf.size
    measured = compiled_state_bytes(tx, params)
    # Beside the moments: Adam's count, the wrapper's count and its key (4 + 4 + 8 bytes).
    assert measured.state_bytes == expected + 16


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"format": "int3"}, ValueError, "format"),
        ({"format": {"dense/kernel": "fp8"}}, ValueError, "dense/kernel"),
        ({"format": {1: "int8"}}, TypeError, "parameter paths"),
        ({"format": 8}, TypeError, "format"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": 64.0}, TypeError, "block_size"),
        ({"block_size": "64"}, TypeError, "block_size"),
        ({"min_size": -1}, ValueError, "min_size"),
        ({"min_size": 1.5}, TypeError, "min_size"),
        ({"seed": 0.5}, TypeError, "seed"),
        ({"second_moments": "nu"}, TypeError, "second_moments"),
        ({"impl": "pallas"}, ValueError, "impl"),
        ({"rounding": "up"}, ValueError, "rounding"),
        ({"rounding": ["nearest"]}, ValueError, "rounding"),
    ],
)
def test_bad_options_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        quantize_state(optax.adamw(1e-3), **kwargs)


def test_a_non_float_leaf_asked_to_be_quantized_is_an_error():
    def init(params):
        return {"visits": jnp.zeros((5000,), jnp.int32), "ema": jnp.zeros((5000,))}

    inner = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
    # Named in a mapping: an error naming the leaf.
    with pytest.raises(ValueError, match="'visits' is int32"):
        quantize_state(inner, format={"visits": "bf16"}).init({})
    # A callable is asked about the float leaves only, so "int8" for everything is a format for
    # everything that can take it, as the string is.
    state = quantize_state(inner, format=lambda path, leaf: "int8").init({})
    assert state.inner_state["visits"].dtype == jnp.int32
    assert isinstance(state.inner_state["ema"], QuantizedLeaf)
    # A format for the whole state converts the float leaves and leaves integers alone.
    state = quantize_state(inner).init({})
    assert state.inner_state["visits"].dtype == jnp.int32
    assert isinstance(state.inner_state["ema"], QuantizedLeaf)


def test_a_callable_returning_an_unknown_format_is_an_error():
    tx = quantize_state(optax.adamw(1e-3), format=lambda path, leaf: "int3", min_size=100)
    with pytest.raises(ValueError, match="format"):
        tx.init(make_params())


# -- states whose fields combine ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "bf16", "fp32"])
def test_centered_rmsprop_stays_finite_where_its_variance_is_small(fmt):
    # Gradients within 10% of a fixed one: nu - mu**2 is a few percent of nu. Rounded
    # independently, mu**2 came out above nu and rsqrt(nu - mu**2 + eps) was NaN (int8 from the
    # 4th step, bf16 from the 36th). The centered variance is stored instead, clamped at 0, so
    # what the update reads is never negative. (float32 state: the reference, finite too.)
    params = make_params()
    tx = quantize_state(optax.rmsprop(1e-3, centered=True), format=fmt, block_size=64, min_size=100)
    state = tx.init(params)
    update = jax.jit(tx.update)
    base = grads_like(params, 0)
    for step in range(60):
        noise = grads_like(params, 100 + step)
        grads = jax.tree.map(lambda b, n: b * (1 + 0.1 * jnp.tanh(n)), base, noise)
        updates, state = update(grads, state, params)
        assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates)), step


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
@pytest.mark.parametrize("bias_correction", [False, True], ids=["plain", "bias-corrected"])
def test_centered_rmsprop_follows_float32_rmsprop(fmt, bias_correction):
    params = make_params()

    def make():
        return optax.rmsprop(1e-3, centered=True, bias_correction=bias_correction)

    tx = quantize_state(make(), format=fmt, block_size=64, min_size=100)
    state, plain = tx.init(params), make().init(params)
    for step in range(30):
        grads = grads_like(params, step)
        updates, state = tx.update(grads, state, params)
        expected, plain = make().update(grads, plain, params)
    error = optax.tree.norm(jax.tree.map(jnp.subtract, updates, expected))
    assert float(error) < 0.05 * float(optax.tree.norm(expected))


def test_the_centered_variance_is_stored_with_the_zero_free_map():
    tx = quantize_state(optax.rmsprop(1e-3, centered=True), block_size=64, min_size=100)
    stored = tx.init(make_params()).inner_state[0]
    assert isinstance(stored, triaccel_jax.transforms.CenteredState)
    assert stored.state.mu["dense"]["kernel"].mapping == "linear"
    assert stored.state.nu["dense"]["kernel"].mapping == "sqrt"
    # fp32 state stores nothing, so nothing is centered: the inner's state exactly.
    fp32 = quantize_state(optax.rmsprop(1e-3, centered=True), format="fp32").init(make_params())
    assert isinstance(fp32.inner_state[0], optax.ScaleByRStdDevState)


# -- second moments found by role ----------------------------------------------------------------


def test_adafactors_second_moments_take_the_zero_free_map():
    # (256, 300) is factored into v_row (256,) and v_col (300,); (5000,) keeps a full v.
    params = {"matrix": jnp.ones((256, 300)), "vector": jnp.ones((5000,))}
    state = quantize_state(optax.adafactor(1e-3), min_size=200).init(params)
    factored = next(
        node
        for node in jax.tree.leaves(
            state.inner_state, is_leaf=lambda n: isinstance(n, optax.FactoredState)
        )
        if isinstance(node, optax.FactoredState)
    )
    assert factored.v_row["matrix"].mapping == "sqrt"
    assert factored.v_col["matrix"].mapping == "sqrt"
    assert factored.v["vector"].mapping == "sqrt"


def test_a_dict_held_second_moment_takes_the_zero_free_map():
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return {"m": zeros, "v": zeros}

    def update(updates, state, params=None):
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["m"], updates)
        v = jax.tree.map(lambda v, g: 0.99 * v + 0.01 * g * g, state["v"], updates)
        return jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + 1e-8), m, v), {"m": m, "v": v}

    tx = quantize_state(optax.GradientTransformation(init, update), min_size=100)
    state = tx.init(make_params())
    assert state.inner_state["v"]["dense"]["kernel"].mapping == "sqrt"
    assert state.inner_state["m"]["dense"]["kernel"].mapping == "linear"


@pytest.mark.parametrize(
    ("make", "get", "expected"),
    [
        # SM3's `mu` holds its non-negative accumulators and `nu` its signed momentum: by name
        # the momentum took the unsigned map and lost its sign.
        (lambda: optax.sm3(1e-2), lambda s: s[0].nu["dense"]["kernel"], "linear"),
        (lambda: optax.sm3(1e-2), lambda s: s[0].mu["out"][0], "sqrt"),
        (lambda: optax.adadelta(1e-2), lambda s: s[1].e_g["dense"]["kernel"], "sqrt"),
        (lambda: optax.adadelta(1e-2), lambda s: s[1].e_x["dense"]["kernel"], "sqrt"),
        (lambda: optax.adan(1e-2), lambda s: s[0].n["dense"]["kernel"], "sqrt"),
        (lambda: optax.adan(1e-2), lambda s: s[0].v["dense"]["kernel"], "linear"),
        (lambda: optax.adabelief(1e-2), lambda s: s[0].nu["dense"]["kernel"], "sqrt"),
    ],
    ids=["sm3-nu", "sm3-mu", "adadelta-e_g", "adadelta-e_x", "adan-n", "adan-v", "adabelief"],
)
def test_optax_states_second_moments_are_found_by_their_type(make, get, expected):
    state = quantize_state(make(), min_size=10, block_size=64).init(make_params())
    assert get(state.inner_state).mapping == expected


# -- clear errors, raised early ------------------------------------------------------------------


def test_a_format_path_that_names_no_leaf_is_refused_naming_the_nearest():
    tx = quantize_state(optax.adamw(1e-2), format={"dense/kernal": "int8", "out": "bf16"})
    with pytest.raises(ValueError, match=r"'dense/kernal'.*'dense/kernel'"):
        tx.init(make_params())


def test_a_callable_format_is_asked_only_about_leaves_it_can_store():
    asked = []

    def every(path, leaf):
        asked.append(path)
        return "int8"

    params = make_params()
    tx = quantize_state(optax.adamw(1e-2), format=every, min_size=100)
    state = tx.init(params)
    assert "0/count" not in asked and "0/mu/dense/bias" not in asked  # an int; under min_size
    assert isinstance(state.inner_state[0].mu["dense"]["kernel"], QuantizedLeaf)
    chex.assert_type(state.inner_state[0].count, jnp.int32)
    updates, _ = tx.update(grads_like(params, 0), state, params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("factory", [optax.adam, optax.contrib.muon], ids=["adam", "muon"])
def test_a_factory_in_place_of_a_transformation_is_refused_when_built(factory):
    with pytest.raises(TypeError, match=r"call it.*\(1e-3\)"):
        quantize_state(factory)
    with pytest.raises(TypeError, match="GradientTransformation"):
        quantize_state("adam")
