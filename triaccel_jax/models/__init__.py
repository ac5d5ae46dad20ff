"""Flax Linen models used in triaccel_jax's tests, examples and benchmarks."""

from triaccel_jax.models._efficientnet import EfficientNetB0
from triaccel_jax.models._norm import BatchNorm
from triaccel_jax.models._resnet import ResNet18
from triaccel_jax.models._resnet import ResNet20
from triaccel_jax.models._small_cnn import SmallCNN

__all__ = ["BatchNorm", "EfficientNetB0", "ResNet18", "ResNet20", "SmallCNN"]
