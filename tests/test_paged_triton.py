"""The GPU face of paged decode attention, run on the CPU under Triton's interpreter, against the
numpy reference. On a GPU the same kernel is compiled; benchmarks/paged_gpu.py checks it there."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run as numpy on the CPU

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from infra_lab.kernels import paged_attention  # noqa: E402
from infra_lab.kernels.paged_attention_triton import default_split_tokens, paged_decode_triton  # noqa: E402


def side_by_side_pool(rng, batch, length, n_kv, group, d, block_size):
    """q, k_pool, v_pool (views of one K-beside-V pool, as PagedKVCache keeps them), tables, lengths."""
    per_seq = -(-length // block_size)
    num_blocks = batch * per_seq + 2
    pool = rng.standard_normal((num_blocks, 2, block_size, n_kv, d)).astype(np.float32)
    tables = rng.permutation(num_blocks)[: batch * per_seq].reshape(batch, per_seq)
    lengths = rng.integers(1, length + 1, size=batch)
    q = rng.standard_normal((batch, n_kv * group, d)).astype(np.float32)
    return q, pool[:, 0], pool[:, 1], tables, lengths


@pytest.mark.numerics
@settings(max_examples=25)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 3), length=st.integers(1, 150),
       n_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]), d=st.sampled_from([8, 24]),
       block_size=st.sampled_from([1, 5, 16]), tile=st.sampled_from([8, 32]),
       split_tokens=st.sampled_from([None, 8, 40]))
@pytest.mark.slow
def test_triton_kernel_agrees_with_the_reference(seed, batch, length, n_kv, group, d, block_size, tile, split_tokens):
    args = side_by_side_pool(np.random.default_rng(seed), batch, length, n_kv, group, d, block_size)
    reference = paged_attention.paged_decode_numpy(*args)
    got = paged_decode_triton(*(torch.from_numpy(x) for x in args), tile=tile, split_tokens=split_tokens)
    np.testing.assert_allclose(got.numpy(), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.numerics
def test_triton_kernel_keeps_bf16_and_reads_past_tables_padded_with_minus_one():
    q, k_pool, v_pool, tables, _ = side_by_side_pool(np.random.default_rng(0), 2, 40, 2, 2, 8, 16)
    tables[1, 1:] = -1  # sequence 1 holds 9 tokens: one block, then padding the kernel must not read
    lengths = np.array([40, 9])
    reference = paged_attention.paged_decode_numpy(q, k_pool, v_pool, tables, lengths)
    args = [torch.from_numpy(x) for x in (q, k_pool, v_pool)]
    got = paged_decode_triton(*(x.to(torch.bfloat16) for x in args), torch.from_numpy(tables), torch.from_numpy(lengths))
    assert got.dtype == torch.bfloat16
    np.testing.assert_allclose(got.float().numpy(), reference, atol=0.05)  # bf16 inputs: 3 significant digits


def test_triton_kernel_names_a_tile_that_is_not_a_power_of_two():
    args = [torch.from_numpy(x) for x in side_by_side_pool(np.random.default_rng(0), 1, 20, 1, 1, 8, 4)]
    with pytest.raises(ValueError, match="tile must be a power of two; got 24"):
        paged_decode_triton(*args, tile=24)


def test_split_size_is_whole_tiles_aimed_at_eight_programs_per_sm():
    cpu = torch.device("cpu")  # one "SM": splits of at least a tile, a multiple of it
    assert default_split_tokens(batch=1, n_heads=1, max_len=1000, tile=64, device=cpu) == 128
    assert default_split_tokens(batch=64, n_heads=8, max_len=1000, tile=64, device=cpu) == 1024


def test_the_torch_face_gathers_on_the_cpu():
    assert not paged_attention.uses_triton(torch.device("cpu"))


def test_triton_kernel_names_shapes_that_do_not_fit():
    q, k_pool, v_pool, tables, lengths = (torch.from_numpy(x) for x in
                                          side_by_side_pool(np.random.default_rng(0), 2, 20, 1, 1, 8, 4))
    with pytest.raises(ValueError, match=r"need block_tables \(batch=2, max_blocks\) and lengths \(2,\); got \(1, 5\)"):
        paged_decode_triton(q, k_pool, v_pool, tables[:1], lengths)
    with pytest.raises(ValueError, match="d must match"):
        paged_decode_triton(q[..., :4], k_pool, v_pool, tables, lengths)
