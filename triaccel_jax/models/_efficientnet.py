"""EfficientNet-B0 (Tan & Le, 2019), in Flax Linen.

The network is a stem convolution, a table of stages of mobile inverted bottleneck
(:class:`MBConv`) blocks with squeeze-and-excitation, a 1x1 head convolution,
global average pooling, dropout and a dense classifier. Only B0 is provided: the
scaled variants B1-B7 would change the resolution, the widths and the repeats.
"""

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax

from triaccel_jax.models._norm import batch_norm_factory as _batch_norm

# He et al.'s fan-in scaling, as for the ResNets of this package; for a depthwise
# kernel (k, k, 1, C) the fan-in is the k * k inputs each output sees.
_conv_init = nn.initializers.he_normal()

# EfficientNet-B0's stages (Tan & Le, 2019, Table 1): expand ratio, output channels,
# repeats, stride of the first block, depthwise kernel size.
B0_STAGES: tuple[tuple[int, int, int, int, int], ...] = (
    (1, 16, 1, 1, 3),
    (6, 24, 2, 2, 3),
    (6, 40, 2, 2, 5),
    (6, 80, 3, 2, 3),
    (6, 112, 3, 1, 5),
    (6, 192, 4, 2, 5),
    (6, 320, 1, 1, 3),
)

_STEM_FEATURES = 32
_HEAD_FEATURES = 1280


class SqueezeExcitation(nn.Module):
    """Channel gating by a bottleneck over globally pooled features (Hu et al., 2018).

    The NHWC input is averaged over space, passed through a 1x1 convolution to
    ``reduced_features`` channels, a swish, and a 1x1 convolution back to the input's
    channels; the sigmoid of the result scales the input channel-wise. Both
    convolutions have biases (no BatchNorm follows them).

    Attributes:
        reduced_features: Channels of the bottleneck.
        dtype: Computation dtype; parameters stay float32.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from triaccel_jax.models._efficientnet import SqueezeExcitation
        >>> se = SqueezeExcitation(reduced_features=4)
        >>> x = jnp.ones((2, 8, 8, 16))
        >>> variables = jax.jit(se.init)(jax.random.key(0), x)
        >>> jax.jit(se.apply)(variables, x).shape
        (2, 8, 8, 16)
    """

    reduced_features: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Returns ``x`` scaled by per-sample, per-channel gates in (0, 1)."""
        s = x.mean(axis=(1, 2), keepdims=True)
        s = nn.Conv(self.reduced_features, (1, 1), kernel_init=_conv_init, dtype=self.dtype)(s)
        s = nn.swish(s)
        s = nn.Conv(x.shape[-1], (1, 1), kernel_init=_conv_init, dtype=self.dtype)(s)
        return x * nn.sigmoid(s)


class MBConv(nn.Module):
    """Mobile inverted bottleneck block (Sandler et al., 2018) with squeeze-and-excitation.

    A 1x1 expansion convolution to ``expand_ratio`` times the input channels (omitted
    when the ratio is 1), a depthwise ``kernel_size`` convolution with stride
    ``strides``, squeeze-and-excitation whose bottleneck has ``se_ratio`` times the
    block's *input* channels, and a linear 1x1 projection to ``features`` channels.
    Every convolution is followed by BatchNorm, and all but the projection by a swish.
    The input is added back when the stride is 1 and the channels are unchanged; on
    that residual branch, ``drop_path_rate > 0`` drops the whole block for a random
    subset of the samples in training (stochastic depth, Huang et al., 2016), which
    then needs a ``'dropout'`` rng.

    Attributes:
        features: Output channels.
        expand_ratio: Hidden channels as a multiple of the input channels.
        kernel_size: Size of the square depthwise kernel.
        strides: Stride of the depthwise convolution.
        se_ratio: Squeeze-and-excitation bottleneck as a fraction of the input
            channels; 0 disables it.
        drop_path_rate: Probability of dropping the residual branch in training.
        dtype: Computation dtype; parameters stay float32.
        bn_momentum: Decay of BatchNorm's running averages.
        bn_epsilon: BatchNorm's variance epsilon.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from triaccel_jax.models._efficientnet import MBConv
        >>> block = MBConv(features=24, expand_ratio=6, kernel_size=3, strides=2)
        >>> x = jnp.zeros((2, 8, 8, 16))
        >>> variables = jax.jit(lambda key: block.init(key, x, train=False))(jax.random.key(0))
        >>> jax.jit(lambda v: block.apply(v, x, train=False))(variables).shape
        (2, 4, 4, 24)
    """

    features: int
    expand_ratio: int = 6
    kernel_size: int = 3
    strides: int = 1
    se_ratio: float = 0.25
    drop_path_rate: float = 0.0
    dtype: Any = None
    bn_momentum: float = 0.99
    bn_epsilon: float = 1e-3

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        """Applies the block.

        Args:
            x: NHWC activations.
            train: If true, BatchNorm normalises with batch statistics and updates
                the running averages in the ``batch_stats`` collection, and
                stochastic depth (if enabled) is applied.

        Returns:
            NHWC activations with ``features`` channels, spatially downsampled by
            ``strides``.
        """
        norm = _batch_norm(train, self.dtype, self.bn_momentum, self.bn_epsilon)
        in_features = x.shape[-1]

        y = x
        if self.expand_ratio != 1:
            y = _conv(in_features * self.expand_ratio, (1, 1), 1, self.dtype)(y)
            y = nn.swish(norm()(y))
        hidden = y.shape[-1]
        kernel = (self.kernel_size, self.kernel_size)
        y = _conv(hidden, kernel, self.strides, self.dtype, groups=hidden)(y)
        y = nn.swish(norm()(y))
        if self.se_ratio > 0:
            reduced = max(1, int(in_features * self.se_ratio))
            y = SqueezeExcitation(reduced, dtype=self.dtype)(y)
        y = _conv(self.features, (1, 1), 1, self.dtype)(y)
        y = norm()(y)

        if self.strides == 1 and in_features == self.features:
            # Per-sample dropout of the branch: the mask is broadcast over H, W, C.
            y = nn.Dropout(self.drop_path_rate, broadcast_dims=(1, 2, 3))(
                y, deterministic=not train
            )
            y = y + x
        return y


class EfficientNetB0(nn.Module):
    """EfficientNet-B0 (Tan & Le, 2019): MBConv stages with squeeze-and-excitation.

    A 3x3 stem convolution with 32 filters and stride ``stem_stride``, the seven
    stages of :data:`B0_STAGES` (16 :class:`MBConv` blocks with squeeze-and-excitation
    ratio 0.25), a 1x1 head convolution to 1280 channels, global average pooling,
    dropout and a dense classifier; swish activations throughout. With a 1000-class
    head it has 5,288,548 parameters, as the reference implementations; 4,020,358
    with ten classes and 4,135,648 with a hundred. BatchNorm follows the reference
    (momentum 0.99, epsilon 1e-3) and its running statistics are in ``batch_stats``.

    ``stem_stride=2`` is the paper's ImageNet network (224x224 inputs, 7x7 final
    features). For 32x32 inputs such as CIFAR-10/100, ``stem_stride=1`` keeps a 2x2
    final feature map instead of 1x1.

    Stochastic depth is optional and off by default (``drop_path_rate=0``); the
    paper trains with 0.2 (survival probability 0.8). As in the reference
    implementation, block ``i`` of ``n`` drops its branch with probability
    ``drop_path_rate * i / n``.

    In training (``train=True``) the dropout before the classifier, and stochastic
    depth if enabled, need a ``'dropout'`` rng:
    ``model.apply(variables, x, train=True, mutable=["batch_stats"],
    rngs={"dropout": key})``. In evaluation both are deterministic and no rng is
    needed.

    Attributes:
        num_classes: Number of output logits.
        stem_stride: Stride of the stem convolution: 2 for ImageNet-size inputs,
            1 for 32x32 inputs.
        dropout_rate: Dropout rate before the classifier.
        drop_path_rate: Stochastic depth rate, scaled by ``i / n`` for block ``i`` of ``n``.
        stages: Stage table of ``(expand ratio, channels, repeats, stride, kernel)``.
        dtype: Computation dtype; parameters stay float32.
        bn_momentum: Decay of BatchNorm's running averages.
        bn_epsilon: BatchNorm's variance epsilon.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from triaccel_jax.models import EfficientNetB0
        >>> model = EfficientNetB0(num_classes=10, stem_stride=1)
        >>> x = jnp.zeros((2, 32, 32, 3))
        >>> init = lambda: model.init(jax.random.key(0), x, train=False)
        >>> variables = jax.eval_shape(init)  # shapes only; jax.jit(init)() to draw them
        >>> sum(p.size for p in jax.tree.leaves(variables["params"]))
        4020358
        >>> def train_logits(variables, key):
        ...     logits, updates = model.apply(
        ...         variables, x, train=True, mutable=["batch_stats"], rngs={"dropout": key}
        ...     )
        ...     return logits
        >>> jax.eval_shape(train_logits, variables, jax.random.key(1)).shape
        (2, 10)
    """

    num_classes: int = 10
    stem_stride: int = 2
    dropout_rate: float = 0.2
    drop_path_rate: float = 0.0
    stages: Sequence[tuple[int, int, int, int, int]] = B0_STAGES
    dtype: Any = None
    bn_momentum: float = 0.99
    bn_epsilon: float = 1e-3

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        """Returns the logits for a batch of NHWC images.

        Args:
            x: Images of shape ``(batch, height, width, channels)``.
            train: If true, BatchNorm uses batch statistics and updates the
                ``batch_stats`` collection, which must then be passed as mutable
                (``model.apply(..., mutable=["batch_stats"])``), and dropout (and
                stochastic depth) draw from the ``'dropout'`` rng. If false, the
                stored running averages are used, nothing is updated and nothing is
                random.

        Returns:
            Logits of shape ``(batch, num_classes)``.
        """
        norm = _batch_norm(train, self.dtype, self.bn_momentum, self.bn_epsilon)
        x = _conv(_STEM_FEATURES, (3, 3), self.stem_stride, self.dtype)(x)
        x = nn.swish(norm()(x))

        num_blocks = sum(repeats for _, _, repeats, _, _ in self.stages)
        index = 0
        for expand_ratio, features, repeats, strides, kernel_size in self.stages:
            for repeat in range(repeats):
                x = MBConv(
                    features=features,
                    expand_ratio=expand_ratio,
                    kernel_size=kernel_size,
                    # Only the first block of a stage changes the resolution.
                    strides=strides if repeat == 0 else 1,
                    drop_path_rate=self.drop_path_rate * index / num_blocks,
                    dtype=self.dtype,
                    bn_momentum=self.bn_momentum,
                    bn_epsilon=self.bn_epsilon,
                )(x, train=train)
                index += 1

        x = _conv(_HEAD_FEATURES, (1, 1), 1, self.dtype)(x)
        x = nn.swish(norm()(x))
        x = x.mean(axis=(1, 2))
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        return nn.Dense(self.num_classes, dtype=self.dtype)(x)


def _conv(
    features: int, kernel_size: tuple[int, int], strides: int, dtype: Any, groups: int = 1
) -> nn.Conv:
    # No bias: every convolution here is followed by BatchNorm, whose shift makes a
    # bias redundant. ``groups == features`` makes a depthwise convolution.
    return nn.Conv(
        features,
        kernel_size=kernel_size,
        strides=(strides, strides),
        padding="SAME",
        feature_group_count=groups,
        use_bias=False,
        kernel_init=_conv_init,
        dtype=dtype,
    )
