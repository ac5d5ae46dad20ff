"""Blocks along the last axis under sharding: codes and scales shard like the leaf, with no
collective in the compiled quantize and dequantize (8 simulated CPU devices, in a subprocess).

Counted in the compiled HLO text: all-gather, all-reduce, collective-permute, all-to-all and
reduce-scatter. Meshes with Auto axes (XLA propagates the sharding) and Explicit axes (sharding
in types, ``jax.make_mesh``'s default), the FSDP layout ``P("fsdp", None)`` and the
tensor-parallel ``P(None, "tp")``, and a (1000, 1000) leaf that no block size of 256 divides.
"""

from __future__ import annotations

import textwrap

from simulated_devices import run_script

PRELUDE = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from triaccel_jax.kernels import quantize as quantize_lib

    COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all",
                   "reduce-scatter")

    def collectives(compiled):
        text = compiled.as_text()
        return {name: text.count(name) for name in COLLECTIVES if name in text}

    def round_trip(block_size, mapping, rounding):
        def run(x):
            quantized = quantize_lib.quantize_blocks(
                x, block_size=block_size, mapping=mapping, rounding=rounding,
                key=jax.random.key(1), layout="rows")
            back = quantize_lib.dequantize_blocks(
                quantized.codes, quantized.scales, block_size=block_size, mapping=mapping,
                layout="rows", shape=x.shape)
            return quantized, back
        return run

    def mesh(name, devices, kind):
        kinds = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
        return jax.make_mesh((devices,), (name,), axis_types=(kinds[kind],),
                             devices=jax.devices()[:devices])
    """
)


FSDP_SCRIPT = PRELUDE + textwrap.dedent(
    """
    # A (1000, 1000) leaf sharded by rows on 8 and on 4 devices: 1000 is no multiple of 256,
    # so each row ends in a short block of 232. Every map, both roundings, both kinds of mesh.
    leaf = jax.random.normal(jax.random.key(0), (1000, 1000))
    for kind in ("auto", "explicit"):
        for devices in (8, 4):
            fsdp = mesh("fsdp", devices, kind)
            for mapping in quantize_lib.ALL_MAPS:
                for rounding in ("nearest", "stochastic"):
                    if devices == 4 and rounding == "nearest":
                        continue  # 4 devices: one rounding is enough to show the same
                    run = round_trip(256, mapping, rounding)
                    expected = jax.jit(run)(leaf)  # one device, unsharded
                    with jax.set_mesh(fsdp):
                        x = jax.device_put(leaf, NamedSharding(fsdp, P("fsdp", None)))
                        compiled = jax.jit(run).lower(x).compile()
                        quantized, back = jax.jit(run)(x)
                    what = (kind, devices, mapping, rounding)
                    assert collectives(compiled) == {}, (what, collectives(compiled))
                    for array in (quantized.codes, quantized.scales, back):
                        assert tuple(array.sharding.spec) in (("fsdp", None), ("fsdp",)), (
                            what, array.sharding)
                    assert quantized.scales.shape == (1000, 4), what
                    np.testing.assert_array_equal(quantized.codes, expected[0].codes)
                    np.testing.assert_array_equal(quantized.scales, expected[0].scales)
                    np.testing.assert_array_equal(back, expected[1])
    print("ok")
    """
)


TENSOR_PARALLEL_SCRIPT = PRELUDE + textwrap.dedent(
    """
    # A last axis sharded 8 ways (1024 columns, 128 a device; 1000 columns, 125 a device):
    # blocks that divide each device's columns stay local under both kinds of mesh.
    for kind in ("auto", "explicit"):
        tp = mesh("tp", 8, kind)
        for shape, block_size, mapping in (
            ((256, 1024), 128, "dynamic"),
            ((256, 1024), 64, "dynamic4"),
            ((256, 1000), 125, "dynamic_unsigned"),
        ):
            leaf = jax.random.normal(jax.random.key(0), shape)
            run = round_trip(block_size, mapping, "stochastic")
            expected = jax.jit(run)(leaf)
            with jax.set_mesh(tp):
                x = jax.device_put(leaf, NamedSharding(tp, P(None, "tp")))
                compiled = jax.jit(run).lower(x).compile()
                quantized, back = jax.jit(run)(x)
            what = (kind, shape, block_size, mapping)
            assert collectives(compiled) == {}, (what, collectives(compiled))
            for array in (quantized.codes, quantized.scales, back):
                assert tuple(array.sharding.spec) == (None, "tp"), (what, array.sharding)
            np.testing.assert_array_equal(quantized.codes, expected[0].codes)
            np.testing.assert_array_equal(back, expected[1])

    # Blocks of 256 cross the 128-column shards: an Explicit mesh refuses them by name; under
    # Auto axes XLA moves the data (collectives) and the values are still right.
    leaf = jax.random.normal(jax.random.key(0), (256, 1024))
    run = round_trip(256, "dynamic", "nearest")
    expected = jax.jit(run)(leaf)
    explicit = mesh("tp", 8, "explicit")
    with jax.set_mesh(explicit):
        x = jax.device_put(leaf, NamedSharding(explicit, P(None, "tp")))
        try:
            jax.jit(run)(x)
        except ValueError as error:
            assert "would cross from one shard to the next" in str(error), error
        else:
            raise AssertionError("blocks across Explicit shards were not refused")
    auto = mesh("tp", 8, "auto")
    with jax.set_mesh(auto):
        x = jax.device_put(leaf, NamedSharding(auto, P(None, "tp")))
        crossing = collectives(jax.jit(run).lower(x).compile())
        quantized, back = jax.jit(run)(x)
    assert crossing, "blocks across shards needed no collective?"
    np.testing.assert_array_equal(back, expected[1])
    print("ok")
    """
)


def test_row_blocks_of_an_fsdp_leaf_add_no_collective_and_shard_like_it():
    run_script(FSDP_SCRIPT, devices=8)


def test_row_blocks_within_tensor_parallel_shards_add_no_collective():
    run_script(TENSOR_PARALLEL_SCRIPT, devices=8)
