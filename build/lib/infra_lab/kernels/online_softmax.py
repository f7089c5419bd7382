"""The online softmax: attention over a block of keys as a partial result that merges exactly.

For query rows with scores s (R, n) against values V (n, D), a partial result is
(m, l, acc): the row max m = max s, the sum l = sum exp(s - m), and acc = sum exp(s - m) V.
Two partials over disjoint key blocks merge by rescaling each to the larger max:
m = max(m1, m2), l = l1 e^(m1 - m) + l2 e^(m2 - m), acc = acc1 e^(m1 - m) + acc2 e^(m2 - m);
acc / l is the softmax-weighted output (Milakov and Gimelshein, 2018; FlashAttention uses it).
"""
from __future__ import annotations

import numpy as np


def partial(scores: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """scores (R, n), values (n, D) -> (m (R,), l (R,), acc (R, D))."""
    if scores.ndim != 2 or values.ndim != 2 or scores.shape[1] != values.shape[0] or scores.shape[1] < 1:
        raise ValueError(f"need scores (R, n) and values (n, D) with n >= 1; got {scores.shape}, {values.shape}")
    top = scores.max(axis=1)
    weights = np.exp(scores - top[:, None])
    return top, weights.sum(axis=1), weights @ values


def merge(first: tuple, second: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The partial result over both key blocks."""
    (m1, l1, acc1), (m2, l2, acc2) = first, second
    top = np.maximum(m1, m2)
    a, b = np.exp(m1 - top), np.exp(m2 - top)
    return top, l1 * a + l2 * b, acc1 * a[:, None] + acc2 * b[:, None]


def finish(result: tuple) -> np.ndarray:
    """The attention output, acc / l, (R, D)."""
    _, total, acc = result
    return acc / total[:, None]
