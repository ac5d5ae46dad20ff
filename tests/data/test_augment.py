"""CIFAR normalisation and random crop + flip: exact windows, flip rate, keys, jit and vmap."""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triaccel_jax.data import CIFAR10_MEAN
from triaccel_jax.data import CIFAR10_STD
from triaccel_jax.data import CIFAR100_MEAN
from triaccel_jax.data import CIFAR100_STD
from triaccel_jax.data import normalize
from triaccel_jax.data import random_crop_flip


def _images(n, size=32, seed=0):
    # Positive and distinct pixels: a window can match the output at one offset only.
    return np.random.default_rng(seed).uniform(0.01, 1.0, (n, size, size, 3)).astype(np.float32)


def _windows(image, out, padding):
    """The (top, left, flipped) windows of the zero-padded ``image`` that equal ``out``."""
    padded = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))
    height, width = image.shape[:2]
    found = []
    for top, left in itertools.product(range(2 * padding + 1), repeat=2):
        window = padded[top : top + height, left : left + width]
        found += [(top, left, False)] if np.array_equal(window, out) else []
        found += [(top, left, True)] if np.array_equal(window[:, ::-1], out) else []
    return found


def test_shape_and_dtype_under_jit():
    step = jax.jit(lambda key, images: random_crop_flip(key, images, padding=2))
    for images in (_images(4), (_images(4) * 255).astype(np.uint8)):
        out = step(jax.random.key(0), images)
        chex.assert_trees_all_equal_shapes_and_dtypes(out, images)
    with pytest.raises(ValueError, match="batch"):
        random_crop_flip(jax.random.key(0), _images(1)[0])


def test_no_padding_and_no_flip_is_the_identity():
    images = _images(8)
    out = random_crop_flip(jax.random.key(3), images, padding=0, flip=False)
    np.testing.assert_array_equal(out, images)


def test_flips_about_half_of_the_images():
    images = _images(1000, size=8)
    out = np.asarray(random_crop_flip(jax.random.key(0), images, padding=0))
    same = np.all(out == images, axis=(1, 2, 3))
    flipped = np.all(out == images[:, :, ::-1], axis=(1, 2, 3))
    assert np.all(same ^ flipped)  # each image is either untouched or mirrored, never both
    assert 440 <= flipped.sum() <= 560  # Binomial(1000, 1/2): mean 500, sd 16


def test_every_output_is_one_shifted_window_of_the_padded_input():
    images = _images(12)
    out = np.asarray(random_crop_flip(jax.random.key(7), images, padding=4))
    found = [_windows(image, crop, 4) for image, crop in zip(images, out, strict=True)]
    assert all(len(windows) == 1 for windows in found), found
    offsets = {windows[0][:2] for windows in found}
    assert len(offsets) > 6  # different per image
    assert 0 < sum(windows[0][2] for windows in found) < 12


def test_offsets_cover_the_whole_range():
    images = _images(400, size=6)
    out = np.asarray(random_crop_flip(jax.random.key(1), images, padding=2))
    offsets = {_windows(image, crop, 2)[0] for image, crop in zip(images, out, strict=True)}
    assert offsets == set(itertools.product(range(5), range(5), (False, True)))


def test_deterministic_for_a_key_and_different_across_keys():
    images = _images(16)
    first = random_crop_flip(jax.random.key(0), images)
    np.testing.assert_array_equal(first, random_crop_flip(jax.random.key(0), images))
    np.testing.assert_array_equal(first, random_crop_flip(jax.random.PRNGKey(0), images))
    other = random_crop_flip(jax.random.key(1), images)
    assert not np.array_equal(first, other)


def test_vmap_over_keys_and_batches():
    batches = _images(3 * 5).reshape(3, 5, 32, 32, 3)
    keys = jax.random.split(jax.random.key(2), 3)
    out = jax.jit(jax.vmap(random_crop_flip))(keys, batches)
    for key, batch, got in zip(keys, batches, out, strict=True):
        np.testing.assert_array_equal(got, random_crop_flip(key, batch))


def test_normalize():
    images = _images(2)
    for mean, std in ((CIFAR10_MEAN, CIFAR10_STD), (CIFAR100_MEAN, CIFAR100_STD)):
        assert len(mean) == len(std) == 3
        assert all(0.4 < m < 0.52 for m in mean) and all(0.24 < s < 0.28 for s in std)
        out = jax.jit(normalize)(images, mean, std)
        chex.assert_shape(out, images.shape)
        chex.assert_type(out, jnp.float32)
        want = (images - np.float32(mean)) / np.float32(std)
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    constant = jnp.broadcast_to(jnp.asarray(CIFAR10_MEAN), (1, 4, 4, 3))
    assert float(jnp.abs(normalize(constant, CIFAR10_MEAN, CIFAR10_STD)).max()) < 1e-6
    with pytest.raises(ValueError, match="one value per channel"):
        normalize(images, (0.5,), (0.5, 0.5))
    with pytest.raises(TypeError, match="divide by 255"):
        normalize(np.zeros((1, 2, 2, 3), np.uint8), CIFAR10_MEAN, CIFAR10_STD)
