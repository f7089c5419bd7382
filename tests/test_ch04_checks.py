"""Chapter 04's checks fail plausible wrong answers, and say where they first differ."""
import numpy as np
import pytest

from infra_lab.grading import checks
from infra_lab.grading import ch04  # noqa: F401  (registers the checks)
from infra_lab.kv.radix import RadixCache
from infra_lab.serving import scheduling


def run(name, candidate):
    return checks._run(checks._lookup(name), candidate)


def test_eviction_that_ignores_locks_fails():
    def ignores_locks(cache, n_tokens):
        saved = {}
        stack = [cache.root]
        while stack:
            node = stack.pop()
            saved[node], node.lock_refs = node.lock_refs, 0
            stack.extend(node.children.values())
        cache.root.lock_refs = 1
        freed = RadixCache.evict(cache, n_tokens)
        for node, refs in saved.items():
            node.lock_refs = refs
        return freed

    result = run("ch04.evict", ignores_locks)
    assert result.passed < result.total
    assert "first difference at item" in result.first_failure and "(evict " in result.first_failure


def test_insert_that_frees_the_trees_own_slots_fails():
    def frees_every_matched_slot(cache, tokens, slots):
        slots = np.asarray(slots)
        matched = RadixCache.insert(cache, tokens, slots)
        if matched:
            cache.free_slots(slots[:matched][slots[:matched] == cache.match_prefix(tokens[:matched])[1]])
        return matched

    assert run("ch04.insert", frees_every_matched_slot).passed < 24


def test_match_without_split_and_unsorted_order_fail():
    def no_split(cache, tokens):
        return RadixCache.match_prefix(cache, tokens[:1])  # stops early: splits nothing past one token

    assert run("ch04.match_prefix", no_split).passed < 24
    assert run("ch04.longest_prefix_first", lambda requests, cache: list(range(len(requests)))).passed < 24


@pytest.mark.parametrize("name, owner, attribute, args", [
    ("match_prefix", RadixCache, "match_prefix", ([1, 2],)),
    ("insert", RadixCache, "insert", ([1, 2], [5, 6])),
    ("evict", RadixCache, "evict", (3,)),
    ("longest_prefix_first", scheduling, "longest_prefix_first", ([[1, 2]],)),
])
def test_the_references_call_the_package(monkeypatch, name, owner, attribute, args):
    """Each reference hands its arguments to the package's own function and returns its answer."""
    seen = []
    monkeypatch.setattr(owner, attribute, lambda *given: seen.append(given) or "the package's answer")
    cache = RadixCache()
    arguments = (args[0], cache) if name == "longest_prefix_first" else (cache, *args)
    assert getattr(ch04, name)(*arguments) == "the package's answer"
    assert seen == [arguments]
