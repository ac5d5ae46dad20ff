"""Fault injection (issue 7): every fault drawn from a fixed seed, every run a few seconds.

* 100 inf/nan gradients at random (step, leaf) points of 10 short runs under
  ``dynamic_loss_scale(triaccel(...))``: each poisoned step is skipped and counted per leaf,
  nothing non-finite ever reaches the params or the state, and the clean steps give, bit for bit,
  the params of a run without the poisoned steps. A controller whose loss is infinite on a few
  poisoned samples finishes with finite params and counts those steps.
* 10 RESOURCE_EXHAUSTED errors per run at random steps: the controller trains exactly the
  sampler's stream (no sample lost or repeated) and finishes.
* A saver process killed with SIGKILL during a save: a new Checkpointer finds the last complete
  checkpoint, restores what was saved at that step, and keeps saving.
* A truncated, overwritten or deleted file, a garbled JSON file: a CheckpointError naming the
  step and the problem, never wrong values or an exception from deep inside orbax.

Run as a script (``PYTHONPATH=tests python tests/package/test_faults.py FOLDER``) this module
is the saver process.
"""

from __future__ import annotations

import collections
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from controller_harness import BIG
from controller_harness import FaultyController
from controller_harness import loss_fn
from controller_harness import make_controller
from controller_harness import make_data
from controller_harness import make_params

import triaccel_jax
from triaccel_jax import Checkpointer
from triaccel_jax import CheckpointError
from triaccel_jax import FakeMemoryProbe
from triaccel_jax.precision import PlannerConfig


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the floating leaves of ``tree`` that hold an inf or a nan."""
    return [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
        if np.issubdtype(np.asarray(leaf).dtype, np.inexact) and not np.isfinite(leaf).all()
    ]


def assert_bitwise_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


# -- non-finite gradients --------------------------------------------------------------------------

NUM_RUNS, NUM_STEPS, FAULTS_PER_RUN = 10, 20, 10
POISONS = {"+inf": np.inf, "-inf": -np.inf, "nan": np.nan}
INITIAL_SCALE, GROWTH_INTERVAL = 2.0**8, 3
# Powers of two: multiplying a gradient by the scale and dividing it back is exact, so a run's
# clean steps do not depend on how the poisoned ones moved the scale.
GUARDED = triaccel_jax.transforms.dynamic_loss_scale(
    triaccel_jax.triaccel(0.05), initial_scale=INITIAL_SCALE, growth_interval=GROWTH_INTERVAL
)


def guarded_params() -> dict:
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    return {
        "embed": jax.random.normal(k1, (12, 6)) * 0.3,
        "dense": {"kernel": jax.random.normal(k2, (6, 6)) * 0.3, "bias": jnp.zeros(6)},
        "head": jax.random.normal(k3, (6, 3)) * 0.3,
        "temperature": jnp.ones(()),
    }


def guarded_loss(params, batch):
    x, y = batch
    hidden = jnp.tanh(x @ params["embed"])
    hidden = jnp.tanh(hidden @ params["dense"]["kernel"] + params["dense"]["bias"])
    return jnp.mean((hidden @ params["head"] * params["temperature"] - y) ** 2)


@jax.jit
def guarded_step(params, state, batch, masks, values):
    """A loss-scaled step whose gradient elements under ``masks`` are replaced by ``values``.

    The poison goes into the scaled gradient, where an overflow would appear. Every run, clean
    or poisoned, calls this one compiled function.
    """
    scale = triaccel_jax.transforms.loss_scale(state)
    grads = jax.grad(lambda p: guarded_loss(p, batch) * scale)(params)
    grads = jax.tree.map(lambda g, m, v: jnp.where(m, v, g), grads, masks, values)
    updates, state = GUARDED.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def draw_faults(rng, shapes) -> dict[int, dict[int, tuple[np.ndarray, str]]]:
    """FAULTS_PER_RUN distinct (step, leaf) points: ``{step: {leaf: (mask, poison)}}``.

    Each point poisons the whole leaf or one element with +inf, -inf or nan; several leaves of
    one step may be poisoned.
    """
    faults: dict[int, dict[int, tuple[np.ndarray, str]]] = {}
    for point in rng.choice(NUM_STEPS * len(shapes), FAULTS_PER_RUN, replace=False):
        step, leaf = divmod(int(point), len(shapes))
        mask = np.zeros(shapes[leaf], bool)
        if rng.random() < 0.5:
            mask[...] = True
        else:
            mask.flat[rng.integers(mask.size)] = True
        faults.setdefault(step, {})[leaf] = (mask, str(rng.choice(list(POISONS))))
    return faults


def expected_scale(faulty_steps) -> float:
    """The loss scale after NUM_STEPS steps: halved at each skipped step (down to the default
    minimum of 1), doubled after GROWTH_INTERVAL finite ones in a row."""
    scale, good = INITIAL_SCALE, 0
    for step in range(NUM_STEPS):
        if step in faulty_steps:
            scale, good = max(scale / 2, 1.0), 0
        else:
            good += 1
            if good == GROWTH_INTERVAL:
                scale, good = scale * 2, 0
    return scale


def run_guarded(batches, faults, steps):
    """Runs ``steps`` (indices into ``batches``) from fresh params and state; checks after every
    step that nothing non-finite reached them."""
    params = guarded_params()
    state = GUARDED.init(params)
    leaves, treedef = jax.tree.flatten(params)
    for step in steps:
        masks = [np.zeros(leaf.shape, bool) for leaf in leaves]
        values = [np.float32(0.0) for _ in leaves]
        for leaf, (mask, poison) in faults.get(step, {}).items():
            masks[leaf], values[leaf] = mask, np.float32(POISONS[poison])
        batch = tuple(x[step] for x in batches)
        params, state = guarded_step(
            params, state, batch, treedef.unflatten(masks), treedef.unflatten(values)
        )
        bad = nonfinite_leaves((params, state))
        assert not bad, f"step {step} (faults {faults.get(step)}) left non-finite {bad}"
    return params, state


def test_100_nonfinite_gradients_are_skipped_counted_and_leave_the_clean_steps_unchanged():
    rng = np.random.default_rng(7)
    shapes = [leaf.shape for leaf in jax.tree.leaves(guarded_params())]
    totals = collections.Counter()
    for _ in range(NUM_RUNS):
        batches = (
            rng.normal(size=(NUM_STEPS, 16, 12)).astype(np.float32),
            rng.normal(size=(NUM_STEPS, 16, 3)).astype(np.float32),
        )
        faults = draw_faults(rng, shapes)
        params, state = run_guarded(batches, faults, range(NUM_STEPS))
        clean_steps = [step for step in range(NUM_STEPS) if step not in faults]
        clean_params, clean_state = run_guarded(batches, {}, clean_steps)

        points = [
            (leaf, poison)
            for leaf_faults in faults.values()
            for leaf, (_, poison) in leaf_faults.items()
        ]
        per_leaf = collections.Counter(leaf for leaf, _ in points)
        counts = [int(c) for c in jax.tree.leaves(state.nonfinite_count)]
        assert counts == [per_leaf[leaf] for leaf in range(len(shapes))]
        assert int(state.skipped_steps) == len(faults)
        assert int(clean_state.skipped_steps) == 0
        assert float(state.scale) == expected_scale(faults)
        # The poisoned steps changed nothing but the scale and the counters.
        assert_bitwise_equal(params, clean_params)
        assert_bitwise_equal(state.inner_state, clean_state.inner_state)
        totals["injected"] += len(points)
        totals["counted"] += sum(counts)
        totals["skipped_steps"] += int(state.skipped_steps)
        totals["survived"] += len(points)  # run_guarded checked every step was finite
        totals.update(poison for _, poison in points)
        totals["whole_leaf"] += sum(
            bool(mask.all()) and mask.size > 1
            for leaf_faults in faults.values()
            for mask, _ in leaf_faults.values()
        )
    print(f"non-finite gradients: {dict(totals)}")
    assert totals["injected"] == totals["counted"] == totals["survived"] == 100
    # Every kind of poison was drawn, in whole leaves and in single elements.
    assert min(totals[poison] for poison in POISONS) > 0 and 0 < totals["whole_leaf"] < 100


@pytest.mark.slow
def test_a_controller_skips_the_steps_of_poisoned_samples_and_finishes():
    poisoned = np.random.default_rng(3).choice(512, 3, replace=False)

    def poisoned_loss(params, batch, *, policy, rng):
        # A corrupt sample's weight overflows: the loss and every gradient leaf are non-finite.
        weight = jnp.where(jnp.isin(batch["id"], poisoned), jnp.inf, 1.0)
        hidden = jnp.tanh(batch["x"] @ params["w1"])
        return jnp.mean(weight * (hidden @ params["w2"] - batch["y"]) ** 2)

    # The controller does not multiply the loss by the scale, so the scale stays 1: the wrapper
    # only guards. Re-planning every step (a budget of 0 keeps the policy, so no re-compile)
    # gives the planner the loss of every skipped step.
    tx = triaccel_jax.transforms.dynamic_loss_scale(
        triaccel_jax.triaccel(1e-2), initial_scale=1.0, max_scale=1.0
    )
    controller = make_controller(
        FaultyController,
        loss_fn=poisoned_loss,
        tx=tx,
        min_batch=32,
        max_batch=32,
        probe=FakeMemoryProbe(BIG),
        replan_every=1,
        planner=PlannerConfig(budget=0.0),
    )
    infos = controller.run(40)
    assert len(controller.seen) == 40  # one compiled call per step: no out-of-memory retry
    expected = [i for i, ids in enumerate(controller.seen) if np.isin(ids, poisoned).any()]
    assert [i for i, info in enumerate(infos) if not np.isfinite(info.loss)] == expected
    state = controller.opt_state
    assert len(expected) > 2 and int(state.skipped_steps) == len(expected)
    assert jax.tree.map(int, state.nonfinite_count) == {"w1": len(expected), "w2": len(expected)}
    assert not nonfinite_leaves((controller.params, state))
    finite = [info.loss for info in infos if np.isfinite(info.loss)]
    assert finite[-1] < finite[0]  # the clean steps still train
    print(f"controller: {len(expected)} poisoned steps of 40 skipped and counted")


# -- out of memory ---------------------------------------------------------------------------------

OOMS_PER_RUN, OOM_STEPS = 10, 40


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "keep_global_batch"), [(0, False), (1, True), (2, False)])
def test_random_out_of_memory_errors_lose_and_repeat_no_sample(seed, keep_global_batch):
    rng = np.random.default_rng(seed)
    # Drawn with replacement: a step drawn twice also runs out of memory on its retry.
    faults = collections.Counter(rng.integers(1, OOM_STEPS, size=OOMS_PER_RUN).tolist())
    # 11 buckets, 1024 down to 1, for the 10 halvings; plain SGD because the test is about the
    # samples and it compiles 3x faster than triaccel (each run compiles 11 to 21 steps).
    controller = FaultyController(
        loss_fn,
        make_params(),
        optax.sgd(1e-2),
        make_data(2048),
        faults=faults,
        min_batch=1,
        max_batch=1024,
        batch_size=1024,
        keep_global_batch=keep_global_batch,
        probe=FakeMemoryProbe(BIG),
        check_every=5,
        seed=seed,
    )
    infos = controller.run(OOM_STEPS)
    assert len(infos) == OOM_STEPS and all(np.isfinite(i.loss) for i in infos)
    ooms = [e for e in controller.events if e.kind == "oom"]
    assert [e.step for e in ooms] == sorted(faults.elements())
    assert [(e.old, e.new) for e in ooms] == [(1024 >> i, 512 >> i) for i in range(OOMS_PER_RUN)]
    seen = np.concatenate(controller.seen)
    sampler = controller.sampler
    served = np.concatenate([sampler.order(e) for e in range(sampler.epoch + 1)])
    # Exactly the sampler's stream, in order: nothing lost, nothing repeated.
    assert len(seen) == sampler.samples_seen == sum(i.batch_size for i in infos)
    np.testing.assert_array_equal(seen, served[: len(seen)])
    if keep_global_batch:
        assert {i.batch_size for i in infos} == {1024}
    print(f"seed {seed}: {len(ooms)} OOMs, {len(seen)} samples trained, 0 lost, 0 repeated")


# -- a save killed mid-write -----------------------------------------------------------------------

KILL_TRIALS = 4


def saved_tree(step: int) -> dict:
    """What the saver process checkpoints at ``step``: 24 MB, every value a function of the step
    (a save takes about 0.15 s on a CPU)."""
    base = jnp.arange(2**22, dtype=jnp.float32).reshape(2048, 2048)
    return {
        "params": {"w": base + step, "b": jnp.full(2048, step, jnp.float32)},
        "opt_state": {
            "mu": (base * 0.5 - step).astype(jnp.bfloat16),
            "count": jnp.asarray(step, jnp.int32),
        },
    }


def save_until_killed(folder: str) -> None:
    """The saver process: saves steps 1, 2, ... and says when each save starts and ends."""
    checkpointer = Checkpointer(folder, max_to_keep=2)
    for step in range(1, 100):  # bounded, in case the parent dies without killing it
        state = jax.block_until_ready(saved_tree(step))
        print(f"saving {step}", flush=True)
        checkpointer.save(step, state)
        print(f"saved {step}", flush=True)


def kill_during_save(folder: Path, kill_step: int, fraction: float) -> bool:
    """Runs the saver and SIGKILLs it ``fraction`` of a save's duration into save ``kill_step``.

    Returns whether save ``kill_step`` finished before the kill landed after all.
    """
    # The script imports the shared modules of tests/ (controller_harness), which pytest put on
    # its own sys.path: the saver gets them through PYTHONPATH.
    tests_root = str(Path(__file__).resolve().parents[1])
    python_path = os.pathsep.join(filter(None, [tests_root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": python_path}
    with open(folder.parent / "saver.log", "w") as log:
        saver = subprocess.Popen(
            [sys.executable, __file__, str(folder)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
    watchdog = threading.Timer(120, saver.kill)
    watchdog.start()
    try:
        durations, started = [], 0.0
        for line in saver.stdout:
            kind, step = line.split()
            if kind == "saved":
                durations.append(time.monotonic() - started)
            elif int(step) < kill_step:
                started = time.monotonic()
            else:
                time.sleep(fraction * min(durations))
                os.kill(saver.pid, signal.SIGKILL)
                break
        rest = saver.stdout.read()
        assert saver.wait() == -signal.SIGKILL, (folder.parent / "saver.log").read_text()[-2000:]
    finally:
        watchdog.cancel()
        saver.stdout.close()
    return f"saved {kill_step}" in rest


@pytest.mark.parametrize("trial", range(KILL_TRIALS))
def test_a_save_killed_mid_write_leaves_the_last_complete_checkpoint(tmp_path, trial):
    rng = np.random.default_rng(100 + trial)
    kill_step, fraction = int(rng.integers(3, 6)), float(rng.uniform(0.05, 0.8))
    folder = tmp_path / "checkpoints"
    finished = kill_during_save(folder, kill_step, fraction)
    leftovers = sorted(p.name for p in folder.iterdir() if not p.name.isdigit())

    with Checkpointer(folder, max_to_keep=2) as checkpointer:
        latest = checkpointer.latest_step()
        # A save is complete once orbax renames its folder, which may come just before the kill.
        assert latest == kill_step if finished else latest in (kill_step - 1, kill_step)
        restored, meta = checkpointer.restore(saved_tree(0))
        assert meta["step"] == latest
        assert_bitwise_equal(restored, saved_tree(latest))
        # Older checkpoints (one may be half deleted, if the kill hit orbax's clean-up) restore
        # exactly or say why not.
        for step in checkpointer.steps()[:-1]:
            try:
                older, _ = checkpointer.restore(saved_tree(0), step=step)
            except CheckpointError as error:
                assert f"step {step}" in str(error)
            else:
                assert_bitwise_equal(older, saved_tree(step))
        # Training resumes: the next saves (over the killed one's leftovers) complete.
        for step in (latest + 1, latest + 2):
            checkpointer.save(step, saved_tree(step))
        assert checkpointer.steps()[-2:] == [latest + 1, latest + 2]
        restored, _ = checkpointer.restore(saved_tree(0))
        assert_bitwise_equal(restored, saved_tree(latest + 2))
    # Orbax replaced the killed save's temporary folder when it saved that step again.
    left = [p.name for p in folder.iterdir() if not p.name.isdigit()]
    assert not [name for name in left if name.split(".")[0] in (str(latest + 1), str(latest + 2))]
    print(
        f"trial {trial}: killed {fraction:.0%} into save {kill_step} "
        f"({'after it finished' if finished else 'mid-save'}); restored step {latest}; "
        f"left {leftovers}"
    )


# -- damaged checkpoints ---------------------------------------------------------------------------


def largest_file(step: Path) -> Path:
    """The biggest array data file of a checkpoint step."""
    return max(
        (p for p in (step / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )


def truncate(step: Path) -> None:
    data = largest_file(step)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def overwrite(step: Path) -> None:
    data = largest_file(step)
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 64] = np.random.default_rng(0).bytes(64)
    data.write_bytes(bytes(raw))


def garble(path: Path) -> None:
    path.write_text(path.read_text()[:-20] + "#")


CORRUPTIONS = {
    "truncated-data-file": (truncate, "damaged"),
    # zstd decodes the garbled chunk without complaint: only the checksums catch it.
    "overwritten-data-bytes": (overwrite, r"is corrupted: the data of \['w'\]"),
    "deleted-data-file": (lambda step: largest_file(step).unlink(), "damaged"),
    "deleted-array-manifest": (
        lambda step: (step / "state" / "manifest.ocdbt").unlink(),
        "damaged",
    ),
    "garbled-array-metadata-json": (lambda step: garble(step / "state" / "_METADATA"), "damaged"),
    "garbled-metadata-json": (lambda step: garble(step / "meta" / "metadata"), "not valid JSON"),
    "deleted-metadata": (lambda step: (step / "meta" / "metadata").unlink(), "no metadata item"),
}


# When one array fails to read, orbax leaves its other read coroutines to fail unawaited; the
# gc.collect() below reports them here, where they are ignored, rather than in a later test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_damaged_checkpoint_gives_a_clear_error(tmp_path, kind):
    damage, problem = CORRUPTIONS[kind]
    rng = np.random.default_rng(5)
    # Random values: zstd barely compresses them, so the data file is much the largest file.
    states = {
        step: {
            "w": jnp.asarray(rng.normal(size=(256, 256)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=256), jnp.bfloat16),
            "n": jnp.int32(step),
        }
        for step in (1, 2)
    }
    with Checkpointer(tmp_path) as checkpointer:
        for step, state in states.items():
            checkpointer.save(step, state)
    damage(tmp_path / "2")
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.steps() == [1, 2]
        with pytest.raises(CheckpointError, match=problem) as info:
            checkpointer.restore(states[1])
        assert f"checkpoint step 2 in {tmp_path}" in str(info.value)
        # The undamaged step still restores.
        restored, _ = checkpointer.restore(states[1], step=1)
    assert_bitwise_equal(restored, states[1])
    gc.collect()
    print(f"{kind}: {str(info.value)[:200]}")


if __name__ == "__main__":
    save_until_killed(sys.argv[1])
