"""Offline data sets as numpy arrays: Fashion-MNIST (Debian's package) and scikit-learn's digits."""

from triaccel_jax.data._arrays import FASHION_MNIST_DIR
from triaccel_jax.data._arrays import ArraySplit
from triaccel_jax.data._arrays import load_digits
from triaccel_jax.data._arrays import load_fashion_mnist

__all__ = ("FASHION_MNIST_DIR", "ArraySplit", "load_digits", "load_fashion_mnist")
