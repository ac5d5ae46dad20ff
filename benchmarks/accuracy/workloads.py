"""The workloads: a model, a data set split into train, validation and test, and a budget."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np

import triaccel_jax
from triaccel_jax.cli import _task as task

# With --quick: training images, validation images and test images used (at most).
QUICK_SIZES = (768, 256, 512)


class MLP(nn.Module):
    """A multilayer perceptron on flattened images (ReLU hidden layers unless told)."""

    hidden: Sequence[int] = (256, 128)
    num_classes: int = 10
    activation: Callable[[jax.Array], jax.Array] = nn.relu

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        del train
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = self.activation(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model and data set, how long it trains and the learning rates tuned over."""

    name: str
    description: str
    model: Callable[[], nn.Module]
    dataset: str
    train_subset: int | None  # training images used (before the validation split), None: all
    validation: int  # images held out of the training set for tuning
    test_subset: int | None
    epochs: int
    batch: int
    max_batch: int  # the elastic rows grow up to this bucket
    lr_range: tuple[float, float]  # AdamW's and Tri-Accel's learning rates
    evals_per_epoch: int
    trials: int  # tuning trials per optimizer unless --trials says otherwise
    has_state: bool = False  # the model has BatchNorm statistics (and takes ``train=``)
    # Muon's learning rates (its orthogonalized matrices' step has an RMS well under Adam's).
    muon_lr_range: tuple[float, float] = (5e-3, 1.6e-1)
    has_conv: bool = False  # the model has convolution kernels (Muon's conv option applies)


WORKLOADS = {
    "fashion_cnn": Workload(
        "fashion_cnn",
        "SmallCNN on Fashion-MNIST (full training set less 6,000 validation images)",
        lambda: triaccel_jax.models.SmallCNN(num_classes=10),
        "fashion_mnist",
        None,
        6_000,
        None,
        epochs=2,
        batch=128,
        max_batch=512,
        lr_range=(5e-4, 1.6e-2),
        evals_per_epoch=8,
        trials=6,
        muon_lr_range=(5e-3, 1.6e-1),
        has_conv=True,
    ),
    # AlgoPerf's MNIST workload's model: 784-128-10, sigmoid hidden layer.
    "fashion_mlp": Workload(
        "fashion_mlp",
        "MLP 784-128-10, sigmoid (AlgoPerf's MNIST model), on Fashion-MNIST (full training set "
        "less 6,000 validation images)",
        lambda: MLP(hidden=(128,), activation=nn.sigmoid),
        "fashion_mnist",
        None,
        6_000,
        None,
        epochs=3,
        batch=128,
        max_batch=512,
        lr_range=(1e-3, 3.2e-2),
        evals_per_epoch=8,
        trials=6,
        muon_lr_range=(1e-2, 3.2e-1),
    ),
    # Not in the default study (the earlier one's first workload).
    "digits_mlp": Workload(
        "digits_mlp",
        "MLP 64-256-128-10 on scikit-learn digits",
        lambda: MLP(),
        "digits",
        None,
        287,
        None,
        epochs=40,
        batch=32,
        max_batch=128,
        lr_range=(1e-3, 3e-2),
        evals_per_epoch=1,
        trials=6,
        muon_lr_range=(1e-2, 3e-1),
    ),
    # Not in the default study: on 2 CPU cores one ResNet-20 epoch of 10,000 images takes
    # minutes.
    "fashion_resnet20": Workload(
        "fashion_resnet20",
        "ResNet-20 on Fashion-MNIST",
        lambda: triaccel_jax.models.ResNet20(num_classes=10),
        "fashion_mnist",
        12_000,
        2_000,
        None,
        epochs=5,
        batch=128,
        max_batch=512,
        lr_range=(5e-4, 8e-3),
        evals_per_epoch=1,
        trials=6,
        has_state=True,
        has_conv=True,
    ),
}
DEFAULT_WORKLOADS = ("fashion_cnn", "fashion_mlp")


@dataclasses.dataclass
class Splits:
    """The training part, the validation part (held out of the training set) and the test set."""

    train: task.Data  # ``test`` here is the validation part, scored while tuning
    test: dict[str, np.ndarray]

    @property
    def validation(self) -> dict[str, np.ndarray]:
        return self.train.test


def load_splits(workload: Workload, quick: bool) -> Splits:
    """The workload's splits: the validation images are a fixed random choice of training ones.

    The choice (``numpy.random.default_rng(12345)``'s permutation, its first ``validation``
    images held out) is the goodput study's (benchmarks/goodput.py), so on Fashion-MNIST both
    studies train on the same 54,000 images. ``quick`` keeps at most :data:`QUICK_SIZES` images.
    """
    data = task.load_data(
        workload.dataset, data_dir=None, train_subset=None, test_subset=workload.test_subset
    )
    size = len(data.train["label"])
    order = np.random.default_rng(12345).permutation(size)
    used = workload.train_subset if workload.train_subset is not None else size
    held, kept = order[: workload.validation], order[workload.validation : used]
    test = data.test
    if quick:
        train_n, validation_n, test_n = QUICK_SIZES
        held, kept = held[:validation_n], kept[:train_n]
        test = {k: v[:test_n] for k, v in test.items()}
    train = {k: v[kept] for k, v in data.train.items()}
    held_out = {k: v[held] for k, v in data.train.items()}
    return Splits(task.Data(data.name, train, held_out, data.num_classes, None), test)
