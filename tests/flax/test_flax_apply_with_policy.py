"""``apply_with_policy`` takes the masters and casts them itself (no cast_params at the caller)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import triaccel_jax
from triaccel_jax.flax import apply_with_policy


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="out")(jnp.tanh(nn.Dense(8, name="hidden")(x)))


def _setup(patterns, on_params=False):
    model = _MLP()
    x = jax.random.normal(jax.random.key(1), (4, 3))
    variables = model.init(jax.random.key(0), x)
    tree = variables["params"] if on_params else variables
    policy = triaccel_jax.PrecisionPolicy.from_patterns(tree, patterns)
    return model, variables, x, policy


@pytest.mark.parametrize("on_params", [False, True], ids=["on_variables", "on_params"])
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3"])
def test_masters_give_what_the_cast_copies_give(fmt, on_params):
    prefix = "" if on_params else "params/"
    model, variables, x, policy = _setup({f"{prefix}hidden/*": fmt}, on_params)
    sub_policy = (
        policy
        if on_params
        else triaccel_jax.PrecisionPolicy.from_patterns(variables["params"], {"hidden/*": fmt})
    )
    compute = triaccel_jax.cast_params(variables["params"], sub_policy)
    from_masters = apply_with_policy(model, variables, x, policy=policy)
    from_copies = apply_with_policy(model, {"params": compute}, x, policy=policy, cast=False)
    np.testing.assert_array_equal(from_masters, from_copies)


def test_fp8_leaves_are_rounded_to_fp8_not_only_to_bf16():
    # The interceptor alone rounds an fp8 leaf to its bf16 carrier; the cast rounds it to fp8
    # values (with the per-leaf scale), so the outputs differ.
    model, variables, x, policy = _setup({"params/hidden/*": "fp8_e4m3"})
    cast = apply_with_policy(model, variables, x, policy=policy)
    interceptor_only = apply_with_policy(model, variables, x, policy=policy, cast=False)
    assert not np.array_equal(
        np.asarray(cast, np.float32), np.asarray(interceptor_only, np.float32)
    )


def test_gradients_reach_the_masters_through_the_cast():
    model, variables, x, policy = _setup({"params/hidden/*": "bf16"})

    def loss(v):
        return apply_with_policy(model, v, x, policy=policy).astype(jnp.float32).sum()

    grads = jax.grad(loss)(variables)["params"]
    assert grads["hidden"]["kernel"].dtype == jnp.float32
    assert float(jnp.abs(grads["hidden"]["kernel"]).sum()) > 0
    assert float(jnp.abs(grads["out"]["kernel"]).sum()) > 0


def test_stochastic_rounding_takes_a_key():
    model, variables, x, policy = _setup({"params/hidden/*": "bf16"})
    with pytest.raises(ValueError, match="needs a PRNG `key`"):
        apply_with_policy(model, variables, x, policy=policy, rounding="stochastic")
    first = apply_with_policy(
        model, variables, x, policy=policy, rounding="stochastic", key=jax.random.key(0)
    )
    again = apply_with_policy(
        model, variables, x, policy=policy, rounding="stochastic", key=jax.random.key(0)
    )
    np.testing.assert_array_equal(first, again)


def test_no_policy_is_plain_apply():
    model, variables, x, _ = _setup({})
    np.testing.assert_array_equal(
        apply_with_policy(model, variables, x, policy=None), model.apply(variables, x)
    )
