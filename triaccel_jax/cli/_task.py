"""The main job's task: its data set, its model and the loss the controller trains.

Data come from :mod:`triaccel_jax.data` (Fashion-MNIST, digits or CIFAR), models from
:mod:`triaccel_jax.models`; the loss computes in the precision policy in force through
:func:`triaccel_jax.flax.apply_with_policy` (which casts the masters itself).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from triaccel_jax.flax import apply_with_policy

MODELS = ("auto", "small_cnn", "resnet20", "resnet18", "efficientnet_b0")


@dataclasses.dataclass
class Data:
    """A data set as arrays: ``{"image", "label"}`` per split, and how to preprocess it."""

    name: str
    train: dict[str, np.ndarray]
    test: dict[str, np.ndarray]
    num_classes: int
    channel_stats: tuple[Any, Any] | None  # CIFAR: (mean, std); crop, flip and normalise


def to_image_shape(images: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """``images`` (N, H, W, C) zero-padded (centred) to ``shape[:2]`` and, from one channel,
    replicated to ``shape[2]``: Fashion-MNIST as 32x32x3, the input of a CIFAR ResNet-18.

    Example::

      >>> to_image_shape(np.ones((2, 28, 28, 1), np.float32), (32, 32, 3)).shape
      (2, 32, 32, 3)
    """
    height, width, channels = shape
    _, h, w, c = images.shape
    if h > height or w > width or c not in (1, channels):
        raise ValueError(
            f"cannot make images of shape {images.shape[1:]} into {shape}: only padding, and "
            "replicating one channel, are done"
        )
    top, left = (height - h) // 2, (width - w) // 2
    padded = np.pad(images, ((0, 0), (top, height - h - top), (left, width - w - left), (0, 0)))
    return np.repeat(padded, channels // c, axis=-1) if c == 1 else padded


def load_data(
    name: str,
    *,
    data_dir: str | None,
    train_subset: int | None,
    test_subset: int | None,
    image_shape: tuple[int, int, int] | None = None,
):
    """The data set ``name`` (as :func:`triaccel_jax.cli._data_source.resolve` chose it), its
    images padded and replicated to ``image_shape`` if given (see :func:`to_image_shape`).

    Fashion-MNIST is read where :func:`triaccel_jax.data.find_fashion_mnist` finds it
    (``data_dir``, ``$TRIACCEL_DATA_DIR``, Debian's folder).
    """
    from triaccel_jax import data as data_lib

    if name == "fashion_mnist":
        train = data_lib.load_fashion_mnist("train", data_dir)
        test = data_lib.load_fashion_mnist("test", data_dir)
        classes, stats = 10, None
    elif name == "digits":
        train, test = data_lib.load_digits("train"), data_lib.load_digits("test")
        classes, stats = 10, None
    else:
        train = data_lib.load_cifar(name, "train", data_dir=data_dir)
        test = data_lib.load_cifar(name, "test", data_dir=data_dir)
        classes = 10 if name == "cifar10" else 100
        stats = (
            (data_lib.CIFAR10_MEAN, data_lib.CIFAR10_STD)
            if name == "cifar10"
            else (data_lib.CIFAR100_MEAN, data_lib.CIFAR100_STD)
        )

    def as_dict(split, limit):
        images, labels = split.images, split.labels
        if limit is not None:
            images, labels = images[:limit], labels[:limit]
        images = np.asarray(images, np.float32)
        if image_shape is not None:
            images = to_image_shape(images, image_shape)
        return {"image": images, "label": np.asarray(labels, np.int32)}

    return Data(name, as_dict(train, train_subset), as_dict(test, test_subset), classes, stats)


def build_model(name: str, num_classes: int) -> tuple[Any, bool]:
    """The Linen model and whether it takes ``train=`` (and has batch statistics)."""
    from triaccel_jax import models

    if name in ("auto", "small_cnn"):
        return models.SmallCNN(num_classes=num_classes), False
    if name == "resnet20":
        return models.ResNet20(num_classes=num_classes), True
    if name == "resnet18":
        return models.ResNet18(num_classes=num_classes), True
    if name == "efficientnet_b0":
        return models.EfficientNetB0(num_classes=num_classes, stem_stride=1), True
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


def make_loss(
    model: Any, has_state: bool, channel_stats: tuple[Any, Any] | None
) -> Callable[..., Any]:
    """The controller's loss: cross-entropy, with accuracy as a metric.

    With ``channel_stats`` (CIFAR), training images get the standard random crop and flip, and
    all images are normalised per channel.
    """
    from triaccel_jax import data as data_lib

    def logits_of(
        params: Any, images: Any, policy: Any, model_state: Any, rng: Any, train: bool
    ) -> tuple[jax.Array, Any]:
        if channel_stats is not None:
            images = data_lib.normalize(images, *channel_stats)
        variables = {"params": params}
        kwargs: dict[str, Any] = {"rngs": {"dropout": rng}} if train else {}
        if has_state:
            variables["batch_stats"] = model_state
            kwargs["train"] = train
            if train:
                kwargs["mutable"] = ["batch_stats"]
        out = apply_with_policy(model, variables, images, policy=policy, **kwargs)
        logits, updates = out if isinstance(out, tuple) else (out, {})
        return logits.astype(jnp.float32), updates.get("batch_stats", model_state)

    def loss_fn(params, batch, *, policy, rng, model_state=None):
        images = batch["image"]
        if channel_stats is not None:
            images = data_lib.random_crop_flip(jax.random.fold_in(rng, 1), images)
        logits, new_state = logits_of(params, images, policy, model_state, rng, True)
        labels = batch["label"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        aux = {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}
        if has_state:
            aux["model_state"] = new_state
        return loss, aux

    loss_fn.logits_of = logits_of  # type: ignore[attr-defined]
    return loss_fn


@functools.lru_cache(maxsize=8)
def _predictor(loss_fn: Callable[..., Any], policy: Any) -> Callable[..., jax.Array]:
    """The jitted eval-mode prediction for ``(loss_fn, policy)``, made once, not per evaluation."""

    @jax.jit
    def predict(params, model_state, images):
        # make_loss sets logits_of on the function, which Callable does not declare.
        logits, _ = loss_fn.logits_of(params, images, policy, model_state, None, False)  # type: ignore[attr-defined]
        return jnp.argmax(logits, -1)

    return predict


def evaluate(loss_fn, params, model_state, policy, test: dict[str, np.ndarray]) -> float:
    """Test accuracy (eval mode: running BatchNorm statistics, no augmentation)."""
    predict = _predictor(loss_fn, policy)
    correct, size = 0, len(test["label"])
    for start in range(0, size, 1000):
        images = test["image"][start : start + 1000]
        correct += int(
            (
                np.asarray(predict(params, model_state, images))
                == test["label"][start : start + 1000]
            ).sum()
        )
    return correct / size
