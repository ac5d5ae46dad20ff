"""Flax Linen models used in triaccel_jax's tests, examples and benchmarks.

SmallCNN, ResNet-20 (CIFAR), ResNet-18 (CIFAR-style stem), EfficientNet-B0 and the BatchNorm
they share. They need Flax, the ``flax`` extra: without it, importing this package raises an
``ImportError`` that says ``pip install -e '.[flax]'``.
"""

from triaccel_jax._src import extras as _extras

# Before the models import Flax, so that a missing Flax names the extra (imports after code):
# ruff: noqa: E402
_extras.require("flax", "triaccel_jax.models")

from triaccel_jax.models._efficientnet import EfficientNetB0
from triaccel_jax.models._norm import BatchNorm
from triaccel_jax.models._resnet import ResNet18
from triaccel_jax.models._resnet import ResNet20
from triaccel_jax.models._small_cnn import SmallCNN

__all__ = ["BatchNorm", "EfficientNetB0", "ResNet18", "ResNet20", "SmallCNN"]
