"""The paged KV cache: fixed-size blocks from one pool, a block table per sequence, shared blocks
with reference counts, and copy-on-write (Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP 2023).

Layout: K and V are each (n_layers, num_blocks, block_size, n_kv_heads, head_dim). Sequence s
keeps its token t at block `tables[s][t // block_size]`, slot `t % block_size`. With prefix
sharing on, a full block is known by the hash of its tokens chained with its prefix's hash, as in
vLLM's automatic prefix caching: a new sequence whose prompt starts with cached blocks takes them
instead of computing them, and a freed block stays cached until the pool needs it back.
"""
from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np


class OutOfBlocks(RuntimeError):
    """The pool cannot supply the blocks asked for; nothing was allocated."""


class BlockAllocator:
    """Physical blocks with reference counts. A block is free, cached (free, but holding a
    known prefix until it is needed), or referenced by one or more block tables."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the pool needs at least one block; got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks
        self.cached: OrderedDict[int, int] = OrderedDict()  # block -> hash, least recently freed first
        self.evicted: list[int] = []  # hashes dropped by the last allocate, for the cache's index

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.cached)

    def allocate(self, n: int = 1) -> list[int]:
        """n blocks with reference count 1: free ones first, then the least recently freed
        cached ones. All or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks but only {self.num_free} of {self.num_blocks} are free")
        blocks, self.evicted = [], []
        for _ in range(n):
            if self.free_ids:
                block = self.free_ids.popleft()
            else:
                block, old_hash = self.cached.popitem(last=False)
                self.evicted.append(old_hash)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is not allocated; share only live blocks")
        self.ref_counts[block] += 1

    def revive(self, block: int) -> None:
        """Take a cached block back into use (a prefix hit on a freed block)."""
        if block not in self.cached:
            raise ValueError(f"block {block} is not cached")
        del self.cached[block]
        self.ref_counts[block] = 1

    def free(self, block: int, keep_as: int | None = None) -> None:
        """Drop one reference; at zero the block is free again, or cached under hash `keep_as`."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is outside the pool of {self.num_blocks}")
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is already free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if keep_as is None:
                self.free_ids.append(block)
            else:
                self.cached[block] = keep_as


class PagedKVCache:
    """Many sequences' K and V in one pool of blocks."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 prefix_sharing: bool = False, dtype=np.float32, zeros=None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        if min(n_layers, n_kv_heads, head_dim) < 1:
            raise ValueError(f"n_layers, n_kv_heads and head_dim must be >= 1; got {n_layers}, {n_kv_heads}, {head_dim}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        # a block's K rows, then its V rows: one contiguous stretch per block for the decode kernel
        shape = (n_layers, num_blocks, 2, block_size, n_kv_heads, head_dim)
        make = zeros or (lambda size: np.zeros(size, dtype))  # a torch factory puts the pool on a GPU
        self.kv = make(shape)
        self.k, self.v = self.kv[:, :, 0], self.kv[:, :, 1]  # views: (layers, blocks, block_size, kv_heads, d)
        self.prefix_sharing = prefix_sharing
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        self.hash_to_block: dict[int, int] = {}
        self.block_hash: dict[int, int] = {}
        self._next_id = 0

    # ---- sequences -----------------------------------------------------------------------

    def _live(self, seq: int) -> None:
        if seq not in self.tables:
            raise KeyError(f"sequence {seq} is not live (never created, or freed); live: {sorted(self.tables)}")

    def new_sequence(self) -> int:
        seq, self._next_id = self._next_id, self._next_id + 1
        self.tables[seq], self.lengths[seq], self.tokens[seq] = [], 0, []
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of `seq` (parallel sampling, beam search)."""
        self._live(seq)
        child = self.new_sequence()
        for block in self.tables[seq]:
            self.allocator.incref(block)
        self.tables[child] = list(self.tables[seq])
        self.lengths[child], self.tokens[child] = self.lengths[seq], list(self.tokens[seq])
        return child

    def free(self, seq: int) -> None:
        """Return the sequence's blocks; shared ones stay with their other owners."""
        self._live(seq)
        for block in self.tables.pop(seq):
            keep = self.block_hash.get(block) if self.prefix_sharing else None
            self.allocator.free(block, keep_as=keep)
            if self.allocator.ref_counts[block] == 0 and keep is None:
                self._forget(block)
        del self.lengths[seq], self.tokens[seq]

    def _forget(self, block: int) -> None:
        old = self.block_hash.pop(block, None)
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]

    # ---- room for new tokens -----------------------------------------------------------------

    def blocks_needed(self, seq: int, n_new: int) -> int:
        """Blocks `reserve(seq, n_new)` would take from the pool, copy-on-write included."""
        self._live(seq)
        length, table = self.lengths[seq], self.tables[seq]
        fresh = -(-(length + n_new) // self.block_size) - len(table)
        shared_tail = length % self.block_size and n_new > 0 and self.allocator.ref_counts[table[-1]] > 1
        return max(fresh, 0) + (1 if shared_tail else 0)

    def reserve(self, seq: int, n_new: int) -> None:
        """Make room for `n_new` more tokens: new blocks, and a private copy of a shared last
        block that the tokens would write into. Raises OutOfBlocks and changes nothing if the
        pool is short."""
        if n_new < 0:
            raise ValueError(f"cannot reserve {n_new} tokens")
        needed = self.blocks_needed(seq, n_new)
        blocks = self.allocator.allocate(needed)
        for old_hash in self.allocator.evicted:
            self._forget(self.hash_to_block.get(old_hash, -1))
        table, length = self.tables[seq], self.lengths[seq]
        if length % self.block_size and n_new > 0 and self.allocator.ref_counts[table[-1]] > 1:
            private = blocks.pop()  # copy-on-write
            self.kv[:, private] = self.kv[:, table[-1]]  # K and V in one copy
            self.allocator.free(table[-1])
            table[-1] = private
        table.extend(blocks)

    def write(self, seq: int, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store keys and values (T, n_kv_heads, head_dim) for the next T positions."""
        table, start = self.tables[seq], self.lengths[seq]
        for offset in range(k.shape[0]):
            block, slot = divmod(start + offset, self.block_size)
            self.k[layer, table[block], slot] = k[offset]
            self.v[layer, table[block], slot] = v[offset]

    def commit(self, seq: int, tokens) -> None:
        """The positions just written now hold `tokens`; full blocks get their prefix hash."""
        before = self.lengths[seq]
        self.tokens[seq].extend(int(t) for t in tokens)
        self.lengths[seq] = before + len(tokens)
        if self.prefix_sharing:
            for index in range(before // self.block_size, self.lengths[seq] // self.block_size):
                self._register(seq, index)

    def _chain_hash(self, seq: int, index: int) -> int:
        tokens = self.tokens[seq]
        running = 0
        for i in range(index + 1):
            running = hash((running, tuple(tokens[i * self.block_size:(i + 1) * self.block_size])))
        return running

    def _register(self, seq: int, index: int) -> None:
        block = self.tables[seq][index]
        digest = self._chain_hash(seq, index)
        if block not in self.block_hash and digest not in self.hash_to_block:
            self.block_hash[block], self.hash_to_block[digest] = digest, block

    def match_prefix(self, seq: int, tokens) -> int:
        """For a new, empty sequence: take the cached full blocks that its first tokens match;
        return how many tokens they cover (the caller computes only the rest)."""
        self._live(seq)
        if self.lengths[seq]:
            raise ValueError(f"sequence {seq} already holds {self.lengths[seq]} tokens; match a prefix first")
        if not self.prefix_sharing:
            return 0
        tokens = [int(t) for t in tokens]
        running, matched = 0, 0
        while (matched + 1) * self.block_size <= len(tokens) - 1:  # keep one token to compute logits from
            chunk = tuple(tokens[matched * self.block_size:(matched + 1) * self.block_size])
            running = hash((running, chunk))
            block = self.hash_to_block.get(running)
            if block is None:
                break
            if self.allocator.ref_counts[block] == 0:
                self.allocator.revive(block)
            else:
                self.allocator.incref(block)
            self.tables[seq].append(block)
            matched += 1
        self.lengths[seq] = matched * self.block_size
        self.tokens[seq] = tokens[: self.lengths[seq]]
        return self.lengths[seq]

    # ---- reading -----------------------------------------------------------------------------

    def gather(self, seq: int, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `length` positions of K and V, contiguous: (length, n_kv_heads, head_dim)."""
        table = list(self.tables[seq][: -(-length // self.block_size)])
        shape = (-1,) + tuple(self.k.shape[3:])
        return self.k[layer, table].reshape(shape)[:length], self.v[layer, table].reshape(shape)[:length]

    def block_table_array(self, seqs: list[int]) -> np.ndarray:
        """(len(seqs), max blocks) int64, padded with -1."""
        width = max((len(self.tables[s]) for s in seqs), default=0)
        out = np.full((len(seqs), max(width, 1)), -1, np.int64)
        for row, seq in enumerate(seqs):
            out[row, : len(self.tables[seq])] = self.tables[seq]
        return out

    def view(self, seq: int) -> SequenceView:
        self._live(seq)
        return SequenceView(self, seq)

    @property
    def bytes_per_block(self) -> int:
        return self.kv[:, 0].nbytes  # K and V; numpy arrays and torch tensors both have nbytes


class SequenceView:
    """One sequence of a PagedKVCache, seen through the model's KV-cache interface."""

    def __init__(self, cache: PagedKVCache, seq: int):
        self.cache, self.seq = cache, seq
        self._pending = 0

    @property
    def length(self) -> int:
        return self.cache.lengths[self.seq]

    def append(self, layer: int, k, v) -> None:
        if layer == 0:  # the first layer of a step makes room for all of them, or fails cleanly
            self.cache.reserve(self.seq, k.shape[0])
            self._pending = k.shape[0]
        self.cache.write(self.seq, layer, k, v)

    def keys(self, layer: int):
        return self.cache.gather(self.seq, layer, self.length + self._pending)[0]

    def values(self, layer: int):
        return self.cache.gather(self.seq, layer, self.length + self._pending)[1]

    def attend_decode(self, layer: int, q, backend=None):
        """Attention of this step's one query (1, H, Dh) over the sequence, through its block
        table: the paged kernel, without gathering the cache first."""
        from infra_lab.kernels import paged_attention

        table = self.cache.block_table_array([self.seq])
        return paged_attention.paged_decode(q, self.cache.k[layer], self.cache.v[layer], table,
                                            np.array([self.length + self._pending]), backend)

    def advance(self, steps: int, tokens=None) -> None:
        if tokens is None:
            if self.cache.prefix_sharing:
                raise ValueError("prefix sharing hashes the tokens: advance(steps, tokens) needs the token ids")
            tokens = [-1] * steps  # positions only; nothing will be hashed
        self.cache.commit(self.seq, tokens)
        self._pending = 0
