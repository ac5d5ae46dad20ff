"""memory_report's gradient bytes are those of the gradients a compiled training step returns."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import triaccel_jax


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(32, name="hidden")(x))
        return nn.Dense(4, name="out")(h)


def _returned_gradient_bytes(params, policy, x):
    """Bytes of the gradients that ``jit(grad(loss))`` returns: what the optimizer receives."""

    def loss(masters, inputs):
        compute = triaccel_jax.cast_params(masters, policy)
        logits = triaccel_jax.apply_with_policy(_MLP(), compute, inputs, policy=policy)
        return logits.astype(jnp.float32).sum()

    grads = jax.jit(jax.grad(loss))(params, x)
    return sum(np.asarray(g).nbytes for g in jax.tree.leaves(grads)), loss


@pytest.mark.parametrize("compute", ["bf16", "fp16", "fp8_e4m3"])
@pytest.mark.parametrize("master_dtype", ["fp32", "policy"])
def test_gradient_bytes_equal_those_the_compiled_step_returns(compute, master_dtype):
    x = jnp.ones((3, 16))
    variables = _MLP().init(jax.random.key(0), x)
    policy = triaccel_jax.PrecisionPolicy.from_patterns(variables, {"*/kernel": compute})
    masters = triaccel_jax.master_params(variables, policy, master_dtype)
    returned, loss = _returned_gradient_bytes(masters, policy, x)
    report = triaccel_jax.memory_report(masters, (), policy, loss, x, compiled=False)
    assert report.gradients == returned
    # Without the step function, the report reads the same figure from the dtypes alone.
    assert triaccel_jax.memory_report(masters, (), policy).gradients == returned


def test_fp32_masters_receive_fp32_gradients_whatever_the_compute_dtype():
    params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16")
    report = triaccel_jax.memory_report(params, (), policy)
    assert report.gradients == (64 * 32 + 32) * 4
    assert "gradients (masters' dtype)" in str(report)
