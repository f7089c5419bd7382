"""Extend attention on a GPU, written in Triton: the torch face's kernel for CUDA tensors.

One program takes BLOCK_M query rows of one sequence and one query head. It walks the keys the
rows can see, BLOCK_N tokens at a time, loading each through the block table straight from the
pool (no gathered copy), scores them with a tensor-core dot, masks the future, and folds them
into an online softmax (chapter 02), as FlashAttention does for a contiguous prompt (Dao et al.,
2022) and SGLang's extend kernel does for a paged one.

Without a GPU it runs under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported),
which is how the tests check it on CPU.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from infra_lab.kernels.attention import LOG2_E
from infra_lab.kernels.paged_shapes import check_extend_shapes


@triton.jit
def _extend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, context_ptr,
                   q_stride_n, q_stride_h, out_stride_n, out_stride_h,
                   pool_stride_block, pool_stride_slot, pool_stride_head, table_stride_b, scale_log2,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PRECISION: tl.constexpr):
    b, tile, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first_row = tl.load(starts_ptr + b).to(tl.int32)
    n_queries = tl.load(starts_ptr + b + 1).to(tl.int32) - first_row
    context = tl.load(context_ptr + b).to(tl.int32)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) within the sequence's chunk
    real_rows = rows < n_queries
    where = context - n_queries + rows  # each row's position: it sees keys 0 .. where
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < D
    q = tl.load(q_ptr + (first_row + rows)[:, None] * q_stride_n + h * q_stride_h + dims[None, :],
                mask=real_rows[:, None] & dim_ok[None, :], other=0.0)
    q = (q.to(tl.float32) * scale_log2).to(q_ptr.dtype.element_ty)  # scores in log2 units, for exp2
    head_offset = (h // GROUP) * pool_stride_head  # this query head's KV head (GQA)
    peak = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each row's scores
    weight = tl.zeros([BLOCK_M], tl.float32)  # running sum of 2^(score - peak)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # keys the tile's last real row sees; none when the tile lies past the chunk's end
    seen = tl.where(tile * BLOCK_M < n_queries, tl.minimum(context, context - n_queries + (tile + 1) * BLOCK_M), 0)
    for start in range(0, seen, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        real_tokens = tokens < seen
        blocks = tl.load(tables_ptr + b * table_stride_b + tokens // BLOCK_SIZE, mask=real_tokens, other=0)
        offsets = blocks.to(tl.int64) * pool_stride_block + (tokens % BLOCK_SIZE) * pool_stride_slot + head_offset
        both = real_tokens[:, None] & dim_ok[None, :]
        keys = tl.load(k_ptr + offsets[:, None] + dims[None, :], mask=both, other=0.0)  # (BLOCK_N, D_PAD)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        visible = real_tokens[None, :] & (tokens[None, :] <= where[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(scores, axis=1))
        safe_peak = tl.where(new_peak == float("-inf"), 0.0, new_peak)  # rows that see nothing yet
        shrink = tl.exp2(peak - safe_peak)
        weights = tl.exp2(scores - safe_peak[:, None])  # (BLOCK_M, BLOCK_N)
        values = tl.load(v_ptr + offsets[:, None] + dims[None, :], mask=both, other=0.0)
        acc = acc * shrink[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=PRECISION)
        weight = weight * shrink + tl.sum(weights, axis=1)
        peak = new_peak
    out = acc / tl.where(weight > 0, weight, 1.0)[:, None]
    tl.store(out_ptr + (first_row + rows)[:, None] * out_stride_n + h * out_stride_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=real_rows[:, None] & dim_ok[None, :])


def extend_attention_triton(q, k_pool, v_pool, block_tables, query_starts, context_lens, *,
                            block_m: int = 32, block_n: int = 32, num_warps: int = 4):
    """q (N, n_heads, d); k_pool, v_pool (num_blocks, block_size, n_kv_heads, d) with the same
    strides; block_tables (batch, max_blocks); query_starts (batch + 1,); context_lens (batch,).
    All torch tensors on one device; returns (N, n_heads, d) in q's dtype. Shapes are checked
    here, values where they are numpy (extend_attention.extend_attention_torch). float32 inputs
    are multiplied in full float32 ("ieee"), not TF32, so that tokens match the CPU faces."""
    check_extend_shapes(q, k_pool, v_pool, block_tables, query_starts, context_lens)
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tensor-core tiles); got {size}")
    n_rows, n_heads, d = q.shape
    block_size, n_kv = k_pool.shape[1], k_pool.shape[2]
    if k_pool.stride() != v_pool.stride() or k_pool.stride(3) != 1:
        k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    q = q.contiguous()
    out = torch.empty_like(q)
    batch = context_lens.shape[0]
    longest_chunk = int((query_starts[1:] - query_starts[:-1]).max())  # one small copy per step
    grid = (batch, triton.cdiv(longest_chunk, block_m), n_heads)
    _extend_kernel[grid](
        q, k_pool, v_pool, out, block_tables, query_starts, context_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_tables.stride(0), LOG2_E / math.sqrt(d),
        GROUP=n_heads // n_kv, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, D=d,
        D_PAD=max(16, triton.next_power_of_2(d)), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps)
    return out
