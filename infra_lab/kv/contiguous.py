"""The contiguous KV cache: one sequence's keys and values in one preallocated stretch of
`max_len` tokens. It is the paged pool's simplest case, one block as long as the sequence may
grow, so that the model reads it through the same kernels as any other cache.
"""
from __future__ import annotations

import numpy as np

from infra_lab.kv.paged import PagedKVCache, SequenceView


class ContiguousKVCache(SequenceView):
    """(n_layers, 1 block, 2, max_len, n_kv_heads, head_dim) of K and V, for one sequence.
    `zeros` makes the buffer: numpy's by default, or a torch factory for the GPU path."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, zeros=None,
                 dtype=np.float32):
        if min(n_layers, n_kv_heads, head_dim, max_len) < 1:
            raise ValueError(f"cache sizes must be >= 1; got n_layers={n_layers}, n_kv_heads="
                             f"{n_kv_heads}, head_dim={head_dim}, max_len={max_len}")
        pool = PagedKVCache(n_layers, n_kv_heads, head_dim, num_blocks=1, block_size=max_len, dtype=dtype,
                            zeros=zeros)
        super().__init__(pool, pool.new_sequence())
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        """Bytes reserved for K and V."""
        return self.cache.bytes_per_block
