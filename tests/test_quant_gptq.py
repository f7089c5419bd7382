"""quant.gptq: GPTQ agrees with a brute-force Optimal Brain Surgeon loop that inverts the remaining
Hessian at every step, equals round-to-nearest when the Hessian is diagonal, beats it on
correlated inputs, and sets each group's scales from the weights as updated when the loop
enters the group."""
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from infra_lab.quant import formats
from infra_lab.quant.gptq import column_update, gptq, group_scales, hessian, inverse_cholesky
from infra_lab.quant.matmul import QuantizedMatrix


def correlated_inputs(rng, n_samples, n_in):
    """(n_samples, n_in) float32 with correlated channels of different sizes, as activations are."""
    mixing = rng.standard_normal((n_in, n_in)) + 2 * np.eye(n_in)
    return (rng.standard_normal((n_samples, n_in)) @ mixing * rng.uniform(0.2, 3, n_in)).astype(np.float32)


def output_error(inputs, weights, matrix):
    """||X W - X W_q||^2 in float64."""
    return float(np.sum((inputs.astype(np.float64) @ (weights.astype(np.float64) - matrix.dequantize())) ** 2))


def brute_force_gptq(weights, inputs, bits, group, damp=0.01):
    """GPTQ as the sequential OBS update of the paper's eq. (2)-(3): round input c of each output,
    then move the inputs c.. by -(w - q) / [H_F^-1]_00 * [H_F^-1]_{:,0}, with H_F^-1 the inverse
    of H restricted to the inputs not yet rounded, inverted afresh. float64, one weight at a time.
    Returns (values, scales, clean): clean (n_out,) marks the outputs where no rounding (of a
    weight or a scale) came so close to a tie that float32 and float64 could round differently."""
    n_in, n_out = weights.shape
    h = 2 * inputs.astype(np.float64).T @ inputs.astype(np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    h += damp * np.mean(np.diag(h)) * np.eye(n_in)
    weights_t = weights.T.astype(np.float64)
    weights_t[:, dead] = 0
    group = group or n_in
    q_max = 2 ** (bits - 1) - 1
    values = np.zeros((n_out, n_in), np.int64)
    scales = np.zeros((n_out, n_in // group), np.float16)
    clean = np.ones(n_out, bool)
    for c in range(n_in):
        h_inv = np.linalg.inv(h[c:, c:])  # the inputs c.. not yet rounded
        for o in range(n_out):
            if c % group == 0:
                block = weights_t[o, c:c + group]
                exact = np.abs(block).max() / q_max
                scales[o, c // group] = formats.quantize_int(block[None], bits, None)[1][0, 0]
                clean[o] &= exact == 0 or abs(exact - float(np.float16(exact))) > 1e-5 * exact
            scale = float(scales[o, c // group])
            ratio = weights_t[o, c] / scale if scale > 0 else 0.0
            clean[o] &= abs(abs(ratio - np.floor(ratio)) - 0.5) > 1e-4 * (1 + abs(ratio))
            values[o, c] = min(max(round(ratio), -q_max), q_max)
            error = weights_t[o, c] - values[o, c] * scale
            weights_t[o, c:] -= error / h_inv[0, 0] * h_inv[:, 0]
    return values, scales, clean


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bits=st.sampled_from([3, 4, 8]), group=st.sampled_from([None, 4, 8]),
       n_in=st.sampled_from([8, 16]), n_out=st.integers(1, 5), n_dead=st.integers(0, 2))
def test_gptq_equals_the_brute_force_obs_loop(seed, bits, group, n_in, n_out, n_dead):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n_in, n_out)).astype(np.float32)
    inputs = correlated_inputs(rng, 3 * n_in, n_in)
    inputs[:, rng.choice(n_in, n_dead, replace=False)] = 0  # inputs that never fire
    expected_values, expected_scales, clean = brute_force_gptq(weights, inputs, bits, group)
    assume(clean.any())
    given_weights = weights.copy()
    matrix = gptq(weights, inputs, bits, group)
    assert (weights == given_weights).all()  # the caller's W is left as it was
    assert (matrix.values()[clean] == expected_values[clean]).all()
    assert (matrix.scales[clean] == expected_scales[clean]).all()
    q_max = 2 ** (bits - 1) - 1
    assert np.abs(matrix.values()).max() <= q_max and (matrix.scales >= 0).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bits=st.sampled_from([3, 4, 8]), group=st.sampled_from([None, 2, 8]),
       n_out=st.integers(1, 6), damp=st.sampled_from([0.0, 0.01, 0.5]))
def test_a_diagonal_hessian_gives_round_to_nearest(seed, bits, group, n_out, damp):
    """Inputs that are a signed permutation of a diagonal matrix have H diagonal: no input's error
    reaches another, and GPTQ is RTN (with dead inputs' weights set to 0)."""
    rng = np.random.default_rng(seed)
    n_in = 16
    weights = rng.standard_normal((n_in, n_out)).astype(np.float32)
    sizes = rng.uniform(0.1, 10, n_in) * (rng.random(n_in) > 0.2 if damp > 0 else 1)  # some dead if damped
    inputs = (np.diag(sizes) * rng.choice([-1, 1], n_in))[rng.permutation(n_in)].astype(np.float32)
    h, dead = hessian(inputs, damp)
    assert (h == np.diag(np.diag(h))).all()
    rtn = QuantizedMatrix.quantize(np.where(dead[:, None], 0, weights), bits, group)
    matrix = gptq(weights, inputs, bits, group, damp)
    assert (matrix.values() == rtn.values()).all() and (matrix.scales == rtn.scales).all()


@pytest.mark.parametrize("group", [None, 16])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(group):
    ratios = []
    for seed in range(12):
        rng = np.random.default_rng(seed)
        weights = rng.standard_normal((64, 24)).astype(np.float32)
        inputs = correlated_inputs(rng, 256, 64)
        ratios.append(output_error(inputs, weights, gptq(weights, inputs, 4, group))
                      / output_error(inputs, weights, QuantizedMatrix.quantize(weights, 4, group)))
    assert max(ratios) < 0.8 and np.mean(ratios) < 0.6, ratios  # about 0.5 on these


def test_group_scales_come_from_the_updated_weights():
    rng = np.random.default_rng(1)
    weights = rng.standard_normal((32, 6)).astype(np.float32)
    inputs = correlated_inputs(rng, 128, 32)
    matrix = gptq(weights, inputs, 4, 8)
    u = inverse_cholesky(hessian(inputs)[0])
    weights_t, scales = weights.T.copy(), np.zeros((6, 4), np.float16)
    for column in range(32):  # GPTQ's loop, by hand, with the public step
        if column % 8 == 0:
            scales[:, column // 8] = group_scales(weights_t[:, column:column + 8], 4)
        weights_t = column_update(weights_t, u, column, scales, 8, 4).weights_t
    rtn = QuantizedMatrix.quantize(weights, 4, 8)
    assert (matrix.scales == scales).all()
    assert (matrix.scales[:, 0] == rtn.scales[:, 0]).all()  # nothing is updated before the first group
    assert (matrix.scales[:, 1:] != rtn.scales[:, 1:]).any()  # later groups see the spread errors
    assert np.allclose(weights_t, matrix.dequantize().T)  # every column ends as its quantized value


def test_one_column_step_by_hand():
    weights_t = np.array([[0.30, -0.20, 0.10], [-0.50, 0.25, 0.40]], np.float32)  # (n_out 2, n_in 3)
    u = np.array([[2.0, 0.5, -1.0], [0.0, 1.0, 0.25], [0.0, 0.0, 0.5]])  # H^-1 = U^T U
    scales = np.array([[0.125], [0.25]], np.float16)  # per channel, 4 bits: q_max 7
    step = column_update(weights_t, u, 0, scales, None, 4)
    # row 0: 0.30 / 0.125 = 2.4 -> 2 (0.25), error (0.30 - 0.25) / 2 = 0.025, moved along U's row 0:
    #   -0.20 - 0.025 * 0.5 = -0.2125 and 0.10 - 0.025 * -1 = 0.125; row 1: -0.5 / 0.25 = -2 exactly
    assert (step.values == [2, -2]).all()
    assert np.allclose(step.error, [0.025, 0.0])
    assert np.allclose(step.weights_t, [[0.25, -0.2125, 0.125], [-0.5, 0.25, 0.40]])
    assert weights_t[0, 0] == np.float32(0.30)  # the argument is left as it was
    step = column_update(step.weights_t, u, 1, scales, None, 4)
    # row 0: -0.2125 / 0.125 = -1.7 -> -2 (-0.25), error 0.0375 / 1, so 0.125 - 0.0375 * 0.25 = 0.115625
    assert (step.values == [-2, 1]).all()
    assert np.allclose(step.weights_t, [[0.25, -0.25, 0.115625], [-0.5, 0.25, 0.40]])
    clipped = column_update(np.array([[2.0, 0.0, 0.0]]), u, 0, np.array([[0.125]]), None, 4)
    assert clipped.values[0] == 7 and np.isclose(clipped.error[0], (2.0 - 0.875) / 2)


@pytest.mark.numerics
def test_the_upper_factor_inverts_h():
    inputs = correlated_inputs(np.random.default_rng(2), 40, 10)
    h, _ = hessian(inputs, 0.01)
    u = inverse_cholesky(h)
    assert np.allclose(u, np.triu(u)) and np.allclose(u.T @ u @ h, np.eye(10), atol=1e-8)


W = np.zeros((8, 2), np.float32)
X = np.ones((4, 8), np.float32)


@pytest.mark.parametrize("call, message", [
    (lambda: gptq(W, np.ones((4, 7)), 4), r"calibration inputs must be \(n_samples, 8\) for a \(8, 2\) matrix; "
                                          r"got \(4, 7\)"),
    (lambda: gptq(W, np.ones((0, 8)), 4), r"at least one input row; got \(0, 8\)"),
    (lambda: gptq(np.zeros(8), X, 4), r"weights must be a non-empty matrix \(n_in, n_out\); got shape \(8,\)"),
    (lambda: gptq(W, X * np.nan, 4), "must be finite"),
    (lambda: gptq(W, X, 2), "packed two to a byte; got bits=2"),
    (lambda: gptq(W, X, 4, 3), "divide the row of 8 values; got 3"),
    (lambda: gptq(np.zeros((6, 2)), np.ones((4, 6)), 4, 3), "the group size must be even; got 3"),
    (lambda: gptq(W, X, 4, damp=-0.1), "damp must be a finite number >= 0 .*; got -0.1"),
    (lambda: gptq(W, X, 4, damp=0), r"singular even after damping by damp=0"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
