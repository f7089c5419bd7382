import numpy as np
import pytest
from hypothesis import given, strategies as st

from infra_lab.grading import ch02
from infra_lab.kv import quant


@given(seed=st.integers(0, 2**32 - 1), group=st.sampled_from([4, 16, 32]), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_int_roundtrip_error_is_within_half_a_step(seed, group, scale):
    x = (np.random.default_rng(seed).standard_normal((3, 2, 64)) * scale).astype(np.float32)
    for bits in (8, 4):
        values, scales = quant.quantize_int(x, bits, group)
        back = quant.dequantize_int(values, scales, group)
        step = np.repeat(scales.astype(np.float32), group, axis=-1).reshape(x.shape)
        assert np.all(np.abs(back - x) <= 0.5 * step * (1 + 1e-3) + 1e-30)
        assert np.abs(values).max() <= 2 ** (bits - 1) - 1


def test_the_exercise_reference_agrees_with_the_package_up_to_fp16_scales():
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    step = np.abs(x.reshape(4, 2, 32)).max(-1, keepdims=True) / 127  # a value may land one step over
    gap = np.abs(ch02.int8_roundtrip(x, 32) - quant.roundtrip(x, "int8")).reshape(4, 2, 32)
    assert np.all(gap <= 1.01 * step)


def test_e4m3_rounds_to_representable_values():
    x = np.array([0.1, 1.0, 1.07, 300.0, 500.0, -2.3, 1e-4, 0.0019], np.float32)
    np.testing.assert_array_equal(quant.round_e4m3(x),
                                  np.array([0.1015625, 1.0, 1.125, 288.0, 448.0, -2.25, 0.0, 0.001953125], np.float32))


def test_bytes_per_value_count_the_scales():
    assert quant.FORMATS["int8"].bytes_per_value == 1 + 2 / 32
    assert quant.FORMATS["int4"].bytes_per_value == 0.5 + 2 / 32
    assert quant.FORMATS["fp8-e4m3"].bytes_per_value == 1


def test_bad_formats_and_groups_are_named():
    with pytest.raises(ValueError, match="unknown format 'int3'"):
        quant.roundtrip(np.zeros(4), "int3")
    with pytest.raises(ValueError, match="divide the row of 10 values; got 4"):
        quant.quantize_int(np.zeros((2, 10)), 8, 4)
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 3, 4, 8\); got 5"):
        quant.quantize_int(np.zeros((2, 8)), 5, 4)
