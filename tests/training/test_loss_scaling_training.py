"""Loss scaling in the training path: the controller's compiled step and the Flax train state
scale the loss while a policy computes any leaf in fp16, hand the optimizer float32 gradients
unscaled, and skip (and count) the steps whose gradients overflow."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from controller_harness import BIG
from controller_harness import make_data
from controller_harness import make_params

import triaccel_jax
from triaccel_jax import Controller
from triaccel_jax import FakeMemoryProbe
from triaccel_jax import PrecisionPolicy
from triaccel_jax.controller._sampler import ElasticSampler
from triaccel_jax.transforms import LossScaling

BATCH, STEPS = 32, 30
# The loss is small, so that its gradients sit below float16's normal range: the cotangent of
# the fp16 prediction is about TINY * |error| / BATCH = 3e-8, under float16's smallest subnormal
# (6e-8); scaled by 2**15 it is 1e-3, which float16 holds to 3 digits.
TINY = 1e-6
POISONED = np.random.default_rng(5).choice(512, 3, replace=False)


def tiny_loss(params, batch, *, policy, rng):
    """A two-layer net computed in the policy's dtypes; a poisoned sample's weight overflows."""
    p = params if policy is None else triaccel_jax.cast_params(params, policy)
    dtype = p["w1"].dtype
    hidden = jnp.tanh(batch["x"].astype(dtype) @ p["w1"])
    prediction = (hidden @ p["w2"]).astype(jnp.float32)
    weight = jnp.where(jnp.isin(batch["id"], POISONED), jnp.inf, 1.0)
    return TINY * jnp.mean(weight * (prediction - batch["y"]) ** 2)


def fp16(params):
    return PrecisionPolicy.uniform(params, "fp16")


def make(policy, **overrides):
    params = make_params()
    kwargs = {"min_batch": BATCH, "max_batch": BATCH, "probe": FakeMemoryProbe(BIG), "seed": 0}
    kwargs.update(overrides)
    return Controller(
        tiny_loss,
        params,
        triaccel_jax.triaccel(1e-2),
        make_data(),
        policy=policy(params) if policy else None,
        **kwargs,
    )


def reference_run(steps):
    """The same data in float32 without any scaling, the poisoned steps left out by hand."""
    tx = triaccel_jax.triaccel(1e-2)
    params = make_params()
    state = tx.init(params)
    data = make_data()
    sampler = ElasticSampler(len(data["id"]), seed=0)
    skipped = []
    for t in range(steps):
        ids = sampler.take(BATCH)
        if np.isin(ids, POISONED).any():
            skipped.append(t)
            continue
        batch = {k: v[ids] for k, v in data.items()}
        grads = jax.grad(lambda p, b=batch: tiny_loss(p, b, policy=None, rng=None))(params)
        updates, state = tx.update(grads, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    return params, state, skipped


def test_without_scaling_fp16_gradients_of_this_loss_lose_their_digits():
    # What makes the next test meaningful: unscaled, this loss's fp16 gradients are float16
    # subnormals, a few units of 6e-8 each; scaled by 2**15 they keep fp16's 3 digits.
    params, data = make_params(), make_data()
    batch = {k: v[:BATCH] for k, v in data.items()}
    batch["id"] = batch["id"] + 10_000  # no poisoned sample

    def grads(policy, scale):
        loss = lambda p: scale * tiny_loss(p, batch, policy=policy, rng=None)
        return np.asarray(jax.grad(loss)(params)["w2"]) / scale

    exact = grads(None, 1.0)
    unscaled_error = np.median(np.abs(grads(fp16(params), 1.0) / exact - 1))
    scaled_error = np.median(np.abs(grads(fp16(params), 2.0**15) / exact - 1))
    print(
        f"median relative error of fp16 gradients: {unscaled_error:.2g} unscaled, "
        f"{scaled_error:.2g} scaled"
    )
    assert unscaled_error > 0.03 and scaled_error < 0.005


@pytest.mark.slow
def test_fp16_under_the_controller_skips_exactly_the_overflows_and_matches_fp32_curvature():
    controller = make(fp16)
    infos = controller.run(STEPS)
    ref_params, ref_state, expected = reference_run(STEPS)
    assert len(expected) >= 2, "the seed should poison a few steps"
    assert [t for t, info in enumerate(infos) if info.metrics["skipped"]] == expected
    assert [t for t, info in enumerate(infos) if not np.isfinite(info.loss)] == expected
    assert int(controller.loss_scale.skipped_steps) == len(expected)
    # Backed off once per overflow from 2**15 (no growth within 2000 steps).
    assert float(controller.loss_scale.scale) == 2.0**15 * 0.5 ** len(expected)
    assert infos[-1].metrics["loss_scale"] == float(controller.loss_scale.scale)
    chex.assert_tree_all_finite((controller.params, controller.opt_state))
    finite = [info.loss for info in infos if np.isfinite(info.loss)]
    assert finite[-1] < finite[0]  # it trains
    # The curvature estimator saw the unscaled gradients: the fp32 run's signals, to fp16
    # rounding of the forward and backward passes.
    ours, theirs = triaccel_jax.signals(controller.opt_state), triaccel_jax.signals(ref_state)
    worst = 0.0
    for path in theirs:
        for name in ("mean_curvature", "max_curvature", "trace", "step_scale"):
            assert ours[path][name] == pytest.approx(theirs[path][name], rel=5e-3), (path, name)
            worst = max(worst, abs(ours[path][name] / theirs[path][name] - 1))
    # The params differ by fp16 rounding passed through 27 sign-like (normalised) updates of
    # 1e-2: measured at most 7e-4 apart after 30 steps, asserted within 2e-3.
    gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(controller.params), jax.tree.leaves(ref_params), strict=True
        )
    )
    print(f"fp16 vs fp32: signals within {worst:.2g} relative, params within {gap:.2g}")
    assert gap < 2e-3


@pytest.mark.slow
def test_the_scale_survives_state_dict_policy_switches_and_micro_batches():
    controller = make(
        fp16,
        min_batch=BATCH // 2,
        keep_global_batch=True,
        global_batch=BATCH,
        batch_size=BATCH // 2,
    )
    infos = controller.run(12)  # two micro-batches of 16 per step: the accumulated path
    skipped = [t for t, info in enumerate(infos) if info.metrics["skipped"]]
    assert skipped and int(controller.loss_scale.skipped_steps) == len(skipped)
    scale = float(controller.loss_scale.scale)
    assert scale == 2.0**15 * 0.5 ** len(skipped)
    # Checkpointed with the controller's own state, restored into a fresh controller.
    saved = controller.state_dict()
    assert saved["loss_scale"]["scale"] == scale
    restored = make(
        fp16,
        min_batch=BATCH // 2,
        keep_global_batch=True,
        global_batch=BATCH,
        batch_size=BATCH // 2,
    )
    restored.load_state_dict(saved)
    assert float(restored.loss_scale.scale) == scale
    assert int(restored.loss_scale.skipped_steps) == len(skipped)
    # An fp32 policy does not scale: the loss is multiplied by 1 and the scale is kept aside.
    controller.set_policy(PrecisionPolicy.uniform(controller.params))
    info = controller.step()
    assert info.metrics["loss_scale"] == 1.0 and info.metrics["skipped"] == 0.0
    assert float(controller.loss_scale.scale) == scale
    # Back in fp16, scaling resumes from the kept scale.
    controller.set_policy(fp16(controller.params))
    assert controller.step().metrics["loss_scale"] == scale


@pytest.mark.slow
def test_the_flax_train_state_scales_the_loss_under_an_fp16_policy():
    import flax.linen as nn

    from triaccel_jax.flax import TrainState

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.tanh(nn.Dense(32)(x)))[:, 0]

    data = make_data()
    model = MLP()
    params = model.init(jax.random.key(0), data["x"][:2])["params"]

    @jax.jit
    def step(state, x, y, poison):
        def loss(p):
            dtype = jax.tree.leaves(p)[0].dtype  # the compute copy's: fp16 under the policy
            prediction = state.apply_fn({"params": p}, x.astype(dtype)).astype(jnp.float32)
            return poison * TINY * jnp.mean((prediction - y) ** 2)

        value, grads = state.value_and_grad(loss)
        return state.apply_gradients(grads=grads), value

    def train(policy, poisoned_steps, run_poisoned):
        state = TrainState.create(
            apply_fn=model.apply, params=params, tx=triaccel_jax.triaccel(1e-2), policy=policy
        )
        for t in range(STEPS):
            if t in poisoned_steps and not run_poisoned:
                continue
            ids = np.arange(t * BATCH, (t + 1) * BATCH) % len(data["id"])
            poison = jnp.float32(jnp.inf if t in poisoned_steps else 1.0)
            state, _ = step(state, data["x"][ids], data["y"][ids], poison)
        return state

    poisoned = {3, 11, 12}
    ours = train(fp16(params), poisoned, run_poisoned=True)
    reference = train(None, poisoned, run_poisoned=False)
    assert ours.scales_loss and not reference.scales_loss
    assert int(ours.step) == STEPS and int(ours.loss_scale.skipped_steps) == len(poisoned)
    assert float(ours.loss_scale.scale) == 2.0**15 * 0.5 ** len(poisoned)
    assert int(reference.loss_scale.skipped_steps) == 0
    assert ours.params["Dense_0"]["kernel"].dtype == jnp.float32  # masters stay fp32
    mine, theirs = triaccel_jax.signals(ours.opt_state), triaccel_jax.signals(reference.opt_state)
    for path in theirs:
        for name in ("mean_curvature", "max_curvature", "trace", "step_scale"):
            assert mine[path][name] == pytest.approx(theirs[path][name], rel=5e-3), (path, name)


def test_a_train_state_round_trip_carries_the_loss_scale_and_its_rule():
    from triaccel_jax.flax import TrainState
    from triaccel_jax.flax import from_train_state
    from triaccel_jax.flax import to_train_state

    params = make_params()
    state = TrainState.create(
        apply_fn=None,
        params=params,
        tx=triaccel_jax.triaccel(1e-2),
        policy=fp16(params),
        loss_scaling=LossScaling(initial_scale=2.0**10),
    )
    options = dict(min_batch=BATCH, max_batch=BATCH, probe=FakeMemoryProbe(BIG))
    controller = from_train_state(tiny_loss, state, make_data(), **options)
    assert float(controller.loss_scale.scale) == 2.0**10  # the state's rule
    infos = controller.run(STEPS)
    skipped = int(sum(info.metrics["skipped"] for info in infos))
    back = to_train_state(controller, state)
    assert skipped > 0 and int(back.loss_scale.skipped_steps) == skipped
    assert float(back.loss_scale.scale) == 2.0**10 * 0.5**skipped
    again = from_train_state(tiny_loss, back, make_data(), **options)
    assert float(again.loss_scale.scale) == float(back.loss_scale.scale)


def test_a_train_state_takes_the_loss_scaling_rule_not_a_dict_of_its_keywords():
    from triaccel_jax.flax import TrainState

    params = make_params()
    with pytest.raises(TypeError, match=r"`loss_scaling` must be a .*LossScaling.*got dict"):
        TrainState.create(
            apply_fn=None,
            params=params,
            tx=triaccel_jax.triaccel(1e-2),
            policy=fp16(params),
            loss_scaling={"initial_scale": 2.0**10},  # type: ignore[arg-type]
        )


def test_a_wrapped_optimizer_under_a_scaling_policy_is_rejected():
    params = make_params()
    controller = Controller(
        tiny_loss,
        params,
        triaccel_jax.transforms.dynamic_loss_scale(triaccel_jax.triaccel(1e-2)),
        make_data(),
        min_batch=BATCH,
        max_batch=BATCH,
        probe=FakeMemoryProbe(BIG),
        policy=PrecisionPolicy.uniform(params),  # fp32: the wrapper alone scales
    )
    controller.step()
    controller.set_policy(fp16(params))
    with pytest.raises(ValueError, match="unscale the gradients a second time"):
        controller.step()
