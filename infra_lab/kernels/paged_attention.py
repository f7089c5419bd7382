"""Paged decode attention: one query per sequence, reading K and V through block tables.

k_pool, v_pool: (num_blocks, block_size, n_kv_heads, head_dim), one layer of a PagedKVCache;
block_tables: (batch, max_blocks) int, -1 past the end; lengths: (batch,). Sequence b's token t
sits in block block_tables[b, t // block_size] at slot t % block_size. The numba kernel streams
each block's rows for all heads at once, prefetches the next block's rows as it goes, and
merges per-split softmaxes (flash-decoding), like the contiguous kernel of chapter 01; torch
gathers the blocks into a contiguous copy first.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from infra_lab import backend as backends
from infra_lab.kernels.attention import _exp_nonpositive
from infra_lab.kernels.attention_decode import _merge_splits, decode_attention_numpy
from infra_lab.kernels.prefetch import prefetch_span


def _check(q, k_pool, v_pool, block_tables, lengths) -> None:
    if len(q.shape) != 3 or len(k_pool.shape) != 4 or tuple(k_pool.shape) != tuple(v_pool.shape):
        raise ValueError(f"need q (batch, n_heads, d) and k_pool, v_pool (num_blocks, block_size, n_kv_heads, d); "
                         f"got q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}")
    batch, n_heads, d = q.shape
    num_blocks, block_size, n_kv, _ = k_pool.shape
    if k_pool.shape[3] != d or n_heads % n_kv:
        raise ValueError(f"q {tuple(q.shape)} does not fit k_pool {tuple(k_pool.shape)}: d must match and "
                         "n_heads must be a multiple of n_kv_heads")
    tables, lengths = np.asarray(block_tables), np.asarray(lengths)
    if tables.ndim != 2 or tables.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"need block_tables (batch={batch}, max_blocks) and lengths ({batch},); "
                         f"got {tables.shape} and {lengths.shape}")
    if (lengths < 1).any() or (lengths > tables.shape[1] * block_size).any():
        raise ValueError(f"lengths must be in [1, {tables.shape[1] * block_size}]; got {lengths.tolist()}")
    for b in range(batch):
        used = tables[b, : -(-int(lengths[b]) // block_size)]
        if (used < 0).any() or (used >= num_blocks).any():
            raise ValueError(f"sequence {b}'s block table points outside the pool of {num_blocks}: {used.tolist()}")


def gather(pool: np.ndarray, block_tables, lengths) -> np.ndarray:
    """Contiguous (batch, max_len, n_kv_heads, d) copies of each sequence's rows, zero-padded."""
    tables, lengths = np.asarray(block_tables), np.asarray(lengths)
    block_size = pool.shape[1]
    out = np.zeros((len(lengths), tables.shape[1] * block_size) + pool.shape[2:], pool.dtype)
    for b, length in enumerate(lengths):
        used = tables[b, : -(-int(length) // block_size)]
        out[b, : len(used) * block_size] = pool[used].reshape((-1,) + pool.shape[2:])
    return out


def paged_decode_numpy(q, k_pool, v_pool, block_tables, lengths):
    """Reference: gather each sequence's K and V, then the float64 decode reference."""
    _check(q, k_pool, v_pool, block_tables, lengths)
    keys, values = gather(k_pool, block_tables, lengths), gather(v_pool, block_tables, lengths)
    return decode_attention_numpy(q, keys, values, np.asarray(lengths))


SPLIT_BLOCKS = 16  # blocks per task


@numba.njit(inline="always")
def _first_block_of(task, n_splits, tables, lengths, block_size):  # the task's first physical block; -1 if none
    if task >= tables.shape[0] * n_splits:
        return -1
    b, first_block = task // n_splits, task % n_splits * SPLIT_BLOCKS
    return tables[b, first_block] if first_block * block_size < lengths[b] else -1


@numba.njit(parallel=True, fastmath=True, cache=True)
def _paged_splits(q, k_pool, v_pool, tables, lengths, scale, top, total, acc, prefetch):
    batch, n_heads, d = q.shape
    block_size, n_kv = k_pool.shape[1], k_pool.shape[2]
    row_floats = n_kv * d  # one position's row of a block: every KV head
    k_flat, v_flat = k_pool.reshape(-1), v_pool.reshape(-1)
    group = n_heads // n_kv
    n_splits = top.shape[1]
    for task in numba.prange(batch * n_splits):
        b, split = task // n_splits, task % n_splits
        first_block = split * SPLIT_BLOCKS
        last = min(lengths[b], (first_block + SPLIT_BLOCKS) * block_size)  # one past the last token
        first = first_block * block_size
        if first >= last:
            continue
        end_block = (last + block_size - 1) // block_size
        query = q[b] * scale  # (n_heads, d), local and contiguous
        scores = np.empty((n_heads, last - first), np.float32)
        for logical in range(first_block, end_block):
            block = tables[b, logical]
            base = logical * block_size
            # the block read next: this task's next K block, or after the last one its first V block
            if logical + 1 < end_block:
                upcoming, upcoming_flat = tables[b, logical + 1], k_flat
            else:
                upcoming, upcoming_flat = tables[b, first_block], v_flat
            for slot in range(min(block_size, last - base)):  # one row: every KV head of a position
                if prefetch:  # the same row of the upcoming block, one block ahead
                    prefetch_span(upcoming_flat, (upcoming * block_size + slot) * row_floats, row_floats)
                for g in range(n_kv):
                    key = k_pool[block, slot, g]  # (d,), contiguous
                    for h in range(g * group, (g + 1) * group):
                        s = np.float32(0.0)
                        for i in range(d):
                            s += query[h, i] * key[i]
                        scores[h, base + slot - first] = s
        bits = np.empty(last - first, np.int32)
        for h in range(n_heads):
            row = scores[h]
            peak = row.max()
            row -= peak
            _exp_nonpositive(row, row, bits)  # vectorized exp, chapter 02
            top[b, split, h] = peak
            total[b, split, h] = row.sum()
        out = np.zeros((n_heads, d), np.float32)
        for logical in range(first_block, end_block):
            block = tables[b, logical]
            base = logical * block_size
            # the block read next: this task's next V block, or after the last one the next task's
            # first K block (numba gives each thread a contiguous range of tasks)
            if logical + 1 < end_block:
                upcoming, upcoming_flat = tables[b, logical + 1], v_flat
            else:
                upcoming, upcoming_flat = _first_block_of(task + 1, n_splits, tables, lengths, block_size), k_flat
            for slot in range(min(block_size, last - base)):
                if prefetch and upcoming >= 0:
                    prefetch_span(upcoming_flat, (upcoming * block_size + slot) * row_floats, row_floats)
                for g in range(n_kv):
                    value = v_pool[block, slot, g]
                    for h in range(g * group, (g + 1) * group):
                        p = scores[h, base + slot - first]
                        for i in range(d):
                            out[h, i] += p * value[i]
        acc[b, split] = out


def paged_decode_numba(q, k_pool, v_pool, block_tables, lengths, prefetch: bool = True):
    """CPU, float32: tasks of SPLIT_BLOCKS blocks per sequence, merged like flash-decoding.
    `prefetch` asks for each row of the next block one block ahead (see kernels.prefetch);
    False leaves the loads to the hardware prefetchers, for comparison."""
    _check(q, k_pool, v_pool, block_tables, lengths)
    lengths = np.asarray(lengths, np.int64)
    batch, n_heads, d = q.shape
    split_len = SPLIT_BLOCKS * k_pool.shape[1]
    n_splits = -(-int(lengths.max()) // split_len)
    top = np.empty((batch, n_splits, n_heads), np.float32)
    total = np.empty((batch, n_splits, n_heads), np.float32)
    acc = np.empty((batch, n_splits, n_heads, d), np.float32)
    k_pool, v_pool = np.ascontiguousarray(k_pool), np.ascontiguousarray(v_pool)  # no copy when already contiguous
    _paged_splits(np.ascontiguousarray(q, np.float32), k_pool, v_pool, np.asarray(block_tables, np.int64),
                  lengths, np.float32(1 / math.sqrt(d)), top, total, acc, bool(prefetch))
    out = np.empty((batch, n_heads, d), np.float32)
    _merge_splits(top, total, acc, lengths, out, split_len)
    return out


def paged_decode_torch(q, k_pool, v_pool, block_tables, lengths):
    """torch: gather the blocks into contiguous K and V, then scaled_dot_product_attention with
    a length mask. numpy in, numpy out (on the backend's device); or tensors in, tensors out."""
    import torch
    import torch.nn.functional as F

    as_numpy = isinstance(q, np.ndarray)
    if as_numpy:
        _check(q, k_pool, v_pool, block_tables, lengths)
        current = backends.current()
        device = current.device if current.name == "torch" else "cpu"
        q, k_pool, v_pool = (torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in (q, k_pool, v_pool))
    if not isinstance(block_tables, torch.Tensor):
        block_tables = torch.as_tensor(np.asarray(block_tables), device=q.device)
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(np.asarray(lengths), device=q.device)
    batch, n_heads, d = q.shape
    n_kv = k_pool.shape[2]
    safe = block_tables.clamp(min=0)
    keys = k_pool[safe].reshape(batch, -1, n_kv, d).permute(0, 2, 1, 3)  # (B, K, max_len, D)
    values = v_pool[safe].reshape(batch, -1, n_kv, d).permute(0, 2, 1, 3)
    group = n_heads // n_kv
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    mask = torch.arange(keys.shape[2], device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask[:, None, None, :])[:, :, 0]
    return out.cpu().numpy() if as_numpy else out


FACES = {"numpy": paged_decode_numpy, "numba": paged_decode_numba, "torch": paged_decode_torch}


def paged_decode(q, k_pool, v_pool, block_tables, lengths, backend: backends.Backend | None = None):
    """Paged decode attention on the current backend (or the one given)."""
    return backends.pick(FACES, backend)(q, k_pool, v_pool, block_tables, lengths)
