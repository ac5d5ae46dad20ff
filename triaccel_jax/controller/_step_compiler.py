"""Compiling the controller's step for a (micro-batch, micro-batches, policy), ahead of its data.

The step is built from the loss, the optimizer, the policy and the loss-scaling rule in force and
compiled on shapes only (:func:`triaccel_jax.controller._train_step.abstract_step_arguments`),
so its compiled peak bytes are known before a batch of that size ever runs; that figure is what
the memory-growth decision checks (docs/design.md §5).
"""

from __future__ import annotations

from typing import Any

from triaccel_jax.controller import _train_step as train_step


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
    policy = controller.policy
    key = (micro, num_micro, policy)
    executable = controller._compiled.get(key)
    if executable is not None:
        return executable
    scaling = train_step.loss_scaling_for(policy, controller._loss_scaling, controller.opt_state)
    step = train_step.make_train_step(
        controller._loss,
        controller.tx,
        policy=policy,
        num_micro=num_micro,
        seed=controller._seed,
        loss_scaling=scaling,
    )
    args = train_step.abstract_step_arguments(
        (controller.params, controller.opt_state, controller.model_state),
        controller._feeder.abstract_batch(num_micro, micro),
        controller.loss_scale,
    )
    new = controller._compiled.compile(key, step, args)
    signature = controller._policy_signature()
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
    )
    return new.executable
