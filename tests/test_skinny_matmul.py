"""kernels.skinny_matmul: the small-batch product reading W once, in both of W's layouts, against
the float64 reference; and the model sends it the steps of a few requests."""
import numpy as np
import pytest
from _numerics import fp32_tolerance
from hypothesis import given, settings
from hypothesis import strategies as st

from infra_lab.kernels import skinny_matmul


@pytest.mark.numerics
@settings(deadline=None, max_examples=40)
@given(batch=st.integers(1, skinny_matmul.MOST_ROWS), n_in=st.integers(1, 300), n_out=st.integers(1, 300),
       transposed=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_three_faces_agree_with_the_float64_reference(batch, n_in, n_out, transposed, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32).T if transposed else \
        rng.standard_normal((n_in, n_out)).astype(np.float32)  # the transpose of a row-major array, or row-major
    reference = skinny_matmul.matmul_numpy(x, w)
    bound = fp32_tolerance(n_in, np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))  # sum |x_i w_io|
    for face in (skinny_matmul.matmul_numba, lambda a, b: skinny_matmul.matmul_torch(a, b).numpy()):
        y = face(x, w)
        assert y.shape == (batch, n_out) and y.dtype == np.float32
        assert np.all(np.abs(y - reference) <= bound + fp32_tolerance(1, np.abs(reference)))


def test_any_other_layout_is_copied_first():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, 20)).astype(np.float32), rng.standard_normal((20, 40)).astype(np.float32)
    strided = w[:, ::2]  # neither layout
    np.testing.assert_allclose(skinny_matmul.matmul_numba(x, strided), x @ strided, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("face", [skinny_matmul.matmul_numpy, skinny_matmul.matmul_numba,
                                  skinny_matmul.matmul_torch])
def test_mismatched_shapes_get_a_clear_error(face):
    with pytest.raises(ValueError, match=r"x \(2, 5\) and W \(4, 3\)"):
        face(np.ones((2, 5), np.float32), np.ones((4, 3), np.float32))


def test_the_model_sends_2_to_a_few_rows_and_a_large_matrix_here_on_numba(monkeypatch):
    from infra_lab import backend, model

    target = model.load("target")
    numba = backend.resolve("numba", "cpu")
    calls = []
    real = skinny_matmul.matmul_numba
    monkeypatch.setattr(skinny_matmul, "matmul_numba", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    key = "layers.0.qkv"
    assert target.matrices[key].nbytes < skinny_matmul.SMALLEST_BYTES  # the small GPT's matrices: BLAS
    monkeypatch.setattr(skinny_matmul, "SMALLEST_BYTES", target.matrices[key].nbytes)
    assert all(m.T.flags.c_contiguous for m in target.matrices.values())  # each output's weights one row
    for rows in (1, 2, skinny_matmul.MOST_ROWS, skinny_matmul.MOST_ROWS + 1):
        x = np.random.default_rng(rows).standard_normal((rows, target.config.d_model)).astype(np.float32)
        np.testing.assert_allclose(target.linear(x, key, numba), x @ target.matrices[key], rtol=1e-4, atol=1e-4)
        target.linear(x, key, backend.resolve("numpy", "cpu"))  # numpy: always BLAS
    assert calls == [2, skinny_matmul.MOST_ROWS]  # one row: BLAS's GEMV reads the matrix once already
