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


class MLP(nn.Module):
    """A ReLU multilayer perceptron on flattened images."""

    hidden: Sequence[int] = (256, 128)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        del train
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
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
    lr_range: tuple[float, float]
    evals_per_epoch: int
    trials: int  # tuning trials per optimizer unless --trials says otherwise
    has_state: bool = False  # the model has BatchNorm statistics (and takes ``train=``)


WORKLOADS = {
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
    ),
    "fashion_cnn": Workload(
        "fashion_cnn",
        "SmallCNN on Fashion-MNIST",
        lambda: triaccel_jax.models.SmallCNN(num_classes=10),
        "fashion_mnist",
        12_000,
        2_000,
        None,
        epochs=5,
        batch=128,
        max_batch=512,
        lr_range=(5e-4, 8e-3),
        evals_per_epoch=1,
        trials=4,
    ),
    # Not in the default study: on 2 CPU cores one ResNet-20 epoch of 10,000 images takes
    # minutes, and the study needs 38 runs.
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
        trials=4,
        has_state=True,
    ),
}
DEFAULT_WORKLOADS = ("digits_mlp", "fashion_cnn")


@dataclasses.dataclass
class Splits:
    """The training part, the validation part (held out of the training set) and the test set."""

    train: task.Data  # ``test`` here is the validation part, scored while tuning
    test: dict[str, np.ndarray]

    @property
    def validation(self) -> dict[str, np.ndarray]:
        return self.train.test


def load_splits(workload: Workload, quick: bool) -> Splits:
    """The workload's splits: the validation images are a fixed random choice of training ones."""
    data = task.load_data(
        workload.dataset,
        data_dir=None,
        train_subset=None,
        test_subset=workload.test_subset if not quick else 1000,
    )
    size = len(data.train["label"])
    order = np.random.default_rng(12345).permutation(size)
    validation = workload.validation if not quick else min(workload.validation, 500)
    used = workload.train_subset if workload.train_subset is not None else size
    if quick:
        used = min(used, 2000)
    held, kept = order[:validation], order[validation:used]
    train = {k: v[kept] for k, v in data.train.items()}
    held_out = {k: v[held] for k, v in data.train.items()}
    return Splits(task.Data(data.name, train, held_out, data.num_classes, None), data.test)
