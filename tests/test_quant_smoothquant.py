"""quant.smoothquant: the W8A8 product is the integer computation it describes, smoothing leaves
the float product unchanged, and with an outlier channel it cuts the W8A8 error; activations are
quantized token by token."""
import numpy as np
import pytest
from _numerics import EPS32
from hypothesis import given, settings
from hypothesis import strategies as st

from infra_lab.quant.matmul import QuantizedMatrix
from infra_lab.quant.smoothquant import (fake_quantize_activations, matmul_w8a8, quantize_activations, smooth,
                                         smoothing_scales)


def brute_force_w8a8(x, matrix):
    """One token and one output at a time: scale the token, quantize it element by element, take
    the integer dot product in Python integers, then multiply by the two scales."""
    x = np.asarray(x, np.float32)
    codes = matrix.values()  # (n_out, n_in) int8
    input_scale = matrix.input_scale if matrix.input_scale is not None else np.ones(matrix.n_in, np.float32)
    out = np.zeros((x.shape[0], matrix.n_out))
    for b in range(x.shape[0]):
        token = [np.float32(x[b, i]) * input_scale[i] for i in range(matrix.n_in)]
        token_scale = np.float32(max(abs(v) for v in token)) / np.float32(127)
        token_codes = [int(np.clip(np.rint(v / token_scale), -127, 127)) if token_scale > 0 else 0 for v in token]
        for o in range(matrix.n_out):
            total = sum(token_codes[i] * int(codes[o, i]) for i in range(matrix.n_in))
            out[b, o] = total * float(token_scale) * float(matrix.scales[o, 0])
    return out


def outlier_inputs(rng, n_samples, n_in, outlier=3, size=100.0):
    inputs = rng.standard_normal((n_samples, n_in))
    inputs[:, outlier] *= size
    return inputs.astype(np.float32)


@pytest.mark.numerics
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 4), n_in=st.integers(1, 12), n_out=st.integers(1, 5),
       smoothed=st.booleans(), alpha=st.floats(0, 1))
def test_the_w8a8_product_is_the_integer_computation(seed, batch, n_in, n_out, smoothed, alpha):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n_in, n_out)).astype(np.float32)
    x = (rng.standard_normal((batch, n_in)) * rng.uniform(0.1, 50, n_in)).astype(np.float32)
    x[rng.random(batch) < 0.2] = 0  # a token of zeros has scale 0
    matrix = smooth(weights, x, alpha) if smoothed else QuantizedMatrix.quantize(weights, 8)
    # the same integer codes and exact integer sums, then the two scales: float64 here, float32 out
    # there, one rounding of at most eps32 / 2 of the value (measured: 0.45 eps32); eps32 doubles it
    got, expected = matmul_w8a8(x, matrix), brute_force_w8a8(x, matrix)
    assert np.all(np.abs(got - expected) <= EPS32 * np.abs(expected))


@pytest.mark.numerics
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), alpha=st.floats(0, 1))
def test_smoothing_leaves_the_float_product_unchanged(seed, alpha):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((16, 6)).astype(np.float32)
    inputs = outlier_inputs(rng, 32, 16)
    s = smoothing_scales(weights, inputs, alpha)
    assert np.allclose((inputs / s) @ (weights * s[:, None]), inputs @ weights, rtol=1e-4, atol=1e-3)
    matrix = smooth(weights, inputs, alpha)
    assert np.allclose(matrix.input_scale, 1 / s)
    half_step = matrix.scales[:, 0].astype(np.float32) / 2 * matrix.input_scale[:, None]  # (n_in, n_out)
    assert np.all(np.abs(matrix.dequantize() - weights) <= half_step * (1 + 1e-5) + 1e-7)  # 1/s times sW's error


def test_the_smoothing_scales_follow_their_definition():
    rng = np.random.default_rng(5)
    weights = rng.standard_normal((6, 3)).astype(np.float32)
    inputs = rng.standard_normal((10, 6)).astype(np.float32)
    inputs[:, 1] = 0  # a silent channel
    weights[4] = 0  # an input whose weights are all 0
    s = smoothing_scales(weights, inputs, 0.3)
    for j in range(6):
        activation_max, weight_max = np.abs(inputs[:, j]).max(), np.abs(weights[j]).max()
        expected = 1.0 if j in (1, 4) else activation_max ** 0.3 / weight_max ** 0.7
        assert np.isclose(s[j], expected)


def test_smoothing_tames_an_outlier_channel():
    rng = np.random.default_rng(6)
    weights = rng.standard_normal((64, 32)).astype(np.float32)
    inputs = outlier_inputs(rng, 128, 64)
    exact = inputs.astype(np.float64) @ weights

    def error(matrix):
        return float(np.sum((matmul_w8a8(inputs, matrix) - exact) ** 2))

    smoothed = error(smooth(weights, inputs, 0.5))
    assert smoothed < 0.1 * error(smooth(weights, inputs, 0.0))  # all the difficulty on the activations
    assert smoothed < 0.1 * error(QuantizedMatrix.quantize(weights, 8))  # no smoothing (about 1/50 here)


def test_activations_are_quantized_per_token():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    x[2] = 0
    values, scales = quantize_activations(x)
    assert values.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (4,)
    assert np.allclose(scales, np.abs(x).max(1) / 127) and scales[2] == 0 and (values[2] == 0).all()
    for b in (0, 1, 3):  # each token's largest value takes the largest code
        assert abs(values[b, np.abs(x[b]).argmax()]) == 127
    louder = x.copy()
    louder[1] *= 1000
    values_louder, scales_louder = quantize_activations(louder)
    assert (np.delete(values_louder, 1, 0) == np.delete(values, 1, 0)).all()  # other tokens keep their codes
    assert np.isclose(scales_louder[1], 1000 * scales[1])
    round_trip = fake_quantize_activations(x)
    assert np.all(np.abs(round_trip - x) <= scales[:, None] / 2 * (1 + 1e-6))
    values_4, scales_4 = quantize_activations(x, 4)
    assert np.abs(values_4).max() == 7 and np.allclose(scales_4, np.abs(x).max(1) / 7)


W = np.ones((8, 2), np.float32)
X = np.ones((4, 8), np.float32)


@pytest.mark.parametrize("call, error, message", [
    (lambda: smooth(W, np.ones((4, 3))), ValueError, r"calibration inputs must be \(n_samples, 8\) for a \(8, 2\) "
                                                     r"matrix; got \(4, 3\)"),
    (lambda: smooth(W, np.ones((0, 8))), ValueError, r"at least one input row; got \(0, 8\)"),
    (lambda: smoothing_scales(np.ones(8), X), ValueError, r"non-empty matrix \(n_in, n_out\); got shape \(8,\)"),
    (lambda: smooth(W, X, 1.2), ValueError, r"alpha .* must be in \[0, 1\]; got 1.2"),
    (lambda: smooth(W, X, -0.1), ValueError, r"must be in \[0, 1\]; got -0.1"),
    (lambda: matmul_w8a8(X, QuantizedMatrix.quantize(W, 4)), ValueError, "W8A8 needs 8-bit weights; got bits=4"),
    (lambda: matmul_w8a8(X, QuantizedMatrix.quantize(W, 8, 4)), ValueError,
     r"one weight scale per output channel \(group = n_in = 8\); got group=4"),
    (lambda: matmul_w8a8(np.ones((4, 7)), QuantizedMatrix.quantize(W, 8)), ValueError,
     r"x must be \(batch, 8\) for a \(8, 2\) matrix; got \(4, 7\)"),
    (lambda: matmul_w8a8(X, W), TypeError, "need a QuantizedMatrix"),
    (lambda: quantize_activations(X, 5), ValueError, r"bits must be one of \(2, 3, 4, 8\); got 5"),
    (lambda: quantize_activations(np.float32(1)), ValueError, r"x must be \(..., n\) .*; got shape \(\)"),
])
def test_bad_input_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()
