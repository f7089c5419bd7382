"""The routing policies on their own: round robin, the power of two choices, and cache-aware."""
from collections import Counter

import pytest

from infra_lab.orchestration.policies import POLICIES, CacheAware, LeastOutstanding, Policy, RoundRobin, Worker


def workers(*loads):
    return [Worker(f"http://w{i}", outstanding=load) for i, load in enumerate(loads)]


def route(policy, text, pool):
    worker = policy.choose(text, pool)
    assert worker in pool
    policy.routed(text, worker)
    return worker


def test_round_robin_takes_each_worker_in_turn():
    pool = workers(0, 5, 9)
    policy = RoundRobin()
    assert [route(policy, "x", pool).url for _ in range(6)] == ["http://w0", "http://w1", "http://w2"] * 2


def test_least_outstanding_takes_the_lighter_of_two_and_is_seeded():
    pool = workers(0, 10, 10, 10)
    policy = LeastOutstanding(seed=1)
    picks = Counter(policy.choose("x", pool).url for _ in range(600))
    # w0 is lighter than every other, so it wins whenever it is drawn: in half of the pairs
    assert 200 < picks["http://w0"] < 400
    first, second = LeastOutstanding(seed=7), LeastOutstanding(seed=7)
    assert [first.choose("x", pool).url for _ in range(50)] == [second.choose("x", pool).url for _ in range(50)]
    assert LeastOutstanding().choose("x", pool[:1]) is pool[0]


def test_least_outstanding_never_takes_the_heaviest_of_two():
    pool = workers(3, 7)
    policy = LeastOutstanding(seed=0)
    assert {policy.choose("x", pool).url for _ in range(50)} == {"http://w0"}


def test_cache_aware_sends_a_shared_prefix_back_where_it_went():
    pool = workers(0, 0, 0)
    policy = CacheAware(cache_threshold=0.5)
    system_a, system_b = "You are a pirate. " * 5, "You answer in French. " * 5
    first_a = route(policy, system_a + "Hello?", pool)
    first_b = route(policy, system_b + "Bonjour?", pool)
    assert first_a is not first_b, "a new prefix goes to the worker whose tree is smallest"
    for question in ["How are you?", "Where is the ship?", "Arr?"]:
        assert route(policy, system_a + question, pool) is first_a
        assert route(policy, system_b + question, pool) is first_b
    third = route(policy, "Something else entirely, no shared opening.", pool)
    assert third not in (first_a, first_b)


def test_cache_aware_balances_load_when_it_is_out_of_balance():
    pool = workers(0, 0)
    policy = CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    text = "the same long prompt " * 4
    hot = route(policy, text, pool)
    hot.outstanding = 5  # 5 - 0 > 4 and 5 > 1.5 * 0: imbalanced, so the cached worker is passed over
    assert policy.choose(text, pool) is not hot
    hot.outstanding = 4  # 4 - 0 is not > 4: balanced enough, the cache wins
    assert policy.choose(text, pool) is hot
    other = next(w for w in pool if w is not hot)
    hot.outstanding, other.outstanding = 20, 14  # 6 > 4 but 20 < 1.5 * 14: still balanced
    assert policy.choose(text, pool) is hot


def test_cache_aware_below_the_threshold_spreads_by_tree_size():
    pool = workers(0, 0)
    policy = CacheAware(cache_threshold=0.9)
    route(policy, "abcdefghij" * 10, pool)
    # a tenth of this prompt matches the first worker's tree: below 0.9, so the emptier tree wins
    assert policy.choose("abcdefghij" + "z" * 90, pool) is pool[1]


def test_cache_aware_trees_stay_under_their_limit_and_forget_removed_workers():
    pool = workers(0, 0)
    policy = CacheAware(max_tree_chars=50)
    for i in range(40):
        route(policy, f"prompt number {i} " * 3, pool)
    assert all(tree.total_chars <= 50 for tree in policy.trees.values())
    policy.removed(pool[0])
    assert pool[0].url not in policy.trees


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match="cache_threshold must be in"):
        CacheAware(cache_threshold=1.5)
    with pytest.raises(ValueError, match="max_tree_chars must be >= 1; got 0"):
        CacheAware(max_tree_chars=0)


def test_a_student_policy_needs_only_choose():
    class Busiest(Policy):
        def choose(self, prompt_text, workers):
            return max(workers, key=lambda w: w.outstanding)

    pool = workers(1, 4, 2)
    assert route(Busiest(), "x", pool) is pool[1]
    assert set(POLICIES) == {"round-robin", "least-outstanding", "cache-aware"}
