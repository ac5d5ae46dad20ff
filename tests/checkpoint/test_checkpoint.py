"""Checkpoints: train state and controller round trips, resume equality, atomicity, clear errors."""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from controller_harness import BIG
from controller_harness import loss_fn
from controller_harness import make_controller
from controller_harness import make_data
from controller_harness import make_params

import triaccel_jax
from triaccel_jax import Checkpointer
from triaccel_jax import CheckpointError
from triaccel_jax.flax import TrainState
from triaccel_jax.flax import from_train_state
from triaccel_jax.flax import to_train_state
from triaccel_jax.precision import PlannerConfig


def make_state():
    model = nn.Dense(4)
    params = model.init(jax.random.key(0), jnp.ones((2, 64)))["params"]
    policy = triaccel_jax.PrecisionPolicy.from_patterns(params, {"kernel": ("bf16", "bf16")})
    return TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=triaccel_jax.triaccel(0.1),
        policy=policy,
        batch_stats={"mean": jnp.arange(4.0)},
    )


def trained(state, steps=3):
    grads = jax.tree.map(jnp.ones_like, state.params)
    for _ in range(steps):
        state = state.apply_gradients(grads=grads)
    return state


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.slow
def test_train_state_round_trip_with_policy_and_batch_stats(tmp_path):
    state = trained(make_state())
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(3, state, metadata={"epoch": 1})
        fresh = make_state().with_policy(None)  # restore_state re-applies the saved policy
        restored = checkpointer.restore_state(fresh)
        meta = checkpointer.read_metadata()
    assert restored.policy == state.policy
    assert_trees_equal(restored.params, state.params)
    assert_trees_equal(restored.opt_state, state.opt_state)
    assert_trees_equal(restored.batch_stats, state.batch_stats)
    assert int(restored.step) == 3 and meta["metadata"] == {"epoch": 1}
    assert restored.opt_state[0].mu["kernel"].dtype == jnp.bfloat16


@pytest.mark.slow
def test_a_resumed_controller_repeats_the_uninterrupted_losses(tmp_path):
    # The memory rule: goodput's decisions follow measured step times, which a resumed run
    # measures again (throughput is not saved), so only memory's are repeated step for step.
    kwargs = dict(
        replan_every=4,
        precision_rule="memory",  # every leaf the budget allows: the plan moves
        planner=PlannerConfig(budget=float("inf"), min_size=0),
        batch_rule="memory",
    )
    reference = make_controller(**kwargs)
    reference.run(6)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save_controller(reference, metadata={"run": "reference"})
    saved_policy = reference.policy
    expected = [i.loss for i in reference.run(10)]

    resumed = make_controller(**kwargs)  # fresh params: everything comes from the checkpoint
    with Checkpointer(tmp_path) as checkpointer:
        metadata = checkpointer.restore_controller(resumed)
    assert metadata == {"run": "reference"} and resumed.step_count == 6
    assert resumed.policy == saved_policy
    assert [i.loss for i in resumed.run(10)] == expected


@pytest.mark.slow
def test_an_interrupted_save_leaves_the_last_good_checkpoint(tmp_path):
    state = trained(make_state())
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(3, state)
    # What a save killed mid-write leaves: orbax's temporary folder, never renamed.
    partial = tmp_path / "4.orbax-checkpoint-tmp-1234567"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(os.urandom(64))
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.latest_step() == 3
        restored = checkpointer.restore_state(make_state())
    assert_trees_equal(restored.params, state.params)


def test_missing_and_foreign_checkpoints_give_clear_errors(tmp_path):
    empty = Checkpointer(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        empty.restore({"w": jnp.ones(2)})
    empty.close()
    with Checkpointer(tmp_path / "one") as checkpointer:
        checkpointer.save(1, {"w": jnp.ones(2)})
        with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 2 .*\[1\]"):
            checkpointer.restore({"w": jnp.ones(2)}, step=2)
        with pytest.raises(CheckpointError, match="could not be restored"):
            checkpointer.restore({"w": jnp.ones(2), "v": jnp.ones(3)})
        with pytest.raises(CheckpointError, match="holds no controller state"):
            checkpointer.restore_controller(make_controller())
        # A pickle planted where the JSON metadata belongs is refused, not loaded.
        (tmp_path / "one" / "1" / "meta" / "metadata").write_bytes(pickle.dumps({"x": 1}))
        with pytest.raises(CheckpointError, match="not valid JSON"):
            checkpointer.read_metadata(1)


def test_arrays_that_differ_from_their_saved_checksums_are_rejected(tmp_path):
    # Orbax does not checksum array data, so the checkpointer records a CRC-32 per array; a
    # changed record stands in for data damaged after the save (test_faults damages the files).
    state = {"w": jnp.arange(4.0), "n": jnp.int32(3)}
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, state)
        path = tmp_path / "1" / "meta" / "metadata"
        meta = json.loads(path.read_text())
        assert set(meta["arrays"]) == {"['w']", "['n']"}
        assert meta["arrays"]["['w']"]["shape"] == [4]
        meta["arrays"]["['w']"]["crc32"] ^= 1
        path.write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match=r"step 1 .* is corrupted: the data of \['w'\]"):
            checkpointer.restore(state)
        meta["arrays"]["['w']"]["crc32"] = "abc"
        path.write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match="malformed array record"):
            checkpointer.restore(state)


# When one array fails to read, orbax leaves its other read coroutines to fail unawaited; the
# gc.collect() below reports them here, where they are ignored, rather than in a later test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_template_that_does_not_match_names_the_leaf(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, {"w": jnp.ones(2), "b": jnp.ones(3)})
        with pytest.raises(CheckpointError, match=r"leaf \['w'\] is float32\[5\] in the template "):
            checkpointer.restore({"w": jnp.ones(5), "b": jnp.ones(3)})
    gc.collect()


def test_metadata_must_be_json(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(TypeError, match="JSON-serialisable"):
            checkpointer.save(1, {"w": jnp.ones(2)}, metadata={"f": loss_fn})
        assert checkpointer.latest_step() is None


def test_the_saved_state_of_your_own_loops_batches_comes_back_under_the_name_it_was_saved_by(
    tmp_path,
):
    batches_state = {"format": "AdaptiveBatches", "step": 3, "bucket": {"micro_batch": 32}}
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(3, {"w": jnp.ones(2)}, controller=batches_state)
        _, meta = checkpointer.restore({"w": jnp.zeros(2)})
    assert meta["controller"] == batches_state


def test_a_folder_that_cannot_be_created_is_reported(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match="cannot create checkpoint folder"):
        Checkpointer(blocker / "checkpoints")


# -- orbax's options, verify= ----------------------------------------------------------------------


def test_orbax_options_pass_through_interval_and_max_to_keep(tmp_path):
    state = {"w": jnp.arange(4.0)}
    options = ocp.CheckpointManagerOptions(save_interval_steps=3, max_to_keep=2)
    with Checkpointer(tmp_path, options=options) as checkpointer:
        saved = [checkpointer.save(step, {"w": state["w"] + step}) for step in range(10)]
        checkpointer.wait_until_finished()
        assert saved == [step % 3 == 0 for step in range(10)]
        assert checkpointer.steps() == [6, 9]
        restored, meta = checkpointer.restore(state)
    assert meta["step"] == 9
    np.testing.assert_array_equal(restored["w"], state["w"] + 9)


@pytest.mark.slow
def test_asynchronous_saves_are_complete_after_wait_and_close(tmp_path):
    states = {step: trained(make_state(), steps=step) for step in (1, 2)}
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    with Checkpointer(tmp_path, options=options) as checkpointer:
        assert checkpointer.save(1, states[1])
        checkpointer.wait_until_finished()
        assert checkpointer.save(2, states[2], metadata={"epoch": 2})
    with Checkpointer(tmp_path) as checkpointer:  # close() waited for the second save
        assert checkpointer.steps() == [1, 2]
        for step, state in states.items():
            restored = checkpointer.restore_state(make_state(), step=step)
            assert_trees_equal(restored.params, state.params)
            assert_trees_equal(restored.opt_state, state.opt_state)
        assert checkpointer.read_metadata(2)["metadata"] == {"epoch": 2}


def test_the_json_item_is_read_through_orbax_whatever_the_step_folders_are_named(tmp_path):
    # With a step prefix the step folder is "ckpt_5", not "5": only orbax knows where it is.
    options = ocp.CheckpointManagerOptions(step_prefix="ckpt", enable_async_checkpointing=False)
    state = {"w": jnp.arange(3.0)}
    with Checkpointer(tmp_path, options=options) as checkpointer:
        checkpointer.save(5, state, metadata={"note": "prefixed"})
        assert (tmp_path / "ckpt_5").is_dir() and not (tmp_path / "5").exists()
        assert checkpointer.read_metadata()["metadata"] == {"note": "prefixed"}
        restored, _ = checkpointer.restore(state)
        (tmp_path / "ckpt_5" / "meta" / "metadata").write_text("{not json")
        with pytest.raises(CheckpointError, match=r"step 5 .* not valid JSON"):
            checkpointer.read_metadata()
    np.testing.assert_array_equal(restored["w"], state["w"])


def test_verify_false_leaves_out_the_checksums_and_their_check(tmp_path, caplog):
    state = {"w": jnp.arange(4.0), "n": jnp.int32(3), "key": jax.random.key(1)}
    with Checkpointer(tmp_path, verify=False) as checkpointer:
        assert checkpointer.save(1, state)
        meta = checkpointer.read_metadata()
        # Shapes and dtypes are still recorded (to name a mismatched template), without CRCs.
        assert meta["arrays"]["['w']"] == {"shape": [4], "dtype": "float32"}
        assert meta["arrays"]["['key']"] == {"shape": [2], "dtype": "uint32"}
        restored, _ = checkpointer.restore(state)
    assert_trees_equal(restored["w"], state["w"])
    # A verifying checkpointer restores it too, and says it could not check it.
    with Checkpointer(tmp_path) as checkpointer:
        caplog.set_level(logging.WARNING, logger="triaccel_jax.checkpoint")
        restored, _ = checkpointer.restore(state)
    assert "saved with verify=False" in caplog.text
    np.testing.assert_array_equal(restored["n"], 3)


def test_verify_false_skips_the_check_that_verify_true_makes(tmp_path):
    state = {"w": jnp.arange(4.0)}
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, state)
    path = tmp_path / "1" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["arrays"]["['w']"]["crc32"] ^= 1  # as if the data had changed since the save
    path.write_text(json.dumps(meta))
    with Checkpointer(tmp_path) as checkpointer, pytest.raises(CheckpointError, match="corrupted"):
        checkpointer.restore(state)
    with Checkpointer(tmp_path, verify=False) as checkpointer:
        restored, _ = checkpointer.restore(state)
    np.testing.assert_array_equal(restored["w"], state["w"])


def test_saving_a_step_not_after_the_latest_is_an_error_and_loses_nothing(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(5, {"w": jnp.ones(2)})
        for step in (5, 3):  # orbax would skip these without a word
            with pytest.raises(CheckpointError, match=f"cannot save step {step} .* holds step 5"):
                checkpointer.save(step, {"w": jnp.zeros(2)})
        assert checkpointer.steps() == [5]
        restored, _ = checkpointer.restore({"w": jnp.zeros(2)})
        np.testing.assert_array_equal(restored["w"], np.ones(2))
        assert checkpointer.save(np.int64(6), {"w": jnp.ones(2)})  # numpy and JAX ints are steps
        assert checkpointer.save(jnp.int32(7), {"w": jnp.ones(2)})
        for step in (-1, 2.5, "8", True):
            with pytest.raises(ValueError, match="`step` must be an integer >= 0"):
                checkpointer.save(step, {"w": jnp.ones(2)})
        assert checkpointer.steps() == [5, 6, 7]


def test_bad_options_are_named(tmp_path):
    with pytest.raises(
        TypeError, match=r"`options` must be an orbax\.checkpoint\.CheckpointManager"
    ):
        Checkpointer(tmp_path, options={"max_to_keep": 2})
    with pytest.raises(ValueError, match="give `max_to_keep` in `options`"):
        Checkpointer(tmp_path, max_to_keep=5, options=ocp.CheckpointManagerOptions())
    with pytest.raises(TypeError, match="`verify` must be a bool"):
        Checkpointer(tmp_path, verify="no")


def test_save_controller_says_whether_it_saved(tmp_path):
    controller = make_controller()
    controller.run(2)
    options = ocp.CheckpointManagerOptions(save_interval_steps=4)
    with Checkpointer(tmp_path, options=options) as checkpointer:
        assert checkpointer.save_controller(controller) is True  # orbax saves the first one
        controller.run(1)
        assert checkpointer.save_controller(controller) is False  # step 3: not due
        controller.run(1)
        assert checkpointer.save_controller(controller) is True  # step 4
        checkpointer.wait_until_finished()
        assert checkpointer.steps() == [2, 4]


def test_a_train_state_controller_restored_from_a_checkpoint_counts_every_step(tmp_path):
    # 7 steps, saved; a controller made from the same starting state, restored, 5 more: the
    # train state handed back has trained 12 steps, as the controller and optax count them.
    tx = triaccel_jax.triaccel(1e-2)
    options = dict(min_batch=8, max_batch=8, probe=triaccel_jax.FakeMemoryProbe(BIG))

    def start():
        return TrainState.create(apply_fn=None, params=make_params(), tx=tx)

    first = from_train_state(loss_fn, start(), make_data(), **options)
    first.run(7)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save_controller(first)
    resumed = from_train_state(loss_fn, start(), make_data(), **options)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.restore_controller(resumed)
    resumed.run(5)
    state = to_train_state(resumed, start())
    assert resumed.step_count == 12
    assert int(state.opt_state[0].count) == 12
    assert int(state.step) == 12
