"""Extend attention: a chunk of new queries per sequence attends to the sequence's cached prefix,
read through its block table, and causally to itself. One kernel covers prefill from nothing,
chunked prefill, prefill after a prefix-cache hit and the verification of drafted tokens; decode
is the case of one query (see paged_attention for its own kernel).

Shapes, as serving engines flatten a step (vLLM's and SGLang's varlen "extend"): q (N, H, D),
the new tokens of every sequence one after another; sequence b owns rows
query_starts[b]:query_starts[b + 1] and, after this step's keys are written, holds
context_lens[b] tokens, so its query i sits at position context_lens[b] - n_b + i and sees
keys 0 .. that position. Pools are (num_blocks, block_size, n_kv_heads, D), as in
paged_attention; block_tables (B, max_blocks), -1 past the end.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numba
import numpy as np

from infra_lab import backend as backends
from infra_lab.kernels.attention import _exp_nonpositive, single_threaded_blas
from infra_lab.kernels import paged_attention
from infra_lab.kernels.paged_attention import flat_pool, gather
from infra_lab.kernels.paged_shapes import check_extend_shapes, check_queries, check_tables, positions

TILE_Q = 64  # query rows per task of the numba kernel
TILE_K = 128  # keys gathered and scored at a time


def _check(q, k_pool, v_pool, block_tables, query_starts, context_lens) -> None:
    check_extend_shapes(q, k_pool, v_pool, np.asarray(block_tables), np.asarray(query_starts),
                        np.asarray(context_lens))
    check_queries(query_starts, context_lens, q.shape[0])
    check_tables(block_tables, context_lens, k_pool.shape[0], k_pool.shape[1])


def extend_attention_numpy(q, k_pool, v_pool, block_tables, query_starts, context_lens):
    """Reference, in float64: gather each sequence's keys and values, mask the future."""
    _check(q, k_pool, v_pool, block_tables, query_starts, context_lens)
    starts, context = np.asarray(query_starts), np.asarray(context_lens)
    keys, values = gather(k_pool, block_tables, context), gather(v_pool, block_tables, context)
    n_heads, d = q.shape[1:]
    group = n_heads // k_pool.shape[2]
    where = positions(starts, context)
    out = np.empty(q.shape)
    for b in range(len(context)):
        rows = slice(starts[b], starts[b + 1])
        k = np.repeat(keys[b, : context[b]].astype(np.float64), group, axis=1)  # (ctx, H, D)
        v = np.repeat(values[b, : context[b]].astype(np.float64), group, axis=1)
        scores = np.einsum("nhd,thd->hnt", q[rows].astype(np.float64), k) / math.sqrt(d)  # (H, n, ctx)
        scores[:, np.arange(context[b])[None, :] > where[rows][:, None]] = -np.inf
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[rows] = np.einsum("hnt,thd->nhd", weights / weights.sum(-1, keepdims=True), v)
    return out


def tasks(query_starts, context_lens, n_kv: int, tile_q: int = TILE_Q) -> np.ndarray:
    """(tasks, 3) int64 rows (first query row, last query row + 1, KV head): every tile of at
    most `tile_q` rows of one sequence, once per KV head, heaviest first (most keys to read),
    so that dealing them out in turn gives the threads equal work."""
    starts, context = np.asarray(query_starts, np.int64), np.asarray(context_lens, np.int64)
    first_rows, ends, keys = [], [], []
    for b in range(len(context)):
        tile_starts = np.arange(starts[b], starts[b + 1], tile_q)
        tile_ends = np.minimum(tile_starts + tile_q, starts[b + 1])
        first_rows.append(tile_starts)
        ends.append(tile_ends)
        keys.append(context[b] - (starts[b + 1] - tile_ends))  # keys the tile's last row sees
    first, end, work = (np.concatenate(x) for x in (first_rows, ends, keys))
    order = np.argsort(-work * (end - first), kind="stable")
    heads = np.arange(n_kv)
    return np.stack([np.repeat(first[order], n_kv), np.repeat(end[order], n_kv),
                     np.tile(heads, len(order))], axis=1)


@functools.cache
def _extend_tiles_for(head_dim: int):
    """The kernel with head_dim fixed at compile time (one compile per head_dim, cached on disk)."""

    @numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def extend_tiles(q_scaled, k_flat, v_flat, k_stride, v_stride, block_size, n_kv, tables, row_seq,
                     row_pos, work, n_workers, out):
        # Each of n_workers threads takes tasks worker, worker + n_workers, ...: a tile of query
        # rows of one sequence and one KV head, with that head's `group` query heads stacked, so
        # that a gathered tile of keys meets group x rows queries in one BLAS call.
        n_heads = q_scaled.shape[1]
        d = head_dim
        group = n_heads // n_kv
        for worker in numba.prange(n_workers):
            keys = np.empty((TILE_K, d), np.float32)
            values = np.empty((TILE_K, d), np.float32)
            for task in range(worker, len(work), n_workers):
                first, end, g = work[task, 0], work[task, 1], work[task, 2]
                rows = end - first
                b = row_seq[first]
                stacked = np.empty((group * rows, d), np.float32)  # row i: head g*group + i // rows
                for i in range(group):
                    stacked[i * rows:(i + 1) * rows] = q_scaled[first:end, g * group + i]
                top = np.full(group * rows, -np.inf, np.float32)
                total = np.zeros(group * rows, np.float32)
                acc = np.zeros((group * rows, d), np.float32)
                bits = np.empty(group * rows * TILE_K, np.int32)
                seen = row_pos[end - 1] + 1  # keys the tile's last row sees
                for k0 in range(0, seen, TILE_K):
                    cols = min(TILE_K, seen - k0)
                    for j in range(cols):  # gather this tile's keys and values through the table
                        block, slot = tables[b, (k0 + j) // block_size], (k0 + j) % block_size
                        keys[j] = k_flat[block * k_stride + (slot * n_kv + g) * d:][:d]
                        values[j] = v_flat[block * v_stride + (slot * n_kv + g) * d:][:d]
                    scores = np.dot(stacked, keys[:cols].T)  # (group * rows, cols)
                    for i in range(group * rows):
                        row = scores[i]
                        visible = min(cols, row_pos[first + i % rows] - k0 + 1)
                        if visible <= 0:
                            row[:] = -1e4  # exp gives ~1e-38, zeroed below
                            continue
                        row[visible:] = -1e4
                        row_top = max(top[i], row[:visible].max())
                        correction = math.exp(top[i] - row_top)
                        top[i] = row_top
                        total[i] *= correction
                        acc[i] *= correction
                        row -= row_top
                    flat = scores.reshape(group * rows * cols)
                    _exp_nonpositive(flat, flat, bits[: group * rows * cols])
                    for i in range(group * rows):
                        visible = min(cols, row_pos[first + i % rows] - k0 + 1)
                        scores[i, max(visible, 0):] = 0.0
                        total[i] += scores[i].sum()
                    acc += np.dot(scores, values[:cols])  # (group * rows, d)
                for i in range(group * rows):
                    out[first + i % rows, g * group + i // rows] = acc[i] / total[i]

    return extend_tiles


@dataclass(frozen=True)
class ExtendPlan:
    """The numba kernel's work for one step's metadata: the same for every layer."""
    tables: np.ndarray  # (B, max_blocks) int64
    row_seq: np.ndarray  # (N,) each query row's sequence
    row_pos: np.ndarray  # (N,) each query row's position
    work: np.ndarray  # (tasks, 3): see tasks()


def plan_extend(query_starts, context_lens, block_tables, n_kv: int) -> ExtendPlan:
    """The tiles, for each of `n_kv` KV heads, and the positions of a step's query rows."""
    starts, context = np.asarray(query_starts, np.int64), np.asarray(context_lens, np.int64)
    return ExtendPlan(np.asarray(block_tables, np.int64), np.repeat(np.arange(len(context)), np.diff(starts)),
                      positions(starts, context), tasks(starts, context, n_kv))


def extend_attention_numba(q, k_pool, v_pool, block_tables, query_starts, context_lens, checked: bool = False):
    """CPU, float32: tiles of up to TILE_Q query rows, keys gathered TILE_K at a time through the
    block table into a contiguous buffer and scored through BLAS, folded by the online softmax
    (chapter 02). `checked=True` skips the checks (the model checks a step's metadata once)."""
    if not checked:
        _check(q, k_pool, v_pool, block_tables, query_starts, context_lens)
    return extend_planned(q, k_pool, v_pool, plan_extend(query_starts, context_lens, block_tables, k_pool.shape[2]))


def extend_planned(q, k_pool, v_pool, plan: ExtendPlan):
    """extend_attention_numba with the plan made already (once per model step, for all its layers)."""
    n_rows, n_heads, d = q.shape
    n_kv = k_pool.shape[2]
    (k_flat, k_stride), (v_flat, v_stride) = flat_pool(k_pool), flat_pool(v_pool)
    q_scaled = np.ascontiguousarray(q, np.float32) * np.float32(1 / math.sqrt(d))
    out = np.empty((n_rows, n_heads, d), np.float32)
    with single_threaded_blas():
        _extend_tiles_for(d)(q_scaled, k_flat, v_flat, k_stride, v_stride, k_pool.shape[1], n_kv, plan.tables,
                             plan.row_seq, plan.row_pos, plan.work, min(numba.get_num_threads(), len(plan.work)), out)
    return out


def extend_attention_torch(q, k_pool, v_pool, block_tables, query_starts, context_lens):
    """torch. On a CUDA GPU: extend_attention_triton's kernel, which reads the pool in place
    through the block tables. Elsewhere: gather each sequence's keys and values, then
    scaled_dot_product_attention with a causal mask offset by the prefix. numpy in, numpy out
    (on the backend's device); or tensors in, tensors out."""
    import torch

    as_numpy = isinstance(q, np.ndarray)
    if as_numpy:
        _check(q, k_pool, v_pool, block_tables, query_starts, context_lens)
        device = backends.torch_device()
        q, k_pool, v_pool = (torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in (q, k_pool, v_pool))
    block_tables, query_starts, context_lens = (
        x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x), device=q.device)
        for x in (block_tables, query_starts, context_lens))
    if paged_attention.uses_triton(q.device):
        from infra_lab.kernels.extend_attention_triton import extend_attention_triton

        out = extend_attention_triton(q, k_pool, v_pool, block_tables, query_starts, context_lens)
    else:
        out = gather_then_sdpa(q, k_pool, v_pool, block_tables, query_starts, context_lens)
    return out.cpu().numpy() if as_numpy else out


def gather_then_sdpa(q, k_pool, v_pool, block_tables, query_starts, context_lens):
    """torch tensors on one device, one sequence at a time: copy its blocks into contiguous K and
    V, then scaled_dot_product_attention, query i seeing keys up to its position."""
    import torch
    import torch.nn.functional as F

    n_heads, d = q.shape[1:]
    n_kv, block_size = k_pool.shape[2], k_pool.shape[1]
    group = n_heads // n_kv
    out = torch.empty_like(q)
    starts, context = query_starts.tolist(), context_lens.tolist()
    for b, length in enumerate(context):
        first, end = starts[b], starts[b + 1]
        table = block_tables[b, : -(-length // block_size)]
        keys = k_pool[table].reshape(-1, n_kv, d)[:length].permute(1, 0, 2)  # (K, ctx, D)
        values = v_pool[table].reshape(-1, n_kv, d)[:length].permute(1, 0, 2)
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        where = torch.arange(length - (end - first), length, device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] <= where[:, None]  # (n, ctx)
        out[first:end] = F.scaled_dot_product_attention(
            q[first:end].permute(1, 0, 2), keys, values, attn_mask=visible).permute(1, 0, 2)
    return out


FACES = {"numpy": extend_attention_numpy, "numba": extend_attention_numba, "torch": extend_attention_torch}


def extend_attention(q, k_pool, v_pool, block_tables, query_starts, context_lens,
                     backend: backends.Backend | None = None):
    """Extend attention on the current backend (or the one given)."""
    return backends.pick(FACES, backend)(q, k_pool, v_pool, block_tables, query_starts, context_lens)
