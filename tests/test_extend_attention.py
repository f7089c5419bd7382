"""Extend attention: chunks of queries after a cached prefix, read through block tables. The
numba and torch faces against the float64 reference, over random prefixes, chunk lengths, block
sizes and GQA groups (the bar: float32's rounding, from the sizes: `tolerance`)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import backend
from infra_lab.kernels import extend_attention as ea
from infra_lab.kernels import paged_attention
from conftest import relative_error, scattered_pool, tolerance


cases = dict(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 4), longest_chunk=st.integers(1, 150),
             longest_prefix=st.integers(0, 300), n_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
             d=st.sampled_from([8, 16, 32]), block_size=st.sampled_from([1, 3, 16, 512]))


@pytest.mark.numerics
@settings(max_examples=40, deadline=None)
@given(**cases)
def test_numba_and_torch_faces_agree_with_the_reference(seed, batch, longest_chunk, longest_prefix, n_kv, group,
                                                        d, block_size):
    rng = np.random.default_rng(seed)
    args = scattered_pool(rng, rng.integers(1, longest_chunk + 1, batch), rng.integers(0, longest_prefix + 1, batch),
                          n_kv, group, d, block_size)
    reference = ea.extend_attention_numpy(*args)
    bound = tolerance(args, reference)  # measured: up to 0.03 of it (the old bar 1e-5: up to 0.11)
    assert relative_error(ea.extend_attention_numba(*args), reference) <= bound
    assert relative_error(ea.extend_attention_torch(*args), reference) <= bound


@pytest.mark.numerics
def test_one_query_per_sequence_is_paged_decode():
    args = scattered_pool(np.random.default_rng(0), [1, 1, 1], [40, 0, 17], 2, 2, 16, 4)
    q, k_pool, v_pool, tables, _, context = args
    reference = paged_attention.paged_decode_numpy(q, k_pool, v_pool, tables, context)
    assert relative_error(ea.extend_attention_numba(*args), reference) <= tolerance(args, reference)


@pytest.mark.numerics
def test_a_prefill_without_prefix_is_causal_attention():
    from infra_lab.kernels.attention import attention_numpy

    q, k_pool, v_pool, tables, starts, context = scattered_pool(np.random.default_rng(1), [70], [0], 2, 2, 16, 16)
    keys = paged_attention.gather(k_pool, tables, context)[0, :70]  # (70, K, D)
    values = paged_attention.gather(v_pool, tables, context)[0, :70]
    expected = attention_numpy(q.transpose(1, 0, 2), keys.transpose(1, 0, 2), values.transpose(1, 0, 2))
    got = ea.extend_attention_numba(q, k_pool, v_pool, tables, starts, context)
    reference = expected.transpose(1, 0, 2)
    assert relative_error(got, reference) <= tolerance((q, k_pool, v_pool, tables, starts, context), reference)


def test_work_is_dealt_heaviest_first_and_covers_every_row_once_per_kv_head():
    work = ea.tasks(np.array([0, 130, 131]), np.array([130, 500]), n_kv=2, tile_q=64)
    rows = sorted((first, end) for first, end, head in work if head == 0)
    assert rows == [(0, 64), (64, 128), (128, 130), (130, 131)]
    # work = rows x keys the last row sees: 64 x 128, 64 x 64, 1 x 500, 2 x 130
    assert [(first, end) for first, end, head in work if head == 0] == [(64, 128), (0, 64), (130, 131), (128, 130)]
    assert sorted(work[:, 2].tolist()) == [0] * 4 + [1] * 4


@pytest.mark.parametrize("face", sorted(ea.FACES))
def test_bad_metadata_is_named(face):
    if face not in backend.available():
        pytest.skip(f"{face} is not installed")
    q, k_pool, v_pool, tables, starts, context = scattered_pool(np.random.default_rng(2), [3, 2], [5, 0], 1, 1, 8, 4)
    run = ea.FACES[face]
    with pytest.raises(ValueError, match="query_starts must rise from 0"):
        run(q, k_pool, v_pool, tables, np.array([0, 4, 4]), context)
    with pytest.raises(ValueError, match="sequence 1 has 2 queries but context_lens 1"):
        run(q, k_pool, v_pool, tables, starts, np.array([8, 1]))
    bad = tables.copy()
    bad[0, 0] = 99
    with pytest.raises(ValueError, match="sequence 0's block table points outside the pool"):
        run(q, k_pool, v_pool, bad, starts, context)
    with pytest.raises(ValueError, match=r"need context_lens \(batch,\), query_starts \(batch \+ 1,\)"):
        run(q, k_pool, v_pool, tables, starts[:2], context)
