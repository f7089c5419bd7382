"""The radix cache against a brute-force model: every cached prefix with its KV slot."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab.kv.radix import RadixCache


class Slots:
    """An allocator that notices a slot returned twice, or one it never handed out."""

    def __init__(self):
        self.live, self.next = set(), 0

    def take(self, n):
        out = list(range(self.next, self.next + n))
        self.next += n
        self.live.update(out)
        return np.array(out, np.int64)

    def give_back(self, slots):
        for slot in slots.tolist():
            assert slot in self.live, f"slot {slot} returned twice or never taken"
            self.live.remove(slot)


operations = st.lists(st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
                                st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(0, 40)),
                      min_size=1, max_size=50)


@settings(max_examples=300)
@given(ops=operations)
def test_random_interleavings_agree_with_brute_force(ops):
    slots = Slots()
    cache = RadixCache(free_slots=slots.give_back)
    cached: dict[tuple, int] = {}  # every cached prefix -> the slot of its last token
    held: list = []  # (node, prefix) of locked requests
    for op, tokens, n in ops:
        longest = max((i for i in range(len(tokens) + 1) if i == 0 or tuple(tokens[:i]) in cached), default=0)
        if op == "insert":
            kv = slots.take(len(tokens))
            assert cache.insert(tokens, kv) == longest
            for i in range(longest + 1, len(tokens) + 1):
                cached[tuple(tokens[:i])] = int(kv[i - 1])
        elif op in ("match", "lock"):
            length, found, node = cache.match_prefix(tokens)
            assert length == longest
            assert found.tolist() == [cached[tuple(tokens[:i])] for i in range(1, length + 1)]
            if op == "lock":  # an empty match locks the root: a no-op, and so is its unlock
                cache.lock(node)
                held.append((node, tuple(tokens[:length])))
        elif op == "unlock" and held:
            node, _ = held.pop(n % len(held))
            cache.unlock(node)
        elif op == "evict":
            pinned = {prefix[:i] for _, prefix in held for i in range(1, len(prefix) + 1)}
            before_live, before_total = set(slots.live), cache.total_size
            evictable = cache.evictable_size
            freed = cache.evict(n)
            gone = before_live - slots.live
            assert freed == len(gone) == before_total - cache.total_size  # exact accounting
            assert freed >= min(n, evictable) and freed <= evictable
            removed = {prefix for prefix, slot in cached.items() if slot in gone}
            assert not removed & pinned  # nothing locked is evicted
            cached = {p: s for p, s in cached.items() if p not in removed}
            assert all(p[:-1] in cached or len(p) == 1 for p in cached)  # still prefix-closed
        assert cache.total_size == len(cached)
        assert cache.locked_size == len({prefix[:i] for _, prefix in held for i in range(1, len(prefix) + 1)})
    while held:
        cache.unlock(held.pop()[0])
    cache.evict(cache.total_size)
    assert cache.total_size == 0 and not slots.live  # every slot came back exactly once


def test_bad_input_is_named():
    cache = RadixCache()
    with pytest.raises(ValueError, match=r"one KV slot per token; got \(3,\) tokens and \(2,\) slots"):
        cache.insert([1, 2, 3], [7, 8])
    _, _, root = cache.match_prefix([1])
    cache.unlock(root)  # an empty match: unlock, like lock, does nothing on the root
    cache.insert([1, 2, 3], [4, 5, 6])
    _, _, node = cache.match_prefix([1, 2, 3])
    with pytest.raises(ValueError, match=r"unlock of a node that is not locked \(lock_refs 0, key \[1, 2, 3\]\)"):
        cache.unlock(node)
    assert cache.evict(100) == 3  # asks for more than there is: evicts what it can


def test_peek_changes_nothing_and_agrees_with_match():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    clock = cache.clock
    assert cache.peek_prefix([1, 2, 9]) == 2 and cache.clock == clock
    assert len(cache.root.children[1].key) == 4  # no split
    assert cache.match_prefix([1, 2, 9])[0] == 2


def test_insert_hands_back_only_duplicates_not_the_trees_own_slots():
    freed = []
    cache = RadixCache(free_slots=lambda slots: freed.extend(slots.tolist()))
    cache.insert([1, 2, 3], [10, 11, 12])
    _, prefix_slots, _ = cache.match_prefix([1, 2])
    # a request that reused the tree's slots for [1, 2] and computed 3, 4 into slots 20, 21
    assert cache.insert([1, 2, 3, 4], np.concatenate([prefix_slots, [20, 21]])) == 3
    assert freed == [20]  # its copy of token 3; slots 10 and 11 stay the tree's
    assert cache.match_prefix([1, 2, 3, 4])[1].tolist() == [10, 11, 12, 21]


def test_lines_show_the_tree_depth_first_in_token_order():
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 9, 9, 9, 9, 9], [5, 6, 7, 8, 9, 10, 11])
    cache.insert([0], [20])
    assert cache.lines() == [
        "[0]  slots [20], lock_refs 0, last_access 3",
        "[1, 2]  slots [0, 1], lock_refs 0, last_access 2",
        "    [3]  slots [2], lock_refs 0, last_access 1",
        "    [9, 9, 9, 9, 9]  slots [7..11], lock_refs 0, last_access 2",
    ]
