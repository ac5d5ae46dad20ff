"""The controller tests' shared setting: a small regression problem and a controller on it.

Imported by the tests of every stage that drives a :class:`triaccel_jax.Controller`
(``from controller_harness import make_controller``); ``tests/conftest.py`` also offers the
factory as the ``make_controller`` fixture. It offers:

* ``make_data``, ``make_params``, ``loss_fn``: 512 samples of an 8-feature tanh regression, a
  two-layer MLP's params for it, and its mean-squared-error loss (the controller's signature);
* ``linear_probe``: a :class:`~triaccel_jax.FakeMemoryProbe` whose peak is linear in the batch;
* ``make_controller(cls=Controller, **overrides)``: a controller on that problem (buckets 8-256,
  the linear probe, a memory check every step, seed 0); any argument can be overridden, the
  params and optimizer included. The batch
  rule is the library's default (goodput, which times the buckets): a test of memory-driven
  growth or shrinking passes ``batch_rule="memory"`` itself;
* ``VirtualClock``, ``take_time`` and ``slower_per_sample``: a clock to pass as the
  controller's ``clock=`` that moves only when a step takes its seconds, the call a traced step
  takes them with (a real sleep without a clock), and a loss whose step takes ``seconds x
  batch^2``: the goodput rule's timing, without the machine's noise;
* ``FaultyController``: a controller with out-of-memory errors injected through ``faults=``,
  keeping every :class:`StepInfo` it delivers;
* ``BIG``, a memory limit nothing reaches; ``BASE_LR`` and ``shrink_settings()``: a batch of 64
  that an out-of-memory error shrinks to 32, with the learning rate scaled linearly.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import triaccel_jax
from triaccel_jax import Controller
from triaccel_jax import FakeMemoryProbe
from triaccel_jax.controller import OutOfMemoryFaults

NUM_EXAMPLES = 512
BIG = 10**12  # a limit nothing reaches


def make_data(n: int = NUM_EXAMPLES) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    w = rng.normal(size=(8,)).astype(np.float32)
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=n)).astype(np.float32)
    return {"x": x, "y": y, "id": np.arange(n, dtype=np.int32)}


def make_params() -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (8, 32)) * 0.3,
        "w2": jax.random.normal(k2, (32,)) * 0.3,
    }


def loss_fn(params, batch, *, policy, rng):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


class VirtualClock:
    """A clock for the controller's step times that moves only by the seconds steps take on it.

    Passed as ``Controller(clock=...)`` (or ``make_controller(clock=...)``), it is what every
    part of that controller reads time from; nothing else in the process sees it. A step of a
    loss from ``slower_per_sample(s, clock)`` advances it by its seconds from the device's
    callback, so each step's measured time is exactly its own (with ``steps_in_flight=0`` no
    step's time can run into the next one's), whatever else the machine is doing: on a busy CI
    machine real sleeps were timed too noisily for the 1.5% the goodput rule waits for.
    """

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def take(self, seconds: float) -> None:
        self.now += seconds


def take_time(seconds: float, clock: VirtualClock | None = None) -> None:
    """Inside a traced step: the step takes ``seconds`` when it runs, on ``clock`` (a
    :class:`VirtualClock`), or in a real sleep without one. ``seconds`` is known when the step
    is traced, so it is compiled in."""
    jax.debug.callback(lambda: time.sleep(seconds) if clock is None else clock.take(seconds))


def slower_per_sample(seconds: float, clock: VirtualClock | None = None):
    """The harness's loss with a step of ``seconds x batch^2``: samples per second fall as the
    (micro-)batch grows, by a wide margin. The step takes that long on ``clock``, or really
    sleeps without one."""

    def loss(params, batch, *, policy, rng):
        size = batch["x"].shape[0]
        take_time(seconds * size * size, clock)
        return loss_fn(params, batch, policy=policy, rng=rng)

    return loss


def linear_probe(limit=20_000, base=1_000, per_sample=100, **kwargs) -> FakeMemoryProbe:
    return FakeMemoryProbe(limit, peak_bytes=lambda b: base + per_sample * b, **kwargs)


def without_step_times(state: dict) -> dict:
    """A controller's ``state_dict()`` less the goodput part's step-time sums and the block being
    timed: wall-clock measurements, which differ between two runs of the same steps (the block's
    step count is kept)."""
    goodput = {k: v for k, v in state["goodput"].items() if k != "step_times"}
    goodput["block"] = goodput["block"][:1]
    return {**state, "goodput": goodput}


def make_controller(cls=Controller, **overrides) -> Controller:
    kwargs = {
        "min_batch": 8,
        "max_batch": 256,
        "probe": linear_probe(),
        "check_every": 1,
        "seed": 0,
    }
    kwargs.update(overrides)
    tx = kwargs.pop("tx", None) or triaccel_jax.triaccel(1e-2)
    params = kwargs.pop("params", None) or make_params()
    return cls(kwargs.pop("loss_fn", loss_fn), params, tx, make_data(), **kwargs)


class FaultyController(Controller):
    """A controller whose runs get out-of-memory errors injected through the public ``faults=``
    hook (:class:`triaccel_jax.controller.OutOfMemoryFaults`); it keeps every delivered
    :class:`StepInfo`, so ``seen`` lists the sample ids each step trained.

    ``faults`` maps a step to how many attempts at it fail at dispatch, ``read_faults`` to how
    many fail when its metrics are read (where asynchronous dispatch surfaces a device's error).
    """

    def __init__(self, *args, faults=None, read_faults=None, callback=None, **kwargs):
        self.injector = OutOfMemoryFaults(at_dispatch=faults, at_read=read_faults)
        self.infos: list[triaccel_jax.controller.StepInfo] = []

        def record(info):
            self.infos.append(info)
            if callback is not None:
                callback(info)

        super().__init__(*args, faults=self.injector, callback=record, **kwargs)

    @property
    def seen(self) -> list[np.ndarray]:
        return [info.indices for info in self.infos]


BASE_LR = 0.1


def shrink_settings() -> dict:
    """A batch of 64 that an out-of-memory error shrinks to 32, the rate scaled linearly from 64
    (a fresh probe each time: probes record their readings)."""
    return dict(
        min_batch=32,
        max_batch=64,
        batch_size=64,
        reference_batch=64,
        lr_scaling="linear",
        probe=FakeMemoryProbe(BIG),
        check_every=1000,
    )
