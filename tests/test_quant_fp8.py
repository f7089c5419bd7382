"""quant.fp8: x W with both in fp8 e4m3 and per-tensor scales, on numpy, numba and torch."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra_lab.quant import formats
from infra_lab.quant.fp8 import Fp8Matrix, matmul_numba, matmul_numpy, quantize_input, tensor_scale

FACES = [matmul_numpy, matmul_numba]
try:
    from infra_lab.quant.fp8 import matmul_torch

    import torch  # noqa: F401

    FACES.append(matmul_torch)
except ImportError:
    pass


@pytest.mark.numerics
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 6), n_in=st.integers(1, 40), n_out=st.integers(1, 9),
       magnitude=st.sampled_from([1e-3, 1.0, 1e3]))
def test_every_face_multiplies_the_rounded_operands(seed, batch, n_in, n_out, magnitude):
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((n_in, n_out)) * magnitude).astype(np.float32)
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    matrix = Fp8Matrix.quantize(weights)
    codes, x_scale = quantize_input(x)
    exact = (formats.decode(codes, formats.E4M3).astype(np.float64) * x_scale) @ matrix.dequantize().astype(np.float64)
    size = np.abs(x).max() * np.abs(weights).max() * n_in
    for face in FACES:
        assert np.allclose(face(x, matrix), exact, rtol=1e-5, atol=1e-6 * size), face.__name__


def test_the_scale_puts_the_largest_weight_on_448():
    weights = np.array([[0.5, -2.0], [1.0, 0.25]], np.float32)
    matrix = Fp8Matrix.quantize(weights)
    assert matrix.scale == np.float32(2.0 / 448)
    assert formats.decode(matrix.codes, formats.E4M3).min() == -448
    assert np.abs(matrix.dequantize() - weights).max() <= 2.0 * 2**-4  # e4m3's relative step is 2^-3
    assert tensor_scale(np.zeros(3)) == 1 and matrix.nbytes == 4 + 4


@pytest.mark.parametrize("call, error, message", [
    (lambda: Fp8Matrix.quantize(np.zeros(4)), ValueError, r"need a matrix \(n_in, n_out\); got shape \(4,\)"),
    (lambda: Fp8Matrix.quantize(np.array([[np.inf]])), ValueError, r"finite values to scale; got max \|x\| = inf"),
    (lambda: matmul_numpy(np.zeros((1, 3)), Fp8Matrix.quantize(np.ones((4, 2)))), ValueError,
     r"x must be \(batch, 4\) for a \(4, 2\) matrix; got \(1, 3\)"),
    (lambda: matmul_numba(np.zeros((1, 4)), np.ones((4, 2))), TypeError, "need an Fp8Matrix"),
])
def test_bad_input_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()
