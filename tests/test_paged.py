"""The paged KV cache against a brute-force model: random allocate/append/fork/free sequences."""
import numba
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import backend
from infra_lab.kernels import paged_attention
from infra_lab.kv.paged import BlockAllocator, OutOfBlocks, PagedKVCache


def snapshot(cache: PagedKVCache):
    a = cache.allocator
    return (repr(cache.tables), repr(cache.lengths), list(a.ref_counts), list(a.free_ids), list(a.cached.items()),
            repr(cache.hash_to_block), cache.k.copy(), cache.v.copy())


def check_invariants(cache: PagedKVCache):
    a = cache.allocator
    free = set(a.free_ids) | set(a.cached)
    assert len(free) == len(a.free_ids) + len(a.cached)  # no block listed twice
    for block in range(a.num_blocks):
        owners = sum(table.count(block) for table in cache.tables.values())
        assert a.ref_counts[block] == owners, (block, a.ref_counts[block], owners)
        assert (block in free) == (owners == 0), block  # free or referenced, never both
    for seq, table in cache.tables.items():
        assert len(table) == -(-cache.lengths[seq] // cache.block_size)


def append(cache: PagedKVCache, seq: int, values: list[float]):
    cache.reserve(seq, len(values))
    rows = np.array(values, np.float32)[:, None, None] * np.ones((1,) + cache.k.shape[3:], np.float32)
    for layer in range(cache.k.shape[0]):
        cache.write(seq, layer, rows + layer, -rows)
    cache.commit(seq, [int(abs(v)) % 7 for v in values])


operations = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free"]), st.integers(0, 10**6),
                                st.integers(1, 9)), min_size=1, max_size=60)


@settings(max_examples=300)
@given(ops=operations, num_blocks=st.integers(1, 12), block_size=st.integers(1, 5), sharing=st.booleans())
def test_random_operations_keep_every_invariant(ops, num_blocks, block_size, sharing):
    cache = PagedKVCache(2, 1, 2, num_blocks, block_size, prefix_sharing=sharing)
    model: dict[int, list[float]] = {}
    for op, pick, n in ops:
        live = sorted(model)
        seq = live[pick % len(live)] if live else None
        before = snapshot(cache)
        try:
            if op == "new" or seq is None:
                model[cache.new_sequence()] = []
            elif op == "append":
                values = [float(pick % 97 + i) for i in range(n)]
                append(cache, seq, values)
                model[seq] += values
            elif op == "fork":
                model[cache.fork(seq)] = list(model[seq])
            else:
                cache.free(seq)
                del model[seq]
        except OutOfBlocks:
            after = snapshot(cache)
            assert all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(before, after))
        check_invariants(cache)
        for s, values in model.items():  # contents match the brute-force model, forks included
            keys, vals = cache.gather(s, 1, len(values))
            assert np.array_equal(keys[:, 0, 0], np.array(values, np.float32) + 1)
            assert np.array_equal(vals[:, 0, 0], -np.array(values, np.float32))
    for seq in list(model):
        cache.free(seq)
    assert cache.allocator.num_free == num_blocks  # nothing leaks
    check_invariants(cache)


def test_fork_then_append_copies_the_shared_last_block_only():
    cache = PagedKVCache(1, 1, 1, 8, 4)
    parent = cache.new_sequence()
    append(cache, parent, [1, 2, 3, 4, 5, 6])  # blocks: full, half
    child = cache.fork(parent)
    assert cache.tables[child] == cache.tables[parent]
    assert cache.blocks_needed(child, 1) == 1
    append(cache, child, [9])
    assert cache.tables[child][0] == cache.tables[parent][0]  # the full block stays shared
    assert cache.tables[child][1] != cache.tables[parent][1]  # the written one was copied
    assert cache.gather(parent, 0, 6)[0][:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6]
    assert cache.gather(child, 0, 7)[0][:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6, 9]


def test_a_blocks_k_and_v_sit_side_by_side():
    cache = PagedKVCache(2, 2, 3, 5, 4)
    assert cache.k.shape == cache.v.shape == (2, 5, 4, 2, 3)
    assert np.shares_memory(cache.k, cache.kv) and np.shares_memory(cache.v, cache.kv)
    seq = cache.new_sequence()
    cache.reserve(seq, 1)
    k, v = np.full((1, 2, 3), 1.0, np.float32), np.full((1, 2, 3), 2.0, np.float32)
    cache.write(seq, 1, k, v)
    block = cache.tables[seq][0]
    stretch = cache.kv[1, block].ravel()  # the block's K rows, then its V rows
    assert stretch[:6].tolist() == [1.0] * 6 and stretch[4 * 6: 4 * 6 + 6].tolist() == [2.0] * 6
    assert cache.bytes_per_block == 2 * 2 * 4 * 2 * 3 * 4  # layers x (K, V) x slots x heads x d x fp32


def test_prefix_sharing_reuses_full_blocks_even_after_free():
    cache = PagedKVCache(1, 1, 1, 6, 2, prefix_sharing=True)
    first = cache.new_sequence()
    append(cache, first, [1, 2, 3, 4, 5])
    cache.free(first)  # its two full blocks stay cached
    second = cache.new_sequence()
    assert cache.match_prefix(second, [1, 2, 3, 4, 5, 6]) == 4
    assert cache.allocator.num_free == 4
    check_invariants(cache)
    third = cache.new_sequence()
    assert cache.match_prefix(third, [1, 2, 9, 9, 9]) == 2  # the first block only
    check_invariants(cache)


def test_bad_input_gets_clear_errors_and_changes_nothing():
    cache = PagedKVCache(1, 1, 1, 2, 4)
    seq = cache.new_sequence()
    append(cache, seq, [1, 2])
    before = snapshot(cache)
    with pytest.raises(OutOfBlocks, match="need 2 blocks but only 1 of 2 are free"):
        cache.reserve(seq, 7)
    after = snapshot(cache)
    assert all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(before, after))
    cache.free(seq)
    with pytest.raises(KeyError, match="sequence 0 is not live"):
        cache.free(seq)
    with pytest.raises(KeyError, match="sequence 0 is not live"):
        cache.reserve(seq, 1)
    with pytest.raises(ValueError, match="block_size must be >= 1; got 0"):
        PagedKVCache(1, 1, 1, 4, 0)
    with pytest.raises(ValueError, match="at least one block; got num_blocks=0"):
        PagedKVCache(1, 1, 1, 0, 16)
    allocator = BlockAllocator(2)
    with pytest.raises(ValueError, match="block 1 is already free"):
        allocator.free(1)


LAYOUTS = ["side by side", "apart", "heads first"]


def pools(rng, num_blocks, block_size, n_kv, d, layout):
    """K and V pools (num_blocks, block_size, n_kv, d): views of one (blocks, 2, ...) array as
    PagedKVCache keeps them, two contiguous arrays, or views whose rows are not contiguous."""
    if layout == "side by side":
        kv = rng.standard_normal((num_blocks, 2, block_size, n_kv, d)).astype(np.float32)
        return kv[:, 0], kv[:, 1]
    if layout == "apart":
        return tuple(rng.standard_normal((num_blocks, block_size, n_kv, d)).astype(np.float32) for _ in range(2))
    heads_first = rng.standard_normal((2, num_blocks, n_kv, block_size, d)).astype(np.float32)
    return heads_first[0].transpose(0, 2, 1, 3), heads_first[1].transpose(0, 2, 1, 3)


def scattered_pool(seed, batch, length, n_kv, group, d, block_size, layout="side by side"):
    rng = np.random.default_rng(seed)
    blocks_per_seq = -(-length // block_size)
    num_blocks = batch * blocks_per_seq + 3
    k_pool, v_pool = pools(rng, num_blocks, block_size, n_kv, d, layout)
    tables = rng.permutation(num_blocks)[: batch * blocks_per_seq].reshape(batch, blocks_per_seq)
    lengths = rng.integers(1, length + 1, size=batch)
    q = rng.standard_normal((batch, n_kv * group, d)).astype(np.float32)
    return q, k_pool, v_pool, tables, lengths


@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 4), length=st.integers(1, 300),
       n_kv=st.integers(1, 2), group=st.sampled_from([1, 2]), block_size=st.sampled_from([1, 4, 5, 16]),
       layout=st.sampled_from(LAYOUTS))
def test_paged_kernels_agree_with_the_reference(seed, batch, length, n_kv, group, block_size, layout):
    args = scattered_pool(seed, batch, length, n_kv, group, 16, block_size, layout)
    reference = paged_attention.paged_decode_numpy(*args)
    for name in backend.available():
        got = paged_attention.paged_decode(*args, backend=backend.resolve(name, "cpu"))
        np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-5, err_msg=name)


@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 4), length=st.integers(1, 200),
       block_size=st.sampled_from([1, 3, 16]))
def test_address_order_lists_every_block_in_use_once_by_address(seed, batch, length, block_size):
    _, k_pool, _, tables, lengths = scattered_pool(seed, batch, length, 1, 1, 4, block_size)
    tables[:, : len(tables[0]) // 2] = tables[0, : len(tables[0]) // 2]  # share a prefix, as forks do
    blocks, seqs, logicals = paged_attention.address_order(tables, lengths, block_size)
    expected = sorted((tables[b, j], b, j) for b in range(batch) for j in range(-(-lengths[b] // block_size)))
    assert sorted(zip(blocks.tolist(), seqs.tolist(), logicals.tolist())) == expected  # each (b, j) once
    assert (np.diff(blocks) >= 0).all()  # in address order


@pytest.mark.parametrize("tables, lengths, block_size", [(np.zeros(3, int), [3], 4), (np.zeros((2, 3), int), [3], 4),
                                                        (np.zeros((1, 3), int), [3], 0)])
def test_address_order_names_tables_lengths_or_block_size_that_do_not_fit(tables, lengths, block_size):
    with pytest.raises(ValueError, match="need block_tables \\(batch, max_blocks\\), lengths \\(batch,\\) and block_size >= 1"):
        paged_attention.address_order(tables, lengths, block_size)


@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(2, 4), length=st.integers(1, 300),
       shared=st.integers(1, 5), threads=st.sampled_from([1, 2]))
def test_paged_kernel_reads_shared_blocks_for_every_sequence_that_holds_them(seed, batch, length, shared, threads):
    q, k_pool, v_pool, tables, lengths = scattered_pool(seed, batch, length, 2, 2, 16, 4)
    shared = min(shared, tables.shape[1])
    tables[:, :shared] = tables[0, :shared]  # a common prefix: each sequence's first blocks are sequence 0's
    reference = paged_attention.paged_decode_numpy(q, k_pool, v_pool, tables, lengths)
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # one chunk, or several to merge
    try:
        got = paged_attention.paged_decode_numba(q, k_pool, v_pool, tables, lengths)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-5)


@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(1, 6), block_size=st.sampled_from([1, 3]),
       n_kv=st.integers(1, 2), layout=st.sampled_from(LAYOUTS))
def test_flat_pool_finds_every_block(seed, num_blocks, block_size, n_kv, layout):
    for pool in pools(np.random.default_rng(seed), num_blocks, block_size, n_kv, 4, layout):
        flat, stride = paged_attention.flat_pool(pool)
        size = block_size * n_kv * 4
        for block in range(num_blocks):  # brute force: each block's values, in C order, from the stride
            np.testing.assert_array_equal(flat[block * stride: block * stride + size], pool[block].ravel())
        assert (stride == 2 * size) == (layout == "side by side")  # only K beside V puts two blocks apart


@pytest.mark.parametrize("shape", [(4, 2, 8), (0, 2, 1, 8), (3, 2, 1, 8, 1)])
def test_flat_pool_names_a_pool_of_the_wrong_shape(shape):
    with pytest.raises(ValueError, match=rf"got shape \({shape[0]}, "):
        paged_attention.flat_pool(np.zeros(shape, np.float32))


def test_paged_kernel_refuses_tables_outside_the_pool():
    q, k_pool, v_pool, tables, lengths = scattered_pool(0, 2, 40, 1, 1, 8, 16)
    tables = tables.copy()
    tables[1, 0] = 999
    with pytest.raises(ValueError, match="points outside the pool"):
        paged_attention.paged_decode_numba(q, k_pool, v_pool, tables, np.array([40, 40]))


@pytest.mark.parametrize("name", list(backend.available()))
def test_the_model_gives_the_same_tokens_from_a_paged_pool(name):
    from infra_lab import model
    from infra_lab.model.generate import generate_many

    prompts = ["import os\n", "class Config:\n"]
    with backend.using(name, "cpu"):
        target = model.load("target")
        pool = target.new_paged_cache(num_blocks=12, block_size=16)
        assert generate_many(target, prompts, 40, paged=pool) == generate_many(target, prompts, 40)
        assert pool.allocator.num_free == pool.allocator.num_blocks  # every block back after the batch
