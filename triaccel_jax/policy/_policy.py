"""``PrecisionPolicy``: an immutable per-leaf map of compute dtype and state dtype (docs/design.md §3).

Also :class:`PrecisionPlan`, what the planner returns: a policy and the planner's memory.

A leaf's *compute* dtype is the dtype of the copy of the parameter that the forward and backward
passes see (and, with the Flax interceptor, of the module's inputs); its *state* dtype is the dtype
of its optimizer moments (never below bf16). The policy is static: it keys the controller's compile
cache, so it is hashable and compares by its leaves alone, and it lives in the compiled step's
closure, never inside the optimizer state.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import json
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax

from triaccel_jax._src import tree as tree_lib
from triaccel_jax.policy import _dtypes as dtypes

JSON_FORMAT = "triaccel_jax.PrecisionPolicy"
JSON_VERSION = 1
_JSON_ENTRIES = frozenset({"format", "version", "leaves", "reasons"})


class LeafPrecision(NamedTuple):
    """One leaf's precision: short names of its compute and state dtypes."""

    compute: str
    state: str


def trainable_paths(params: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of every leaf the optimizer acts on, in tree order."""
    with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
    return [
        (tree_lib.path_string(p), leaf) for p, leaf in with_paths if tree_lib.is_trainable(leaf)
    ]


def _check_pair(name: str, value: Any) -> None:
    if isinstance(value, tuple) and len(value) != 2:
        raise ValueError(
            f"{name!r}: expected a compute dtype or a (compute, state) pair, got {value!r}"
        )


def _leaf(compute: Any, state: Any) -> LeafPrecision:
    return LeafPrecision(
        dtypes.format_name(compute, what="compute dtype"),
        dtypes.format_name(state, allowed=dtypes.STATE_NAMES, what="state dtype"),
    )


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """An immutable map from leaf path to :class:`LeafPrecision`.

    Build one with :meth:`uniform`, :meth:`from_patterns` or :func:`triaccel_jax.plan_precision`.
    A plain value: equality and hashing use the leaves only (``reasons``, why the planner chose
    each leaf's precision, rides along without changing the policy's identity), so a policy keys
    a compile cache. The planner's hysteresis memory is not here but in the
    :class:`triaccel_jax.policy.PrecisionPlan` it returns. Looking a leaf up by path takes
    constant time (an index built once).

    Attributes:
      leaves: ``(path, LeafPrecision)`` pairs sorted by path.
      reasons: ``{path: reason}``, filled by the planner.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax import PrecisionPolicy
      >>> params = {"dense": {"kernel": jnp.ones((64, 64)), "bias": jnp.zeros(64)}}
      >>> policy = PrecisionPolicy.from_patterns(params, {"*/kernel": "bf16"})
      >>> policy.compute("dense/kernel"), policy.compute("dense/bias")
      ('bf16', 'fp32')
      >>> PrecisionPolicy.from_json(policy.to_json()) == policy
      True
    """

    leaves: tuple[tuple[str, LeafPrecision], ...]
    reasons: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, hash=False)
    _by_path: Mapping[str, LeafPrecision] = dataclasses.field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        leaves = tuple(sorted((str(p), _leaf(*lp)) for p, lp in self.leaves))
        paths = [p for p, _ in leaves]
        if len(set(paths)) != len(paths):
            raise ValueError(f"duplicate leaf paths in a policy: {sorted(paths)}")
        object.__setattr__(self, "leaves", leaves)
        object.__setattr__(self, "reasons", dict(self.reasons))
        object.__setattr__(self, "_by_path", dict(leaves))

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def uniform(cls, params: Any, compute: Any = "fp32", state: Any = "fp32") -> PrecisionPolicy:
        """Every trainable leaf of ``params`` in ``compute``, its moments in ``state``.

        Example:
          >>> import jax.numpy as jnp
          >>> from triaccel_jax import PrecisionPolicy
          >>> PrecisionPolicy.uniform({"w": jnp.ones(3)}, "bf16").compute("w")
          'bf16'
        """
        leaf = _leaf(compute, state)
        return cls(tuple((path, leaf) for path, _ in trainable_paths(params)))

    @classmethod
    def from_patterns(
        cls,
        params: Any,
        patterns: Mapping[str, Any],
        *,
        default: Any = "fp32",
        state: Any = "fp32",
    ) -> PrecisionPolicy:
        """Per-leaf precision from glob patterns on leaf paths (``fnmatch``; first match wins).

        Args:
          params: the parameter tree.
          patterns: ``{pattern: compute}`` or ``{pattern: (compute, state)}``, e.g.
            ``{"*/kernel": "bf16", "head/*": ("fp32", "fp32")}``.
          default: compute dtype of leaves no pattern matches.
          state: state dtype where a pattern gives only the compute dtype.

        Returns:
          The policy.

        Example:
          >>> import jax.numpy as jnp
          >>> from triaccel_jax import PrecisionPolicy
          >>> p = PrecisionPolicy.from_patterns({"a": jnp.ones(2)}, {"a": ("bf16", "bf16")})
          >>> p["a"]
          LeafPrecision(compute='bf16', state='bf16')
        """
        rules = []
        for pattern, value in patterns.items():
            _check_pair(pattern, value)
            compute, leaf_state = (value, state) if not isinstance(value, tuple) else value
            rules.append((pattern, _leaf(compute, leaf_state)))
        fallback = _leaf(default, state)
        leaves = []
        for path, _ in trainable_paths(params):
            match = next(
                (leaf for pattern, leaf in rules if fnmatch.fnmatchcase(path, pattern)), None
            )
            leaves.append((path, match or fallback))
        return cls(tuple(leaves))

    # -- queries ------------------------------------------------------------------------------

    def __getitem__(self, path: str) -> LeafPrecision:
        try:
            return self._by_path[path]
        except KeyError:
            raise KeyError(
                f"no leaf {path!r} in the policy; it has {len(self.leaves)} leaves"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return (path for path, _ in self.leaves)

    def __len__(self) -> int:
        return len(self.leaves)

    def compute(self, path: str) -> str:
        """The compute dtype name of the leaf at ``path``."""
        return self[path].compute

    def state(self, path: str) -> str:
        """The state dtype name of the leaf at ``path``."""
        return self[path].state

    @functools.cached_property
    def signature(self) -> str:
        """A short stable digest of the leaves, for logs and compile-cache keys (computed once)."""
        text = ";".join(f"{p}={c}/{s}" for p, (c, s) in self.leaves)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def check_matches(self, params: Any) -> None:
        """Raises ``ValueError`` naming the paths if the policy does not cover ``params`` exactly."""
        wanted = {path for path, _ in trainable_paths(params)}
        have = set(self)
        if wanted != have:
            missing, extra = sorted(wanted - have), sorted(have - wanted)
            raise ValueError(
                "the precision policy does not match the params: "
                f"leaves without a policy: {missing[:10]}; policy paths not in params: {extra[:10]}"
            )

    def dtype_tree(self, params: Any, which: str = "compute") -> Any:
        """A tree like ``params`` holding each trainable leaf's JAX dtype (others: None).

        Args:
          params: the parameter tree the policy was made for.
          which: ``"compute"`` or ``"state"``.
        """
        if which not in ("compute", "state"):
            raise ValueError(f"`which` must be 'compute' or 'state', got {which!r}")
        self.check_matches(params)
        index = 0 if which == "compute" else 1
        by_path = {path: dtypes.FORMATS[leaf[index]].dtype for path, leaf in self._by_path.items()}
        return jax.tree_util.tree_map_with_path(
            lambda p, x: by_path.get(tree_lib.path_string(p)) if tree_lib.is_trainable(x) else None,
            params,
        )

    def replace(self, **changes: Any) -> PrecisionPolicy:
        """A copy with some leaves changed: ``policy.replace(**{"a/kernel": ("bf16", "fp32")})``."""
        leaves = dict(self._by_path)
        for path, value in changes.items():
            if path not in leaves:
                raise KeyError(f"no leaf {path!r} in the policy")
            _check_pair(path, value)
            compute, state = (value, leaves[path].state) if not isinstance(value, tuple) else value
            leaves[path] = _leaf(compute, state)
        return PrecisionPolicy(tuple(leaves.items()), self.reasons)

    # -- serialisation ------------------------------------------------------------------------

    def to_json(self) -> str:
        """The policy (leaves and reasons) as a JSON document."""
        return json.dumps(
            {
                "format": JSON_FORMAT,
                "version": JSON_VERSION,
                "leaves": {p: {"compute": c, "state": s} for p, (c, s) in self.leaves},
                "reasons": dict(self.reasons),
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> PrecisionPolicy:
        """Reads :meth:`to_json`'s output. Only JSON is accepted; nothing is ever unpickled.

        A document holds what :meth:`to_json` writes and nothing else: an entry it never writes
        (such as the planner's ``"pending"`` streaks, which belong to a
        :class:`triaccel_jax.policy.PrecisionPlan`) is an error naming it.

        Raises:
          ValueError: the text is not a JSON policy document (the message says what is wrong).
        """
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(
                    "not a precision policy: the data is not UTF-8 JSON (binary data such as a "
                    "pickle is refused)"
                ) from None
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not a precision policy: invalid JSON ({error})") from None
        if not isinstance(document, dict) or document.get("format") != JSON_FORMAT:
            raise ValueError(
                f"not a precision policy: expected a JSON object with format {JSON_FORMAT!r}"
            )
        if document.get("version") != JSON_VERSION:
            raise ValueError(
                f"precision policy version {document.get('version')!r} is not supported "
                f"(this triaccel_jax reads version {JSON_VERSION})"
            )
        unknown = sorted(set(document) - _JSON_ENTRIES, key=str)
        if unknown:
            raise ValueError(
                f"not a precision policy: unknown entries {unknown} (a policy document holds "
                f"only {sorted(_JSON_ENTRIES)})"
            )
        leaves = document.get("leaves")
        if not isinstance(leaves, dict) or not all(
            isinstance(v, dict) and set(v) == {"compute", "state"} for v in leaves.values()
        ):
            raise ValueError("not a precision policy: 'leaves' must map paths to {compute, state}")
        reasons = document.get("reasons", {})
        if not isinstance(reasons, dict):
            raise ValueError("not a precision policy: 'reasons' must map paths to strings")
        return cls(
            tuple((p, LeafPrecision(v["compute"], v["state"])) for p, v in leaves.items()),
            {str(k): str(v) for k, v in reasons.items()},
        )

    # -- display ------------------------------------------------------------------------------

    def table(self) -> str:
        """A readable table: one row per leaf with compute, state and the planner's reason."""
        width = max([len("leaf"), *(len(p) for p in self)])
        rows = [f"{'leaf':<{width}}  compute   state  reason", "-" * (width + 40)]
        for path, (compute, state) in self.leaves:
            rows.append(f"{path:<{width}}  {compute:<8}  {state:<5}  {self.reasons.get(path, '')}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for _, (compute, _state) in self.leaves:
            counts[compute] = counts.get(compute, 0) + 1
        summary = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
        return f"PrecisionPolicy({len(self)} leaves: {summary}; signature {self.signature})"


class PrecisionPlan(NamedTuple):
    """What the planner returns: the policy, and its memory for the next re-plan.

    Attributes:
      policy: the :class:`triaccel_jax.PrecisionPolicy` to run (with the planner's ``reasons``);
        a plain value that keys a compile cache.
      pending: the hysteresis memory, ``{path: (proposed compute dtype, consecutive re-plans it
        won)}`` for the leaves held back from a move; pass the plan back to
        :func:`plan_precision` to continue the streaks.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.policy import PrecisionPolicy
      >>> from triaccel_jax.precision import plan_precision
      >>> params = {"w": jnp.ones((64, 64))}
      >>> signals = {"w": {"mean_curvature": 1e-4, "noise_to_signal": 0.0}}
      >>> plan = plan_precision(signals, params, PrecisionPolicy.uniform(params), budget=1.0)
      >>> plan.policy.compute("w"), plan.pending["w"]  # bf16 won once; patience is 2
      ('fp32', ('bf16', 1))
      >>> plan_precision(signals, params, plan, budget=1.0).policy.compute("w")
      'bf16'

    References:
      docs/design.md §3 (hysteresis).
    """

    policy: PrecisionPolicy
    pending: Mapping[str, tuple[str, int]] = {}


def pending_from_document(document: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """The planner's streaks ``{path: (compute dtype, count)}`` in a JSON document's ``"pending"``.

    :attr:`PrecisionPlan.pending` as the controller's state record stores it, beside (not in)
    the policy: ``{path: [compute dtype, count]}``. A document without the entry has none.

    Raises:
      ValueError: the entry is not a map of paths to ``[compute dtype, count]``.
    """
    pending = document.get("pending", {})
    if not isinstance(pending, dict) or not all(
        isinstance(v, list | tuple) and len(v) == 2 and isinstance(v[1], int)
        for v in pending.values()
    ):
        raise ValueError("'pending' must map paths to [compute dtype, count]")
    return {str(p): (str(v[0]), int(v[1])) for p, v in pending.items()}


def check_policy(policy: Any, params: Any = None) -> PrecisionPolicy:
    """Raises unless ``policy`` is a :class:`PrecisionPolicy` (covering ``params``, when given).

    Args:
      policy: what a caller passed as ``policy``.
      params: the params it must cover exactly; None skips that check.

    Returns:
      ``policy``.

    Raises:
      TypeError: ``policy`` is not a PrecisionPolicy.
      ValueError: it does not cover ``params`` (the message names the paths).
    """
    if not isinstance(policy, PrecisionPolicy):
        raise TypeError(f"`policy` must be a PrecisionPolicy, got {type(policy).__name__}")
    if params is not None:
        policy.check_matches(params)
    return policy
