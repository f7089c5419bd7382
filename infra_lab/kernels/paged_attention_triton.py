"""Paged decode attention on a GPU, written in Triton: the torch face's kernel for CUDA tensors.

Gathering the blocks into a contiguous copy and calling scaled_dot_product_attention (the torch
face on CPU) moves the cache three times: read it, write the copy, read the copy. This kernel
reads each K and V row once, straight through the block table, the way vLLM's PagedAttention
does (Kwon et al., SOSP 2023). One Triton program takes one (sequence, query head, split of the
sequence) and folds TILE tokens at a time into an online softmax (chapter 02); a second kernel
merges the splits (flash-decoding), so that short batches still give every SM work.

Without a GPU it runs under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported),
which is how the tests check it on CPU.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from infra_lab.kernels.attention import LOG2_E
from infra_lab.kernels.paged_shapes import check_decode_shapes


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, acc_ptr, peak_ptr, weight_ptr,
                  q_stride_b, q_stride_h, pool_stride_block, pool_stride_slot, pool_stride_head, table_stride_b,
                  scale_log2, split_tokens, n_splits,
                  GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                  D: tl.constexpr, D_PAD: tl.constexpr):
    b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = split * split_tokens
    last = tl.minimum(first + split_tokens, tl.load(lengths_ptr + b).to(tl.int32))  # one past this split's last token
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < D
    query = tl.load(q_ptr + b * q_stride_b + h * q_stride_h + dims, mask=dim_ok, other=0.0)
    query = query.to(tl.float32) * scale_log2  # scores come out in log2 units, for exp2
    head_offset = (h // GROUP) * pool_stride_head  # this query head's KV head (GQA)
    peak = -float("inf")  # running max of the scores
    weight = 0.0  # running sum of 2^(score - peak)
    acc = tl.zeros([D_PAD], tl.float32)  # running sum of 2^(score - peak) * value
    for start in range(first, last, TILE):  # each tile holds at least one real token
        tokens = start + tl.arange(0, TILE)  # (TILE,)
        real = tokens < last
        blocks = tl.load(tables_ptr + b * table_stride_b + tokens // BLOCK_SIZE, mask=real, other=0)
        rows = blocks.to(tl.int64) * pool_stride_block + (tokens % BLOCK_SIZE) * pool_stride_slot + head_offset
        both = real[:, None] & dim_ok[None, :]
        keys = tl.load(k_ptr + rows[:, None] + dims[None, :], mask=both, other=0.0)  # (TILE, D_PAD)
        scores = tl.sum(keys.to(tl.float32) * query[None, :], axis=1)
        scores = tl.where(real, scores, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(scores, axis=0))
        shrink = tl.exp2(peak - new_peak)  # 0 on the first tile
        weights = tl.exp2(scores - new_peak)  # (TILE,)
        values = tl.load(v_ptr + rows[:, None] + dims[None, :], mask=both, other=0.0)
        acc = acc * shrink + tl.sum(weights[:, None] * values.to(tl.float32), axis=0)
        weight = weight * shrink + tl.sum(weights, axis=0)
        peak = new_peak
    slot = (b * tl.num_programs(1) + h) * n_splits + split  # acc: (batch, n_heads, n_splits, D_PAD)
    tl.store(acc_ptr + slot * D_PAD + dims, acc)
    tl.store(peak_ptr + slot, peak)  # -inf and 0 for a split past the sequence's end
    tl.store(weight_ptr + slot, weight)


@triton.jit
def _merge_kernel(acc_ptr, peak_ptr, weight_ptr, out_ptr, out_stride_b, out_stride_h, n_splits,
                  SPLITS_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D_PAD)
    used = splits < n_splits
    first_slot = (b * tl.num_programs(1) + h) * n_splits
    peaks = tl.load(peak_ptr + first_slot + splits, mask=used, other=float("-inf"))
    weights = tl.load(weight_ptr + first_slot + splits, mask=used, other=0.0)
    accs = tl.load(acc_ptr + (first_slot + splits[:, None]) * D_PAD + dims[None, :], mask=used[:, None], other=0.0)
    rescale = tl.exp2(peaks - tl.max(peaks, axis=0))  # split 0 always holds a token, so the max is finite
    out = tl.sum(rescale[:, None] * accs, axis=0) / tl.sum(rescale * weights, axis=0)
    tl.store(out_ptr + b * out_stride_b + h * out_stride_h + dims, out.to(out_ptr.dtype.element_ty), mask=dims < D)


def default_split_tokens(batch: int, n_heads: int, max_len: int, tile: int, device) -> int:
    """Tokens per split: enough splits for about 8 programs per SM (one if the device has none)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    wanted_splits = max(1, -(-8 * sms // (batch * n_heads)))
    return max(tile, -(-max_len // wanted_splits // tile) * tile)


def paged_decode_triton(q, k_pool, v_pool, block_tables, lengths, *, tile: int = 64,
                        split_tokens: int | None = None, num_warps: int = 4):
    """q (batch, n_heads, d); k_pool, v_pool (num_blocks, block_size, n_kv_heads, d) with the same
    strides (views of one cache, say); block_tables (batch, max_blocks); lengths (batch,), each >= 1.
    All torch tensors on one device. Returns (batch, n_heads, d) in q's dtype. Shapes are checked
    here; the tables' values are not, since that would copy them off the GPU on every call (the
    numpy-in path of paged_attention.paged_decode_torch checks them)."""
    check_decode_shapes(q, k_pool, v_pool, block_tables, lengths)
    batch, n_heads, d = q.shape
    block_size, n_kv = k_pool.shape[1], k_pool.shape[2]
    if k_pool.stride() != v_pool.stride() or k_pool.stride(3) != 1:
        k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    q = q.contiguous()
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two; got {tile}")
    max_len = block_tables.shape[1] * block_size
    split_tokens = split_tokens or default_split_tokens(batch, n_heads, max_len, tile, q.device)
    n_splits = -(-max_len // split_tokens)
    d_pad = triton.next_power_of_2(d)
    acc = torch.empty(batch, n_heads, n_splits, d_pad, device=q.device, dtype=torch.float32)
    peak = torch.empty(batch, n_heads, n_splits, device=q.device, dtype=torch.float32)
    weight = torch.empty_like(peak)
    _split_kernel[(batch, n_heads, n_splits)](
        q, k_pool, v_pool, block_tables, lengths, acc, peak, weight,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_tables.stride(0),
        LOG2_E / math.sqrt(d), split_tokens, n_splits,
        GROUP=n_heads // n_kv, BLOCK_SIZE=block_size, TILE=tile, D=d, D_PAD=d_pad, num_warps=num_warps)
    out = torch.empty_like(q)
    _merge_kernel[(batch, n_heads)](acc, peak, weight, out, out.stride(0), out.stride(1), n_splits,
                                    SPLITS_PAD=max(2, triton.next_power_of_2(n_splits)), D=d, D_PAD=d_pad)
    return out
