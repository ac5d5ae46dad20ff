"""Residual networks for small images (He et al., 2016), in Flax Linen.

The network is assembled from a generic :class:`ResNet` and a residual block
class, so deeper or wider variants are a matter of configuration.
"""

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax

from triaccel_jax.models._norm import batch_norm_factory as _batch_norm

# He et al. initialise convolutions for ReLU networks with fan-in scaling.
_conv_init = nn.initializers.he_normal()


class BasicBlock(nn.Module):
    """Two 3x3 conv-BatchNorm layers with a residual shortcut.

    The shortcut is the identity when the input already has the output shape,
    and a 1x1 strided convolution followed by BatchNorm (a projection) when the
    stride or the channel count changes.

    Attributes:
        features: Output channels of both convolutions.
        strides: Stride of the first convolution (and of the projection).
        dtype: Computation dtype; parameters stay float32.
        bn_momentum: Decay of BatchNorm's running averages.
        bn_epsilon: BatchNorm's variance epsilon.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from triaccel_jax.models._resnet import BasicBlock
        >>> block = BasicBlock(features=32, strides=2)
        >>> x = jnp.zeros((2, 8, 8, 16))
        >>> variables = jax.jit(lambda key: block.init(key, x, train=False))(jax.random.key(0))
        >>> jax.jit(lambda v: block.apply(v, x, train=False))(variables).shape
        (2, 4, 4, 32)
    """

    features: int
    strides: int = 1
    dtype: Any = None
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        """Applies the block.

        Args:
            x: NHWC activations.
            train: If true, BatchNorm normalises with batch statistics and updates
                the running averages in the ``batch_stats`` collection.

        Returns:
            NHWC activations with ``features`` channels, spatially downsampled by
            ``strides``.
        """
        norm = _batch_norm(train, self.dtype, self.bn_momentum, self.bn_epsilon)
        strides = (self.strides, self.strides)

        y = _conv(self.features, (3, 3), strides, self.dtype)(x)
        y = nn.relu(norm()(y))
        y = _conv(self.features, (3, 3), (1, 1), self.dtype)(y)
        y = norm()(y)

        shortcut = x
        if x.shape[-1] != self.features or self.strides != 1:
            shortcut = _conv(self.features, (1, 1), strides, self.dtype)(x)
            shortcut = norm()(shortcut)
        return nn.relu(y + shortcut)


class ResNet(nn.Module):
    """A ResNet for small images: 3x3 stem, residual stages, global pooling.

    Stage ``i`` has ``num_filters * 2**i`` channels and ``stage_sizes[i]``
    blocks; every stage after the first halves the spatial size in its first
    block. There is no max-pool in the stem, as in the CIFAR networks of
    He et al. (2016).

    The defaults give ResNet-20; other depths and widths are configurations,
    e.g. ``ResNet(stage_sizes=(2, 2, 2, 2), num_filters=64)`` is the CIFAR
    variant of ResNet-18.

    Attributes:
        num_classes: Number of output logits.
        stage_sizes: Number of residual blocks in each stage.
        block_cls: Residual block class, constructed as
            ``block_cls(features=..., strides=..., dtype=...)`` and called as
            ``block(x, train=...)``.
        num_filters: Channels of the stem and of the first stage.
        dtype: Computation dtype; parameters stay float32.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from triaccel_jax.models._resnet import ResNet
        >>> model = ResNet(stage_sizes=(1, 1), num_filters=8, num_classes=5)
        >>> x = jnp.zeros((2, 16, 16, 3))
        >>> # Shapes only (nothing is computed); jax.jit(init)(key) draws the variables.
        >>> init = lambda key: model.init(key, x, train=False)
        >>> variables = jax.eval_shape(init, jax.random.key(0))
        >>> jax.eval_shape(lambda v: model.apply(v, x, train=False), variables).shape
        (2, 5)
    """

    # num_classes comes first so that ``ResNet20(10)`` means ten classes; the
    # structural defaults are ResNet-20's.
    num_classes: int = 10
    stage_sizes: Sequence[int] = (3, 3, 3)
    block_cls: type[nn.Module] = BasicBlock
    num_filters: int = 16
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        """Returns the logits for a batch of NHWC images.

        Args:
            x: Images of shape ``(batch, height, width, channels)``.
            train: If true, BatchNorm uses batch statistics and updates the
                ``batch_stats`` collection, which must then be passed as mutable
                (``model.apply(..., mutable=["batch_stats"])``). If false, the stored
                running averages are used and nothing is updated.

        Returns:
            Logits of shape ``(batch, num_classes)``.
        """
        x = _conv(self.num_filters, (3, 3), (1, 1), self.dtype)(x)
        x = nn.relu(_batch_norm(train, self.dtype)()(x))
        for stage, num_blocks in enumerate(self.stage_sizes):
            for index in range(num_blocks):
                # Only the first block of a later stage changes the resolution.
                strides = 2 if stage > 0 and index == 0 else 1
                x = self.block_cls(
                    features=self.num_filters * 2**stage, strides=strides, dtype=self.dtype
                )(x, train=train)
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x)


class ResNet20(ResNet):
    """ResNet-20 for 32x32 images (He et al., 2016, Section 4.2).

    Three stages of three :class:`BasicBlock` s with 16, 32 and 64 filters, and
    projection shortcuts where the shape changes: 272,474 parameters for ten
    classes. The attributes are those of :class:`ResNet`, whose defaults are
    this configuration.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from triaccel_jax.models import ResNet20
        >>> model = ResNet20(num_classes=10)
        >>> x = jnp.zeros((2, 32, 32, 3))
        >>> # Shapes only (nothing is computed); jax.jit(init)(key) draws the variables.
        >>> init = lambda key: model.init(key, x, train=False)
        >>> variables = jax.eval_shape(init, jax.random.key(0))
        >>> train = lambda v: model.apply(v, x, train=True, mutable=["batch_stats"])
        >>> logits, updates = jax.eval_shape(train, variables)
        >>> logits.shape
        (2, 10)
    """


class ResNet18(ResNet):
    """ResNet-18 for 32x32 images, the CIFAR variant of He et al. (2016).

    The ImageNet ResNet-18's four stages of two :class:`BasicBlock` s with 64, 128,
    256 and 512 filters (stride 2 at the start of stages 2-4), with the stem of the
    CIFAR networks: one 3x3 convolution with 64 filters and stride 1, and no
    max-pool. With projection shortcuts where the shape changes it has 11,173,962
    parameters for ten classes (11,220,132 for a hundred). The attributes are those
    of :class:`ResNet`; only the defaults of ``stage_sizes`` (``(2, 2, 2, 2)``) and
    ``num_filters`` (64) differ.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from triaccel_jax.models import ResNet18
        >>> model = ResNet18(num_classes=100)
        >>> x = jnp.zeros((2, 32, 32, 3))
        >>> variables = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
        >>> variables["params"]["Dense_0"]["kernel"].shape
        (512, 100)
    """

    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    num_filters: int = 64


def _conv(
    features: int, kernel_size: tuple[int, int], strides: tuple[int, int], dtype: Any
) -> nn.Conv:
    # No bias: every convolution is followed by BatchNorm, whose shift makes a
    # bias redundant.
    return nn.Conv(
        features,
        kernel_size=kernel_size,
        strides=strides,
        padding="SAME",
        use_bias=False,
        kernel_init=_conv_init,
        dtype=dtype,
    )
