"""Chapter 08's checks: plausible wrong answers fail and say why, the cases
cover what the statements promise, and the statements state the checks' tolerances."""
import dataclasses
import types
import zlib

import numpy as np
import pytest

from infra_lab import book
from infra_lab.grading import ch08, checks, notebooks
from infra_lab.grading.ch08 import unpack_int4  # noqa: F401 - the int4 check finds it beside quantize_int4
from infra_lab.quant import formats, gptq
from infra_lab.quant.matmul import QuantizedMatrix

NAMES = ["quantize_int4", "round_e4m3", "column_update", "gemv_int4", "my_quantizer"]


def run(name, candidate, spec=None):
    return checks._run(spec or checks._lookup(f"ch08.{name}"), candidate)


def cases(name):
    spec = checks._lookup(f"ch08.{name}")
    rng = np.random.default_rng(zlib.crc32(spec.name.encode()))
    return [spec.draw_case(rng) for _ in range(spec.n_cases)]


def fails(name, wrong, says, spec=None):
    result = run(name, wrong, spec)
    assert result.passed < result.total
    assert result.line.startswith(f"FAIL ch08.{name} ") and says in result.first_failure, result.first_failure
    return result


def package_gptq(weights, inputs, bits, group):
    return gptq.gptq(weights, inputs, bits, group)


@pytest.mark.slow
def test_the_packages_gptq_passes_the_quantizer_check():
    result = run("my_quantizer", package_gptq)
    assert result.passed == result.total == 24, result.first_failure


# ---- the cases cover the edges the statements name -------------------------------------------------

def test_the_int4_cases_have_zero_groups_ties_and_every_group_size():
    found = set()
    for row, group in cases("quantize_int4"):
        values, scales = formats.quantize_int(row, 4, group)
        exact = row.reshape(-1, group) / np.where(scales > 0, scales, 1).astype(np.float32)[:, None]
        found |= {"zero group"} if (scales == 0).any() else set()
        found |= {"tie"} if (np.abs(exact - np.floor(exact)) == 0.5).any() else set()
        found |= {"group 1"} if group == 1 else {"whole row"} if group == len(row) else set()
        found |= {"subnormal scale"} if (scales > 0).any() and scales[scales > 0].min() < 2.0 ** -14 else set()
        found |= {"negative"} if values.min() < 0 else set()
    assert found == {"zero group", "tie", "group 1", "whole row", "subnormal scale", "negative"}


def test_the_e4m3_cases_have_the_special_values_and_ties():
    x = np.concatenate([case[0] for case in cases("round_e4m3")])
    assert np.isnan(x).any() and np.isposinf(x).any() and np.isneginf(x).any()
    assert ((x == 0) & np.signbit(x)).any() and ((np.abs(x) > 448) & np.isfinite(x)).any()
    assert (np.abs(x[np.isfinite(x)]) < 2.0 ** -10).any()  # rounds to zero
    rounded = formats.round_e4m3(x)
    assert ((rounded != 0) & (np.abs(rounded) < 2.0 ** -6)).any()  # subnormals
    assert 464 in x and (np.abs(x) == 2.0 ** -10).any()  # ties above the top and at the bottom


def test_the_column_cases_clip_and_reach_both_ends():
    kinds, columns = set(), set()
    for case in cases("column_update"):
        kind, n_out, n_in, column, group, bits, seed = case
        weights_t, u, column, scales, group, bits = ch08.column_arguments(*case)
        scale = scales[:, column // (group or n_in)].astype(np.float32)
        q_max = 2 ** (bits - 1) - 1
        kinds |= {"clips"} if (np.abs(weights_t[:, column]) > q_max * scale * 1.01).any() else set()
        kinds |= {"zero scale"} if (scale == 0).any() else set()
        kinds |= {f"{bits} bits", "per channel" if group is None else "grouped"}
        columns |= {"first" if column == 0 else "last" if column == n_in - 1 else
                    "group end" if (column + 1) % (group or n_in) == 0 else "inside"}
    assert kinds == {"clips", "zero scale", "3 bits", "4 bits", "8 bits", "per channel", "grouped"}
    assert columns == {"first", "last", "group end", "inside"}


def test_the_gemv_cases_hold_every_nibble_and_zero_scales():
    nibbles, zero_scales, groups = set(), False, set()
    for case in cases("gemv_int4"):
        x, codes, scales, group = ch08.gemv_arguments(*case[:6])
        nibbles |= set(np.unique(codes & 15)) | set(np.unique(codes >> 4))
        zero_scales |= bool((scales == 0).any())
        groups.add(group)
    assert nibbles == set(range(16)) and zero_scales and {2, 128} <= groups


def test_the_quantizer_cases_end_on_the_model():
    kinds = [case[0] for case in cases("my_quantizer")]
    assert kinds[-3:] == ["model: quantize and serve", "model: serve", "model: bits per byte"]
    assert not any(kind.startswith("model") for kind in kinds[:-3])
    matrices = [case for case in cases("my_quantizer")[:-3]]
    assert {bits for *_, bits, group, seed in matrices} == {3, 4}
    assert any(group == n_in for _, n_in, _, _, _, group, _ in matrices)
    assert any(n_samples < n_in for _, n_in, _, n_samples, _, _, _ in matrices)


# ---- exercise 1: int4 ----------------------------------------------------------------------------

def high_nibble_first(row, group):
    packed, scales = ch08.quantize_int4(row, group)
    return (packed << 4) | (packed >> 4), scales


def scale_rounded_to_nearest(row, group):
    groups = row.reshape(-1, group)
    scales = (np.abs(groups).max(1) / 7).astype(np.float16)
    values = np.clip(np.rint(groups / np.where(scales > 0, scales, 1).astype(np.float32)[:, None]), -7, 7)
    return formats.pack_int4(values.astype(np.int8).reshape(-1)), scales


def stores_v_plus_8(row, group):
    values, scales = formats.quantize_int(row, 4, group)
    nibbles = (values + 8).astype(np.uint8)
    return nibbles[0::2] | (nibbles[1::2] << 4), scales


def rounds_half_up(row, group):
    values, scales = formats.quantize_int(row, 4, group)
    groups = row.reshape(-1, group) / np.where(scales > 0, scales, 1).astype(np.float32)[:, None]
    values = np.clip(np.floor(groups + 0.5), -7, 7).astype(np.int8).reshape(-1)
    return formats.pack_int4(values), scales


def scale_over_8(row, group):
    groups = row.reshape(-1, group)
    scales = (np.abs(groups).max(1) / 8).astype(np.float16)
    values = np.clip(np.rint(groups / np.where(scales > 0, scales, 1).astype(np.float32)[:, None]), -8, 7)
    return formats.pack_int4(values.astype(np.int8).reshape(-1)), scales


@pytest.mark.parametrize("wrong, says", [
    (high_nibble_first, "the first value of a pair goes in the low nibble"),
    (scale_rounded_to_nearest, "round the scale up to the next fp16"),
    (stores_v_plus_8, "store each value in two's complement, v & 0xF"),
    (rounds_half_up, "is a tie: np.rint rounds ties to even"),
    (scale_over_8, "q_max is 7"),
])
def test_wrong_int4_quantizers_fail_naming_the_cause(wrong, says):
    fails("quantize_int4", wrong, says)


def beside(unpack):
    """The reference quantize_int4, as if written in a notebook beside `unpack`."""
    return types.FunctionType(ch08.quantize_int4.__code__, {**vars(ch08), "unpack_int4": unpack}, "quantize_int4")


def no_sign(packed, n):
    out = np.empty(n, np.int8)
    out[0::2], out[1::2] = packed & 0xF, packed >> 4
    return out


def swapped(packed, n):
    return formats.unpack_int4((packed << 4) | (packed >> 4), n)


@pytest.mark.parametrize("wrong, says", [
    (no_sign, "a nibble of 8 or more is negative in two's complement: subtract 16"),
    (swapped, "value 2i is byte i's low nibble"),
    (lambda packed, n: formats.unpack_int4(packed, n).astype(np.int64), "must be a numpy array of int8"),
])
def test_wrong_unpacks_fail_naming_the_cause(wrong, says):
    fails("quantize_int4", beside(wrong), says)


def test_a_missing_unpack_is_named():
    alone = types.FunctionType(ch08.quantize_int4.__code__, {"formats": formats}, "quantize_int4")
    fails("quantize_int4", alone, "define unpack_int4 beside quantize_int4")


# ---- exercise 2: e4m3 ----------------------------------------------------------------------------

def spacing(x):
    _, exponent = np.frexp(x)
    return np.exp2((np.maximum(exponent - 1, -6) - 3).astype(np.float64))


def no_saturation(x):
    with np.errstate(invalid="ignore", over="ignore"):
        rounded = np.rint(x / spacing(x)) * spacing(x)
        return np.where(np.isnan(x), np.nan, rounded).astype(np.float32)


def half_away_from_zero(x):
    step = spacing(x)
    with np.errstate(invalid="ignore", over="ignore"):
        rounded = np.sign(x) * np.floor(np.abs(x) / step + 0.5) * step
        rounded = np.where(np.abs(rounded) > 448, np.copysign(448.0, x), rounded)
    return np.where(np.isnan(x), np.nan, np.copysign(rounded, x)).astype(np.float32)


def no_subnormals(x):
    _, exponent = np.frexp(x)
    step = np.exp2((exponent - 4).astype(np.float64))
    with np.errstate(invalid="ignore", over="ignore"):
        rounded = np.rint(x / step) * step
        rounded = np.where(np.abs(rounded) > 448, np.copysign(448.0, x), rounded)
    return np.where(np.isnan(x), np.nan, rounded).astype(np.float32)


def loses_the_sign_of_zero(x):
    return np.where(formats.round_e4m3(x) == 0, np.float32(0), formats.round_e4m3(x))


def nan_saturates(x):
    return np.where(np.isnan(x), np.float32(448), formats.round_e4m3(x))


@pytest.mark.parametrize("wrong, says", [
    (no_saturation, "saturates to ±448"), (half_away_from_zero, "(to even)"), (no_subnormals, "subnormal"),
    (loses_the_sign_of_zero, "zero keeps its sign"), (nan_saturates, "NaN stays NaN"),
    (lambda x: formats.round_e4m3(x).astype(np.float64), "must be a numpy array of float32"),
])
def test_wrong_e4m3_roundings_fail_naming_the_value(wrong, says):
    result = fails("round_e4m3", wrong, says)
    assert "raised WrongRounding: x[" in result.line or "float32" in says, result.line


# ---- exercise 3: the column update --------------------------------------------------------------------

def step_parts(weights_t, u, column, scales, group, bits):
    size = group or weights_t.shape[1]
    scale = scales[:, column // size].astype(np.float32)
    w = np.array(weights_t[:, column], np.float32)
    return scale, w, 2 ** (bits - 1) - 1


def finish(weights_t, u, column, values, scale, error):
    weights_t = np.array(weights_t, np.float32)
    u = u.astype(np.float32)
    weights_t[:, column + 1:] -= error[:, None] * u[column, column + 1:]
    weights_t[:, column] = values * scale
    return weights_t, values, error


def not_divided(weights_t, u, column, scales, group, bits):
    step = gptq.column_update(weights_t, u, column, scales, group, bits)
    scale = step_parts(weights_t, u, column, scales, group, bits)[0]
    return finish(weights_t, u, column, step.values, scale, step.error * np.float32(u[column, column]))


def not_clipped(weights_t, u, column, scales, group, bits):
    scale, w, _ = step_parts(weights_t, u, column, scales, group, bits)
    values = np.where(scale > 0, np.rint(w / np.where(scale > 0, scale, 1)), 0).astype(np.int8)
    error = (w - values * scale) / np.float32(u[column, column])
    return finish(weights_t, u, column, values, scale, error)


def divides_by_a_zero_scale(weights_t, u, column, scales, group, bits):
    scale, w, q_max = step_parts(weights_t, u, column, scales, group, bits)
    with np.errstate(divide="ignore", invalid="ignore"):
        values = np.nan_to_num(np.clip(np.rint(w / scale), -q_max, q_max), nan=q_max).astype(np.int8)
    error = (w - values * scale) / np.float32(u[column, column])
    return finish(weights_t, u, column, values, scale, error)


def error_reversed(weights_t, u, column, scales, group, bits):
    step = gptq.column_update(weights_t, u, column, scales, group, bits)
    scale = step_parts(weights_t, u, column, scales, group, bits)[0]
    return finish(weights_t, u, column, step.values, scale, -step.error)


def keeps_w_in_its_column(weights_t, u, column, scales, group, bits):
    step = gptq.column_update(weights_t, u, column, scales, group, bits)
    updated = step.weights_t.copy()
    updated[:, column] = weights_t[:, column]
    return updated, step.values, step.error


@pytest.mark.parametrize("wrong, says", [
    (not_divided, "divide by U[c, c]: e = (w - q) / U_cc"), (not_clipped, "clip to [-"),
    (divides_by_a_zero_scale, "a scale of 0 gives the value 0"), (error_reversed, "not (q - w) / U_cc"),
])
def test_wrong_column_updates_fail_naming_the_cause(wrong, says):
    result = fails("column_update", wrong, says)
    assert result.first_failure.startswith("column_update('"), result.first_failure


def test_a_column_update_that_leaves_w_in_its_column_is_named():
    fails("column_update", keeps_w_in_its_column, "itself must hold q = value * scale afterwards")


def test_the_column_update_accepts_float64_arithmetic():
    def in_float64(weights_t, u, column, scales, group, bits):
        scale, w, q_max = step_parts(weights_t, u, column, scales, group, bits)
        scale, w = scale.astype(np.float64), w.astype(np.float64)
        values = np.where(scale > 0, np.clip(np.rint(w / np.where(scale > 0, scale, 1)), -q_max, q_max), 0)
        error = (w - values * scale) / u[column, column]
        weights_t = weights_t.astype(np.float64)
        weights_t[:, column + 1:] -= error[:, None] * u[column, column + 1:]
        weights_t[:, column] = values * scale
        return weights_t, values.astype(np.int8), error

    result = run("column_update", in_float64)
    assert result.passed == result.total, result.first_failure


# ---- exercise 4: the GEMV ------------------------------------------------------------------------------

def layout_values(codes, group):
    n_out = codes.shape[0]
    low = (codes & 15).reshape(n_out, -1, group // 2)
    high = (codes >> 4).reshape(n_out, -1, group // 2)
    return np.concatenate([low, high], axis=-1).reshape(n_out, -1).astype(np.float32)


def gemv_of(values, scales, group, x):
    weights_t = values * np.repeat(scales.astype(np.float32), group, axis=1)
    return x @ weights_t.T


def forgets_the_offset(x, codes, scales, group):
    return gemv_of(layout_values(codes, group), scales, group, x)


def reads_neighbours(x, codes, scales, group):
    values = formats.unpack_int4(codes ^ np.uint8(0x88), 2 * codes.shape[1]).astype(np.float32)
    return gemv_of(values, scales, group, x)


def forgets_the_scales(x, codes, scales, group):
    return x @ (layout_values(codes, group) - 8).T


@pytest.mark.parametrize("wrong, says", [
    (forgets_the_offset, "each nibble holds v + 8: subtract 8"), (reads_neighbours, "not two neighbours"),
    (forgets_the_scales, "multiply each group's dot product by its scale"),
    (lambda x, codes, scales, group: ch08.gemv_int4(x, codes, scales, group).T, "shape"),
])
def test_wrong_gemvs_fail_naming_the_cause(wrong, says):
    result = fails("gemv_int4", wrong, says)
    assert result.first_failure.startswith("gemv_int4('"), result.first_failure


def test_the_gemv_check_takes_float64_and_the_kernels_sum_order():
    def with_group_sums(x, codes, scales, group):  # the numba kernel's way: nibbles, then 8 * sum(x)
        x = x.astype(np.float64)
        nibbles = layout_values(codes, group).reshape(codes.shape[0], -1, group)  # (n_out, G, group)
        groups = x.reshape(x.shape[0], -1, group)  # (B, G, group)
        dots = np.einsum("bgi,ogi->bog", groups, nibbles) - 8 * groups.sum(-1)[:, None, :]
        return (dots * scales.astype(np.float64)[None]).sum(-1)

    result = run("gemv_int4", with_group_sums)
    assert result.passed == result.total, result.first_failure


# ---- exercise 5: the quantizer -----------------------------------------------------------------------------

def without_scales(weights, inputs, bits, group):
    values, scales = formats.quantize_int(weights.T, bits, group)
    return QuantizedMatrix.from_values(values, np.ones_like(scales), bits, group)


def with_q_max(q_bits):
    def coarse(weights, inputs, bits, group):
        values, scales = formats.quantize_int(weights.T, q_bits, group)  # fewer levels in the same format
        return QuantizedMatrix.from_values(values, scales, bits, group)

    coarse.__name__ = f"rounds_to_{q_bits}_bits"
    return coarse


def matrices_only():
    """The quantizer check without its model cases (they come last in its schedule)."""
    return dataclasses.replace(checks._lookup("ch08.my_quantizer"), n_cases=21)


@pytest.mark.parametrize("wrong, says", [
    (without_scales, "the scales are all 1"), (with_q_max(2), "is q_max 2^(bits - 1) - 1?"),
    (lambda weights, inputs, bits, group: QuantizedMatrix.quantize(weights, 8, group), "the matrix has bits 8; "
                                                                                        "the check asked for 4"),
    (lambda weights, inputs, bits, group: QuantizedMatrix.quantize(weights, bits), "the matrix has group"),
    (lambda weights, inputs, bits, group: weights, "must return a QuantizedMatrix"),
])
def test_wrong_quantizers_fail_on_the_matrices(wrong, says):
    result = fails("my_quantizer", wrong, says, matrices_only())
    assert "raised WrongQuantizer" in result.line and result.passed <= 3, result.line


def test_the_model_bar_passes_gptq_and_rtn_and_fails_coarser_rounding():
    """The numbers behind BPB_TOLERANCE: round-to-nearest is the bar itself, GPTQ beats it, and
    rounding to 3 bits' levels in the 4-bit format loses far more than the tolerance."""
    bar = ch08._rtn_bits_per_byte()
    gained = bar - ch08.bits_per_byte(ch08.quantize_target(package_gptq))
    lost = ch08.bits_per_byte(ch08.quantize_target(with_q_max(3))) - bar
    assert gained > 0 and lost > 2 * ch08.BPB_TOLERANCE, (gained, lost)
    case = ("model: bits per byte", (), ())
    assert ch08.drive_quantizer(package_gptq, *case) == ch08.drive_quantizer(ch08.my_quantizer, *case)
    with pytest.raises(ch08.WrongQuantizer, match=r"scores \d\.\d{4} bits per byte on the first 8 validation "
                                                  r"windows; round-to-nearest \d\.\d{4}, the float model .* more "
                                                  r"than 0.02 above round-to-nearest"):
        ch08.drive_quantizer(with_q_max(3), *case)


def test_a_quantizer_that_fails_on_the_model_is_named_with_the_matrix():
    def only_small(weights, inputs, bits, group):
        if weights.shape[0] > 128:
            raise ValueError("too wide")
        return QuantizedMatrix.quantize(weights, bits, group)

    first_model_case = cases("my_quantizer")[-3]
    with pytest.raises(ch08.WrongQuantizer, match=r"^quantizing the target's layers.0.w_down: \(512, 128\): "
                                                  r"ValueError: too wide$"):
        ch08.drive_quantizer(only_small, *first_model_case)
    assert run("my_quantizer", only_small, matrices_only()).passed == 21  # the random matrices are narrower


def test_the_model_is_quantized_afresh_each_run():
    calls = []

    def counted(weights, inputs, bits, group):
        calls.append(weights.shape)
        return QuantizedMatrix.quantize(weights, bits, group)

    keys = len(ch08.quantize_target(ch08.my_quantizer).quantized)
    for fresh in (True, False, True, False):  # a run's first model case, then its others
        ch08._quantized(counted, fresh)
    assert len(calls) == 2 * keys
    assert cases("my_quantizer")[-3][0] == "model: quantize and serve"  # the kind that asks for a fresh one


# ---- the statements say what the checks check ---------------------------------------------------------------

def short(x: float) -> str:
    """1e-4 as the statements write it."""
    mantissa, exponent = f"{x:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def test_the_statements_state_the_checks_tolerances():
    text = book.exercise_statements("ch08_low_precision")
    assert text.count("\n### Exercise") + text.startswith("### Exercise") == 5
    for promise in [f"at most {ch08.BPB_TOLERANCE} bits per byte", f"{ch08.ERROR_RATIO} times",
                    f"rtol={short(ch08.GEMV_TOLERANCE)}, atol={short(ch08.GEMV_TOLERANCE)}",
                    f"relative {short(ch08.COLUMN_TOLERANCE)}",
                    f"first {ch08.BPB_WINDOWS}",
                    f"{ch08.CALIBRATION_ROWS} tokens of {ch08.CALIBRATION_WINDOWS} windows",
                    f"{ch08.TARGET_BITS} bits in groups of {ch08.TARGET_GROUP}"]:
        assert promise in " ".join(text.split()), promise
    solution = notebooks.read(book.REPO_ROOT / "solutions" / "ch08_low_precision.ipynb")
    assert list(notebooks.exercises(solution)) == [f"ch08.{name}" for name in NAMES]
