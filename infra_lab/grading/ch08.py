"""Checks for chapter 08's exercises: int4 group quantization with packing, fp8 e4m3 rounding,
one GPTQ column update, a GEMV that reads the int4 matrix layout, and a quantizer of the
reader's own that serves the real model.

The references call the package: `quant.formats` (quantize_int, pack_int4, unpack_int4,
round_e4m3), `quant.gptq.column_update`, `quant.matmul.matmul_numpy`, and round-to-nearest,
`QuantizedMatrix.quantize`, as the bar a quantizer must reach. Each drive compares what the
reader's function gives with the package's answer itself, so that a failure line can name the
value that differs and its likely cause (the nibble order, a scale rounded down, no saturation,
an error not divided by U_cc, the +8 offset). The last check quantizes random matrices, then the
shipped target model at 4 bits with groups of 32, serves it through the engine and scores it on
validation text against round-to-nearest.
"""
from __future__ import annotations

import functools
import zlib

import numpy as np
from threadpoolctl import threadpool_limits

from infra_lab.grading.ch05 import serving_backend
from infra_lab.grading.ch07 import Schedule
from infra_lab.grading.checks import Check, register
from infra_lab.quant import formats, gptq
from infra_lab.quant.matmul import QuantizedMatrix, matmul_numpy

Q_MAX = 7  # symmetric int4: values in [-7, 7]
GEMV_TOLERANCE = 1e-4  # rtol and atol of the GEMV against the package's (float32 sums in any order)
COLUMN_TOLERANCE = 1e-5  # rtol of the column update (atol 1e-6): float32 against float64 arithmetic
ERROR_RATIO = 1.1  # a quantizer's output error on its calibration inputs, at most this times RTN's
TARGET_BITS, TARGET_GROUP = 4, 32  # the format the target model is quantized to
ONE_THREAD = {"limits": 1, "user_api": "blas"}  # quantizers run on one BLAS thread: their matrices are
# small, and on a busy 2-core machine two threads mostly wait for each other (6x slower here)
CALIBRATION_WINDOWS, CALIBRATION_ROWS = 4, 512  # training windows run for calibration, token rows kept
BPB_WINDOWS = 8  # the first validation windows of 512 bytes the quantized model is scored on
BPB_TOLERANCE = 0.02  # bits per byte a quantizer may lose to round-to-nearest at the same format


class WrongCodes(AssertionError):
    """Scales, packed bytes or unpacked values that differ from the package's."""


class WrongRounding(AssertionError):
    """A value rounded to fp8 e4m3 differently from the package."""


class WrongUpdate(AssertionError):
    """A GPTQ column update that differs from the package's."""


class WrongProduct(AssertionError):
    """A GEMV whose outputs differ from the package's."""


class WrongQuantizer(AssertionError):
    """A quantizer that returns another format, loses more than round-to-nearest, or cannot be served."""


def _floats(value, what: str, shape: tuple) -> np.ndarray:
    """`value`, an array of floats of `shape`, as float64; a TypeError that says what came instead."""
    if not (isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.shape == shape):
        got = (f"an array of {value.dtype}, shape {value.shape}" if isinstance(value, np.ndarray)
               else type(value).__name__)
        raise TypeError(f"{what} must be a numpy array of floats, shape {shape}; got {got}")
    return value.astype(np.float64)


def _first(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(bad)[0])


def _array(value, what: str, dtype, shape: tuple) -> np.ndarray:
    """`value` as an array of `dtype` and `shape`, or a TypeError that says what came instead."""
    array = np.asarray(value) if isinstance(value, np.ndarray) else None
    if array is None or array.dtype != dtype or array.shape != shape:
        got = (f"{type(value).__name__}" if array is None else
               f"an array of {array.dtype}, shape {array.shape}")
        raise TypeError(f"{what} must be a numpy array of {np.dtype(dtype)}, shape {shape}; got {got}")
    return array


# ---- exercise 1: int4 with group scales, packed two to a byte --------------------------------------

def quantize_int4(row, group):
    """Reference: (packed uint8 (n / 2,), scales fp16 (n / group,)) of a float32 row: symmetric
    int4 (q_max 7), one scale max |x| / 7 per group rounded up to fp16, value 2i in byte i's low nibble."""
    values, scales = formats.quantize_int(row, 4, group)
    return formats.pack_int4(values), scales


def unpack_int4(packed, n):
    """Reference: the n int8 values that `packed` (n / 2,) holds, two's complement nibbles."""
    return formats.unpack_int4(packed, n)


def _partner(function, name: str):
    """The function called `name` defined beside `function` (in its notebook or module)."""
    found = getattr(function, "__globals__", {}).get(name)
    if not callable(found):
        raise NameError(f"define {name} beside {getattr(function, '__name__', 'your function')}: the check calls "
                        f"it on the bytes it packs and on random bytes")
    return found


def _scale_hint(biggest: float, got: float, expected: float) -> str:
    if expected == 0:
        return "an all-zero group gets the scale 0 and the values 0: do not divide by it"
    nearest = float(np.float16(np.float32(biggest) / Q_MAX))
    if 0 < got == nearest < expected:
        return (f"max |x| / 7 rounds down to {got:.6g} in fp16, where the largest value would need "
                f"{biggest / got:.6g} > 7: round the scale up to the next fp16 (np.nextafter) when fp16 "
                f"rounding lowered it")
    if any(abs(got - biggest / q) <= 1e-3 * abs(got) for q in (8, 15, 16)):
        return "q_max is 7: symmetric int4 uses [-7, 7], so the scale is max |x| / 7"
    return "a group's scale is max |x| / 7 over its values, as fp16, rounded up"


def _compare_scales(row, group, got, expected) -> None:
    bad = got != expected
    if bad.any():
        (g,) = _first(bad)
        part = row[g * group:(g + 1) * group]
        biggest = float(np.abs(part).max())
        raise WrongCodes(f"the scale of group {g} (row[{g * group}:{(g + 1) * group}], max |x| = {biggest:.6g}) is "
                         f"{float(got[g]):.6g}, expected {float(expected[g]):.6g}: "
                         f"{_scale_hint(biggest, float(got[g]), float(expected[g]))}")


def _value_hint(x: float, scale: float, got: int) -> str:
    exact = np.float32(x) / np.float32(scale) if scale else 0.0
    if scale and exact - np.floor(exact) == 0.5:
        return f"x / scale = {float(exact):.6g} is a tie: np.rint rounds ties to even (2.5 to 2, -0.5 to -0)"
    if abs(got) > Q_MAX:
        return "clip the values to [-7, 7]"
    return "a value is round(x / scale) with its group's scale"


def _compare_packed(row, group, scales, values, got, expected) -> None:
    bad = got != expected
    if not bad.any():
        return
    (i,) = _first(bad)
    b, e = int(got[i]), int(expected[i])
    low, high = int(values[2 * i]), int(values[2 * i + 1])
    where = (f"byte {i} is 0x{b:02x}, expected 0x{e:02x}, which holds value {2 * i} = {low} in its low nibble and "
             f"value {2 * i + 1} = {high} in its high one")
    if b == ((e & 0xF) << 4 | e >> 4):
        hint = "the first value of a pair goes in the low nibble: byte i = (v[2i] & 0xF) | (v[2i + 1] & 0xF) << 4"
    elif b == ((low + 8) | (high + 8) << 4):
        hint = ("store each value in two's complement, v & 0xF (-1 is 0xF), not v + 8 (that is the matrix "
                "kernel's layout, exercise 4)")
    else:
        got_values = formats.unpack_int4(got[i:i + 1], 2)
        k = 2 * i if got_values[0] != low else 2 * i + 1
        scale = float(scales[k // group])
        hint = (f"row[{k}] = {float(row[k]):.6g} with scale {scale:.6g} became {int(got_values[k - 2 * i])}: "
                f"{_value_hint(float(row[k]), scale, int(got_values[k - 2 * i]))}")
    raise WrongCodes(f"{where}: {hint}")


def _compare_unpacked(source, got, n: int, what: str) -> None:
    got = _array(got, f"unpack_int4's answer for {what}", np.int8, (n,))
    expected = formats.unpack_int4(source, n)
    bad = got != expected
    if not bad.any():
        return
    (k,) = _first(bad)
    byte = int(source[k // 2])
    nibble = "low" if k % 2 == 0 else "high"
    if int(got[k]) == int(expected[k]) + 16:
        hint = "a nibble of 8 or more is negative in two's complement: subtract 16"
    elif k % 2 == 0 and int(got[k]) == int(formats.unpack_int4(source[k // 2:k // 2 + 1], 2)[1]) or \
            k % 2 == 1 and int(got[k]) == int(formats.unpack_int4(source[k // 2:k // 2 + 1], 2)[0]):
        hint = "value 2i is byte i's low nibble (byte & 0xF), value 2i + 1 its high one (byte >> 4)"
    else:
        hint = "a value is its nibble, minus 16 when the nibble is 8 or more"
    raise WrongCodes(f"unpack_int4 of {what} gave value {k} = {int(got[k])}, expected {int(expected[k])}: it is the "
                     f"{nibble} nibble of byte {k // 2} = 0x{byte:02x}; {hint}")


def drive_int4(function, row, group):
    """Quantize and pack `row` with `function`, then unpack what the package packed and random
    bytes with the unpack_int4 defined beside it; WrongCodes at the first difference."""
    n = len(row)
    unpack = _partner(function, "unpack_int4")
    answer = function(row.copy(), group)
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise TypeError(f"quantize_int4 must return a pair (packed, scales); got {type(answer).__name__}")
    packed = _array(answer[0], "packed", np.uint8, (n // 2,))
    scales = _array(answer[1], "scales", np.float16, (n // group,))
    values, expected_scales = formats.quantize_int(row, 4, group)
    expected_packed = formats.pack_int4(values)
    _compare_scales(row, group, scales, expected_scales)
    _compare_packed(row, group, scales, values, packed, expected_packed)
    noise = np.random.default_rng(zlib.crc32(row.tobytes())).integers(0, 256, n // 2, dtype=np.uint8)
    for what, source in (("the packed row", expected_packed), ("random bytes", noise)):
        _compare_unpacked(source, unpack(source.copy(), n), n, what)
    return (("scales", "max |x| / 7 per group, rounded up to fp16"), ("packed", "value 2i in byte i's low nibble"),
            ("unpacked", "the package's values, -8 included"))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _int4_case(kind, rng):
    n = int(rng.choice([2, 8, 16, 32, 48, 64, 96, 128, 256]))
    group = {"whole row": n}.get(kind) or int(rng.choice(_divisors(n)))
    sigma = 10.0 ** rng.uniform(-5, -4) if kind == "tiny" else 10.0 ** rng.uniform(-2, 2)
    row = rng.normal(0, sigma, n).astype(np.float32)
    if kind == "outlier":
        row[rng.integers(n)] *= 50
    if kind == "zero group":
        g = int(rng.integers(n // group))
        row[g * group:(g + 1) * group] = 0
    if kind == "ties":  # each group's max is 7 s exactly, s an fp16 value: every x / s is exact
        for g in range(n // group):
            s = np.float32(np.float16(10.0 ** rng.uniform(-2, 1)))
            halves = rng.integers(-13, 14, group) / 2  # k + 1/2 and whole numbers in [-6.5, 6.5]
            halves[int(rng.integers(group))] = rng.choice([-7, 7])
            row[g * group:(g + 1) * group] = (halves * s).astype(np.float32)
    return row, group


_INT4_KINDS = ["random", "ties", "zero group", "random", "outlier", "ties", "whole row", "tiny"] * 3


# ---- exercise 2: fp8 e4m3 ------------------------------------------------------------------------

def round_e4m3(x):
    """Reference: x rounded to fp8 e4m3 (ties to even, saturating at ±448, NaN kept), as float32."""
    return formats.round_e4m3(x)


def _rounding_hint(x: float, got: float, expected: float) -> str:
    if np.isnan(x):
        return "NaN stays NaN"
    if abs(x) > formats.E4M3.max_value:
        return "e4m3 has no infinity: anything beyond 448, inf included, saturates to ±448"
    if expected == 0 and got == 0:
        return "zero keeps its sign: -0.0 (and a negative value that rounds to 0) gives -0.0"
    _, exponent = np.frexp(np.float32(x))
    step = max(int(exponent) - 1, 1 - formats.E4M3.bias) - formats.E4M3.mantissa_bits  # spacing 2^step
    if abs(np.ldexp(abs(x), -step) % 1 - 0.5) == 0:
        return "a tie rounds to the neighbour whose last mantissa bit is 0 (to even)"
    if abs(x) < formats.E4M3.min_normal:
        return "below 2^-6 the values are subnormal: evenly spaced by 2^-9, down to 0"
    return "3 mantissa bits: between 2^e and 2^(e+1) the values are 2^(e-3) apart"


def drive_e4m3(function, x):
    """Round x with `function`; WrongRounding at the first value that differs from the package's
    (NaN for NaN, and the sign of a zero counts)."""
    got = _array(function(x.copy()), "round_e4m3's answer", np.float32, x.shape)
    expected = formats.round_e4m3(x)
    same = ((got == expected) & (np.signbit(got) == np.signbit(expected))) | (np.isnan(got) & np.isnan(expected))
    if not same.all():
        (i,) = _first(~same)
        raise WrongRounding(f"x[{i}] = {float(x[i])!r} became {float(got[i])!r}, expected {float(expected[i])!r}: "
                            f"{_rounding_hint(float(x[i]), float(got[i]), float(expected[i]))}")
    return "values", f"{x.size} as fp8 e4m3"


_E4M3_FINITE = np.unique(np.abs(formats.TABLES[formats.E4M3.name][np.isfinite(formats.TABLES[formats.E4M3.name])]))
_SPECIALS = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 448, -448, 449, 464, -464, 480, 1e30, -1e30,
             np.finfo(np.float32).max, 2.0 ** -9, -2.0 ** -9, 2.0 ** -10, -2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -6,
             1e-45, -1e-45, 1.0, 1.0625, 1.1875, -1.1875, 0.5, 240, 232, 248]


def _e4m3_case(kind, rng):
    n = 256
    sign = rng.choice([-1.0, 1.0], n)
    if kind == "ties":  # midpoints of neighbouring e4m3 values, and the one above 448
        mids = (_E4M3_FINITE[:-1] + _E4M3_FINITE[1:]) / 2
        x = sign * rng.choice(np.append(mids, 464.0), n)
    elif kind == "past the range":
        big, small = 10.0 ** rng.uniform(np.log10(448), 38, n), 10.0 ** rng.uniform(-40, np.log10(2.0 ** -10), n)
        x = sign * np.where(rng.random(n) < 0.5, big, small)
    else:  # every binade from below the subnormals to past the largest value
        x = sign * np.ldexp(rng.uniform(1, 2, n), rng.integers(-13, 11, n))
    if kind == "specials":
        x[:len(_SPECIALS)] = _SPECIALS
    return (rng.permutation(x).astype(np.float32),)


_E4M3_KINDS = ["every binade", "ties", "specials", "past the range"] * 6


# ---- exercise 3: one GPTQ column update ------------------------------------------------------------

def column_update(weights_t, h_inv_chol, column, scales, group, bits):
    """Reference: the package's step, (weights_t, values, error)."""
    return gptq.column_update(weights_t, h_inv_chol, column, scales, group, bits)


def column_arguments(kind, n_out, n_in, column, group, bits, seed):
    """The arrays of a column-update case: weights_t (n_out, n_in) float32 as updated so far,
    U (n_in, n_in) float64 from calibration inputs, and fp16 scales (n_out, n_in / group)."""
    rng = np.random.default_rng(seed)
    inputs = rng.normal(0, 1, (n_in + int(rng.integers(0, 2 * n_in)), n_in)) * rng.uniform(0.2, 3, n_in)
    u = gptq.inverse_cholesky(gptq.hessian(inputs)[0])  # (n_in, n_in)
    weights_t = rng.normal(0, 0.1, (n_out, n_in)).astype(np.float32)
    size = group or n_in
    scales = np.stack([gptq.group_scales(weights_t[:, g:g + size], bits) for g in range(0, n_in, size)], axis=1)
    if kind == "clipped":  # the updates since the group's scales were set pushed weights past q_max * scale
        scales = (scales.astype(np.float32) * 0.6).astype(np.float16)
    if kind == "zero scale":  # a group that was all zero when the loop entered it, and is not any more
        scales[int(rng.integers(n_out)), column // size] = 0
    return weights_t, u, column, scales, group, bits


def _update_hint(label, got, expected, args) -> str:
    weights_t, u, column, scales, group, bits = args
    c = column
    if label == "values":
        scale = float(scales[np.argmax(got != expected), c // (group or weights_t.shape[1])])
        q_max = 2 ** (bits - 1) - 1
        if scale == 0:
            return "a scale of 0 gives the value 0 (and q = 0), not a division by zero"
        if np.abs(got).max() > q_max:
            return (f"clip to [-{q_max}, {q_max}]: the scales were set when the loop entered the group, and "
                    f"the updates since can push a weight past q_max * scale")
        return "value = round(w / s) with s = scales[:, column // group] (group None: one scale per row)"
    if label == "error":
        if np.allclose(got, expected * u[c, c], rtol=1e-4, atol=1e-7):
            return "divide by U[c, c]: e = (w - q) / U_cc"
        if np.allclose(got, -expected, rtol=1e-4, atol=1e-7):
            return "e = (w - q) / U_cc, not (q - w) / U_cc"
        return "e = (w - q) / U_cc, with q = value * scale"
    _, cols = np.nonzero(~np.isclose(got, expected, rtol=COLUMN_TOLERANCE, atol=1e-6))
    j = int(cols[0])
    if j < c:
        return f"only the columns after {c} change; column {j} is before it"
    if j == c:
        return f"column {c} itself must hold q = value * scale afterwards"
    return "subtract e[o] * U[c, j] from every later column j > c (e already divided by U_cc)"


def drive_column(function, kind, n_out, n_in, column, group, bits, seed):
    """One column update of the case's arrays with `function`; WrongUpdate at the first of
    values, error and weights_t that differs from the package's."""
    args = column_arguments(kind, n_out, n_in, column, group, bits, seed)
    answer = function(*(np.copy(a) if isinstance(a, np.ndarray) else a for a in args))
    if not (isinstance(answer, (tuple, list)) and len(answer) == 3):
        raise TypeError(f"column_update must return (weights_t, values, error); got {type(answer).__name__}")
    step = gptq.column_update(*args)
    for index, label in ((1, "values"), (2, "error"), (0, "weights_t")):  # a cause before what follows from it
        got, expected = answer[index], step[index]
        got = np.asarray(got, np.float64)
        if got.shape != expected.shape:
            raise TypeError(f"{label} must have shape {expected.shape}; got {got.shape}")
        if not np.allclose(got, expected, rtol=COLUMN_TOLERANCE, atol=1e-6):
            gap = np.abs(got - expected)
            at = tuple(int(i) for i in np.unravel_index(int(np.argmax(gap)), gap.shape))
            raise WrongUpdate(f"{label}{list(at)} is {float(got[at]):.6g}, expected {float(expected[at]):.6g} "
                              f"(U[{column}, {column}] = {float(args[1][column, column]):.4g}): "
                              f"{_update_hint(label, got, expected, args)}")
    return ("values", "rounded with the group's scale"), ("error", "divided by U_cc"), ("weights_t", "corrected")


def _column_case(kind, rng):
    n_in = int(rng.choice([8, 16, 32, 64]))
    group = None if kind == "per channel" else int(rng.choice([g for g in _divisors(n_in) if 2 <= g < n_in] or [n_in]))
    size = group or n_in
    fixed = {"first column": 0, "last column": n_in - 1, "last of a group": size * int(rng.integers(n_in // size))
             + size - 1}
    column = fixed.get(kind, int(rng.integers(n_in)))
    bits = int(rng.choice([3, 8])) if kind == "3 or 8 bits" else 4
    return kind, int(rng.integers(1, 13)), n_in, column, group, bits, int(rng.integers(2**31))


_COLUMN_KINDS = ["random", "first column", "clipped", "last column", "zero scale", "last of a group", "per channel",
                 "3 or 8 bits"] * 3


# ---- exercise 4: a GEMV that reads the int4 matrix layout --------------------------------------------

def gemv_int4(x, codes, scales, group):
    """Reference: x (batch, n_in) @ W, W read from QuantizedMatrix's int4 codes and scales."""
    return matmul_numpy(x, QuantizedMatrix.from_codes(codes, scales, 4, group))


def gemv_arguments(kind, batch, n_in, n_out, group, seed):
    """x (batch, n_in) float32, and codes uint8 (n_out, n_in / 2) and scales fp16 (n_out, n_in / group)
    of a QuantizedMatrix: W quantized, or random bytes (every nibble, -8 too)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (batch, n_in)).astype(np.float32)
    weights = rng.normal(0, 0.1, (n_in, n_out)).astype(np.float32)
    if kind == "zero groups":
        weights[:group, ::2] = 0  # every other output's first group: scale 0
    matrix = QuantizedMatrix.quantize(weights, 4, group)
    codes, scales = matrix.codes, matrix.scales
    if kind == "random bytes":
        codes = rng.integers(0, 256, codes.shape, dtype=np.uint8)
    return x, codes, scales, group


def _gemv_hint(x, codes, scales, group, got) -> str:
    n_out = codes.shape[0]
    nibbles = np.stack([codes & 15, codes >> 4], axis=1).astype(np.float32)  # (n_out, 2, n_in / 2)
    halves = nibbles.reshape(n_out, 2, -1, group // 2).transpose(0, 2, 1, 3).reshape(n_out, -1)  # the layout
    neighbours = np.stack([codes & 15, codes >> 4], axis=-1).reshape(n_out, -1).astype(np.float32)
    per_group = np.repeat(scales.astype(np.float32), group, axis=1)
    guesses = [(halves * per_group, "each nibble holds v + 8: subtract 8 from it (or 8 times x's group "
                                  "sum from the group's dot product)"),
               ((neighbours - 8) * per_group, "in a group of g, byte j holds value j (low nibble) and value j + g/2 "
                                              "(high nibble), not two neighbours"),
               ((halves - 8), "multiply each group's dot product by its scale, scales[o, g]")]
    for weights_t, hint in guesses:
        if np.allclose(got, x @ weights_t.T, rtol=GEMV_TOLERANCE, atol=GEMV_TOLERANCE):
            return hint
    return "y[b, o] = sum over groups g of scales[o, g] * sum over the group's inputs i of x[b, i] * (nibble - 8)"


def drive_gemv(function, kind, batch, n_in, n_out, group, seed):
    """y of the case's x and matrix with `function`; WrongProduct where it differs most from the
    package's matmul_numpy, beyond GEMV_TOLERANCE."""
    x, codes, scales, group = gemv_arguments(kind, batch, n_in, n_out, group, seed)
    got = _floats(function(x.copy(), codes.copy(), scales.copy(), group), "gemv_int4's answer", (batch, n_out))
    expected = gemv_int4(x, codes, scales, group)
    if not np.allclose(got, expected, rtol=GEMV_TOLERANCE, atol=GEMV_TOLERANCE):
        gap = np.abs(got - expected)
        b, o = (int(i) for i in np.unravel_index(int(np.argmax(gap)), gap.shape))
        raise WrongProduct(f"y[{b}, {o}] = {float(got[b, o]):.6g}, expected {float(expected[b, o]):.6g}: "
                           f"{_gemv_hint(x, codes, scales, group, got)}")
    return "y", f"({batch}, {n_out}) within {GEMV_TOLERANCE:g}"


def _gemv_case(kind, rng):
    group = int(rng.choice([2, 8, 16, 32, 64, 128]))
    n_in = group * int(rng.integers(1, 5)) if kind != "one group" else group
    return kind, int(rng.integers(1, 5)), n_in, int(rng.integers(1, 40)), group, int(rng.integers(2**31))


_GEMV_KINDS = ["quantized W", "random bytes", "zero groups", "quantized W", "one group", "random bytes"] * 4


# ---- exercise 5: a quantizer that serves the real model ---------------------------------------------

def my_quantizer(weights, inputs, bits, group):
    """Reference: round-to-nearest, the bar: W (n_in, n_out) as a QuantizedMatrix of `bits` with a
    scale per `group` inputs of each output (the calibration inputs go unused)."""
    return QuantizedMatrix.quantize(weights, bits, group)


def quantizer_arguments(kind, n_in, n_out, n_samples, seed):
    """W (n_in, n_out) float32 and calibration inputs X (n_samples, n_in) float32 like a layer's:
    correlated channels of very different sizes, a few of them outliers."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(0, 1, (n_in, n_in)) * 0.9 ** np.arange(n_in)[:, None]  # a decaying spectrum
    inputs = rng.normal(0, 1, (n_samples, n_in)) @ mixing * rng.lognormal(0, 0.5, n_in)
    if kind == "outlier channels":
        inputs[:, rng.choice(n_in, 3, replace=False)] *= 20
    if kind == "dead input":  # an input no calibration row uses
        inputs[:, int(rng.integers(n_in))] = 0
    weights = rng.normal(0, n_in ** -0.5, (n_in, n_out))
    return weights.astype(np.float32), inputs.astype(np.float32)


def _check_matrix(matrix, n_in: int, n_out: int, bits: int, group: int) -> QuantizedMatrix:
    if not isinstance(matrix, QuantizedMatrix):
        raise WrongQuantizer(f"my_quantizer must return a QuantizedMatrix (QuantizedMatrix.from_values(values, "
                             f"scales, bits, group)); got {type(matrix).__name__}")
    got = {"shape (n_in, n_out)": (matrix.n_in, matrix.n_out), "bits": matrix.bits, "group": matrix.group}
    asked = {"shape (n_in, n_out)": (n_in, n_out), "bits": bits, "group": group}
    for what in got:
        if got[what] != asked[what]:
            raise WrongQuantizer(f"the matrix has {what} {got[what]}; the check asked for {asked[what]}")
    return matrix


def _output_error(inputs, weights, matrix: QuantizedMatrix) -> float:
    """||X W - X Q|| / ||X W||: how far the layer's outputs on X move."""
    exact = inputs.astype(np.float64) @ weights
    return float(np.linalg.norm(exact - inputs.astype(np.float64) @ matrix.dequantize()) / np.linalg.norm(exact))


def _coarse_hint(matrix: QuantizedMatrix, bits: int) -> str:
    values, q_max = matrix.values(), 2 ** (bits - 1) - 1
    scales = matrix.scales.astype(np.float32)
    if np.all((scales == 1) | (scales == 0)):
        return "the scales are all 1: store each group's scale, max |w| / q_max"
    if np.abs(values).max() < q_max:
        return (f"the values use only [-{np.abs(values).max()}, {np.abs(values).max()}] of [-{q_max}, {q_max}]: "
                f"is q_max 2^(bits - 1) - 1?")
    return "is each weight rounded with its own group's scale, and does GPTQ subtract e * U[c, c+1:]?"


def _drive_matrix(function, kind, n_in, n_out, n_samples, bits, group, seed):
    weights, inputs = quantizer_arguments(kind, n_in, n_out, n_samples, seed)
    with threadpool_limits(**ONE_THREAD):
        answer = function(weights.copy(), inputs.copy(), bits, group)
    matrix = _check_matrix(answer, n_in, n_out, bits, group)
    ours = _output_error(inputs, weights, matrix)
    rtn = _output_error(inputs, weights, QuantizedMatrix.quantize(weights, bits, group))
    if not ours <= ERROR_RATIO * rtn:
        raise WrongQuantizer(f"its output error on the calibration inputs, ||X W - X Q|| / ||X W||, is {ours:.4g}; "
                             f"round-to-nearest's is {rtn:.4g} at {bits} bits with groups of {group}, and more than "
                             f"{ERROR_RATIO}x that fails: {_coarse_hint(matrix, bits)}")
    return ("matrix", f"{bits} bits, groups of {group}"), ("output error", f"at most {ERROR_RATIO}x round-to-nearest's")


@functools.cache
def _target():
    from infra_lab import model

    return model.load("target")


@functools.cache
def _splits() -> tuple[np.ndarray, np.ndarray]:
    from infra_lab.model import corpus

    return corpus.load()  # (train, validation)


@functools.cache
def calibration() -> dict[str, np.ndarray]:
    """What meets each layer matrix of the target on CALIBRATION_ROWS tokens of the training split."""
    from infra_lab.model.quantized import calibration_inputs

    return calibration_inputs(_target(), windows=CALIBRATION_WINDOWS, rows=CALIBRATION_ROWS, train_bytes=_splits()[0])


def quantize_target(quantizer):
    """The target model with every layer matrix quantized by `quantizer(W, X, 4, 32)` through the
    package's quantize_model, X the matrix's calibration inputs; WrongQuantizer names the matrix
    where it failed."""
    from infra_lab.model.quantized import quantize_model

    def checked(weights, inputs, bits, group):
        n_in, n_out = weights.shape
        try:
            with threadpool_limits(**ONE_THREAD):
                answer = quantizer(weights, inputs, bits, group)
            return _check_matrix(answer, n_in, n_out, bits, group)
        except Exception as error:  # quantize_model puts the matrix's name before a ValueError's text
            kind = "" if isinstance(error, WrongQuantizer) else f"{type(error).__name__}: "
            raise ValueError(f"({n_in}, {n_out}): {kind}{error}") from error

    checked.__name__ = getattr(quantizer, "__name__", "my_quantizer")
    try:
        return quantize_model(_target(), checked, TARGET_BITS, TARGET_GROUP, calibration())
    except ValueError as error:
        raise WrongQuantizer(f"quantizing the target's {error}") from error


_QUANTIZED: dict = {}  # quantizer -> the target it quantized (or the error it raised), for one run's model cases


def _quantized(quantizer, fresh: bool):
    if fresh or quantizer not in _QUANTIZED:
        _QUANTIZED.pop(quantizer, None)
        while len(_QUANTIZED) >= 4:
            _QUANTIZED.pop(next(iter(_QUANTIZED)))
        try:
            _QUANTIZED[quantizer] = quantize_target(quantizer)
        except Exception as error:  # kept, so each model case reports it without quantizing again
            _QUANTIZED[quantizer] = error
    found = _QUANTIZED[quantizer]
    if isinstance(found, Exception):
        raise found
    return found


def bits_per_byte(model) -> float:
    """Bits per byte of `model` on the first BPB_WINDOWS windows of the validation split."""
    from infra_lab.model import quantized

    return quantized.bits_per_byte(model, _splits()[1], max_windows=BPB_WINDOWS)


@functools.cache
def _rtn_bits_per_byte() -> float:
    return bits_per_byte(quantize_target(my_quantizer))


def _drive_model(function, kind, prompts, max_tokens):
    from infra_lab.model.generate import generate
    from infra_lab.serving.config import EngineConfig
    from infra_lab.serving.engine import Engine
    from infra_lab.serving.request import SamplingParams

    model = _quantized(function, fresh=kind == "model: quantize and serve")
    if kind == "model: bits per byte":
        ours, bar = bits_per_byte(model), _rtn_bits_per_byte()
        if not ours <= bar + BPB_TOLERANCE:
            plain = bits_per_byte(_target())
            raise WrongQuantizer(f"the target quantized by my_quantizer ({TARGET_BITS} bits, groups of {TARGET_GROUP}) "
                                 f"scores {ours:.4f} bits per byte on the first {BPB_WINDOWS} validation windows; "
                                 f"round-to-nearest {bar:.4f}, the float model {plain:.4f}: more than "
                                 f"{BPB_TOLERANCE} above round-to-nearest")
        return "bits per byte", f"within {BPB_TOLERANCE} of round-to-nearest's"
    backend = serving_backend()
    config = EngineConfig(policy="chunked", max_batch=4, token_budget=64, num_blocks=32, block_size=8)
    served = Engine(model, config, backend).generate([p.encode() for p in prompts],
                                                     [SamplingParams(max_tokens=m) for m in max_tokens])
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        alone = generate(model, prompt, m, temperature=0, backend=backend).new_tokens
        if served[i] != alone:
            raise WrongQuantizer(f"served through the engine, the quantized target continued {prompt!r} with "
                                 f"{bytes(served[i])!r}, but decoding greedily on its own it gives {bytes(alone)!r}")
    return "served", f"{len(prompts)} prompts, greedy tokens as the model's own"


def drive_quantizer(function, kind, *numbers):
    """A matrix case: quantize the case's W with `function` and compare its output error on X with
    round-to-nearest's. A model case: the target quantized with it, served through the engine or
    scored in bits per byte. The first model case of a run quantizes the target afresh."""
    if kind.startswith("model"):
        return _drive_model(function, kind, *numbers)
    return _drive_matrix(function, kind, *numbers)


_PROMPTS = ("def ", "import os\n", "class Stack:\n", "for i in range(", "return self.", "    if x is None:")


def _quantizer_case(kind, rng):
    if kind.startswith("model"):
        if kind == "model: bits per byte":
            return kind, (), ()
        chosen = rng.choice(len(_PROMPTS), 3, replace=False)
        return kind, tuple(_PROMPTS[int(i)] for i in chosen), tuple(int(m) for m in rng.integers(3, 7, 3))
    n_in = int(rng.choice([32, 64, 128]))
    group = n_in if kind == "per channel" else int(rng.choice([g for g in (8, 16, 32) if g < n_in]))
    n_samples = int(rng.integers(n_in // 2, n_in)) if kind == "few samples" else int(rng.integers(2 * n_in, 4 * n_in))
    bits = 3 if kind == "3 bits" else 4
    return kind, n_in, int(rng.integers(8, 49)), n_samples, bits, group, int(rng.integers(2**31))


_QUANTIZER_KINDS = (["random", "outlier channels", "3 bits", "dead input", "per channel", "few samples", "random"] * 3
                    + ["model: quantize and serve", "model: serve", "model: bits per byte"])


register(Check("ch08.quantize_int4", quantize_int4, Schedule(_INT4_KINDS, _int4_case), drive=drive_int4, rtol=0,
               atol=0))
register(Check("ch08.round_e4m3", round_e4m3, Schedule(_E4M3_KINDS, _e4m3_case), drive=drive_e4m3, rtol=0, atol=0))
register(Check("ch08.column_update", column_update, Schedule(_COLUMN_KINDS, _column_case), drive=drive_column,
               rtol=0, atol=0))
register(Check("ch08.gemv_int4", gemv_int4, Schedule(_GEMV_KINDS, _gemv_case), drive=drive_gemv, rtol=0, atol=0))
register(Check("ch08.my_quantizer", my_quantizer, Schedule(_QUANTIZER_KINDS, _quantizer_case),
               drive=drive_quantizer, rtol=0, atol=0))
