"""Sampling text from the model, with or without a KV cache."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from infra_lab import backend as backends
from infra_lab.model import tokenizer


@dataclass(frozen=True)
class Generation:
    prompt_tokens: list[int]
    new_tokens: list[int]
    seconds: float

    @property
    def text(self) -> str:
        return tokenizer.decode(self.new_tokens)

    @property
    def tokens_per_s(self) -> float:
        return len(self.new_tokens) / self.seconds if self.seconds > 0 else float("inf")


def nucleus(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The tokens sampling may pick from (vocab,) logits at temperature > 0, most likely first,
    with their probabilities: softmax(logits / T) cut to the top_k most likely (0: no cut) and
    then to the smallest set with mass >= top_p, renormalized."""
    scaled = logits.astype(np.float64) / temperature
    probabilities = np.exp(scaled - scaled.max())
    probabilities /= probabilities.sum()
    order = np.argsort(-probabilities, kind="stable")
    keep = len(order) if top_k == 0 else min(top_k, len(order))
    cumulative = np.cumsum(probabilities[order[:keep]])
    keep = min(keep, int(np.searchsorted(cumulative, top_p * (1 - 1e-12))) + 1)  # nucleus
    chosen = order[:keep]
    return chosen, probabilities[chosen] / probabilities[chosen].sum()


def distribution(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """(vocab,) the probabilities `sample` draws from: one-hot on the argmax at temperature 0."""
    out = np.zeros(len(logits), np.float64)
    if temperature == 0:
        out[int(np.argmax(logits))] = 1.0
    else:
        chosen, weights = nucleus(logits, temperature, top_k, top_p)
        out[chosen] = weights
    return out


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
    """One token from (vocab,) logits: greedy at temperature 0, else drawn from `nucleus`."""
    if temperature == 0:
        return int(np.argmax(logits))
    chosen, weights = nucleus(logits, temperature, top_k, top_p)
    return int(chosen[rng.choice(len(chosen), p=weights)])


def _whole(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_sampling(temperature: float, top_k: int, top_p: float, seed: int) -> None:
    """Refuses, by name, sampling settings that a step would fail on (or silently misread) later:
    a temperature that is not a finite number >= 0 (NaN passes a `< 0` test and poisons every
    probability), a top_k that is not a whole number >= 0, a top_p outside (0, 1], a seed that
    is not a whole number >= 0 (numpy's generators take no negative seed)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.number)) \
            or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 and finite (0 is greedy); got {temperature!r}")
    if not _whole(top_k) or top_k < 0:
        raise ValueError(f"top_k must be >= 0 and a whole number (0 keeps every token); got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.number)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1]; got {top_p!r}")
    if not _whole(seed) or seed < 0:
        raise ValueError(f"seed must be >= 0 and a whole number; got {seed!r}")


def generate(model, prompt, max_new_tokens: int = 64, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, use_cache: bool = True,
             backend: backends.Backend | None = None) -> Generation:
    """Continue `prompt` (text, bytes or token ids) by up to `max_new_tokens` tokens.

    With `use_cache` the prompt is prefilled once and each new token costs one decode step;
    without it, every step recomputes the whole sequence. The prompt and the new tokens must
    fit in the model's context: there is no sliding window.
    """
    tokens = list(tokenizer.encode(prompt)) if isinstance(prompt, (str, bytes)) else [int(t) for t in prompt]
    context = model.config.context
    if not tokens:
        raise ValueError("the prompt needs at least one token")
    if len(tokens) > context:
        raise ValueError(f"prompt of {len(tokens)} tokens is longer than the context of {context}")
    if max_new_tokens < 0 or len(tokens) + max_new_tokens > context:
        raise ValueError(f"max_new_tokens must be in [0, {context - len(tokens)}] for a "
                         f"{len(tokens)}-token prompt and a {context}-token context; got {max_new_tokens}")
    check_sampling(temperature, top_k, top_p, seed)
    rng = np.random.default_rng(seed)
    backend = backend or backends.current()
    started = time.perf_counter()
    new: list[int] = []
    if max_new_tokens:
        cache = model.new_cache(backend=backend) if use_cache else None
        logits = model.forward(tokens, cache, backend)[-1]
        for step in range(max_new_tokens):
            new.append(sample(logits, temperature, top_k, top_p, rng))
            if step + 1 == max_new_tokens:
                break
            if use_cache:
                logits = model.forward([new[-1]], cache, backend)[-1]
            else:
                logits = model.forward(tokens + new, None, backend)[-1]
    return Generation(tokens, new, time.perf_counter() - started)


def generate_many(model, prompts: list, max_new_tokens: int, paged=None,
                  backend: backends.Backend | None = None) -> list[list[int]]:
    """Greedy continuations of several prompts decoded together: each prompt is prefilled into
    its own sequence, then every step runs one batched decode over all of them. The sequences
    live in `paged` (a PagedKVCache) when given, else in contiguous caches: a pool of one block
    of the model's context per prompt. Sequences are freed from the pool at the end."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    backend = backend or backends.current()
    encoded = [list(tokenizer.encode(p)) if isinstance(p, (str, bytes)) else [int(t) for t in p] for p in prompts]
    longest = max(len(tokens) for tokens in encoded) if encoded else 0
    if not encoded or min(len(t) for t in encoded) < 1 or longest + max_new_tokens > model.config.context:
        raise ValueError(f"need non-empty prompts that leave room for {max_new_tokens} tokens in the "
                         f"context of {model.config.context}; the longest has {longest}")
    if paged is None:
        paged = model.new_paged_cache(len(encoded), block_size=model.config.context, backend=backend)
    seqs = [paged.new_sequence() for _ in encoded]
    caches = [paged.view(seq) for seq in seqs]
    try:
        last = np.array([int(np.argmax(model.forward(tokens, cache, backend)[-1]))
                         for tokens, cache in zip(encoded, caches)])
        outputs = [[int(t)] for t in last]
        for _ in range(max_new_tokens - 1):
            last = np.argmax(model.decode_batch(last, caches, backend), axis=-1)
            for out, token in zip(outputs, last):
                out.append(int(token))
    finally:
        for seq in seqs:
            paged.free(seq)
    return outputs
