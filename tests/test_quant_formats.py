"""quant.formats: fp8, bf16 and fp16 rounding bit for bit against torch's conversions, the fp8
code tables, integer quantization against its definition, and int4 packing."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from infra_lab.quant import formats

torch = pytest.importorskip("torch")

FP8 = [(formats.E4M3, torch.float8_e4m3fn), (formats.E5M2, torch.float8_e5m2)]


def floats_to_test(n: int = 1_000_000, seed: int = 0) -> np.ndarray:
    """A million float32s over every scale fp8 and bf16 see, with the hard cases: zeros of both
    signs, infinities, NaN, each format's largest values and the midpoints around them,
    subnormals and the ties between them, and float32's own extremes."""
    rng = np.random.default_rng(seed)
    spread = rng.standard_normal(n - 64) * np.exp2(rng.uniform(-24, 20, n - 64))
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 448, 449, 464, 465, 479.9, 480, 57344, 61439, 61440, 65504,
               65520, 2.0 ** -9, 2.0 ** -10, 2.0 ** -10 * 1.0001, 3 * 2.0 ** -11, 2.0 ** -16, 2.0 ** -17,
               1.5 * 2.0 ** -17, 2.0 ** -6, 2.0 ** -14, 1e-45, 1e-38, 3.4e38, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -9]
    special += [-v for v in special]
    # any 32 bits: NaNs of both signs with every kind of payload among them (1 in 256 or so)
    bits = rng.integers(0, 2**32, 2**16, dtype=np.uint64).astype(np.uint32).view(np.float32)
    rest = np.concatenate([spread[:-bits.size], special, np.zeros(64 - len(special))]).astype(np.float32)
    return np.concatenate([rest, bits])  # float32 throughout: a cast would quiet the signalling NaNs


def same_bits(ours: np.ndarray, theirs: np.ndarray) -> bool:
    """Equal as float32 bit patterns, except that any NaN equals any NaN."""
    both_nan = np.isnan(ours) & np.isnan(theirs)
    return bool(((ours.view(np.uint32) == theirs.view(np.uint32)) | both_nan).all())


@pytest.mark.parametrize("fmt, dtype", FP8, ids=["e4m3", "e5m2"])
def test_the_code_table_is_torchs(fmt, dtype):
    codes = np.arange(256, dtype=np.uint8)
    theirs = torch.from_numpy(codes).view(dtype).float().numpy()
    assert same_bits(formats.decode(codes, fmt), theirs)


@pytest.mark.parametrize("fmt, dtype", FP8, ids=["e4m3", "e5m2"])
def test_every_code_encodes_back_to_itself(fmt, dtype):
    codes = np.arange(256, dtype=np.uint8)
    values = formats.decode(codes, fmt)
    numbers = ~np.isnan(values)
    assert (formats.encode(values[numbers], fmt) == codes[numbers]).all()
    assert np.isnan(formats.decode(formats.encode(values[~numbers], fmt), fmt)).all()


@pytest.mark.parametrize("fmt, dtype", FP8, ids=["e4m3", "e5m2"])
def test_rounding_a_million_floats_equals_torchs_conversion(fmt, dtype):
    x = floats_to_test()
    theirs = torch.from_numpy(x).to(dtype)
    assert same_bits(formats.round_float(x, fmt), theirs.float().numpy())
    codes, their_codes = formats.encode(x, fmt), theirs.view(torch.uint8).numpy()
    assert (codes == their_codes).all()
    nan = np.isnan(x)  # NaNs of both signs, and with other payloads, compared too
    assert np.signbit(x[nan]).sum() > 50 and (~np.signbit(x[nan])).sum() > 50


@pytest.mark.parametrize("fmt, dtype", FP8, ids=["e4m3", "e5m2"])
def test_a_nan_keeps_its_sign_in_its_code(fmt, dtype):
    nans = np.array([np.nan, -np.nan], np.float32)
    assert np.signbit(formats.round_float(nans, fmt)).tolist() == [False, True]
    assert formats.encode(nans, fmt).tolist() == torch.from_numpy(nans).to(dtype).view(torch.uint8).tolist() == [0x7F, 0xFF]


def test_the_two_fp8_formats_differ_out_of_range_as_torch_does():
    """e4m3 saturates to ±448 (even inf); e5m2 overflows to ±inf from 61,440 (the midpoint to
    2^16, a tie rounded to even) up; NaN stays NaN."""
    x = np.array([449, 1e6, np.inf, -np.inf, 61439, 61440, np.nan], np.float32)
    assert formats.round_e4m3(x)[:4].tolist() == [448, 448, 448, -448]
    assert formats.round_e5m2(x)[:6].tolist() == [448, np.inf, np.inf, -np.inf, 57344, np.inf]
    assert np.isnan(formats.round_e4m3(x)[-1]) and np.isnan(formats.round_e5m2(x)[-1])


@pytest.mark.parametrize("ours, dtype", [(formats.round_bf16, torch.bfloat16), (formats.round_fp16, torch.float16)],
                         ids=["bf16", "fp16"])
def test_bf16_and_fp16_round_as_torch(ours, dtype):
    x = floats_to_test(200_000, seed=1)
    assert same_bits(ours(x), torch.from_numpy(x).to(dtype).float().numpy())


def test_fp8_smallest_values():
    assert formats.E4M3.min_subnormal == 2.0 ** -9 and formats.E4M3.min_normal == 2.0 ** -6
    assert formats.E5M2.min_subnormal == 2.0 ** -16 and formats.E5M2.min_normal == 2.0 ** -14
    assert formats.round_e4m3(np.float32(2.0 ** -10)) == 0  # a tie between 0 and 2^-9: to even
    assert formats.round_e4m3(np.float32(3 * 2.0 ** -10)) == 2.0 ** -8  # a tie between 1 and 2 steps


def test_decode_wants_uint8_codes():
    with pytest.raises(ValueError, match="fp8 codes must be uint8; got int64"):
        formats.decode(np.arange(3), formats.E4M3)


# ---- integers --------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**32 - 1), bits=st.sampled_from(formats.INT_BITS),
       group=st.sampled_from([None, 1, 4, 8, 32]), rows=st.integers(1, 4))
def test_integer_quantization_is_round_to_nearest_on_its_scale(seed, bits, group, rows):
    x = (np.random.default_rng(seed).standard_normal((rows, 64)) * 3).astype(np.float32)
    values, scales = formats.quantize_int(x, bits, group)
    q_max = 2 ** (bits - 1) - 1
    n_groups = 64 // (group or 64)
    assert values.dtype == np.int8 and np.abs(values).max() <= q_max
    assert scales.dtype == np.float16 and scales.shape == (rows, n_groups)
    grouped = x.reshape(rows, n_groups, -1)
    assert (scales.astype(np.float32) * q_max >= np.abs(grouped).max(-1)).all()  # no value is clipped
    back = formats.dequantize_int(values, scales, group)
    step = np.repeat(scales.astype(np.float32), 64 // n_groups, axis=1)
    assert (np.abs(back - x) <= step / 2 * (1 + 1e-6)).all()  # each value within half a step


@given(values=st.lists(st.integers(-8, 7), min_size=0, max_size=40).filter(lambda v: len(v) % 2 == 0))
def test_int4_packing_round_trips_two_to_a_byte(values):
    array = np.array(values, np.int8).reshape(1, -1)
    packed = formats.pack_int4(array)
    assert packed.dtype == np.uint8 and packed.shape == (1, len(values) // 2)
    assert (formats.unpack_int4(packed, len(values)) == array).all()
    if values:
        assert packed[0, 0] & 0xF == values[0] & 0xF and packed[0, 0] >> 4 == values[1] & 0xF


def test_bytes_per_value_count_the_scales():
    assert formats.IntFormat(4, 128).bytes_per_value(4096) == 0.5 + 2 / 128
    assert formats.IntFormat(8, None).bytes_per_value(4096) == 1 + 2 / 4096


@pytest.mark.parametrize("call, message", [
    (lambda: formats.quantize_int(np.zeros((2, 10)), 4, 4), "divide the row of 10 values; got 4"),
    (lambda: formats.quantize_int(np.zeros((2, 8)), 5, 4), r"bits must be one of \(2, 3, 4, 8\); got 5"),
    (lambda: formats.quantize_int(np.zeros((2, 8)), True, 4), r"bits must be one of .*; got True"),
    (lambda: formats.IntFormat(4, 0), "group must be >= 1 or None"),
    (lambda: formats.pack_int4(np.zeros((2, 3), np.int8)), "the last dimension must be even; got 3"),
    (lambda: formats.pack_int4(np.array([[8, 0]])), r"int4 values must be in \[-8, 7\]; got 0..8"),
    (lambda: formats.unpack_int4(np.zeros((2, 3), np.uint8), 8), "8 int4 values need 4 bytes per row; got 3"),
    (lambda: formats.unpack_int4(np.zeros((2, 4), np.int8), 8), "packed int4 must be uint8; got int8"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
