import numpy as np
import pytest
from hypothesis import given, strategies as st

from infra_lab import backend
from infra_lab.kernels import gemv


@pytest.mark.numerics
@given(n_out=st.integers(1, 300), n_in=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_three_faces_agree_with_the_float64_reference(n_out, n_in, seed):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n_out, n_in)).astype(np.float32)
    x = rng.standard_normal(n_in).astype(np.float32)
    reference = gemv.gemv_numpy(weights.astype(np.float64), x.astype(np.float64))
    scale = np.abs(weights).sum(axis=1) * np.abs(x).max() + 1e-30  # |W||x| per row
    for name in backend.available():
        y = gemv.gemv(weights, x, backend.resolve(name, "cpu"))
        assert y.shape == (n_out,)
        assert np.all(np.abs(y - reference) <= 1e-5 * scale), name


def test_torch_face_keeps_tensors_on_their_device():
    torch = pytest.importorskip("torch")
    weights, x = torch.ones(3, 4), torch.ones(4)
    assert torch.equal(gemv.gemv_torch(weights, x), torch.full((3,), 4.0))


@pytest.mark.parametrize("face", [gemv.gemv_numpy, gemv.gemv_numba, gemv.gemv_torch])
def test_mismatched_shapes_get_a_clear_error(face):
    with pytest.raises(ValueError, match=r"W \(3, 4\) and x \(5,\)"):
        face(np.ones((3, 4), np.float32), np.ones(5, np.float32))
