"""``memory_report``: training memory by component, from the pytrees' real dtypes (docs/design.md §7).

XLA on CPU computes bf16 convolutions in fp32, so a CPU's compiled temp bytes do not show what a
precision policy saves. The figures here are device-independent instead:

1. params, compute copies, gradients and optimizer state: exact bytes from shapes and dtypes;
2. the residuals saved for backward: the arrays that ``jax.vjp`` keeps between the forward and the
   backward pass of ``step_fn``, at their real dtypes, read from a jaxpr (nothing runs);
3. optionally, XLA's compiled memory analysis of ``value_and_grad(step_fn)`` on this backend, shown
   apart from the total because it depends on the backend (and on CPU hides bf16 savings).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from triaccel_jax import policy as policy_lib
from triaccel_jax import transforms
from triaccel_jax._src import arrays
from triaccel_jax._src import tree as tree_lib

COMPONENTS = ("params", "compute_copies", "gradients", "optimizer_state", "residuals")

_LABELS = {
    "params": "params (masters, as stored)",
    "compute_copies": "compute copies",
    "gradients": "gradients (as the optimizer gets them)",
    "optimizer_state": "optimizer state",
    "residuals": "residuals saved for backward",
}
_COMPILED_LABEL = "XLA compiled (this backend)"

# Primitives whose single sub-jaxpr maps its inputs and outputs one to one, so that a parameter
# cast inside a jitted helper is still recognised as that parameter's compute copy.
_CALL_PRIMITIVES = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "custom_jvp_call"}
)
# Primitives that return their operand with at most a new dtype.
_COPY_PRIMITIVES = frozenset({"convert_element_type", "copy", "copy_p"})


def compute_copy_dtype(name: str) -> jnp.dtype:
    """The dtype a compute copy in format ``name`` is stored in.

    fp8 copies are carried in bfloat16 (their values are fp8 times a per-leaf scale, rounded to
    bf16, since XLA has no general unscaled fp8 matmul; see :func:`triaccel_jax.cast_params`), so they occupy and
    compute as bf16 (the rule is :func:`triaccel_jax.policy.carrier_dtype`).

    Example:
      >>> from triaccel_jax.precision import compute_copy_dtype
      >>> compute_copy_dtype("fp16"), compute_copy_dtype("fp8_e4m3")
      (dtype('float16'), dtype(bfloat16))
    """
    return policy_lib.carrier_dtype(name)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of training memory by component, at the arrays' real dtypes.

    Attributes:
      params: the parameters as stored (the masters), all array leaves.
      compute_copies: the low-precision copies the forward and backward passes see; 0 for a leaf
        computed in its master's dtype.
      gradients: one gradient per trainable leaf, as the training step hands it to the
        optimizer: in its master's dtype (fp32 for fp32 masters, whatever the compute dtype), or
        in float32 for every leaf while the policy scales the loss (a leaf in fp16 or fp8), since
        the gradients are unscaled in float32.
      optimizer_state: all array leaves of the optimizer state.
      residuals: arrays saved for backward by ``step_fn`` (``None``: not measured), not counting
        the params and compute copies, which ``params`` and ``compute_copies`` already hold.
      compiled: XLA's compiled figure for ``value_and_grad(step_fn)`` on this backend (temp +
        argument + output - alias bytes; ``None``: not measured). Not part of :attr:`total`.

    Example:
      >>> from triaccel_jax.precision._memory import MemoryReport
      >>> report = MemoryReport(params=400, compute_copies=200, gradients=200, optimizer_state=800)
      >>> report.total
      1600
      >>> report.ratio_to(MemoryReport(params=400, gradients=400, optimizer_state=800))
      1.0
    """

    params: int = 0
    compute_copies: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    residuals: int | None = None
    compiled: int | None = None

    @property
    def total(self) -> int:
        """Params + compute copies + gradients + optimizer state + residuals (if measured)."""
        return sum(getattr(self, name) or 0 for name in COMPONENTS)

    def ratio_to(self, other: MemoryReport) -> float:
        """``self.total / other.total``, e.g. a policy's memory relative to an fp32 baseline.

        Raises:
          ValueError: ``other.total`` is 0.
        """
        if other.total == 0:
            raise ValueError("cannot take a ratio to a memory report whose total is 0 bytes")
        return self.total / other.total

    def as_dict(self) -> dict[str, int | None]:
        """The byte counts by component, plus ``"total"``, as a plain dict (for JSON and logs)."""
        return {**dataclasses.asdict(self), "total": self.total}

    def table(self) -> str:
        """A readable table: bytes, MiB and share of the total for each component."""
        width = max(len(label) for label in (*_LABELS.values(), _COMPILED_LABEL))
        total = self.total
        rows = [f"{'component':<{width}}  {'bytes':>14}  {'MiB':>10}  {'share':>6}"]
        rows.append("-" * len(rows[0]))
        for name in COMPONENTS:
            value = getattr(self, name)
            if value is None:
                rows.append(f"{_LABELS[name]:<{width}}  {'not measured':>14}")
                continue
            share = 100.0 * value / total if total else 0.0
            rows.append(
                f"{_LABELS[name]:<{width}}  {value:>14,d}  {value / 2**20:>10.3f}  {share:>5.1f}%"
            )
        rows.append("-" * len(rows[0]))
        rows.append(f"{'total':<{width}}  {total:>14,d}  {total / 2**20:>10.3f}  {100.0:>5.1f}%")
        if self.compiled is not None:
            rows.append(
                f"{_COMPILED_LABEL:<{width}}  {self.compiled:>14,d}  "
                f"{self.compiled / 2**20:>10.3f}  (not in total)"
            )
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


class _Origin(NamedTuple):
    """What a jaxpr variable is made of.

    Attributes:
      params: indices of the param leaves it depends on.
      batch: whether it depends on the batch.
      chain: if it is one parameter passed through pure dtype conversions only, the successive
        dtypes it took (the master's first); else ``None``.
    """

    params: frozenset[int]
    batch: bool
    chain: tuple[Any, ...] | None


_CONSTANT = _Origin(frozenset(), False, None)


def _origin_of(atom: Any, env: dict[Any, _Origin]) -> _Origin:
    # Literals and closed-over constants depend on neither the params nor the batch.
    return env.get(atom, _CONSTANT) if isinstance(atom, jex_core.Var) else _CONSTANT


def _trace_origins(jaxpr: Any, env: dict[Any, _Origin]) -> None:
    """Extends ``env`` (variable -> :class:`_Origin`) over the equations of ``jaxpr``."""
    for eqn in jaxpr.eqns:
        ins = [_origin_of(atom, env) for atom in eqn.invars]
        name = eqn.primitive.name
        if name in _CALL_PRIMITIVES:
            inner = list(jex_core.jaxprs_in_params(eqn.params))
            body = getattr(inner[0], "jaxpr", inner[0]) if len(inner) == 1 else None
            if (
                body is not None
                and len(body.invars) == len(eqn.invars)
                and len(body.outvars) == len(eqn.outvars)
            ):
                inner_env = dict(zip(body.invars, ins, strict=True))
                _trace_origins(body, inner_env)
                for var, out in zip(body.outvars, eqn.outvars, strict=True):
                    env[out] = _origin_of(var, inner_env)
                continue
        if name in _COPY_PRIMITIVES and ins[0].chain is not None:
            chain, dtype = ins[0].chain, jnp.dtype(eqn.outvars[0].aval.dtype)
            env[eqn.outvars[0]] = ins[0]._replace(
                chain=chain if chain[-1] == dtype else (*chain, dtype)
            )
            continue
        # Anything else (arithmetic, control flow): the outputs depend on all of the inputs.
        merged = _Origin(
            frozenset().union(*(o.params for o in ins)), any(o.batch for o in ins), None
        )
        for out in eqn.outvars:
            env[out] = merged


def _residual_bytes(
    step_fn: Callable[[Any, Any], Any], params: Any, batch: Any, kept: list[tuple[Any, Any, Any]]
) -> int:
    """Bytes of the residuals ``jax.vjp(step_fn(., batch), params)`` keeps, params excluded.

    The vjp function is a pytree whose leaves are the residuals, so tracing a function that
    returns it yields a jaxpr whose outputs are exactly the saved arrays, at their real dtypes.
    ``kept[i]`` is ``(master dtype, compute dtype, shape)`` of param leaf ``i``; see
    :func:`_already_counted` for which residuals ``params`` / ``compute_copies`` already hold.
    """
    params_abs, batch_abs = arrays.abstract_tree(params), arrays.abstract_tree(batch)

    def saved(p: Any, b: Any) -> Any:
        _, vjp_fn = jax.vjp(lambda q: step_fn(q, b), p)
        return vjp_fn

    closed = jax.make_jaxpr(saved)(params_abs, batch_abs)
    invars: list[Any] = closed.jaxpr.invars  # avals are ShapedArrays; the stubs say AbstractValue
    param_vars, batch_vars = invars[: len(kept)], invars[len(kept) :]
    env = {
        var: _Origin(frozenset({i}), False, (var.aval.dtype,)) for i, var in enumerate(param_vars)
    }
    env.update({var: _Origin(frozenset(), True, None) for var in batch_vars})
    _trace_origins(closed.jaxpr, env)

    total, seen = 0, set()
    for atom in closed.jaxpr.outvars:
        # Literals are constants of the program (scalars), not arrays held for backward; one
        # array saved twice is held once.
        if not isinstance(atom, jex_core.Var) or atom in seen:
            continue
        seen.add(atom)
        if not _already_counted(atom, _origin_of(atom, env), kept):
            total += arrays.nbytes(atom.aval)
    return total


def _already_counted(var: Any, origin: _Origin, kept: list[tuple[Any, Any, Any]]) -> bool:
    """Whether a residual is a master or a compute copy (counted in params / compute_copies)."""
    if len(origin.params) != 1 or origin.batch:
        return False
    (index,) = origin.params
    master, compute, shape = kept[index]
    if origin.chain is not None:
        # The master itself, or the master converted straight to its compute dtype; a copy
        # rounded to bf16 and cast back up to fp32 is a new array.
        return origin.chain in ((master,), (master, compute))
    # Made from this one parameter (and constants, e.g. a rounding key) by more than a cast, e.g.
    # stochastic rounding or fp8 scaling: a compute copy if it has the copy's shape and dtype.
    return compute != master and var.aval.dtype == compute and tuple(var.aval.shape) == shape


def compiled_peak_bytes(compiled: Any) -> int | None:
    """XLA's predicted peak of a compiled function: temp + argument + output - alias bytes.

    Args:
      compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``).

    Returns:
      The bytes, or None when the backend gives no memory analysis. (XLA's own
      ``peak_memory_in_bytes`` is not used: it is wrong on CPU.)

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.precision import compiled_peak_bytes
      >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(1024)).compile()
      >>> compiled_peak_bytes(compiled) >= 2 * 4096
      True
    """
    if not callable(getattr(compiled, "memory_analysis", None)):
        raise TypeError(
            "`compiled` must be a compiled executable, `jax.jit(f).lower(...).compile()`, got "
            f"{type(compiled).__name__}"
        )
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if stats is None:
        return None
    return int(
        stats.temp_size_in_bytes
        + stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
    )


def step_peak_bytes(step: Callable[..., Any], *args: Any) -> Callable[[int], int | None]:
    """``batch size -> XLA's compiled peak bytes`` of your training step, for
    :class:`triaccel_jax.controller.AdaptiveBatches`'s ``peak_bytes``.

    The step is lowered and compiled at each batch size asked for, on abstract arguments (nothing
    is allocated or run): ``step(*args)`` with every leaf of the last argument, the batch, given
    that many rows on its leading axis. Any batch of the right structure will do as the example,
    the whole data set included. Each size is compiled once and remembered; this compile is apart
    from the one ``jax.jit`` makes when the step first runs at that size, so a batch size costs
    two compiles (the persistent compilation cache, where it is on, serves the second).

    Args:
      step: your step, ``jax.jit``-ed or not (it is jitted here otherwise).
      *args: its arguments as your loop passes them, the batch last: arrays or
        ``jax.ShapeDtypeStruct``.

    Returns:
      A callable from a batch size to the compiled step's peak bytes (temp + arguments + outputs
      - aliased, :func:`compiled_peak_bytes`), or None where the backend gives no analysis.

    Raises:
      TypeError: ``step`` is not callable, or no batch is given.
      ValueError: a leaf of the batch has no leading axis to resize.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from triaccel_jax.precision import step_peak_bytes
      >>> @jax.jit
      ... def step(w, batch):
      ...     x, y = batch
      ...     return w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
      >>> x, y = np.zeros((1000, 64), np.float32), np.zeros(1000, np.float32)
      >>> peak = step_peak_bytes(step, jnp.zeros(64), (x, y))
      >>> peak(512) > peak(64) > 64 * 64 * 4
      True

    References:
      AdaptDL (Qiao et al., 2021) profiles the step's memory at each batch size it may take;
      here XLA's memory analysis predicts it without running the step.
    """
    if not callable(step):
        raise TypeError(f"`step` must be your training step, a callable; got {type(step).__name__}")
    if not args:
        raise TypeError("step_peak_bytes(step, *args) needs the step's arguments, the batch last")
    lower = getattr(step, "lower", None)
    if not callable(lower):
        lower = jax.jit(step).lower
    *before, batch = args
    fixed = arrays.abstract_tree(tuple(before))
    leaves, treedef = jax.tree.flatten(arrays.abstract_tree(batch))
    for leaf in leaves:
        if not getattr(leaf, "shape", ()):
            raise ValueError(
                "every leaf of the batch (the last argument) needs a leading axis of samples to "
                f"resize; got {leaf!r}"
            )
    peaks: dict[int, int | None] = {}

    def peak(batch_size: int) -> int | None:
        if batch_size not in peaks:
            resized = [
                jax.ShapeDtypeStruct((batch_size, *leaf.shape[1:]), leaf.dtype) for leaf in leaves
            ]
            compiled = lower(*fixed, jax.tree.unflatten(treedef, resized)).compile()
            peaks[batch_size] = compiled_peak_bytes(compiled)
        return peaks[batch_size]

    return peak


def _compiled_bytes(step_fn: Callable[[Any, Any], Any], params: Any, batch: Any) -> int | None:
    """XLA's temp + argument + output - alias bytes of ``jit(value_and_grad(step_fn))``."""
    grad_fn = jax.value_and_grad(step_fn, allow_int=True)
    compiled = (
        jax.jit(grad_fn).lower(arrays.abstract_tree(params), arrays.abstract_tree(batch)).compile()
    )
    return compiled_peak_bytes(compiled)


def memory_report(
    params: Any,
    opt_state: Any,
    policy: Any = None,
    step_fn: Callable[[Any, Any], Any] | None = None,
    batch: Any = None,
    *,
    compiled: bool = True,
) -> MemoryReport:
    """Bytes of params, compute copies, gradients, optimizer state and saved residuals.

    Everything is read from shapes and dtypes, so arrays and ``jax.ShapeDtypeStruct`` trees both
    work and nothing is allocated or run (except the optional compile). Per trainable leaf of
    ``n`` elements with master dtype ``m`` and policy compute dtype ``c``: the compute copy takes
    ``n * itemsize(c)`` when ``c != m`` (else 0), the gradient ``n * itemsize(m)``: the step
    differentiates the loss with respect to the masters, so the gradient the optimizer receives
    has the master's dtype (the compute copy's cotangent, in ``c``, is a transient of the
    backward pass, which the compiled figure sees); while the policy computes any leaf in fp16
    or fp8, the loss is scaled and every gradient is unscaled in float32 (as the
    :class:`triaccel_jax.Controller` and ``triaccel_jax.flax.TrainState`` do), so ``4 * n``. An fp8 leaf's ``c`` is bf16, the dtype its
    compute copy is carried in (:func:`compute_copy_dtype`). Integer and other non-trainable
    leaves count in ``params`` only.

    Residuals: with ``step_fn`` and ``batch``, the arrays that ``jax.vjp`` of
    ``lambda p: step_fn(p, batch)`` saves for the backward pass are read from a jaxpr, at their
    real dtypes, deduplicated. A residual that is a parameter, or a parameter's compute copy made
    inside ``step_fn`` (a cast, also inside a jitted helper; or any array made from that one
    parameter and constants alone, e.g. by stochastic rounding or fp8 scaling, with the copy's
    shape and compute dtype), is not counted again: ``params`` and ``compute_copies`` hold it.
    Everything else saved counts (a bf16 copy cast back up to fp32 is a new array), the
    batch included when the backward pass needs it (``x`` of ``x @ w``, at the dtype it is
    saved in, e.g. bf16 after the Flax interceptor cast it). ``step_fn`` receives ``params`` as
    given, so it should compute the way training does (e.g. through
    :func:`triaccel_jax.flax.apply_with_policy`); the policy does not change ``step_fn``.

    Args:
      params: the parameter tree as stored (the masters).
      opt_state: the optimizer state (any pytree).
      policy: a :class:`triaccel_jax.PrecisionPolicy` for ``params``; ``None`` computes every
        leaf in its stored dtype.
      step_fn: ``step_fn(params, batch) -> scalar loss``, the function training differentiates.
      batch: the batch ``step_fn`` takes (arrays or ``jax.ShapeDtypeStruct``).
      compiled: with ``step_fn``, also compile ``jit(value_and_grad(step_fn))`` for this backend
        and keep XLA's temp + argument + output - alias bytes in ``MemoryReport.compiled``. XLA's
        figure depends on the backend: on CPU bf16 convolutions run in fp32, so it does not show
        bf16 savings there. It is reported apart from the total.

    Returns:
      A :class:`MemoryReport`.

    Raises:
      ValueError: the policy does not match ``params`` (the message names the paths), or only one
        of ``step_fn`` and ``batch`` is given.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> params = {"w": jnp.ones((256, 256)), "b": jnp.zeros(256)}
      >>> policy = triaccel_jax.PrecisionPolicy.from_patterns(params, {"w": "bf16"})
      >>> report = triaccel_jax.memory_report(params, optax.adam(1e-3).init(params), policy)
      >>> report.params, report.compute_copies, report.gradients
      (263168, 131072, 263168)
      >>> print(report)
      component                                        bytes         MiB   share
      --------------------------------------------------------------------------
      params (masters, as stored)                    263,168       0.251   22.2%
      compute copies                                 131,072       0.125   11.1%
      gradients (as the optimizer gets them)         263,168       0.251   22.2%
      optimizer state                                526,340       0.502   44.5%
      residuals saved for backward              not measured
      --------------------------------------------------------------------------
      total                                        1,183,748       1.129  100.0%

    References:
      docs/design.md §7 "Measuring memory honestly"; JAX, "Autodiff cookbook" and
      ``jax.ad_checkpoint.print_saved_residuals`` for what ``jax.vjp`` saves.
    """
    if (step_fn is None) != (batch is None):
        raise ValueError(
            "memory_report needs both `step_fn` and `batch` to measure the residuals saved for "
            f"backward (got step_fn={'set' if step_fn is not None else None}, "
            f"batch={'set' if batch is not None else None})"
        )
    with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
    if policy is not None:
        policy_lib.check_policy(policy, params)
        by_path = {path: compute_copy_dtype(leaf.compute) for path, leaf in policy.leaves}
    else:
        by_path = {}

    # Unscaling divides in float32, so the optimizer gets float32 gradients for every leaf.
    scaled = transforms.needs_loss_scaling(policy)
    params_bytes = compute_bytes = grad_bytes = 0
    kept = []  # per leaf: the dtypes in which params + compute_copies already count it
    for key_path, leaf in with_paths:
        params_bytes += arrays.nbytes(leaf)
        master = jnp.dtype(leaf.dtype) if hasattr(leaf, "dtype") else None
        compute = by_path.get(tree_lib.path_string(key_path), master)
        kept.append((master, compute, tuple(getattr(leaf, "shape", ()))))
        if not tree_lib.is_trainable(leaf):
            continue
        assert master is not None and compute is not None  # a trainable leaf has a dtype
        size = math.prod(leaf.shape)
        grad_bytes += size * (4 if scaled else master.itemsize)
        if compute != master:
            compute_bytes += size * compute.itemsize

    state_bytes = sum(arrays.nbytes(leaf) for leaf in jax.tree_util.tree_leaves(opt_state))

    residual_bytes = compiled_bytes = None
    if step_fn is not None:
        residual_bytes = _residual_bytes(step_fn, params, batch, kept)
        if compiled:
            compiled_bytes = _compiled_bytes(step_fn, params, batch)

    return MemoryReport(
        params=params_bytes,
        compute_copies=compute_bytes,
        gradients=grad_bytes,
        optimizer_state=state_bytes,
        residuals=residual_bytes,
        compiled=compiled_bytes,
    )
