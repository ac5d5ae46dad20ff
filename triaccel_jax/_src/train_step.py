"""The pure training step the controller compiles: gradients accumulated over micro-batches.

The controller builds the step from the user's loss function rather than taking a finished step,
because only then can it split a batch that ran out of memory into micro-batches whose averaged
gradient is the big batch's gradient (the mean of equal-sized micro-batch means is the batch
mean), so the update is the one the big batch would have produced (DESIGN §5).

The loss function is called as ``loss_fn(params, batch, *, policy, rng)`` (plus
``model_state=`` when the controller holds one, e.g. BatchNorm statistics) and returns the mean
loss, or ``(loss, aux)`` with ``has_aux=True`` where ``aux`` is a dict of scalar metrics; with a
model state, ``aux["model_state"]`` is the updated model state. Micro-batches run in order, each
seeing the model state the previous one left (as in any gradient accumulation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

MODEL_STATE = "model_state"


class StepOutput(NamedTuple):
    """What one compiled step returns."""

    params: Any
    opt_state: Any
    model_state: Any
    metrics: dict[str, jax.Array]


def normalize_loss_fn(
    loss_fn: Callable[..., Any], *, has_aux: bool, has_model_state: bool
) -> Callable[..., tuple[jax.Array, tuple[dict[str, Any], Any]]]:
    """``(params, model_state, batch, policy, rng) -> (loss, (metrics, model_state))``."""

    def normalized(params, model_state, batch, policy, rng):
        kwargs = {"policy": policy, "rng": rng}
        if has_model_state:
            kwargs[MODEL_STATE] = model_state
        out = loss_fn(params, batch, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    "with has_aux=True the loss function must return (loss, aux), got "
                    f"{type(out).__name__}"
                )
            loss, aux = out
            if not isinstance(aux, dict):
                raise TypeError(
                    f"the loss function's aux must be a dict of metrics, got {type(aux).__name__}"
                )
        else:
            loss, aux = out, {}
        aux = dict(aux)
        if has_model_state:
            if MODEL_STATE not in aux:
                raise TypeError(
                    "with a model_state the loss function must return (loss, aux) with "
                    "aux['model_state'] holding the updated model state"
                )
            model_state = aux.pop(MODEL_STATE)
        loss = jnp.asarray(loss)
        if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
            raise TypeError(
                f"the loss function must return a scalar float loss, got shape {loss.shape} "
                f"dtype {loss.dtype}"
            )
        for name, value in aux.items():
            if jnp.shape(value) != ():
                raise TypeError(f"metric {name!r} must be a scalar, got shape {jnp.shape(value)}")
        return loss.astype(jnp.float32), (aux, model_state)

    return normalized


def make_train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    *,
    policy: Any,
    num_micro: int,
    seed: int,
) -> Callable[..., StepOutput]:
    """The step ``(params, opt_state, model_state, batch, step, lr_factor) -> StepOutput``.

    Args:
      loss_fn: a loss normalised by :func:`normalize_loss_fn`.
      tx: the optimizer. Extra-args transforms also get ``loss_fn=`` (a loss of the params on
        the first micro-batch), which Hutchinson's estimator needs and others ignore.
      policy: the precision policy (static), passed to the loss function.
      num_micro: micro-batches per step; ``batch`` leaves have a leading axis of that size.
      seed: the loss's ``rng`` is ``fold_in(key(seed), step)``, then folded with the
        micro-batch index; made inside the step, so it needs no device placement.

    Returns:
      The pure step function, to be jitted. ``lr_factor`` multiplies the update only when the
      controller scales the learning rate without an injected hyperparameter (it is 1 otherwise).
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    takes_extra = isinstance(tx, optax.GradientTransformationExtraArgs)

    def one(params, model_state, micro_batch, rng):
        (loss, (metrics, model_state)), grads = grad_fn(
            params, model_state, micro_batch, policy, rng
        )
        return grads, model_state, {"loss": loss, **metrics}

    def controller_step(params, opt_state, model_state, batch, step, lr_factor):
        rng = jax.random.fold_in(jax.random.key(seed), step)
        first = jax.tree.map(lambda x: x[0], batch)
        if num_micro == 1:
            grads, model_state, metrics = one(params, model_state, first, rng)
        else:

            def body(carry, xs):
                total, state = carry
                micro_batch, index = xs
                grads, state, metrics = one(
                    params, state, micro_batch, jax.random.fold_in(rng, index)
                )
                return (jax.tree.map(jnp.add, total, grads), state), metrics

            zeros = jax.tree.map(jnp.zeros_like, params)
            (total, model_state), metrics = jax.lax.scan(
                body, (zeros, model_state), (batch, jnp.arange(num_micro))
            )
            grads = jax.tree.map(lambda g: (g / num_micro).astype(g.dtype), total)
            metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
        extra = {}
        if takes_extra:
            extra["loss_fn"] = lambda p: loss_fn(p, model_state, first, policy, rng)[0]
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        updates = jax.tree.map(lambda u: _scaled(u, lr_factor), updates)
        params = optax.apply_updates(params, updates)
        return StepOutput(params, opt_state, model_state, metrics)

    return controller_step


def _scaled(update: Any, factor: jax.Array) -> Any:
    if not jnp.issubdtype(jnp.result_type(update), jnp.floating):
        return update
    return (update * factor).astype(update.dtype)
