"""A Flax train state through the :class:`triaccel_jax.Controller`, and back.

:func:`from_train_state` builds a controller that continues a train state (its params, optimizer
state, batch statistics, loss scale and its rule, policy, and its step: the controller counts on
from ``state.step``); :func:`to_train_state` gives the state back advanced to the controller's
step. Because the controller's step count is the train state's, a controller restored from a
checkpoint (:meth:`triaccel_jax.Checkpointer.restore_controller`) hands back a state whose step
counts every step trained, before the save and after it (docs/design.md §6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from triaccel_jax import controller as controller_lib
from triaccel_jax import transforms


def from_train_state(
    loss_fn: Callable[..., Any], state: Any, data: Any, **kwargs: Any
) -> controller_lib.Controller:
    """A controller that trains a Flax train state; :func:`to_train_state` gives it back.

    Args:
      loss_fn: as for :class:`triaccel_jax.Controller`; with a state that has ``batch_stats``
        (e.g. :class:`triaccel_jax.flax.TrainState`), the loss gets them as ``model_state=``.
      state: a ``flax.training.train_state.TrainState`` or
        :class:`triaccel_jax.flax.TrainState` (whose ``policy`` becomes the starting policy,
        and whose loss scale and its rule the controller continues with).
      data: as for :class:`triaccel_jax.Controller`.
      **kwargs: the other arguments of :class:`triaccel_jax.Controller` (not ``params``,
        ``opt_state``, ``model_state``, ``loss_scale`` or ``start_step``, which come from
        ``state``).

    Returns:
      The controller, its step count starting at ``state.step``.

    Raises:
      TypeError: ``kwargs`` gives one of the arguments that come from ``state``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
      >>> import triaccel_jax
      >>> from triaccel_jax.flax import TrainState, from_train_state, to_train_state
      >>> x = np.random.default_rng(0).normal(size=(128, 3)).astype(np.float32)
      >>> model = nn.Dense(1)
      >>> state = TrainState.create(
      ...     apply_fn=model.apply,
      ...     tx=triaccel_jax.triaccel(0.05),
      ...     params=model.init(jax.random.key(0), x)["params"],
      ... )
      >>> def loss_fn(params, batch, *, policy, rng):
      ...     return jnp.mean((state.apply_fn({"params": params}, batch) - 1.0) ** 2)
      >>> controller = from_train_state(
      ...     loss_fn,
      ...     state,
      ...     x,
      ...     min_batch=32,
      ...     max_batch=32,
      ...     probe=triaccel_jax.BudgetMemoryProbe(2**30),
      ... )
      >>> _ = controller.run(5)
      >>> int(to_train_state(controller, state).step)
      5

    References:
      docs/design.md §6 (the Flax integration).
    """
    taken = ("params", "opt_state", "model_state", "loss_scale", "start_step")
    given = sorted(name for name in taken if name in kwargs)
    if given:
        raise TypeError(
            f"from_train_state takes params, opt_state, batch_stats, the loss scale and the "
            f"step from `state`; got {given} as well"
        )
    kwargs.setdefault("policy", getattr(state, "policy", None))
    if isinstance(getattr(state, "loss_scaling", None), transforms.LossScaling):
        given_config = kwargs.get("config")
        if isinstance(given_config, controller_lib.ControllerConfig):
            # The state's rule, unless the config sets one of its own.
            if given_config.loss_scaling == transforms.LossScaling():
                kwargs["config"] = dataclasses.replace(
                    given_config, loss_scaling=state.loss_scaling
                )
        else:
            kwargs.setdefault("loss_scaling", state.loss_scaling)
    return controller_lib.Controller(
        loss_fn,
        state.params,
        state.tx,
        data,
        opt_state=state.opt_state,
        model_state=getattr(state, "batch_stats", None),
        loss_scale=getattr(state, "loss_scale", None),
        start_step=int(state.step),
        **kwargs,
    )


def to_train_state(controller: controller_lib.Controller, state: Any) -> Any:
    """``state`` advanced to ``controller``'s last step dispatched: the train state back.

    It holds the controller's step count, params, optimizer state, batch statistics, loss scale
    and (for :class:`triaccel_jax.flax.TrainState`) policy. An injected learning rate in its
    optimizer state is the tuned (reference-batch) rate
    (:attr:`triaccel_jax.Controller.tuned_opt_state`): the controller's batch scaling is its
    own and is applied again by whoever trains next, so that round trips do not compound it.

    Args:
      controller: a controller, e.g. one :func:`from_train_state` made.
      state: the train state to advance (the one given to :func:`from_train_state`, or any
        state of the same model and optimizer): its fields other than those above are kept.

    Returns:
      The advanced train state.

    Raises:
      ValueError: ``state``'s params do not have the structure of the controller's.

    Example:
      See :func:`from_train_state`.
    """
    given: Any = jax.tree.structure(state.params)  # a jaxlib PyTreeDef: no stubs
    if given != jax.tree.structure(controller.params):
        raise ValueError(
            f"to_train_state: the state's params have the structure {given}, the controller's "
            f"{jax.tree.structure(controller.params)}"
        )
    step = controller.step_count
    changes = {
        "step": step
        if isinstance(state.step, int)
        else jnp.asarray(step, jnp.result_type(state.step)),
        "params": controller.params,
        "opt_state": controller.tuned_opt_state,
    }
    if getattr(state, "batch_stats", None) is not None:
        changes["batch_stats"] = controller.model_state
    if getattr(state, "loss_scale", None) is not None:
        changes["loss_scale"] = controller.loss_scale
    advanced = state.replace(**changes)
    if hasattr(advanced, "with_policy"):  # triaccel_jax.flax.TrainState: rebuild the copy
        advanced = advanced.with_policy(controller.policy)
    return advanced
