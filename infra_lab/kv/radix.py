"""The radix KV cache: a radix tree over token sequences whose edges hold the KV slots of their
tokens, shared by every request with that prefix (Zheng et al., "SGLang: Efficient Execution of
Structured Language Model Programs", 2024: RadixAttention).

`match_prefix` finds the longest cached prefix (splitting an edge where a match ends inside it),
`insert` adds a sequence and hands the slots it already had back to the allocator, `lock` and
`unlock` pin a request's path, and `evict` frees least-recently-used unpinned leaves, walking up
as parents become leaves.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

EMPTY = np.zeros(0, np.int64)


class Node:
    __slots__ = ("children", "parent", "key", "slots", "lock_refs", "last_access")

    def __init__(self, key: np.ndarray, slots: np.ndarray, parent: Node | None, last_access: int = 0):
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.key = key  # (n,) token ids on the edge into this node
        self.slots = slots  # (n,) KV slots holding those tokens
        self.lock_refs = 0
        self.last_access = last_access


def _common_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class RadixCache:
    def __init__(self, free_slots: Callable[[np.ndarray], None] = lambda slots: None):
        self.root = Node(EMPTY, EMPTY, None)
        self.root.lock_refs = 1  # never evicted
        self.free_slots = free_slots  # where slots the tree lets go of are returned
        self.clock = 0
        self.total_size = 0  # tokens cached
        self.locked_size = 0  # tokens on locked paths

    @property
    def evictable_size(self) -> int:
        return self.total_size - self.locked_size

    def peek_prefix(self, tokens) -> int:
        """How many leading tokens are cached, without splitting edges or touching the LRU
        clock (for schedulers that only look)."""
        tokens = np.asarray(tokens, np.int64)
        node, position = self.root, 0
        while position < len(tokens):
            child = node.children.get(int(tokens[position]))
            if child is None:
                break
            shared = _common_length(child.key, tokens[position:])
            position += shared
            if shared < len(child.key):
                break
            node = child
        return position

    def match_prefix(self, tokens) -> tuple[int, np.ndarray, Node]:
        """(matched length, the KV slots of the matched tokens, the node the match ends at)."""
        tokens = np.asarray(tokens, np.int64)
        self.clock += 1
        node, position, pieces = self.root, 0, []
        while position < len(tokens):
            child = node.children.get(int(tokens[position]))
            if child is None:
                break
            shared = _common_length(child.key, tokens[position:])
            if shared < len(child.key):
                child = self._split(child, shared)
            child.last_access = self.clock
            pieces.append(child.slots)
            position += shared
            node = child
            if shared < len(child.key):
                break
        return position, np.concatenate(pieces) if pieces else EMPTY, node

    def _split(self, child: Node, at: int) -> Node:
        """Cut child's edge after `at` tokens; the new upper node is returned."""
        upper = Node(child.key[:at], child.slots[:at], child.parent, child.last_access)
        upper.lock_refs = child.lock_refs
        upper.children = {int(child.key[at]): child}
        child.parent.children[int(child.key[0])] = upper
        child.key, child.slots, child.parent = child.key[at:], child.slots[at:], upper
        return upper

    def insert(self, tokens, slots) -> int:
        """Cache `tokens` with their KV `slots`; return how many were cached already. For those,
        the tree keeps its own slots, and given slots that duplicate them go back to the
        allocator (a request that reused the tree's slots for its prefix hands back none)."""
        tokens, slots = np.asarray(tokens, np.int64), np.asarray(slots, np.int64)
        if tokens.shape != slots.shape or tokens.ndim != 1:
            raise ValueError(f"need one KV slot per token; got {tokens.shape} tokens and {slots.shape} slots")
        matched, cached_slots, node = self.match_prefix(tokens)
        duplicates = slots[:matched][slots[:matched] != cached_slots]
        if len(duplicates):
            self.free_slots(duplicates)
        if matched < len(tokens):
            leaf = Node(tokens[matched:].copy(), slots[matched:].copy(), node, self.clock)
            node.children[int(tokens[matched])] = leaf
            self.total_size += len(leaf.key)
        return matched

    def lock(self, node: Node) -> None:
        """Pin node's path to the root for a request in flight."""
        while node is not self.root:
            if node.lock_refs == 0:
                self.locked_size += len(node.key)
            node.lock_refs += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Release a `lock(node)`. Like `lock`, a no-op on the root (an empty match), so callers
        need not special-case one; a node that is not locked is an error."""
        if node is not self.root and node.lock_refs == 0:
            raise ValueError(f"unlock of a node that is not locked (lock_refs 0, key "
                             f"{node.key[:8].tolist()}{'...' if len(node.key) > 8 else ''}); "
                             "unlock only what lock() pinned, once per lock")
        while node is not self.root:
            node.lock_refs -= 1
            if node.lock_refs == 0:
                self.locked_size -= len(node.key)
            node = node.parent

    def evict(self, n_tokens: int) -> int:
        """Free at least `n_tokens` (whole leaves, least recently used first) or as many as no
        request holds; return how many were freed."""
        if n_tokens < 0:
            raise ValueError(f"cannot evict {n_tokens} tokens")
        leaves = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_refs == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < n_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            self.free_slots(leaf.slots)
            freed += len(leaf.key)
            self.total_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[int(leaf.key[0])]
            if parent is not self.root and not parent.children and parent.lock_refs == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def lines(self, show: Callable[[np.ndarray], str] = lambda key: str(key.tolist())) -> list[str]:
        """The tree as indented text, one line per node, children in token order: the edge's
        tokens through `show`, then its slots, lock count and last access."""
        out, stack = [], [(child, 0) for _, child in sorted(self.root.children.items(), reverse=True)]
        while stack:
            node, depth = stack.pop()
            slots = node.slots.tolist()
            shown = slots if len(slots) <= 4 else f"[{slots[0]}..{slots[-1]}]"
            out.append(f"{'    ' * depth}{show(node.key)}  slots {shown}, lock_refs {node.lock_refs}, "
                       f"last_access {node.last_access}")
            stack.extend((child, depth + 1) for _, child in sorted(node.children.items(), reverse=True))
        return out

    def _leaves(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node
