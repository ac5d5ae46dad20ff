"""The controller's features combined, as a property (hypothesis): random runs of at least 200
steps with out-of-memory errors at dispatch and at the late read, background grows and re-plans,
``set_policy`` and ``state_dict``/``load_state_dict`` resumes, all at once.

Each example runs the same script twice: once uninterrupted, once resumed from its saved state at
the script's resume points (a new controller given the saved params and optimizer state, as a
restarted job would be). The invariants:

* every sample is trained exactly once per epoch (the delivered steps' samples are the sampler's
  stream, in order);
* each step trains at the rate of the batch it trained (``StepInfo.learning_rate``);
* the optimizer state's moments are in the dtypes of the policy in force;
* an out-of-memory error is charged to the bucket its step ran at, so a ceiling only ever sits at
  a bucket that failed;
* with compiles in the step that decides (``compile_in_background=False``), the resumed run
  equals the uninterrupted one, step for step.

With ``compile_in_background=True`` the step at which a switch lands depends on when its compile
is ready, and a restarted job has lost its compiled steps (a re-plan to a policy compiled before
switches at once in the uninterrupted run, after a compile in the resumed one), so the two runs
may differ; the other invariants hold in both. Background compiles wait on a semaphore the script
releases when their decision is delivered, so each run is reproducible.
"""

from __future__ import annotations

import inspect
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck
from hypothesis import event
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import triaccel_jax
from triaccel_jax import FakeMemoryProbe
from triaccel_jax import PrecisionPolicy
from triaccel_jax.controller import FaultSite
from triaccel_jax.controller import _compiling as compiling
from triaccel_jax.controller import simulated_out_of_memory
from triaccel_jax.precision import PlannerConfig
from triaccel_jax.transforms import LossScaling
from triaccel_jax.transforms import find_signal_states

NUM_EXAMPLES = 96
MIN_STEPS = 200
BASE_LR = 0.02
REFERENCE = 8
DTYPES = {"fp32": jnp.dtype(jnp.float32), "bf16": jnp.dtype(jnp.bfloat16)}

# 100 examples of two runs of 200+ steps each: about 2 minutes of CI's 2 cores (200 took 7).
PROPERTY = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 0.5], np.float32)).astype(np.float32)
    return {"x": x, "y": y}


def make_params():
    return {"w": jnp.full((3,), 0.1, jnp.float32), "b": jnp.zeros((), jnp.float32)}


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


class ScriptedFaults:
    """A fault injector: each scripted (where, step) fails once, never at the smallest bucket
    (an error there is :class:`triaccel_jax.OutOfMemoryError`, the end of the run)."""

    def __init__(self, at_dispatch, at_read, min_batch):
        self.left = {("dispatch", s) for s in at_dispatch} | {("read", s) for s in at_read}
        self.min_batch = min_batch
        self.injected: list[FaultSite] = []

    def __call__(self, site: FaultSite) -> None:
        if (site.where, site.step) in self.left and site.micro > self.min_batch:
            self.left.discard((site.where, site.step))
            self.injected.append(site)
            raise simulated_out_of_memory(site)


_EXECUTABLES: dict = {}  # shared by every example: see `release`


def _program_key(step, abstract_args):
    """What a compiled step depends on here: its static settings (policy, micro-batches, loss
    scaling, fusion, seed: the plain values it closes over) and its arguments' shapes and dtypes.
    Every controller in this module trains the same loss with the same optimizer settings, so
    two steps with one key are one program."""
    settings = tuple(
        sorted(
            (name, value)
            for name, value in inspect.getclosurevars(step).nonlocals.items()
            if value is None or isinstance(value, int | float | str | PrecisionPolicy | LossScaling)
        )
    )
    leaves, structure = jax.tree.flatten(abstract_args)
    return settings, str(structure), tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves)


@pytest.fixture
def release(monkeypatch):
    """Background compiles wait for a permit; ``release(controller)`` gives one and waits.

    Compiled steps are also shared between the examples' controllers (a restarted job compiles
    its steps again; here the program is the same, and compiling it hundreds of times would
    only make the test slow).
    """
    permits = threading.Semaphore(0)
    build = compiling.build

    def gated_build(step, abstract_args):
        if threading.current_thread() is not threading.main_thread():
            assert permits.acquire(timeout=120), "a background compile was never released"
        key = _program_key(step, abstract_args)
        if key not in _EXECUTABLES:
            _EXECUTABLES[key] = build(step, abstract_args)
        return _EXECUTABLES[key]

    monkeypatch.setattr(compiling, "build", gated_build)

    def give(controller):
        if controller.compile_pending:
            permits.release()
            controller.wait_for_compile()

    return give


@st.composite
def scripts(draw):
    """Chunks of steps, each followed by an intervention; faults keyed by step."""
    chunks = []
    total = 0
    while total < MIN_STEPS:
        steps = draw(st.integers(1, 60))
        action = draw(st.sampled_from(["none", "none", "resume", "policy-bf16", "policy-fp32"]))
        chunks.append((steps, action))
        total += steps
    at_dispatch = draw(st.sets(st.integers(0, total - 1), max_size=6))
    at_read = draw(st.sets(st.integers(0, total - 1), max_size=6))
    # Memory limits the probe reports, one per reading, cycling: grows and shrinks.
    limits = draw(st.lists(st.sampled_from([2_500, 4_500, 9_000, 10**9]), min_size=1, max_size=6))
    background = draw(st.booleans())
    return chunks, sorted(at_dispatch), sorted(at_read), limits, background


class Run:
    """One run of a script: its controllers (one per resume) and everything they delivered."""

    def __init__(self, script, release, *, resume: bool):
        self.chunks, at_dispatch, at_read, limits, self.background = script
        self.release, self.resume = release, resume
        self.faults = ScriptedFaults(at_dispatch, at_read, min_batch=4)
        self.probe = FakeMemoryProbe(
            lambda n: limits[n % len(limits)], peak_bytes=lambda batch: 1_000 + 200 * batch
        )
        self.infos: list[triaccel_jax.controller.StepInfo] = []
        self.controller = self.make(make_params(), None)

    def make(self, params, opt_state):
        return triaccel_jax.Controller(
            loss_fn,
            params,
            optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=BASE_LR),
            make_data(),
            opt_state=opt_state,
            probe=self.probe,
            faults=self.faults,
            callback=self.deliver,
            min_batch=4,
            max_batch=16,
            batch_size=8,
            reference_batch=REFERENCE,
            lr_scaling="sqrt",
            check_every=3,
            patience=1,
            replan_every=7,
            first_replan=7,
            planner=PlannerConfig(budget=float("inf"), min_size=0, state="bf16"),
            compile_in_background=self.background,
            steps_in_flight=2,
            seed=3,
            # The probe's scripted limits drive the grows; goodput would follow measured step
            # times, which a resumed controller measures again.
            batch_rule="memory",
        )

    def deliver(self, info):
        self.infos.append(info)
        if any(e.kind in ("grow_decided", "replan_decided") for e in info.events):
            self.release(self.controller)

    def go(self):
        for steps, action in self.chunks:
            self.controller.run(steps)
            self.check_moments()
            if action.startswith("policy-"):
                self.controller.set_policy(
                    PrecisionPolicy.uniform(self.controller.params, "fp32", action[7:])
                )
                self.check_moments()
            elif action == "resume":
                self.settle()
                if self.resume:
                    self.restart()
        self.settle()

    def settle(self):
        """Takes a waiting background switch (in both runs alike), so a save holds it."""
        while self.controller.compile_pending:
            self.release(self.controller)
            self.controller.run(1)

    def restart(self):
        old = self.controller
        saved = old.state_dict()
        params = jax.tree.map(np.asarray, old.params)
        opt_state = jax.tree.map(np.asarray, old.opt_state)
        self.controller = self.make(params, opt_state)
        self.controller.load_state_dict(saved)

    def stream(self) -> np.ndarray:
        """The sampler's epochs so far (a function of its seed: the same in every controller)."""
        sampler = self.controller.sampler
        return np.concatenate([sampler.order(e) for e in range(sampler.epoch + 1)])

    def check_moments(self):
        policy = self.controller.policy
        (state,) = find_signal_states(self.controller.opt_state)
        for moments in (state.mu, state.nu):
            for path, leaf in moments.items():
                assert leaf.dtype == DTYPES[policy.state(path)], (path, leaf.dtype, policy)


@PROPERTY
@given(script=scripts())
def test_features_combined_keep_every_invariant(script, release):
    plain = Run(script, release, resume=False)
    plain.go()
    resumed = Run(script, release, resume=True)
    resumed.go()

    kinds = [e.kind for e in plain.controller.events]
    # What each example exercised, in `pytest --hypothesis-show-statistics`.
    event(f"out-of-memory errors: {min(kinds.count('oom'), 3)}+")
    event(f"grows: {min(kinds.count('grow'), 3)}+, re-plans: {min(kinds.count('replan'), 2)}+")
    event(f"background compiles: {plain.background}")
    for run in (plain, resumed):
        infos = run.infos
        assert [i.step for i in infos] == list(range(1, len(infos) + 1))
        assert len(infos) >= MIN_STEPS
        # Every sample once per epoch: the steps' samples are the sampler's stream, in order.
        trained = np.concatenate([i.indices for i in infos])
        np.testing.assert_array_equal(trained, run.stream()[: len(trained)])
        for info in infos:
            assert len(info.indices) == info.batch_size
            assert info.batch_size % info.micro_batch == 0
            expected = BASE_LR * math.sqrt(info.batch_size / REFERENCE)
            assert info.learning_rate == pytest.approx(expected, rel=1e-6), info
        # Each out-of-memory error is charged once, to the bucket its step ran at.
        ooms = sorted(e.old for e in run.controller.events if e.kind == "oom")
        if not run.resume:
            assert ooms == sorted(site.micro for site in run.faults.injected)
        ceiling = run.controller.state_dict()["bucket"]["ceiling"]
        assert ceiling is None or ceiling in {site.micro for site in run.faults.injected}

    if plain.background:
        return
    # The resumed run is the uninterrupted one, step for step.
    assert [(i.batch_size, i.micro_batch) for i in resumed.infos] == [
        (i.batch_size, i.micro_batch) for i in plain.infos
    ]
    np.testing.assert_array_equal([i.loss for i in resumed.infos], [i.loss for i in plain.infos])
    assert resumed.faults.injected == plain.faults.injected
    assert resumed.controller.policy == plain.controller.policy
    for a, b in zip(
        jax.tree.leaves(resumed.controller.params),
        jax.tree.leaves(plain.controller.params),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
