"""quant.awq: the search's errors are the layer's output errors, alpha = 0 is round-to-nearest,
so AWQ's scaling is never worse than RTN on its calibration data, it helps when a few input
channels carry large activations, and its clipping search picks each group's best ratio."""
import numpy as np
import pytest
from _numerics import EPS32
from hypothesis import given, settings
from hypothesis import strategies as st

from infra_lab.quant import formats
from infra_lab.quant.awq import CLIP_RATIOS, activation_scales, awq, awq_search, clip_search
from infra_lab.quant.matmul import QuantizedMatrix


def salient_inputs(rng, n_samples, n_in, n_salient=2, size=20.0):
    """(n_samples, n_in) float32 with a few channels `size` times louder than the rest."""
    inputs = rng.standard_normal((n_samples, n_in)) * rng.uniform(0.5, 1.5, n_in)
    inputs[:, rng.choice(n_in, n_salient, replace=False)] *= size
    return inputs.astype(np.float32)


def output_error(inputs, weights, dequantized):
    """||X W - X W_q||^2 in float64, the product taken directly."""
    return float(np.sum((inputs.astype(np.float64) @ (weights.astype(np.float64) - dequantized)) ** 2))


def brute_force_error(weights, inputs, bits, group, alpha, magnitude=False):
    """||X W - (X / s) Q(diag(s) W)||^2, with s computed channel by channel from its definition;
    with `magnitude`, also || |X| |diag(1 / s) Q| ||_F, which bounds how float32 rounding of the
    scaled matrix moves X W_q."""
    n_in = weights.shape[0]
    mean_abs = np.array([np.mean(np.abs(inputs[:, j].astype(np.float64))) for j in range(n_in)])
    s = np.maximum(mean_abs, 1e-4 * mean_abs.max()) ** alpha
    s = s / np.sqrt(s.max() * s.min())
    values, scales = formats.quantize_int((weights * s[:, None]).T, bits, group)
    quantized = formats.dequantize_int(values, scales, group).T  # Q(diag(s) W), (n_in, n_out)
    approximation = (inputs.astype(np.float64) / s.astype(np.float32)) @ quantized
    error = float(np.sum((inputs.astype(np.float64) @ weights - approximation) ** 2))
    if not magnitude:
        return error
    return error, float(np.linalg.norm(np.abs(inputs.astype(np.float64)) @ np.abs(quantized / s[:, None])))


@pytest.mark.numerics
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bits=st.sampled_from([3, 4, 8]), group=st.sampled_from([None, 8, 16]),
       n_out=st.integers(1, 8), grid=st.integers(1, 12), n_salient=st.integers(0, 3))
def test_awq_is_never_worse_than_round_to_nearest_on_calibration(seed, bits, group, n_out, grid, n_salient):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((32, n_out)).astype(np.float32)
    inputs = salient_inputs(rng, 64, 32, n_salient)
    matrix = awq(weights, inputs, bits, group, grid, clip=False)
    rtn = QuantizedMatrix.quantize(weights, bits, group)
    assert output_error(inputs, weights, matrix.dequantize()) <= output_error(inputs, weights, rtn.dequantize()) \
        * (1 + 1e-9)
    search = awq_search(weights, inputs, bits, group, grid)
    assert np.isclose(search.errors[0], output_error(inputs, weights, rtn.dequantize()), rtol=1e-7)
    assert search.best_alpha == search.alphas[np.argmin(search.errors)]
    assert np.allclose(matrix.input_scale, 1 / activation_scales(inputs, search.best_alpha))


@pytest.mark.numerics
def test_the_search_record_is_the_brute_force_output_error():
    rng = np.random.default_rng(3)
    weights = rng.standard_normal((16, 4)).astype(np.float32)
    inputs = salient_inputs(rng, 48, 16)
    search = awq_search(weights, inputs, 4, 8, grid=5)
    assert np.allclose(search.alphas, [0, 0.2, 0.4, 0.6, 0.8])
    # The search keeps W_q = diag(1 / s) Q in float32, each element within eps32 / 2 of the float64
    # one here; that moves X D (D = W - W_q) by at most eps32 / 2 || |X| |W_q| ||, and ||X D||^2 by
    # at most twice ||X D|| times that (to first order). All else is float64. Measured: 0.2 of it.
    for error, (expected, magnitude) in zip(search.errors, (brute_force_error(weights, inputs, 4, 8, alpha, True)
                                                            for alpha in search.alphas)):
        assert abs(error - expected) <= EPS32 * np.sqrt(expected) * magnitude


@pytest.mark.parametrize("bits, group", [(3, None), (4, 16), (8, None)])
def test_alpha_zero_is_round_to_nearest(bits, group):
    rng = np.random.default_rng(4)
    weights = rng.standard_normal((32, 5)).astype(np.float32)
    matrix = awq(weights, salient_inputs(rng, 64, 32), bits, group, grid=1, clip=False)  # alpha = 0 alone
    rtn = QuantizedMatrix.quantize(weights, bits, group)
    assert (matrix.values() == rtn.values()).all() and (matrix.scales == rtn.scales).all()
    assert (matrix.input_scale == 1).all()


def test_awq_helps_when_a_few_channels_are_loud():
    ratios, alphas = [], []
    for seed in range(8):
        rng = np.random.default_rng(seed)
        weights = rng.standard_normal((64, 16)).astype(np.float32)
        inputs = salient_inputs(rng, 128, 64, n_salient=3)
        matrix = awq(weights, inputs, 4, None)
        rtn = QuantizedMatrix.quantize(weights, 4, None)
        ratios.append(output_error(inputs, weights, matrix.dequantize()) / output_error(inputs, weights,
                                                                                          rtn.dequantize()))
        alphas.append(awq_search(weights, inputs, 4, None).best_alpha)
    assert min(alphas) > 0 and max(ratios) < 0.6, (alphas, ratios)  # 0.18 to 0.47 here


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bits=st.sampled_from([3, 4]), group=st.sampled_from([None, 8]),
       outlier=st.booleans())
def test_the_clip_search_keeps_each_groups_best_ratio(seed, bits, group, outlier):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((16, 3)).astype(np.float32)
    if outlier:
        weights[rng.integers(16), rng.integers(3)] *= 8
    inputs = rng.standard_normal((40, 16)).astype(np.float32)
    ratios = clip_search(weights, inputs, bits, group)
    size = group or 16
    for o in range(3):
        for g in range(16 // size):
            rows = slice(g * size, (g + 1) * size)
            w, x = weights[rows, o].astype(np.float64), inputs[:, rows].astype(np.float64)

            def group_error(ratio):  # the group alone: max |w| shrunk, rounded, clipped to +-q_max
                q_max = 2 ** (bits - 1) - 1
                exact = np.float32(np.abs(w).max() / q_max * np.float32(ratio))
                scale = np.float16(exact)
                scale = np.nextafter(scale, np.float16(np.inf)) if np.float32(scale) < exact else scale
                q = np.clip(np.rint(w.astype(np.float32) / np.float32(scale)), -q_max, q_max) * np.float32(scale)
                return float(np.sum((x @ (w - q)) ** 2))

            errors = [group_error(r) for r in CLIP_RATIOS]
            assert np.isclose(CLIP_RATIOS, ratios[o, g]).any()
            assert group_error(ratios[o, g]) <= min(errors) * (1 + 1e-9) + 1e-12


def test_clipping_a_lone_outlier_helps_the_rest_of_its_group():
    rng = np.random.default_rng(5)
    weights = rng.standard_normal((64, 8)).astype(np.float32)
    weights[3, :] = 12  # one huge weight per output: an unclipped 4-bit step of 12 / 7 flattens the rest
    inputs = rng.standard_normal((128, 64)).astype(np.float32)
    inputs[:, 3] *= 0.01  # ... on an input that barely matters
    clipped, plain = awq(weights, inputs, 4, None, grid=1), awq(weights, inputs, 4, None, grid=1, clip=False)
    assert (clip_search(weights, inputs, 4) < 1).all()
    assert output_error(inputs, weights, clipped.dequantize()) < 0.5 * output_error(inputs, weights,
                                                                                      plain.dequantize())


def test_the_scales_are_centred_and_floored():
    inputs = np.array([[1.0, -4.0, 0.0, 100.0], [3.0, 4.0, 0.0, -100.0]], np.float32)  # mean |x|: 2, 4, 0, 100
    s = activation_scales(inputs, 0.5)
    raw = np.sqrt([2.0, 4.0, 1e-2, 100.0])  # the silent channel counts as 1e-4 of the loudest
    assert np.allclose(s, raw / np.sqrt(raw.max() * raw.min()))
    assert np.isclose(s.max() * s.min(), 1)
    assert (activation_scales(inputs, 0) == 1).all() and (activation_scales(inputs * 0, 0.7) == 1).all()


W = np.zeros((8, 2), np.float32)
X = np.ones((4, 8), np.float32)


@pytest.mark.parametrize("call, message", [
    (lambda: awq(W, np.ones((4, 9)), 4), r"calibration inputs must be \(n_samples, 8\) for a \(8, 2\) matrix; "
                                         r"got \(4, 9\)"),
    (lambda: awq(W, np.ones((0, 8)), 4), r"at least one input row; got \(0, 8\)"),
    (lambda: awq(np.zeros((2, 2, 2)), X, 4), r"non-empty matrix \(n_in, n_out\); got shape \(2, 2, 2\)"),
    (lambda: awq(W, X, 5), "packed two to a byte; got bits=5"),
    (lambda: awq(W, X, 4, 5), "divide the row of 8 values; got 5"),
    (lambda: awq(W, X, 4, grid=0), r"grid must be an integer >= 1 .*; got 0"),
    (lambda: awq_search(W, X, 4, grid=2.5), r"grid must be an integer >= 1 .*; got 2.5"),
    (lambda: activation_scales(X, 1.5), r"alpha must be a number in \[0, 1\]; got 1.5"),
    (lambda: awq(W, X, 4, clip="yes"), "clip must be True or False; got 'yes'"),
    (lambda: clip_search(W, np.ones((4, 7)), 4), r"calibration inputs must be \(n_samples, 8\)"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
