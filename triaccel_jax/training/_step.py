"""The pure training step the controller compiles: gradients accumulated over micro-batches.

The controller builds the step from the user's loss function rather than taking a finished step,
because only then can it split a batch that ran out of memory into micro-batches whose averaged
gradient is the big batch's gradient (the mean of equal-sized micro-batch means is the batch
mean), so the update is the one the big batch would have produced (docs/design.md §5).

The loss function is called as ``loss_fn(params, batch)``, optax's form, and is also given
``policy=`` and ``rng=`` when its signature takes them (by name or through ``**kwargs``), and
``model_state=`` when the controller holds one (e.g. BatchNorm statistics; then it must take it).
A loss that does not take ``policy`` is handed the compute copy of the params under the policy in
force (:func:`triaccel_jax.cast_params`), so the precision policy applies to it too. It returns the
mean loss, or ``(loss, aux)`` with ``has_aux=True`` where ``aux`` is a dict of scalar metrics; with a
model state, ``aux["model_state"]`` is the updated model state. Micro-batches run in order, each
seeing the model state the previous one left (as in any gradient accumulation).

When the precision policy computes a leaf in fp16 or fp8, the step scales the loss
(Micikevicius et al., 2018, "Mixed Precision Training"): it differentiates ``loss * scale``,
divides each micro-batch's gradients by the scale in float32, hands the optimizer (and so the
curvature estimator) those unscaled gradients, and where any is non-finite skips the update,
keeps the state, and backs the scale off, with the rule of :class:`LossScaling`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from triaccel_jax._src import arrays
from triaccel_jax.precision import _casting as casting
from triaccel_jax.transforms import _fused_apply as fused_lib
from triaccel_jax.transforms import _loss_scaling as loss_scaling_lib

MODEL_STATE = "model_state"


class StepOutput(NamedTuple):
    """What one compiled step returns.

    ``metrics`` holds the mean ``loss`` and the loss function's metrics, plus ``skipped`` (1.0
    when loss scaling found a non-finite gradient and the step changed nothing, else 0.0) and
    ``loss_scale`` (the scale the loss was multiplied by; 1.0 without loss scaling).
    """

    params: Any
    opt_state: Any
    model_state: Any
    loss_scale: loss_scaling_lib.LossScaleState
    metrics: dict[str, jax.Array]


LOSS_KEYWORDS = ("policy", "rng", MODEL_STATE)

ACCEPTED_LOSS_FORMS = (
    "loss_fn(params, batch)  (optax's form)",
    "loss_fn(params, batch, *, policy, rng)  (either keyword alone, or both)",
    "loss_fn(params, batch, *, model_state, ...)  (needed when the controller holds a model_state)",
    "loss_fn(params, batch, **kwargs)  (given every keyword above)",
)


def loss_keywords(loss_fn: Callable[..., Any], *, has_model_state: bool) -> frozenset[str]:
    """The keywords among ``policy``, ``rng`` and ``model_state`` that ``loss_fn`` takes.

    Read from its signature once, when the controller is built, so that a loss of a form the
    controller cannot call fails there with the forms it can, not inside the first compiled step.
    A callable whose signature Python cannot read is given every keyword.

    Args:
      loss_fn: the user's loss function.
      has_model_state: whether the controller holds a model state (the loss must then take
        ``model_state=``).

    Returns:
      The keywords to pass.

    Raises:
      TypeError: ``loss_fn`` cannot be called as ``loss_fn(params, batch, **keywords)``; the
        message lists the accepted forms.

    Example:
      >>> from triaccel_jax.training import loss_keywords
      >>> sorted(loss_keywords(lambda params, batch, *, rng: 0.0, has_model_state=False))
      ['rng']
    """
    try:
        parameters = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or an object Python cannot introspect
        return frozenset(LOSS_KEYWORDS if has_model_state else LOSS_KEYWORDS[:2])
    kinds = inspect.Parameter
    positional = [
        p for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in parameters)
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in parameters)
    by_name = {p.name: p for p in parameters if p.kind is not kinds.POSITIONAL_ONLY}
    problems = []
    if len(positional) < 2 and not var_positional:
        problems.append(f"it takes {len(positional)} positional argument(s), not (params, batch)")
    named_positional = {p.name for p in positional[:2]}
    wanted = set(LOSS_KEYWORDS if has_model_state else LOSS_KEYWORDS[:2])
    taken = {
        name for name in wanted if var_keyword or (name in by_name and name not in named_positional)
    }
    if has_model_state and MODEL_STATE not in taken:
        problems.append("the controller holds a model_state, and it takes no model_state=")
    required = [
        p.name
        for p in parameters[2 if len(positional) >= 2 else len(positional) :]
        if p.default is kinds.empty
        and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
        and p.name not in taken
    ]
    if required:
        problems.append(
            f"it requires {', '.join(map(repr, required))}, which the controller never passes"
        )
    if problems:
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        forms = "\n  ".join(ACCEPTED_LOSS_FORMS)
        raise TypeError(
            f"`loss_fn` {name}{inspect.signature(loss_fn)} cannot be called by the controller: "
            f"{'; '.join(problems)}. Accepted forms:\n  {forms}"
        )
    return frozenset(taken)


def normalize_loss_fn(
    loss_fn: Callable[..., Any], *, has_aux: bool, has_model_state: bool
) -> Callable[..., tuple[jax.Array, tuple[dict[str, Any], Any]]]:
    """``(params, model_state, batch, policy, rng) -> (loss, (metrics, model_state))``.

    Raises:
      TypeError: ``loss_fn``'s signature is not one of the accepted forms (see
        :func:`loss_keywords`).
    """
    keywords = loss_keywords(loss_fn, has_model_state=has_model_state)

    def normalized(params, model_state, batch, policy, rng):
        given = {"policy": policy, "rng": rng, MODEL_STATE: model_state}
        kwargs = {name: given[name] for name in keywords}
        if "policy" not in keywords and policy is not None:
            # The loss cannot apply the policy itself: it computes on the compute copy.
            params = casting.cast_params(params, policy)
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
    loss_scaling: loss_scaling_lib.LossScaling | None = None,
    fused: bool = False,
) -> Callable[..., StepOutput]:
    """The step ``(params, opt_state, model_state, batch, step, lr_factor, loss_scale)``.

    Args:
      loss_fn: a loss normalised by :func:`normalize_loss_fn`.
      tx: the optimizer. Extra-args transforms also get ``loss_fn=`` (a loss of the params on
        the first micro-batch, unscaled), which Hutchinson's estimator needs and others ignore.
      policy: the precision policy (static), passed to the loss function.
      num_micro: micro-batches per step; ``batch`` leaves have a leading axis of that size.
      seed: the loss's ``rng`` is ``fold_in(key(seed), step)``, then folded with the
        micro-batch index; made inside the step, so it needs no device placement.
      loss_scaling: the dynamic loss scale's rule; None: the loss is not scaled, nothing is
        skipped and the ``loss_scale`` state passes through unchanged.
      fused: update and apply in one pass per leaf
        (:func:`triaccel_jax.transforms.fused_apply`) instead of ``tx.update`` and
        ``optax.apply_updates``.

    Returns:
      The pure step function, to be jitted, returning a :class:`StepOutput`. ``lr_factor``
      multiplies the update only when the controller scales the learning rate without an
      injected hyperparameter (it is 1 otherwise); ``loss_scale`` is a
      :class:`LossScaleState`.
    """
    takes_extra = isinstance(tx, optax.GradientTransformationExtraArgs)

    def scaled_loss(params, model_state, micro_batch, rng, scale):
        loss, (metrics, model_state) = loss_fn(params, model_state, micro_batch, policy, rng)
        return loss * scale, (loss, metrics, model_state)

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

    def one(params, model_state, micro_batch, rng, scale):
        (_, (loss, metrics, model_state)), grads = grad_fn(
            params, model_state, micro_batch, rng, scale
        )
        if loss_scaling is not None:  # float32, so that unscaling underflows nothing
            grads = loss_scaling_lib.unscale(grads, scale)
        return grads, model_state, {"loss": loss, **metrics}

    def controller_step(params, opt_state, model_state, batch, step, lr_factor, loss_scale):
        rng = jax.random.fold_in(jax.random.key(seed), step)
        scale = loss_scale.scale if loss_scaling is not None else jnp.float32(1.0)
        first = jax.tree.map(lambda x: x[0], batch)
        if num_micro == 1:
            grads, new_model_state, metrics = one(params, model_state, first, rng, scale)
        else:

            def body(carry, xs):
                total, state = carry
                micro_batch, index = xs
                grads, state, metrics = one(
                    params, state, micro_batch, jax.random.fold_in(rng, index), scale
                )
                return (jax.tree.map(jnp.add, total, grads), state), metrics

            zeros = jax.eval_shape(
                lambda: one(params, model_state, first, rng, scale)[0]
            )  # the gradients' dtypes: float32 when unscaled
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
            (total, new_model_state), metrics = jax.lax.scan(
                body, (zeros, model_state), (batch, jnp.arange(num_micro))
            )
            grads = jax.tree.map(lambda g: (g / num_micro).astype(g.dtype), total)
            metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)

        def apply(operand):
            params, opt_state, _ = operand
            extra: dict[str, Any] = {}
            if takes_extra:
                extra["loss_fn"] = lambda p: loss_fn(p, new_model_state, first, policy, rng)[0]
            if fused:
                out = fused_lib.fused_apply(
                    tx, grads, opt_state, params, learning_rate_factor=lr_factor, **extra
                )
                return out.params, out.opt_state, new_model_state
            updates, opt_state = tx.update(grads, opt_state, params, **extra)
            updates = jax.tree.map(lambda u: _scaled(u, lr_factor), updates)
            return optax.apply_updates(params, updates), opt_state, new_model_state

        if loss_scaling is None:
            params, opt_state, model_state = apply((params, opt_state, model_state))
            skipped = jnp.float32(0.0)
        else:
            finite = loss_scaling_lib.all_finite(loss_scaling_lib.leaf_finite(grads))
            # A step with an overflow changes nothing: params, optimizer and model state kept.
            params, opt_state, model_state = lax.cond(
                finite, apply, lambda operand: operand, (params, opt_state, model_state)
            )
            loss_scale = loss_scaling.update(loss_scale, finite)
            skipped = 1.0 - finite.astype(jnp.float32)
        metrics = {**metrics, "skipped": skipped, "loss_scale": scale}
        return StepOutput(params, opt_state, model_state, loss_scale, metrics)

    return controller_step


def _scaled(update: Any, factor: jax.Array) -> Any:
    if not jnp.issubdtype(jnp.result_type(update), jnp.floating):
        return update
    return (update * factor).astype(update.dtype)


def loss_scaling_for(
    policy: Any, rule: loss_scaling_lib.LossScaling, opt_state: Any
) -> loss_scaling_lib.LossScaling | None:
    """The loss-scaling rule a step under ``policy`` needs: ``rule`` while it computes a leaf in
    fp16 or fp8, else None.

    Raises:
      ValueError: the step needs scaling and ``opt_state`` already scales (an optimizer wrapped
        in ``dynamic_loss_scale`` would unscale the gradients a second time).
    """
    if not loss_scaling_lib.needs_loss_scaling(policy):
        return None
    if loss_scaling_lib.holds_loss_scale(opt_state):
        raise ValueError(
            f"policy {policy.signature} computes in fp16/fp8, so the controller scales "
            "the loss itself; an optimizer wrapped in dynamic_loss_scale would unscale the "
            "gradients a second time: pass the inner optimizer"
        )
    return rule


def abstract_step_arguments(state: tuple[Any, Any, Any], batch: Any, loss_scale: Any) -> tuple:
    """The arguments of :func:`make_train_step`'s step as shapes, to compile without data.

    Args:
      state: ``(params, opt_state, model_state)``.
      batch: the batch's ``jax.ShapeDtypeStruct`` tree (micro-batches on the leading axis).
      loss_scale: the :class:`LossScaleState`.
    """
    scalars = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32)
    return (*arrays.abstract_tree(state), batch, *scalars, arrays.abstract_tree(loss_scale))


def check_loss_structure(
    loss_fn: Callable[..., Any], params: Any, model_state: Any, batch: Any, policy: Any
) -> None:
    """Traces a normalised loss on shapes only; a loss returning the wrong structure fails here.

    Raises:
      TypeError: ``loss_fn`` returns the wrong structure (the message says what is wrong).
    """
    try:
        jax.eval_shape(
            lambda p, s, b, k: loss_fn(p, s, b, policy, k),
            params,
            model_state,
            batch,
            jax.random.key(0),
        )
    except TypeError as error:
        if "loss function" in str(error) or "metric" in str(error):
            raise TypeError(f"`loss_fn` returns the wrong structure: {error}") from None
        raise
