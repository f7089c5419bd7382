"""Number formats for weights, activations and the KV cache (chapter 08).

- Floating point, rounded to nearest, ties to even, as hardware converts:
  - bf16 (8 exponent bits, 7 mantissa bits) and fp16 (5 and 10);
  - fp8 e4m3 and e5m2 (Micikevicius et al., "FP8 Formats for Deep Learning", 2022). e4m3 is the
    "fn" variant: no infinities, one NaN per sign (S.1111.111), largest 448. e5m2 is IEEE-like:
    infinities and NaNs, largest 57,344.
  - Out of range, the two fp8 formats differ, and torch's conversions do too: e4m3 saturates to
    ±448 (torch's `float8_e4m3fn` turns 1e6 and even inf into 448), while e5m2 overflows to ±inf
    from 61,440 up (the midpoint to 2^16, rounded to even). NaN stays NaN in both.
  - `encode_*` gives the 8-bit codes and `decode_*` reads them back, so a code and a value are
    one table lookup apart.
- Integers, symmetric: a value x of a group of `group` values (a whole row: per channel) is
  stored as round(x / s) in [-q_max, q_max], q_max = 2^(bits-1) - 1, with one scale
  s = max|x| / q_max per group, kept in fp16. int4 values pack two to a byte, the first in the
  low nibble (as AutoAWQ and the GPTQ kernels do, in their order of choice).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCALE_BYTES = 2  # group scales are stored in fp16
INT_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class FloatFormat:
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_value: float  # the largest finite value
    saturates: bool  # out of range: clamp to ±max_value (True) or overflow to ±inf

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)


E4M3 = FloatFormat("fp8-e4m3", 4, 3, 7, 448.0, saturates=True)
E5M2 = FloatFormat("fp8-e5m2", 5, 2, 15, 57344.0, saturates=False)
FP16 = FloatFormat("fp16", 5, 10, 15, 65504.0, saturates=False)
BF16 = FloatFormat("bf16", 8, 7, 127, (2 - 2**-7) * 2.0**127, saturates=False)  # just under fp32's max


def round_float(x, fmt: FloatFormat) -> np.ndarray:
    """x (any shape) rounded to the nearest value of `fmt`, ties to even, as float32."""
    x = np.asarray(x, np.float32)
    _, exponent = np.frexp(x)  # x = m * 2^exponent with |m| in [0.5, 1)
    # the spacing of fmt's values around x: 2^(e - 1 - mantissa_bits) for normals, fixed for subnormals
    step = np.maximum(exponent - 1, 1 - fmt.bias) - fmt.mantissa_bits
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = (np.rint(np.ldexp(x, -step)) * np.exp2(step.astype(np.float64))).astype(np.float64)
        if fmt is BF16:  # beyond fp32's range the float64 product overflows float32 like the hardware
            rounded = rounded.astype(np.float32)
        over = np.abs(rounded) > fmt.max_value
        rounded = np.where(over, np.copysign(fmt.max_value if fmt.saturates else np.inf, x), rounded)
    return np.where(np.isnan(x), x, rounded).astype(np.float32)  # a NaN keeps its sign, as torch's does


def round_bf16(x) -> np.ndarray:
    return round_float(x, BF16)


def round_fp16(x) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond 65,504 fp16 overflows to inf, as the hardware does
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)  # to nearest, ties to even


def round_e4m3(x) -> np.ndarray:
    return round_float(x, E4M3)


def round_e5m2(x) -> np.ndarray:
    return round_float(x, E5M2)


def _table(fmt: FloatFormat) -> np.ndarray:
    """(256,) float32: the value of every 8-bit code of an fp8 format."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    mantissa = (codes & ((1 << fmt.mantissa_bits) - 1)) / (1 << fmt.mantissa_bits)
    values = np.where(exponent == 0, mantissa * 2.0 ** (1 - fmt.bias),
                      (1 + mantissa) * 2.0 ** (exponent - fmt.bias)) * sign
    top = (1 << fmt.exponent_bits) - 1
    if fmt is E4M3:  # only S.1111.111 is NaN; the rest of the top exponent holds numbers
        values[(codes & 0x7F) == 0x7F] = np.nan
    else:  # IEEE: the top exponent is inf (mantissa 0) or NaN
        values[exponent == top] = np.where(mantissa[exponent == top] == 0, sign[exponent == top] * np.inf, np.nan)
    return values.astype(np.float32)


TABLES = {E4M3.name: _table(E4M3), E5M2.name: _table(E5M2)}
NAN_CODE = {E4M3.name: 0x7F, E5M2.name: 0x7F}


def decode(codes, fmt: FloatFormat) -> np.ndarray:
    """float32 values of uint8 codes in an fp8 format."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise ValueError(f"fp8 codes must be uint8; got {codes.dtype}")
    return TABLES[fmt.name][codes]


def encode(x, fmt: FloatFormat) -> np.ndarray:
    """uint8 codes of x rounded to an fp8 format (sign kept for zero and NaN; NaN to S.1111111)."""
    rounded = round_float(x, fmt)
    table = TABLES[fmt.name][:128]  # the non-negative codes, in increasing order up to the NaNs
    finite = np.isfinite(table)
    order = np.flatnonzero(finite)  # codes 0.. whose values increase
    magnitude = np.abs(rounded)
    index = np.searchsorted(table[order], np.where(np.isfinite(magnitude), magnitude, 0))
    codes = order[np.minimum(index, len(order) - 1)].astype(np.uint8)
    if not fmt.saturates:
        codes = np.where(np.isinf(magnitude), np.uint8(np.flatnonzero(np.isinf(table))[0]), codes)
    codes = np.where(np.isnan(rounded), np.uint8(NAN_CODE[fmt.name]), codes).astype(np.uint8)
    return codes | np.where(np.signbit(rounded), np.uint8(0x80), np.uint8(0)).astype(np.uint8)


# ---- integers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class IntFormat:
    bits: int
    group: int | None  # values sharing one scale; None: a whole row (per channel)

    def __post_init__(self):
        check_bits(self.bits)
        if self.group is not None and (isinstance(self.group, bool) or self.group < 1):
            raise ValueError(f"group must be >= 1 or None (per channel); got {self.group!r}")

    @property
    def q_max(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def bytes_per_value(self, row: int) -> float:
        """Bits of the value plus its share of a fp16 scale, in bytes, for rows of `row` values."""
        return self.bits / 8 + SCALE_BYTES / (self.group or row)


def check_bits(bits) -> int:
    if isinstance(bits, bool) or bits not in INT_BITS:
        raise ValueError(f"bits must be one of {INT_BITS}; got {bits!r}")
    return bits


def groups_of(x: np.ndarray, group: int | None) -> np.ndarray:
    """x (..., n) as (..., n / group, group); a group of None is the whole row."""
    n = x.shape[-1]
    group = group or n
    if isinstance(group, bool) or group < 1 or n % group:
        raise ValueError(f"the group size must be >= 1 and divide the row of {n} values; got {group}")
    return x.reshape(*x.shape[:-1], n // group, group)


def quantize_int(x, bits: int, group: int | None, clip=None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric round-to-nearest: (values (..., n) as int8 in [-q_max, q_max], fp16 scales
    (..., n / group)). A scale is rounded up to fp16, so no value needs clipping, unless `clip`
    (..., n / group), ratios in (0, 1], shrinks each group's range to clip * max |x| first (AWQ's
    clipping search): the values beyond it then clip to +-q_max."""
    q_max = 2 ** (check_bits(bits) - 1) - 1
    x = np.asarray(x, np.float32)
    grouped = groups_of(x, group)
    exact = np.abs(grouped).max(-1) / q_max  # (..., n_groups)
    if clip is not None:
        exact = (exact * np.asarray(clip, np.float32)).astype(np.float32)
    scales = exact.astype(np.float16)
    scales = np.where(scales.astype(np.float32) < exact, np.nextafter(scales, np.float16(np.inf)), scales)
    safe = np.where(scales > 0, scales, 1).astype(np.float32)[..., None]
    values = np.clip(np.rint(grouped / safe), -q_max, q_max).astype(np.int8)
    return values.reshape(x.shape), scales


def dequantize_int(values, scales, group: int | None) -> np.ndarray:
    grouped = groups_of(np.asarray(values).astype(np.float32), group)
    return (grouped * np.asarray(scales).astype(np.float32)[..., None]).reshape(np.shape(values))


def pack_int4(values) -> np.ndarray:
    """int4 values (..., n) in [-8, 7], n even, as uint8 (..., n / 2): value 2i in the low nibble
    of byte i, value 2i + 1 in the high one, each in two's complement."""
    values = np.asarray(values)
    if values.shape[-1] % 2:
        raise ValueError(f"int4 values pack two to a byte: the last dimension must be even; got {values.shape[-1]}")
    if values.size and (values.min() < -8 or values.max() > 7):
        raise ValueError(f"int4 values must be in [-8, 7]; got {values.min()}..{values.max()}")
    nibbles = (values.astype(np.int16) & 0xF).astype(np.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed, n: int) -> np.ndarray:
    """The n int4 values (..., n) as int8 that `pack_int4` stored in `packed` (..., n / 2)."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise ValueError(f"packed int4 must be uint8; got {packed.dtype}")
    if n % 2 or packed.shape[-1] != n // 2:
        raise ValueError(f"{n} int4 values need {n // 2 if n % 2 == 0 else 'an even count of'} bytes per row; "
                         f"got {packed.shape[-1]}")
    low, high = (packed & 0xF).astype(np.int8), (packed >> 4).astype(np.int8)
    out = np.empty(packed.shape[:-1] + (n,), np.int8)
    out[..., 0::2], out[..., 1::2] = low, high
    return np.where(out > 7, out - 16, out).astype(np.int8)
