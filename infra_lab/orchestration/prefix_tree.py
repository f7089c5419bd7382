"""An approximate radix tree over prompt text, one per worker, as a router keeps to guess which
worker's KV cache holds a prompt's prefix (SGLang's router, sgl-router's cache-aware policy).

The router never sees a worker's real cache: it remembers the texts it sent there. Edges hold
strings (compressed, not one node per character); `insert` adds a text, `match` returns the
longest prefix of a text the tree holds, and `evict` drops least-recently-used leaves until the
tree holds at most a given number of characters, as the worker's own cache forgets old prefixes.
"""
from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("edge", "children", "parent", "last_used")

    def __init__(self, edge: str, parent: _Node | None, last_used: int):
        self.edge = edge  # the characters on the edge into this node (empty only at the root)
        self.children: dict[str, _Node] = {}  # by the first character of the child's edge
        self.parent = parent
        self.last_used = last_used  # a logical clock: higher is more recent


def _common_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixTree:
    """The texts routed to one worker, as a radix tree of strings with LRU eviction."""

    def __init__(self):
        self._clock = itertools.count(1)
        self.root = _Node("", None, 0)
        self.total_chars = 0  # characters on all edges: what the tree holds

    def insert(self, text: str) -> None:
        """Hold `text` (and so every prefix of it); marks its path most recently used."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        now = next(self._clock)
        node, i = self.root, 0
        node.last_used = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                if node.children or node is self.root:
                    node.children[text[i]] = _Node(text[i:], node, now)
                else:  # a leaf grows longer rather than gaining an only child
                    node.edge += text[i:]
                self.total_chars += len(text) - i
                return
            k = _common_length(child.edge, text[i:])
            if k < len(child.edge) and i + k < len(text):  # the text leaves the edge midway: split it
                child = self._split(child, k)
            child.last_used = now
            node, i = child, i + k

    def match(self, text: str) -> int:
        """The length of the longest prefix of `text` that the tree holds. Changes nothing: only
        `insert` counts as a use, so asking every worker's tree leaves their LRU order alone."""
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                return i
            k = _common_length(child.edge, text[i:])
            if k < len(child.edge):
                return i + k
            node, i = child, i + k
        return i

    def evict(self, max_chars: int) -> int:
        """Drop least-recently-used leaves until at most `max_chars` characters remain; the
        characters dropped. A parent left with one child merges with it, so edges stay long."""
        if max_chars < 0:
            raise ValueError(f"max_chars must be >= 0; got {max_chars}")
        before = self.total_chars
        if before <= max_chars:
            return 0
        order = itertools.count()  # breaks ties between equal last_used without comparing nodes
        leaves = [(leaf.last_used, next(order), leaf) for leaf in self._leaves()]
        heapq.heapify(leaves)
        while self.total_chars > max_chars and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.edge[0]]
            self.total_chars -= len(leaf.edge)
            if parent is self.root:
                continue
            if not parent.children:
                heapq.heappush(leaves, (parent.last_used, next(order), parent))
            elif len(parent.children) == 1:
                self._merge_into_child(parent)
        return before - self.total_chars

    def texts(self) -> list[str]:
        """Every text the tree holds whole (its leaves' paths), sorted: for tests and displays."""
        out = []
        for leaf in self._leaves():
            parts, node = [], leaf
            while node is not self.root:
                parts.append(node.edge)
                node = node.parent
            out.append("".join(reversed(parts)))
        return sorted(out)

    def nodes(self) -> int:
        """Nodes below the root."""
        return sum(1 for _ in self._walk()) - 1

    def _walk(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self):
        return [node for node in self._walk() if not node.children and node is not self.root]

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut `child`'s edge after `k` characters; the new upper node, which takes its place."""
        parent = child.parent
        upper = _Node(child.edge[:k], parent, child.last_used)
        parent.children[upper.edge[0]] = upper
        child.edge = child.edge[k:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def _merge_into_child(self, node: _Node) -> None:
        (child,) = node.children.values()
        child.edge = node.edge + child.edge
        child.parent = node.parent
        child.last_used = node.last_used  # the parent's use is the more recent
        node.parent.children[child.edge[0]] = child
