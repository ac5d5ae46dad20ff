"""The Controller across devices and processes.

* 8 simulated CPU devices: the batch sharded over a ``data`` mesh axis gives the losses and
  params of the single-device run.
* 2 processes (``jax.distributed`` on localhost, CPU, gloo collectives), 50 controller steps with
  precision re-plans: only one process's fake probe reports memory pressure, and it changes
  mid-run; both still take identical decisions (those of the tighter limit) and end with
  identical params, policies and controller state.

XLA's device count and the distributed runtime are fixed when jax starts, so each runs in
subprocesses.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest
from simulated_devices import device_env
from simulated_devices import run_script

COMMON = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    import triaccel_jax
    from triaccel_jax.precision import PlannerConfig

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = np.tanh(x @ rng.normal(size=8).astype(np.float32)).astype(np.float32)
    data = {"x": x, "y": y}
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (8, 32)) * 0.3, "w2": jax.random.normal(k2, (32,)) * 0.3}

    def loss_fn(params, batch, *, policy, rng):
        hidden = jnp.tanh(batch["x"] @ params["w1"])
        return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

    def summary(controller, infos):
        decisions = [
            [e.step, e.kind, e.old, e.new]
            for e in controller.events
            if e.kind in ("grow", "shrink", "oom", "learning_rate", "update_scale")
        ]
        return {
            "losses": [i.loss for i in infos],
            "batches": [i.batch_size for i in infos],
            "decisions": decisions,
            "params": {k: np.asarray(v).tolist() for k, v in controller.params.items()},
        }
    """
)

MULTI_DEVICE = COMMON + textwrap.dedent(
    """
    from jax.sharding import Mesh
    assert jax.device_count() == 8, jax.devices()

    def run(mesh):
        probe = triaccel_jax.FakeMemoryProbe(10_000, peak_bytes=lambda b: 500 + 100 * b)
        controller = triaccel_jax.Controller(
            loss_fn, params, triaccel_jax.triaccel(1e-2), data, min_batch=8, max_batch=128,
            probe=probe, check_every=2, mesh=mesh, seed=0, batch_rule="memory")
        infos = controller.run(12)
        if mesh is not None:
            placed = controller.params["w1"].sharding
            assert len(placed.device_set) == 8, placed
        return summary(controller, infos)

    single = run(None)
    sharded = run(Mesh(np.array(jax.devices()), ("data",)))
    assert single["batches"] == sharded["batches"], (single["batches"], sharded["batches"])
    assert max(single["batches"]) > 8, single["batches"]
    np.testing.assert_allclose(single["losses"], sharded["losses"], rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(single["params"][k], sharded["params"][k], rtol=1e-5, atol=1e-6)
    print("ok")
    """
)

DISTRIBUTED_START = textwrap.dedent(
    """
    import sys
    import jax
    process_id, port = int(sys.argv[1]), sys.argv[2]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    """
)

TWO_PROCESSES = (
    DISTRIBUTED_START
    + COMMON
    + textwrap.dedent(
        """
    from jax.sharding import Mesh
    assert jax.process_count() == 2 and jax.device_count() == 2

    # Only process 1 sees memory pressure, and it changes: its limit allows batch 64 at first,
    # then drops to 6000 bytes (batch 32) from its 10th reading on. Process 0 always has room.
    def limit(reading):
        if process_id == 0:
            return 20_000
        return 9_000 if reading < 10 else 6_000

    probe = triaccel_jax.FakeMemoryProbe(limit, peak_bytes=lambda b: 500 + 100 * b)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    controller = triaccel_jax.Controller(
        loss_fn, params, triaccel_jax.triaccel(1e-2, curvature_every=2), data, min_batch=8,
        max_batch=128, probe=probe, check_every=2, replan_every=10,
        planner=PlannerConfig(budget=0.5), mesh=mesh, seed=0, batch_rule="memory", precision_rule="memory")
    infos = controller.run(50)
    result = summary(controller, infos)
    result["policies"] = [e.new for e in controller.events if e.kind == "replan"]
    result["policy"] = controller.policy.to_json()
    result["state"] = controller.state_dict()
    print("RESULT " + json.dumps(result))
    """
    )
)


@pytest.mark.slow
def test_data_parallel_controller_on_8_devices_matches_one_device():
    run_script(MULTI_DEVICE, devices=8)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_processes_take_identical_decisions_when_their_probes_disagree():
    first, second = _run_two_processes(TWO_PROCESSES)
    assert len(first["losses"]) == 50
    for key in ("decisions", "batches", "losses", "params", "policies", "policy", "state"):
        assert first[key] == second[key], key
    # The decisions follow process 1's limits, which process 0 never measured: grow to 64
    # (500 + 100 b under 80% of 9000; alone, process 0 would take 128), then shrink to 32 once its
    # limit drops to 6000.
    batches = first["batches"]
    runs = [b for i, b in enumerate(batches) if i == 0 or b != batches[i - 1]]
    assert max(batches) == 64 and runs[-2:] == [64, 32], runs
    assert [d[1] for d in first["decisions"]].count("shrink") >= 1, first["decisions"]
    # A re-plan changed the policy (the same on both, checked above: "policies", "policy").
    assert len(first["policies"]) >= 1, first["policies"]
    assert first["state"]["step"] == 50


YOUR_LOOP_TWO_PROCESSES = DISTRIBUTED_START + textwrap.dedent(
    """
    import json
    import jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from triaccel_jax.controller import AdaptiveBatches, FakeMemoryProbe
    from triaccel_jax.training import value_and_grad_with_noise

    # Every host holds the data and draws the same indices (the same seed); each puts the rows
    # of its own devices into the global batch.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 8)).astype(np.float32)
    y = (x @ rng.normal(size=8) + 3.0 * rng.normal(size=2048)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)

    def loss(w, batch):
        inputs, targets = batch
        return jnp.mean((inputs @ w - targets) ** 2)

    @jax.jit
    def step(w, opt_state, batch):
        value, grads, norms = value_and_grad_with_noise(loss)(w, batch)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, {"loss": value, **norms}

    # The hosts disagree on what they measure: process 1's steps take 3x as long, and only its
    # memory limit binds (80% of 200,000 bytes at 1,000 a sample: batch 128 at most).
    now = [0.0]
    slow = 3.0 if process_id == 1 else 1.0
    probe = FakeMemoryProbe(200_000 if process_id == 1 else 10**9, peak_bytes=lambda b: 1000 * b)
    w = jnp.zeros(8)
    opt_state = tx.init(w)
    batches = AdaptiveBatches(
        (x, y), opt_state, min_batch=16, max_batch=512, check_every=4, patience=1, probe=probe,
        clock=lambda: now[0], seed=0,
    )
    sizes, rates = [], []
    for epoch in range(2):
        for batch, settings in batches:
            global_batch = tuple(
                jax.make_array_from_callback(a.shape, rows, lambda index, a=a: a[index])
                for a in batch
            )
            opt_state = settings.apply(opt_state)
            w, opt_state, metrics = step(w, opt_state, global_batch)
            now[0] += slow * (0.010 + 1e-5 * settings.batch_size)  # a GPU-like step time
            batches.report(metrics, opt_state=opt_state)
            sizes.append(settings.batch_size)
            rates.append(settings.learning_rate)
    decisions = [[e.step, e.kind, e.old, e.new] for e in batches.events if e.kind != "start"]
    print("RESULT " + json.dumps({"sizes": sizes, "rates": rates, "decisions": decisions,
                                  "w": np.asarray(w).tolist(), "state": batches.state_dict()}))
    """
)


def _run_two_processes(script: str) -> list[dict]:
    """Runs ``script`` as processes 0 and 1 of one distributed run; their RESULT lines."""
    port = str(_free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(i), port],
            env=device_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=600)
        finally:
            process.kill()
        assert process.returncode == 0, err[-4000:]
        (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
        outputs.append(json.loads(line[len("RESULT ") :]))
    return outputs


@pytest.mark.slow
def test_your_loop_on_two_hosts_takes_one_decision_when_their_clocks_and_memory_disagree():
    first, second = _run_two_processes(YOUR_LOOP_TWO_PROCESSES)
    for key in ("sizes", "rates", "decisions", "w", "state"):
        assert first[key] == second[key], key
    sizes = first["sizes"]
    assert sum(sizes) == 2 * 2048  # two epochs, each sample once
    # The noisy regression grows the batch, within the limit only process 1 has.
    assert sizes[0] == 16 and max(sizes) > 16, first["decisions"]
    assert max(sizes) == 128, first["decisions"]  # process 1's limit, which process 0 never saw
