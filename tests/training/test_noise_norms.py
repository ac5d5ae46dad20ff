"""value_and_grad_with_noise: the batch's gradient and the noise scale's two norms."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from simulated_devices import run_script

from triaccel_jax.models import SmallCNN
from triaccel_jax.precision import compiled_peak_bytes
from triaccel_jax.training import value_and_grad_with_noise


def data(num=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 2.0]) + rng.normal(size=num)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def sq_norm(tree):
    return sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(tree))


def test_the_gradient_is_the_batchs_and_the_norms_are_the_averages_and_the_halves():
    params = {"w": jnp.array([0.5, 0.0, -0.5]), "b": jnp.zeros(())}
    batch = data()
    value, grads, norms = jax.jit(value_and_grad_with_noise(loss))(params, batch)
    want_value, want_grads = jax.value_and_grad(loss)(params, batch)
    assert float(value) == pytest.approx(float(want_value), rel=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, want_grads
    )
    # The halves are the even- and the odd-numbered samples (a sharded batch splits in place).
    halves = [jax.tree.map(lambda x, i=i: x[i::2], batch) for i in range(2)]
    half_norms = [sq_norm(jax.grad(loss)(params, h)) for h in halves]
    assert float(norms["grad_sq_norm"]) == pytest.approx(sq_norm(want_grads), rel=1e-5)
    assert float(norms["micro_grad_sq_norm"]) == pytest.approx(np.mean(half_norms), rel=1e-5)
    assert norms["grad_sq_norm"].dtype == jnp.float32


def test_aux_is_the_halves_mean_and_extra_arguments_pass_through():
    def with_aux(params, batch, scale):
        x, y = batch
        error = x @ params["w"] + params["b"] - y
        return scale * jnp.mean(error**2), {"mean_error": jnp.mean(error)}

    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    batch = data()
    (value, aux), grads, _ = value_and_grad_with_noise(with_aux, has_aux=True)(params, batch, 2.0)
    (want, want_aux), want_grads = jax.value_and_grad(with_aux, has_aux=True)(params, batch, 2.0)
    assert float(value) == pytest.approx(float(want), rel=1e-5)
    assert float(aux["mean_error"]) == pytest.approx(float(want_aux["mean_error"]), rel=1e-5)
    np.testing.assert_allclose(grads["w"], want_grads["w"], rtol=1e-5)


def test_an_odd_batch_is_refused_naming_the_shape():
    x, y = data(num=31)
    with pytest.raises(ValueError, match=r"even number of samples.*\(31, 3\)"):
        value_and_grad_with_noise(loss)({"w": jnp.zeros(3), "b": jnp.zeros(())}, (x, y))


def small_cnn_loss():
    """A linen SmallCNN's cross-entropy, its params and a batch of 16 8x8 images."""
    model = SmallCNN(features=(4,), dense=8)
    rng = np.random.default_rng(1)
    images = jnp.asarray(rng.normal(size=(16, 8, 8, 1)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, size=16), jnp.int32)
    params = model.init(jax.random.key(0), images[:1])["params"]

    def cnn_loss(p, batch):
        logits = model.apply({"params": p}, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return cnn_loss, params, (images, labels)


@pytest.mark.slow
@pytest.mark.standard_promotion("Flax's avg_pool divides by an int window size")
def test_the_halves_are_not_a_loop_in_the_compiled_step():
    # XLA:CPU runs a convolution's gradient inside a while loop's body an order of magnitude
    # slower than unrolled: a conv net's step cost 4-16x jax.value_and_grad's with the halves
    # in a lax.scan.
    cnn_loss, params, batch = small_cnn_loss()
    fun = value_and_grad_with_noise(cnn_loss)
    hlo = jax.jit(fun).lower(params, batch).compile().as_text()
    assert re.findall(r"\bwhile\(", hlo) == []
    primitives = {eqn.primitive.name for eqn in jax.make_jaxpr(fun)(params, batch).eqns}
    assert not primitives & {"scan", "while"}, primitives
    # Each half is differentiated once: twice the convolutions of one jax.value_and_grad.
    plain = jax.jit(jax.value_and_grad(cnn_loss)).lower(params, batch).compile().as_text()
    assert len(re.findall(r"\bconvolution\(", hlo)) == 2 * len(
        re.findall(r"\bconvolution\(", plain)
    )


@pytest.mark.slow
@pytest.mark.standard_promotion("Flax's avg_pool divides by an int window size")
def test_the_compiled_peak_is_at_most_jax_value_and_grads_and_the_halves_gradients():
    cnn_loss, params, batch = small_cnn_loss()
    grad_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))

    def peak(fun):
        return compiled_peak_bytes(jax.jit(fun).lower(params, batch).compile())

    assert peak(value_and_grad_with_noise(cnn_loss)) <= (
        peak(jax.value_and_grad(cnn_loss)) + 2 * grad_bytes
    )
    value, grads, norms = jax.jit(value_and_grad_with_noise(cnn_loss))(params, batch)
    want_value, want_grads = jax.value_and_grad(cnn_loss)(params, batch)
    assert float(value) == pytest.approx(float(want_value), rel=1e-5)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-4, atol=1e-6)
    assert float(norms["grad_sq_norm"]) == pytest.approx(sq_norm(want_grads), rel=1e-4)


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from triaccel_jax.training import value_and_grad_with_noise

def loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] - y) ** 2)

rng = np.random.default_rng(0)
x = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
y = jnp.asarray(rng.normal(size=64), jnp.float32)
params = {"w": jnp.linspace(-1.0, 1.0, 16)}
fn = jax.jit(value_and_grad_with_noise(loss))
want = fn(params, (x, y))
for kind in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    with jax.set_mesh(mesh):
        batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
        got = fn(params, batch)
        text = fn.lower(params, batch).compile().as_text()
    moved = {n: text.count(n) for n in ("all-gather", "collective-permute", "all-to-all")}
    assert not any(moved.values()), (kind, moved)  # the halves are cut within each shard
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_a_batch_sharded_over_devices_is_halved_within_each_shard():
    # 8 samples a device, Auto and Explicit meshes: no sample moves between devices to be
    # halved, and the value, gradient and norms are the unsharded ones.
    run_script(SHARDED, devices=8)
