"""GPTQ (chapter 08): round the weights one input at a time, and let the inputs not yet rounded
absorb each rounding error (Frantar et al., "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", ICLR 2023, Algorithm 1).

Rounding to nearest (RTN) treats every weight alone. GPTQ instead minimizes the error of the
layer's output on calibration inputs X, ||X W - X Q||^2, whose curvature is the Hessian
H = 2 X^T X (n_in, n_in). After input i is rounded, the best correction of the weights of the
inputs after it is the error divided by [H^-1]_ii times row i of H^-1 restricted to those inputs
(the Optimal Brain Surgeon update), and the rows of the upper Cholesky factor U of H^-1
(H^-1 = U^T U) are exactly these rows for one input after another, so one factorization serves
every step. The paper's "columns" are our inputs: W (n_in, n_out) is kept as its transpose
(n_out, n_in), each output's n_in weights quantized along n_in, and a step handles input i of
every output at once. With groups, a group's scales are set from the weights as updated so far,
when the loop enters it. H is dampened by `damp` times its mean diagonal, and inputs that never
fire (H_ii = 0) get H_ii = 1 and zero weights, as the paper's code does. The paper's lazy batches
(a speed-up that gives the same result) are left out for clarity.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from infra_lab.quant import formats, matmul
from infra_lab.quant.matmul import QuantizedMatrix


def check_calibration(weights, inputs) -> tuple[np.ndarray, np.ndarray]:
    """W (n_in, n_out) and calibration inputs X (n_samples, n_in) as float32, or a ValueError that
    names what is wrong. Shared by the methods that fit W to X (GPTQ, AWQ, SmoothQuant)."""
    weights = np.asarray(weights, np.float32)
    if weights.ndim != 2 or weights.size == 0:
        raise ValueError(f"weights must be a non-empty matrix (n_in, n_out); got shape {weights.shape}")
    n_in, n_out = weights.shape
    inputs = np.asarray(inputs, np.float32)
    if inputs.ndim != 2 or inputs.shape[1] != n_in:
        raise ValueError(f"calibration inputs must be (n_samples, {n_in}) for a ({n_in}, {n_out}) matrix; "
                         f"got {inputs.shape}")
    if inputs.shape[0] == 0:
        raise ValueError(f"calibration needs at least one input row; got {inputs.shape}")
    if not (np.isfinite(weights).all() and np.isfinite(inputs).all()):
        raise ValueError("weights and calibration inputs must be finite; got NaN or inf")
    return weights, inputs


def check_format(n_in: int, bits, group) -> None:
    """Raise the matrix's own error for `bits` or a `group` that rows of n_in inputs cannot take,
    before any work is done."""
    matmul.check_bits(bits)
    formats.groups_of(np.zeros((1, n_in)), group)  # names a group that does not divide n_in
    QuantizedMatrix.from_values(np.zeros((1, n_in), np.int8), np.zeros((1, n_in // (group or n_in))), bits, group)


def hessian(inputs: np.ndarray, damp: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """H = 2 X^T X (n_in, n_in) float64, dampened, and the dead inputs (n_in,) bool: those no
    calibration row uses, which get H_ii = 1 (their weights are set to 0)."""
    inputs = np.asarray(inputs, np.float64)  # (n_samples, n_in)
    h = 2 * inputs.T @ inputs  # (n_in, n_in)
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    h[np.diag_indices_from(h)] += damp * np.mean(np.diag(h))
    return h, dead


def inverse_cholesky(h: np.ndarray) -> np.ndarray:
    """U (n_in, n_in) float64, upper triangular with H^-1 = U^T U. Row i, from column i on, is the
    direction in which rounding input i moves the inputs after it (scaled by 1 / U_ii). Raises
    numpy's LinAlgError if H is not positive definite."""
    lower = np.linalg.cholesky(h)  # H = L L^T
    lower_inverse = np.linalg.inv(lower)
    return np.linalg.cholesky(lower_inverse.T @ lower_inverse).T  # H^-1 = L^-T L^-1 = U^T U


def group_scales(block: np.ndarray, bits: int) -> np.ndarray:
    """fp16 scales (n_out,) for one group's weights (n_out, group), by formats.quantize_int's rule:
    max |w| / q_max, rounded up to fp16 so that no weight of the block clips."""
    return formats.quantize_int(block, bits, None)[1][:, 0]


class ColumnStep(NamedTuple):
    weights_t: np.ndarray  # float32 (n_out, n_in): column `column` now holds its quantized value
    values: np.ndarray  # int8 (n_out,): the integer codes of column `column`
    error: np.ndarray  # float32 (n_out,): (w - q) / U[column, column], the error spread onward


def column_update(weights_t: np.ndarray, h_inv_chol: np.ndarray, column: int, scales: np.ndarray,
                  group: int | None, bits: int) -> ColumnStep:
    """One GPTQ step, without touching its arguments: round input `column` of every output
    (weights_t (n_out, n_in), the weights as updated so far) with its group's scales
    (scales (n_out, n_in / group), fp16), then subtract the error times row `column` of
    U = h_inv_chol from the inputs after it. Returns the updated weights, the codes and the error."""
    weights_t = np.array(weights_t, np.float32)
    values, error = _round_column(weights_t, np.asarray(h_inv_chol, np.float32), column, scales,
                                  group or weights_t.shape[1], 2 ** (bits - 1) - 1)
    return ColumnStep(weights_t, values, error)


def _round_column(weights_t, u, column, scales, group, q_max) -> tuple[np.ndarray, np.ndarray]:
    """column_update in place on weights_t (n_out, n_in) float32, with U (n_in, n_in) float32."""
    scale = np.asarray(scales)[:, column // group].astype(np.float32)  # (n_out,)
    w = weights_t[:, column].copy()  # (n_out,)
    safe = np.where(scale > 0, scale, 1)
    values = np.where(scale > 0, np.clip(np.rint(w / safe), -q_max, q_max), 0).astype(np.int8)
    quantized = values * scale  # (n_out,) float32
    error = (w - quantized) / u[column, column]  # (n_out,)
    weights_t[:, column + 1:] -= error[:, None] * u[column, column + 1:]  # (n_out, n_in - column - 1)
    weights_t[:, column] = quantized
    return values, error


def gptq(weights, inputs, bits: int, group: int | None = None, damp: float = 0.01) -> QuantizedMatrix:
    """W (n_in, n_out) quantized to `bits` (8, 4 or 3) with a scale per `group` inputs of each
    output (None: per channel), fitted to calibration inputs (n_samples, n_in) by GPTQ."""
    weights, inputs = check_calibration(weights, inputs)
    n_in, n_out = weights.shape
    check_format(n_in, bits, group)
    if isinstance(damp, bool) or not isinstance(damp, numbers.Real) or not (math.isfinite(damp) and damp >= 0):
        raise ValueError(f"damp must be a finite number >= 0 (a fraction of H's mean diagonal; the paper uses "
                         f"0.01); got {damp!r}")
    h, dead = hessian(inputs, damp)
    try:
        u = inverse_cholesky(h).astype(np.float32)  # (n_in, n_in)
    except np.linalg.LinAlgError:
        raise ValueError(f"H = 2 X^T X is singular even after damping by damp={damp} of its mean diagonal; "
                         f"use more calibration rows or a larger damp") from None
    weights_t = weights.T.copy()  # (n_out, n_in): output o's weights, updated in place (a copy: W stays)
    weights_t[:, dead] = 0
    group = group or n_in
    q_max = 2 ** (bits - 1) - 1
    scales = np.zeros((n_out, n_in // group), np.float16)
    values = np.zeros((n_out, n_in), np.int8)
    for column in range(n_in):
        if column % group == 0:  # entering a group: its scales come from the weights updated so far
            scales[:, column // group] = group_scales(weights_t[:, column:column + group], bits)
        values[:, column], _ = _round_column(weights_t, u, column, scales, group, q_max)
    return QuantizedMatrix.from_values(values, scales, bits, group)
