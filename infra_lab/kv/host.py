"""Swap space: blocks in host memory that hold a preempted sequence's keys and values.

When the KV pool runs out, an engine can preempt a sequence by swapping: its blocks are copied
to a pool of the same block shape in host memory and freed, and copied back into fresh blocks
when the engine resumes it, so nothing is recomputed (Kwon et al., "Efficient Memory
Management for Large Language Model Serving with PagedAttention", SOSP 2023, Section 4.5).
On a GPU the copy crosses PCIe; on the CPU it is a memory copy between two arrays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infra_lab.kv.paged import BlockAllocator, PagedKVCache


@dataclass(frozen=True)
class SwappedSequence:
    host_blocks: tuple[int, ...]  # where its blocks wait, in table order
    tokens: tuple[int, ...]  # the tokens whose K and V they hold


class HostPool:
    """`num_blocks` blocks shaped like `pool`'s, in host memory, with their own allocator."""

    def __init__(self, pool: PagedKVCache, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a host pool needs at least one block; got {num_blocks}")
        if pool.prefix_sharing:
            raise ValueError("a pool that shares blocks by hash (prefix_sharing=True) cannot swap: a block it "
                             "caches may belong to no sequence; use a radix tree over the pool instead")
        self.pool = pool
        self.allocator = BlockAllocator(num_blocks)
        shape = (pool.kv.shape[0], num_blocks) + tuple(pool.kv.shape[2:])  # (L, NB_host, 2, bs, K, Dh)
        if isinstance(pool.kv, np.ndarray):
            self.kv = np.zeros(shape, pool.kv.dtype)
        else:  # a torch pool: host blocks on the CPU, pinned when a GPU can copy from them directly
            import torch

            pinned = pool.kv.device.type == "cuda"
            self.kv = torch.zeros(shape, dtype=pool.kv.dtype, pin_memory=pinned)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def blocks_of(self, seq: int) -> int:
        return len(self.pool.tables[seq])

    def swap_out(self, seq: int) -> SwappedSequence:
        """Copy `seq`'s blocks to host memory and free the sequence in the pool. Raises
        OutOfBlocks (kv.paged), changing nothing, when the host pool is short."""
        table = self.pool.tables[seq]
        host_blocks = self.allocator.allocate(len(table))  # OutOfBlocks before anything moves
        self.kv[:, self._index(host_blocks, self.kv)] = self._to_host(self.pool.kv[:, self._index(table, self.pool.kv)])
        swapped = SwappedSequence(tuple(host_blocks), tuple(self.pool.tokens[seq]))
        self.pool.free(seq)
        return swapped

    def swap_in(self, swapped: SwappedSequence) -> int:
        """A new sequence in the pool holding the swapped blocks' contents again; the host
        blocks are freed. Raises OutOfBlocks, changing nothing, when the pool is short."""
        n = len(swapped.host_blocks)
        blocks = self.pool.allocator.allocate(n)
        data = self.kv[:, self._index(swapped.host_blocks, self.kv)]
        self.pool.kv[:, self._index(blocks, self.pool.kv)] = data if isinstance(data, np.ndarray) else data.to(
            self.pool.kv.device, non_blocking=True)
        seq = self.pool.new_sequence()
        self.pool.attach_prefix(seq, blocks, swapped.tokens)  # takes a second reference to each block
        self.pool.release(blocks)  # ... so drop the one allocate took
        self.drop(swapped)
        return seq

    def drop(self, swapped: SwappedSequence) -> None:
        """Free the host blocks of a swapped sequence that will not come back (aborted)."""
        for block in swapped.host_blocks:
            self.allocator.free(block)

    def can_swap_in(self, swapped: SwappedSequence) -> bool:
        return len(swapped.host_blocks) <= self.pool.num_free

    @staticmethod
    def _index(blocks, like):
        if isinstance(like, np.ndarray):
            return np.asarray(blocks, np.int64)
        import torch

        return torch.as_tensor(list(blocks), dtype=torch.int64, device=like.device)

    def _to_host(self, data):
        return data if isinstance(data, np.ndarray) else data.to("cpu")

