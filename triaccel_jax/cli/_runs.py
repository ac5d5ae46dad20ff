"""The main job's runs: one model trained through a Controller, and the figures each run gives.

* ``fp32``: ``optax.adamw`` in float32 at a fixed batch;
* ``bf16``: ``optax.adamw`` with every layer computing in bfloat16 (fp32 masters and state) at
  the same fixed batch: static mixed precision;
* ``triaccel``: Tri-Accel's update (curvature step sizes over Adam's direction,
  :func:`triaccel_jax.cli._state.triaccel_optimizer`) with Adam's moments stored in low-bit
  formats under ``--state-cap``: by size from the start, then planned per leaf from the run's
  own signals at step ``--state-plan-step`` (:func:`triaccel_jax.cli._state.plan_state`; a plan
  that differs converts the state and the run goes on), the planner re-planning each leaf's compute
  precision every ``--replan-every`` steps, and the batch moved by goodput within the memory
  budget (buckets up to ``--max-batch``; the learning rate follows the square root of
  AdaScale's gain, the controller's default under goodput).

Every run records its optimizer state's bytes by format (counted from the stored leaves) and
XLA's compiled figure of it, and the compiled memory of one whole training step (forward,
backward and the optimizer's update) at the batch it trained at and at the common batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from triaccel_jax import controller as controller_lib
from triaccel_jax import policy as policy_lib
from triaccel_jax import precision as precision_lib
from triaccel_jax import transforms
from triaccel_jax._src import arrays as arrays_lib
from triaccel_jax.cli import _state as state_lib
from triaccel_jax.cli import _task as task

RUNS = ("fp32", "bf16", "triaccel")
RUN_LABELS = {"fp32": "FP32 AdamW", "bf16": "static bf16 AdamW", "triaccel": "Tri-Accel"}


@dataclasses.dataclass
class RunResult:
    """One run's figures.

    ``run_batch`` is the largest batch the run trained at; ``common_batch`` the batch every run's
    memory is also measured at (``--batch-size``). The ``*_memory_mib`` figures are
    ``memory_report``'s analytic total, the ``*_compiled_mib`` ones XLA's compiled memory of one
    whole training step (forward, backward and the optimizer's update, parameters and state
    donated as the controller's step donates them) under the run's final policy at that batch.
    ``seconds`` is the run's wall time without its evaluations, Tri-Accel's state plan
    included (its ``plan_seconds``); of it, ``compile_seconds`` went to compiling the
    controller's steps (or loading them from the persistent cache) and ``step_seconds`` to
    running them (the controller's ``timings``, summed over the controller a changed state plan
    hands the run to). ``samples_per_second`` is training samples over the wall time less
    compiles and the plan. Each of ``evals`` holds ``seconds`` and ``compile_seconds`` so far,
    from which the time to an accuracy is read with or without compiles.

    ``state_bytes`` is the optimizer state's bytes by the format each leaf is stored in
    (:func:`triaccel_jax.cli._state.state_bytes_by_format`); ``state_compiled_bytes`` XLA's
    figure of the whole state in the compiled update (None without a memory analysis), and
    ``parameters`` the trainable elements, for bytes per parameter. ``state_plan`` is
    Tri-Accel's :class:`triaccel_jax.cli._state.StatePlan` as a dict (None for the other runs,
    and for a run that ended before its plan's step).
    """

    name: str
    seconds: float
    # The devices' ``peak_bytes_in_use`` (None where the backend has no memory_stats, as on CPU):
    # at the end of the run, and after its last step at the common batch (before it grew).
    peak_bytes_in_use_mib: float | None
    common_batch_peak_bytes_in_use_mib: float | None
    compile_seconds: float
    step_seconds: float
    samples_per_second: float
    steps: int
    final_batch: int
    run_batch: int
    run_batch_memory_mib: float
    run_batch_compiled_mib: float | None
    common_batch: int
    common_batch_memory_mib: float
    common_batch_compiled_mib: float | None
    accuracy: float
    history: list[dict[str, float]]
    epoch_accuracy: list[float]
    evals: list[dict[str, float]]
    events: list[dict[str, Any]]
    # Each policy the run trained under (FP32's: every leaf fp32): {"step": the first step it ran,
    # "leaves": {path: compute dtype}}.
    policies: list[dict[str, Any]]
    # Tri-Accel's per-leaf step-size scales over training: {"step", "scales": {path: scale}}.
    step_scales: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    parameters: int = 0
    state_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    state_compiled_bytes: int | None = None
    state_plan: dict[str, Any] | None = None

    @property
    def memory_mib(self) -> float:
        """``memory_report``'s total at the common batch, the figure runs are compared by."""
        return self.common_batch_memory_mib

    @property
    def state_bytes_per_parameter(self) -> float | None:
        """XLA's compiled state bytes per trainable parameter (else the stored leaves' count)."""
        if not self.parameters:
            return None
        total = self.state_compiled_bytes
        if total is None:
            total = sum(self.state_bytes.values())
        return total / self.parameters


@dataclasses.dataclass
class _RunLog:
    """What a run records while it trains (the lists of :class:`RunResult`)."""

    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    epoch_accuracy: list[float] = dataclasses.field(default_factory=list)
    evals: list[dict[str, float]] = dataclasses.field(default_factory=list)
    policies: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    step_scales: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    eval_seconds: float = 0.0  # spent evaluating and recording figures: not training time
    common_batch_peak_bytes: int | None = None
    # The controllers the run was handed on from (a changed state plan), first first: their
    # compiles, steps and events are the run's too.
    earlier: list[Any] = dataclasses.field(default_factory=list)
    controller: Any = None  # the controller the run ended with

    def timing(self, controller: Any, key: str) -> float:
        """The run's ``key`` seconds so far (``"compile"``, ``"step"``), ``controller`` the one
        now training."""
        return sum(c.timings[key] for c in self.earlier) + controller.timings[key]


def init_variables(model: Any, has_state: bool, data: task.Data, seed: int) -> tuple[Any, Any]:
    """The model's initial ``(params, model_state)`` (``model_state`` None without BatchNorm),
    the same for every run of one seed."""
    sample = data.train["image"][:2]
    init_kwargs = {"train": False} if has_state else {}
    variables = model.init(jax.random.key(seed), sample, **init_kwargs)
    return variables["params"], variables.get("batch_stats")


def build_controller(
    run: str,
    model: Any,
    has_state: bool,
    loss_fn: Callable[..., Any],
    data: task.Data,
    args: Any,
    *,
    state_formats: str | dict[str, str] = "fp32",
    start: tuple[Any, Any, Any] | None = None,
) -> controller_lib.Controller:
    """The controller of ``run``: its optimizer, policy, batch range and memory probe.

    ``state_formats`` is the format of Tri-Accel's moments (a plan's ``formats``, or one name);
    the fixed runs' AdamW keeps float32 state. ``start`` is ``(params, model_state,
    opt_state)`` to go on from (a run handed to a new state plan); None: the seed's
    initialisation.
    """
    if start is None:
        params, model_state = init_variables(model, has_state, data, args.seed)
        opt_state = None
    else:
        params, model_state, opt_state = start
    common: dict[str, Any] = {
        "model_state": model_state,
        "has_aux": True,
        "seed": args.seed,
        "reference_batch": args.batch_size,
        "check_every": args.check_every,
    }
    if run == "triaccel":
        tx = state_lib.injected_triaccel(args.lr, state_formats)
        budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
        probe = (
            controller_lib.default_memory_probe()
            if budget is None
            else controller_lib.BudgetMemoryProbe(budget)
        )
        min_batch = min(32, args.batch_size)
        kwargs = dict(
            min_batch=min_batch,
            max_batch=max(args.max_batch, args.batch_size),
            batch_size=args.batch_size,
            probe=probe,
            replan_every=args.replan_every,
            first_replan=min(args.first_replan, args.replan_every),
            # A grow's bigger step compiles on a worker thread while training goes on.
            compile_in_background=(
                args.compile_in_background
                if args.compile_in_background is not None
                else jax.devices()[0].platform != "cpu"
            ),
        )
    else:
        tx = optax.adamw(args.lr, weight_decay=state_lib.WEIGHT_DECAY)
        policy = policy_lib.PrecisionPolicy.uniform(params, "bf16") if run == "bf16" else None
        kwargs = dict(
            min_batch=args.batch_size,
            max_batch=args.batch_size,
            # The batch is fixed (min = max); the probe only supplies the recorded figures.
            probe=controller_lib.default_memory_probe(),
            policy=policy,
            lr_scaling="none",
        )
    return controller_lib.Controller(
        loss_fn, params, tx, data.train, opt_state=opt_state, **common, **kwargs
    )


def _history_row(info: Any, samples: int) -> dict[str, float]:
    return {
        "step": info.step,
        "samples": samples,
        "loss": info.loss,
        "batch": info.batch_size,
        "peak_mib": math.nan if info.peak_bytes is None else info.peak_bytes / 2**20,
        "limit_mib": math.nan if info.limit_bytes is None else info.limit_bytes / 2**20,
        "noise_scale": math.nan if info.noise_scale is None else info.noise_scale,
    }


_MAX_CHUNK = 64  # steps per Controller.run call


def planned_samples(data: task.Data, args: Any) -> int:
    """The samples one fixed-batch run trains: ``--epochs`` epochs, or ``--max-steps`` steps."""
    samples = len(data.train["label"]) * args.epochs
    if args.max_steps is not None:
        samples = min(samples, args.max_steps * args.batch_size)
    return samples


def _advance(progress: Any, samples: int) -> None:
    """Moves the bar by ``samples``, first stretching its total where a run trains more than
    planned (a grown batch's last step of an epoch draws from the next one)."""
    total = getattr(progress, "total", None)
    if total is not None and progress.n + samples > total:
        progress.total = progress.n + samples
        progress.refresh()
    progress.update(samples)


def _chunk_steps(
    controller: controller_lib.Controller, args: Any, max_steps: float, stop_at: float = math.inf
) -> int:
    """Steps to the epoch's end, the next evaluation, the step limit or ``stop_at`` (the state
    plan's step, until it is taken).

    Counted at the largest batch the run may reach, so that a batch that grows inside the chunk
    cannot carry it past the epoch's end (at most the epoch's last step draws into the next).
    """
    sampler = controller.sampler
    largest = max(controller.batch_size, *controller.buckets)
    left_in_epoch = -(-(sampler.num_examples - sampler.cursor) // largest)
    steps = min(left_in_epoch, _MAX_CHUNK, max_steps - controller.step_count)
    if stop_at > controller.step_count:
        steps = min(steps, stop_at - controller.step_count)
    if args.eval_every:
        steps = min(steps, args.eval_every - controller.step_count % args.eval_every)
    return max(int(steps), 1)


def _train_epochs(
    run: str,
    controller: controller_lib.Controller,
    loss_fn: Any,
    data: task.Data,
    args: Any,
    progress: Any,
    spent: float = 0.0,
    replan: tuple[int, Callable[[Any], Any]] | None = None,
) -> _RunLog:
    """Steps ``controller`` through ``args.epochs`` epochs (or ``--max-steps``), recording.

    ``spent`` is the run's seconds before its first step (the formats Tri-Accel's state starts
    in), counted in every evaluation's ``seconds``.

    ``replan`` is ``(step, hand_on)``: once the run has taken ``step`` steps, ``hand_on(controller)``
    returns the controller it goes on with (Tri-Accel's state plan: the same one, or one with the
    state in the plan's formats that carries on from the same step); its seconds are the run's.
    """
    log = _RunLog()
    start = time.perf_counter()
    plan_step = math.inf if replan is None else replan[0]

    def record_eval() -> float:
        seconds = spent + time.perf_counter() - start - log.eval_seconds
        eval_start = time.perf_counter()
        accuracy = task.evaluate(
            loss_fn, controller.params, controller.model_state, controller.policy, data.test
        )
        log.evals.append(
            {
                "step": controller.step_count,
                "samples": controller.sampler.samples_seen,
                "accuracy": accuracy,
                "seconds": seconds,
                "compile_seconds": log.timing(controller, "compile"),
            }
        )
        log.eval_seconds += time.perf_counter() - eval_start
        return accuracy

    max_steps = args.max_steps if args.max_steps is not None else math.inf
    grown = False
    samples = 0

    def record_step_scales() -> None:
        # Reading the scales waits for the device: counted with the evaluations, not training.
        begin = time.perf_counter()
        leaves = transforms.signals(controller.opt_state)
        scales = {path: float(figures["step_scale"]) for path, figures in leaves.items()}
        log.step_scales.append({"step": controller.step_count, "scales": scales})
        log.eval_seconds += time.perf_counter() - begin

    for epoch in range(args.epochs):
        while controller.sampler.epoch <= epoch and controller.step_count < max_steps:
            # Steps run in chunks through Controller.run, which keeps a step in flight (the
            # device never waits for the host to read metrics); a chunk ends at the epoch's end,
            # the next evaluation or the step limit at the current batch (a batch that grows
            # inside a chunk may end it a few steps into the next epoch).
            for info in controller.run(_chunk_steps(controller, args, max_steps, plan_step)):
                samples += info.batch_size
                log.history.append(_history_row(info, samples))
                grown = grown or info.batch_size > args.batch_size
                replanned = any(e.kind == "replan" for e in info.events)
                policy = controller.policy
                if not log.policies or (replanned and policy is not None):
                    # Every run's: FP32's (no policy: every leaf in fp32) and static bf16's too,
                    # for the precision map's side-by-side panels.
                    policy = policy or policy_lib.PrecisionPolicy.uniform(controller.params)
                    leaves = {path: policy.compute(path) for path in policy}
                    log.policies.append({"step": info.step - 1, "leaves": leaves})
                _advance(progress, info.batch_size)
                progress.set_postfix(
                    run=run,
                    loss=f"{info.loss:.3f}",
                    batch=info.batch_size,
                    mem=f"{(info.peak_bytes or 0) / 2**20:.0f}MiB",
                )
            if replan is not None and controller.step_count >= plan_step:
                handed_on = replan[1](controller)
                if handed_on is not controller:
                    log.earlier.append(controller)
                    controller = handed_on
                plan_step = math.inf
            if run == "triaccel":
                record_step_scales()
            # The high-water mark at the common batch: read until the batch first grows.
            if not grown:
                log.common_batch_peak_bytes = device_peak_bytes()
            if args.eval_every and controller.step_count % args.eval_every == 0:
                record_eval()
        # The end of each epoch is evaluated too (once, if --eval-every just did).
        last = log.evals[-1] if log.evals else None
        if last is not None and last["step"] == controller.step_count:
            log.epoch_accuracy.append(last["accuracy"])
        else:
            log.epoch_accuracy.append(record_eval())
        if controller.step_count >= max_steps:
            break
    log.controller = controller
    return log


def train_run(run: str, data: task.Data, args: argparse.Namespace, progress: Any) -> RunResult:
    """Trains ``run`` (one of :data:`RUNS`) on ``data`` and measures it.

    Tri-Accel's state starts in the formats its size gives under ``--state-cap``
    (:func:`triaccel_jax.cli._state.initial_state_formats`) and is planned from the run's own
    signals at step ``--state-plan-step`` (:func:`triaccel_jax.cli._state.plan_state`); a plan
    that differs hands the run to a controller with the state converted, which goes on from the
    same step. Planning's seconds count in its wall time.

    Args:
      run: ``"fp32"``, ``"bf16"`` or ``"triaccel"``.
      data: the data set.
      args: the main job's parsed arguments.
      progress: a tqdm-like bar (``update``, ``set_postfix``).

    Returns:
      The run's :class:`RunResult`.
    """
    model, has_state = task.build_model(args.model, data.num_classes)
    loss_fn = task.make_loss(model, has_state, data.channel_stats)
    plans: list[state_lib.StatePlan] = []
    formats: str | dict[str, str] = "fp32"
    replan = None
    build = functools.partial(build_controller, run, model, has_state, loss_fn, data, args)
    start = time.perf_counter()
    if run == "triaccel":
        params, _ = init_variables(model, has_state, data, args.seed)
        under_cap = {"learning_rate": args.lr, "cap": args.state_cap}
        initial = state_lib.initial_state_formats(params, **under_cap)
        formats = initial

        def hand_on(old: controller_lib.Controller) -> controller_lib.Controller:
            begin = time.perf_counter()
            plan = state_lib.plan_state(
                old.opt_state, old.params, step=old.step_count, started_in=initial, **under_cap
            )
            new = old
            if plan.switched:
                opt_state = state_lib.convert_state_formats(
                    old.opt_state, old.params, learning_rate=args.lr, formats=plan.formats
                )
                new = build(
                    state_formats=plan.formats, start=(old.params, old.model_state, opt_state)
                )
                new.load_state_dict(old.state_dict())
            plans.append(dataclasses.replace(plan, plan_seconds=time.perf_counter() - begin))
            return new

        replan = (args.state_plan_step, hand_on)
    spent = time.perf_counter() - start
    controller = build(state_formats=formats)
    start = time.perf_counter()
    log = _train_epochs(run, controller, loss_fn, data, args, progress, spent=spent, replan=replan)
    controller = log.controller
    seconds = spent + time.perf_counter() - start - log.eval_seconds
    compile_seconds = log.timing(controller, "compile")
    plan = plans[0] if plans else None
    plan_seconds = spent + (0.0 if plan is None else plan.plan_seconds)

    # Memory of one step under the run's final policy, at the largest batch the run trained at
    # and at the common batch: a run that grew its batch needs more than the common figure says.
    run_batch = max((int(h["batch"]) for h in log.history), default=args.batch_size)
    run_report = step_memory(loss_fn, controller, data, run_batch)
    if run_batch == args.batch_size:
        common = run_report
    else:
        common = step_memory(loss_fn, controller, data, args.batch_size)
    training_seconds = seconds - compile_seconds - plan_seconds
    return RunResult(
        name=run,
        seconds=seconds,
        peak_bytes_in_use_mib=_mib(device_peak_bytes()),
        common_batch_peak_bytes_in_use_mib=_mib(log.common_batch_peak_bytes),
        compile_seconds=compile_seconds,
        step_seconds=log.timing(controller, "step"),
        samples_per_second=controller.sampler.samples_seen / max(training_seconds, 1e-9),
        steps=controller.step_count,
        final_batch=controller.batch_size,
        run_batch=run_batch,
        run_batch_memory_mib=run_report.total / 2**20,
        run_batch_compiled_mib=_mib(run_report.compiled),
        common_batch=args.batch_size,
        common_batch_memory_mib=common.total / 2**20,
        common_batch_compiled_mib=_mib(common.compiled),
        accuracy=log.epoch_accuracy[-1],
        history=log.history,
        epoch_accuracy=log.epoch_accuracy,
        evals=log.evals,
        events=[_jsonable(r) for c in (*log.earlier, controller) for r in c.event_records()],
        policies=log.policies,
        step_scales=log.step_scales,
        parameters=sum(
            math.prod(leaf.shape)
            for leaf in jax.tree.leaves(controller.params)
            if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating)
        ),
        state_bytes=state_lib.state_bytes_by_format(controller.opt_state),
        state_compiled_bytes=state_lib.compiled_state_bytes(controller.tx, controller.params),
        state_plan=None if plan is None else dataclasses.asdict(plan),
    )


def step_memory(
    loss_fn: Callable[..., Any],
    controller: controller_lib.Controller,
    data: task.Data,
    batch_size: int,
) -> precision_lib.MemoryReport:
    """The memory of one training step at ``batch_size`` under the controller's policy.

    ``memory_report``'s analytic count (parameters, compute copies, gradients, the optimizer
    state as stored, the residuals saved for backward), with XLA's compiled figure of the whole
    step in its ``compiled``: the loss's forward and backward, the optimizer's update and its
    application, the parameters and the optimizer state donated as the controller's step donates
    them (so that a state stored in fewer bytes shows there, and its update's temporaries too).
    The batch is the first ``batch_size`` training samples (repeated if the set is smaller: only
    shapes and dtypes matter); nothing is run.
    """
    size = len(data.train["label"])
    index = np.arange(batch_size) % size
    batch = {k: v[index] for k, v in data.train.items()}
    policy = controller.policy
    model_state = controller.model_state
    tx = controller.tx

    def loss_of(p, b, s=model_state):
        return loss_fn(p, b, policy=policy, rng=jax.random.key(0), model_state=s)

    def train_step(params, opt_state, model_state, batch):
        (_, aux), grads = jax.value_and_grad(
            lambda p: loss_of(p, batch, model_state), has_aux=True
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, aux.get("model_state")

    report = precision_lib.memory_report(
        controller.params,
        controller.opt_state,
        policy,
        lambda p, b: loss_of(p, b)[0],
        batch,
        compiled=False,
    )
    abstract = arrays_lib.abstract_tree(
        (controller.params, controller.opt_state, model_state, batch)
    )
    compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(*abstract).compile()
    return dataclasses.replace(report, compiled=precision_lib.compiled_peak_bytes(compiled))


def device_peak_bytes() -> int | None:
    """The largest ``peak_bytes_in_use`` of the local devices, or None without memory_stats."""
    peaks = []
    for device in jax.local_devices():
        stats = device.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def _mib(value: int | None) -> float | None:
    return None if value is None else value / 2**20


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(record, default=str))
