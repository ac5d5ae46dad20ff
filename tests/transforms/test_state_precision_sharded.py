"""``quantize_state`` on sharded leaves: the update adds no collective, and the stored codes and
scales shard like their leaf (8 simulated CPU devices, in a subprocess).

Blocks are cut along each leaf's last axis, so a leaf sharded along its leading axes (FSDP) keeps
every block on one device, whatever the block size; a leaf sharded along its last axis (tensor
parallel) does when the block size divides each device's columns. Counted in the compiled HLO
text of a jitted AdamW update: all-gather, all-reduce, collective-permute, all-to-all and
reduce-scatter. Meshes with Auto axes (XLA propagates the sharding) and Explicit axes (sharding in
types, ``jax.make_mesh``'s default); leaves of (1000, 1000) and (1000, 968), which no block size of
256 or 128 divides. Blocks cut from the flattened leaf, as before, straddle the shards: an
Explicit mesh refuses the reshape and an Auto mesh all-gathers the state on every step. int4's
factored second moments (AdamW's ``nu`` of a matrix) cost one all-reduce a leaf under FSDP:
test_state_precision_factored.py.
"""

from __future__ import annotations

import textwrap

import pytest
from simulated_devices import run_script

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import triaccel_jax
    from triaccel_jax.transforms import QuantizedLeaf

    jax.config.update("jax_numpy_dtype_promotion", "standard")  # optax's count promotes
    COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all",
                   "reduce-scatter")

    def collectives(compiled):
        text = compiled.as_text()
        return {name: text.count(name) for name in COLLECTIVES if name in text}

    def mesh(name, kind):
        kinds = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
        return jax.make_mesh((8,), (name,), axis_types=(kinds[kind],))

    def params_of(shapes):
        keys = jax.random.split(jax.random.key(0), len(shapes))
        return {f"w{i}": jax.random.normal(k, s) for i, (k, s) in enumerate(zip(keys, shapes))}

    def two_steps(tx, params, grads):
        state = tx.init(params)
        step = jax.jit(tx.update)
        updates, state = step(grads, state, params)
        updates, state = step(grads, state, params)
        return updates, state, step.lower(grads, state, params).compile()

    def check(layout_name, spec, shapes, fmt, rounding, block_size=None, inner=None):
        params = params_of(shapes)
        grads = jax.tree.map(lambda p: 0.01 * jnp.cos(p), params)
        tx = triaccel_jax.quantize_state(
            inner or optax.adamw(1e-3), format=fmt, rounding=rounding, block_size=block_size,
            min_size=1024)
        expected, _, _ = two_steps(tx, params, grads)  # one device, unsharded
        for kind in ("auto", "explicit"):
            m = mesh(layout_name, kind)
            with jax.set_mesh(m):
                put = lambda x: jax.device_put(x, NamedSharding(m, spec))
                updates, state, compiled = two_steps(
                    tx, jax.tree.map(put, params), jax.tree.map(put, grads))
            what = (layout_name, kind, fmt, rounding)
            assert collectives(compiled) == {}, (what, collectives(compiled))
            moments = state.inner_state[0]
            stored = [
                *getattr(moments, "mu", {}).values(),
                *getattr(moments, "nu", {}).values(),
                *getattr(moments, "trace", {}).values(),
            ]
            assert stored, what
            assert all(isinstance(node, QuantizedLeaf) for node in stored), what
            for node in stored:
                for array in (node.codes, node.scales):
                    assert layout_name in tuple(array.sharding.spec), (what, array.sharding)
            for name in params:
                np.testing.assert_allclose(
                    updates[name], expected[name], rtol=1e-6, atol=1e-9, err_msg=str(what))

    # FSDP: rows sharded 8 ways; rows of 1000 and 968 end in a short block.
    for fmt in ("int8", "int8_dynamic"):
        check("fsdp", P("fsdp", None), [(1000, 1000), (1000, 968)], fmt, "nearest")
    # int4's 4-bit codes (two a byte along the last axis) on a signed state: SGD's momentum.
    # AdamW's int4 second moments of rank 2 are factored, whose column means reduce across the
    # shards (an all-reduce): test_state_precision_factored.py counts them.
    check("fsdp", P("fsdp", None), [(1000, 1000), (1000, 968)], "int4", "nearest",
          inner=optax.sgd(1e-3, momentum=0.9))
    check("fsdp", P("fsdp", None), [(1000, 1000)], "int8", "stochastic")
    # Tensor parallel: 1000 columns, 125 a device; blocks of 125 stay within a shard.
    check("tp", P(None, "tp"), [(256, 1000)], "int8", "nearest", block_size=125)
    print("ok")
    """
)


@pytest.mark.slow
def test_a_sharded_update_adds_no_collective_and_its_state_shards_like_the_leaf():
    run_script(SCRIPT, devices=8)
