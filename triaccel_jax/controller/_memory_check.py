"""The periodic memory check: read the probe, ask the bucket tracker, grow or shrink the bucket.

A "grow" is taken only once the bigger bucket's step is compiled and its compiled peak is under
the high-water mark (else it is logged as a ``"reject"``); a "shrink" is taken at once. Either
moves the learning rate with the batch (docs/design.md §5).
"""

from __future__ import annotations

from typing import Any

from triaccel_jax.controller import _agreement as agreement


def check_memory(controller: Any) -> None:
    """Reads ``controller``'s probe and moves its bucket when the tracker says so.

    Args:
      controller: the :class:`triaccel_jax.controller.Controller` (its steps in flight read).
    """
    micro = controller._micro
    reading = controller.probe.read(batch_size=micro)
    peak, limit = agreement.agree_on_memory(reading.peak_bytes, reading.limit_bytes)
    state = (controller.params, controller.opt_state, controller.model_state)
    tracker = controller._bucket
    decision = tracker.check(
        peak,
        limit,
        compiled_peaks=controller._compiled.peaks(controller._policy_signature()),
        fixed_bytes=tracker.fixed_bytes(state, controller.params),
    )
    background = controller._background
    if decision.kind == "keep" or (decision.kind == "grow" and background.busy):
        return
    if decision.kind == "shrink":
        background.cancel_switch()  # a grow decided before memory tightened is not taken
    figures = {"peak_bytes": controller._known_peaks().get(micro), "limit_bytes": limit}
    if decision.kind == "grow" and controller.config.compile_in_background:
        controller._background.start_grow(controller, decision.bucket, decision.reason, figures)
        return
    if decision.kind == "grow":
        controller._compiled_step(decision.bucket, controller._num_micro(decision.bucket))
        compiled = controller._compiled.peaks(controller._policy_signature())
        refused = tracker.over_high_water(decision.bucket, compiled)
        if refused is not None:
            controller._log(
                "reject",
                micro,
                decision.bucket,
                refused,
                compiled_peak_bytes=compiled[decision.bucket],
                limit_bytes=limit,
            )
            return
    controller._log(decision.kind, micro, decision.bucket, decision.reason, **figures)
    tracker.micro = decision.bucket
    controller._set_learning_rate()
