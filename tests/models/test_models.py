"""Tests for the Flax models in ``triaccel_jax.models``.

The ResNets' and EfficientNet-B0's variables are drawn with NumPy from the shapes that ``init``
traces: compiling ``init`` itself costs several seconds on CPU (threefry bits for each 4-D kernel
shape), and what is under test here is the network, not Flax's initialisers.
"""

from __future__ import annotations

import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from triaccel_jax.models import EfficientNetB0
from triaccel_jax.models import ResNet18
from triaccel_jax.models import ResNet20
from triaccel_jax.models import SmallCNN
from triaccel_jax.models._efficientnet import B0_STAGES
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

    assert models.__all__ == sorted(models.__all__)
    assert models.__all__ == ["BatchNorm", "EfficientNetB0", "ResNet18", "ResNet20", "SmallCNN"]


@pytest.mark.standard_promotion("Flax's avg_pool, normalisation and Dense promote internally")
def test_small_cnn_logits_shape_and_jit():
    model = SmallCNN(num_classes=7)
    x = _images((5, 28, 28, 1), seed=0)
    variables = jax.jit(model.init)(jax.random.key(0), x)
    assert set(variables) == {"params"}  # nothing stateful
    logits = jax.jit(model.apply)(variables, x)
    chex.assert_shape(logits, (5, 7))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)
    # ``train`` is accepted for a uniform interface and changes nothing.
    np.testing.assert_array_equal(jax.jit(model.apply)(variables, x, train=True), logits)


@pytest.mark.standard_promotion("Flax's avg_pool, normalisation and Dense promote internally")
def test_small_cnn_param_count_and_layout():
    variables = _abstract_variables(SmallCNN(), jnp.zeros((1, 28, 28, 1)))
    # conv 3*3*1*32+32, conv 3*3*32*64+64, dense 7*7*64*128+128, dense 128*10+10.
    assert _num_params(variables) == 320 + 18_496 + 401_536 + 1_290
    assert variables["params"]["Conv_0"]["kernel"].shape == (3, 3, 1, 32)  # HWIO
    assert variables["params"]["Dense_0"]["kernel"].shape == (7 * 7 * 64, 128)


@pytest.mark.standard_promotion("Flax's avg_pool, normalisation and Dense promote internally")
def test_small_cnn_configurable_widths():
    model = SmallCNN(num_classes=3, features=(8, 8, 16), dense=32)
    variables = _abstract_variables(model, jnp.zeros((1, 32, 32, 3)))
    assert variables["params"]["Dense_0"]["kernel"].shape == (4 * 4 * 16, 32)
    assert jax.eval_shape(model.apply, variables, jnp.zeros((2, 32, 32, 3))).shape == (2, 3)


@pytest.mark.standard_promotion("Flax's avg_pool, normalisation and Dense promote internally")
def test_small_cnn_bfloat16_compute_keeps_float32_params():
    model = SmallCNN(dtype=jnp.bfloat16)
    x = jnp.zeros((2, 28, 28, 1))
    variables = _abstract_variables(model, x)
    chex.assert_type(jax.tree.leaves(variables), jnp.float32)
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
    chex.assert_shape([eval_logits, train_logits], (4, 10))
    chex.assert_tree_all_finite((eval_logits, train_logits))


def test_resnet20_batch_stats_update_in_train_mode_only(resnet20_variables, resnet20_outputs):
    old_stats = resnet20_variables["batch_stats"]
    _, eval_stats, _, train_stats = resnet20_outputs[0]
    chex.assert_trees_all_equal_structs(train_stats, old_stats)
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


@pytest.mark.slow
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
    chex.assert_tree_all_finite((loss, grads))
    chex.assert_trees_all_equal_structs(grads, params, new_params)
    assert all(np.any(g != 0) for g in jax.tree.leaves(grads))
    chex.assert_trees_all_equal_structs(new_stats, batch_stats)


def test_batch_norm_matches_flax_in_fp32_and_stays_bf16_in_bf16():
    from triaccel_jax.models import BatchNorm

    x = jax.random.normal(jax.random.key(3), (16, 5, 5, 6)) * 3.0 + 1.0
    ours, theirs = (
        BatchNorm(False, momentum=0.8),
        nn.BatchNorm(False, momentum=0.8, use_fast_variance=False),
    )
    variables = ours.init(jax.random.key(0), x)
    reference = theirs.init(jax.random.key(0), x)
    chex.assert_trees_all_equal_shapes(variables, reference)
    y, stats = ours.apply(variables, x, mutable=["batch_stats"])
    y_ref, stats_ref = theirs.apply(reference, x, mutable=["batch_stats"])
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(stats, stats_ref, rtol=1e-5, atol=1e-6)
    evaluated = BatchNorm(True).apply({**variables, **stats}, x)
    expected = nn.BatchNorm(True, use_fast_variance=False).apply({**reference, **stats_ref}, x)
    np.testing.assert_allclose(evaluated, expected, rtol=1e-5, atol=1e-5)
    low, _ = ours.apply(variables, x.astype(jnp.bfloat16), mutable=["batch_stats"])
    chex.assert_type(low, jnp.bfloat16)
    np.testing.assert_allclose(low.astype(jnp.float32), y, atol=0.05)


# --- ResNet-18 and EfficientNet-B0 at the CIFAR input shape ---------------------------------------

# Reference counts: the CIFAR ResNet-18 (3x3 stem, no max-pool, projection shortcuts) as in
# kuangliu/pytorch-cifar, 11,173,962 parameters for ten classes; EfficientNet-B0 as in Tan & Le
# (2019, Table 2: 5.3M) and the Keras / timm implementations, 5,288,548 for 1000 classes, so
# 4,020,358 with a ten-class head. BatchNorm running statistics are not parameters.
_REFERENCE_PARAMS = {
    ("ResNet18", 10): 11_170_000,
    ("EfficientNetB0", 10): 4_000_000,
    ("EfficientNetB0", 1000): 5_290_000,
}


def _resnet18_param_count(num_classes: int) -> int:
    """The CIFAR ResNet-18's parameters, counted from its architecture."""
    count = 3 * 3 * 3 * 64 + 2 * 64  # stem conv and BatchNorm
    in_channels = 64
    for stage, width in enumerate((64, 128, 256, 512)):
        for index in range(2):
            count += 3 * 3 * in_channels * width + 3 * 3 * width * width + 4 * width
            if stage > 0 and index == 0:  # projection: 1x1 conv and BatchNorm
                count += in_channels * width + 2 * width
            in_channels = width
    return count + 512 * num_classes + num_classes


def _efficientnet_b0_param_count(num_classes: int) -> int:
    """EfficientNet-B0's parameters, counted from its stage table."""
    count = 3 * 3 * 3 * 32 + 2 * 32  # stem conv and BatchNorm
    in_channels = 32
    for expand_ratio, width, repeats, _, kernel in B0_STAGES:
        for _ in range(repeats):
            hidden = in_channels * expand_ratio
            if expand_ratio != 1:
                count += in_channels * hidden + 2 * hidden
            count += kernel * kernel * hidden + 2 * hidden  # depthwise conv and BatchNorm
            reduced = max(1, in_channels // 4)  # squeeze-and-excitation, with biases
            count += hidden * reduced + reduced + reduced * hidden + hidden
            count += hidden * width + 2 * width  # projection and BatchNorm
            in_channels = width
    count += 320 * 1280 + 2 * 1280  # head conv and BatchNorm
    return count + 1280 * num_classes + num_classes


_CIFAR_MODELS = {
    "ResNet18": (lambda n, **kw: ResNet18(num_classes=n, **kw), _resnet18_param_count),
    # Stem stride 1 suits 32x32 inputs; stride 2 (the ImageNet network) must run on them too.
    "EfficientNetB0": (
        lambda n, **kw: EfficientNetB0(num_classes=n, stem_stride=1 if n == 10 else 2, **kw),
        _efficientnet_b0_param_count,
    ),
}
_CIFAR_CASES = [(name, n) for name in _CIFAR_MODELS for n in (10, 100)]
# Compiling a training step of the full EfficientNet-B0 takes XLA's CPU backend 15-40 s, so
# those cases are slow; a three-stage EfficientNet (same blocks, same head) stands in for it
# in the quick runs.
_SHALLOW_STAGES = (*B0_STAGES[:2], (6, 40, 1, 2, 5))
_STEP_MODELS = {
    "ResNet18-10": lambda: ResNet18(num_classes=10),
    "ResNet18-100": lambda: ResNet18(num_classes=100),
    "EfficientNetB0-3stages-10": lambda: EfficientNetB0(
        num_classes=10, stem_stride=1, stages=_SHALLOW_STAGES
    ),
    "EfficientNetB0-10": lambda: _cifar_model("EfficientNetB0", 10),
    "EfficientNetB0-100": lambda: _cifar_model("EfficientNetB0", 100),
}
_STEP_CASES = [
    pytest.param(name, marks=pytest.mark.slow, id=name)
    if name.startswith("EfficientNetB0-1")
    else pytest.param(name, id=name)
    for name in _STEP_MODELS
]


def _cifar_model(name: str, num_classes: int, **kwargs):
    return _CIFAR_MODELS[name][0](num_classes, **kwargs)


def _train_step(model, tx):
    """One training step and an evaluation pass of ``model``, as one function to jit."""

    def step(variables, opt_state, x, labels, key):
        params, batch_stats = variables["params"], variables["batch_stats"]

        def loss_fn(p):
            logits, updates = model.apply(
                {"params": p, "batch_stats": batch_stats},
                x,
                train=True,
                mutable=["batch_stats"],
                rngs={"dropout": key},
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, (logits, updates["batch_stats"])

        (loss, (logits, new_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        eval_logits, eval_updates = model.apply(
            {"params": new_params, "batch_stats": batch_stats},
            x,
            train=False,
            mutable=["batch_stats"],
        )
        return {
            "loss": loss,
            "logits": logits,
            "grads": grads,
            "params": new_params,
            "batch_stats": new_stats,
            "eval_logits": eval_logits,
            "eval_batch_stats": eval_updates["batch_stats"],
        }

    return step


@pytest.fixture(scope="module", params=_STEP_CASES)
def cifar_step(request):
    """Variables, and the outputs of one jitted adam step on a CIFAR-shaped batch of two."""
    model = _STEP_MODELS[request.param]()
    num_classes = model.num_classes
    x = _images((2, 32, 32, 3), seed=4) * 2.0 + 1.0
    labels = jnp.array([1, num_classes - 1])
    variables = _numpy_variables(_abstract_variables(model, x[:1], train=False))
    tx = optax.adam(1e-3)
    opt_state = tx.init(variables["params"])
    out = jax.jit(_train_step(model, tx))(variables, opt_state, x, labels, jax.random.key(5))
    return num_classes, variables, out


@pytest.mark.parametrize(("name", "num_classes"), [*_CIFAR_CASES, ("EfficientNetB0", 1000)])
def test_cifar_model_param_counts(name, num_classes):
    model = _cifar_model(name, num_classes)
    variables = _abstract_variables(model, jnp.zeros((1, 32, 32, 3)), train=False)
    count = _num_params(variables)
    assert count == _CIFAR_MODELS[name][1](num_classes)
    reference = _REFERENCE_PARAMS.get((name, num_classes))
    if reference is not None:
        assert abs(count - reference) <= 0.02 * reference
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(variables))


def test_cifar_model_exact_param_counts():
    assert _resnet18_param_count(10) == 11_173_962
    assert _efficientnet_b0_param_count(10) == 4_020_358
    assert _efficientnet_b0_param_count(1000) == 5_288_548


def test_resnet18_is_a_resnet_configuration():
    model = ResNet18(100)  # num_classes first, as for ResNet20
    assert isinstance(model, ResNet)
    assert model.num_classes == 100
    assert (tuple(model.stage_sizes), model.num_filters) == ((2, 2, 2, 2), 64)
    variables = _abstract_variables(model, jnp.zeros((1, 32, 32, 3)), train=False)
    params = variables["params"]
    assert params["Conv_0"]["kernel"].shape == (3, 3, 3, 64)  # 3x3 stem, 64 filters
    blocks = sorted(k for k in params if k.startswith("BasicBlock"))
    assert len(blocks) == 8
    assert [k for k in blocks if "Conv_2" in params[k]] == [
        "BasicBlock_2",
        "BasicBlock_4",
        "BasicBlock_6",
    ]
    assert params["BasicBlock_7"]["Conv_1"]["kernel"].shape == (3, 3, 512, 512)
    assert params["Dense_0"]["kernel"].shape == (512, 100)
    # Stride 1 in the stem and no max-pool: 32 -> 32 -> 16 -> 8 -> 4.
    _, state = jax.eval_shape(
        lambda v: model.apply(
            v, jnp.zeros((1, 32, 32, 3)), train=False, capture_intermediates=True
        ),
        variables,
    )
    assert state["intermediates"]["BasicBlock_7"]["__call__"][0].shape == (1, 4, 4, 512)
    assert state["intermediates"]["BasicBlock_0"]["__call__"][0].shape == (1, 32, 32, 64)


@pytest.mark.parametrize(("stem_stride", "final_size"), [(1, 2), (2, 1)])
def test_efficientnet_b0_structure(stem_stride, final_size):
    model = EfficientNetB0(num_classes=10, stem_stride=stem_stride)
    x = jnp.zeros((1, 32, 32, 3))
    variables = _abstract_variables(model, x, train=False)
    params = variables["params"]
    blocks = sorted(k for k in params if k.startswith("MBConv"))
    assert len(blocks) == sum(repeats for _, _, repeats, _, _ in B0_STAGES) == 16
    assert params["Conv_0"]["kernel"].shape == (3, 3, 3, 32)  # stem
    # The first block has no expansion: depthwise 3x3 on the stem's 32 channels, SE to 8.
    first = params["MBConv_0"]
    assert first["Conv_0"]["kernel"].shape == (3, 3, 1, 32)
    assert first["SqueezeExcitation_0"]["Conv_0"]["kernel"].shape == (1, 1, 32, 8)
    assert first["Conv_1"]["kernel"].shape == (1, 1, 32, 16)
    # The second expands 16 -> 96 channels, its SE bottleneck is a quarter of its input (4).
    second = params["MBConv_1"]
    assert second["Conv_0"]["kernel"].shape == (1, 1, 16, 96)
    assert second["Conv_1"]["kernel"].shape == (3, 3, 1, 96)  # depthwise
    assert second["SqueezeExcitation_0"]["Conv_0"]["kernel"].shape == (1, 1, 96, 4)
    assert params["MBConv_3"]["Conv_1"]["kernel"].shape == (5, 5, 1, 144)  # stage 3: 5x5
    assert params["Conv_1"]["kernel"].shape == (1, 1, 320, 1280)  # head
    assert params["Dense_0"]["kernel"].shape == (1280, 10)
    _, state = jax.eval_shape(
        lambda v: model.apply(v, x, train=False, capture_intermediates=True), variables
    )
    head = state["intermediates"]["Conv_1"]["__call__"][0]
    assert head.shape == (1, final_size, final_size, 1280)


def test_efficientnet_b0_dropout_needs_an_rng_in_train_mode_only():
    x = jnp.zeros((2, 32, 32, 3))
    model = EfficientNetB0(num_classes=10)
    variables = _abstract_variables(model, x, train=False)

    def run(model, train, **kwargs):
        return jax.eval_shape(
            lambda v: model.apply(v, x, train=train, mutable=["batch_stats"], **kwargs), variables
        )

    with pytest.raises(Exception, match="dropout"):
        run(model, train=True)
    run(model, train=True, rngs={"dropout": jax.random.key(0)})
    run(model, train=False)
    # Without dropout and stochastic depth nothing is random; with stochastic depth alone
    # the rng is needed again.
    run(EfficientNetB0(num_classes=10, dropout_rate=0.0), train=True)
    with pytest.raises(Exception, match="dropout"):
        run(EfficientNetB0(num_classes=10, dropout_rate=0.0, drop_path_rate=0.2), train=True)


@pytest.mark.slow
def test_cifar_model_train_step(cifar_step):
    num_classes, variables, out = cifar_step
    params = variables["params"]
    chex.assert_shape([out["logits"], out["eval_logits"]], (2, num_classes))
    chex.assert_tree_all_finite(
        [out["loss"], out["logits"], out["eval_logits"], out["grads"], out["params"]]
    )
    chex.assert_trees_all_equal_structs(out["grads"], params, out["params"])
    assert all(np.any(g != 0) for g in jax.tree.leaves(out["grads"]))
    # Adam moves every parameter that has a gradient.
    moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), params, out["params"])
    assert all(jax.tree.leaves(moved))


@pytest.mark.slow  # its module fixture compiles each model's step (test_cifar_model_train_step's)
def test_cifar_model_batch_stats_update_in_train_mode_only(cifar_step):
    _, variables, out = cifar_step
    old_stats = variables["batch_stats"]
    chex.assert_trees_all_equal_structs(old_stats, out["batch_stats"], out["eval_batch_stats"])
    changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), old_stats, out["batch_stats"])
    assert all(jax.tree.leaves(changed))
    unchanged = jax.tree.map(lambda a, b: bool(np.all(a == b)), old_stats, out["eval_batch_stats"])
    assert all(jax.tree.leaves(unchanged))


@pytest.mark.standard_promotion(
    "optax promotes inside its own transforms (integer leaves, MultiSteps, injected hyperparameters)"
)
@pytest.mark.parametrize("name", list(_CIFAR_MODELS))
def test_cifar_model_bfloat16_compute_keeps_float32_params(name):
    model = _cifar_model(name, 10, dtype=jnp.bfloat16)
    x = jnp.zeros((2, 32, 32, 3))
    variables = _abstract_variables(model, x[:1], train=False)
    chex.assert_type(jax.tree.leaves(variables), jnp.float32)

    def forward(params, batch_stats):
        logits, state = model.apply(
            {"params": params, "batch_stats": batch_stats},
            x,
            train=True,
            mutable=["batch_stats", "intermediates"],
            capture_intermediates=True,
            rngs={"dropout": jax.random.key(0)},
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.zeros(2, int)).mean()
        return loss, (logits, state)

    tx = optax.adam(1e-3)
    grads, (logits, state) = jax.eval_shape(
        jax.grad(forward, has_aux=True), variables["params"], variables["batch_stats"]
    )
    chex.assert_type(logits, jnp.bfloat16)
    # Every module's output (convolutions, BatchNorm, blocks, head) is bf16.
    activations = jax.tree.leaves(state["intermediates"])
    assert len(activations) > 20
    chex.assert_type(activations, jnp.bfloat16)
    chex.assert_type(jax.tree.leaves((state["batch_stats"], grads)), jnp.float32)
    new_params = jax.eval_shape(
        lambda p, g: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]),
        variables["params"],
        grads,
    )
    chex.assert_type(jax.tree.leaves(new_params), jnp.float32)
