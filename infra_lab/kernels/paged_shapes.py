"""Shape checks shared by the paged kernels' faces (numba, numpy, torch and Triton).

They read shapes only, so numpy arrays and torch tensors on any device pass through without a
copy; the values of block tables are checked where they are numpy (`check_tables`).
"""
from __future__ import annotations

import numpy as np


def check_pool(q, k_pool, v_pool) -> None:
    """q (rows, n_heads, d) against pools (num_blocks, block_size, n_kv_heads, d)."""
    if len(q.shape) != 3 or len(k_pool.shape) != 4 or tuple(k_pool.shape) != tuple(v_pool.shape):
        raise ValueError(f"need q (rows, n_heads, d) and k_pool, v_pool (num_blocks, block_size, n_kv_heads, d); "
                         f"got q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}")
    n_heads, d = q.shape[1:]
    if k_pool.shape[3] != d or n_heads % k_pool.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k_pool {tuple(k_pool.shape)}: d must match and "
                         "n_heads must be a multiple of n_kv_heads")


def check_decode_shapes(q, k_pool, v_pool, block_tables, lengths) -> None:
    """Decode: one query row per sequence; block_tables (batch, max_blocks), lengths (batch,)."""
    check_pool(q, k_pool, v_pool)
    batch = q.shape[0]
    if len(block_tables.shape) != 2 or block_tables.shape[0] != batch or tuple(lengths.shape) != (batch,):
        raise ValueError(f"need block_tables (batch={batch}, max_blocks) and lengths ({batch},); "
                         f"got {tuple(block_tables.shape)} and {tuple(lengths.shape)}")


def check_extend_shapes(q, k_pool, v_pool, block_tables, query_starts, context_lens) -> None:
    """Extend: sequence b's query rows are q[query_starts[b]:query_starts[b + 1]]."""
    check_pool(q, k_pool, v_pool)
    batch = len(context_lens.shape) == 1 and context_lens.shape[0]
    if not batch or tuple(query_starts.shape) != (batch + 1,) or tuple(block_tables.shape[:1]) != (batch,) \
            or len(block_tables.shape) != 2:
        raise ValueError(f"need context_lens (batch,), query_starts (batch + 1,) and block_tables (batch, "
                         f"max_blocks) with batch >= 1; got {tuple(context_lens.shape)}, "
                         f"{tuple(query_starts.shape)} and {tuple(block_tables.shape)}")


def blocks_in_use(tables: np.ndarray, lengths: np.ndarray, block_size: int) -> np.ndarray:
    """(batch, max_blocks) bool: the table entries that hold a sequence's tokens."""
    return np.arange(tables.shape[1]) < -(-lengths[:, None] // block_size)


def check_tables(block_tables, lengths, num_blocks: int, block_size: int) -> None:
    """Every table entry a sequence of `lengths` tokens reads lies inside the pool."""
    tables, lengths = np.asarray(block_tables), np.asarray(lengths)
    if (lengths < 1).any() or (lengths > tables.shape[1] * block_size).any():
        raise ValueError(f"lengths must be in [1, {tables.shape[1] * block_size}]; got {lengths.tolist()}")
    used = blocks_in_use(tables, lengths, block_size)
    outside = used & ((tables < 0) | (tables >= num_blocks))
    if outside.any():
        b = int(outside.any(axis=1).argmax())
        raise ValueError(f"sequence {b}'s block table points outside the pool of {num_blocks}: "
                         f"{tables[b, used[b]].tolist()}")


def check_queries(query_starts, context_lens, rows: int) -> None:
    """query_starts start at 0, grow by at least one row per sequence and end at `rows`; each
    sequence holds at least as many tokens as it has queries."""
    starts, context = np.asarray(query_starts), np.asarray(context_lens)
    counts = np.diff(starts)
    if starts[0] != 0 or starts[-1] != rows or (counts < 1).any():
        raise ValueError(f"query_starts must rise from 0 to the {rows} query rows by at least 1 per "
                         f"sequence; got {starts.tolist()}")
    if (context < counts).any():
        b = int(np.argmax(context < counts))
        raise ValueError(f"sequence {b} has {counts[b]} queries but context_lens {context[b]}: the "
                         "context counts the new tokens too")


def positions(query_starts, context_lens) -> np.ndarray:
    """(N,) the position in its sequence of every query row: sequence b's rows sit at the last
    query_starts[b + 1] - query_starts[b] of its context_lens[b] positions."""
    starts, context = np.asarray(query_starts, np.int64), np.asarray(context_lens, np.int64)
    counts = np.diff(starts)
    first = np.repeat(context - counts, counts)  # each row's sequence's first new position
    return first + np.arange(starts[-1]) - np.repeat(starts[:-1], counts)
