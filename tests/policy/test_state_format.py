"""The state-format registry: every format's maps exist, its bytes and its error model hold."""

from __future__ import annotations

import itertools
import math

import pytest

from triaccel_jax import policy
from triaccel_jax.kernels import quantize as quantize_lib


@pytest.mark.parametrize("name", sorted(policy.STATE_FORMATS))
def test_the_error_model_is_what_a_store_measures(name):
    state = policy.state_format(name)
    measured = policy.measure_error_variance(name)
    if name == "fp32":
        assert measured == state.error_variance == 0.0
    else:
        # A second seed and the registered constant agree within sampling error.
        again = policy.measure_error_variance(name, seed=1)
        assert math.isclose(measured, state.error_variance, rel_tol=0.05), (name, measured)
        assert math.isclose(again, state.error_variance, rel_tol=0.15), (name, again)


@pytest.mark.parametrize("name", sorted(policy.STATE_FORMATS))
def test_a_coded_format_names_kernel_maps_and_counts_their_bytes(name):
    state = policy.state_format(name)
    if state.is_float:
        assert state.block_size is None and state.unsigned_map is None
        assert state.bytes_per_element(4) == (4.0 if name == "fp32" else 2.0)
        assert state.bytes_per_element(2) == 2.0
        return
    assert state.signed_map in quantize_lib.ALL_MAPS
    assert state.unsigned_map in quantize_lib.ALL_MAPS
    assert quantize_lib.MAP_BITS[state.signed_map] == state.bits
    assert quantize_lib.MAP_BITS[state.unsigned_map] == state.bits
    # The per-element figure is what the kernels store, scales included.
    shape = (64, state.block_size)
    for mapping in (state.signed_map, state.unsigned_map):
        stored = quantize_lib.stored_bytes(shape, block_size=state.block_size, mapping=mapping)
        assert stored == state.bytes_per_element(4) * math.prod(shape)


def test_an_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown state format 'int3'.*int4"):
        policy.state_format("int3")


def test_the_policy_keeps_its_own_state_in_the_float_formats():
    assert policy.STATE_NAMES == ("fp32", "bf16")
    assert [name for name in policy.STATE_FORMATS] == [
        "fp32",
        "bf16",
        "int8",
        "int8_dynamic",
        "int4",
    ]
    # From the most to the least precise: bytes fall, error grows.
    formats = list(policy.STATE_FORMATS.values())
    for more, less in itertools.pairwise(formats):
        assert more.bytes_per_element(4) >= less.bytes_per_element(4)
    assert formats[-1].error_variance > formats[1].error_variance


# -- the bytes of one state leaf ---------------------------------------------------------------

SHAPES = [(7,), (4096,), (64, 128), (1000, 1000), (3, 5), (2, 3, 300), (1, 129)]


@pytest.mark.parametrize("name", sorted(policy.STATE_FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
def test_a_leafs_bytes_are_its_codes_and_row_scales_or_its_float_elements(name, shape):
    state = policy.state_format(name)
    size = math.prod(shape)
    for itemsize in (4, 2):
        for second in (False, True):
            got = state.leaf_bytes(shape, itemsize, second_moment=second)
            assert isinstance(got, int)
            if name == "fp32":
                assert got == size * itemsize
            elif name == "bf16":
                assert got == size * 2
            elif second and state.factored and len(shape) >= 2:
                # Adafactor's row and column means of the last two axes, float32.
                assert got == 4 * (shape[-2] + shape[-1]) * math.prod(shape[:-2])
            else:
                # Codes (4-bit ones two a byte, each row's count rounded up) and one float32
                # scale per block of the last axis, each row's last block shorter.
                codes = size if state.bits == 8 else math.prod(shape[:-1]) * -(-shape[-1] // 2)
                scales = math.prod(shape[:-1]) * -(-shape[-1] // state.block_size)
                assert got == codes + 4 * scales
                mapping = state.unsigned_map if second else state.signed_map
                assert got == quantize_lib.stored_bytes(
                    shape, block_size=state.block_size, mapping=mapping, layout="rows"
                )


def test_a_one_dimensional_second_moment_keeps_int4_codes_and_a_block_size_overrides():
    int4 = policy.state_format("int4")
    assert int4.leaf_bytes((4096,), 4, second_moment=True) == 2048 + 4 * 32
    assert int4.leaf_bytes((4096,), 4, second_moment=True) == quantize_lib.stored_bytes(
        (4096,), block_size=128, mapping="linear4_unsigned", layout="rows"
    )
    int8 = policy.state_format("int8")
    assert int8.leaf_bytes((64, 128), 4, block_size=64) == 64 * 128 + 4 * 64 * 2
    assert int8.leaf_bytes((64, 128), 4) == 64 * 128 + 4 * 64  # one block per row of 128
    # A scalar has no last axis: one flat block.
    assert int8.leaf_bytes((), 4) == 1 + 4
    # Where a row holds whole blocks, the per-element figure is the leaf's bytes over its size.
    for name in ("int8", "int8_dynamic", "int4"):
        state = policy.state_format(name)
        shape = (8, 2 * state.block_size)
        assert state.leaf_bytes(shape, 4) == state.bytes_per_element(4) * math.prod(shape)
