"""Compiling the controller's step for a (micro-batch, micro-batches, policy), ahead of its data.

The step is built from the loss, the optimizer, the policy and the loss-scaling rule in force and
compiled on shapes only (:func:`triaccel_jax.training.abstract_step_arguments`),
so its compiled peak bytes are known before a batch of that size ever runs; that figure is what
the memory-growth decision checks (docs/design.md §5).
"""

from __future__ import annotations

import time
from typing import Any

from triaccel_jax import training as train_step
from triaccel_jax.transforms import _fused_apply as fused_lib


def compiled_step(controller: Any, micro: int, num_micro: int) -> Any:
    """The executable for ``micro`` x ``num_micro`` under ``controller``'s policy, compiled once.

    A new compile is timed, its compiled peak recorded (for a bucket's own step, not an
    out-of-memory retry's accumulation) and logged as a ``"compile"`` event.

    Args:
      controller: the :class:`triaccel_jax.controller.Controller`.
      micro: the micro-batch.
      num_micro: micro-batches per step.

    Returns:
      The compiled step, called as ``(params, opt_state, model_state, batch, step, lr_factor,
      loss_scale)``.
    """
    executable = controller._compiled.get((micro, num_micro, controller.policy))
    if executable is not None:
        return executable
    key, step, args = step_to_compile(controller, micro, num_micro)
    start = time.perf_counter()
    executable = controller._build_step(step, args)
    return keep_compiled(controller, key, executable, time.perf_counter() - start)


def step_to_compile(
    controller: Any,
    micro: int,
    num_micro: int,
    *,
    policy: Any = None,
    opt_state: Any = None,
) -> tuple[tuple, Any, tuple]:
    """``(cache key, step function, abstract arguments)`` for ``micro`` x ``num_micro``.

    Nothing is traced or compiled here, so it is cheap to call for a step already cached.

    Args:
      controller: the :class:`triaccel_jax.controller.Controller`.
      micro: the micro-batch.
      num_micro: micro-batches per step.
      policy: the policy to compile for; default the one in force. A re-plan compiling ahead
        passes the new policy together with ``opt_state`` converted to it.
      opt_state: the optimizer state whose shapes and dtypes the step takes; default the
        controller's.
    """
    if policy is None:
        policy = controller.policy
    if opt_state is None:
        opt_state = controller.opt_state
    scaling = train_step.loss_scaling_for(policy, controller._loss_scaling, opt_state)
    step = train_step.make_train_step(
        controller._loss,
        controller.tx,
        policy=policy,
        num_micro=num_micro,
        seed=controller._seed,
        loss_scaling=scaling,
        fused=fused_step(controller.config.fused_update, controller.tx, opt_state),
    )
    args = train_step.abstract_step_arguments(
        (controller.params, opt_state, controller.model_state),
        controller._feeder.abstract_batch(num_micro, micro),
        controller.loss_scale,
    )
    return (micro, num_micro, policy), step, args


def fused_step(setting: bool | None, tx: Any, opt_state: Any) -> bool:
    """Whether the step updates and applies in one pass (``ControllerConfig.fused_update``).

    Raises:
      ValueError: ``setting`` is True and ``tx`` cannot be fused (the reason is named).
    """
    if setting is None:
        return fused_lib.uses_triton(tx, opt_state)
    if setting:
        reason = fused_lib.unfused_reason(tx, opt_state)
        if reason is not None:
            raise ValueError(f"fused_update=True, but the optimizer cannot be fused: {reason}")
    return bool(setting)


def keep_compiled(
    controller: Any, key: tuple, executable: Any, seconds: float, *, background: bool = False
) -> Any:
    """Caches a newly built step, records its compiled peak and logs a ``"compile"`` event.

    ``background`` (the event's figure) says the compile ran on a worker thread, not in a step.
    """
    micro, num_micro, policy = key
    new = controller._compiled.store(key, executable, seconds)
    signature = "none" if policy is None else policy.signature
    if new.peak_bytes is not None and num_micro == controller._num_micro(micro):
        controller._compiled.record_peak(signature, micro, new.peak_bytes)
    controller.timings["compile"] += new.seconds
    controller._log(
        "compile",
        None,
        f"{num_micro}x{micro}",
        f"first step with micro-batch {micro} x {num_micro}, policy {signature}",
        compiled_peak_bytes=new.peak_bytes,
        policy=signature,
        seconds=round(new.seconds, 3),
        background=background,
    )
    return new.executable
