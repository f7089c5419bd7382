import numpy as np
import pytest
from hypothesis import given, strategies as st

from infra_lab.kv import accounting


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 30), st.integers(0, 100)), max_size=60))
def test_first_fit_matches_a_slot_by_slot_model(ops):
    space, slots, live = accounting.FirstFit(100), [None] * 100, []
    for allocate, size, pick in ops:
        if allocate:
            start = space.allocate(size)
            runs = [i for i in range(100 - size + 1) if all(s is None for s in slots[i:i + size])]
            assert start == (runs[0] if runs else None)  # the lowest hole that fits
            if start is not None:
                slots[start:start + size] = [start] * size
                live.append(start)
        elif live:
            start = live.pop(pick % len(live))
            space.free(start)
            slots = [None if s == start else s for s in slots]
        assert space.free_slots == slots.count(None)


def test_shares_add_up_and_paging_wastes_least():
    requests = accounting.synthetic_requests("sharegpt", 120, seed=3)
    results = {p: accounting.simulate(requests, 20_000, p) for p in accounting.RESERVATION_POLICIES}
    for usage in results.values():
        total = usage.real + usage.reserved_unused + usage.internal + usage.external + usage.free
        assert total == pytest.approx(1.0, abs=1e-9)
        assert usage.busy_steps > 0
    assert results["paged"].real > max(results[p].real for p in ("max", "pow2", "oracle"))
    assert results["paged"].internal < 0.05
    assert results["max"].mean_running < results["paged"].mean_running


def test_synthetic_lengths_have_the_papers_means():
    for name, (prompt_mean, output_mean) in accounting.DATASETS.items():
        requests = accounting.synthetic_requests(name, 20_000, seed=0)
        assert np.mean([r.prompt for r in requests]) == pytest.approx(prompt_mean, rel=0.08)
        assert np.mean([r.output for r in requests]) == pytest.approx(output_mean, rel=0.08)
        assert all(1 <= r.prompt and 1 <= r.output and r.prompt + r.output <= 2048 for r in requests)


def test_bad_input_is_named():
    requests = accounting.synthetic_requests("alpaca", 5)
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        accounting.simulate(requests, 1000, "lifo")
    with pytest.raises(ValueError, match="unknown dataset 'wiki'"):
        accounting.synthetic_requests("wiki", 5)
    with pytest.raises(ValueError, match="cannot fit max_len 2048 or the budget of 10"):
        accounting.simulate([accounting.Request(20, 5)], 10, "paged", block_size=4)
    relaxed = accounting.simulate(requests, 100_000, "paged")  # no pressure: averages over every step
    assert relaxed.busy_steps == 0 and relaxed.steps > 0 and relaxed.free > 0.9


@given(prompt=st.integers(1, 300), output=st.integers(1, 200), block_size=st.integers(1, 64))
def test_table_entries_of_one_request_match_a_step_by_step_count(prompt, output, block_size):
    usage = accounting.simulate([accounting.Request(prompt, output)], 4096, "paged",
                                block_size=block_size)
    # at the step where it has emitted g tokens, it holds ceil((prompt + g) / block_size) blocks
    held = [-(-(prompt + g) // block_size) for g in range(1, output + 1)]
    assert usage.steps == output and usage.busy_steps == 0
    assert usage.table_entries == pytest.approx(np.mean(held))
    assert accounting.simulate([accounting.Request(prompt, output)], 4096, "oracle").table_entries == 0


@given(seed=st.integers(0, 50), block_size=st.sampled_from([1, 4, 16, 64, 256]),
       dataset=st.sampled_from(sorted(accounting.DATASETS)))
def test_table_entries_times_block_size_are_the_slots_held(seed, block_size, dataset):
    requests = accounting.synthetic_requests(dataset, 40, seed=seed, max_len=1024)
    budget = 6_000 if dataset == "sharegpt" else 1_500
    u = accounting.simulate(requests, budget, "paged", block_size=block_size, max_len=1024)
    held_per_request = (u.real + u.internal) * budget / u.mean_running  # tokens' slots, averaged
    assert u.table_entries * block_size == pytest.approx(held_per_request)
    assert u.table_entries >= 1
