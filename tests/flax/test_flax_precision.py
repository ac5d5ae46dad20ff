"""The Linen interceptor: each layer really computes, and saves residuals, in its policy dtype.

The assertions read the jaxpr of ``jax.grad`` of a loss: which ``dot_general`` /
``conv_general_dilated`` equations run with which operand dtypes, and the dtypes of the residuals
``jax.vjp`` saves.
"""

from __future__ import annotations

import collections

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jex_core
from jax_versions import exact_residuals

import triaccel_jax
from triaccel_jax.flax._precision import apply_with_policy
from triaccel_jax.flax._precision import precision_interceptor

BF16, F32 = "bfloat16", "float32"


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(16, name="hidden")(x))
        return nn.Dense(4, name="out")(h)


class _ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Conv(6, (3, 3), name="conv")(x))
        return nn.Dense(4, name="out")(h.reshape(h.shape[0], -1))


class _SetupScale(nn.Module):
    """A module that reads its own parameter in ``setup``, next to a child layer."""

    def setup(self):
        self.dense = nn.Dense(4)
        # (1, 4), not (4,): a module owning only vectors would follow its input's dtype instead.
        self.scale = self.param("scale", nn.initializers.ones, (1, 4))

    def __call__(self, x):
        return self.dense(x) * self.scale


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jex_core.jaxprs_in_params(eqn.params):
            yield from _equations(getattr(sub, "jaxpr", sub))


def _ops(fn, *args, primitive="dot_general"):
    """Counter of operand dtypes of every ``primitive`` equation in ``fn``'s jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return collections.Counter(
        tuple(str(v.aval.dtype) for v in eqn.invars)
        for eqn in _equations(jaxpr)
        if eqn.primitive.name == primitive
    )


def _residuals(loss, variables, x):
    _, vjp_fn = jax.vjp(lambda v: loss(v, x), variables)
    return sorted((leaf.shape, str(leaf.dtype)) for leaf in jax.tree_util.tree_leaves(vjp_fn))


def _setup(model, x, patterns, **kwargs):
    variables = model.init(jax.random.key(0), x)
    policy = triaccel_jax.PrecisionPolicy.from_patterns(variables, patterns)

    def loss(v, inputs):
        out = apply_with_policy(model, v, inputs, policy=policy, **kwargs)
        return out.astype(jnp.float32).sum()

    return variables, policy, loss


@exact_residuals
def test_bf16_hidden_layer_next_to_an_fp32_output_layer():
    x = jnp.ones((3, 8))
    variables, _, loss = _setup(_MLP(), x, {"params/hidden/*": "bf16"})
    # Forward: hidden (bf16), out (fp32). Backward: d out/kernel and d h (fp32, out's), d
    # hidden/kernel (bf16); x is not differentiated, so there is no d x.
    assert _ops(jax.grad(loss), variables, x) == {(BF16, BF16): 2, (F32, F32): 3}
    assert _residuals(loss, variables, x) == [
        ((3, 8), BF16),  # hidden's input, cast, for d hidden/kernel
        ((3, 16), BF16),  # tanh' of hidden's bf16 output
        ((3, 16), F32),  # out's input, cast back up, for d out/kernel
        ((16, 4), F32),  # out/kernel (the fp32 master), for d h
    ]
    grads = jax.grad(loss)(variables, x)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(grads)} == {jnp.dtype(F32)}


@exact_residuals
def test_fp32_hidden_layer_next_to_a_bf16_output_layer():
    x = jnp.ones((3, 8))
    variables, _, loss = _setup(_MLP(), x, {"params/out/*": "bf16"})
    assert _ops(jax.grad(loss), variables, x) == {(F32, F32): 2, (BF16, BF16): 3}
    assert _residuals(loss, variables, x) == [
        ((3, 8), F32),  # hidden's input, for d hidden/kernel
        ((3, 16), BF16),  # out's input, cast, for d out/kernel
        ((3, 16), F32),  # tanh' of hidden's fp32 output
        ((16, 4), BF16),  # out/kernel's bf16 compute copy, for d h
    ]


@exact_residuals
def test_bf16_conv_next_to_an_fp32_dense():
    x = jnp.ones((2, 5, 5, 1))
    variables, _, loss = _setup(_ConvNet(), x, {"params/conv/*": "bf16"})
    grad = jax.grad(loss)
    # The convolution and its kernel gradient run in bf16; the Dense head stays fp32.
    assert _ops(grad, variables, x, primitive="conv_general_dilated") == {(BF16, BF16): 2}
    assert _ops(grad, variables, x) == {(F32, F32): 3}
    assert _residuals(loss, variables, x) == [
        ((2, 5, 5, 1), BF16),  # the conv's input, cast
        ((2, 5, 5, 6), BF16),  # tanh' of the conv's bf16 output
        ((2, 150), F32),  # the head's input
        ((150, 4), F32),  # the head's kernel (master)
    ]


def test_compute_copies_passed_in_give_the_same_program():
    x = jnp.ones((3, 8))
    variables, policy, loss = _setup(_MLP(), x, {"params/hidden/*": "bf16"})
    copies = jax.tree.map(lambda v, d: v.astype(d), variables, policy.dtype_tree(variables))
    assert copies["params"]["hidden"]["kernel"].dtype == jnp.bfloat16
    assert _ops(jax.grad(loss), copies, x) == {(BF16, BF16): 2, (F32, F32): 3}
    np.testing.assert_allclose(loss(copies, x), loss(variables, x), rtol=1e-6)


def test_policy_built_on_the_params_collection_works_too():
    x = jnp.ones((3, 8))
    model = _MLP()
    variables = model.init(jax.random.key(0), x)
    policy = triaccel_jax.PrecisionPolicy.from_patterns(variables["params"], {"hidden/*": "bf16"})
    loss = lambda v, inputs: apply_with_policy(model, v, inputs, policy=policy).sum()
    assert _ops(jax.grad(loss), variables, x) == {(BF16, BF16): 2, (F32, F32): 3}


def test_mixed_largest_follows_the_kernel_and_widest_keeps_fp32_biases_in_charge():
    x = jnp.ones((3, 8))
    patterns = {"*/kernel": "bf16"}  # the planner keeps small leaves (biases) fp32
    variables, _, largest = _setup(_MLP(), x, patterns)  # "largest" is the default
    _, _, widest = _setup(_MLP(), x, patterns, mixed="widest")
    assert _ops(jax.grad(widest), variables, x) == {(F32, F32): 5}
    assert _ops(jax.grad(largest), variables, x) == {(BF16, BF16): 5}
    with pytest.raises(ValueError, match="`mixed`"):
        precision_interceptor(triaccel_jax.PrecisionPolicy.uniform(variables), mixed="narrow")


def test_bf16_forward_and_gradients_are_close_to_fp32():
    x = jax.random.normal(jax.random.key(1), (3, 8))
    variables, _, bf16_loss = _setup(_MLP(), x, {"*": "bf16"})
    _, _, fp32_loss = _setup(_MLP(), x, {})
    np.testing.assert_allclose(bf16_loss(variables, x), fp32_loss(variables, x), rtol=0.05)
    chex.assert_trees_all_close(
        jax.grad(bf16_loss)(variables, x), jax.grad(fp32_loss)(variables, x), rtol=0.05, atol=0.05
    )


def test_params_read_in_setup_are_cast_and_init_is_untouched():
    x = jnp.ones((2, 3))
    model = _SetupScale()
    policy_vars = model.init(jax.random.key(0), x)
    policy = triaccel_jax.PrecisionPolicy.uniform(policy_vars, "bf16")
    with precision_interceptor(policy):
        variables = model.init(jax.random.key(0), x)  # init creates fp32 params as usual
        y = model.apply(variables, x)
    assert jax.tree.map(lambda v: v.dtype, variables) == jax.tree.map(
        lambda v: v.dtype, policy_vars
    )
    assert y.dtype == jnp.bfloat16  # bf16 dense output times the bf16-cast `scale`


def test_lifted_remat_and_scan_layers_are_cast():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, carry, _):
            # A scan carry keeps its dtype: a layer computing in bf16 must hand back fp32.
            return jnp.tanh(nn.Dense(8)(carry)).astype(carry.dtype), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.remat(nn.Dense)(8, name="first")(x)
            stack = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
            )
            x, _ = stack(name="stack")(x, None)
            return x

    x = jnp.ones((2, 8))
    # The scan body appears once in the jaxpr: forward, then d kernel and d carry in the backward
    # scan; the rematerialised layer: forward and d kernel (x is not differentiated).
    variables, _, loss = _setup(Model(), x, {"params/stack/*": "bf16"})
    assert _ops(jax.grad(loss), variables, x) == {(BF16, BF16): 3, (F32, F32): 2}
    variables, _, loss = _setup(Model(), x, {"params/first/*": "bf16"})
    assert _ops(jax.grad(loss), variables, x) == {(BF16, BF16): 2, (F32, F32): 3}


def test_a_module_param_missing_from_the_policy_is_an_error_naming_it():
    x = jnp.ones((3, 8))
    model = _MLP()
    variables = model.init(jax.random.key(0), x)
    partial = triaccel_jax.PrecisionPolicy.uniform(
        {"params": {"hidden": variables["params"]["hidden"]}}
    )
    with pytest.raises(ValueError, match=r"params/out/(kernel|bias)"):
        apply_with_policy(model, variables, x, policy=partial)
    with (
        pytest.raises(ValueError, match=r"params/out/(kernel|bias)"),
        precision_interceptor(partial),
    ):
        model.apply(variables, x)
    with pytest.raises(ValueError, match="'params' collection"):
        apply_with_policy(model, {"batch_stats": {}}, x, policy=partial)


def test_nnx_layers_compute_in_their_dtype_once_set_from_the_policy():
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    model = MLP(nnx.Rngs(0))
    policy = triaccel_jax.PrecisionPolicy.from_patterns(
        nnx.state(model, nnx.Param), {"l1/*": "bf16"}
    )
    to_dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
    for path, module in nnx.iter_modules(model):
        kernel = "/".join(map(str, path)) + "/kernel/value"
        if hasattr(module, "dtype") and kernel in set(policy):
            module.dtype = jnp.dtype(to_dtype[policy.compute(kernel)])

    graphdef, params = nnx.split(model)
    x = jnp.ones((3, 8))
    loss = lambda p, inputs: nnx.merge(graphdef, p)(inputs).sum()
    assert _ops(jax.grad(loss), params, x) == {(BF16, BF16): 2, (F32, F32): 3}
    grads = jax.grad(loss)(params, x)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(grads)} == {jnp.dtype(F32)}


@pytest.mark.standard_promotion("Flax's avg_pool, normalisation and Dense promote internally")
def test_norm_layers_follow_the_dtype_of_their_input():
    class ConvNorm(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.LayerNorm()(nn.Dense(8)(x))
            return nn.Dense(2)(nn.LayerNorm()(x.astype(jnp.float32)))

    x = jnp.ones((2, 4))
    variables = ConvNorm().init(jax.random.key(0), x)
    policy = triaccel_jax.PrecisionPolicy.from_patterns(variables, {"*Dense_0/kernel": "bf16"})
    with precision_interceptor(policy):
        intermediates = ConvNorm().apply(
            variables, x, capture_intermediates=True, mutable=["intermediates"]
        )[1]["intermediates"]
    # The first LayerNorm receives bf16 and computes in bf16; the second receives fp32.
    assert intermediates["LayerNorm_0"]["__call__"][0].dtype == jnp.bfloat16
    assert intermediates["LayerNorm_1"]["__call__"][0].dtype == jnp.float32
    assert variables["params"]["LayerNorm_0"]["scale"].dtype == jnp.float32  # masters untouched
