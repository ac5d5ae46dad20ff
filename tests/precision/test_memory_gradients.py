"""memory_report's gradient bytes are those of the gradients the compiled training step hands the
optimizer: the masters' dtype, or float32 while the policy scales the loss (fp16/fp8 leaves)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
import triaccel_jax.flax


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(32, name="hidden")(x))
        return nn.Dense(4, name="out")(h)


def _recording(seen: list) -> optax.GradientTransformation:
    """A transform that records, while the step is traced, the gradients it receives."""

    def update(updates, state, params=None):
        del params
        seen.append(jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape, g.dtype), updates))
        return updates, state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def _bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.mark.standard_promotion(
    "optax.apply_updates adds float32 updates to float16 or fp8-carried masters"
)
@pytest.mark.parametrize("compute", ["bf16", "fp16", "fp8_e4m3"])
@pytest.mark.parametrize("master_dtype", ["fp32", "policy"])
def test_gradient_bytes_equal_those_the_compiled_step_hands_the_optimizer(compute, master_dtype):
    model, x = _MLP(), jnp.ones((3, 16))
    params = model.init(jax.random.key(0), x)["params"]
    policy = triaccel_jax.PrecisionPolicy.from_patterns(params, {"*/kernel": compute})
    masters = triaccel_jax.master_params(params, policy, master_dtype)
    seen: list = []
    state = triaccel_jax.flax.TrainState.create(
        apply_fn=model.apply,
        params=masters,
        tx=optax.chain(_recording(seen), optax.sgd(0.1)),
        policy=policy,
    )

    def loss_of(p, inputs):
        logits = triaccel_jax.flax.apply_with_policy(model, {"params": p}, inputs, policy=policy)
        return jnp.mean(jnp.square(logits.astype(jnp.float32)))

    @jax.jit
    def step(state, inputs):
        _, grads = state.value_and_grad(lambda p: loss_of(p, inputs))
        return state.apply_gradients(grads=grads)

    step(state, x)
    (received,) = seen
    report = triaccel_jax.memory_report(
        masters, state.opt_state, policy, lambda p, b: loss_of(p, b), x, compiled=False
    )
    assert report.gradients == _bytes(received)
    # Without the step function, the report reads the same figure from the dtypes alone.
    assert triaccel_jax.memory_report(masters, (), policy).gradients == _bytes(received)


def test_fp32_masters_receive_fp32_gradients_whatever_the_compute_dtype():
    params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16")
    grads = jax.jit(jax.grad(lambda p: jnp.sum(triaccel_jax.cast_params(p, policy)["w"])))(params)
    report = triaccel_jax.memory_report(params, (), policy)
    assert report.gradients == _bytes(grads) == (64 * 32 + 32) * 4
    assert "gradients (as the optimizer gets them)" in str(report)
