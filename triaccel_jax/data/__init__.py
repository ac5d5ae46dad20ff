"""Offline data sets as numpy arrays, CIFAR through tensorflow-datasets, and CIFAR augmentation.

Fashion-MNIST is read from its IDX files wherever they are (``directory=`` / the main job's
``--data-dir``, ``$TRIACCEL_DATA_DIR``, Debian's ``dataset-fashion-mnist``; see
:func:`find_fashion_mnist`); :func:`download_fashion_mnist` fetches them from the official source
with checksums, only when called. scikit-learn's digits need no download; CIFAR-10/100 are
prepared offline from the official archive (see :func:`load_cifar`).
"""

from triaccel_jax.data._arrays import FASHION_MNIST_DIR
from triaccel_jax.data._arrays import ArraySplit
from triaccel_jax.data._arrays import load_digits
from triaccel_jax.data._arrays import load_fashion_mnist
from triaccel_jax.data._augment import CIFAR10_MEAN
from triaccel_jax.data._augment import CIFAR10_STD
from triaccel_jax.data._augment import CIFAR100_MEAN
from triaccel_jax.data._augment import CIFAR100_STD
from triaccel_jax.data._augment import normalize
from triaccel_jax.data._augment import random_crop_flip
from triaccel_jax.data._fashion_mnist import DATA_DIR_ENV
from triaccel_jax.data._fashion_mnist import default_data_dir
from triaccel_jax.data._fashion_mnist import download_fashion_mnist
from triaccel_jax.data._fashion_mnist import fashion_mnist_not_found_message
from triaccel_jax.data._fashion_mnist import find_fashion_mnist
from triaccel_jax.data._tfds import CifarNotFoundError
from triaccel_jax.data._tfds import load_cifar
from triaccel_jax.data._tfds import prepare_cifar

__all__ = (
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "DATA_DIR_ENV",
    "FASHION_MNIST_DIR",
    "ArraySplit",
    "CifarNotFoundError",
    "default_data_dir",
    "download_fashion_mnist",
    "fashion_mnist_not_found_message",
    "find_fashion_mnist",
    "load_cifar",
    "load_digits",
    "load_fashion_mnist",
    "normalize",
    "prepare_cifar",
    "random_crop_flip",
)
