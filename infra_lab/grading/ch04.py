"""Checks for chapter 04's exercises: prefix match with a split, insert, LRU eviction that
respects locks, and longest-prefix-first ordering, each written as a function of a
`infra_lab.kv.radix.RadixCache`. The references call the package: RadixCache's own methods and
`infra_lab.serving.scheduling.longest_prefix_first`. Every case drives a fresh cache through a
seeded script and records what the function returns, the slots it hands back and the whole tree
after each step."""
from __future__ import annotations

import numpy as np

from infra_lab.grading.checks import Check, register
from infra_lab.kv.radix import RadixCache
from infra_lab.serving import scheduling


def match_prefix(cache, tokens):
    """Reference: (matched length, slots of the matched tokens, the node the match ends at);
    the clock ticks once and every node on the path is stamped; a match that ends inside an
    edge splits it."""
    return RadixCache.match_prefix(cache, tokens)


def insert(cache, tokens, slots):
    """Reference: cache tokens with their slots, return how many were cached already."""
    return RadixCache.insert(cache, tokens, slots)


def evict(cache, n_tokens):
    """Reference: free least-recently-used unlocked leaves until n_tokens are freed."""
    return RadixCache.evict(cache, n_tokens)


def longest_prefix_first(requests, cache):
    """Reference: indices of requests, most cached tokens first, ties in arrival order."""
    return scheduling.longest_prefix_first(requests, cache)


def snapshot(cache) -> tuple:
    """The whole tree as plain lines, depth first in token order, one per node (the tokens from
    the root to it, its edge, slots, last_access and lock_refs), then the clock and the sizes."""
    lines = []

    def walk(node, above: list):
        here = above + np.asarray(node.key).tolist()
        if node is not cache.root:
            lines.append(f"node {here}: edge {np.asarray(node.key).tolist()}, slots {np.asarray(node.slots).tolist()}, "
                         f"last_access {node.last_access}, lock_refs {node.lock_refs}")
        for _, child in sorted(node.children.items()):
            walk(child, here)

    walk(cache.root, [])
    return tuple(lines) + (f"clock {cache.clock}, total_size {cache.total_size}, locked_size {cache.locked_size}",)


def _path(cache, node) -> tuple:
    """Tokens from the root to node."""
    pieces = []
    while node is not None and node is not cache.root:
        pieces.append(np.asarray(node.key).tolist())
        node = node.parent
        if len(pieces) > 10_000:
            raise ValueError("the parent links form a loop: they never reach the root")
    return tuple(token for piece in reversed(pieces) for token in piece)


def _filled(freed: list, script: list) -> RadixCache:
    """A cache built with the package's own operations, handing freed slots to `freed`."""
    cache = RadixCache(free_slots=lambda slots: freed.extend(np.asarray(slots).tolist()))
    next_slot = 0
    for tokens in script:
        cache.insert(tokens, np.arange(next_slot, next_slot + len(tokens)))
        next_slot += len(tokens)
    return cache


def drive_match(function, inserts, queries):
    """Per query: (matched length, slots, tokens from the root to the returned node, the tree)."""
    freed: list = []
    cache, log = _filled(freed, inserts), []
    for tokens in queries:
        length, slots, node = function(cache, np.array(tokens, np.int64))
        log.append((f"query {tokens}", int(length), tuple(np.asarray(slots).tolist()), _path(cache, node),
                    snapshot(cache)))
    return log


def drive_insert(function, script):
    """script: (tokens, how) pairs; how picks fresh slots, the tree's own slots for the cached
    prefix (as a request that reused them), or a wrong number of slots."""
    freed: list = []
    cache, log, next_slot = _filled(freed, []), [], 1000
    for tokens, how in script:
        fresh = np.arange(next_slot, next_slot + len(tokens))
        next_slot += len(tokens)
        if how == "reuse":
            matched, own, _ = RadixCache.match_prefix(cache, tokens)
            fresh[:matched] = own
        elif how == "wrong":
            fresh = fresh[:-1]
        try:
            result = ("matched", int(function(cache, np.array(tokens, np.int64), fresh)))
        except ValueError:
            result = ("error", "ValueError")
        log.append((f"insert {tokens} ({how} slots)", result, tuple(freed), snapshot(cache)))
        freed.clear()
    return log


def drive_evict(function, inserts, script):
    """script: ("match" | "lock" | "unlock" | "evict", tokens or n) steps on a filled cache."""
    freed: list = []
    cache, log, held = _filled(freed, inserts), [], []
    for op, argument in script:
        if op in ("match", "lock"):
            _, _, node = RadixCache.match_prefix(cache, np.array(argument, np.int64))
            if op == "lock" and node is not cache.root:
                cache.lock(node)
                held.append(node)
            continue
        if op == "unlock":
            if held:
                cache.unlock(held.pop(argument % len(held)))
            continue
        try:
            result = ("freed", int(function(cache, argument)))
        except ValueError:
            result = ("error", "ValueError")
        log.append((f"evict {argument}", result, tuple(freed), snapshot(cache)))
        freed.clear()
    return log


def drive_order(function, inserts, requests):
    cache = _filled([], inserts)
    order = function([np.array(r, np.int64) for r in requests], cache)
    return [int(i) for i in order]


def _sequence(rng, longest=10):
    return [int(t) for t in rng.integers(0, 3, size=int(rng.integers(1, longest + 1)))]


def _match_case(rng):
    return [_sequence(rng) for _ in range(int(rng.integers(0, 6)))], [_sequence(rng, 12) for _ in range(6)]


def _insert_case(rng):
    return ([(_sequence(rng), str(rng.choice(["fresh", "fresh", "reuse", "wrong"]))) for _ in range(int(rng.integers(1, 10)))],)


def _evict_case(rng):
    inserts = [_sequence(rng) for _ in range(int(rng.integers(2, 8)))]
    script = []
    for _ in range(int(rng.integers(4, 16))):
        op = str(rng.choice(["match", "lock", "lock", "unlock", "evict", "evict", "evict"]))
        if op == "evict":
            script.append((op, int(rng.integers(-1, 12))))
        elif op == "unlock":
            script.append((op, int(rng.integers(0, 4))))
        else:  # a prefix of something cached, so locks pin real paths
            source = inserts[int(rng.integers(len(inserts)))]
            script.append((op, source[:int(rng.integers(1, len(source) + 1))]))
    return inserts, script


def _order_case(rng):
    return [_sequence(rng) for _ in range(int(rng.integers(0, 5)))], [_sequence(rng) for _ in range(int(rng.integers(0, 9)))]


register(Check("ch04.match_prefix", match_prefix, _match_case, drive=drive_match, rtol=0, atol=0))
register(Check("ch04.insert", insert, _insert_case, drive=drive_insert, rtol=0, atol=0))
register(Check("ch04.evict", evict, _evict_case, drive=drive_evict, rtol=0, atol=0))
register(Check("ch04.longest_prefix_first", longest_prefix_first, _order_case, drive=drive_order, rtol=0, atol=0))
