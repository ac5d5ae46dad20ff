"""Flax: compute each module really in its parameters' policy dtype (docs/design.md §3 (c)).

Casting a parameter to bf16 is not enough for a layer to compute in bf16: ``nn.Dense`` promotes
its input, kernel and bias to a common dtype, so an fp32 activation pulls a bf16 kernel back to
fp32, and the activations and the residuals saved for backward stay fp32. The Linen interceptor
here, active inside :func:`precision_interceptor` (or through :func:`apply_with_policy`), therefore
casts, for every module that owns parameters,

* the module's floating-point inputs (array leaves among the positional and keyword arguments of
  ``__call__``) to the module's compute dtype, and
* the module's own parameters, each first to its own policy compute dtype (its compute copy, as
  :func:`triaccel_jax.cast_params` would make it; a no-op when the caller already passes compute
  copies) and then to the module's compute dtype.

The module's compute dtype comes from the policy entries of its own parameters, looked up by the
module's scope path (``"params/Dense_0/kernel"``, or ``"Dense_0/kernel"`` for a policy built on
``variables["params"]``). Where they differ, ``mixed="largest"`` (the default) takes the dtype of
the module's largest parameter (the kernel), the usual mixed-precision practice: the planner keeps
biases fp32 (``min_size``) as masters, but the layer computes in its kernel's dtype.
``mixed="widest"`` takes their JAX promotion instead, so no leaf computes below its plan: a bf16
kernel next to an fp32 bias then computes in fp32 (on the kernel's bf16-rounded values, an extra
fp32 copy), which saves nothing on Dense/Conv layers with planned policies. A module that owns
only vectors (a norm's scale and bias) computes in the dtype of the activations it receives: its
parameters stay fp32 masters but are cast to that dtype for the computation, as mixed-precision
training runs normalisation layers; so a bf16 convolution feeds a bf16 BatchNorm.

fp8 leaves compute in bf16, the dtype :func:`triaccel_jax.cast_params` carries fp8 values in (XLA
has no general unscaled fp8 matmul): pass its compute copies to get the fp8 rounding with its
per-leaf scale; from fp32 masters the interceptor rounds to bf16 only. Modules without parameters
of their own (the model's root, activations, containers) pass through, so each layer casts what it
receives. The module's output is left in its compute dtype; cast logits up before the loss if you
want an fp32 loss, and inside ``nn.scan`` cast a layer's output back to the carry's dtype (a scan
carry must keep its dtype).

How the parameter cast is done: Linen's ``Module.param`` is not interceptable, so for the duration
of each intercepted method call the interceptor gives the module's scope a shallow copy of its
``params`` collection holding the cast leaves (children keep their own subtrees untouched), and
restores it afterwards. The casts are ordinary ``astype`` ops on the traced parameters, so
``jax.grad`` with respect to fp32 masters returns fp32 gradients through them, and the cast copy is
what the layer's ``dot_general`` (or convolution) reads and saves. This relies on Flax's private
``Scope._collection`` and ``Scope._variables`` (checked by the tests against the installed Flax).
During ``init`` (params mutable) the interceptor does nothing.

NNX: NNX layers (``nnx.Linear``, ``nnx.Conv``, ``nnx.Einsum``, ...) already cast their inputs and
parameters inside ``__call__`` to their ``dtype`` attribute (``promote_dtype``), while
``param_dtype`` keeps the fp32 masters. NNX users get the same effect by setting each layer's
``dtype`` from the policy (built on ``nnx.state(model, nnx.Param)``, whose leaf paths end in
``/value``), here from the kernel as ``mixed="largest"`` would; re-run it after each re-plan:

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> from triaccel_jax import PrecisionPolicy
>>> class MLP(nnx.Module):
...     def __init__(self, rngs):
...         self.l1, self.l2 = nnx.Linear(3, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)
...
...     def __call__(self, x):
...         return self.l2(jnp.tanh(self.l1(x)))
>>> model = MLP(nnx.Rngs(0))
>>> policy = PrecisionPolicy.from_patterns(nnx.state(model, nnx.Param), {"l1/*": "bf16"})
>>> to_dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
>>> for path, module in nnx.iter_modules(model):
...     kernel = "/".join(map(str, path)) + "/kernel/value"
...     if hasattr(module, "dtype") and kernel in set(policy):
...         module.dtype = jnp.dtype(to_dtype[policy.compute(kernel)])
>>> model.l1.dtype, model.l2.dtype
(dtype(bfloat16), dtype('float32'))
>>> model(jnp.ones((1, 3))).dtype  # l2 promotes its bf16 input to its fp32 dtype
dtype('float32')
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from triaccel_jax._src import tree as tree_lib
from triaccel_jax.policy import cast_by_path
from triaccel_jax.precision import compute_copy_dtype

MIXED = ("widest", "largest")
# A module that owns only vectors (a norm's scale and bias, a standalone bias) computes in the dtype
# of the activations it receives, as mixed-precision training runs normalisation layers (its
# parameters stay masters in their own dtype and are cast for the computation only).
FOLLOW_INPUT = "follow the input's dtype"
_PARAMS = "params"


def _policy_dtypes(policy: Any) -> tuple[dict[str, Any], str]:
    """``{path: compute dtype}`` and the prefix of the ``params`` collection in those paths."""
    by_path = {path: compute_copy_dtype(leaf.compute) for path, leaf in policy.leaves}
    prefix = f"{_PARAMS}/" if any(p.startswith(f"{_PARAMS}/") for p in by_path) else ""
    return by_path, prefix


class _Planner:
    """Resolves, per module, the policy dtype of each own parameter leaf and the module's dtype."""

    def __init__(self, policy: Any, mixed: str):
        if mixed not in MIXED:
            raise ValueError(f"`mixed` must be one of {MIXED}, got {mixed!r}")
        self.by_path, self.prefix = _policy_dtypes(policy)
        self.mixed = mixed

    def plan(self, scope_path: tuple[str, ...], own: Mapping[str, Any]) -> tuple[Any, dict]:
        """The module's compute dtype and ``{name: {leaf path: dtype}}`` for its own params."""
        base = self.prefix + "".join(f"{part}/" for part in scope_path)
        leaf_dtypes: dict[str, dict[str, Any]] = {}
        sized = []
        vectors_only = True
        for name, value in own.items():
            with_paths, _ = jax.tree_util.tree_flatten_with_path(value)
            for sub, leaf in with_paths:
                if not tree_lib.is_trainable(leaf):
                    continue
                path = base + name + ("/" + tree_lib.path_string(sub) if sub else "")
                if path not in self.by_path:
                    raise ValueError(
                        f"the precision policy has no entry for {path!r}, a parameter of the "
                        f"module at {'/'.join(scope_path) or '(root)'}; build the policy on the "
                        "variables (or variables['params']) that are applied"
                    )
                leaf_dtypes.setdefault(name, {})[tree_lib.path_string(sub)] = self.by_path[path]
                sized.append((math.prod(leaf.shape), self.by_path[path]))
                vectors_only = vectors_only and leaf.ndim <= 1
        if not sized:
            return None, {}
        if vectors_only:
            return FOLLOW_INPUT, leaf_dtypes
        if self.mixed == "largest":
            top = max(size for size, _ in sized)
            candidates = [dtype for size, dtype in sized if size == top]
        else:
            candidates = [dtype for _, dtype in sized]
        module_dtype = candidates[0]
        # The widest of the dtypes is wanted here: an explicit promotion, allowed under strict.
        with jax.numpy_dtype_promotion("standard"):
            for dtype in candidates[1:]:
                module_dtype = jnp.promote_types(module_dtype, dtype)
        return jnp.dtype(module_dtype), leaf_dtypes


def _cast_leaf(x: Any, *dtype_chain: Any) -> Any:
    for dtype in dtype_chain:
        if x.dtype != dtype:
            x = x.astype(dtype)
    return x


def _cast_inputs(tree: Any, dtype: Any) -> Any:
    def cast(x: Any) -> Any:
        # Arrays only: Python scalars are weakly typed and adopt the module's dtype by themselves.
        if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return _cast_leaf(jnp.asarray(x), dtype)
        return x

    return jax.tree.map(cast, tree)


def _input_dtype(tree: Any) -> Any:
    """The dtype of the first floating array among a call's arguments, or None."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.dtype(x.dtype)
    return None


@contextlib.contextmanager
def _swapped_params(scope: Any, own: Mapping[str, Any], leaf_dtypes: dict, dtype: Any):
    """Shows the module its own params cast for the duration of one method call."""
    original = scope._collection(_PARAMS)
    casted = dict(original)  # children's subtrees are shared, not copied
    for name, per_leaf in leaf_dtypes.items():
        casted[name] = jax.tree_util.tree_map_with_path(
            lambda sub, x, per_leaf=per_leaf: (
                _cast_leaf(x, per_leaf[tree_lib.path_string(sub)], dtype)
                if tree_lib.path_string(sub) in per_leaf
                else x
            ),
            own[name],
        )
    scope._variables[_PARAMS] = casted
    try:
        yield
    finally:
        scope._variables[_PARAMS] = original


def precision_interceptor(
    policy: Any, *, mixed: str = "largest", methods: Collection[str] = ("__call__",)
) -> contextlib.AbstractContextManager[None]:
    """A context in which every Linen module computes in its parameters' policy dtype.

    Inside it, each call of a module that owns parameters sees its inputs (floating array leaves
    of the arguments of the methods in ``methods``) and its own parameters cast to the module's
    compute dtype, so its activations and the residuals it saves for backward are really in that
    dtype. Parameters may be fp32 masters or compute copies: gradients flow back through the casts
    in the masters' dtype. See the module docstring for how modules with mixed dtypes and NNX are
    handled.

    Args:
      policy: a :class:`triaccel_jax.PrecisionPolicy` built on the Linen variables (paths like
        ``"params/Dense_0/kernel"``) or on ``variables["params"]`` (``"Dense_0/kernel"``).
      mixed: a module whose parameters have several compute dtypes computes in the dtype of its
        largest parameter (``"largest"``, the default) or in their promotion (``"widest"``).
      methods: the methods whose inputs are cast (parameters are cast for every method).

    Returns:
      A context manager (``flax.linen.intercept_methods`` around the interceptor).

    Raises:
      ValueError: ``mixed`` is unknown; during apply, a module owns a trainable parameter that the
        policy has no entry for (the message names the path).

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from triaccel_jax import PrecisionPolicy
      >>> from triaccel_jax.flax import precision_interceptor
      >>> model = nn.Dense(4)
      >>> variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> policy = PrecisionPolicy.uniform(variables, "bf16")
      >>> with precision_interceptor(policy):
      ...     y = model.apply(variables, jnp.ones((2, 3)))
      >>> y.dtype
      dtype(bfloat16)

    References:
      Micikevicius et al., 2018, "Mixed Precision Training"; Flax, ``nn.intercept_methods``.
    """
    planner = _Planner(policy, mixed)
    methods = frozenset((methods,) if isinstance(methods, str) else methods)

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        scope = module.scope
        if scope is None or scope.is_mutable_collection(_PARAMS):
            return next_fun(*args, **kwargs)  # unbound, or init: params are being created
        collection = scope._collection(_PARAMS)
        own = {k: v for k, v in collection.items() if not isinstance(v, Mapping)}
        dtype, leaf_dtypes = planner.plan(tuple(scope.path), own)
        if dtype is None:
            return next_fun(*args, **kwargs)
        if dtype is FOLLOW_INPUT:
            dtype = _input_dtype((args, kwargs))
            if dtype is None:
                return next_fun(*args, **kwargs)
        elif context.method_name in methods:
            args, kwargs = _cast_inputs((args, kwargs), dtype)
        with _swapped_params(scope, own, leaf_dtypes, dtype):
            return next_fun(*args, **kwargs)

    return nn.intercept_methods(interceptor)


def _check_covers(policy: Any, params: Any) -> None:
    """Raises ``ValueError`` naming the paths where ``policy`` and the ``params`` collection differ."""
    by_path, prefix = _policy_dtypes(policy)
    wanted = {prefix + path for path, _ in _trainable(params)}
    have = {path for path in by_path if not prefix or path.startswith(prefix)}
    if wanted != have:
        missing, extra = sorted(wanted - have), sorted(have - wanted)
        raise ValueError(
            "the precision policy does not match the model's params: "
            f"leaves without a policy: {missing[:10]}; policy paths not in params: {extra[:10]}"
        )


def _trainable(tree: Any) -> Iterator[tuple[str, Any]]:
    with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in with_paths:
        if tree_lib.is_trainable(leaf):
            yield tree_lib.path_string(path), leaf


def apply_with_policy(
    model: nn.Module,
    variables: Any,
    *args: Any,
    policy: Any,
    mixed: str = "largest",
    cast: bool = True,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    **kwargs: Any,
) -> Any:
    """``model.apply(variables, *args, **kwargs)`` on master params, each module in its policy dtype.

    Checks that ``policy`` covers the ``params`` collection exactly, casts the masters to their
    compute copies (as :func:`triaccel_jax.cast_params` does: fp8 leaves rounded with their
    per-leaf scale and carried in bf16), and applies the model inside
    :func:`precision_interceptor`. The cast passes gradients straight through, so ``jax.grad``
    with respect to the masters gives gradients in the masters' dtype. This is the one call a
    forward pass needs: callers do not cast first.

    Args:
      model: a Linen module.
      variables: its variables (``{"params": masters, ...}``); other collections are not cast.
      *args: positional arguments of ``model.apply`` (the inputs).
      policy: a :class:`triaccel_jax.PrecisionPolicy` built on ``variables`` or on
        ``variables["params"]``; None: plain ``model.apply`` (no cast, no interceptor), so a
        loss written once runs with and without a policy.
      mixed: see :func:`precision_interceptor`.
      cast: True (default): cast the ``params`` collection to its compute copies first. False:
        ``variables["params"]`` already holds compute copies (say, a train state's
        ``compute_params``), or the interceptor's plain ``astype`` of the masters is wanted.
      rounding: rounding of the cast, ``"nearest"`` or ``"stochastic"`` (needs ``key``).
      key: PRNG key for stochastic rounding (one stream per leaf, as in ``cast_params``).
      **kwargs: keyword arguments of ``model.apply`` (``rngs``, ``mutable``, ``method``, ...).

    Returns:
      What ``model.apply`` returns.

    Raises:
      ValueError: the policy does not match the params (the message names the paths), or
        ``rounding="stochastic"`` without a ``key``.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from triaccel_jax import PrecisionPolicy
      >>> from triaccel_jax.flax import apply_with_policy
      >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
      >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> policy = PrecisionPolicy.from_patterns(variables, {"params/layers_0/*": "bf16"})
      >>> apply_with_policy(model, variables, jnp.ones((1, 3)), policy=policy).dtype
      dtype('float32')
      >>> loss = lambda v: apply_with_policy(model, v, jnp.ones((1, 3)), policy=policy).sum()
      >>> jax.grad(loss)(variables)["params"]["layers_0"]["kernel"].dtype  # fp32 masters
      dtype('float32')
      >>> apply_with_policy(model, variables, jnp.ones((1, 3)), policy=None).shape  # plain apply
      (1, 2)

    References:
      Micikevicius et al., 2018, "Mixed Precision Training"; docs/design.md §3.7.
    """
    if policy is None:
        return model.apply(variables, *args, **kwargs)
    if _PARAMS not in variables:
        raise ValueError(f"`variables` has no {_PARAMS!r} collection: got {sorted(variables)}")
    _check_covers(policy, variables[_PARAMS])
    if cast:
        _, prefix = _policy_dtypes(policy)
        compute = cast_by_path(
            variables[_PARAMS],
            lambda path: policy.compute(prefix + path),
            rounding=rounding,
            key=key,
        )
        variables = {**variables, _PARAMS: compute}
    with precision_interceptor(policy, mixed=mixed):
        return model.apply(variables, *args, **kwargs)
