"""Serving the book's model through a radix cache: one KV slot per token in a shared pool (as in
SGLang, whose token pool is a paged pool with pages of one token: here a PagedKVCache with
block_size 1), with the tree holding the slots of every finished request so the next request
that starts the same way prefills only what is new.

Each request: match its prompt (all but the last token, whose logits are needed) in the tree,
lock the matched path, take slots for the rest (evicting least-recently-used leaves when the pool
is short), prefill the unmatched tail after the cached prefix, decode greedily, then insert the
prompt and answer into the tree and unlock. Without the tree, every request prefills its whole
prompt into slots it frees at the end. The tree's bookkeeping is the engine's block manager
(serving.block_manager), the one path through which chapter 05's engine caches prefixes too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from infra_lab import backend as backends
from infra_lab.kv.radix import RadixCache
from infra_lab.model import corpus, tokenizer
from infra_lab.serving.block_manager import BlockManager
from infra_lab.serving.request import Request, RequestState
from infra_lab.serving.workloads import PrefixHits


@dataclass(frozen=True)
class ModelServed(PrefixHits):
    outputs: list[list[int]]  # greedy tokens per request
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the tree
    prefill_seconds: float  # in the prefill forward passes only
    seconds: float  # the whole run
    evicted_tokens: int
    slots_in_use: int  # at the end: the tree's tokens (none without a tree)


def serve_model(model, prompts: list, max_new_tokens: int, n_slots: int, radix: bool = True,
                backend: backends.Backend | None = None, cache: RadixCache | None = None) -> ModelServed:
    """Greedy answers to `prompts` (text or token ids), one request after another, from a pool of
    `n_slots` KV slots, through a radix cache (`cache`, or a new RadixCache) or without one."""
    encoded = [list(tokenizer.encode(p)) if isinstance(p, (str, bytes)) else [int(t) for t in p] for p in prompts]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if not encoded or min(len(t) for t in encoded) < 1:
        raise ValueError("need at least one prompt, and every prompt needs at least one token")
    longest = max(len(t) for t in encoded) + max_new_tokens - 1  # slots one request holds
    if longest + 1 > model.config.context:
        raise ValueError(f"the longest prompt plus {max_new_tokens} new tokens exceeds the context of "
                         f"{model.config.context}")
    if n_slots < longest:
        raise ValueError(f"n_slots={n_slots} cannot hold one request: the longest needs {longest}")
    if cache is not None and (not radix or cache.total_size):
        raise ValueError("cache must be an empty RadixCache, with radix=True: a tree's slots belong to the pool "
                         f"of the run that filled it (got radix={radix}, {cache.total_size} tokens cached)")
    backend = backend or backends.current()
    pool = model.new_paged_cache(n_slots, block_size=1, backend=backend)  # a slot is a block of one token
    blocks = BlockManager(pool, radix=radix, tree=cache)  # the engine's books: a tree's slots are held once
    outputs, cached, prefill_seconds = [], 0, 0.0
    started = time.perf_counter()
    for i, tokens in enumerate(encoded):
        request = Request(i, tokens, state=RequestState.RUNNING)
        matched = blocks.start(request)  # the cached prefix, locked; its slots head the block table
        try:
            blocks.make_room(len(tokens) - matched + max_new_tokens - 1)  # evicting LRU leaves if short
            view = pool.view(request.seq)
            prefill_started = time.perf_counter()
            out = [int(np.argmax(model.forward(tokens[matched:], view, backend)[-1]))]
            prefill_seconds += time.perf_counter() - prefill_started
            for _ in range(max_new_tokens - 1):
                out.append(int(np.argmax(model.forward(out[-1:], view, backend)[-1])))
        finally:
            blocks.release(request)  # the prompt and answer (less the last token) go into the tree
        outputs.append(out)
        cached += matched
    return ModelServed(outputs, sum(len(t) for t in encoded), cached, prefill_seconds,
                       time.perf_counter() - started, blocks.evicted_tokens, n_slots - pool.num_free)


def module_opening(source: bytes, prefix_bytes: int) -> bytes:
    """The whole lines that open `source` within its first `prefix_bytes` bytes, so that no line
    is cut mid-word (a first line longer than that is cut at `prefix_bytes`, and ends the
    opening with a newline added)."""
    if prefix_bytes < 1:
        raise ValueError(f"prefix_bytes must be at least 1; got {prefix_bytes}")
    head = source[:prefix_bytes]
    end = head.rfind(b"\n")
    return head[:end + 1] if end >= 0 else head + b"\n"


def shared_prefix_prompts(n_prompts: int = 24, n_prefixes: int = 3, prefix_bytes: int = 320,
                          seed: int = 0) -> list[bytes]:
    """Prompts of real Python that share prefixes, from the validation modules (held out of
    training): `n_prefixes` module openings of at most `prefix_bytes` bytes, cut after a whole line
    (`module_opening`), each request one of them plus a `def` line from the same module, in a
    seeded random order."""
    if not 1 <= n_prefixes <= len(corpus.VALIDATION):
        raise ValueError(f"n_prefixes must be in [1, {len(corpus.VALIDATION)}]; got {n_prefixes}")
    rng = np.random.default_rng(seed)
    root = corpus.stdlib_root()
    sources = [(root / name).read_bytes() for name in corpus.VALIDATION[:n_prefixes]]
    defs = [[line.strip() + b"\n" for line in source.splitlines() if line.strip().startswith(b"def ")]
            for source in sources]
    openings = [module_opening(source, prefix_bytes) for source in sources]
    prompts = []
    for _ in range(n_prompts):
        which = int(rng.integers(n_prefixes))
        line = defs[which][int(rng.integers(len(defs[which])))][:120]
        prompts.append(openings[which] + b"\n" + line + b"    ")
    return prompts
