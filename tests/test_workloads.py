"""The hit-rate bars of the radix chapter, on the generated workloads."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab.serving import workloads
from infra_lab.serving.scheduling import ORDERS


def test_few_shot_with_room_for_the_shared_examples_serves_80_percent_from_cache():
    requests = workloads.few_shot()
    served = workloads.serve(requests, capacity=4 * 8 * 61 + 2048)  # the 4 templates fit, with room
    assert served.hit_rate >= 0.80


def test_multi_turn_under_pressure_longest_prefix_is_at_least_fcfs():
    requests = workloads.multi_turn()
    fcfs = workloads.serve(requests, capacity=3000, order="fcfs")
    longest = workloads.serve(requests, capacity=3000, order="longest-prefix")
    assert longest.hit_rate >= fcfs.hit_rate


def test_the_control_shares_nothing_and_the_tree_shares_more_than_block_hashing():
    assert workloads.serve(workloads.control(), capacity=8192).hit_rate == 0
    for make in (workloads.few_shot, workloads.multi_turn, workloads.tree_of_thought):
        requests = make()
        radix = workloads.serve(requests, capacity=1 << 20)
        hashed = workloads.serve_block_hashing(requests, capacity=1 << 20)
        assert radix.cached_tokens >= hashed.cached_tokens
        assert radix.prefill_tokens == radix.prompt_tokens - radix.cached_tokens


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown order 'random'"):
        workloads.serve([np.arange(10)], 100, order="random")
    with pytest.raises(ValueError, match="capacity 5 is smaller than the longest prompt, 10"):
        workloads.serve([np.arange(10)], 5)
    for serve in (workloads.serve, workloads.serve_block_hashing):
        with pytest.raises(ValueError, match="batch must be >= 1; got 0"):
            serve([np.arange(10)], 100, batch=0)


def test_per_batch_series_add_up():
    requests = workloads.multi_turn()
    for served in (workloads.serve(requests, 1500), workloads.serve_block_hashing(requests, 1504)):
        assert len(served.hit_rates) == len(served.evictions) == -(-len(requests) // 16)
        assert sum(served.evictions) > 0  # 1,500 tokens cannot hold 40 growing chats
    big = workloads.serve(requests, 1 << 20)
    assert sum(big.evictions) == 0


def test_mix_draws_from_each_workload_in_proportion():
    mixed = workloads.mix({"few-shot": 3, "control": 1}, n_requests=400, seed=2)
    assert len(mixed) == 400
    control_like = sum(len(r) == 300 for r in mixed)  # control prompts are 300 tokens, few-shot 518
    assert 60 <= control_like <= 140
    assert workloads.mix({"control": 1}, 10, seed=0)[0].tolist() == workloads.control(seed=1)[0].tolist()
    with pytest.raises(ValueError, match="weights must be non-negative"):
        workloads.mix({"chat": 1})
    with pytest.raises(ValueError, match="weights must be non-negative"):
        workloads.mix({"control": 0})


def test_per_request_matches_sum_to_the_totals():
    requests = workloads.tree_of_thought()
    for served in (workloads.serve(requests, 2000, "dfs-weight"), workloads.serve_block_hashing(requests, 2000)):
        assert len(served.matches) == len(requests)
        assert sum(p for p, _ in served.matches) == served.prompt_tokens
        assert sum(m for _, m in served.matches) == served.cached_tokens
        assert all(0 <= m <= p for p, m in served.matches)


def distinct_prefixes(requests):
    """Brute force: every prefix of every prompt, once. A prefix cache must compute each of
    them at least once, so at most prompt tokens minus this many come from any cache."""
    return len({tuple(r[:i]) for r in requests for i in range(1, len(r) + 1)})


prompts = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=10).map(np.array),
                   min_size=1, max_size=24)


@settings(max_examples=60, deadline=None)
@given(requests=prompts, extra=st.integers(0, 60), batch=st.integers(1, 6),
       order=st.sampled_from(ORDERS))
def test_no_cache_serves_more_than_every_prefix_computed_once(requests, extra, batch, order):
    total = sum(len(r) for r in requests)
    bound = total - distinct_prefixes(requests)
    capacity = max(len(r) for r in requests) + extra
    served = workloads.serve(requests, capacity, order, batch)
    assert served.prompt_tokens == total and 0 <= served.cached_tokens <= bound
    hashed = workloads.serve_block_hashing(requests, 16 * capacity, block_size=2, batch=batch)
    assert 0 <= hashed.cached_tokens <= bound
    # a cache that never evicts reaches the bound in any admission order
    assert workloads.serve(requests, total, order, batch).cached_tokens == bound


def test_block_hashing_loses_a_chain_from_its_tail_and_keeps_the_head():
    """Tail-first freeing (vLLM's order): under pressure, block hashing evicts one block at a time
    from a chain's tail, where the tree evicts whole leaves, so on few-shot at 1,000 tokens the
    blocks serve more than the tree in arrival order (chapter 04 measures why)."""
    requests = workloads.few_shot()
    hashed = workloads.serve_block_hashing(requests, 1000)
    tree = workloads.serve(requests, 1000, order="fcfs")
    assert hashed.hit_rate > 1.5 * tree.hit_rate
