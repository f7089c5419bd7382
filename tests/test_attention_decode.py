import numpy as np
import pytest
from hypothesis import given, strategies as st

from infra_lab import backend
from infra_lab.kernels import attention_decode as kernel


def inputs(seed, batch, n_kv, group, d, max_len):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, n_kv * group, d)).astype(np.float32)
    k = rng.standard_normal((batch, max_len, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((batch, max_len, n_kv, d)).astype(np.float32)
    lengths = rng.integers(1, max_len + 1, size=batch)
    return q, k, v, lengths


@pytest.mark.numerics
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 4), n_kv=st.integers(1, 3),
       group=st.sampled_from([1, 2, 4]), d=st.sampled_from([1, 8, 64]), max_len=st.integers(1, 80))
def test_three_faces_agree_with_the_float64_reference(seed, batch, n_kv, group, d, max_len):
    q, k, v, lengths = inputs(seed, batch, n_kv, group, d, max_len)
    reference = kernel.decode_attention_numpy(q, k, v, lengths)
    for name in backend.available():
        got = kernel.decode_attention(q, k, v, lengths, backend.resolve(name, "cpu"))
        assert got.shape == reference.shape
        np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.numerics
def test_positions_past_the_length_are_ignored():
    q, k, v, lengths = inputs(0, 2, 2, 2, 16, 12)
    lengths = np.array([5, 12])
    poisoned_k, poisoned_v = k.copy(), v.copy()
    poisoned_k[0, 5:] = 1e6
    poisoned_v[0, 5:] = np.nan
    np.testing.assert_allclose(kernel.decode_attention_numba(q, poisoned_k, poisoned_v, lengths),
                               kernel.decode_attention_numba(q, k, v, lengths), rtol=1e-6)


@pytest.mark.parametrize("face", list(kernel.FACES.values()))
def test_bad_shapes_and_lengths_are_named(face):
    q, k, v, _ = inputs(0, 2, 2, 2, 8, 10)
    with pytest.raises(ValueError, match=r"lengths must be 2 values in \[1, 10\]; got \[0, 3\]"):
        face(q, k, v, np.array([0, 3]))
    with pytest.raises(ValueError, match="n_heads must be a multiple of n_kv_heads"):
        face(q[:, :3], k, v, np.array([1, 3]))
