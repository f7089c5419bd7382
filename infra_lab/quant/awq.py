"""AWQ (chapter 08): scale up the weights of the inputs that carry large activations before
rounding, and scale those inputs down by as much (Lin et al., "AWQ: Activation-aware Weight
Quantization for LLM Compression and Acceleration", MLSys 2024, Section 3.2).

A weight's rounding error reaches the output multiplied by its input, so the few input channels
with large activations ("salient" ones) matter most. Multiplying input j's weights by s_j > 1
and its activation by 1 / s_j leaves the product unchanged, x W = (x / s) (diag(s) W), but
shrinks that channel's rounding error relative to its weights when the group's scale does not
grow. AWQ sets s = (mean |x_j| over the calibration rows)^alpha, searches alpha on the grid
0, 1/grid, ..., (grid - 1)/grid, and keeps the alpha whose quantized layer is closest on the
calibration inputs: ||X W - (X / s) Q(diag(s) W)||^2, Q round-to-nearest. alpha = 0 gives s = 1,
plain round-to-nearest, so on its calibration data AWQ is never worse than RTN. As in the
paper's code, s is divided by sqrt(max s * min s), centring it around 1 on a log scale; channels
quieter than 1e-4 of the loudest are treated as that quiet, so no s is 0.

The paper's code then searches a clipping range for every group of every output: it shrinks the
group's max |w| by ratios 1, 0.95, ..., 0.55 (`CLIP_RATIOS`), and keeps the ratio whose
rounded group is closest on the calibration inputs, ||X_g (w_g - Q(w_g))||^2 with X_g the group's
inputs, each group judged alone. Clipping the rare large weight buys a finer step for the others.
Ratio 1 is plain rounding, so this too never loses on its calibration data, group by group. The
returned matrix keeps 1 / s as its input_scale, which a kernel folds into x (or into the layer
before).
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from infra_lab.quant import formats
from infra_lab.quant.gptq import check_calibration, check_format
from infra_lab.quant.matmul import QuantizedMatrix

QUIET = 1e-4  # channels quieter than this fraction of the loudest count as this quiet
CLIP_RATIOS = 1 - np.arange(10) / 20  # (10,): 1, 0.95, ..., 0.55: n_grid = 20, max_shrink = 0.5 in llm-awq


def activation_scales(inputs, alpha: float) -> np.ndarray:
    """s (n_in,) float64: (mean |x_j| over the rows of inputs (n_samples, n_in))^alpha, divided by
    sqrt(max s * min s)."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be a number in [0, 1]; got {alpha!r}")
    return _scales_of(np.abs(np.asarray(inputs, np.float64)).mean(0), alpha)


def _scales_of(mean_abs: np.ndarray, alpha: float) -> np.ndarray:
    """activation_scales from the channels' mean |x| (n_in,)."""
    loudest = mean_abs.max()
    if loudest == 0:
        return np.ones_like(mean_abs)
    s = np.maximum(mean_abs, QUIET * loudest) ** alpha
    return s / np.sqrt(s.max() * s.min())


def _scaled_rtn(weights: np.ndarray, s: np.ndarray, bits: int, group: int | None):
    """Round-to-nearest of diag(s) W: (values (n_out, n_in) int8, scales fp16, input_scale 1 / s
    float32 (n_in,))."""
    values, scales = formats.quantize_int((weights * s[:, None]).T, bits, group)  # along n_in
    return values, scales, (1 / s).astype(np.float32)


def _output_error(gram: np.ndarray, weights: np.ndarray, values, scales, input_scale, group) -> float:
    """||X W - X W_q||^2 from gram = X^T X (n_in, n_in): with D = W - W_q (n_in, n_out), it is
    trace(D^T X^T X D), cheaper than the product when n_samples > n_in."""
    dequantized = formats.dequantize_int(values, scales, group).T * input_scale[:, None]  # (n_in, n_out)
    difference = weights.astype(np.float64) - dequantized
    return float(np.sum(difference * (gram @ difference)))


class AwqSearch(NamedTuple):
    alphas: np.ndarray  # (grid,): 0, 1/grid, ..., (grid - 1)/grid
    errors: np.ndarray  # (grid,): the calibration output error ||X W - X W_q||^2 at each alpha
    best_alpha: float  # the alpha of the smallest error (the smallest such alpha on a tie)


def awq_search(weights, inputs, bits: int, group: int | None = None, grid: int = 20) -> AwqSearch:
    """The grid search of AWQ over alpha, for W (n_in, n_out) and inputs (n_samples, n_in)."""
    weights, inputs = check_calibration(weights, inputs)
    check_format(weights.shape[0], bits, group)
    if isinstance(grid, bool) or not isinstance(grid, numbers.Integral) or grid < 1:
        raise ValueError(f"grid must be an integer >= 1 (alphas 0, 1/grid, ..., (grid - 1)/grid); got {grid!r}")
    inputs64 = inputs.astype(np.float64)
    gram = inputs64.T @ inputs64  # (n_in, n_in)
    mean_abs = np.abs(inputs64).mean(0)  # (n_in,)
    alphas = np.arange(grid) / grid
    errors = np.empty(grid)
    for k, alpha in enumerate(alphas):
        values, scales, input_scale = _scaled_rtn(weights, _scales_of(mean_abs, alpha), bits, group)
        errors[k] = _output_error(gram, weights, values, scales, input_scale, group)
    return AwqSearch(alphas, errors, float(alphas[np.argmin(errors)]))


def clip_search(weights, inputs, bits: int, group: int | None = None) -> np.ndarray:
    """The ratio (n_out, n_in / group) of CLIP_RATIOS whose clipped rounding of W (n_in, n_out)
    is closest on inputs (n_samples, n_in), group by group (the first such ratio on a tie)."""
    weights, inputs = check_calibration(weights, inputs)
    check_format(weights.shape[0], bits, group)
    n_in, n_out = weights.shape
    group = group or n_in
    x = formats.groups_of(inputs.astype(np.float64), group)  # (n_samples, G, group)
    grams = np.einsum("sgi,sgj->gij", x, x)  # (G, group, group): each group's X_g^T X_g
    exact = formats.groups_of(weights.T.astype(np.float64), group)  # (n_out, G, group)
    errors = np.empty((len(CLIP_RATIOS),) + exact.shape[:2])
    for k, ratio in enumerate(CLIP_RATIOS):
        values, scales = formats.quantize_int(weights.T, bits, group, np.full(exact.shape[:2], ratio))
        difference = exact - formats.groups_of(formats.dequantize_int(values, scales, group), group)
        errors[k] = np.einsum("ogi,gij,ogj->og", difference, grams, difference)
    return CLIP_RATIOS[np.argmin(errors, axis=0)].astype(np.float32)


def awq(weights, inputs, bits: int, group: int | None = None, grid: int = 20,
        clip: bool = True) -> QuantizedMatrix:
    """W (n_in, n_out) quantized to `bits` (8, 4 or 3) with a scale per `group` inputs of each
    output (None: per channel) after AWQ's activation-aware scaling, searched on `grid` alphas
    against calibration inputs (n_samples, n_in), then (with `clip`) each group's clipping range
    searched. input_scale is 1 / s."""
    weights, inputs = check_calibration(weights, inputs)
    if not isinstance(clip, bool):
        raise ValueError(f"clip must be True or False; got {clip!r}")
    best_alpha = awq_search(weights, inputs, bits, group, grid).best_alpha
    s = activation_scales(inputs, best_alpha)
    values, scales, input_scale = _scaled_rtn(weights, s, bits, group)
    if clip:  # on the scaled problem: (X / s) (diag(s) W)
        scaled, scaled_inputs = (weights * s[:, None]).astype(np.float32), (inputs / s).astype(np.float32)
        ratios = clip_search(scaled, scaled_inputs, bits, group)
        values, scales = formats.quantize_int(scaled.T, bits, group, ratios)
    return QuantizedMatrix.from_values(values, scales, bits, group, input_scale)
