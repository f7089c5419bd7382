"""Scenarios in the spirit of vLLM's block-manager and prefix-caching tests and SGLang's
radix-cache tests, written from the behaviour those engines document: which blocks a freed
sequence gives up first, what a prefix hit may return, how forks and truncation share blocks,
and how locks pin a radix tree's paths."""
import numpy as np
import pytest

from infra_lab.kv import paged
from infra_lab.kv.paged import PagedKVCache
from infra_lab.kv.radix import RadixCache


def held(cache: PagedKVCache, tokens) -> int:
    """Commit `tokens` into a new sequence (no prefix lookup) and return it."""
    seq = cache.new_sequence()
    cache.reserve(seq, len(tokens))
    cache.commit(seq, tokens)
    return seq


def matched(cache: PagedKVCache, tokens) -> int:
    return cache.match_prefix(cache.new_sequence(), tokens)


# ---- eviction order: a chain's tail goes before its head ---------------------------------------

def test_one_eviction_takes_the_tail_of_a_freed_chain_not_its_head():
    """The first repro of issue 14: evicting the chain's first block orphaned the other two."""
    cache = PagedKVCache(1, 1, 1, 3, 2, prefix_sharing=True)
    cache.free(held(cache, [1, 2, 3, 4, 5, 6]))  # three cached blocks, no free ones
    cache.reserve(cache.new_sequence(), 1)  # one eviction
    assert matched(cache, [1, 2, 3, 4, 5, 6, 7]) == 4  # vLLM keeps the first two blocks


@pytest.mark.parametrize("evicted", range(10))
def test_chains_freed_in_turn_are_evicted_oldest_first_each_from_its_tail(evicted):
    cache = PagedKVCache(1, 1, 1, 9, 2, prefix_sharing=True)
    chains = [[10 * c + i for i in range(6)] for c in range(3)]  # three prompts of 3 blocks each
    for tokens in chains:
        cache.free(held(cache, tokens))
    assert cache.allocator.num_free == 9 and not cache.allocator.free_ids  # all 9 cached
    cache.reserve(cache.new_sequence(), 2 * evicted)  # takes `evicted` blocks back
    assert len(cache.allocator.evicted) == evicted
    left = [3 - min(max(evicted - 3 * c, 0), 3) for c in range(3)]  # blocks each chain keeps
    assert [matched(cache, tokens + [99]) for tokens in chains] == [2 * n for n in left]


def test_a_prefix_shared_by_two_prompts_outlives_both_tails():
    cache = PagedKVCache(1, 1, 1, 5, 2, prefix_sharing=True)
    first = held(cache, [1, 2, 3, 4, 5, 6])
    second = cache.new_sequence()
    assert cache.match_prefix(second, [1, 2, 7, 8, 9, 10]) == 2  # shares block [1, 2]
    cache.reserve(second, 4)
    cache.commit(second, [7, 8, 9, 10])
    cache.free(first)  # [1, 2] is still held by the second
    cache.free(second)
    cache.reserve(cache.new_sequence(), 6)  # three evictions: both tails' last blocks, then [3, 4]
    assert matched(cache, [1, 2, 7, 8, 9]) == 4  # [1, 2] and [7, 8] are left
    assert matched(cache, [1, 2, 3, 4, 5]) == 2


# ---- what a hit may return ----------------------------------------------------------------------

def test_prefixes_whose_python_hashes_collide_do_not_share_kv():
    """The second repro of issue 14: hash(-1) == hash(-2), so [-2, -2] found [-1, -1]'s block."""
    assert hash(-1) == hash(-2)
    cache = PagedKVCache(1, 1, 1, 4, 2, prefix_sharing=True)
    first = held(cache, [-1, -1, 0])
    second = cache.new_sequence()
    assert cache.match_prefix(second, [-2, -2, 0]) == 0
    assert cache.tables[second] == [] and cache.allocator.ref_counts[cache.tables[first][0]] == 1
    assert matched(cache, [-1, -1, 0]) == 2  # the real prefix still hits


def test_a_hit_compares_tokens_even_when_the_digests_collide(monkeypatch):
    """Belt and braces: with a digest that names every block alike, only the stored tokens
    stop a different prompt from taking the cached block."""
    monkeypatch.setattr(paged, "chain_digest", lambda parent, tokens: bytes(32))
    cache = PagedKVCache(1, 1, 1, 4, 2, prefix_sharing=True)
    held(cache, [1, 2, 3])
    assert matched(cache, [4, 5, 6]) == 0
    assert matched(cache, [1, 2, 6]) == 2


def test_digests_chain_each_block_to_its_parent():
    cache = PagedKVCache(1, 1, 1, 8, 2, prefix_sharing=True)
    seq = held(cache, [1, 2, 3, 4, 5])
    first = paged.chain_digest(paged.ROOT_DIGEST, [1, 2])
    assert cache.digests[seq] == [first, paged.chain_digest(first, [3, 4])]
    assert matched(cache, [9, 9, 3, 4, 5]) == 0  # the same block after another prefix is another block


# ---- free, then match again ---------------------------------------------------------------------

def test_a_freed_prompt_is_matched_again_and_its_blocks_revived():
    cache = PagedKVCache(1, 1, 1, 6, 4, prefix_sharing=True)
    prompt = list(range(10))  # blocks [0..3], [4..7], and a partial [8, 9]
    first = held(cache, prompt)
    cache.free(first)
    assert len(cache.allocator.cached) == 2 and len(cache.allocator.free_ids) == 4  # partial block not kept
    second = cache.new_sequence()
    assert cache.match_prefix(second, prompt + [10]) == 8
    assert not cache.allocator.cached  # both revived, held by the new sequence
    assert [cache.allocator.ref_counts[b] for b in cache.tables[second]] == [1, 1]
    cache.free(second)
    assert matched(cache, prompt) == 8  # and again


def test_a_match_keeps_one_token_to_compute_logits_from():
    cache = PagedKVCache(1, 1, 1, 4, 2, prefix_sharing=True)
    held(cache, [1, 2, 3, 4])
    assert matched(cache, [1, 2, 3, 4]) == 2  # not 4: the last token must be run
    assert matched(cache, [1, 2, 3, 4, 5]) == 4


# ---- fork and free (parallel sampling) ----------------------------------------------------------

def test_forks_share_the_prompt_copy_its_partial_block_and_leave_it_cached_once():
    cache = PagedKVCache(1, 1, 1, 8, 4, prefix_sharing=True)
    parent = held(cache, list(range(6)))  # one full block, one partial
    children = [cache.fork(parent) for _ in range(3)]
    full, partial = cache.tables[parent]
    assert cache.allocator.ref_counts[full] == cache.allocator.ref_counts[partial] == 4
    for n, child in enumerate(children):  # each samples its own next token
        cache.reserve(child, 1)
        cache.commit(child, [100 + n])
        assert cache.tables[child][0] == full and cache.tables[child][1] != partial  # copy-on-write
    assert cache.allocator.ref_counts[partial] == 1  # only the parent's now
    cache.free(parent)
    assert cache.allocator.ref_counts[full] == 3 and partial in cache.allocator.free_ids
    for child in children:
        cache.free(child)
    assert list(cache.allocator.cached) == [full]  # the shared full block, cached once
    assert cache.allocator.num_free == 8
    assert matched(cache, list(range(6))) == 4


# ---- truncate (speculative decoding) ------------------------------------------------------------

def test_rolled_back_blocks_go_back_to_the_pool_and_out_of_the_index():
    cache = PagedKVCache(1, 1, 1, 8, 2, prefix_sharing=True)
    seq = held(cache, [1, 2, 3, 4, 5, 6, 7])  # three full blocks, then [7]
    tail = cache.tables[seq][1:]
    cache.truncate(seq, 3)  # keeps [1, 2] and [3]
    assert cache.tables[seq] == [cache.tables[seq][0], tail[0]] and cache.lengths[seq] == 3
    assert all(block in cache.allocator.free_ids for block in tail[1:])  # free, not cached
    assert matched(cache, [1, 2, 3, 4, 5, 6, 7]) == 2  # [3, 4] and [5, 6] were rolled back
    cache.reserve(seq, 2)
    cache.commit(seq, [8, 9])
    assert cache.tokens[seq] == [1, 2, 3, 8, 9]
    assert matched(cache, [1, 2, 3, 8, 9]) == 4


def test_truncate_drops_only_this_sequences_reference_to_blocks_a_fork_holds():
    cache = PagedKVCache(1, 1, 1, 8, 2, prefix_sharing=True)
    seq = held(cache, [1, 2, 3, 4, 5, 6])
    fork = cache.fork(seq)
    cache.truncate(seq, 1)
    assert cache.allocator.ref_counts[cache.tables[fork][0]] == 2  # still shared, still indexed
    assert [cache.allocator.ref_counts[b] for b in cache.tables[fork][1:]] == [1, 1]
    assert matched(cache, [1, 2, 3, 4, 5, 6, 7]) == 6  # the fork's copy is unchanged and findable
    cache.reserve(seq, 1)  # writing into the shared block copies it first
    cache.commit(seq, [9])
    copy, original = cache.tables[seq][0], cache.tables[fork][0]
    assert copy != original
    for tokens, block in (([1, 9, 0], copy), ([1, 2, 0], original)):  # each prefix finds its own block
        probe = cache.new_sequence()
        assert cache.match_prefix(probe, tokens) == 2 and cache.tables[probe] == [block]


def test_truncate_to_every_length_then_regrow_gives_the_same_cache_as_never_drafting():
    for length in range(8):
        drafted = PagedKVCache(1, 1, 1, 8, 3, prefix_sharing=True)
        seq = held(drafted, [5, 6, 7, 8, 9, 10, 11])
        drafted.truncate(seq, length)
        drafted.reserve(seq, 8 - length)
        drafted.commit(seq, list(range(20, 28 - length)))
        assert drafted.tokens[seq] == [5, 6, 7, 8, 9, 10, 11][:length] + list(range(20, 28 - length))
        expected = len(drafted.tokens[seq]) // 3 * 3
        assert matched(drafted, drafted.tokens[seq] + [0]) == expected


# ---- radix tree: locks ---------------------------------------------------------------------------

def test_unlock_mirrors_lock_even_for_an_empty_match():
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    length, _, node = cache.match_prefix([7, 8])  # nothing cached: the root
    assert length == 0 and node is cache.root
    cache.lock(node)  # a request in flight, whatever it matched
    cache.unlock(node)  # no special case needed
    assert cache.locked_size == 0 and cache.root.lock_refs == 1


def test_locks_count_and_an_extra_unlock_is_named():
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    _, _, node = cache.match_prefix([1, 2, 3])
    cache.lock(node)
    cache.lock(node)  # two requests on the same path
    cache.unlock(node)
    assert cache.locked_size == 3 and cache.evict(3) == 0  # one still holds it
    cache.unlock(node)
    assert cache.locked_size == 0
    with pytest.raises(ValueError, match=r"not locked \(lock_refs 0, key \[1, 2, 3\]\)"):
        cache.unlock(node)


def test_a_lock_survives_an_edge_split_below_and_above():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    _, _, leaf = cache.match_prefix([1, 2, 3, 4])
    cache.lock(leaf)
    _, _, upper = cache.match_prefix([1, 2, 9])  # splits the locked edge after [1, 2]
    assert upper.lock_refs == 1 and cache.locked_size == 4
    cache.unlock(leaf)  # releases both halves
    assert upper.lock_refs == 0 and cache.locked_size == 0 and cache.evictable_size == 4


# ---- radix tree: eviction ------------------------------------------------------------------------

def test_evict_takes_least_recently_used_unlocked_leaves_and_walks_up():
    freed = []
    cache = RadixCache(free_slots=lambda slots: freed.extend(slots.tolist()))
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [0, 1, 3])  # shares [1, 2]; its duplicate slots 0, 1 go back
    cache.insert([5, 6], [4, 5])
    freed.clear()
    _, _, pinned = cache.match_prefix([1, 2, 3])
    cache.lock(pinned)
    cache.match_prefix([5, 6])  # [5, 6] is now more recent than [1, 2, 4]
    assert cache.evict(1) == 1 and freed == [3]  # the least recent unlocked leaf: [4]
    assert cache.evict(100) == 2 and freed == [3, 4, 5]  # [5, 6]; [1, 2, 3] is pinned
    assert cache.match_prefix([1, 2, 3])[0] == 3
    cache.unlock(pinned)
    assert cache.evict(100) == 3 and sorted(freed) == [0, 1, 2, 3, 4, 5]  # [3], then its parent [1, 2]
    assert cache.total_size == 0 and not cache.root.children


def test_evicting_everything_returns_every_slot_once():
    returned = []
    cache = RadixCache(free_slots=lambda slots: returned.extend(slots.tolist()))
    rng = np.random.default_rng(0)
    next_slot = 0
    for _ in range(50):
        tokens = rng.integers(0, 3, size=int(rng.integers(1, 8)))
        matched_len, slots, _ = cache.match_prefix(tokens)
        fresh = np.arange(next_slot, next_slot + len(tokens) - matched_len)
        next_slot += len(fresh)
        cache.insert(tokens, np.concatenate([slots, fresh]))
    cache.evict(cache.total_size)
    assert sorted(returned) == list(range(next_slot))
