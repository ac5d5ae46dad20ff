"""Tests for the Flax models in ``triaccel_jax.models``.

ResNet-20's variables are drawn with NumPy from the shapes that ``init`` traces: compiling
``init`` itself costs several seconds on CPU (threefry bits for each 4-D kernel shape), and
what is under test here is the network, not Flax's initialisers.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from triaccel_jax.models import ResNet20
from triaccel_jax.models import SmallCNN
from triaccel_jax.models._resnet import BasicBlock
from triaccel_jax.models._resnet import ResNet

_RESNET20_PARAMS = 272_474  # He et al.'s 269,722 plus 2,752 for the two projections.


def _num_params(variables) -> int:
    return sum(x.size for x in jax.tree.leaves(variables["params"]))


def _images(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _abstract_variables(model, x, **kwargs):
    return jax.eval_shape(lambda: model.init(jax.random.key(0), x, **kwargs))


def _numpy_variables(abstract, seed: int = 0):
    """He-scaled kernels, BatchNorm scale 1 and shift 0, running mean 0 and variance 1."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path[-1:])
        if "kernel" in name:
            fan_in = math.prod(leaf.shape[:-1])
            values = rng.standard_normal(leaf.shape) * math.sqrt(2.0 / fan_in)
        elif "scale" in name or "var" in name:
            values = np.ones(leaf.shape)
        else:
            values = np.zeros(leaf.shape)
        return jnp.asarray(values, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


@pytest.fixture(scope="module")
def resnet20_variables():
    abstract = _abstract_variables(ResNet20(), jnp.zeros((1, 32, 32, 3)), train=False)
    return _numpy_variables(abstract)


@jax.jit
def _resnet20_both_modes(variables, x):
    """Logits and new batch stats in eval mode and in train mode, in one compilation."""
    model = ResNet20()
    eval_logits, eval_updates = model.apply(variables, x, train=False, mutable=["batch_stats"])
    train_logits, train_updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    return eval_logits, eval_updates["batch_stats"], train_logits, train_updates["batch_stats"]


@pytest.fixture(scope="module")
def resnet20_outputs(resnet20_variables):
    # The two batches share their first image and differ elsewhere, and they are offset
    # from the zero mean / unit variance of the initial running statistics.
    x = _images((4, 32, 32, 3), seed=1) * 2.0 + 1.0
    other = x.copy()
    other[1:] = _images((3, 32, 32, 3), seed=2) * 5.0
    return _resnet20_both_modes(resnet20_variables, x), _resnet20_both_modes(
        resnet20_variables, other
    )


def test_models_are_exported():
    import triaccel_jax.models as models

    assert sorted(models.__all__) == ["BatchNorm", "ResNet20", "SmallCNN"]


def test_small_cnn_logits_shape_and_jit():
    model = SmallCNN(num_classes=7)
    x = _images((5, 28, 28, 1), seed=0)
    variables = jax.jit(model.init)(jax.random.key(0), x)
    assert set(variables) == {"params"}  # nothing stateful
    logits = jax.jit(model.apply)(variables, x)
    assert logits.shape == (5, 7)
    assert logits.dtype == jnp.float32
    assert np.all(np.isfinite(logits))
    # ``train`` is accepted for a uniform interface and changes nothing.
    np.testing.assert_array_equal(jax.jit(model.apply)(variables, x, train=True), logits)


def test_small_cnn_param_count_and_layout():
    variables = _abstract_variables(SmallCNN(), jnp.zeros((1, 28, 28, 1)))
    # conv 3*3*1*32+32, conv 3*3*32*64+64, dense 7*7*64*128+128, dense 128*10+10.
    assert _num_params(variables) == 320 + 18_496 + 401_536 + 1_290
    assert variables["params"]["Conv_0"]["kernel"].shape == (3, 3, 1, 32)  # HWIO
    assert variables["params"]["Dense_0"]["kernel"].shape == (7 * 7 * 64, 128)


def test_small_cnn_configurable_widths():
    model = SmallCNN(num_classes=3, features=(8, 8, 16), dense=32)
    variables = _abstract_variables(model, jnp.zeros((1, 32, 32, 3)))
    assert variables["params"]["Dense_0"]["kernel"].shape == (4 * 4 * 16, 32)
    assert jax.eval_shape(model.apply, variables, jnp.zeros((2, 32, 32, 3))).shape == (2, 3)


def test_small_cnn_bfloat16_compute_keeps_float32_params():
    model = SmallCNN(dtype=jnp.bfloat16)
    x = jnp.zeros((2, 28, 28, 1))
    variables = _abstract_variables(model, x)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(variables))
    assert jax.eval_shape(model.apply, variables, x).dtype == jnp.bfloat16


def test_resnet20_param_count(resnet20_variables):
    count = _num_params(resnet20_variables)
    assert count == _RESNET20_PARAMS
    assert 260_000 <= count <= 280_000


def test_resnet20_structure(resnet20_variables):
    params = resnet20_variables["params"]
    blocks = sorted(k for k in params if k.startswith("BasicBlock"))
    assert len(blocks) == 9
    # Projections only where the shape changes: the first block of stages 2 and 3.
    assert [k for k in blocks if "Conv_2" in params[k]] == ["BasicBlock_3", "BasicBlock_6"]
    assert params["BasicBlock_3"]["Conv_2"]["kernel"].shape == (1, 1, 16, 32)
    assert params["BasicBlock_8"]["Conv_1"]["kernel"].shape == (3, 3, 64, 64)
    assert "bias" not in params["Conv_0"]  # BatchNorm follows every convolution
    assert params["Dense_0"]["kernel"].shape == (64, 10)
    # A running mean and variance per channel of each BatchNorm: the stem, two per block
    # and one per projection.
    num_stats = sum(x.size for x in jax.tree.leaves(resnet20_variables["batch_stats"]))
    assert num_stats == 2 * (16 + 6 * 16 + 7 * 32 + 7 * 64)


def test_resnet20_init_traces_with_default_flax_api():
    abstract = _abstract_variables(ResNet20(num_classes=100), jnp.zeros((2, 32, 32, 3)), train=True)
    assert set(abstract) == {"params", "batch_stats"}
    assert abstract["params"]["Dense_0"]["kernel"].shape == (64, 100)


def test_resnet_is_configurable():
    model = ResNet(stage_sizes=(2, 2, 2, 2), block_cls=BasicBlock, num_filters=64)
    variables = _abstract_variables(model, jnp.zeros((1, 32, 32, 3)), train=False)
    assert _num_params(variables) == 11_173_962  # the CIFAR variant of ResNet-18
    assert isinstance(ResNet20(), ResNet)


def test_resnet20_logits(resnet20_outputs):
    eval_logits, _, train_logits, _ = resnet20_outputs[0]
    for logits in (eval_logits, train_logits):
        assert logits.shape == (4, 10)
        assert np.all(np.isfinite(logits))


def test_resnet20_batch_stats_update_in_train_mode_only(resnet20_variables, resnet20_outputs):
    old_stats = resnet20_variables["batch_stats"]
    _, eval_stats, _, train_stats = resnet20_outputs[0]
    assert jax.tree.structure(train_stats) == jax.tree.structure(old_stats)
    changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), old_stats, train_stats)
    assert all(jax.tree.leaves(changed))
    unchanged = jax.tree.map(lambda a, b: bool(np.all(a == b)), old_stats, eval_stats)
    assert all(jax.tree.leaves(unchanged))


def test_resnet20_train_mode_normalises_with_batch_statistics(resnet20_outputs):
    # With batch statistics a sample's logits depend on the rest of the batch; with the
    # running averages they do not.
    (eval_x, _, train_x, _), (eval_other, _, train_other, _) = resnet20_outputs
    np.testing.assert_allclose(eval_x[0], eval_other[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(train_x[0], train_other[0], rtol=1e-3, atol=1e-3)


def test_resnet20_train_mode_needs_mutable_batch_stats(resnet20_variables):
    with pytest.raises(Exception, match="batch_stats"):
        jax.eval_shape(
            lambda v: ResNet20().apply(v, jnp.zeros((2, 32, 32, 3)), train=True),
            resnet20_variables,
        )


def test_resnet20_jitted_train_step(resnet20_variables):
    model = ResNet20()
    tx = optax.sgd(0.1)
    x = _images((4, 32, 32, 3), seed=3)
    labels = jnp.arange(4)

    @jax.jit
    def step(params, batch_stats, opt_state):
        def loss_fn(p):
            logits, updates = model.apply(
                {"params": p, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates["batch_stats"]

        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state, loss, grads

    params = resnet20_variables["params"]
    batch_stats = resnet20_variables["batch_stats"]
    new_params, new_stats, _, loss, grads = step(params, batch_stats, tx.init(params))
    assert np.isfinite(loss)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert all(np.any(g != 0) for g in jax.tree.leaves(grads))
    assert jax.tree.structure(new_params) == jax.tree.structure(params)
    assert jax.tree.structure(new_stats) == jax.tree.structure(batch_stats)


def test_batch_norm_matches_flax_in_fp32_and_stays_bf16_in_bf16():
    from triaccel_jax.models import BatchNorm

    x = jax.random.normal(jax.random.key(3), (16, 5, 5, 6)) * 3.0 + 1.0
    ours, theirs = (
        BatchNorm(False, momentum=0.8),
        nn.BatchNorm(False, momentum=0.8, use_fast_variance=False),
    )
    variables = ours.init(jax.random.key(0), x)
    reference = theirs.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, reference)
    y, stats = ours.apply(variables, x, mutable=["batch_stats"])
    y_ref, stats_ref = theirs.apply(reference, x, mutable=["batch_stats"])
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(stats_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    evaluated = BatchNorm(True).apply({**variables, **stats}, x)
    expected = nn.BatchNorm(True, use_fast_variance=False).apply({**reference, **stats_ref}, x)
    np.testing.assert_allclose(evaluated, expected, rtol=1e-5, atol=1e-5)
    low, _ = ours.apply(variables, x.astype(jnp.bfloat16), mutable=["batch_stats"])
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(low.astype(jnp.float32), y, atol=0.05)
