"""CIFAR normalisation and the standard light augmentation (random crop of a padded image + flip).

Both are pure JAX and work under :func:`jax.jit` and :func:`jax.vmap`. The usual order, as in
the ResNet paper and torchvision's CIFAR recipes: augment the [0, 1] images of each training
batch, then normalise; normalise the test images only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Per-channel (red, green, blue) mean and standard deviation of the 50,000 training images, in
# [0, 1], over all their pixels. (The often-quoted CIFAR-10 std (0.2023, 0.1994, 0.2010) is the
# mean of per-image stds, not the std of the pixels.)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


def normalize(images: jax.Array, mean, std) -> jax.Array:
    """``(images - mean) / std`` per channel, the channels last (NHWC or HWC).

    Args:
      images: floating-point images in [0, 1], channels last.
      mean: one value per channel, e.g. :data:`CIFAR10_MEAN`.
      std: one value per channel, e.g. :data:`CIFAR10_STD`.

    Returns:
      The normalised images, of the dtype of ``images``.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.data import CIFAR10_MEAN, CIFAR10_STD, normalize
      >>> images = jnp.broadcast_to(jnp.asarray(CIFAR10_MEAN), (2, 32, 32, 3))
      >>> out = normalize(images, CIFAR10_MEAN, CIFAR10_STD)
      >>> out.shape, out.dtype, float(abs(out).max()) < 1e-6
      ((2, 32, 32, 3), dtype('float32'), True)
    """
    images = jnp.asarray(images)
    if not jnp.issubdtype(images.dtype, jnp.floating):
        raise TypeError(
            f"normalize needs floating-point images in [0, 1], got {images.dtype}: "
            "divide by 255 first"
        )
    mean = jnp.asarray(mean, images.dtype)
    std = jnp.asarray(std, images.dtype)
    if mean.shape != (images.shape[-1],) or std.shape != (images.shape[-1],):
        raise ValueError(
            f"mean and std need one value per channel ({images.shape[-1]}, channels last), "
            f"got shapes {mean.shape} and {std.shape}"
        )
    return (images - mean) / std


@functools.partial(jax.jit, static_argnames=("padding", "flip"))
def random_crop_flip(
    key: jax.Array, images: jax.Array, *, padding: int = 4, flip: bool = True
) -> jax.Array:
    """Random crop of the zero-padded image back to its size, and a random horizontal flip.

    Each image of the batch gets its own offsets, uniform in ``0 .. 2 * padding`` down and
    across, and is mirrored left-right with probability 1/2, all drawn from ``key``: the same key
    gives the same batch. The padding is zeros (black for [0, 1] images, so augment before
    :func:`normalize`), as in the ResNet paper's CIFAR set-up and torchvision's
    ``RandomCrop(32, padding=4)``.

    Args:
      key: a JAX random key.
      images: ``(n, height, width, channels)``, any dtype.
      padding: pixels of zeros added on each side before cropping; 0 crops nothing.
      flip: whether to flip; False only crops.

    Returns:
      The augmented images, of the shape and dtype of ``images``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.data import random_crop_flip
      >>> images = jax.random.uniform(jax.random.key(1), (8, 32, 32, 3))
      >>> out = random_crop_flip(jax.random.key(0), images)
      >>> out.shape, out.dtype
      ((8, 32, 32, 3), dtype('float32'))
      >>> same = random_crop_flip(jax.random.key(0), images, padding=0, flip=False)
      >>> bool((same == images).all())
      True
    """
    if images.ndim != 4:
        raise ValueError(f"images must be a batch (n, height, width, channels), got {images.shape}")
    if padding < 0:
        raise ValueError(f"`padding` must be >= 0, got {padding}")
    _, height, width, _ = images.shape

    def one(key, image):
        crop_key, flip_key = jax.random.split(key)
        top, left = jax.random.randint(crop_key, (2,), 0, 2 * padding + 1)
        padded = jnp.pad(image, ((padding, padding), (padding, padding), (0, 0)))
        out = jax.lax.dynamic_slice(padded, (top, left, 0), (height, width, image.shape[-1]))
        if flip:
            out = jnp.where(jax.random.bernoulli(flip_key), out[:, ::-1], out)
        return out

    return jax.vmap(one)(jax.random.split(key, images.shape[0]), images)
