"""The real model served through the radix cache: same tokens, less prefill, exact slot accounting."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from infra_lab import backend, model
from infra_lab.serving import radix_serving
from infra_lab.kv.radix import RadixCache


@pytest.fixture(scope="module")
def target():
    return model.load("target")


@pytest.fixture(scope="module")
def prompts():
    return radix_serving.shared_prefix_prompts(10, n_prefixes=2, seed=1)


@pytest.fixture(scope="module")
def without(target, prompts):
    return radix_serving.serve_model(target, prompts, 12, 4096, radix=False)


def test_the_tree_gives_the_same_tokens_and_skips_the_cached_prefill(target, prompts, without):
    cache = RadixCache()
    served = radix_serving.serve_model(target, prompts, 12, 4096, cache=cache)
    assert served.outputs == without.outputs
    assert without.cached_tokens == 0 and without.slots_in_use == 0
    assert served.hit_rate > 0.5  # two openings of up to 320 bytes shared by ten prompts
    assert served.prefill_tokens == served.prompt_tokens - served.cached_tokens
    assert served.slots_in_use == cache.total_size  # every slot is the tree's or free
    assert cache.locked_size == 0  # nothing left pinned
    assert served.cached_tokens <= served.prompt_tokens - len(prompts[0])  # the first request cannot hit


def test_under_pressure_the_tree_evicts_and_the_tokens_stay_the_same(target, prompts, without):
    cache = RadixCache()
    served = radix_serving.serve_model(target, prompts, 12, 500, cache=cache)
    assert served.evicted_tokens > 0
    assert served.outputs == without.outputs
    assert served.slots_in_use == cache.total_size <= 500


def test_torch_path_agrees(target, prompts, without):
    served = radix_serving.serve_model(target, prompts[:4], 12, 1000, backend=backend.resolve("torch", "cpu"))
    assert served.outputs == without.outputs[:4]


def test_the_token_pool_is_a_paged_pool_of_one_token_blocks_the_tree_holds(target, prompts):
    """After a run, every slot the tree caches is held once (by the tree), and every other slot
    is free: no reference leaks from the sequences, duplicates or evictions."""
    cache = RadixCache()
    served = radix_serving.serve_model(target, prompts, 12, 500, cache=cache)
    assert served.evicted_tokens > 0
    slots, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        slots.extend(node.slots.tolist())
        stack.extend(node.children.values())
    assert len(set(slots)) == len(slots) == cache.total_size == served.slots_in_use


def test_bad_requests_are_named(target):
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        radix_serving.serve_model(target, ["x"], 0, 100)
    with pytest.raises(ValueError, match="n_slots=10 cannot hold one request: the longest needs 20"):
        radix_serving.serve_model(target, [np.arange(5)], 16, 10)
    with pytest.raises(ValueError, match="exceeds the context of 512"):
        radix_serving.serve_model(target, [np.zeros(500, int)], 16, 1000)
    used = RadixCache()
    used.insert([1, 2], [0, 1])
    with pytest.raises(ValueError, match="cache must be an empty RadixCache.*2 tokens cached"):
        radix_serving.serve_model(target, ["x"], 1, 100, cache=used)
    with pytest.raises(ValueError, match="got radix=False"):
        radix_serving.serve_model(target, ["x"], 1, 100, radix=False, cache=RadixCache())
    with pytest.raises(ValueError, match="n_prefixes must be in"):
        radix_serving.shared_prefix_prompts(4, n_prefixes=0)


@given(st.lists(st.sampled_from([b"a", b"b", b" ", b"\n"]), max_size=60).map(b"".join),
       st.integers(1, 70))
def test_a_module_opening_is_whole_lines_of_the_source(source, prefix_bytes):
    opening = radix_serving.module_opening(source, prefix_bytes)
    assert opening.endswith(b"\n")
    if b"\n" in source[:prefix_bytes]:  # whole lines: the longest run of them that fits
        assert source.startswith(opening) and len(opening) <= prefix_bytes
        assert b"\n" not in source[len(opening):prefix_bytes]
    else:  # no whole line fits: the cut, then a newline
        assert opening == source[:prefix_bytes] + b"\n"


def test_the_prompts_open_with_whole_lines():
    for prompt in radix_serving.shared_prefix_prompts(6, n_prefixes=3, prefix_bytes=320):
        opening, _, rest = prompt.partition(b"\n\ndef ")
        assert rest and len(opening) < 320  # a blank line, then the def line
    with pytest.raises(ValueError, match="prefix_bytes"):
        radix_serving.module_opening(b"x\n", 0)
