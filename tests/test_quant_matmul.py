"""quant.matmul: the dequantizing products on numpy, numba and torch agree with the float product
of the dequantized matrix, and QuantizedMatrix stores what formats.quantize_int gives."""
import unittest.mock

import numpy as np
import pytest
from _numerics import EPS32, fp32_tolerance
from hypothesis import given, settings
from hypothesis import strategies as st

from infra_lab import backend as backends
from infra_lab.quant import formats
from infra_lab.quant import matmul as qmatmul
from infra_lab.quant.matmul import QuantizedMatrix, matmul, matmul_numba, matmul_numpy, matmul_torch

FACES = [matmul_numpy, matmul_numba]
try:
    import torch  # noqa: F401

    FACES.append(matmul_torch)
except ImportError:
    pass


def tolerance(x, matrix, face) -> np.ndarray:
    """(batch, n_out): how far a float32 face may be from the float64 product x @ dequantize().
    Each output is a dot of n_in terms x_i w_i, each rounded up to three times on the way (x times
    its input scale, a code times its scale, the reference's dequantize()): at most (n_in + 3)
    eps32 sum_i |x_i w_i|. The packed kernel (3 and 4 bits) multiplies x by whole bytes (v + 8 in
    each nibble: up to 255) and the high nibble by x2 - 16 x1 before the two cancel to v x:
    rounding those costs up to eps/2 255 |x1| + 15 eps (|x2| + 16 |x1|) < 368 eps |x| s per
    input, and the running sum (up to 15 s sum |x|) eps/2 at each of a group's g/2 adds, 4 g eps
    |x| s per input: (368 + 4 g) eps32 sum_i |x_i| s_i."""
    scaled = np.abs(x.astype(np.float64) * (1.0 if matrix.input_scale is None else matrix.input_scale))
    weights = np.abs(matrix.dequantize().astype(np.float64))
    bound = fp32_tolerance(matrix.n_in + 3, scaled @ weights)
    if face is matmul_numba and matrix.bits != 8:
        scales = np.repeat(matrix.scales.astype(np.float64), matrix.group, axis=1).T  # (n_in, n_out): s_i
        bound = bound + (368 + 4 * matrix.group) * EPS32 * (scaled @ scales)
    return bound


@pytest.mark.numerics
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bits=st.sampled_from([3, 4, 8]),
       group=st.sampled_from([None, 2, 8, 32]), batch=st.integers(1, 5), n_out=st.integers(1, 9),
       input_scaled=st.booleans())
def test_every_face_computes_x_times_the_dequantized_matrix(seed, bits, group, batch, n_out, input_scaled):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((64, n_out)).astype(np.float32)
    x = rng.standard_normal((batch, 64)).astype(np.float32)
    matrix = QuantizedMatrix.quantize(weights, bits, group)
    if input_scaled:  # as AWQ leaves it: W = diag(input_scale) (values * scales)^T
        values, scales = matrix.values(), matrix.scales
        matrix = QuantizedMatrix.from_values(values, scales, bits, group, rng.uniform(0.5, 2, 64))
    exact = x.astype(np.float64) @ matrix.dequantize().astype(np.float64)
    for face in FACES:  # measured: up to 0.04 of the tolerance (numba, 3 and 4 bits), 0.02 elsewhere
        assert np.all(np.abs(face(x, matrix) - exact) <= tolerance(x, matrix, face)), face.__name__
    with unittest.mock.patch.object(qmatmul, "ONE_THREAD_BYTES", 0):  # numba's threads, even for this size
        assert np.all(np.abs(matmul_numba(x, matrix) - exact) <= tolerance(x, matrix, matmul_numba))


def test_one_thread_and_the_threads_give_the_same_bits():
    """A product under ONE_THREAD_BYTES runs on the calling thread; the same sums in the same
    order on the threads (each tile's outputs are one thread's), so the same floats."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    for bits, group in ((8, None), (4, 32)):
        matrix = QuantizedMatrix.quantize(rng.standard_normal((576, 320)).astype(np.float32), bits, group)
        assert 3 * matrix.tiles.nbytes < qmatmul.ONE_THREAD_BYTES
        alone = matmul_numba(x, matrix)
        with unittest.mock.patch.object(qmatmul, "ONE_THREAD_BYTES", 0):
            assert np.array_equal(matmul_numba(x, matrix), alone)


def test_the_matrix_holds_formats_codes_and_scales():
    weights = np.random.default_rng(0).standard_normal((16, 3)).astype(np.float32)
    matrix = QuantizedMatrix.quantize(weights, 4, 8)
    values, scales = formats.quantize_int(weights.T, 4, 8)
    assert (matrix.values() == values).all() and (matrix.scales == scales).all()
    low, high = matrix.codes[0, :4] & 15, matrix.codes[0, :4] >> 4  # the first group's two halves, as v + 8
    assert (low == values[0, :4] + 8).all() and (high == values[0, 4:8] + 8).all()
    assert matrix.codes.shape == (3, 8) and matrix.nbytes == 3 * 8 + 3 * 2 * 4  # float32 scales
    assert np.abs(matrix.dequantize() - weights).max() <= scales.astype(np.float32).max() / 2 * (1 + 1e-6)


@pytest.mark.parametrize("n_out, rows", [(192, 64), (256, 64), (96, 32), (40, 8), (3, 1)])
def test_tiles_put_up_to_64_outputs_side_by_side(n_out, rows):
    weights = np.random.default_rng(n_out).standard_normal((32, n_out)).astype(np.float32)
    for bits in (8, 4):
        matrix = QuantizedMatrix.quantize(weights, bits, 16)
        tiles, codes = matrix.tiles, matrix.codes
        assert tiles.shape == (n_out // rows, codes.shape[1], rows)
        for t, j, r in [(0, 0, 0), (n_out // rows - 1, codes.shape[1] - 1, rows - 1), (0, 1, rows // 2)]:
            assert tiles[t, j, r] == codes[t * rows + r, j]  # byte j of output t * rows + r
        assert matrix.tile_scales[-1, 1, -1] == matrix.scales[-1, 1]


def test_the_current_backend_picks_the_face():
    weights = np.eye(8, dtype=np.float32)
    matrix = QuantizedMatrix.quantize(weights, 8)
    x = np.arange(8, dtype=np.float32)[None]
    with backends.using("numpy"):
        assert np.allclose(matmul(x, matrix), x, atol=0.05)


@pytest.mark.parametrize("call, error, message", [
    (lambda: QuantizedMatrix.quantize(np.zeros((8, 2)), 2), ValueError, "packed two to a byte; got bits=2"),
    (lambda: QuantizedMatrix.from_values(np.full((2, 8), 4), np.ones((2, 1)), 3, None), ValueError,
     r"3-bit values must be in \[-4, 3\]; got 4..4"),
    (lambda: QuantizedMatrix.from_values(np.zeros((2, 8)), np.ones((2, 2)), 8, None), ValueError,
     r"need scales \(2, 1\) for groups of 8; got \(2, 2\)"),
    (lambda: QuantizedMatrix.from_values(np.zeros((2, 8)), np.ones((2, 1)), 8, None, np.ones(7)), ValueError,
     r"input_scale must be \(8,\); got \(7,\)"),
    (lambda: QuantizedMatrix.quantize(np.zeros(8), 8), ValueError, r"need a matrix \(n_in, n_out\); got shape \(8,\)"),
    (lambda: QuantizedMatrix.quantize(np.zeros((10, 2)), 8, 4), ValueError, "divide the row of 10 values; got 4"),
    (lambda: QuantizedMatrix.quantize(np.zeros((9, 2)), 4, 3), ValueError, "the group size must be even; got 3"),
    (lambda: matmul_numpy(np.zeros((1, 7)), QuantizedMatrix.quantize(np.zeros((8, 2)), 8)), ValueError,
     r"x must be \(batch, 8\) for a \(8, 2\) matrix; got \(1, 7\)"),
    (lambda: matmul_numba(np.zeros((1, 8)), np.zeros((8, 2))), TypeError, "need a QuantizedMatrix"),
])
def test_bad_input_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()
