"""Checks for chapter 02's exercises, with their reference answers."""
from __future__ import annotations

import math

import numpy as np

from infra_lab.grading.checks import Check, register
from infra_lab.kernels import online_softmax


def merge_softmax(m1, l1, acc1, m2, l2, acc2):
    """Merge two partial softmax results over disjoint key blocks: (m, l, acc)."""
    return online_softmax.merge((m1, l1, acc1), (m2, l2, acc2))


def causal_attention(q, k, v):
    """One head, float64: q, k, v (L, D) -> (L, D); query i sees keys 0..i."""
    scores = q @ k.T / math.sqrt(q.shape[1])
    scores[np.triu(np.ones(scores.shape, bool), 1)] = -np.inf
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    return weights @ v / weights.sum(axis=1, keepdims=True)


def decode_step(q, k_new, v_new, k_cache, v_cache):
    """Append this token's key and value (H, D) to the cache (T, H, D), then attend with its
    query (H, D) over all T + 1 positions: returns (H, D)."""
    keys = np.concatenate([k_cache, k_new[None]])  # (T + 1, H, D)
    values = np.concatenate([v_cache, v_new[None]])
    scores = np.einsum("hd,thd->ht", q, keys) / math.sqrt(q.shape[1])  # (H, T + 1)
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    return np.einsum("ht,thd->hd", weights / weights.sum(axis=1, keepdims=True), values)


def int8_roundtrip(x, group_size):
    """Symmetric int8 with one scale per `group_size` consecutive values of the last axis:
    s = max|x| / 127 per group, q = round(x / s) clipped to [-127, 127], back to q * s (an
    all-zero group stays zero)."""
    grouped = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    scales = np.abs(grouped).max(axis=-1, keepdims=True) / 127
    safe = np.where(scales > 0, scales, 1)
    return (np.clip(np.rint(grouped / safe), -127, 127) * scales).reshape(x.shape)


def _partials(rng: np.random.Generator) -> tuple:
    rows, d = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    result = []
    for _ in range(2):
        n = int(rng.integers(1, 12))
        scale = float(rng.choice([1.0, 10.0, 80.0]))  # large scores: the max matters
        result += online_softmax.partial(rng.standard_normal((rows, n)) * scale, rng.standard_normal((n, d)))
    return tuple(result)


def _qkv(rng: np.random.Generator) -> tuple:
    length, d = int(rng.integers(1, 40)), int(rng.choice([1, 4, 16]))
    return tuple(rng.standard_normal((length, d)) for _ in range(3))


def _decode(rng: np.random.Generator) -> tuple:
    heads, d, cached = int(rng.integers(1, 5)), int(rng.choice([2, 8, 16])), int(rng.integers(0, 30))
    return (rng.standard_normal((heads, d)), rng.standard_normal((heads, d)), rng.standard_normal((heads, d)),
            rng.standard_normal((cached, heads, d)), rng.standard_normal((cached, heads, d)))


def _tensor(rng: np.random.Generator) -> tuple:
    group = int(rng.choice([4, 8, 32]))
    shape = (int(rng.integers(1, 5)), int(rng.integers(1, 4)), group * int(rng.integers(1, 4)))
    x = (rng.standard_normal(shape) * rng.choice([0.01, 1.0, 30.0])).astype(np.float32)
    if rng.random() < 0.3:
        x[..., :group] = 0.0  # an all-zero group: its scale is 0
    return x, group


register(Check("ch02.merge_softmax", merge_softmax, _partials, rtol=1e-9, atol=1e-12))
register(Check("ch02.causal_attention", causal_attention, _qkv, rtol=1e-6, atol=1e-9))
register(Check("ch02.decode_step", decode_step, _decode, rtol=1e-6, atol=1e-9))
register(Check("ch02.int8_roundtrip", int8_roundtrip, _tensor, rtol=1e-5, atol=1e-7))
