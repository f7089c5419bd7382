"""Request streams that share prefixes, and how much of their prefill a prefix cache saves.

Each workload is a list of prompts (token arrays) in arrival order; the generators are seeded
and their shapes are documented with each function. The generators' lengths are chosen not to
be multiples of 16 (sums of them can be, as one multi-turn history of 320 tokens is), as real
prompts' are not: block hashing can only share whole blocks, the radix tree any
prefix. `serve` admits them in batches of `batch` waiting requests, in an admission order
(serving.scheduling), through a radix cache of `capacity` tokens (chapter 04) or chapter 03's paged
cache with block-hash prefix sharing, and counts prompt tokens served from the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infra_lab.kv.paged import PagedKVCache
from infra_lab.kv.radix import RadixCache
from infra_lab.serving.scheduling import ORDERS, admission_order

VOCAB = 50_000


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n)


def few_shot(n_requests: int = 400, n_templates: int = 4, examples: int = 8,
             example_len: int = 61, question_len: int = 30, seed: int = 0) -> list[np.ndarray]:
    """`n_templates` few-shot prompts of `examples` x `example_len` shared tokens; every request
    takes one template and adds its own `question_len`-token question."""
    rng = np.random.default_rng(seed)
    templates = [_tokens(rng, examples * example_len) for _ in range(n_templates)]
    return [np.concatenate([templates[rng.integers(n_templates)], _tokens(rng, question_len)])
            for _ in range(n_requests)]


def multi_turn(n_sessions: int = 40, turns: int = 6, system_len: int = 70, user_len: int = 25,
               answer_len: int = 50, seed: int = 0) -> list[np.ndarray]:
    """Chat sessions sharing one system prompt; turn t of a session sends the whole history
    (system, earlier questions and answers) plus a new question. Sessions interleave at random."""
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_len)
    histories = [system.copy() for _ in range(n_sessions)]
    remaining = [turns] * n_sessions
    requests = []
    while any(remaining):
        session = int(rng.choice([s for s in range(n_sessions) if remaining[s]]))
        prompt = np.concatenate([histories[session], _tokens(rng, user_len)])
        requests.append(prompt)
        answer = _tokens(rng, answer_len)
        histories[session] = np.concatenate([prompt, answer])  # the answer joins the history
        remaining[session] -= 1
    return requests


def tree_of_thought(n_trees: int = 20, branching: int = 3, depth: int = 3,
                    question_len: int = 120, thought_len: int = 30,
                    seed: int = 0) -> list[np.ndarray]:
    """Each tree: a question, then `branching` thoughts per node to `depth`; every node's path
    is a request, breadth first within a tree."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(n_trees):
        level = [_tokens(rng, question_len)]
        requests.extend(level)
        for _ in range(depth):
            level = [np.concatenate([path, _tokens(rng, thought_len)])
                     for path in level for _ in range(branching)]
            requests.extend(level)
    return requests


def control(n_requests: int = 400, length: int = 300, seed: int = 0) -> list[np.ndarray]:
    """No sharing at all: every prompt is new."""
    rng = np.random.default_rng(seed)
    return [_tokens(rng, length) for _ in range(n_requests)]


WORKLOADS = {"few-shot": few_shot, "multi-turn": multi_turn, "tree-of-thought": tree_of_thought,
             "control": control}


def mix(weights: dict[str, float], n_requests: int = 600, seed: int = 0) -> list[np.ndarray]:
    """`n_requests` drawn from several workloads: each next request comes from workload w with
    probability weights[w] (normalized), and each workload's requests keep their own order."""
    unknown = sorted(set(weights) - set(WORKLOADS))
    if unknown or not weights or min(weights.values()) < 0 or sum(weights.values()) <= 0:
        raise ValueError(f"weights must be non-negative, not all zero, over "
                         f"{', '.join(WORKLOADS)}; got {weights}")
    rng = np.random.default_rng(seed)
    names = list(weights)
    p = np.array([weights[name] for name in names], float)
    streams = {name: iter(WORKLOADS[name](seed=seed + 1 + i))
               for i, name in enumerate(names) if weights[name] > 0}
    requests = []
    while len(requests) < n_requests and streams:
        live = [name for name in names if name in streams]
        chances = np.array([p[names.index(name)] for name in live])
        name = live[int(rng.choice(len(live), p=chances / chances.sum()))]
        request = next(streams[name], None)
        if request is None:
            del streams[name]  # that workload ran out; the others go on
        else:
            requests.append(request)
    return requests


class PrefixHits:
    """What a prefix cache saved, from `prompt_tokens` and `cached_tokens` (served from it)."""

    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class Served(PrefixHits):
    prompt_tokens: int
    cached_tokens: int  # served from the cache
    hit_rates: list[float]  # per batch, in order
    evictions: list[int]  # tokens evicted per batch, in order
    matches: list[tuple[int, int]]  # (prompt, cached) tokens per request, as admitted


def serve(requests: list[np.ndarray], capacity: int, order: str = "fcfs",
          batch: int = 16) -> Served:
    """Radix cache of `capacity` tokens: each batch is admitted in the given order; every
    request matches its prefix, then its prompt is cached, evicting LRU leaves to stay in budget."""
    if capacity < max(len(r) for r in requests):
        longest = max(len(r) for r in requests)
        raise ValueError(f"capacity {capacity} is smaller than the longest prompt, {longest}")
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    cache, next_slot = RadixCache(), 0
    total = cached = 0
    rates, evictions, matches = [], [], []
    for first in range(0, len(requests), batch):
        waiting = requests[first:first + batch]
        batch_total = batch_cached = batch_evicted = 0
        for index in admission_order(order, waiting, cache):
            tokens = waiting[index]
            matched, _, _ = cache.match_prefix(tokens)
            matches.append((len(tokens), matched))
            batch_total, batch_cached = batch_total + len(tokens), batch_cached + matched
            overflow = cache.total_size + len(tokens) - matched - capacity
            if overflow > 0:
                batch_evicted += cache.evict(overflow)
            cache.insert(tokens, np.arange(next_slot, next_slot + len(tokens)))
            next_slot += len(tokens)
        total, cached = total + batch_total, cached + batch_cached
        rates.append(batch_cached / batch_total)
        evictions.append(batch_evicted)
    return Served(total, cached, rates, evictions, matches)


def serve_block_hashing(requests: list[np.ndarray], capacity: int, block_size: int = 16,
                        batch: int = 16) -> Served:
    """Chapter 03's prefix sharing: only whole blocks whose chained hash matches are reused;
    freed blocks stay cached until the pool needs them (least recently freed first), in arrival
    order. Rates and evictions are summed per `batch` requests, as `serve` reports them."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    pool = PagedKVCache(1, 1, 1, capacity // block_size, block_size, prefix_sharing=True)
    total = cached = 0
    rates, evictions, matches = [], [], []
    for first in range(0, len(requests), batch):
        batch_total = batch_cached = batch_evicted = 0
        for tokens in requests[first:first + batch]:
            seq = pool.new_sequence()
            matched = pool.match_prefix(seq, tokens)
            pool.reserve(seq, len(tokens) - matched)
            batch_evicted += len(pool.allocator.evicted) * block_size  # cached blocks taken back
            pool.commit(seq, tokens[matched:])
            pool.free(seq)
            matches.append((len(tokens), matched))
            batch_total, batch_cached = batch_total + len(tokens), batch_cached + matched
        total, cached = total + batch_total, cached + batch_cached
        rates.append(batch_cached / batch_total)
        evictions.append(batch_evicted)
    return Served(total, cached, rates, evictions, matches)
