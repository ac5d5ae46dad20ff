"""``MetricWriterCallback``: a progress callback that writes to a metric writer (TensorBoard files).

Each step's figures (loss, the loss scale and skipped flag, the batch and micro-batch, seconds,
samples per second, the memory peak and limit, any metric the loss returns) become scalars, and
each controller decision becomes a text entry at the step it was taken, so TensorBoard shows the
loss curve beside the batch growing and the policy changing.

Given a folder, the callback writes TensorBoard event files with :class:`TensorBoardWriter`, over
tensorboardX, which writes the files without TensorFlow (a few MB of numpy and protobuf, where
``clu.metric_writers`` imports TensorFlow, a 2.6 GB environment). tensorboardX is the optional
``tensorboard`` extra (``pip install -e '.[tensorboard]'`` in a clone), imported only when a writer
is made: ``import triaccel_jax`` never imports it. Any object with ``write_scalars``,
``write_texts`` and ``flush`` (every ``clu.metric_writers.MetricWriter``, for instance) can be
given instead of a folder.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

from triaccel_jax._src import extras
from triaccel_jax._src import validation
from triaccel_jax.controller import _events as events_lib

_WRITER_METHODS = ("write_scalars", "write_texts", "flush")


class TensorBoardWriter:
    """TensorBoard event files in a folder, written by tensorboardX (no TensorFlow needed).

    The writer's methods are those of ``clu.metric_writers``' writers, so
    :class:`MetricWriterCallback` takes either. tensorboardX queues the records and writes them on
    its own thread, so a step does not wait for the disk.

    Args:
      logdir: the folder the event files go to (made if missing).

    Raises:
      ImportError: tensorboardX is not installed; the message names the extra.

    Example:
      >>> import tempfile
      >>> from triaccel_jax.controller import TensorBoardWriter
      >>> with tempfile.TemporaryDirectory() as logdir:
      ...     try:
      ...         writer = TensorBoardWriter(logdir)
      ...     except ImportError as error:  # tensorboardX is an optional extra
      ...         print("pip install -e '.[tensorboard]'" in str(error))
      ...     else:
      ...         writer.write_scalars(1, {"loss": 0.5})
      ...         writer.write_texts(1, {"events/grow": "16 -> 32"})
      ...         writer.close()
      ...         print(True)
      True
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as error:
            raise ImportError(
                f"writing TensorBoard files needs tensorboardX, which could not be imported "
                f"({error}); install the tensorboard extra, {extras.install_hint('tensorboard')}, "
                "or pip install tensorboardX"
            ) from error
        self._writer = SummaryWriter(os.fspath(logdir))

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Writes each ``{tag: value}`` as a scalar at ``step``."""
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), global_step=step)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        """Writes each ``{tag: text}`` as a text at ``step``."""
        for tag, text in texts.items():
            self._writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        """Makes everything written so far reach the disk."""
        self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event files."""
        self._writer.close()


def _event_text(event: events_lib.Event) -> str:
    figures = "".join(f"; {name}={value}" for name, value in event.figures.items())
    return f"{event.old} -> {event.new}: {event.reason}{figures}"


def _scalar(value: Any) -> float | None:
    """``value`` as a float when it is a real number (bools and None are not written)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class MetricWriterCallback:
    """Writes each controller step and decision to a metric writer (TensorBoard files).

    Give it to :class:`triaccel_jax.Controller` as ``callback=``. Per step (every ``every``
    steps) it writes the scalars ``loss``, each metric of :attr:`StepInfo.metrics`
    (``loss_scale``, ``skipped`` and the loss's own), ``batch_size``, ``micro_batch``,
    ``seconds``, ``samples_per_second``, ``peak_bytes`` and ``limit_bytes`` (when measured),
    ``noise_scale`` (the gradient noise scale, once measured and while finite), and
    ``learning_rate`` (the rate the optimizer uses, once a ``"learning_rate"`` event has set
    it) and ``learning_rate_factor`` (the controller's batch scaling of the tuned rate, once a
    ``"learning_rate"`` or ``"update_scale"`` event has set it); each :class:`triaccel_jax.controller.Event` (all of
    them, whatever ``every``) is written as the text ``events/<kind>`` at its step. All names
    get ``prefix``.

    The controller's start-up decisions (its ``"start"`` event, the first compile's and a
    learning-rate change for the starting batch) are taken before any step, so no
    :class:`StepInfo` carries them: write them with ``callback.write_events(controller.events)``
    after making the controller.

    Args:
      writer: a folder for TensorBoard event files (written by :class:`TensorBoardWriter`, which
        needs the tensorboard extra), or a writer: any object with ``write_scalars(step,
        scalars)``, ``write_texts(step, texts)`` and ``flush()``, e.g. a
        ``clu.metric_writers.MetricWriter``.
      every: write the step scalars every this many steps (events are always written).
      prefix: put before every name (e.g. ``"train/"``).

    Raises:
      ImportError: ``writer`` is a folder and tensorboardX is not installed; the message says
        ``pip install -e '.[tensorboard]'`` in a clone.
      TypeError: ``writer`` is neither a folder nor a writer.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> import triaccel_jax
      >>> from triaccel_jax.controller import MetricWriterCallback
      >>> class PrintingWriter:  # a stand-in for TensorBoardWriter(logdir)
      ...     def write_scalars(self, step, scalars):
      ...         print(step, {k: round(v, 1) for k, v in scalars.items() if "batch" in k})
      ...
      ...     def write_texts(self, step, texts):
      ...         print(step, list(texts))
      ...
      ...     def flush(self):
      ...         pass
      >>> x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
      >>> def loss_fn(params, batch, *, policy, rng):
      ...     return jnp.mean((batch @ params["w"]) ** 2)
      >>> callback = MetricWriterCallback(PrintingWriter(), every=2)
      >>> controller = triaccel_jax.Controller(
      ...     loss_fn,
      ...     {"w": jnp.ones(4)},
      ...     triaccel_jax.triaccel(0.01),
      ...     x,
      ...     min_batch=16,
      ...     max_batch=16,
      ...     probe=triaccel_jax.BudgetMemoryProbe(2**30),
      ...     callback=callback,
      ... )
      >>> callback.write_events(controller.events)  # the start-up decisions
      0 ['events/start']
      >>> _ = controller.run(4)
      0 ['events/compile']
      2 {'batch_size': 16.0, 'micro_batch': 16.0}
      4 {'batch_size': 16.0, 'micro_batch': 16.0}
      >>> callback.close()
    """

    def __init__(
        self,
        writer: Any,
        *,
        every: int = 1,
        prefix: str = "",
    ) -> None:
        validation.check_integer("every", every, 1)
        if not isinstance(prefix, str):
            raise TypeError(f"`prefix` must be a str, got {type(prefix).__name__}")
        if isinstance(writer, str | os.PathLike):
            writer = TensorBoardWriter(writer)
        else:
            missing = [m for m in _WRITER_METHODS if not callable(getattr(writer, m, None))]
            if missing:
                raise TypeError(
                    "`writer` must be a folder or a metric writer (with write_scalars, "
                    f"write_texts and flush, like TensorBoardWriter or clu's writers); "
                    f"{type(writer).__name__} lacks {', '.join(missing)}"
                )
        self.writer = writer
        self.every = every
        self.prefix = prefix
        self.learning_rate: float | None = None
        self.learning_rate_factor: float | None = None

    def __call__(self, info: events_lib.StepInfo) -> None:
        """Writes one step: its events, then (every ``every`` steps) its scalars."""
        self.write_events(info.events)
        if info.step % self.every == 0:
            self.writer.write_scalars(info.step, self.step_scalars(info))

    def step_scalars(self, info: events_lib.StepInfo) -> dict[str, float]:
        """The scalars written for ``info``, by name (``prefix`` included)."""
        scalars = {"loss": info.loss}
        for name, value in info.metrics.items():
            if (number := _scalar(value)) is not None:
                scalars[name] = number
        scalars["batch_size"] = info.batch_size
        scalars["micro_batch"] = info.micro_batch
        scalars["seconds"] = info.seconds
        if info.seconds > 0:
            scalars["samples_per_second"] = info.batch_size / info.seconds
        if info.peak_bytes is not None:
            scalars["peak_bytes"] = info.peak_bytes
        if info.limit_bytes is not None:
            scalars["limit_bytes"] = info.limit_bytes
        if info.noise_scale is not None and math.isfinite(info.noise_scale):
            scalars["noise_scale"] = info.noise_scale
        if self.learning_rate is not None:
            scalars["learning_rate"] = self.learning_rate
        if self.learning_rate_factor is not None:
            scalars["learning_rate_factor"] = self.learning_rate_factor
        return {f"{self.prefix}{name}": float(value) for name, value in scalars.items()}

    def write_events(self, events: Iterable[events_lib.Event]) -> None:
        """Writes controller events as texts ``events/<kind>`` at their steps.

        A ``"learning_rate"`` event also sets the ``learning_rate`` (its new value) and
        ``learning_rate_factor`` written from then on; an ``"update_scale"`` event the factor.
        """
        for event in events:
            if not isinstance(event, events_lib.Event):
                raise TypeError(
                    "write_events takes triaccel_jax.controller.Event objects, got "
                    f"{type(event).__name__}"
                )
            if event.kind in ("learning_rate", "update_scale"):
                factor = _scalar(event.figures.get("factor"))
                if factor is not None and math.isfinite(factor):
                    self.learning_rate_factor = factor
            rate = _scalar(event.new) if event.kind == "learning_rate" else None
            if rate is not None and math.isfinite(rate):
                self.learning_rate = rate
            self.writer.write_texts(
                event.step, {f"{self.prefix}events/{event.kind}": _event_text(event)}
            )

    def flush(self) -> None:
        """Makes everything written so far reach the disk."""
        self.writer.flush()

    def close(self) -> None:
        """Flushes, and closes the writer when it has a ``close``."""
        self.flush()
        close = getattr(self.writer, "close", None)
        if callable(close):
            close()

    def __enter__(self) -> MetricWriterCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
