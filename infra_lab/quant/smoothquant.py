"""SmoothQuant (chapter 08): move the activations' outliers into the weights, so that both fit in
int8 (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
Language Models", ICML 2023, Section 4).

W8A8 multiplies int8 activations by int8 weights with integer arithmetic. Weights are easy to
quantize, one scale per output channel; activations are not: a few input channels carry values
100x larger than the rest, and with one scale per token they leave every other channel only a
few levels. Since x W = (x / s) (diag(s) W) for any s > 0, dividing channel j's activations by
s_j = max |X_j|^alpha / max |W_j|^(1 - alpha) (over the calibration rows X and input j's
weights W_j) evens out the activations and moves that much of the range onto the weights; the
paper uses alpha = 0.5. A channel with no activation or no weight (a zero max) keeps s_j = 1.
Here the weights of diag(s) W are int8 per output channel, the activations int8 per token,
quantized at run time (dynamic, symmetric), and the product accumulates the integer dot products
exactly, then multiplies by the token's scale and the output's scale.
"""
from __future__ import annotations

import numbers

import numpy as np

from infra_lab.quant import formats
from infra_lab.quant.gptq import check_calibration
from infra_lab.quant.matmul import QuantizedMatrix


def smoothing_scales(weights, inputs, alpha: float = 0.5) -> np.ndarray:
    """s (n_in,) float64 for W (n_in, n_out) and calibration inputs (n_samples, n_in):
    max |X_j|^alpha / max |W_j|^(1 - alpha), and 1 where either max is 0."""
    weights, inputs = check_calibration(weights, inputs)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha (the share of the difficulty moved to the weights) must be in [0, 1]; "
                         f"got {alpha!r}")
    activation_max = np.abs(inputs).max(0).astype(np.float64)  # (n_in,)
    weight_max = np.abs(weights).max(1).astype(np.float64)  # (n_in,): over input j's n_out weights
    silent = (activation_max == 0) | (weight_max == 0)
    s = np.where(silent, 1, activation_max) ** alpha / np.where(silent, 1, weight_max) ** (1 - alpha)
    return np.where(silent, 1.0, s)


def smooth(weights, inputs, alpha: float = 0.5) -> QuantizedMatrix:
    """diag(s) W (n_in, n_out) in int8 with one scale per output channel, and input_scale 1 / s,
    for W8A8 with matmul_w8a8."""
    weights, inputs = check_calibration(weights, inputs)
    s = smoothing_scales(weights, inputs, alpha)
    values, scales = formats.quantize_int((weights * s[:, None]).T, 8, None)  # (n_out, n_in), (n_out, 1)
    return QuantizedMatrix.from_values(values, scales, 8, None, (1 / s).astype(np.float32))


def quantize_activations(x, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Per-token symmetric quantization of x (..., n): (values int8 (..., n) in [-q_max, q_max],
    scales float32 (...,) = max |x| / q_max of each token; 0 for a token of zeros)."""
    q_max = 2 ** (formats.check_bits(bits) - 1) - 1
    x = np.asarray(x, np.float32)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be (..., n) with n >= 1 values per token; got shape {x.shape}")
    scales = (np.abs(x).max(-1) / np.float32(q_max)).astype(np.float32)  # (...,)
    safe = np.where(scales > 0, scales, 1).astype(np.float32)[..., None]
    values = np.clip(np.rint(x / safe), -q_max, q_max).astype(np.int8)
    return values, scales


def fake_quantize_activations(x, bits: int = 8) -> np.ndarray:
    """x (..., n) float32 after the per-token round trip: what a W8A8 layer sees of it."""
    values, scales = quantize_activations(x, bits)
    return values.astype(np.float32) * scales[..., None]


def matmul_w8a8(x, matrix: QuantizedMatrix) -> np.ndarray:
    """The reference W8A8 product (B, n_out) float32 of x (B, n_in) and an 8-bit per-channel
    matrix: x * input_scale quantized per token to int8, integer dot products with the codes
    (hardware accumulates in int32, which holds n_in * 127^2 up to n_in = 133,143; here float64
    BLAS, whose sums of integer products are exact below 2^53), then times the token's scale and
    the output's scale."""
    if not isinstance(matrix, QuantizedMatrix):
        raise TypeError(f"need a QuantizedMatrix (smooth(W, X) or QuantizedMatrix.quantize(W, 8)); "
                        f"got {type(matrix).__name__}")
    if matrix.bits != 8:
        raise ValueError(f"W8A8 needs 8-bit weights; got bits={matrix.bits}")
    if matrix.group != matrix.n_in:
        raise ValueError(f"W8A8 needs one weight scale per output channel (group = n_in = {matrix.n_in}); "
                         f"got group={matrix.group}")
    x = np.asarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] != matrix.n_in:
        raise ValueError(f"x must be (batch, {matrix.n_in}) for a ({matrix.n_in}, {matrix.n_out}) matrix; "
                         f"got {x.shape}")
    if matrix.input_scale is not None:
        x = x * matrix.input_scale
    x_values, x_scales = quantize_activations(x, 8)  # (B, n_in) int8, (B,) float32
    dots = x_values.astype(np.float64) @ matrix.values().astype(np.float64).T  # (B, n_out), exact integers
    weight_scales = matrix.scales[:, 0].astype(np.float64)  # (n_out,)
    return (dots * x_scales[:, None].astype(np.float64) * weight_scales[None, :]).astype(np.float32)
