"""``TrainState``: Flax's train state with optax extra arguments, a precision policy and BatchNorm.

Flax's ``flax.training.train_state.TrainState.apply_gradients(grads=..., **kwargs)`` treats every
keyword as a field to replace and calls ``tx.update`` without extra arguments, so a Hutchinson
estimator cannot get its ``loss_fn`` through it. This subclass forwards the known extra-argument
names (and those declared at ``create``) to ``tx.update`` and rejects any other keyword that is
not a field (docs/design.md §6), holds the precision policy (static: it is part of the
compiled program) and the compute copy of the params that the policy asks for, and a
``batch_stats`` field for BatchNorm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from triaccel_jax import policy as policy_lib
from triaccel_jax import training
from triaccel_jax import transforms
from triaccel_jax._src import tree as tree_lib

# The extra arguments optax's transforms and triaccel's take: the loss (triaccel's and optax's
# linesearch ``loss_fn``/``value_fn``, optax.contrib.sophia's ``obj_fn``), its value and gradient
# (``value``, ``grad``: linesearches, reduce_on_plateau). Others are declared at ``create``.
KNOWN_EXTRA_ARGS = frozenset({"loss_fn", "value_fn", "obj_fn", "value", "grad"})


class TrainState(train_state.TrainState):
    """A Flax ``TrainState`` for triaccel: extra arguments, a precision policy, batch statistics.

    How it differs from ``flax.training.train_state.TrainState``:

    * ``apply_gradients(grads=..., **kwargs)``: keywords naming a field of the state are
      replaced as in Flax (e.g. ``batch_stats=``); the names of optax *extra arguments*
      (``loss_fn``, ``value_fn``, ``obj_fn``, ``value``, ``grad``, and those declared with
      ``create(..., extra_arg_names=...)``) are forwarded to ``tx.update`` (e.g. ``loss_fn=``
      for ``TriAccelConfig(estimator="hutchinson")``); any other keyword, such as a misspelt
      field, is a ``TypeError`` naming it rather than an argument silently ignored.
    * ``policy`` (static, not a pytree leaf) and ``compute_params``: with a policy whose compute
      dtypes are not all fp32, ``compute_params`` holds the compute copy of ``params``
      (:func:`triaccel_jax.cast_params`), refreshed by every ``apply_gradients``; the forward pass
      uses :attr:`forward_params`. Gradients taken with respect to the compute copy arrive in its
      dtypes and are cast up to the masters' dtypes before the optimizer sees them, so the
      update is computed in the masters' precision.
    * ``batch_stats``: BatchNorm's running statistics (None for models without them).
    * :meth:`with_policy` switches policy: the optimizer state's moments are converted
      (:func:`triaccel_jax.transforms.convert_state`) and the compute copy rebuilt.
    * Dynamic loss scaling while the policy computes any leaf in fp16 or fp8: take gradients
      with :meth:`value_and_grad` (or of :meth:`scale_loss` of the loss); ``apply_gradients``
      divides them by the scale in float32, and a step with a non-finite gradient changes
      neither the params nor the optimizer state, backs the scale off and is counted in
      ``loss_scale.skipped_steps``.

    Flax's ``OVERWRITE_WITH_GRADIENT`` collection (fp8 training through Flax's own fp8 ops) is
    not supported here.

    Attributes:
      batch_stats: BatchNorm statistics, or None.
      policy: the :class:`triaccel_jax.PrecisionPolicy`, or None (everything in the params'
        own dtypes).
      compute_params: the compute copy, or None when it would equal ``params``.
      extra_arg_names: extra-argument names accepted besides ``KNOWN_EXTRA_ARGS`` (static).
      loss_scale: the dynamic loss scale's state (``scale``, ``good_steps``,
        ``skipped_steps``); it changes only while the policy scales the loss.
      loss_scaling: the scale's rule (static).
      fused: None, or the fused form of ``tx`` (static;
        :func:`triaccel_jax.transforms.fused_triaccel` of ``tx``'s arguments, whose ``tx`` is
        passed as ``tx``): ``apply_gradients`` then writes the moments and the master in one
        pass per leaf (:func:`triaccel_jax.transforms.fused_apply`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> import triaccel_jax
      >>> from triaccel_jax.flax import TrainState
      >>> model = nn.Dense(1)
      >>> x, y = jnp.ones((8, 3)), jnp.zeros((8, 1))
      >>> params = model.init(jax.random.key(0), x)["params"]
      >>> hutchinson = triaccel_jax.TriAccelConfig(estimator="hutchinson")
      >>> tx = triaccel_jax.triaccel(0.1, config=hutchinson)
      >>> state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
      >>> loss = lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)
      >>> state = state.apply_gradients(grads=jax.grad(loss)(state.params), loss_fn=loss)
      >>> int(state.step)
      1
    """

    batch_stats: Any = None
    policy: policy_lib.PrecisionPolicy | None = struct.field(pytree_node=False, default=None)
    compute_params: Any = None
    extra_arg_names: tuple[str, ...] = struct.field(pytree_node=False, default=())
    loss_scale: Any = None
    loss_scaling: transforms.LossScaling = struct.field(
        pytree_node=False, default=transforms.LossScaling()
    )
    fused: transforms.FusedTriAccel | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Any,
        params: Any,
        tx: optax.GradientTransformation,
        policy: policy_lib.PrecisionPolicy | None = None,
        batch_stats: Any = None,
        extra_arg_names: Iterable[str] = (),
        loss_scaling: transforms.LossScaling | None = None,
        **kwargs: Any,
    ) -> TrainState:
        """A state at step 0 with ``tx.init(params)`` and the policy's compute copy.

        Args:
          apply_fn: the model's apply function.
          params: the (master) parameters.
          tx: the optimizer.
          policy: an optional precision policy covering ``params``.
          batch_stats: BatchNorm statistics, if the model has them.
          extra_arg_names: names of extra arguments some transform in ``tx`` takes besides
            the known ``loss_fn``, ``value_fn``, ``obj_fn``, ``value`` and ``grad``.
          loss_scaling: the dynamic loss scale's rule, a
            :class:`triaccel_jax.transforms.LossScaling` (e.g.
            ``LossScaling(initial_scale=2.0**10)``; None: its defaults), used while the policy
            computes a leaf in fp16 or fp8.
          **kwargs: other fields of a subclass.

        Returns:
          The state.

        Raises:
          TypeError: ``loss_scaling`` is not a :class:`triaccel_jax.transforms.LossScaling` (a
            dict of its keywords included), or ``extra_arg_names`` is not a sequence of names.
        """
        if isinstance(extra_arg_names, str) or not isinstance(extra_arg_names, Iterable):
            raise TypeError(
                "`extra_arg_names` must be a sequence of names, e.g. ('temperature',), got "
                f"{extra_arg_names!r}"
            )
        extra_arg_names = tuple(extra_arg_names)
        fields = {f.name for f in dataclasses.fields(cls)}
        for name in extra_arg_names:
            if not isinstance(name, str) or not name.isidentifier():
                raise TypeError(f"`extra_arg_names` holds {name!r}, which is not a name")
            if name in fields:
                raise ValueError(
                    f"`extra_arg_names` holds {name!r}, a field of the state: apply_gradients "
                    "replaces fields, so it cannot also be an extra argument"
                )
        if loss_scaling is None:
            loss_scaling = transforms.LossScaling()
        elif not isinstance(loss_scaling, transforms.LossScaling):
            raise TypeError(
                "`loss_scaling` must be a triaccel_jax.transforms.LossScaling, e.g. "
                f"loss_scaling=LossScaling(initial_scale=2.0**10), got {type(loss_scaling).__name__}"
            )
        if policy is not None:
            policy_lib.check_policy(policy, params)
        opt_state = tx.init(params)
        if policy is not None:
            opt_state = _convert_if_triaccel(opt_state, policy)
        return cls(
            step=jnp.asarray(0, jnp.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=opt_state,
            batch_stats=batch_stats,
            policy=policy,
            compute_params=_compute_copy(params, policy),
            extra_arg_names=extra_arg_names,
            loss_scale=loss_scaling.init(),
            loss_scaling=loss_scaling,
            **kwargs,
        )

    @property
    def forward_params(self) -> Any:
        """The params the forward pass should see: the compute copy, or the params themselves."""
        return self.params if self.compute_params is None else self.compute_params

    @property
    def scales_loss(self) -> bool:
        """Whether the policy computes any leaf in fp16 or fp8, so the loss is scaled."""
        return self.loss_scale is not None and transforms.needs_loss_scaling(self.policy)

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        """``loss`` times the current loss scale (unchanged when the loss is not scaled).

        Gradients of the scaled loss go to :meth:`apply_gradients`, which unscales them.
        """
        return loss * self.loss_scale.scale if self.scales_loss else loss

    def value_and_grad(
        self, loss_fn: Callable[[Any], Any], *, has_aux: bool = False
    ) -> tuple[Any, Any]:
        """The loss at :attr:`forward_params` and the gradients for :meth:`apply_gradients`.

        Args:
          loss_fn: ``params -> loss`` (or ``(loss, aux)`` with ``has_aux``).
          has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

        Returns:
          ``(loss, grads)`` or ``((loss, aux), grads)``: the loss unscaled, the gradients of
          the scaled loss (:meth:`scale_loss`) with respect to the compute copy.
        """

        def scaled(params):
            out = loss_fn(params)
            loss, aux = out if has_aux else (out, None)
            return self.scale_loss(loss), (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(self.forward_params)
        return ((loss, aux) if has_aux else loss), grads

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """One optimizer step.

        Args:
          grads: gradients shaped like ``params`` (with respect to the params or to the compute
            copy; they are cast to each master's dtype first). While the loss is scaled
            (:attr:`scales_loss`), gradients of :meth:`scale_loss` of the loss: they are divided
            by the scale in float32 here.
          **kwargs: fields of the state to replace (e.g. ``batch_stats=``), and optax extra
            arguments for ``tx.update`` (``loss_fn=``, ``value_fn=``, ``obj_fn=``, ``value=``,
            ``grad=`` and the names declared at :meth:`create`).

        Returns:
          The new state: ``step + 1``, updated params, optimizer state and compute copy.

        Raises:
          TypeError: a keyword is neither a field nor an accepted extra argument.
        """
        fields = {f.name for f in dataclasses.fields(self)}
        accepted = KNOWN_EXTRA_ARGS.union(self.extra_arg_names)
        unknown = sorted(k for k in kwargs if k not in fields and k not in accepted)
        if unknown:
            raise TypeError(
                f"apply_gradients got unexpected keyword(s) {', '.join(map(repr, unknown))}: "
                f"neither a field of the state ({', '.join(sorted(fields))}) nor an extra "
                f"argument of the optimizer ({', '.join(sorted(accepted))}). Declare another "
                "extra argument with TrainState.create(..., extra_arg_names=(name,))"
            )
        replaced = {k: v for k, v in kwargs.items() if k in fields}
        extra = {k: v for k, v in kwargs.items() if k not in fields}
        for name in ("step", "params", "opt_state", "compute_params"):
            if name in replaced:
                raise TypeError(f"apply_gradients computes `{name}`; it cannot be passed")
        grads_structure: Any = jax.tree.structure(grads)  # a jaxlib PyTreeDef: no stubs
        if grads_structure != jax.tree.structure(self.params):
            raise ValueError(
                "`grads` must have the structure of `params`: got "
                f"{jax.tree.structure(grads)}, params are {jax.tree.structure(self.params)}"
            )
        scaling = self.loss_scaling if self.scales_loss else None
        if scaling is None:
            # Scaled gradients are unscaled in float32 by apply_gradients, as from fp32 masters.
            grads = jax.tree.map(_to_master_dtype, grads, self.params)
        out = training.apply_gradients(
            self.tx,
            grads,
            self.opt_state,
            self.params,
            loss_scale=self.loss_scale,
            loss_scaling=scaling,
            # Given the optimizer's fused form, the moments and the master are written in one
            # pass per leaf.
            fused=self.fused,
            # An overflowing step keeps the replaced fields (batch statistics) too.
            carry=replaced,
            carry_before={
                name: _kept_on_skip(value, getattr(self, name)) for name, value in replaced.items()
            },
            extra_args=extra,
        )
        return self.replace(
            step=self.step + 1,
            params=out.params,
            opt_state=out.opt_state,
            compute_params=_compute_copy(out.params, self.policy),
            loss_scale=out.loss_scale,
            **out.carry,
        )

    def with_policy(self, policy: policy_lib.PrecisionPolicy | None) -> TrainState:
        """The state under another precision policy (moments converted, compute copy rebuilt).

        Args:
          policy: the new policy, or None for none.

        Returns:
          The state; its program changes (the policy is static), so a jitted step retraces.
        """
        opt_state = self.opt_state
        if policy is not None:
            policy.check_matches(self.params)
            opt_state = _convert_if_triaccel(opt_state, policy)
        return self.replace(
            policy=policy, opt_state=opt_state, compute_params=_compute_copy(self.params, policy)
        )


def _compute_copy(params: Any, policy: policy_lib.PrecisionPolicy | None) -> Any:
    if policy is None or all(policy.compute(path) == "fp32" for path in policy):
        return None
    return policy_lib.cast_params(params, policy)


def _convert_if_triaccel(opt_state: Any, policy: policy_lib.PrecisionPolicy) -> Any:
    if transforms.find_signal_states(opt_state):
        return transforms.convert_state(opt_state, policy)
    return opt_state


def _kept_on_skip(new: Any, old: Any) -> Any:
    """What a replaced field holds after a skipped step: its old value when it is alike (same
    structure, shapes and dtypes), else the new one, as there is no old value of its kind."""
    new_leaves, old_leaves = jax.tree.leaves(new), jax.tree.leaves(old)
    new_structure: Any = jax.tree.structure(new)  # a jaxlib PyTreeDef: no stubs
    alike = new_structure == jax.tree.structure(old) and all(
        jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b)
        for a, b in zip(new_leaves, old_leaves, strict=True)
    )
    return old if alike else new


def _to_master_dtype(grad: Any, param: Any) -> Any:
    if grad is None or not tree_lib.is_trainable(param):
        return grad
    return jnp.asarray(grad).astype(jnp.result_type(param))
