"""Routing policies: which worker takes a request. Round robin, least outstanding (the power of
two choices: Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", 2001), and
cache-aware routing as SGLang's router does it (sgl-router's cache-aware policy): send a prompt
where its prefix was sent before, unless the load is out of balance.

A policy is a `Policy` subclass with one method to write, `choose`; the router calls the hooks
`routed`, `finished` and `removed` so a policy can keep state (the cache-aware trees do).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from infra_lab.orchestration.prefix_tree import PrefixTree


@dataclass
class Worker:
    """One OpenAI-compatible server behind the router, as the policies see it."""

    url: str
    outstanding: int = 0  # requests sent to it that have not finished
    healthy: bool = True  # answered its last health probe and its last connection
    draining: bool = False  # being removed: it finishes what it has and takes nothing new


class Policy:
    """The interface a routing policy implements.

    `choose(prompt_text, workers)` returns one of `workers`: those that may take a request now
    (healthy, not draining, below their in-flight limit; never empty). `prompt_text` is the
    completion's prompt, or a chat's message contents joined by newlines. `choose` should not
    change state: the router may call it again (a retry on another worker), and it tells the
    policy what it did through the hooks below, which do nothing unless overridden.
    """

    def choose(self, prompt_text: str, workers: list[Worker]) -> Worker:
        raise NotImplementedError

    def routed(self, prompt_text: str, worker: Worker) -> None:
        """The request was sent to `worker` (its `outstanding` already counts it)."""

    def finished(self, prompt_text: str, worker: Worker, ok: bool) -> None:
        """The request sent to `worker` ended: `ok` is False if it failed."""

    def removed(self, worker: Worker) -> None:
        """`worker` left the router for good (removed through /admin/workers)."""


class RoundRobin(Policy):
    """Each worker in turn."""

    def __init__(self):
        self._turn = 0

    def choose(self, prompt_text: str, workers: list[Worker]) -> Worker:
        return workers[self._turn % len(workers)]

    def routed(self, prompt_text: str, worker: Worker) -> None:
        self._turn += 1


class LeastOutstanding(Policy):
    """The power of two choices: of two workers drawn at random, the one with fewer requests in
    flight. Nearly as good as asking every worker, and no herd all picks the same one."""

    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)

    def choose(self, prompt_text: str, workers: list[Worker]) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(workers, 2)
        return b if b.outstanding < a.outstanding else a


class CacheAware(Policy):
    """SGLang's cache-aware routing over one `PrefixTree` of routed prompt text per worker.

    If the load is out of balance (the busiest worker has more than `balance_abs_threshold`
    requests beyond the least busy one's AND more than `balance_rel_threshold` times it), the
    least busy worker. Otherwise, if some worker's tree matches at least `cache_threshold` of
    the prompt, the best-matching worker; otherwise the worker whose tree is smallest, so new
    prefixes spread out. Each tree keeps at most `max_tree_chars` characters (LRU eviction).
    Ties go to the worker with fewer requests in flight, then to the earlier in the list.
    """

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, max_tree_chars: int = 1_000_000):
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1]; got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1; "
                             f"got {balance_abs_threshold} and {balance_rel_threshold}")
        if max_tree_chars < 1:
            raise ValueError(f"max_tree_chars must be >= 1; got {max_tree_chars}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_chars = max_tree_chars
        self.trees: dict[str, PrefixTree] = {}  # by worker URL

    def imbalanced(self, workers: list[Worker]) -> bool:
        loads = [w.outstanding for w in workers]
        most, least = max(loads), min(loads)
        return most - least > self.balance_abs_threshold and most > self.balance_rel_threshold * least

    def choose(self, prompt_text: str, workers: list[Worker]) -> Worker:
        if self.imbalanced(workers):
            return min(workers, key=lambda w: w.outstanding)
        matched = [self._tree(w).match(prompt_text) for w in workers]
        best = max(matched)
        if prompt_text and best / len(prompt_text) >= self.cache_threshold:
            return min((w for w, m in zip(workers, matched) if m == best), key=lambda w: w.outstanding)
        return min(workers, key=lambda w: (self._tree(w).total_chars, w.outstanding))

    def routed(self, prompt_text: str, worker: Worker) -> None:
        tree = self.trees.setdefault(worker.url, PrefixTree())
        tree.insert(prompt_text)
        if tree.total_chars > self.max_tree_chars:
            tree.evict(self.max_tree_chars)

    def removed(self, worker: Worker) -> None:
        self.trees.pop(worker.url, None)

    def _tree(self, worker: Worker) -> PrefixTree:
        tree = self.trees.get(worker.url)
        return tree if tree is not None else _EMPTY


_EMPTY = PrefixTree()  # what a worker's tree is before anything was routed there


POLICIES = {"round-robin": RoundRobin, "least-outstanding": LeastOutstanding, "cache-aware": CacheAware}
