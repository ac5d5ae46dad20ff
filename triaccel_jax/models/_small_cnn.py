"""A small convolutional classifier that trains quickly on CPU."""

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax


class SmallCNN(nn.Module):
    """Two conv blocks followed by a two-layer MLP head.

    Each block is a 3x3 ``SAME`` convolution, a ReLU and a 2x2 average pool, so
    a 28x28 input is reduced to 7x7 before the head. Inputs are NHWC and conv
    kernels are stored in Flax's HWIO layout.

    Attributes:
        num_classes: Number of output logits.
        features: Output channels of each conv block; one block per entry.
        dense: Width of the hidden dense layer.
        dtype: Computation dtype (e.g. ``jnp.bfloat16``); parameters stay float32.
            ``None`` lets Flax infer it from the inputs.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from triaccel_jax.models import SmallCNN
        >>> model = SmallCNN(num_classes=10)
        >>> x = jnp.zeros((4, 28, 28, 1))
        >>> variables = model.init(jax.random.key(0), x)
        >>> model.apply(variables, x).shape
        (4, 10)
    """

    num_classes: int = 10
    features: Sequence[int] = (32, 64)
    dense: int = 128
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the logits for a batch of NHWC images.

        Args:
            x: Images of shape ``(batch, height, width, channels)``.
            train: Unused. Accepted so that training code can call every model in
                this package the same way; this model has no train-time behaviour.

        Returns:
            Logits of shape ``(batch, num_classes)``.
        """
        del train
        for width in self.features:
            x = nn.Conv(width, kernel_size=(3, 3), padding="SAME", dtype=self.dtype)(x)
            x = nn.relu(x)
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(self.dense, dtype=self.dtype)(x))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x)
