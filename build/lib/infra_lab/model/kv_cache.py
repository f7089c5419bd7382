"""The KV cache: each layer's keys and values for every token seen so far.

A forward step over T new tokens calls `append(layer, k, v)` once per layer, reads the whole
history back with `keys(layer)` and `values(layer)`, and ends with `advance(T)`. Anything with
these methods can be the model's cache: the paged and radix caches of later chapters are.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class KVCache(Protocol):
    length: int  # tokens committed

    def append(self, layer: int, k, v) -> None: ...  # k, v: (T, n_kv_heads, head_dim)

    def keys(self, layer: int): ...  # (length + T, n_kv_heads, head_dim) during a step

    def values(self, layer: int): ...

    def advance(self, steps: int, tokens=None) -> None: ...  # tokens: ids of the positions just written


class ContiguousKVCache:
    """One preallocated (n_layers, max_len, n_kv_heads, head_dim) buffer each for K and V.
    `zeros` makes the buffers: numpy's by default, or a torch factory for the GPU path."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 zeros=None, dtype=np.float32):
        if min(n_layers, n_kv_heads, head_dim, max_len) < 1:
            raise ValueError(f"cache sizes must be >= 1; got n_layers={n_layers}, n_kv_heads="
                             f"{n_kv_heads}, head_dim={head_dim}, max_len={max_len}")
        shape = (n_layers, max_len, n_kv_heads, head_dim)
        self.k = zeros(shape) if zeros else np.zeros(shape, dtype)
        self.v = zeros(shape) if zeros else np.zeros(shape, dtype)
        self.max_len = max_len
        self.length = 0
        self._pending = 0

    @property
    def nbytes(self) -> int:
        """Bytes reserved for K and V."""
        return 2 * self.k.numel() * self.k.element_size() if hasattr(self.k, "numel") else self.k.nbytes + self.v.nbytes

    def append(self, layer: int, k, v) -> None:
        steps = k.shape[0]
        if self.length + steps > self.max_len:
            raise ValueError(f"KV cache full: {self.length} cached + {steps} new > max_len {self.max_len}")
        self.k[layer, self.length:self.length + steps] = k
        self.v[layer, self.length:self.length + steps] = v
        self._pending = steps

    def keys(self, layer: int):
        return self.k[layer, : self.length + self._pending]

    def values(self, layer: int):
        return self.v[layer, : self.length + self._pending]

    def advance(self, steps: int, tokens=None) -> None:
        self.length += steps
        self._pending = 0
