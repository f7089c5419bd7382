"""Decode attention: one new query per sequence against its cached keys and values.

For each sequence b and query head h, out[b, h] = softmax(q[b, h] . K[b, :len_b]^T / sqrt(d))
V[b, :len_b]. With grouped-query attention (Ainslie et al., 2023) G = n_heads / n_kv_heads query
heads share each cached head. Every cached byte is read once per step for a few FLOPs, so the
kernel is bound by memory bandwidth.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from infra_lab import backend as backends


def _check(q_shape, k_shape, v_shape, lengths) -> None:
    if len(q_shape) != 3 or len(k_shape) != 4 or tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"need q (batch, n_heads, d) and k, v (batch, max_len, n_kv_heads, d); "
                         f"got q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)}")
    batch, n_heads, d = q_shape
    if k_shape[0] != batch or k_shape[3] != d or n_heads % k_shape[2]:
        raise ValueError(f"q {tuple(q_shape)} does not fit k {tuple(k_shape)}: batch and d must "
                         "match, and n_heads must be a multiple of n_kv_heads")
    lengths = np.asarray(lengths)
    if lengths.shape != (batch,) or (lengths < 1).any() or (lengths > k_shape[1]).any():
        raise ValueError(f"lengths must be {batch} values in [1, {k_shape[1]}]; got {lengths.tolist()}")


def decode_attention_numpy(q, k, v, lengths):
    """Reference, in float64: q (B, H, D); k, v (B, T, KV, D); lengths (B,) -> (B, H, D)."""
    _check(q.shape, k.shape, v.shape, lengths)
    batch, n_heads, d = q.shape
    group = n_heads // k.shape[2]
    out = np.empty((batch, n_heads, d))
    for b in range(batch):
        for h in range(n_heads):
            keys = k[b, : lengths[b], h // group].astype(np.float64)  # (len, D)
            values = v[b, : lengths[b], h // group].astype(np.float64)
            scores = keys @ q[b, h].astype(np.float64) / math.sqrt(d)  # (len,)
            weights = np.exp(scores - scores.max())
            out[b, h] = weights @ values / weights.sum()
    return out


SPLIT = 256  # cached positions per task: contiguous rows of K and V, all heads at once


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _decode_attention_splits(q, k, v, lengths, scale, top, total, acc):
    """Flash-decoding: every task takes SPLIT positions of one sequence, reads those rows of K
    and V once for all heads, and leaves a partial softmax per head: its max score `top`, the
    sum of exp(score - top) `total`, and the weighted sum of values `acc`."""
    batch, n_heads, d = q.shape
    n_kv = k.shape[2]
    group = n_heads // n_kv
    n_splits = top.shape[1]
    for task in numba.prange(batch * n_splits):
        b, split = task // n_splits, task % n_splits
        first, last = split * SPLIT, min(lengths[b], (split + 1) * SPLIT)
        if first >= last:
            continue
        scores = np.empty((n_heads, last - first), np.float32)
        for t in range(first, last):  # K rows, contiguous across heads
            for h in range(n_heads):
                s = np.float32(0.0)
                for i in range(d):
                    s += q[b, h, i] * k[b, t, h // group, i]
                scores[h, t - first] = s * scale
        for h in range(n_heads):
            peak = scores[h].max()
            summed = np.float32(0.0)
            for j in range(last - first):
                scores[h, j] = np.exp(scores[h, j] - peak)
                summed += scores[h, j]
            top[b, split, h] = peak
            total[b, split, h] = summed
            acc[b, split, h, :] = 0.0
        for t in range(first, last):  # V rows
            for h in range(n_heads):
                p = scores[h, t - first]
                for i in range(d):
                    acc[b, split, h, i] += p * v[b, t, h // group, i]


@numba.njit(cache=True)
def _merge_splits(top, total, acc, lengths, out, split_len):
    """Combine partial softmaxes: rescale each by exp(its max - the overall max)."""
    batch, n_splits, n_heads = top.shape
    for b in range(batch):
        used = (lengths[b] + split_len - 1) // split_len
        for h in range(n_heads):
            peak = top[b, 0, h]
            for split in range(1, used):
                peak = max(peak, top[b, split, h])
            weight_sum = 0.0
            out[b, h, :] = 0.0
            for split in range(used):
                factor = np.exp(top[b, split, h] - peak)
                weight_sum += factor * total[b, split, h]
                out[b, h, :] += factor * acc[b, split, h, :]
            out[b, h, :] /= weight_sum


def decode_attention_numba(q, k, v, lengths):
    """CPU, float32: tasks of SPLIT cached positions each, then a merge of their softmaxes."""
    _check(q.shape, k.shape, v.shape, lengths)
    lengths = np.asarray(lengths, np.int64)
    batch, n_heads, d = q.shape
    n_splits = (int(lengths.max()) + SPLIT - 1) // SPLIT
    top = np.empty((batch, n_splits, n_heads), np.float32)
    total = np.empty((batch, n_splits, n_heads), np.float32)
    acc = np.empty((batch, n_splits, n_heads, d), np.float32)
    _decode_attention_splits(np.ascontiguousarray(q, np.float32), np.ascontiguousarray(k, np.float32),
                             np.ascontiguousarray(v, np.float32), lengths,
                             np.float32(1 / math.sqrt(d)), top, total, acc)
    out = np.empty((batch, n_heads, d), np.float32)
    _merge_splits(top, total, acc, lengths, out, SPLIT)
    return out


def decode_attention_torch(q, k, v, lengths):
    """torch scaled_dot_product_attention with a length mask; numpy in, numpy out (on the
    backend's device), or tensors in, tensors out."""
    import torch
    import torch.nn.functional as F

    _check(tuple(q.shape), tuple(k.shape), tuple(v.shape), np.asarray(lengths.cpu() if hasattr(lengths, "cpu") else lengths))
    as_numpy = isinstance(q, np.ndarray)
    if as_numpy:
        device = backends.torch_device()
        q, k, v = (torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in (q, k, v))
        lengths = torch.as_tensor(np.asarray(lengths), device=device)
    group = q.shape[1] // k.shape[2]
    keys = k.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # (B, H, T, D)
    values = v.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    mask = torch.arange(k.shape[1], device=k.device)[None, :] < lengths[:, None]  # (B, T)
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values,
                                         attn_mask=mask[:, None, None, :])[:, :, 0]  # (B, H, D)
    return out.cpu().numpy() if as_numpy else out


FACES = {"numpy": decode_attention_numpy, "numba": decode_attention_numba, "torch": decode_attention_torch}


def decode_attention(q, k, v, lengths, backend: backends.Backend | None = None):
    """Decode attention on the current backend (or the one given)."""
    return backends.pick(FACES, backend)(q, k, v, lengths)
