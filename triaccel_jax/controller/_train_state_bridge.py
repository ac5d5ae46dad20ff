"""Training a Flax train state with the controller, and handing it back (docs/design.md §5).

:meth:`triaccel_jax.Controller.from_train_state` and :attr:`triaccel_jax.Controller.train_state`
are these two functions: the train state's params, optimizer state, batch statistics, policy and
loss scale go in, and come back advanced by the steps the controller ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from triaccel_jax.transforms import _loss_scaling as loss_scaling_lib


def controller_from_train_state(
    cls: type, loss_fn: Callable[..., Any], state: Any, data: Any, **kwargs: Any
) -> Any:
    """A controller that trains a Flax train state; :func:`train_state_of` gives it back.

    Args:
      loss_fn: as for :class:`Controller`; with a state that has ``batch_stats`` (e.g.
        :class:`triaccel_jax.flax.TrainState`), the loss gets them as ``model_state=``.
      state: a ``flax.training.train_state.TrainState`` or
        :class:`triaccel_jax.flax.TrainState` (whose ``policy`` becomes the starting policy,
        and whose loss scale and its rule the controller continues with).
      data: as for :class:`Controller`.
      cls: the controller class (:class:`triaccel_jax.Controller` or a subclass).
      **kwargs: the other arguments of :class:`triaccel_jax.Controller`.

    Returns:
      The controller.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
      >>> import triaccel_jax
      >>> from triaccel_jax.flax import TrainState
      >>> x = np.random.default_rng(0).normal(size=(128, 3)).astype(np.float32)
      >>> model = nn.Dense(1)
      >>> state = TrainState.create(
      ...     apply_fn=model.apply,
      ...     tx=triaccel_jax.triaccel(0.05),
      ...     params=model.init(jax.random.key(0), x)["params"],
      ... )
      >>> def loss_fn(params, batch, *, policy, rng):
      ...     return jnp.mean((state.apply_fn({"params": params}, batch) - 1.0) ** 2)
      >>> controller = triaccel_jax.Controller.from_train_state(
      ...     loss_fn,
      ...     state,
      ...     x,
      ...     min_batch=32,
      ...     max_batch=32,
      ...     probe=triaccel_jax.BudgetMemoryProbe(2**30),
      ... )
      >>> _ = controller.run(5)
      >>> int(controller.train_state.step)
      5
    """
    if "params" in kwargs or "opt_state" in kwargs or "model_state" in kwargs:
        raise TypeError("from_train_state takes params, opt_state and batch_stats from `state`")
    kwargs.setdefault("policy", getattr(state, "policy", None))
    if isinstance(getattr(state, "loss_scaling", None), loss_scaling_lib.LossScaling):
        kwargs.setdefault("loss_scaling", dataclasses.asdict(state.loss_scaling))
    controller = cls(
        loss_fn,
        state.params,
        state.tx,
        data,
        opt_state=state.opt_state,
        model_state=getattr(state, "batch_stats", None),
        **kwargs,
    )
    if getattr(state, "loss_scale", None) is not None:
        controller.loss_scale = controller._place(state.loss_scale)
    controller._train_state = (state, controller.step_count)
    return controller


def train_state_of(controller: Any, template: Any, start: int, opt_state: Any) -> Any:
    """``template`` (the train state the controller was made from at step ``start``), advanced.

    Args:
      controller: the controller.
      template: the train state given to :func:`controller_from_train_state`.
      start: the controller's step count when it was made.
      opt_state: the optimizer state to hand back (holding the tuned learning rate).

    Returns:
      The train state at the controller's current step, with its params, optimizer state,
      batch statistics, loss scale and (for :class:`triaccel_jax.flax.TrainState`) policy.
    """
    changes = {
        "step": template.step + (controller.step_count - start),
        "params": controller.params,
        "opt_state": opt_state,
    }
    if getattr(template, "batch_stats", None) is not None:
        changes["batch_stats"] = controller.model_state
    if getattr(template, "loss_scale", None) is not None:
        changes["loss_scale"] = controller.loss_scale
    state = template.replace(**changes)
    if hasattr(state, "with_policy"):  # triaccel_jax.flax.TrainState: rebuild the copy
        state = state.with_policy(controller.policy)
    return state
