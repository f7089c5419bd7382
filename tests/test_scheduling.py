"""The admission orders of the radix chapter: each is a permutation, and each puts first what it says."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from infra_lab.kv.radix import RadixCache
from infra_lab.serving import scheduling


def test_scheduling_orders():
    cache = RadixCache()
    cache.insert([5, 5, 5, 5], [0, 1, 2, 3])
    waiting = [[1, 2], [5, 5, 5, 1], [5, 1], [9, 9, 9]]
    assert scheduling.fcfs(waiting) == [0, 1, 2, 3]
    assert scheduling.longest_prefix_first(waiting, cache) == [1, 2, 0, 3]
    shared = [[1, 2, 3], [7], [1, 2, 4], [1, 2, 3, 5], [7, 8]]
    order = scheduling.dfs_weight(shared)
    assert sorted(order) == [0, 1, 2, 3, 4]
    first_three = set(order[:3])
    assert first_three == {0, 2, 3}  # the heaviest subtree (prefix 1, 2) runs back to back


@given(requests=st.lists(st.lists(st.integers(0, 2), max_size=6), max_size=12))
def test_every_order_is_a_permutation(requests):
    cache = RadixCache()
    for tokens in requests[: len(requests) // 2]:
        if tokens:
            cache.insert(tokens, np.arange(len(tokens)))
    for name in scheduling.ORDERS:
        order = scheduling.admission_order(name, requests, cache)
        assert sorted(order) == list(range(len(requests)))


def test_unknown_order_is_named():
    with pytest.raises(ValueError, match="unknown order 'random'; choose one of fcfs, longest-prefix"):
        scheduling.admission_order("random", [[1]], RadixCache())
