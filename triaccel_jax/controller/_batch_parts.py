"""The batch-decision parts, built in one place for both drivers.

:class:`triaccel_jax.controller.Controller` (which runs the step) and
:class:`triaccel_jax.controller.AdaptiveBatches` (which feeds a loop the user writes) decide the
batch with the same three parts: a :class:`._bucket_tracker.BucketTracker` (the bucket in force,
the measured peaks, the shrink streak), a :class:`._learning_rate.LearningRateScaling` (the tuned
rate and the batch rule) and a :class:`._goodput_tracker.GoodputTracker` (noise scale,
throughput, the goodput decision's clock). :func:`build_batch_parts` builds them from one
:class:`._config.ControllerConfig`, so a setting reaches both drivers the same way. The two
differ only in what they pass: how many steps a reading lags behind its dispatch, and the number
of examples an epoch has.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

from triaccel_jax.controller import _bucket_tracker as bucket_tracker
from triaccel_jax.controller import _config as config_lib
from triaccel_jax.controller import _goodput_tracker as goodput_tracker
from triaccel_jax.controller import _learning_rate as learning_rate


class BatchParts(NamedTuple):
    """The three parts a batch decision is made with (:func:`build_batch_parts`).

    Attributes:
      bucket: the bucket in force, its measured peaks and the shrink streak.
      lr: the learning rate's scaling with the batch.
      goodput: the noise scale, the throughput and the goodput decision's clock.
    """

    bucket: bucket_tracker.BucketTracker
    lr: learning_rate.LearningRateScaling
    goodput: goodput_tracker.GoodputTracker


def build_batch_parts(
    config: config_lib.ControllerConfig,
    layout: config_lib.BatchLayout,
    opt_state: Any,
    *,
    lag: int,
    num_examples: int,
) -> BatchParts:
    """Builds the batch-decision parts from ``config``.

    Args:
      config: the settings (``target``, ``high_water``, ``patience``, the learning-rate rule and
        hyperparameters, the goodput settings, ``check_every``).
      layout: the buckets, the starting bucket and the reference batch
        (:meth:`._config.ControllerConfig.layout`).
      opt_state: the optimizer state whose injected learning rate is scaled.
      lag: how many steps a step's figures are read after it is dispatched (the controller's
        ``steps_in_flight``; 0 where each step is reported before the next is fed).
      num_examples: the examples in an epoch; the goodput decision runs every
        ``goodput_every`` of an epoch.

    Returns:
      A :class:`BatchParts`.

    Example:
      >>> import optax, jax.numpy as jnp
      >>> from triaccel_jax.controller import ControllerConfig
      >>> from triaccel_jax.controller._batch_parts import build_batch_parts
      >>> config = ControllerConfig(min_batch=16, max_batch=64)
      >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
      >>> parts = build_batch_parts(
      ...     config, config.layout(1), tx.init(jnp.zeros(3)), lag=0, num_examples=1000
      ... )
      >>> parts.bucket.micro
      16
    """
    bucket = bucket_tracker.BucketTracker(
        layout.buckets,
        layout.start,
        target=config.target,
        high_water=config.high_water,
        patience=config.patience,
    )
    lr = learning_rate.LearningRateScaling(
        opt_state,
        config.lr_hyperparam,
        config.learning_rate_rule,
        layout.reference_batch,
        decay_hyperparam=config.weight_decay_hyperparam,
    )
    goodput = goodput_tracker.GoodputTracker(
        horizon=config.noise_horizon_for(layout.reference_batch),
        lag=lag,
        reference=layout.reference_batch,
        margin=config.goodput_margin,
        critical_multiple=config.critical_multiple,
        assumed_step_time=config.assumed_step_time,
        # Blocks of the steps between two checks (each holding one check's flush), at most ten
        # steps, so that a long check interval still gives a spread soon.
        block=min(config.check_every, 10),
        every=max(1, round(config.goodput_every * num_examples)),
    )
    return BatchParts(bucket, lr, goodput)
