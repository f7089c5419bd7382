import numpy as np
import pytest
from hypothesis import given, strategies as st

from infra_lab import backend
from infra_lab.kernels import attention as kernel
from infra_lab.kernels import online_softmax


def qkv(seed, heads, kv_heads, length, d):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((heads, length, d)).astype(np.float32),
            rng.standard_normal((kv_heads, length, d)).astype(np.float32),
            rng.standard_normal((kv_heads, length, d)).astype(np.float32))


@pytest.mark.numerics
@given(seed=st.integers(0, 2**32 - 1), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2]),
       length=st.integers(1, 300), d=st.sampled_from([1, 8, 64]), causal=st.booleans(),
       block_q=st.sampled_from([1, 16, 64]), block_k=st.sampled_from([1, 32, 256]))
def test_flash_attention_matches_the_float64_reference(seed, kv_heads, group, length, d, causal, block_q, block_k):
    q, k, v = qkv(seed, kv_heads * group, kv_heads, length, d)
    reference = kernel.attention_numpy(q, k, v, causal)
    got = kernel.attention_numba(q, k, v, causal, block_q=block_q, block_k=block_k)
    np.testing.assert_allclose(got, reference, rtol=1e-4, atol=2e-5)


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["numba", "torch", "numpy"])
def test_every_face_agrees(name):
    q, k, v = qkv(1, 4, 2, 130, 32)
    reference = kernel.attention_numpy(q, k, v, causal=True)
    got = kernel.attention(q, k, v, causal=True, backend=backend.resolve(name, "cpu"))
    np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.numerics
def test_the_vectorized_exp_is_accurate_down_to_underflow():
    x = np.concatenate([-np.logspace(-8, 2.2, 5000), [0.0, -87.0, -100.0, -1e4]]).astype(np.float32)
    out, bits = np.empty_like(x), np.empty(x.shape, np.int32)
    kernel._exp_nonpositive(x, out, bits)
    exact = np.exp(x.astype(np.float64))
    normal = exact > 1e-37
    # the kernel works in float64 (LOG2_E and LN_2 are Python floats) and rounds to float32 once, so
    # no CPU changes its error: the degree-6 Taylor remainder, |u|^7 / 7! e^-u <= 1.7e-7 at
    # |u| = ln 2 / 2, plus eps32 / 2 = 6e-8, 2.3e-7 in all (measured: 2.0e-7)
    assert np.all(np.abs(out[normal] - exact[normal]) <= 3e-7 * exact[normal])
    assert np.all(out[~normal] <= np.maximum(exact[~normal] * 1.01, 1.2e-38))  # flushed near 2^-126


def test_bad_shapes_get_clear_errors():
    q, k, v = qkv(0, 3, 2, 10, 8)
    with pytest.raises(ValueError, match="H must be a multiple of H_kv"):
        kernel.attention_numba(q, k, v)
    with pytest.raises(ValueError, match="need q \\(H, L, D\\)"):
        kernel.attention_numpy(q[0], k, v)
    with pytest.raises(ValueError, match="block sizes must be >= 1; got block_q=0"):
        kernel.attention_numba(q[:2], k, v, block_q=0)


@pytest.mark.numerics
@given(seed=st.integers(0, 2**32 - 1), split=st.integers(1, 19), scale=st.sampled_from([1.0, 50.0]))
def test_online_softmax_merge_equals_one_softmax(seed, split, scale):
    rng = np.random.default_rng(seed)
    scores, values = rng.standard_normal((3, 20)) * scale, rng.standard_normal((20, 5))
    whole = online_softmax.finish(online_softmax.partial(scores, values))
    merged = online_softmax.finish(online_softmax.merge(online_softmax.partial(scores[:, :split], values[:split]),
                                                        online_softmax.partial(scores[:, split:], values[split:])))
    np.testing.assert_allclose(merged, whole, rtol=1e-10)
    weights = np.exp(scores - scores.max(1, keepdims=True))
    np.testing.assert_allclose(whole, weights @ values / weights.sum(1, keepdims=True), rtol=1e-10)


@given(length=st.integers(1, 600), d=st.integers(1, 128), block_q=st.integers(1, 700))
def test_work_per_head_counts_what_each_kernel_moves(length, d, block_q):
    work = kernel.work_per_head(length, d, block_q)
    assert work["standard"] == (4 * length**2 * d, 4 * length * d + 4 * length**2)
    flops, elements = work["tiled"]
    blocks = -(-length // block_q)
    keys_read = sum(min(length, (b + 1) * block_q) for b in range(blocks))  # causal: up to the block
    assert elements == 2 * length * d + 2 * d * keys_read
    assert flops <= work["standard"][0]
    if block_q >= length:  # one block: Q, K, V read once, O written once
        assert elements == 4 * length * d
    non_causal = kernel.work_per_head(length, d, block_q, causal=False)["tiled"]
    assert non_causal == (4 * length**2 * d, 2 * length * d * (1 + blocks))


@given(length=st.integers(1, 600), d=st.integers(1, 128))
def test_tiled_flops_with_one_row_blocks_are_the_causal_pairs(length, d):
    from infra_lab import roofline

    flops, _ = kernel.work_per_head(length, d, block_q=1)["tiled"]
    assert flops == roofline.attention_prefill(length, 1, d, "fp32").flops


def test_work_per_head_names_bad_sizes():
    with pytest.raises(ValueError, match="got 0, 64, 256"):
        kernel.work_per_head(0, 64)
