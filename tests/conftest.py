"""Shared fixtures: a backend-compile counter, strict dtype promotion, the controller factory.

The tests are grouped by stage in folders (tests/policy/, tests/controller/, ...); the shared
modules (``harness``, ``controller_harness``, ``simulated_devices``, ``jax_versions``) live
here, in tests/, which pytest puts on ``sys.path`` because this conftest has no ``__init__.py``
beside it (the default prepend import mode), so every test module imports them by name.
"""

from __future__ import annotations

import contextlib
import os
import threading

# XLA compiles every test's functions without LLVM's optimisations: most of the suite's time on a
# CPU is compiling programs that then run a few steps on tiny arrays: at -O0 CI's test step took
# 1183 s instead of 1499 s (one controller file: 119 s of CPU instead of 184 s). The programs (the HLO, its fusions and kernels) are the same;
# the machine code is not, and a result can differ from an optimised build's in its last bits, so
# every comparison in the tests is between programs compiled in this mode (jit against eager, one
# run against another) or within a tolerance. Set before jax starts, so the backend and every
# subprocess the tests start (which inherit the environment) compile the same way; a flag the
# caller already set is kept.
_TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_xla_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_xla_flags, *(f for f in _TEST_XLA_FLAGS if f.split("=")[0] not in _xla_flags)]
).strip()

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

# The controller turns JAX's persistent compilation cache on by default; the tests count and time
# compiles, and must not read executables a test (or an earlier run) wrote, so it is off here
# (subprocesses inherit it). tests/cli/test_compilation_cache.py turns it on where it is tested.
os.environ["TRIACCEL_COMPILATION_CACHE"] = "off"

# Hypothesis profiles, picked by TRIACCEL_HYPOTHESIS_PROFILE (unset: "ci" under CI=true, else
# Hypothesis's own default):
#   "ci"   no deadline (a loaded 2-core machine makes an example's first compile look slow), the
#          same examples on every run (derandomize) and no example database; each property runs
#          the examples its @settings ask for. .ci/run's full tier.
#   "fast" the same, at most FAST_EXAMPLES examples a property, also where its @settings name a
#          larger count (capped at collection below). `bash tools/test.sh --fast` picks it.
FAST_EXAMPLES = 10
hypothesis.settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile(
    "fast", hypothesis.settings.get_profile("ci"), max_examples=FAST_EXAMPLES
)
_PROFILE = os.environ.get(
    "TRIACCEL_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") == "true" else "default"
)
hypothesis.settings.load_profile(_PROFILE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under the "fast" profile, caps each property's examples at FAST_EXAMPLES.

    An explicit ``@settings(max_examples=300)`` outranks any profile, so the cap is applied to
    the settings Hypothesis keeps on the test (if a Hypothesis release stops keeping them there,
    the properties simply run their full count).
    """
    if _PROFILE != "fast":
        return
    for item in items:
        test = getattr(item, "obj", None)
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if isinstance(own, hypothesis.settings) and own.max_examples > FAST_EXAMPLES:
            test._hypothesis_internal_use_settings = hypothesis.settings(  # type: ignore[union-attr]
                own, max_examples=FAST_EXAMPLES
            )


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles: list[str] = []  # the name of every function compiled, in order
_lock = threading.Lock()


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        with _lock:
            _compiles.append(str(kwargs.get("fun_name", "")))


jax.monitoring.register_event_duration_secs_listener(_on_event)


# Every test runs under JAX's strict dtype promotion, so that an accidental promotion in the library
# (a bfloat16 moment times a float32 array, an int32 count times a float) fails instead of
# silently widening. A test that goes through a promotion inside optax or Flax themselves (optax's
# updates of the integer leaves the tests pass through, Flax's avg_pool and normalisation layers,
# which mix int or float32 constants with the input's dtype) is marked
# `standard_promotion(reason)` and runs under standard promotion.
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "standard_promotion(reason): run under JAX's standard dtype promotion because optax or "
        "Flax promote internally",
    )


@pytest.fixture(autouse=True)
def _dtype_promotion(request: pytest.FixtureRequest):
    marker = request.node.get_closest_marker("standard_promotion")
    with jax.numpy_dtype_promotion("standard" if marker is not None else "strict"):
        yield


# A worker runs hundreds of test modules and compiles thousands of functions. Kept in JAX's caches,
# their executables hold memory mappings until the process reaches the kernel's limit on them
# (vm.max_map_count, 65530 by default), and XLA's CPU compiler then fails with "LLVM compilation
# error: Cannot allocate memory" in whichever test compiles next. Each module's compiled functions
# are released when the module ends; a module that compiles the same function twice still hits
# the cache.
@pytest.fixture(autouse=True, scope="module")
def _release_compiled_functions():
    yield
    jax.clear_caches()


class CompileCounter:
    """Counts XLA backend compilations inside a ``with`` block (measured, not assumed)."""

    def __init__(self) -> None:
        self.count = 0
        self.names: list[str] = []

    @contextlib.contextmanager
    def __call__(self):
        start = len(_compiles)
        try:
            yield self
        finally:
            self.names = _compiles[start:]
            self.count = len(self.names)

    def of(self, name: str) -> int:
        """Compilations of functions whose name contains ``name``."""
        return sum(name in compiled for compiled in self.names)


@pytest.fixture
def count_compiles() -> CompileCounter:
    return CompileCounter()


@pytest.fixture
def make_controller():
    """The controller factory of ``controller_harness`` (``make_controller(**overrides)``).

    ``from controller_harness import make_controller`` gives the same function; this fixture is
    for tests that prefer to receive it as an argument.
    """
    import controller_harness  # tests/ is on sys.path (this conftest's folder, prepend mode)

    return controller_harness.make_controller
