"""Paged decode attention: one query per sequence, reading K and V through block tables.

k_pool, v_pool: (num_blocks, block_size, n_kv_heads, head_dim), one layer of a PagedKVCache (views
of one array that keeps each block's K beside its V) or two arrays; block_tables: (batch,
max_blocks) int, -1 past the end; lengths: (batch,). Sequence b's token t sits in block
block_tables[b, t // block_size] at slot t % block_size (PagedAttention: Kwon et al., SOSP 2023).
The numba kernel reads the pool in address order rather than sequence by sequence: it folds
each block into the online softmax (chapter 02) of the sequence that owns it, so the hardware
prefetchers see one stream per thread, and merges the threads' softmaxes at the end. torch on
a CUDA GPU runs a Triton kernel that reads through the tables (paged_attention_triton); torch
elsewhere gathers the blocks into a contiguous copy first.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numba
import numpy as np

from infra_lab import backend as backends
from infra_lab.kernels.attention import LN_2, LOG2_E
from infra_lab.kernels.attention_decode import decode_attention_numpy
from infra_lab.kernels.paged_shapes import blocks_in_use, check_decode_shapes, check_tables


def _check(q, k_pool, v_pool, block_tables, lengths) -> None:
    tables, lengths = np.asarray(block_tables), np.asarray(lengths)
    check_decode_shapes(q, k_pool, v_pool, tables, lengths)
    check_tables(tables, lengths, k_pool.shape[0], k_pool.shape[1])


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


def flat_pool(pool) -> tuple[np.ndarray, int]:
    """pool (num_blocks, block_size, n_kv_heads, d) as a flat 1-D view that starts at its first
    value, and the distance from one block to the next, in values. Blocks may sit apart, as in
    PagedKVCache, which keeps a block's K and V side by side. The rows within a block must be
    contiguous; if they are not, this returns a contiguous copy."""
    pool = np.asarray(pool)
    if pool.ndim != 4 or len(pool) == 0:
        raise ValueError(f"need a pool (num_blocks >= 1, block_size, n_kv_heads, d); got shape {pool.shape}")
    _, block_size, n_kv, d = pool.shape
    block_values, item = block_size * n_kv * d, pool.itemsize
    stride = pool.strides[0]
    if pool.strides[1:] != (n_kv * d * item, d * item, item) or stride % item or stride < block_values * item:
        pool = np.ascontiguousarray(pool)  # rows within a block apart: copy
        stride = block_values * item
    span = (len(pool) - 1) * (stride // item) + block_values
    root = pool
    while isinstance(root.base, np.ndarray):  # the array that owns the memory, when it is contiguous
        root = root.base
    if root is not pool and root.flags.c_contiguous and root.dtype == pool.dtype:
        start = (pool.__array_interface__["data"][0] - root.__array_interface__["data"][0]) // item
        flat = root.reshape(-1)[start:start + span]  # a plain view: cheaper than as_strided (the engine
        # makes one per layer per step)
    else:
        flat = np.lib.stride_tricks.as_strided(pool, (span,), (item,))
    flat = flat.view()
    flat.flags.writeable = False
    return flat, stride // item


def address_order(block_tables, lengths, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every block in use, as (physical block, sequence, logical block) sorted by physical block:
    the order in which the kernel reads the pool. A shared block appears once per sequence that
    holds it, one after another, so the kernel reads it from memory once and then from cache."""
    tables, lengths = np.asarray(block_tables, np.int64), np.asarray(lengths, np.int64)
    if tables.ndim != 2 or lengths.shape != (len(tables),) or block_size < 1:
        raise ValueError(f"need block_tables (batch, max_blocks), lengths (batch,) and block_size >= 1; "
                         f"got {tables.shape}, {lengths.shape} and {block_size}")
    seqs, logicals = np.nonzero(blocks_in_use(tables, lengths, block_size))
    blocks = tables[seqs, logicals]
    order = np.argsort(blocks, kind="stable")
    return blocks[order], seqs[order], logicals[order]


@functools.cache
def _paged_chunks_for(head_dim: int):
    """The kernel below with head_dim fixed when numba compiles it, so LLVM turns each loop over
    d into whole vector instructions. One compile per head_dim, cached on disk like the rest."""

    @numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def paged_chunks(q_scaled, k_flat, v_flat, k_stride, v_stride, block_size, n_kv, blocks, seqs, logicals,
                     lengths, bounds, top, total, acc):
        # k_flat, v_flat: flat pools; in block n, (slot, KV head g) starts at n * stride + (slot * n_kv + g) * d.
        # Chunk c reads entries bounds[c]:bounds[c + 1] of the address-ordered (blocks, seqs, logicals)
        # and leaves a running softmax per (sequence, head) in top[c], total[c], acc[c].
        batch, n_heads = q_scaled.shape[:2]
        d = head_dim  # a compile-time constant
        row_values = n_kv * d  # one position's row of a block: every KV head
        group = n_heads // n_kv
        for c in numba.prange(len(bounds) - 1):
            queries = q_scaled.copy()  # (batch, n_heads, d): this thread's own copy
            peaks = np.full((batch, n_heads), -np.inf, np.float32)  # running max of the scores
            weights = np.zeros((batch, n_heads), np.float32)  # running sum of exp(score - peak)
            outs = np.zeros((batch, n_heads, d), np.float32)  # running sum of exp(score - peak) * value
            scores = np.empty((n_heads, block_size), np.float32)  # one block's scores, then weights
            bits = np.empty(block_size, np.int32)  # scratch: the float bits of 2^n
            block_peak = np.empty(n_heads, np.float32)  # this block's highest score, per head
            for entry in range(bounds[c], bounds[c + 1]):
                block, b = blocks[entry], seqs[entry]
                rows = min(block_size, lengths[b] - logicals[entry] * block_size)
                query, peak, weight, out = queries[b], peaks[b], weights[b], outs[b]
                block_peak[:] = -np.inf
                for slot in range(rows):
                    for g in range(n_kv):
                        start = block * k_stride + (slot * n_kv + g) * d
                        key = k_flat[start: start + d]
                        for h in range(g * group, (g + 1) * group):
                            s = np.float32(0.0)
                            for i in range(d):
                                s += query[h, i] * key[i]
                            scores[h, slot] = s
                            block_peak[h] = max(block_peak[h], s)
                for h in range(n_heads):  # online softmax (chapter 02): fold this block into b's running sums
                    if block_peak[h] > peak[h]:  # rescale only when the max grows, rare after the first blocks
                        shrink = np.float32(math.exp(peak[h] - block_peak[h]))  # 0 for b's first block
                        peak[h] = block_peak[h]
                        weight[h] *= shrink
                        for i in range(d):
                            out[h, i] *= shrink
                    top_so_far = peak[h]
                    row = scores[h]
                    # exp(score - peak) the way chapter 02's _exp_nonpositive vectorizes it, written out here:
                    # calling that on each 16-score row measured 15% slower with the data in cache, and
                    # an inlined helper that returns both parts 2 to 4% slower from DRAM
                    for slot in range(rows):
                        t = max((row[slot] - top_so_far) * LOG2_E, -126.0)
                        n = np.floor(t + 0.5)
                        u = (t - n) * LN_2
                        row[slot] = 1 + u * (1 + u * (0.5 + u * (1 / 6 + u * (1 / 24 + u * (1 / 120 + u * (1 / 720))))))
                        bits[slot] = (np.int32(n) + 127) << 23
                    twos = bits.view(np.float32)  # 2^n
                    block_weight = np.float32(0.0)
                    for slot in range(rows):
                        row[slot] *= twos[slot]
                        block_weight += row[slot]
                    weight[h] += block_weight
                for slot in range(rows):
                    for g in range(n_kv):
                        start = block * v_stride + (slot * n_kv + g) * d
                        value = v_flat[start: start + d]
                        for h in range(g * group, (g + 1) * group):
                            p = scores[h, slot]
                            for i in range(d):
                                out[h, i] += p * value[i]
            top[c] = peaks
            total[c] = weights
            acc[c] = outs

    return paged_chunks


@dataclass(frozen=True)
class DecodePlan:
    """Which thread reads which blocks, for one step's tables: the same for every layer."""
    blocks: np.ndarray  # (entries,) physical blocks in use, in address order
    seqs: np.ndarray  # (entries,) the sequence holding each
    logicals: np.ndarray  # (entries,) its place in that sequence
    bounds: np.ndarray  # (n_chunks + 1,) thread c reads entries bounds[c]:bounds[c + 1]
    lengths: np.ndarray  # (batch,) int64


def plan_decode(block_tables, lengths, block_size: int) -> DecodePlan:
    """Equal shares of the blocks in use, in address order (see address_order), one per thread."""
    lengths = np.asarray(lengths, np.int64)
    blocks, seqs, logicals = address_order(block_tables, lengths, block_size)
    bounds = np.linspace(0, len(blocks), numba.get_num_threads() + 1).astype(np.int64)
    return DecodePlan(blocks, seqs, logicals, bounds, lengths)


def paged_decode_numba(q, k_pool, v_pool, block_tables, lengths, checked: bool = False):
    """CPU, float32. The kernel reads the pool in address order (see address_order), not sequence
    by sequence: each thread takes one contiguous stretch of it, and folds each block into the
    running softmax of the sequence that owns it, so the hardware prefetchers see one stream per
    thread. The threads' softmaxes then merge, like flash-decoding's splits. Pools may be views
    whose blocks sit apart (see flat_pool); PagedKVCache keeps a block's K beside its V, so each
    block is one contiguous stretch. Each thread keeps batch x n_heads x (d + 2) floats of state.
    `checked=True` skips the checks (the model checks a step's metadata once)."""
    if not checked:
        _check(q, k_pool, v_pool, block_tables, lengths)
    return paged_decode_planned(q, k_pool, v_pool, plan_decode(block_tables, lengths, k_pool.shape[1]))


def paged_decode_planned(q, k_pool, v_pool, plan: DecodePlan):
    """paged_decode_numba with the plan made already (once per model step, for all its layers)."""
    batch, n_heads, d = q.shape
    block_size, n_kv = k_pool.shape[1], k_pool.shape[2]
    n_chunks = len(plan.bounds) - 1
    top = np.empty((n_chunks, batch, n_heads), np.float32)  # -inf where a chunk holds none of a sequence
    total = np.empty((n_chunks, batch, n_heads), np.float32)
    acc = np.empty((n_chunks, batch, n_heads, d), np.float32)
    (k_flat, k_stride), (v_flat, v_stride) = flat_pool(k_pool), flat_pool(v_pool)
    q_scaled = np.ascontiguousarray(q, np.float32) * np.float32(1 / math.sqrt(d))
    _paged_chunks_for(d)(q_scaled, k_flat, v_flat, k_stride, v_stride, block_size, n_kv, plan.blocks, plan.seqs,
                         plan.logicals, plan.lengths, plan.bounds, top, total, acc)
    rescale = np.exp(top - top.max(axis=0))  # (n_chunks, batch, n_heads); 0 where a chunk saw none
    return ((rescale[..., None] * acc).sum(axis=0) / (rescale * total).sum(axis=0)[..., None]).astype(np.float32)


def uses_triton(device) -> bool:
    """Whether the torch face runs its Triton kernel on `device`: a CUDA GPU, with triton installed.
    (The tests reach the same route on a CPU, under Triton's interpreter, by patching this.)"""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401  (ships with torch's CUDA builds)
    except ImportError:
        return False
    return True


def paged_decode_torch(q, k_pool, v_pool, block_tables, lengths):
    """torch. On a CUDA GPU with triton: paged_attention_triton's kernel, which reads each row once
    through the block table. Elsewhere: gather the blocks into contiguous K and V, then
    scaled_dot_product_attention with a length mask. numpy in, numpy out (on the backend's
    device); or tensors in, tensors out."""
    import torch

    as_numpy = isinstance(q, np.ndarray)
    if as_numpy:
        _check(q, k_pool, v_pool, block_tables, lengths)
        device = backends.torch_device()
        q, k_pool, v_pool = (torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in (q, k_pool, v_pool))
    if not isinstance(block_tables, torch.Tensor):
        block_tables = torch.as_tensor(np.asarray(block_tables), device=q.device)
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(np.asarray(lengths), device=q.device)
    if uses_triton(q.device):
        from infra_lab.kernels.paged_attention_triton import paged_decode_triton

        out = paged_decode_triton(q, k_pool, v_pool, block_tables, lengths)
    else:
        out = gather_then_sdpa(q, k_pool, v_pool, block_tables, lengths)
    return out.cpu().numpy() if as_numpy else out


def gather_then_sdpa(q, k_pool, v_pool, block_tables, lengths):
    """torch tensors on one device: copy each sequence's blocks into contiguous K and V, then
    scaled_dot_product_attention with a length mask. It moves the cache three times (read, write
    the copy, read the copy); the benchmarks' peer."""
    import torch
    import torch.nn.functional as F

    batch, n_heads, d = q.shape
    n_kv = k_pool.shape[2]
    safe = block_tables.clamp(min=0)
    keys = k_pool[safe].reshape(batch, -1, n_kv, d).permute(0, 2, 1, 3)  # (B, K, max_len, D)
    values = v_pool[safe].reshape(batch, -1, n_kv, d).permute(0, 2, 1, 3)
    group = n_heads // n_kv
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    mask = torch.arange(keys.shape[2], device=q.device)[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask[:, None, None, :])[:, :, 0]


FACES = {"numpy": paged_decode_numpy, "numba": paged_decode_numba, "torch": paged_decode_torch}


def paged_decode(q, k_pool, v_pool, block_tables, lengths, backend: backends.Backend | None = None):
    """Paged decode attention on the current backend (or the one given)."""
    return backends.pick(FACES, backend)(q, k_pool, v_pool, block_tables, lengths)
