"""Wrong calls across the public API: each raises the right exception, naming the problem.

One table, ``CASES``: wrong types, shapes and ranges, mismatched trees, unsupported dtypes,
missing extra arguments, bad Controller configurations, a loss or a compiled step that raises
something other than an out-of-memory error (it must propagate unchanged, never be taken for an
OOM), bad sampler, probe and checkpoint inputs, and what is not a precision policy (a pickle,
non-JSON bytes). Each case asserts the exact exception type and a regex on its message.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import triaccel_jax
from triaccel_jax import Checkpointer
from triaccel_jax import CheckpointError
from triaccel_jax import Controller
from triaccel_jax import PrecisionPolicy

PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3), "step": jnp.array(1, jnp.int32)}
OTHER = {"x": jnp.ones((2, 2))}  # params of another model
SIGNALS = {"w": {"mean_curvature": 1.0, "noise_to_signal": 0.0}}
POLICY_JSON = '{"format": "triaccel_jax.PrecisionPolicy", "version": 1, '
LEAF_W = '"leaves": {"w": {"compute": "bf16", "state": "fp32"}}'


def policy(params: Any = PARAMS, compute: str = "bf16") -> PrecisionPolicy:
    return PrecisionPolicy.uniform(params, compute)


def update(tx: optax.GradientTransformation, grads: Any, **extra_args: Any) -> Any:
    """One update from a fresh state initialised on ``PARAMS``."""
    return tx.update(grads, tx.init(PARAMS), PARAMS, **extra_args)


# -- a small controller, as in tests/controller_harness.py -----------------------------------------


def controller_data(n: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(n, 4)).astype(np.float32), "y": np.zeros(n, np.float32)}


def controller_loss(params, batch, *, policy, rng):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def controller(cls: type[Controller] = Controller, **overrides: Any) -> Controller:
    kwargs = {"min_batch": 8, "max_batch": 32, "probe": triaccel_jax.FakeMemoryProbe(10**12)}
    kwargs.update(overrides)
    tx = kwargs.pop("tx", None) or triaccel_jax.triaccel(1e-2)
    data = kwargs.pop("data", None) or controller_data()
    return cls(kwargs.pop("loss_fn", controller_loss), {"w": jnp.zeros(4)}, tx, data, **kwargs)


def raising(error: BaseException) -> Callable[[Any], None]:
    """A fault injector (``Controller(faults=...)``) raising ``error`` at every dispatch, where
    XLA's runtime errors surface."""

    def inject(site: Any) -> None:
        if site.where == "dispatch":
            raise error

    return inject


def step_unchanged_by_the_error(make: Callable[[], Controller]) -> None:
    """Runs one step that must fail; the failure must not be treated as an out-of-memory."""
    instance = make()
    try:
        instance.step()
    finally:
        assert not [e for e in instance.events if e.kind == "oom"], instance.events
        assert instance.micro_batch == 8 and instance.step_count == 0


def raises_at_construction(params, batch, *, policy, rng):
    raise ValueError("labels out of range: 11 classes, expected 10")


def raises_after_first_trace() -> Callable[..., Any]:
    """A loss that traces fine at construction and raises when the step is traced."""
    traces = []

    def loss(params, batch, *, policy, rng):
        traces.append(1)
        if len(traces) > 1:
            raise ValueError("labels out of range: 11 classes, expected 10")
        return controller_loss(params, batch, policy=policy, rng=rng)

    return loss


def internal_xla_error() -> jax.errors.JaxRuntimeError:
    return jax.errors.JaxRuntimeError("INTERNAL: something else broke")


def out_of_memory() -> jax.errors.JaxRuntimeError:
    return jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: injected, 2.0GiB")


# -- checkpoints ---------------------------------------------------------------------------------


def checkpointer_call(tmp_path: Path, call: Callable[[Checkpointer], Any]) -> Any:
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        return call(checkpointer)


def folder_under_a_file(tmp_path: Path) -> Any:
    (tmp_path / "file").write_text("not a folder")
    return Checkpointer(tmp_path / "file" / "checkpoints")


# -- the table -----------------------------------------------------------------------------------


class Case(NamedTuple):
    id: str
    call: Callable[[Path], Any]
    error: type[BaseException]
    match: str


# The message exactly: JAX may only append a note on its traceback filtering.
UNCHANGED_MESSAGE = r"^labels out of range: 11 classes, expected 10(\n|$)"

T = triaccel_jax
HUTCHINSON = T.TriAccelConfig(estimator="hutchinson")
CASES = [
    # optimizer construction
    Case("triaccel-lr-none", lambda _: T.triaccel(None), ValueError, "`learning_rate`"),
    Case("triaccel-lr-string", lambda _: T.triaccel("0.1"), ValueError, "`learning_rate`"),
    Case(
        "triaccel-b1-vector",
        lambda _: T.triaccel(0.1, b1=[0.9, 0.99]),
        ValueError,
        r"`b1` must be a real scalar.*shape \(2,\)",
    ),
    Case("triaccel-b2-one", lambda _: T.triaccel(0.1, b2=1.0), ValueError, r"`b2`.*\[0.0, 1.0\)"),
    Case(
        "triaccel-state-dtype-int8",
        lambda _: T.triaccel(0.1, config=T.TriAccelConfig(state_dtype="int8")),
        ValueError,
        "`state_dtype`.*'int8'",
    ),
    Case(
        "triaccel-estimator-unknown",
        lambda _: T.triaccel(0.1, config=T.TriAccelConfig(estimator="newton")),
        ValueError,
        "`estimator`.*'newton'",
    ),
    Case(
        "triaccel-min-scale-above-max",
        lambda _: T.triaccel(0.1, min_scale=3.0, max_scale=2.0),
        ValueError,
        "`max_scale` must be >= `min_scale`",
    ),
    Case(
        "TriAccelConfig-block-size-fraction",
        lambda _: T.TriAccelConfig(block_size=2.5),
        ValueError,
        "`block_size` must be an integer",
    ),
    Case(
        "hutchinson-num-samples-zero",
        lambda _: triaccel_jax.transforms.hutchinson_diagonal(0),
        ValueError,
        "`num_samples` must be an integer >= 1",
    ),
    Case(
        "dynamic-loss-scale-zero",
        lambda _: triaccel_jax.transforms.dynamic_loss_scale(optax.sgd(0.1), initial_scale=0.0),
        ValueError,
        "initial_scale",
    ),
    # optimizer init and update
    Case(
        "init-complex-params",
        lambda _: T.triaccel(0.1).init({"w": jnp.ones(3, jnp.complex64)}),
        ValueError,
        "'w' is complex64.*real",
    ),
    Case(
        "init-state-policy-for-other-params",
        lambda _: T.triaccel(0.1, config=T.TriAccelConfig(state_dtype=policy(OTHER))).init(PARAMS),
        ValueError,
        "no entry for leaf",
    ),
    Case(
        "update-grads-of-another-tree",
        lambda _: update(T.triaccel(0.1), {"w": PARAMS["w"]}),
        ValueError,
        "updates do not have the tree structure of the params",
    ),
    Case(
        "update-grad-of-another-shape",
        lambda _: update(T.triaccel(0.1), {**PARAMS, "w": jnp.ones((3, 2))}),
        ValueError,
        r"leaf 'w' has shape \(3, 2\).*\(2, 3\)",
    ),
    Case(
        "update-hutchinson-without-loss-fn",
        lambda _: update(T.triaccel(0.1, config=HUTCHINSON), PARAMS),
        ValueError,
        "needs the loss as an extra argument.*loss_fn=",
    ),
    Case(
        "update-hutchinson-loss-fn-not-callable",
        lambda _: update(T.triaccel(0.1, config=HUTCHINSON), PARAMS, loss_fn=3.0),
        TypeError,
        "`loss_fn` must be callable",
    ),
    Case(
        "hutchinson-without-params",
        lambda _: triaccel_jax.transforms.hutchinson_diagonal().update(
            PARAMS, triaccel_jax.transforms.hutchinson_diagonal().init(PARAMS), loss_fn=jnp.sum
        ),
        ValueError,
        "needs `params`",
    ),
    Case(
        "signals-of-an-adam-state",
        lambda _: T.signals(optax.adam(1e-3).init(PARAMS)),
        ValueError,
        "no triaccel state",
    ),
    Case(
        "loss-scale-of-an-adam-state",
        lambda _: triaccel_jax.transforms.loss_scale(optax.adam(1e-3).init(PARAMS)),
        ValueError,
        "one dynamic_loss_scale state.*found 0",
    ),
    Case(
        "compress-diagonal-block-size-zero",
        lambda _: triaccel_jax.transforms.compress_diagonal(jnp.ones(4), block_size=0, rho=0.5),
        ValueError,
        "`block_size` must be an integer >= 1",
    ),
    Case(
        "compress-diagonal-rho-zero",
        lambda _: triaccel_jax.transforms.compress_diagonal(jnp.ones(4), block_size=2, rho=0.0),
        ValueError,
        r"`rho` must be in \(0.0, 1.0\]",
    ),
    # precision policies
    Case(
        "policy-int8-compute",
        lambda _: PrecisionPolicy.uniform(PARAMS, "int8"),
        ValueError,
        "unknown compute dtype 'int8'",
    ),
    Case(
        "policy-int8-dtype-compute",
        lambda _: PrecisionPolicy.uniform(PARAMS, jnp.int8),
        ValueError,
        "unknown compute dtype",
    ),
    Case(
        "policy-fp16-state",
        lambda _: PrecisionPolicy.uniform(PARAMS, "bf16", "fp16"),
        ValueError,
        "unknown state dtype 'fp16'",
    ),
    Case(
        "policy-pattern-three-tuple",
        lambda _: PrecisionPolicy.from_patterns(PARAMS, {"w": ("bf16", "fp32", "fp32")}),
        ValueError,
        r"'w'.*\(compute, state\) pair",
    ),
    Case(
        "policy-duplicate-paths",
        lambda _: PrecisionPolicy((("a", ("bf16", "fp32")), ("a", ("fp32", "fp32")))),
        ValueError,
        "duplicate leaf paths",
    ),
    Case("policy-unknown-leaf", lambda _: policy()["nope"], KeyError, "no leaf 'nope'"),
    Case(
        "policy-replace-unknown-leaf",
        lambda _: policy().replace(nope="bf16"),
        KeyError,
        "no leaf 'nope'",
    ),
    Case(
        "policy-dtype-tree-which",
        lambda _: policy().dtype_tree(PARAMS, "moments"),
        ValueError,
        "`which` must be 'compute' or 'state'",
    ),
    Case(
        "policy-for-other-params",
        lambda _: policy().check_matches(OTHER),
        ValueError,
        r"leaves without a policy: \['x'\]; policy paths not in params: \['b', 'w'\]",
    ),
    Case(
        "from-json-pickle",
        lambda _: PrecisionPolicy.from_json(pickle.dumps(policy())),
        ValueError,
        "not UTF-8 JSON.*pickle is refused",
    ),
    Case(
        "from-json-ascii-pickle",
        lambda _: PrecisionPolicy.from_json(pickle.dumps({"leaves": {}}, protocol=0)),
        ValueError,
        "not a precision policy: invalid JSON",
    ),
    Case(
        "from-json-binary-garbage",
        lambda _: PrecisionPolicy.from_json(b"\x00\x01garbage"),
        ValueError,
        "not a precision policy: invalid JSON",
    ),
    Case(
        "from-json-another-format",
        lambda _: PrecisionPolicy.from_json('{"format": "pickle", "leaves": {}}'),
        ValueError,
        "format 'triaccel_jax.PrecisionPolicy'",
    ),
    Case(
        "from-json-future-version",
        lambda _: PrecisionPolicy.from_json(POLICY_JSON.replace(": 1,", ": 99,") + '"leaves": {}}'),
        ValueError,
        "version 99 is not supported",
    ),
    Case(
        "from-json-int8-compute",
        lambda _: PrecisionPolicy.from_json(POLICY_JSON + LEAF_W.replace("bf16", "int8") + "}"),
        ValueError,
        "unknown compute dtype 'int8'",
    ),
    Case(
        "from-json-pending-entry",
        lambda _: PrecisionPolicy.from_json(POLICY_JSON + LEAF_W + ', "pending": {"w": "bf16"}}'),
        ValueError,
        r"unknown entries \['pending'\]",
    ),
    Case(
        "from-json-bad-reasons",
        lambda _: PrecisionPolicy.from_json(POLICY_JSON + LEAF_W + ', "reasons": ["fp32"]}'),
        ValueError,
        "'reasons' must map paths",
    ),
    Case(
        "from-json-none",
        lambda _: PrecisionPolicy.from_json(None),
        TypeError,
        "must be str, bytes or bytearray, not NoneType",
    ),
    # casts, masters, updates, state conversion
    Case(
        "cast-policy-for-other-params",
        lambda _: T.cast_params(PARAMS, policy(OTHER)),
        ValueError,
        r"does not match the params: leaves without a policy: \['b', 'w'\]",
    ),
    Case(
        "cast-policy-a-string",
        lambda _: T.cast_params(PARAMS, "bf16"),
        TypeError,
        "`policy` must be a PrecisionPolicy, got str",
    ),
    Case(
        "cast-stochastic-without-key",
        lambda _: T.cast_params(PARAMS, policy(), rounding="stochastic"),
        ValueError,
        "needs a PRNG `key`",
    ),
    Case(
        "cast-unknown-rounding",
        lambda _: T.cast_params(PARAMS, policy(), rounding="up"),
        ValueError,
        "`rounding` must be one of",
    ),
    Case(
        "cast-unknown-impl",
        lambda _: T.cast_params(PARAMS, policy(), impl="cuda"),
        ValueError,
        "`impl` must be one of",
    ),
    Case(
        "master-params-fp16",
        lambda _: T.master_params(PARAMS, policy(), "fp16"),
        ValueError,
        "`master_dtype` must be one of",
    ),
    Case(
        "apply-updates-of-another-tree",
        lambda _: T.stochastic_apply_updates(PARAMS, {"w": PARAMS["w"]}),
        ValueError,
        "`updates` do not have the tree structure of `params`",
    ),
    Case(
        "convert-state-policy-for-other-params",
        lambda _: triaccel_jax.transforms.convert_state(
            T.triaccel(0.1).init(PARAMS), policy(OTHER)
        ),
        ValueError,
        "new policy has no entry for leaf 'b'",
    ),
    Case(
        "convert-state-policy-none",
        lambda _: triaccel_jax.transforms.convert_state(T.triaccel(0.1).init(PARAMS), None),
        TypeError,
        "`policy` must be a PrecisionPolicy, got NoneType",
    ),
    # the planner
    Case(
        "plan-negative-budget",
        lambda _: T.plan_precision(SIGNALS, PARAMS, budget=-1.0),
        ValueError,
        "`budget` must be a number >= 0",
    ),
    Case(
        "plan-nan-budget",
        lambda _: T.plan_precision(SIGNALS, PARAMS, budget=float("nan")),
        ValueError,
        "`budget`",
    ),
    Case(
        "plan-int8-allowed",
        lambda _: T.plan_precision(SIGNALS, PARAMS, allowed=("bf16", "int8")),
        ValueError,
        "unknown allowed dtype 'int8'",
    ),
    Case(
        "plan-allowed-a-string",
        lambda _: T.plan_precision(SIGNALS, PARAMS, allowed="bf16"),
        TypeError,
        r"`allowed` must be a sequence of dtype names, e.g. \('bf16',\)",
    ),
    Case(
        "plan-signals-a-list",
        lambda _: T.plan_precision([SIGNALS], PARAMS),
        TypeError,
        "`signals` must map leaf paths",
    ),
    Case(
        "plan-signal-without-curvature",
        lambda _: T.plan_precision({"w": {"noise_to_signal": 0.0}}, PARAMS, min_size=0),
        ValueError,
        r"`signals\['w'\]` must hold a number 'mean_curvature'",
    ),
    Case(
        "plan-previous-policy-a-string",
        lambda _: T.plan_precision(SIGNALS, PARAMS, "bf16"),
        TypeError,
        "`previous_policy` must be a PrecisionPolicy",
    ),
    Case(
        "plan-previous-policy-for-other-params",
        lambda _: T.plan_precision(SIGNALS, PARAMS, policy(OTHER)),
        ValueError,
        "leaves without a policy",
    ),
    Case(
        "plan-margin-one",
        lambda _: T.plan_precision(SIGNALS, PARAMS, margin=1.0),
        ValueError,
        r"`margin` must be in \[0, 1\)",
    ),
    Case(
        "plan-infinite-loss",
        lambda _: T.plan_precision(SIGNALS, PARAMS, loss=float("inf")),
        ValueError,
        "`loss` must be a finite number",
    ),
    # batch buckets
    Case(
        "buckets-zero",
        lambda _: triaccel_jax.controller.bucket_sizes(0, 8),
        ValueError,
        "`min_batch`.*got 0",
    ),
    Case(
        "buckets-reversed",
        lambda _: triaccel_jax.controller.bucket_sizes(16, 8),
        ValueError,
        r"`min_batch` \(16\) must be <= `max_batch` \(8\)",
    ),
    Case(
        "buckets-none-in-range",
        lambda _: triaccel_jax.controller.bucket_sizes(3, 3, 2),
        ValueError,
        r"no batch size of the form 2 \* 2\*\*k lies in \[3, 3\]",
    ),
    # the sampler
    Case(
        "sampler-no-examples",
        lambda _: triaccel_jax.controller.ElasticSampler(0),
        ValueError,
        "`num_examples`",
    ),
    Case(
        "sampler-negative-seed",
        lambda _: triaccel_jax.controller.ElasticSampler(10, seed=-1),
        ValueError,
        "`seed`",
    ),
    Case(
        "sampler-fractional-batch",
        lambda _: triaccel_jax.controller.ElasticSampler(10).take(2.5),
        ValueError,
        "`batch_size` must be an integer >= 1, got 2.5",
    ),
    Case(
        "sampler-foreign-state",
        lambda _: triaccel_jax.controller.ElasticSampler(10).load_state_dict({"format": "pickle"}),
        ValueError,
        "not a sampler state",
    ),
    Case(
        "sampler-state-of-another-seed",
        lambda _: triaccel_jax.controller.ElasticSampler(10).load_state_dict(
            triaccel_jax.controller.ElasticSampler(10, seed=3).state_dict()
        ),
        ValueError,
        "saved with seed=3, this sampler has seed=0",
    ),
    # memory probes
    Case("budget-probe-zero", lambda _: T.BudgetMemoryProbe(0), ValueError, "`budget_bytes`"),
    Case(
        "budget-probe-float-bytes",
        lambda _: T.BudgetMemoryProbe(1.5e9),
        ValueError,
        "`budget_bytes` must be a positive integer",
    ),
    Case(
        "budget-probe-fraction-zero",
        lambda _: T.BudgetMemoryProbe(fraction=0.0),
        ValueError,
        r"`fraction` must be in \(0, 1\]",
    ),
    Case(
        "budget-probe-callable-negative",
        lambda _: T.BudgetMemoryProbe(lambda: -1).read(batch_size=8),
        ValueError,
        "`budget_bytes`.*got -1",
    ),
    Case(
        "fake-probe-noise-one",
        lambda _: T.FakeMemoryProbe(100, noise=1.0),
        ValueError,
        r"`noise` must be in \[0, 1\)",
    ),
    Case("fake-probe-negative-limit", lambda _: T.FakeMemoryProbe(-5), ValueError, "`limit_bytes`"),
    # checkpoints
    Case("checkpoint-folder-under-a-file", folder_under_a_file, CheckpointError, "cannot create"),
    Case(
        "checkpoint-restore-from-empty-folder",
        lambda tmp: checkpointer_call(tmp, lambda c: c.restore(PARAMS)),
        CheckpointError,
        "no complete checkpoint in",
    ),
    Case(
        "checkpoint-restore-missing-step",
        lambda tmp: checkpointer_call(tmp, lambda c: c.restore(PARAMS, step=3)),
        CheckpointError,
        r"no complete checkpoint for step 3 .*\(have \[\]\)",
    ),
    Case(
        "checkpoint-metadata-not-json",
        lambda tmp: checkpointer_call(tmp, lambda c: c.save(1, PARAMS, metadata={"x": object()})),
        TypeError,
        "metadata must be JSON-serialisable",
    ),
    # the controller
    Case(
        "controller-min-above-max",
        lambda _: controller(min_batch=64, max_batch=16),
        ValueError,
        r"`min_batch` \(64\) must be <= `max_batch` \(16\)",
    ),
    Case("controller-target-one", lambda _: controller(target=1.0), ValueError, "`target`"),
    Case(
        "controller-batch-not-a-bucket",
        lambda _: controller(batch_size=24),
        ValueError,
        r"`batch_size` 24 is not one of the buckets .*: the buckets are the powers of two "
        r"within \[min_batch, max_batch\].*Start at 16 or 32",
    ),
    Case("controller-tx-a-string", lambda _: controller(tx="adam"), TypeError, "`tx` must be"),
    Case(
        "triaccel-leaf-of-2-31-elements",
        lambda _: jax.eval_shape(
            T.triaccel(0.1).init, {"big": jax.ShapeDtypeStruct((2**31,), jnp.float32)}
        ),
        ValueError,
        r"leaf 'big' has 2,147,483,648 elements; triaccel holds at most 2,147,483,647",
    ),
    Case(
        "plan-precision-signals-of-other-paths",
        lambda _: T.plan_precision({"x": SIGNALS["w"]}, PARAMS),
        ValueError,
        r"`signals` holds 1 leaf path\(s\) that `params` has no trainable leaf for \('x'\)",
    ),
    Case(
        "fused-apply-on-another-optimizers-state",
        lambda _: triaccel_jax.transforms.fused_apply(
            triaccel_jax.transforms.fused_triaccel(0.1),
            PARAMS,
            optax.adam(0.1).init(PARAMS),
            PARAMS,
        ),
        ValueError,
        r"`opt_state` is not a state of `fused\.tx` \(another optimizer's",
    ),
    Case(
        "controller-callable-data-returns-wrong-rows",
        lambda _: controller(
            # One row per call, whatever the indices: right for the first sample, wrong after.
            data=lambda idx: {k: v[:1] for k, v in controller_data().items()},
            num_examples=64,
        ).step(),
        ValueError,
        r"`data` returned leaf \"\['x'\]\" of shape \(1, 4\) for 8 indices; expected \(8, 4\)",
    ),
    Case(
        "controller-loss-not-callable",
        lambda _: controller(loss_fn="mse"),
        TypeError,
        "`loss_fn` must be callable",
    ),
    Case(
        "controller-policy-a-string",
        lambda _: controller(policy="bf16"),
        TypeError,
        "`policy` must be a PrecisionPolicy",
    ),
    Case(
        "controller-policy-for-other-params",
        lambda _: controller(policy=policy(OTHER)),
        ValueError,
        r"leaves without a policy: \['w'\]",
    ),
    Case(
        "controller-replan-without-triaccel",
        lambda _: controller(replan_every=5, tx=optax.adam(1e-3)),
        ValueError,
        "no triaccel state",
    ),
    Case(
        "controller-data-without-samples",
        lambda _: controller(data={"x": np.zeros((0, 4)), "y": np.zeros(0)}),
        ValueError,
        "`data` holds no samples",
    ),
    Case(
        "controller-run-negative-steps",
        lambda _: controller().run(-1),
        ValueError,
        "`num_steps` must be an integer >= 0",
    ),
    Case(
        "controller-foreign-state",
        lambda _: controller().load_state_dict({"format": "pickle"}),
        ValueError,
        "not a controller state",
    ),
    Case(
        "controller-restore-without-arrays",
        lambda _: controller().restore({"params": None}, {}),
        ValueError,
        r"restore: `arrays` has no \['model_state', 'opt_state'\]",
    ),
    Case(
        "controller-negative-start-step",
        lambda _: controller(start_step=-1),
        ValueError,
        "`start_step` must be an integer >= 0",
    ),
    # errors that are not out-of-memory propagate unchanged (type and message)
    Case(
        "controller-loss-raises-at-construction",
        lambda _: controller(loss_fn=raises_at_construction),
        ValueError,
        UNCHANGED_MESSAGE,
    ),
    Case(
        "controller-loss-raises-when-the-step-is-traced",
        lambda _: step_unchanged_by_the_error(
            lambda: controller(loss_fn=raises_after_first_trace())
        ),
        ValueError,
        UNCHANGED_MESSAGE,
    ),
    Case(
        "controller-step-raises-internal-xla-error",
        lambda _: step_unchanged_by_the_error(
            lambda: controller(faults=raising(internal_xla_error()))
        ),
        jax.errors.JaxRuntimeError,
        r"^INTERNAL: something else broke(\n|$)",
    ),
    Case(
        "controller-out-of-memory-at-the-smallest-bucket",
        lambda _: controller(faults=raising(out_of_memory()), max_batch=8).step(),
        triaccel_jax.OutOfMemoryError,
        r"smallest batch bucket 8 \(tried micro-batches 1x8.*RESOURCE_EXHAUSTED: injected",
    ),
    # Flax and memory reports
    Case(
        "apply-with-policy-without-params",
        lambda _: triaccel_jax.flax.apply_with_policy(None, {"batch_stats": {}}, policy=policy()),
        ValueError,
        "`variables` has no 'params' collection",
    ),
    Case(
        "precision-interceptor-mixed",
        lambda _: triaccel_jax.flax.precision_interceptor(policy(), mixed="median"),
        ValueError,
        "`mixed` must be one of",
    ),
    Case(
        "memory-report-step-fn-without-batch",
        lambda _: T.memory_report(PARAMS, None, step_fn=lambda p, b: 0.0),
        ValueError,
        "needs both `step_fn` and `batch`",
    ),
    Case(
        "memory-report-policy-a-string",
        lambda _: T.memory_report(PARAMS, None, policy="bf16"),
        TypeError,
        "`policy` must be a PrecisionPolicy, got str",
    ),
    Case(
        "plan-budget-a-string",
        lambda _: T.plan_precision(SIGNALS, PARAMS, budget="0.1"),
        TypeError,
        "`budget` must be a number",
    ),
    Case(
        "compiled-peak-bytes-of-a-function",
        lambda _: triaccel_jax.precision.compiled_peak_bytes(jax.jit(lambda x: x)),
        TypeError,
        "`compiled` must be a compiled executable",
    ),
    Case(
        "event-records-of-ints",
        lambda _: triaccel_jax.controller.event_records([1, 2]),
        TypeError,
        "takes triaccel_jax.controller.Event objects, got int",
    ),
    Case(
        "device-probe-devices-an-int",
        lambda _: T.DeviceMemoryProbe(devices=3),
        TypeError,
        "`devices` must be a sequence of jax devices",
    ),
    Case(
        "device-probe-no-devices",
        lambda _: T.DeviceMemoryProbe(devices=[]),
        TypeError,
        "`devices` must be a non-empty sequence",
    ),
    Case(
        "decide-bucket-current-not-a-bucket",
        lambda _: triaccel_jax.controller.decide_bucket(48, (16, 32, 64), {}, 1000),
        ValueError,
        "`current` bucket 48 is not one of `buckets`",
    ),
    Case(
        "expand-diagonal-store-of-another-shape",
        lambda _: triaccel_jax.transforms.expand_diagonal(
            triaccel_jax.transforms.compress_diagonal(
                jnp.ones((3, 3, 2, 4)), block_size=4, rho=0.1
            ),
            (3, 3, 4, 2),
        ),
        ValueError,
        r"is not one of a leaf of shape \(3, 3, 4, 2\)",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_rejected_naming_the_problem(case, tmp_path):
    with pytest.raises(case.error, match=case.match) as info:
        case.call(tmp_path)
    assert type(info.value) is case.error, info.value  # the type itself, not a subclass


def test_numpy_and_jax_scalars_are_numbers_for_the_planner():
    # A budget computed from a float32 loss is a NumPy or JAX scalar, not a Python float.
    for budget in (np.float32(1e-3), jnp.float32(1e-3), 1e-3):
        assert isinstance(T.plan_precision(SIGNALS, PARAMS, budget=budget).policy, PrecisionPolicy)
