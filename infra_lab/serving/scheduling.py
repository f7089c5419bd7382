"""Cache-aware scheduling: the order in which a batch of waiting requests is admitted (the
engine's `EngineConfig.order`; "policy" is the batching policy there, never the order).

First come first served, longest cached prefix first, and SGLang's DFS-weight order, which walks
the waiting prompts as a tree so requests sharing a prefix run back to back (Zheng et al.,
"SGLang: Efficient Execution of Structured Language Model Programs", 2024).
"""
from __future__ import annotations

from infra_lab.kv.radix import RadixCache

ORDERS = ("fcfs", "longest-prefix", "dfs-weight")


def fcfs(requests: list) -> list[int]:
    """First come, first served: indices in arrival order."""
    return list(range(len(requests)))


def longest_prefix_first(requests: list, cache: RadixCache) -> list[int]:
    """Requests whose prompts the cache already holds most of go first (ties keep arrival order).
    `cache` is a RadixCache, or any cache with its peek_prefix(tokens) (the engine's block hashes)."""
    matched = [cache.peek_prefix(tokens) for tokens in requests]
    return sorted(range(len(requests)), key=lambda i: -matched[i])


def dfs_weight(requests: list) -> list[int]:
    """SGLang's DFS-weight order: lay the waiting prompts out as a tree and walk it depth first,
    heaviest subtree (most requests) first, so requests that share a prefix run back to back."""
    root: dict = {"weight": 0, "ends": [], "children": {}}
    for index, tokens in enumerate(requests):
        node = root
        node["weight"] += 1
        for token in list(tokens):
            node = node["children"].setdefault(int(token), {"weight": 0, "ends": [], "children": {}})
            node["weight"] += 1  # requests passing through this node
        node["ends"].append(index)
    order: list[int] = []
    stack = [root]
    while stack:
        node = stack.pop()
        order.extend(node["ends"])
        stack.extend(sorted(node["children"].values(), key=lambda child: child["weight"]))  # heaviest on top
    return order


def admission_order(order: str, waiting: list, cache: RadixCache | None) -> list[int]:
    """Indices of `waiting` (token sequences) in the named order (one of ORDERS)."""
    if order == "fcfs":
        return fcfs(waiting)
    if order == "longest-prefix":
        return longest_prefix_first(waiting, cache)
    if order == "dfs-weight":
        return dfs_weight(waiting)
    raise ValueError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
