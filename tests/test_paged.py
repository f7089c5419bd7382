"""The paged KV cache against a brute-force model: random new/prompt/append/fork/truncate/free
sequences, with prompts that share prefixes, and every invariant checked after every step."""
import hashlib
import struct

import numba
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import backend
from infra_lab.kernels import paged_attention
from infra_lab.kv.paged import BlockAllocator, OutOfBlocks, PagedKVCache


def snapshot(cache: PagedKVCache):
    a = cache.allocator
    return (repr(cache.tables), repr(cache.lengths), repr(cache.tokens), repr(cache.digests), list(a.ref_counts),
            list(a.free_ids), list(a.cached.items()), repr(cache.hash_to_block), repr(cache.block_hash),
            repr(cache.block_tokens), cache.k.copy(), cache.v.copy())


def unchanged(before, after) -> bool:
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(before, after))


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
        assert len(cache.tokens[seq]) == cache.lengths[seq]
    # the prefix index: digest <-> block one to one, cached blocks all in it, free ones never
    assert {block: digest for digest, block in cache.hash_to_block.items()} == cache.block_hash
    assert set(cache.block_tokens) == set(cache.block_hash)
    assert all(a.cached[block] == cache.block_hash.get(block) for block in a.cached)
    assert not set(a.free_ids) & set(cache.block_hash)


def digests_of(tokens: list[int], block_size: int) -> list[bytes]:
    """Brute force: sha256 over the parent's digest and the block's token ids, int64 little-endian."""
    out, parent = [], bytes(32)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = tokens[start:start + block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(chunk)}q", *chunk)).digest()
        out.append(parent)
    return out


def kv_values(tokens: list[int]) -> np.ndarray:
    """The brute-force KV: position p holds a value that depends on every token up to p, as a
    real key does (integers below 2^16, exact in float32). Layer l stores K = value + l, V = -value."""
    out, running = [], 0
    for token in tokens:
        running = (running * 31 + token + 3) % 65521
        out.append(running)
    return np.array(out, np.float32)


def extend(cache: PagedKVCache, seq: int, tokens: list[int]):
    """reserve, write the brute-force KV of the new positions, commit."""
    cache.reserve(seq, len(tokens))
    values = kv_values(cache.tokens[seq] + tokens)[cache.lengths[seq]:]
    rows = values[:, None, None] * np.ones((1,) + cache.k.shape[3:], np.float32)
    for layer in range(cache.k.shape[0]):
        cache.write(seq, layer, rows + layer, -rows)
    cache.commit(seq, tokens)


def check_contents(cache: PagedKVCache, model: dict[int, list[int]], known: dict[bytes, tuple]):
    """Each sequence holds its tokens and their KV; each digest names one token prefix ever seen;
    the index sends every digest to a block holding that prefix's last tokens and their KV."""
    bs = cache.block_size
    for seq, tokens in model.items():
        assert cache.tokens[seq] == tokens
        for layer in range(cache.k.shape[0]):
            keys, values = cache.gather(seq, layer, len(tokens))
            assert np.array_equal(keys[:, 0, 0], kv_values(tokens) + layer)
            assert np.array_equal(values[:, 0, 0], -kv_values(tokens))
        digests = digests_of(tokens, bs) if cache.prefix_sharing else []
        assert cache.digests[seq] == digests
        for index, digest in enumerate(digests):
            assert known.setdefault(digest, tuple(tokens[:(index + 1) * bs])) == tuple(tokens[:(index + 1) * bs])
    for digest, block in cache.hash_to_block.items():
        prefix = known[digest]  # the test saw every registered digest being made
        assert cache.block_tokens[block] == prefix[-bs:]
        for layer in range(cache.k.shape[0]):
            assert np.array_equal(cache.k[layer, block, :, 0, 0], kv_values(list(prefix))[-bs:] + layer)
            assert np.array_equal(cache.v[layer, block, :, 0, 0], -kv_values(list(prefix))[-bs:])


def append(cache: PagedKVCache, seq: int, values: list[float]):
    cache.reserve(seq, len(values))
    rows = np.array(values, np.float32)[:, None, None] * np.ones((1,) + cache.k.shape[3:], np.float32)
    for layer in range(cache.k.shape[0]):
        cache.write(seq, layer, rows + layer, -rows)
    cache.commit(seq, [int(abs(v)) % 7 for v in values])


ALPHABET = [-2, -1, 0, 1]  # few ids, so prompts share prefixes; hash(-1) == hash(-2) in Python
operations = st.lists(st.tuples(st.sampled_from(["prompt", "append", "fork", "truncate", "free"]),
                                st.integers(0, 10**6), st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=9)),
                      min_size=8, max_size=60)


@settings(max_examples=300)
@given(ops=operations, num_blocks=st.integers(1, 12), block_size=st.integers(1, 5), sharing=st.booleans())
def test_random_operations_keep_every_invariant(ops, num_blocks, block_size, sharing):
    cache = PagedKVCache(2, 1, 2, num_blocks, block_size, prefix_sharing=sharing)
    model: dict[int, list[int]] = {}  # live sequence -> its tokens
    seen: list[list[int]] = [[]]  # every token list a sequence held, for prompts to share
    known: dict[bytes, tuple] = {}  # every chain digest -> the one token prefix it names
    for op, pick, tokens in ops:
        live = sorted(model)
        seq = live[pick % len(live)] if live else None
        if op == "prompt":  # a new request whose prompt starts like an earlier one
            source = seen[pick % len(seen)]
            prompt = source[: pick // 1009 % (len(source) + 1)] + tokens
            seq = cache.new_sequence()
            matched = cache.match_prefix(seq, prompt)
            assert matched % block_size == 0 and matched <= len(prompt) - 1 and (sharing or matched == 0)
            model[seq], tokens = prompt[:matched], prompt[matched:]  # the rest is computed below
            check_contents(cache, model, known)  # the matched KV is the prompt's own
        before = snapshot(cache)
        try:
            if seq is None:
                model[cache.new_sequence()] = []
            elif op in ("append", "prompt"):
                extend(cache, seq, tokens)
                model[seq] = model[seq] + tokens
            elif op == "fork":
                model[cache.fork(seq)] = list(model[seq])
            elif op == "truncate":
                length = len(model[seq]) + 1 - pick // 1009 % (2 * block_size + 3)  # rolls back a few, or errs
                cache.truncate(seq, length)
                assert 0 <= length <= len(model[seq])
                del model[seq][length:]
            else:
                cache.free(seq)
                del model[seq]
        except OutOfBlocks:
            assert unchanged(before, snapshot(cache))
        except ValueError as error:
            assert op == "truncate" and f"to {length} tokens; allowed 0..{len(model[seq])}" in str(error)
            assert unchanged(before, snapshot(cache))
        seen.extend(list(held) for held in model.values())
        check_invariants(cache)
        check_contents(cache, model, known)
    for seq in list(model):
        cache.free(seq)
    assert cache.allocator.num_free == num_blocks  # nothing leaks
    assert len(cache.allocator.cached) == len(cache.hash_to_block)  # every indexed block is cached
    check_invariants(cache)


@settings(max_examples=200)
@given(prompt=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=30), extra=st.lists(
    st.sampled_from(ALPHABET), max_size=5), keep=st.integers(0, 30), block_size=st.integers(1, 5))
def test_a_committed_prompt_is_found_again_up_to_where_it_was_truncated(prompt, extra, keep, block_size):
    """No eviction (the pool is large): a later prompt that starts with this one matches every
    full block that is still there, and none of the rolled-back ones."""
    cache = PagedKVCache(1, 1, 1, 64, block_size, prefix_sharing=True)
    first = cache.new_sequence()
    extend(cache, first, prompt)
    keep = min(keep, len(prompt))
    cache.truncate(first, keep)
    query = prompt + extra
    second = cache.new_sequence()
    assert cache.match_prefix(second, query) == block_size * min(keep // block_size, (len(query) - 1) // block_size)
    check_invariants(cache)


@settings(max_examples=200)
@given(prompt=st.lists(st.sampled_from(ALPHABET), min_size=2, max_size=20), keep=st.integers(0, 20),
       extra=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=6), block_size=st.integers(2, 5),
       share=st.sampled_from(["fork", "match"]), then=st.sampled_from(["other frees", "other truncates", "both hold"]))
def test_a_shared_block_kept_in_part_is_never_written_while_indexed(prompt, keep, extra, block_size, share, then):
    """Truncate a sequence into a full, indexed block that another sequence shares, then write:
    the block is copied while shared, and leaves the index once the writer holds it alone."""
    cache = PagedKVCache(2, 1, 2, 32, block_size, prefix_sharing=True)
    known: dict[bytes, tuple] = {}
    first = cache.new_sequence()
    extend(cache, first, prompt)
    if share == "fork":
        other = cache.fork(first)
    else:
        other = cache.new_sequence()
        extend(cache, other, prompt[cache.match_prefix(other, prompt):])
    model = {first: list(prompt), other: list(prompt)}
    check_contents(cache, model, known)
    keep = min(keep, len(prompt))
    cache.truncate(first, keep)
    del model[first][keep:]
    if then == "other frees":
        cache.free(other)
        del model[other]
    elif then == "other truncates":
        cache.truncate(other, 0)
        model[other] = []
    check_invariants(cache)
    check_contents(cache, model, known)
    extend(cache, first, extra)
    model[first] += extra
    check_invariants(cache)
    check_contents(cache, model, known)  # the index still sends each digest to that prefix's KV


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
    assert unchanged(before, snapshot(cache))
    with pytest.raises(ValueError, match=r"cannot truncate sequence 0 to 3 tokens; allowed 0\.\.2"):
        cache.truncate(seq, 3)
    with pytest.raises(ValueError, match=r"cannot truncate sequence 0 to -1 tokens; allowed 0\.\.2"):
        cache.truncate(seq, -1)
    assert unchanged(before, snapshot(cache))
    cache.free(seq)
    with pytest.raises(KeyError, match="sequence 0 is not live"):
        cache.free(seq)
    with pytest.raises(KeyError, match="sequence 0 is not live"):
        cache.reserve(seq, 1)
    with pytest.raises(KeyError, match="sequence 0 is not live"):
        cache.truncate(seq, 0)
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


@pytest.mark.numerics
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


@pytest.mark.numerics
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
