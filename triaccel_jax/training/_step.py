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

That update is :func:`apply_gradients`, the one pure function both this step and
:class:`triaccel_jax.flax.TrainState` apply gradients with: unscaling, the finite check, the
(fused or not) optimizer update and the skip of an overflowing step exist only there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from triaccel_jax import policy as policy_lib
from triaccel_jax import transforms
from triaccel_jax._src import arrays
from triaccel_jax._src import tree as tree_lib
from triaccel_jax._src import validation

MODEL_STATE = "model_state"

# The values of make_train_step's `noise_weights`: how the step also weighs its squared gradient
# norms (None: it does not).
NOISE_WEIGHTS = ("curvature", "preconditioned")


class NoiseNorms(NamedTuple):
    """The two squared gradient norms a step's noise-scale estimate reads, as one typed value.

    The step computes them with the weighting it was made with (``noise_weights`` of
    :func:`make_train_step`: plain, curvature-weighted or preconditioned), so whoever reads a
    step's noise takes these two and never picks metric names by the weighting.

    Attributes:
      batch_sq_norm: ``|G_big|^2`` of the step's averaged gradient (a float32 scalar).
      micro_sq_norm: ``|G_small|^2``: the mean over the micro-batches (or the two halves of a
        split step) of each one's squared norm; 0 where the step measured no estimate (the
        curvature weights before the first curvature estimate).

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.training import NoiseNorms
      >>> norms = NoiseNorms(jnp.float32(1.0), jnp.float32(3.0))
      >>> float(norms.micro_sq_norm - norms.batch_sq_norm)
      2.0
    """

    batch_sq_norm: jax.Array
    micro_sq_norm: jax.Array


class StepOutput(NamedTuple):
    """What one compiled step returns.

    ``metrics`` holds the mean ``loss`` and the loss function's metrics, plus, every one a
    float32 scalar:

    * ``skipped``: 1.0 when loss scaling found a non-finite gradient and the step changed
      nothing, else 0.0;
    * ``loss_scale``: the scale the loss was multiplied by (1.0 without loss scaling);
    * ``grad_sq_norm``: the squared L2 norm of the step's gradient (averaged over the
      micro-batches, unscaled), ``|G_big|^2`` in McCandlish et al. (2018), appendix A;
    * ``micro_grad_sq_norm``: the mean over the micro-batches of each one's squared gradient
      norm (unscaled), ``|G_small|^2`` there at the micro-batch size; equal to ``grad_sq_norm``
      with one micro-batch, and never below it with several (the mean of squared norms is at
      least the squared norm of the mean). A step made with ``split=True`` measures it at half
      the micro-batch (see :func:`make_train_step`): the mean of its two halves' squared norms
      for a model without state, the squared norm of one half (an unbiased sample of the same
      expectation, which may fall below ``grad_sq_norm``) for a model with state.

    With ``noise_weights="curvature"`` (see :func:`make_train_step`) two more, computed alike
    from the same unscaled gradients, with each leaf's squared norm weighted by the leaf's mean
    curvature ``h_l >= 0`` in the optimizer state before the step's update
    (:func:`triaccel_jax.transforms.mean_curvatures`, clipped at 0; leaves without curvature
    weigh 0):

    * ``curvature_grad_sq_norm``: ``sum_l h_l |G_big,l|^2``;
    * ``curvature_micro_grad_sq_norm``: the mean over the micro-batches of ``sum_l h_l
      |G_small,l|^2``.

    With ``noise_weights="preconditioned"``, two more weighted per element by Adam's
    preconditioner as the optimizer holds it before the step, ``w_i = 1 / (sqrt(nu_i) + eps)^2``
    (the second moment ``nu`` found by name in the optimizer state, as ``optax.scale_by_adam``
    keeps it): the squared norms of the preconditioned gradient ``g / (sqrt(nu) + eps)``, the
    direction an Adam-like optimizer follows before its moments' smoothing. The bias correction
    of ``nu`` is one factor for every element and cancels in the noise scale's ratio:

    * ``preconditioned_grad_sq_norm`` and ``preconditioned_micro_grad_sq_norm``.

    Both norms are summed in float32 over the trainable (floating-point) leaves; with
    micro-batches of ``B_small = B / num_micro`` samples they estimate the gradient noise scale
    ``B_simple = tr(Sigma) / |G|^2``, where ``|G|^2 ~ (B |G_big|^2 - B_small |G_small|^2) /
    (B - B_small)`` and ``tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B)``.
    The same estimators, fed the curvature-weighted norms, estimate ``G^T H G`` and ``tr(H
    Sigma)`` for the diagonal, per-leaf constant Hessian ``H = diag(h_l)``, and their ratio is
    the Hessian-weighted noise scale ``B_noise = tr(H Sigma) / (G^T H G)`` (the expectation of
    ``sum_l h_l |g_l|^2`` over batches of ``b`` samples is ``sum_l h_l |G_l|^2 + sum_l h_l
    tr(Sigma_l) / b``, linear in the squared norms as the plain one is).

    ``noise`` holds the pair the step's weighting selects (the plain, curvature-weighted or
    preconditioned ``grad_sq_norm`` and ``micro_grad_sq_norm`` above) as a :class:`NoiseNorms`.

    References:
      McCandlish, Kaplan, Amodei et al., 2018, "An Empirical Model of Large-Batch Training",
      appendix A (``B_simple``, and ``B_noise`` with the Hessian).
    """

    params: Any
    opt_state: Any
    model_state: Any
    loss_scale: transforms.LossScaleState
    metrics: dict[str, jax.Array]
    noise: NoiseNorms


class AppliedGradients(NamedTuple):
    """What :func:`apply_gradients` returns.

    Attributes:
      params: the new params (the old ones, bit for bit, on a skipped step).
      opt_state: the new optimizer state (the old one on a skipped step).
      carry: the step's ``carry`` (``carry_before`` on a skipped step).
      loss_scale: the loss scale's state after the step (passed through without a rule).
      finite: a boolean scalar, whether every gradient was finite (True without a rule, when
        nothing is checked); the step was skipped where it is False.
    """

    params: Any
    opt_state: Any
    carry: Any
    loss_scale: Any
    finite: jax.Array


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    *,
    loss_scale: transforms.LossScaleState | None = None,
    loss_scaling: transforms.LossScaling | None = None,
    fused: transforms.FusedTriAccel | None = None,
    learning_rate_factor: Any = 1.0,
    carry: Any = None,
    carry_before: Any = None,
    extra_args: Mapping[str, Any] | None = None,
) -> AppliedGradients:
    """One optimizer update, skipped whole where a loss-scaled gradient is not finite.

    The one place a training step applies gradients: :func:`make_train_step`'s step and
    :meth:`triaccel_jax.flax.TrainState.apply_gradients` both call it. With a loss-scaling rule,
    ``grads`` are gradients of the scaled loss: they are divided by ``loss_scale.scale`` in
    float32 (so unscaling underflows nothing) and checked; where any trainable leaf holds an inf
    or a nan, the update is thrown away and the params, the optimizer state and the carry come
    back as they were (selected with :func:`triaccel_jax.transforms.select_tree`), and the scale
    backs off; otherwise the update applies and the scale may grow (:class:`LossScaling`).
    Without a rule the gradients are used as given and nothing is checked or skipped.

    Args:
      tx: the optimizer.
      grads: the gradients, a tree like ``params``.
      opt_state: ``tx``'s state.
      params: the params (the masters).
      loss_scale: the loss scale's :class:`LossScaleState`; needed with ``loss_scaling``.
      loss_scaling: the dynamic loss scale's rule, or None: the loss is not scaled.
      fused: None, or the fused form of ``tx``
        (:func:`triaccel_jax.transforms.fused_triaccel` of the arguments ``tx`` was made with):
        update with :func:`triaccel_jax.transforms.fused_apply` (one pass per leaf) instead of
        ``tx.update`` and ``optax.apply_updates``.
      learning_rate_factor: multiplies the update (the learning rate, on the fused path); 1 by
        default, which leaves the unfused update untouched.
      carry: other state the step produced with the gradients (e.g. the model state or batch
        statistics its forward pass updated): returned unless the step is skipped.
      carry_before: that state before the step, returned in its place on a skipped step; a tree
        of ``carry``'s structure, shapes and dtypes (None with ``carry=None``).
      extra_args: optax extra arguments for the update (e.g. ``loss_fn=`` for Hutchinson's
        estimator); a transform without extra-argument support is given none.

    Returns:
      An :class:`AppliedGradients` ``(params, opt_state, carry, loss_scale, finite)``.

    Raises:
      ValueError: ``loss_scaling`` without ``loss_scale``, or ``carry_before`` not shaped as
        ``carry`` while the step can be skipped.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from triaccel_jax.training import apply_gradients
      >>> from triaccel_jax.transforms import LossScaling
      >>> rule = LossScaling(initial_scale=4.0)
      >>> params, tx = {"w": jnp.ones(2)}, optax.sgd(0.5)
      >>> out = apply_gradients(
      ...     tx,
      ...     {"w": jnp.array([4.0, jnp.inf])},
      ...     tx.init(params),
      ...     params,
      ...     loss_scale=rule.init(),
      ...     loss_scaling=rule,
      ...     carry={"n": jnp.int32(1)},
      ...     carry_before={"n": jnp.int32(0)},
      ... )
      >>> (
      ...     bool(out.finite),
      ...     out.params["w"].tolist(),
      ...     int(out.carry["n"]),
      ...     float(out.loss_scale.scale),
      ... )
      (False, [1.0, 1.0], 0, 2.0)
      >>> out = apply_gradients(
      ...     tx,
      ...     {"w": jnp.array([4.0, 8.0])},
      ...     tx.init(params),
      ...     params,
      ...     loss_scale=out.loss_scale,
      ...     loss_scaling=rule,
      ... )
      >>> out.params["w"].tolist()  # the gradients unscaled by 2: [2, 4], times the rate 0.5
      [0.0, -1.0]

    References:
      Micikevicius et al., 2018, "Mixed Precision Training" (loss scaling, skipping overflowing
      steps); jmp's ``select_tree`` and Flax's ``DynamicScale`` (select rather than branch).
    """
    extra = dict(extra_args or {})
    if loss_scaling is not None:
        if loss_scale is None:
            raise ValueError("`loss_scaling` needs the loss scale's state, `loss_scale`")
        grads = transforms.unscale(grads, loss_scale.scale)  # float32
    if fused is not None:
        out = transforms.fused_apply(
            fused, grads, opt_state, params, learning_rate_factor=learning_rate_factor, **extra
        )
        new_params, new_opt_state = out.params, out.opt_state
    else:
        updates, new_opt_state = optax.with_extra_args_support(tx).update(
            grads, opt_state, params, **extra
        )
        if not (isinstance(learning_rate_factor, (int, float)) and learning_rate_factor == 1):
            updates = jax.tree.map(lambda u: _scaled(u, learning_rate_factor), updates)
        new_params = optax.apply_updates(params, updates)
    if loss_scaling is None:
        return AppliedGradients(new_params, new_opt_state, carry, loss_scale, jnp.asarray(True))
    carry_structure: Any = jax.tree.structure(carry)  # a jaxlib PyTreeDef: no stubs
    if carry_structure != jax.tree.structure(carry_before):
        raise ValueError(
            "`carry_before` must have the structure of `carry` (it replaces it on a skipped "
            f"step): got {jax.tree.structure(carry_before)}, carry is {carry_structure}"
        )
    finite = transforms.all_finite(transforms.leaf_finite(grads))
    # An overflowing step changes nothing: params, optimizer state and carry are kept.
    new_params, new_opt_state, carry = transforms.select_tree(
        finite, (new_params, new_opt_state, carry), (params, opt_state, carry_before)
    )
    assert loss_scale is not None  # checked above, with the rule
    return AppliedGradients(
        new_params, new_opt_state, carry, loss_scaling.update(loss_scale, finite), finite
    )


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
        :func:`loss_keywords`); when traced, it returns a tuple without ``has_aux`` or what
        ``has_aux`` and ``has_model_state`` do not expect.
    """
    keywords = loss_keywords(loss_fn, has_model_state=has_model_state)

    def normalized(params, model_state, batch, policy, rng):
        given = {"policy": policy, "rng": rng, MODEL_STATE: model_state}
        kwargs = {name: given[name] for name in keywords}
        if "policy" not in keywords and policy is not None:
            # The loss cannot apply the policy itself: it computes on the compute copy.
            params = policy_lib.cast_params(params, policy)
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
        elif isinstance(out, tuple | list):
            # Checked here: JAX's own error for it is "Value '{}' with dtype object ...".
            raise TypeError(
                f"the loss function returned a {type(out).__name__} of {len(out)}, where a "
                "scalar loss was expected: a loss that returns (loss, aux) needs has_aux=True "
                "(Controller(..., has_aux=True) or ControllerConfig(has_aux=True) under the "
                "controller)"
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
        try:
            loss = jnp.asarray(loss)
        except TypeError:  # a dict or another container: JAX's "dtype object" error
            raise TypeError(
                f"the loss function must return a scalar float loss, got a {type(loss).__name__}"
            ) from None
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
    loss_scaling: transforms.LossScaling | None = None,
    fused: transforms.FusedTriAccel | None = None,
    split: bool = False,
    noise_weights: str | None = None,
) -> Callable[..., StepOutput]:
    """The step ``(params, opt_state, model_state, batch, step, lr_factor, loss_scale)``.

    Args:
      loss_fn: a loss normalised by :func:`normalize_loss_fn`.
      tx: the optimizer. Extra-args transforms also get ``loss_fn=`` (a loss of the params on
        the first micro-batch, unscaled), which Hutchinson's estimator needs and others ignore;
        a transform inside ``optax.masked`` or ``optax.multi_transform`` may call it on its own
        leaves with ``optax.MaskedNode`` for the others, which take this step's params
        (:func:`triaccel_jax.transforms.unmask`).
      policy: the precision policy (static), passed to the loss function.
      num_micro: micro-batches per step; ``batch`` leaves have a leading axis of that size.
      seed: the loss's ``rng`` is ``fold_in(key(seed), step)``, then folded with the
        micro-batch index; made inside the step, so it needs no device placement.
      loss_scaling: the dynamic loss scale's rule; None: the loss is not scaled, nothing is
        skipped and the ``loss_scale`` state passes through unchanged.
      fused: None, or the fused form of ``tx``
        (:func:`triaccel_jax.transforms.fused_triaccel`): update and apply in one pass per leaf
        (:func:`triaccel_jax.transforms.fused_apply`) instead of ``tx.update`` and
        ``optax.apply_updates``.
      split: with one micro-batch, also measure the squared gradient norm at half of it, so
        that the step's two squared norms differ and measure the gradient noise scale, without
        changing what the step trains on. The halves are the even-numbered samples and the
        odd-numbered ones of each shard (each device keeps its own rows under data parallelism,
        explicit sharding included), so the micro-batch must hold an even number of samples on
        every shard. For a model without state the micro-batch runs as its two halves
        accumulated like micro-batches: for a loss whose per-sample terms are independent the
        update is the same (the mean of the halves' means is the batch mean), at no extra cost.
        For a model with state (BatchNorm), whose statistics depend on the batch they are taken
        over, the micro-batch runs whole, exactly as without ``split`` (same update, same new
        statistics, same ``rng``), and the gradient of its first half is computed beside it for
        its norm only (its state discarded): half a step's work more. An extra-args
        optimizer's ``loss_fn`` (Hutchinson's curvature) sees the whole batch either way.
      noise_weights: None (the default), ``"preconditioned"`` (the norms of the gradient
        preconditioned by the Adam-like second moment the optimizer holds, see
        :class:`StepOutput`; AdaptDL measures an Adam direction's noise this way), or
        ``"curvature"``: the metrics also carry
        ``curvature_grad_sq_norm`` and ``curvature_micro_grad_sq_norm``, the two squared
        gradient norms with each leaf's weighted by its mean curvature in the optimizer state
        as it is before this step's update (:func:`triaccel_jax.transforms.mean_curvatures`,
        negative values clipped at 0, float32), from which the Hessian-weighted noise scale
        ``B_noise = tr(H Sigma) / (G^T H G)`` is estimated as ``B_simple`` is from the plain
        ones (see :class:`StepOutput`). It sets what the step computes (not a hyperparameter);
        the curvature is 0 until the optimizer's first estimate, and so are the weighted norms.
        The optimizer must hold curvature (:func:`triaccel_jax.triaccel` or
        :func:`triaccel_jax.scale_by_triaccel`, alone or inside optax's wrappers).

    Returns:
      The pure step function, to be jitted, returning a :class:`StepOutput` (its metrics listed
      there). The update is :func:`apply_gradients`'s. ``lr_factor``
      multiplies the update only when the controller scales the learning rate without an
      injected hyperparameter (it is 1 otherwise); ``loss_scale`` is a
      :class:`LossScaleState`.

    Raises:
      ValueError: ``noise_weights`` is not None, ``"curvature"`` or ``"preconditioned"``; or,
        when the step is traced with ``noise_weights="curvature"``, the optimizer state holds no
        curvature (e.g. ``optax.adam``'s) or holds it for leaves the params do not have; with
        ``"preconditioned"``, it holds no ``nu`` shaped like the params, or more than one.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import triaccel_jax
      >>> from triaccel_jax import training
      >>> from triaccel_jax.transforms import LossScaling
      >>> def mse(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> loss = training.normalize_loss_fn(mse, has_aux=False, has_model_state=False)
      >>> tx = triaccel_jax.triaccel(1e-2, curvature_every=1)
      >>> step = jax.jit(
      ...     training.make_train_step(
      ...         loss, tx, policy=None, num_micro=2, seed=0, noise_weights="curvature"
      ...     )
      ... )
      >>> params = {"w": jnp.zeros((3, 1))}
      >>> x = jax.random.normal(jax.random.key(0), (2, 4, 3))  # 2 micro-batches of 4 samples
      >>> batch = {"x": x, "y": x @ jnp.ones((3, 1))}
      >>> scale = LossScaling().init()
      >>> out = step(params, tx.init(params), None, batch, 0, 1.0, scale)  # a first estimate
      >>> kappa = triaccel_jax.transforms.mean_curvatures(out.opt_state, params)["w"]
      >>> out = step(out.params, out.opt_state, None, batch, 1, 1.0, scale)
      >>> m = out.metrics  # one leaf: its squared norms times its curvature before the step
      >>> bool(jnp.allclose(m["curvature_grad_sq_norm"], kappa * m["grad_sq_norm"]))
      True
      >>> bool(m["curvature_micro_grad_sq_norm"] >= m["curvature_grad_sq_norm"] > 0)
      True

    References:
      McCandlish, Kaplan, Amodei et al., 2018, "An Empirical Model of Large-Batch Training",
      appendix A (the noise scales ``B_simple`` and ``B_noise``).
    """
    if noise_weights is not None:
        validation.check_choice("noise_weights", noise_weights, NOISE_WEIGHTS)
    takes_extra = isinstance(tx, optax.GradientTransformationExtraArgs)

    def scaled_loss(params, model_state, micro_batch, rng, scale):
        loss, (metrics, model_state) = loss_fn(params, model_state, micro_batch, policy, rng)
        return loss * scale, (loss, metrics, model_state)

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

    def unscaled(grads, scale):
        return grads if loss_scaling is None else transforms.unscale(grads, scale)

    def sq_norms(grads, scale, weights):
        """The squared norm of the unscaled gradients, and the weighted one with ``weights``."""
        grads = unscaled(grads, scale)
        if weights is None:
            return {"grad_sq_norm": _sq_norm(grads)}
        return {
            "grad_sq_norm": _sq_norm(grads),
            f"{noise_weights}_grad_sq_norm": _weighted_sq_norm(grads, weights),
        }

    def one(params, model_state, micro_batch, rng, scale, weights):
        (_, (loss, metrics, model_state)), grads = grad_fn(
            params, model_state, micro_batch, rng, scale
        )
        if loss_scaling is not None:
            # Accumulated in float32, still scaled: apply_gradients unscales the average once
            # (exactly, for the rule's powers of two), and float32 sums of scaled float16
            # gradients do not overflow.
            grads = _to_float32(grads)
        return grads, model_state, {"loss": loss, **metrics}, sq_norms(grads, scale, weights)

    def controller_step(params, opt_state, model_state, batch, step, lr_factor, loss_scale):
        rng = jax.random.fold_in(jax.random.key(seed), step)
        scale = loss_scale.scale if loss_scaling is not None else jnp.float32(1.0)
        # The curvature the optimizer holds before this step's update, one weight per leaf.
        weights = _noise_weights(noise_weights, opt_state, params)
        count = num_micro
        whole = jax.tree.map(lambda x: x[0], batch)  # the first micro-batch, unsplit
        side_half = None  # a half measured beside the whole step (a model with state)
        if split and num_micro == 1:
            halves = jax.tree.map(lambda x: split_in_halves(x[0], needs="split=True"), batch)
            if jax.tree.leaves(model_state):
                side_half = jax.tree.map(lambda x: x[0], halves)
            else:
                batch, count = halves, 2
        first = jax.tree.map(lambda x: x[0], batch)
        if count == 1:
            grads, new_model_state, metrics, micro_norms = one(
                params, model_state, first, rng, scale, weights
            )
        else:

            def body(carry, xs):
                total, state = carry
                micro_batch, index = xs
                grads, state, metrics, norms = one(
                    params, state, micro_batch, jax.random.fold_in(rng, index), scale, weights
                )
                return (jax.tree.map(jnp.add, total, grads), state), (metrics, norms)

            zeros = jax.eval_shape(
                lambda: one(params, model_state, first, rng, scale, weights)[0]
            )  # the gradients' dtypes: float32 when the loss is scaled
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
            (total, new_model_state), (metrics, micro_norms) = jax.lax.scan(
                body, (zeros, model_state), (batch, jnp.arange(count)), unroll=_unroll(count)
            )
            grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), total)
            metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
            micro_norms = {name: jnp.mean(norms) for name, norms in micro_norms.items()}
        norms = micro_norms if count == 1 else sq_norms(grads, scale, weights)
        if side_half is not None:
            # Measured only: the statistics and the state this half would compute are dropped,
            # so that batch norm trains on the whole micro-batch as it does without measuring.
            micro_norms = one(params, model_state, side_half, rng, scale, weights)[3]
        extra: dict[str, Any] = {}
        if takes_extra:
            # A loss of the whole params: under optax.masked / multi_transform the inner
            # transform differentiates it at its own leaves (MaskedNode for the others), and the
            # leaves it leaves out are this step's params, constants of its estimate.
            def loss_of(p):
                return loss_fn(transforms.unmask(p, params), new_model_state, whole, policy, rng)[0]

            extra["loss_fn"] = loss_of
        out = apply_gradients(
            tx,
            grads,
            opt_state,
            params,
            loss_scale=loss_scale,
            loss_scaling=loss_scaling,
            fused=fused,
            learning_rate_factor=lr_factor,
            carry=new_model_state,
            carry_before=model_state,
            extra_args=extra,
        )
        metrics = {
            **metrics,
            "skipped": 1.0 - out.finite.astype(jnp.float32),
            "loss_scale": scale,
            "grad_sq_norm": norms["grad_sq_norm"],
            "micro_grad_sq_norm": micro_norms["grad_sq_norm"],
        }
        read = "grad_sq_norm"  # the pair the noise estimate reads
        if weights is not None:
            read = f"{noise_weights}_grad_sq_norm"
            metrics[read] = norms[read]
            metrics[f"{noise_weights}_micro_grad_sq_norm"] = micro_norms[read]
        noise = NoiseNorms(norms[read], micro_norms[read])
        return StepOutput(out.params, out.opt_state, out.carry, out.loss_scale, metrics, noise)

    return controller_step


def _scaled(update: Any, factor: Any) -> Any:
    if not jnp.issubdtype(jnp.result_type(update), jnp.floating):
        return update
    # In at least float32, so that a bfloat16 update is multiplied by the factor unrounded.
    wide = jnp.promote_types(jnp.result_type(update), jnp.float32)
    return (update.astype(wide) * jnp.asarray(factor).astype(wide)).astype(update.dtype)


def _to_float32(grads: Any) -> Any:
    return jax.tree.map(lambda g: g.astype(jnp.float32) if tree_lib.is_trainable(g) else g, grads)


def _sq_norm(grads: Any) -> jax.Array:
    """The squared L2 norm of the trainable leaves, summed in float32."""
    squares = [
        jnp.sum(jnp.square(g.astype(jnp.float32)))
        for g in jax.tree.leaves(grads)
        if tree_lib.is_trainable(g)
    ]
    return sum(squares, jnp.zeros((), jnp.float32))


def _noise_weights(kind: str | None, opt_state: Any, params: Any) -> Any:
    """The weights of the step's weighted squared norms (None: no weighted norms)."""
    if kind is None:
        return None
    if kind == "curvature":
        return _curvature_weights(opt_state, params)
    return _preconditioner_weights(opt_state, params)


def _preconditioner_weights(opt_state: Any, params: Any, floor: float = 1e-3) -> Any:
    """``m / (sqrt(nu) + floor sqrt(m))^2`` per element, from the one ``nu`` in ``opt_state``,
    with ``m`` the mean of ``nu`` over every element.

    Adam's preconditioner ``1 / (sqrt(nu) + eps)^2`` up to one factor a step: the factor makes
    the weighted norms independent of ``nu``'s scale, which moves by orders of magnitude as the
    second moment warms up (it starts at 0 and is not bias-corrected in the state); unscaled,
    the first steps' norms (1e16 at ``nu = 0``) outweighed every later one in the noise scale's
    averages for thousands of steps. The ratio of a step's two weighted norms is unchanged. The
    floor keeps an element whose ``nu`` is still 0 among warm ones at a weight of at most 1e6;
    before any second moment (``m = 0``) every weight is 0: the step carries no estimate.

    Raises:
      ValueError: ``opt_state`` holds no ``nu`` with the params' structure and shapes, or several.
    """
    structure: Any = jax.tree.structure(params)  # a jaxlib PyTreeDef: no stubs
    shapes = jax.tree.map(jnp.shape, params)
    found = [
        nu
        for _, nu in optax.tree_utils.tree_get_all_with_path(opt_state, "nu")
        if jax.tree.structure(nu) == structure and jax.tree.map(jnp.shape, nu) == shapes
    ]
    if len(found) != 1:
        raise ValueError(
            'noise_weights="preconditioned" weighs the gradient by the Adam-like second moment '
            f"the optimizer holds (a `nu` shaped like the params), and it holds {len(found)} "
            "such: use an optimizer with one (optax.adam, optax.adamw, triaccel_jax.triaccel), "
            "or noise_weights=None"
        )
    nu = jax.tree.map(lambda v: v.astype(jnp.float32), found[0])
    leaves = jax.tree.leaves(nu)
    size = sum(leaf.size for leaf in leaves)
    mean = sum(jnp.sum(leaf) for leaf in leaves) / size
    root = jnp.sqrt(mean)

    def weight(v):
        denominator = jnp.square(jnp.sqrt(v) + floor * root)
        return jnp.where(mean > 0, mean / jnp.where(denominator > 0, denominator, 1.0), 0.0)

    return jax.tree.map(weight, nu)


def _curvature_weights(opt_state: Any, params: Any) -> Any:
    """Each leaf's mean curvature in ``opt_state``, clipped at 0 (None where a leaf has none).

    Raises:
      ValueError: ``opt_state`` holds no curvature, or holds it for leaves ``params`` lacks.
    """
    try:
        kappa = transforms.mean_curvatures(opt_state, params)
    except ValueError as error:
        raise ValueError(
            f'noise_weights="curvature" weighs the gradient norms by the curvature the '
            f"optimizer holds, and it holds none usable: {error}. Use an optimizer built with "
            "triaccel_jax.triaccel or triaccel_jax.scale_by_triaccel (e.g. not a plain "
            "optax.adam), or noise_weights=None"
        ) from None
    # Hutchinson's estimate can make a mean curvature negative: such a leaf weighs nothing.
    return jax.tree.map(lambda h: jnp.maximum(h, 0.0), kappa)


def _weighted_sq_norm(grads: Any, weights: Any) -> jax.Array:
    """``sum_l sum_i weights_l,i g_l,i^2`` over the trainable leaves with a weight (a scalar a
    leaf, or one a element), in float32."""
    treedef: Any  # a jaxlib PyTreeDef, which has no stubs mypy can see
    leaves, treedef = jax.tree.flatten(grads)
    terms = [
        jnp.sum(jnp.square(g.astype(jnp.float32)) * h)
        for g, h in zip(leaves, treedef.flatten_up_to(weights), strict=True)
        if h is not None and tree_lib.is_trainable(g)
    ]
    return sum(terms, jnp.zeros((), jnp.float32))


def loss_scaling_for(
    policy: Any, rule: transforms.LossScaling, opt_state: Any
) -> transforms.LossScaling | None:
    """The loss-scaling rule a step under ``policy`` needs: ``rule`` while it computes a leaf in
    fp16 or fp8, else None.

    Raises:
      ValueError: the step needs scaling and ``opt_state`` already scales (an optimizer wrapped
        in ``dynamic_loss_scale`` would unscale the gradients a second time).
    """
    if not transforms.needs_loss_scaling(policy):
        return None
    if transforms.holds_loss_scale(opt_state):
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


def split_in_halves(leaf: Any, *, needs: str) -> jax.Array:
    """A batch leaf of ``b`` samples as ``(2, b / 2, ...)``: the even-numbered samples, then the
    odd-numbered ones, so that a batch sharded over devices splits within each shard (no
    gather). The one way a batch is halved to measure the gradient noise: the controller's
    split step and :func:`triaccel_jax.training.value_and_grad_with_noise` both use it.

    Sample ``i`` goes to row ``i // 2`` of half ``i % 2``: a shard holding samples ``[s * n, (s +
    1) * n)`` with ``n`` even holds rows ``[s * n / 2, (s + 1) * n / 2)`` of each half, so under
    sharding in types (Explicit mesh axes) the reshape keeps the batch axis's sharding on the
    rows. With an odd ``n`` a shard's samples cannot be halved within it; that is refused.

    Args:
      leaf: an array with the samples on its leading axis.
      needs: who needs the halves, for the error (e.g. ``"split=True"``).

    Returns:
      The ``(2, b / 2, ...)`` halves.

    Raises:
      ValueError: the leaf has no leading axis, or an odd number of samples on some shard.
    """
    leaf = jnp.asarray(leaf)
    if leaf.ndim == 0:
        raise ValueError(f"{needs} splits the batch on its leading axis; got a scalar leaf")
    size = leaf.shape[0]
    shards, spec = _batch_shards(leaf)
    if size % 2 or (size // shards) % 2:
        where = f" on each of {shards} shards" if shards > 1 else ""
        raise ValueError(
            f"{needs} halves the batch, which needs an even number of samples on every "
            f"shard, got {size // shards} samples{where} (a leaf of shape {leaf.shape})"
        )
    sizes = (size // 2, 2, *leaf.shape[1:])
    if spec is None:
        pairs = leaf.reshape(sizes)
    else:
        out = jax.sharding.PartitionSpec(spec[0] if spec else None, *([None] * (len(sizes) - 1)))
        pairs = jax.lax.reshape(leaf, sizes, out_sharding=out)
    return jnp.swapaxes(pairs, 0, 1)


def _batch_shards(leaf: jax.Array) -> tuple[int, Any]:
    """How many shards the batch axis (the leading axis) of ``leaf``'s type is split into over
    Explicit mesh axes, and the type's partition spec (None when no axis is Explicit)."""
    sharding: Any = getattr(jax.typeof(leaf), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
        return 1, None
    explicit = {
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Explicit
    }
    if not explicit:
        return 1, None
    spec = tuple(sharding.spec)
    axis = spec[0] if spec else None
    names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
    shards = 1
    for name in names:
        if name in explicit:
            shards *= mesh.shape[name]
    return shards, spec


# XLA:CPU runs a convolution's gradient inside a loop body an order of magnitude slower than the
# same gradient unrolled (the small CNN's gradient of a batch of 32 as two halves: 428 ms in a
# scan, 28 ms unrolled, 25 ms whole). Unrolling a few micro-batches costs compile time only; on
# an accelerator a loop keeps one micro-batch's activations live at a time, which is what an
# out-of-memory retry's accumulation is for, so there only the two halves of a split step (no
# more memory than the whole micro-batch) are unrolled.
_CPU_UNROLL_LIMIT = 8


def _unroll(count: int) -> int:
    """How many micro-batches of the accumulation loop to unroll (``count``: all of them)."""
    if count == 2 or (jax.default_backend() == "cpu" and count <= _CPU_UNROLL_LIMIT):
        return count
    return 1
